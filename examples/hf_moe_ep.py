"""A transformers MoE model trained expert-parallel with FSDP2, then saved back as a transformers checkpoint.

    python examples/hf_moe_ep.py                                          # one process
    torchrun --nproc-per-node 4 examples/hf_moe_ep.py --dp 2 --ep 2       # 4 gloo processes on this machine

It builds a small random Qwen3-MoE (nothing is downloaded; ``--model DIR`` takes a real checkpoint folder
instead), converts its MoE blocks to mode layers (``mode.hf.to_mode_moe``), splits the experts over ``ep``
and shards everything over the whole ``dp x ep`` mesh (``mode.parallel.parallelize``), trains a few steps on
the built-in byte corpus (each rank its own rows of every global batch), saves a sharded checkpoint
(``mode.parallel.model_state``) halfway, writes the result as a transformers folder
(``mode.hf.save_transformers``), and reloads that folder with plain transformers to check the logits.

On 8 GPUs with a real checkpoint (docs/adopt_moe.md):
    torchrun --nproc-per-node 8 examples/hf_moe_ep.py --model /path/to/Qwen3-30B-A3B --dp 2 --ep 4 --bf16
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import mode.hf as mh
from mode.parallel import clip_grad_norm_
from mode.train.data import BatchSampler, stdlib_corpus


def small_qwen3_moe(seed: int = 0, vocab_size: int = 256):
    """A 2-layer Qwen3-MoE with 8 experts, top-2, random weights (the same on every rank)."""
    import transformers as tf

    cfg = tf.Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(cfg).float()


def train(
    model: nn.Module,
    batches,
    *,
    world_size: int = 1,
    row_rank: int = 0,
    lr: float = 1e-3,
    clip: float = 1.0,
    optimizer: torch.optim.Optimizer | None = None,
    first_step: int = 1,
    log=None,
) -> list[tuple[float, float]]:
    """Train on ``batches`` (global batches of (inputs, next-token targets)); returns (global mean loss,
    gradient norm) per step. With ``world_size > 1`` every rank of the model's mesh calls it (``row_rank``:
    its flat rank, which picks its rows of each batch)."""
    params = [p for p in model.parameters() if p.requires_grad]
    device = params[0].device
    optimizer = optimizer or torch.optim.AdamW(params, lr=lr, weight_decay=0.1)
    curve = []
    for step, (x_BS, y_BS) in enumerate(batches, first_step):
        t0 = time.perf_counter()
        b = x_BS.shape[0] // world_size
        rows = slice(row_rank * b, (row_rank + 1) * b)
        x_bS, y_bS = x_BS[rows].to(device), y_BS[rows].to(device)
        logits = model(input_ids=x_bS).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y_bS.flatten())
        aux = mh.collect_aux(model).total()  # our balance/z losses (0 unless to_mode_moe was given coefs)
        ((loss + aux) / world_size).backward()  # FSDP sums over the ranks: the global mean's gradient
        norm = clip_grad_norm_(params, clip)  # one norm per mesh, combined (also fine in one process)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = loss.detach().double()
        if world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(loss)
        curve.append((float(loss) / world_size, float(norm)))
        if log is not None:
            tok_s = x_BS.numel() / (time.perf_counter() - t0)
            log(f"step {step:3d}  loss {curve[-1][0]:.4f}  grad norm {curve[-1][1]:.4f}  {tok_s:,.0f} tokens/s")
    return curve


def make_batches(steps: int, batch: int, seq: int, seed: int, vocab_size: int, tokenizer=None):
    """Global batches from the built-in corpus: bytes (a random model of 256 ids), or the text tokenised."""
    corpus = stdlib_corpus(max_bytes=2_000_000)
    data = corpus.train
    if tokenizer is not None:
        import numpy as np

        data = np.asarray(tokenizer(bytes(data[:200_000]).decode("utf-8", "replace"))["input_ids"], dtype=np.int64)
    sampler = BatchSampler(data, batch, seq, seed=seed)
    return [tuple(t.long() % vocab_size for t in sampler.next()) for _ in range(steps)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a transformers checkpoint folder (default: a small random Qwen3-MoE)")
    p.add_argument("--dp", type=int)
    p.add_argument("--ep", type=int)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=8, help="global batch, split over the processes")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bf16", action="store_true", help="bfloat16 weights (a real checkpoint on GPUs)")
    p.add_argument("--out", default="runs/hf_moe_ep", help="where the checkpoint and the transformers folder go")
    args = p.parse_args()
    out = Path(args.out)

    world, rank, mesh, ctx = 1, 0, None, None
    if "WORLD_SIZE" in os.environ:  # started by torchrun
        from mode.parallel import ParallelDims, build_mesh, process_group as mdist

        torch.set_num_threads(1)
        ctx = mdist.init_distributed("auto")  # gloo on CPU, NCCL on GPUs; with a timeout
        world, rank = ctx.world_size, ctx.rank
        mesh = build_mesh(ParallelDims.for_world(world, args.dp, args.ep), ctx.device.type, ctx.timeout_s)
    say = print if rank == 0 else (lambda *a, **k: None)

    tokenizer = None
    if args.model:
        import transformers as tf

        model = tf.AutoModelForCausalLM.from_pretrained(
            args.model, dtype=torch.bfloat16 if args.bf16 else torch.float32
        )
        tokenizer = tf.AutoTokenizer.from_pretrained(args.model)
    else:
        model = small_qwen3_moe(args.seed)
    mh.to_mode_moe(model)  # in place: the MoE blocks are mode layers on the same tensors
    device = ctx.device if ctx is not None else torch.device("cpu")
    model.to(device)
    if mesh is not None:
        from mode.parallel import parallelize

        parallelize(model, mesh)
        say(
            f"{world} processes, mesh dp={mesh.size(0)} x ep={mesh.size(1)}; "
            f"{sum(p.to_local().numel() for p in model.parameters()):,} of "
            f"{sum(p.numel() for p in model.parameters()):,} parameters on rank 0"
        )
    from mode.parallel.model_state import load_state, save_state

    vocab = model.config.vocab_size
    batches = make_batches(args.steps, args.batch, args.seq, args.seed, vocab, tokenizer)
    params = [q for q in model.parameters() if q.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
    half = args.steps // 2
    kw = dict(world_size=world, row_rank=rank, optimizer=optimizer, log=say)
    curve = train(model, batches[:half], **kw)
    save_state(out / "ckpt", model, optimizer, extra={"step": half})
    step = load_state(out / "ckpt", model, optimizer)["step"]  # what a resumed run does (any layout)
    curve += train(model, batches[step:], first_step=step + 1, **kw)
    say(f"trained {len(curve)} steps: loss {curve[0][0]:.4f} -> {curve[-1][0]:.4f}")

    folder = mh.save_transformers(model, out / "transformers")
    x_BS = batches[0][0][:2].to(device)
    model.eval()
    with torch.no_grad():
        ours = model(input_ids=x_BS).logits.float().cpu()  # every rank: the same rows (FSDP + EP forward)
    if rank == 0:
        import transformers as tf

        plain = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            theirs = plain(input_ids=x_BS.cpu()).logits.float()
        diff = (ours - theirs).abs().max().item()
        say(f"saved {folder}; plain transformers reloads it ({type(plain).__name__}): max |logit diff| {diff:.2e}")
    if ctx is not None:
        from mode.parallel import process_group as mdist

        mdist.destroy()


if __name__ == "__main__":
    main()

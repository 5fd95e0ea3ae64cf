"""Pretrain a small byte-level Llama with transformers on the built-in corpus and save it as a local checkpoint.

    PYTHONPATH=. python examples/hf_pretrain.py --out runs/llama_bytes --threads 2   # ~13 min on 2 CPU cores
    PYTHONPATH=. python examples/hf_convert.py --model runs/llama_bytes --capacities 1 0.5 0.25 0.125

Nothing can be downloaded on the machines this project is built on, so ``examples/hf_convert.py`` had no
trained model to convert. This trains one: ``LlamaForCausalLM`` from transformers itself (not mode's LM),
the 256 byte values as its vocabulary, on the Python standard library's sources (``mode.train.data``), with
``mode.train``'s optimizer and schedule (AdamW, matrices decay; linear warm-up, cosine decay to a tenth),
then ``save_pretrained`` (safetensors). A trained model is what makes
the conversion's numbers mean something: a random model's loss is ln 256 whatever routes.

Needs the ``hf`` extra (``pip install -e '.[hf]'``). Shape legend: B batch, S sequence.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from mode.train.config import TrainConfig
from mode.train.data import BatchSampler, eval_batches, stdlib_corpus
from mode.train.optim import build_optimizer, lr_at


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder to save the checkpoint in (config + safetensors)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus-bytes", type=int, default=None, help="read at most this much of the corpus")
    args = p.parse_args(argv)
    from transformers import LlamaConfig, LlamaForCausalLM

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=args.hidden,
        intermediate_size=int(8 * args.hidden / 3) // 16 * 16,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=1024,
        attn_implementation="sdpa",
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg)
    corpus = stdlib_corpus(max_bytes=args.corpus_bytes)
    sampler = BatchSampler(corpus.train, args.batch, args.seq_len, args.seed)
    val = eval_batches(corpus.val, args.batch, args.seq_len, 8)
    train_cfg = TrainConfig(
        steps=args.steps, batch_size=args.batch, lr=args.lr, warmup_steps=max(1, args.steps // 20), seed=args.seed
    )
    opt = build_optimizer(model, train_cfg)

    def val_loss() -> float:
        model.eval()
        with torch.no_grad():
            losses = [F.cross_entropy(model(x_BS).logits.transpose(1, 2), y_BS).item() for x_BS, y_BS in val]
        model.train()
        return sum(losses) / len(losses)

    from tqdm import tqdm

    model.train()
    start = time.perf_counter()
    bar = tqdm(range(args.steps), desc="pretrain", unit="step")
    for step in bar:
        x_BS, y_BS = sampler.next()
        loss = F.cross_entropy(model(x_BS).logits.transpose(1, 2), y_BS)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, train_cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train_cfg.grad_clip)
        opt.step()
        if step % 10 == 0:
            tok_s = (step + 1) * args.batch * args.seq_len / (time.perf_counter() - start)
            bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{tok_s:,.0f}")
    final = val_loss()
    out = Path(args.out)
    model.save_pretrained(out)  # config.json + model.safetensors
    summary = {
        "params": sum(p.numel() for p in model.parameters()),
        "steps": args.steps,
        "tokens": args.steps * args.batch * args.seq_len,
        "val_loss": final,
        "wall_s": time.perf_counter() - start,
        "config": {k: getattr(args, k) for k in vars(args)},
    }
    (out / "pretrain.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"val loss {final:.4f} nats/byte after {args.steps} steps ({summary['params']:,} parameters); saved {out}")
    return summary


if __name__ == "__main__":
    main()

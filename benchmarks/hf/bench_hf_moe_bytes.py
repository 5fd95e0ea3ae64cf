"""Bytes on the wire per training step: a converted transformers MoE model on mode's expert parallelism
against transformers' own expert parallelism, the same model and global batch on 4 gloo ranks.

    PYTHONPATH=. python benchmarks/hf/bench_hf_moe_bytes.py                          # global batch 4 x 32
    PYTHONPATH=. python benchmarks/hf/bench_hf_moe_bytes.py --batch 16 --seq 128     # 2048 tokens per step

The model: a random Qwen3-MoE (hidden 64, 2 layers, 4 query and 4 K/V heads, 8 experts of hidden 32, top-2,
vocab 256); one training step (forward, backward, AdamW) after one warm-up step. Every collective a rank
calls is counted (``benchmarks/parallel/collective_bytes.py``: eager ``torch.distributed`` calls and the functional
collectives of DTensor), as the bytes that rank sends under the standard algorithms, by phase and kind; the
table sums the 4 ranks.

mode: ``to_mode_moe`` then ``parallelize`` at (dp, ep) = (1, 4) and (2, 2) (and (1, 4) with ``dedup``): the
four ranks are four data-parallel row groups, each holding a quarter of the batch; routed rows go to the
experts' ranks by all-to-all; every weight is sharded by FSDP2 (all-gathers in forward and backward,
reduce-scatters of the gradients: bytes that depend on the weights, not on the tokens).
transformers: ``from_pretrained(..., distributed_config=DistributedConfig(tp_size=4, ep_size=4))``, the
configuration its expert parallelism needs (ep_size == tp_size; ``from_pretrained`` with a distributed config
needs ``pip install accelerate``): every rank runs the whole batch, attention tensor-parallel (its
row-parallel output and the input gradients of q/k/v all-reduced over the full (tokens, hidden) activation),
the embedding vocab-parallel, the logits all-gathered, the experts split whole over the ranks with its own
all-to-all and an all-gather of the expert output. It needs the K/V head count divisible by tp_size (hence
4 K/V heads here; with 2 its first forward fails on the k_proj view). Without accelerate the transformers
row reports the failure and no ratio is printed.

Writes benchmarks/results/hf_moe_bytes_{batch}x{seq}.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere without installing
    sys.path.insert(0, str(ROOT))

from benchmarks.common import machine_info, print_table, write_json  # noqa: E402

WORLD = 4
BATCH, SEQ = 4, 32  # the global batch (--batch, --seq set them)
LAYOUTS = [("mode (1, 4)", 1, 4, False), ("mode (2, 2)", 2, 2, False), ("mode (1, 4) dedup", 1, 4, True)]
TRANSFORMERS = "transformers tp=ep=4"


def qwen3_config():
    import transformers as tf

    return tf.Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        attn_implementation="sdpa",
    )


def batch() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, 256, (BATCH, SEQ + 1), generator=g)


def _step(model, opt, ids_bS, counter=None, scale: float = 1.0 / WORLD):
    """One training step (forward, backward, AdamW) on these rows; the counter's phase follows it."""
    import torch.nn.functional as F

    if counter is not None:
        counter.phase = "forward"
    logits = model(input_ids=ids_bS[:, :-1]).logits
    loss = F.cross_entropy(logits.flatten(0, 1).float(), ids_bS[:, 1:].flatten())
    if counter is not None:
        counter.phase = "backward"
    (loss * scale).backward()
    if counter is not None:
        counter.phase = "optimizer"
    opt.step()
    opt.zero_grad(set_to_none=True)


def run_mode(rank: int, dp: int, ep: int, dedup: bool) -> dict:
    import transformers as tf

    import mode.hf as mh
    from benchmarks.parallel.collective_bytes import CollectiveBytes
    from mode.parallel import ParallelDims, build_mesh, parallelize

    torch.manual_seed(0)
    model = mh.to_mode_moe(tf.AutoModelForCausalLM.from_config(qwen3_config()).float())
    parallelize(model, build_mesh(ParallelDims(dp, ep), timeout_s=60), dedup=dedup)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    b = BATCH // WORLD
    rows = batch()[rank * b : (rank + 1) * b]
    _step(model, opt, rows)  # warm-up
    with CollectiveBytes() as counter:
        _step(model, opt, rows, counter)
    return counter.table()


def run_transformers(rank: int, tmp: str) -> dict:
    """transformers' own tensor + expert parallelism, tp = ep = 4: every rank runs the whole batch."""
    import torch.distributed as dist
    import transformers as tf
    from transformers.distributed import DistributedConfig

    from benchmarks.parallel.collective_bytes import CollectiveBytes

    folder = Path(tmp, "tf_model")
    if rank == 0:  # save_pretrained writes on the main process only
        torch.manual_seed(0)
        tf.AutoModelForCausalLM.from_config(qwen3_config()).float().save_pretrained(folder)
    dist.barrier()
    model = tf.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, distributed_config=DistributedConfig(tp_size=WORLD, ep_size=WORLD)
    )
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    rows = batch()  # tensor parallelism: the same (whole) batch on every rank
    _step(model, opt, rows, scale=1.0)  # warm-up
    with CollectiveBytes() as counter:
        _step(model, opt, rows, counter, scale=1.0)
    return counter.table()


def _worker(rank: int, store: str, out: str, batch_size: int, seq_len: int) -> None:
    import torch.distributed as dist

    global BATCH, SEQ
    BATCH, SEQ = batch_size, seq_len  # a spawned process starts from the module's defaults

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60)
    )
    res = {}
    for name, dp, ep, dedup in LAYOUTS:
        try:
            res[name] = run_mode(rank, dp, ep, dedup)
        except Exception:  # noqa: BLE001 - reported
            res[name] = {"failure": traceback.format_exc()}
    try:
        res[TRANSFORMERS] = run_transformers(rank, out)
    except Exception:  # noqa: BLE001 - reported (no accelerate, or a transformers without this path)
        res[TRANSFORMERS] = {"failure": traceback.format_exc()}
    Path(out, f"rank{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    os._exit(0)


def spawn(fn, timeout_s: float = 300.0) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(
            fn, args=(str(Path(tmp) / "store"), tmp, BATCH, SEQ), nprocs=WORLD, join=False, start_method="spawn"
        )
        t0 = time.monotonic()
        while not all(Path(tmp, f"rank{r}.json").exists() for r in range(WORLD)):
            if time.monotonic() - t0 > timeout_s or not any(p.is_alive() for p in ctx.processes):
                break
            time.sleep(0.2)
        out = [json.loads(p.read_text()) if (p := Path(tmp, f"rank{r}.json")).exists() else None for r in range(WORLD)]
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return out


def summarize(per_rank: list[dict]) -> dict:
    """Bytes sent per step by all ranks together, by phase/kind."""
    total: dict[str, int] = {}
    for table in per_rank:
        for key, v in table.items():
            total[key] = total.get(key, 0) + v["bytes"]
    return total


def main(argv=None) -> dict:
    global BATCH, SEQ
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=BATCH, help="global batch (a multiple of 4)")
    p.add_argument("--seq", type=int, default=SEQ)
    args = p.parse_args(argv)
    BATCH, SEQ = args.batch, args.seq
    info = machine_info()
    ranks = spawn(_worker)
    rows, result = [], {"machine": info, "world": WORLD, "batch": [BATCH, SEQ], "variants": {}}
    for name in [n for n, *_ in LAYOUTS] + [TRANSFORMERS]:
        per_rank = [r[name] if r is not None else {"failure": "no result"} for r in ranks]
        failed = [r for r in per_rank if "failure" in r]
        if failed:
            print(f"{name}: failed\n{failed[0]['failure'][-2000:]}")
            result["variants"][name] = {"failure": failed[0]["failure"][-2000:]}
            continue
        total = summarize(per_rank)
        result["variants"][name] = {"per_kind": total, "rank0": per_rank[0]}
        rows.append(_row(name, total))
    if TRANSFORMERS not in [r["variant"] for r in rows]:
        print("transformers' path did not run (see above): no ratio")
        return result
    base = rows[-1]["total"]
    for r in rows:
        r["vs transformers"] = r["total"] / base if base else float("nan")
    print(
        f"\nBytes sent per training step, all {WORLD} ranks together (global batch {BATCH}x{SEQ}; torch "
        f"{info['torch']}, gloo)"
    )
    print_table(
        rows,
        [
            ("variant", "variant", "s"),
            ("forward", "forward", ",d"),
            ("backward", "backward", ",d"),
            ("all_to_all", "all-to-all", ",d"),
            ("all_gather", "all-gather", ",d"),
            ("reduce_scatter", "reduce-scatter", ",d"),
            ("all_reduce", "all-reduce", ",d"),
            ("total", "total", ",d"),
            ("vs transformers", "÷ transformers", ".3f"),
        ],
    )
    path = write_json(ROOT / "benchmarks" / "results" / f"hf_moe_bytes_{BATCH}x{SEQ}.json", result)
    print(f"wrote {path}")
    return result


def _row(name: str, total: dict) -> dict:
    def part(suffix: str) -> int:
        return sum(v for key, v in total.items() if key.endswith(suffix) or key.startswith(suffix))

    return {
        "variant": name,
        "forward": part("forward/"),
        "backward": part("backward/"),
        "all_to_all": part("/all_to_all"),
        "all_gather": part("/all_gather"),
        "reduce_scatter": part("/reduce_scatter"),
        "all_reduce": part("/all_reduce") + part("/broadcast"),
        "total": sum(total.values()),
    }


if __name__ == "__main__":
    main()

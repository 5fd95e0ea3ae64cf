"""How long a training step stalls for a sharded checkpoint: a synchronous save against ``async_save``.

    PYTHONPATH=. python benchmarks/parallel/bench_async_save.py              # 2 gloo processes (~6 min on 2 CPU cores)
    PYTHONPATH=. python benchmarks/parallel/bench_async_save.py --world 4
    PYTHONPATH=. python benchmarks/parallel/bench_async_save.py --quick      # tiny model, seconds (a smoke run)

``mode.train.Trainer`` on a ``(1, W)`` mesh (gloo, CPU, one thread per process), the model below (about 27M
parameters; a checkpoint is the parameters and AdamW's two moments, ~320 MB over all ranks). Rounds of the two
modes alternate (sync, async, async, sync, ...) on the same trainer (``MeshRuntime.async_save`` switched
between rounds); each round is

    plain steps | the step that saves (train_step + Trainer.save) | steps after it | wait for the save

and every interval is timed on rank 0 after a barrier. ``--idle``: each step first sleeps this long, leaving the
CPU to the background save as a step that waits on a GPU does, then trains (on 2 CPU cores every core is busy
training otherwise); each value is its own set of rounds. In sync mode ``Trainer.save`` returns when the save is
complete (shards written and hashed, ``meta.json``, ``SHA256SUMS``, ``latest``); in async mode when this
rank's shards are copied to CPU memory, and the rest runs in a background thread on a gloo group of its own
while the following steps train. Reported: medians over rounds of the plain step, the saving step, the next
step and the later ones (the background write competes with them for the CPU), the wait left at the end of
the round, and what the save added to the round against the plain step of all rounds. Writes
benchmarks/results/async_save.json (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere without installing
    sys.path.insert(0, str(ROOT))

from benchmarks.common import machine_info, print_table, write_json  # noqa: E402
from mode.model import LMConfig  # noqa: E402
from mode.train import TrainConfig  # noqa: E402
from mode.train.data import Corpus  # noqa: E402

MODEL = LMConfig(
    seq_len=64,
    d_model=256,
    n_heads=4,
    d_hidden=1024,
    num_experts=8,
    num_noop=0,
    top_k=2,
    layers=("moe", "moe", "moe"),
    capacity_factor=None,
)
TRAIN = TrainConfig(
    steps=10_000, batch_size=8, lr=1e-3, warmup_steps=10, eval_every=10_000, eval_batches=1, log_every=10_000, seed=0
)
FULL = dict(rounds=6, plain=3, after=4, warmup=2)
QUICK = dict(rounds=2, plain=1, after=2, warmup=1)


def _corpus() -> Corpus:
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=200_000).astype(np.uint8)
    return Corpus(train=data[:180_000], val=data[180_000:], source="uniform-bytes")


def _worker(rank: int, world: int, port: int, out_dir: str, model_cfg: dict, cfg: dict, idles: list[float]) -> None:
    import torch.distributed as dist

    from mode.parallel import ParallelDims, build_mesh, init_distributed
    from mode.parallel.runtime import MeshRuntime
    from mode.train import Trainer

    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    ctx = init_distributed("gloo", timeout_s=300, world_size=world)
    mesh = build_mesh(ParallelDims(1, world), "cpu", ctx.timeout_s)
    runtime = MeshRuntime(mesh, ctx.timeout_s)
    out = Path(out_dir)
    trainer = Trainer(
        LMConfig(**model_cfg), TRAIN, _corpus(), out / "run", progress=False, runtime=runtime, timeout_s=ctx.timeout_s
    )
    params = sum(p.numel() for p in trainer.model.parameters())

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    for _ in range(cfg["warmup"]):
        trainer.train_step()
    for mode in ("sync", "async"):  # warm both paths (the async one makes its gloo group here)
        runtime.async_save = mode == "async"
        trainer.save(out / "ckpt")
        runtime.wait_saves()
    rounds = []
    order = [("sync", "async"), ("async", "sync")]
    for idle in idles:

        def step(idle=idle):
            time.sleep(idle)  # the CPU idle this long, as in a step that waits for the GPU to run its kernels
            trainer.train_step()

        for i in range(cfg["rounds"]):
            for mode in order[i % 2]:
                runtime.async_save = mode == "async"
                r = {"idle_s": idle, "mode": mode, "plain": [timed(step) for _ in range(cfg["plain"])]}
                r["save_step"] = timed(lambda: (step(), trainer.save(out / "ckpt")))
                r["after"] = [timed(step) for _ in range(cfg["after"])]
                r["wait"] = timed(runtime.wait_saves)
                rounds.append(r)
    if rank == 0:
        sizes = sum(f.stat().st_size for f in (out / "ckpt").glob("step-*/*"))
        Path(out_dir, "rank0.json").write_text(
            json.dumps({"rounds": rounds, "params": params, "checkpoint_bytes": sizes})
        )
    dist.barrier()
    dist.destroy_process_group()


def run(world: int, model_cfg: LMConfig, cfg: dict, idles: list[float]) -> dict:
    import torch.multiprocessing as mp

    from mode.parallel.process_group import free_port

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _worker,
            args=(world, free_port(), tmp, asdict(model_cfg), cfg, idles),
            nprocs=world,
            join=True,
            start_method="spawn",
        )
        return json.loads(Path(tmp, "rank0.json").read_text())


def summarize(res: dict) -> list[dict]:
    """Per idle time and mode, medians over its rounds. The baseline of both modes is the plain step of all
    their rounds (the same work in both), so a busy moment of the machine weighs on one mode less."""
    rows = []
    for idle in sorted({r["idle_s"] for r in res["rounds"]}):
        same = [r for r in res["rounds"] if r["idle_s"] == idle]
        plain = statistics.median(t for r in same for t in r["plain"])
        for mode in ("sync", "async"):
            rs = [r for r in same if r["mode"] == mode]
            save_step = statistics.median(r["save_step"] for r in rs)
            # what the save added to the round: the saving step's and the following steps' excess, and the wait
            added = [r["save_step"] + sum(r["after"]) + r["wait"] - (1 + len(r["after"])) * plain for r in rs]
            rows.append(
                {
                    "idle_s": idle,
                    "mode": mode,
                    "rounds": len(rs),
                    "plain_s": plain,
                    "plain_this_mode_s": statistics.median(t for r in rs for t in r["plain"]),
                    "save_step_s": save_step,
                    "stall_s": save_step - plain,
                    "first_after_s": statistics.median(r["after"][0] for r in rs),
                    "later_after_s": statistics.median(t for r in rs for t in r["after"][1:]),
                    "wait_s": statistics.median(r["wait"] for r in rs),
                    "added_s": statistics.median(added),
                }
            )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2, help="gloo processes (a (1, W) mesh)")
    p.add_argument("--quick", action="store_true", help="a tiny model and 2 rounds (a smoke run)")
    p.add_argument(
        "--idle",
        default="0,0.5",
        help="comma-separated seconds each step leaves the CPU idle before its work (emulating a step "
        "that waits on a GPU); 0: the CPU-bound step of this machine (default 0,0.5)",
    )
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "async_save.json"))
    args = p.parse_args()
    model = replace(MODEL, d_model=32, n_heads=2, d_hidden=64, seq_len=16) if args.quick else MODEL
    cfg = QUICK if args.quick else FULL
    idles = [float(x) for x in args.idle.split(",")]
    res = run(args.world, model, cfg, idles)
    rows = summarize(res)
    print(
        f"\nStep time around a sharded checkpoint: {args.world} gloo processes (mesh 1 x {args.world}), "
        f"{res['params']:,} parameters, checkpoint {res['checkpoint_bytes'] / 2**20:.0f} MiB, "
        f"{cfg['rounds']} rounds per mode, medians, seconds\n"
    )
    print_table(
        rows,
        [
            ("idle_s", "idle per step", ".1f"),
            ("mode", "save", ""),
            ("plain_this_mode_s", "plain step", ".3f"),
            ("save_step_s", "step + save() returns", ".3f"),
            ("stall_s", "stall (vs all plain steps)", ".3f"),
            ("first_after_s", "next step", ".3f"),
            ("later_after_s", "later steps", ".3f"),
            ("wait_s", "wait left at round end", ".3f"),
            ("added_s", "time the save added to a round", ".3f"),
        ],
    )
    print()
    for sync, async_ in zip(rows[::2], rows[1::2]):
        print(
            f"idle {sync['idle_s']:g} s: async removes {sync['stall_s'] - async_['stall_s']:.3f} s of the saving "
            f"step's {sync['stall_s']:.3f} s stall; the save added {sync['added_s']:.3f} s (sync) and "
            f"{async_['added_s']:.3f} s (async) to its round"
        )
    payload = dict(
        benchmark="async_save",
        machine=machine_info(torch.device("cpu")),
        quick=args.quick,
        world=args.world,
        idle_s=idles,
        model=asdict(model),
        train=asdict(TRAIN),
        schedule=cfg,
        params=res["params"],
        checkpoint_bytes=res["checkpoint_bytes"],
        summary=rows,
        rounds=res["rounds"],
    )
    print(f"wrote {write_json(args.out, payload)}")


if __name__ == "__main__":
    main()

"""Parameter and optimizer bytes per rank at each (dp, ep) layout, against one process (what FSDP saves).

    PYTHONPATH=. python benchmarks/parallel/bench_memory.py                # the `mode train` presets quick and small
    PYTHONPATH=. python benchmarks/parallel/bench_memory.py --preset base  # d_model 512, 16 experts (~1 GB per process)

For each preset, one process builds the LM (``mode.train.Trainer``, no mesh) and takes one training step so
that AdamW's state exists; then 4 gloo processes do the same on the (dp, ep) meshes (1, 4), (2, 2), (4, 1),
and 2 processes on (1, 2), (2, 1). Counted per rank: the bytes of the parameters this rank holds
(``p.to_local()``: its FSDP shard, of its expert-parallel shard) and of their AdamW moments
(``exp_avg``, ``exp_avg_sq`` and the step counters), split into expert weights and the rest. Gradients are
freed after each step (``zero_grad(set_to_none=True)``), and activations and FSDP's temporarily gathered
weights are not counted: this is the state a rank keeps between steps. For contrast, the last column
gives what the expert-parallel scheme without FSDP (dense weights replicated, experts split over all ranks)
would hold per rank, computed from the same counts. The counts are exact; they do not depend on the
machine. Results: benchmarks/results/memory.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere without installing
    sys.path.insert(0, str(ROOT))

from mode.parallel.command import PRESETS  # noqa: E402
from mode.train import Trainer  # noqa: E402
from mode.train.data import Corpus  # noqa: E402

LAYOUTS = {4: [(1, 4), (2, 2), (4, 1)], 2: [(1, 2), (2, 1)]}


def _corpus() -> Corpus:
    import numpy as np

    data = np.random.default_rng(0).integers(0, 256, 400_000, dtype=np.uint8)
    return Corpus(train=data[:360_000], val=data[360_000:], source="random")


def _bytes(trainer: Trainer) -> dict:
    """This rank's parameter and AdamW bytes, split into expert weights and the rest."""
    out = {"param_expert": 0, "param_dense": 0, "optim_expert": 0, "optim_dense": 0}
    for name, p in trainer.model.named_parameters():
        kind = "expert" if ".experts." in name else "dense"
        local = p.to_local() if hasattr(p, "to_local") else p
        out[f"param_{kind}"] += local.numel() * local.element_size()
        for v in trainer.optimizer.state.get(p, {}).values():
            v = v.to_local() if hasattr(v, "to_local") else v
            out[f"optim_{kind}"] += v.numel() * v.element_size()
    return out


def _step(trainer: Trainer) -> None:
    trainer.train_step()


def _train_cfg(preset):
    from dataclasses import replace

    return replace(preset.train, batch_size=8, eval_batches=1)


def _worker(rank: int, world: int, store: str, out: str, presets: list[str]) -> None:
    import torch.distributed as dist

    from mode.parallel import ParallelDims, build_mesh

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=600)
    )
    res = {}
    for name in presets:
        preset = PRESETS[name]
        for dp, ep in LAYOUTS[world]:
            mesh = build_mesh(ParallelDims(dp, ep), timeout_s=600)
            t = Trainer(
                preset.model, _train_cfg(preset), _corpus(), Path(out) / f"{name}_{dp}x{ep}", progress=False, mesh=mesh
            )
            _step(t)
            res[f"{name} {dp}x{ep}"] = _bytes(t)
            del t
    Path(out, f"rank{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", nargs="+", default=["quick", "small"], choices=sorted(PRESETS))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "memory.json"))
    args = p.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    rows = []
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        single = {}
        for name in args.preset:
            preset = PRESETS[name]
            t = Trainer(preset.model, _train_cfg(preset), _corpus(), tmp / f"one_{name}", progress=False)
            _step(t)
            single[name] = _bytes(t)
            del t
        per_layout: dict = {}
        for world in (4, 2):
            out = tmp / f"w{world}"
            out.mkdir()
            mp.start_processes(
                _worker,
                args=(world, str(tmp / f"store{world}"), str(out), args.preset),
                nprocs=world,
                join=True,
                start_method="spawn",
            )
            ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
            for key in ranks[0]:
                per_layout[key] = [r[key] for r in ranks]
    for name in args.preset:
        one = single[name]
        total_one = sum(one.values())
        rows.append(
            {
                "preset": name,
                "layout": "one process",
                "ranks": 1,
                "max_rank_bytes": total_one,
                "params": one["param_expert"] + one["param_dense"],
                "optimizer": one["optim_expert"] + one["optim_dense"],
                "vs_one": 1.0,
                "ep_only_bytes": total_one,
            }
        )
        for world, layouts in LAYOUTS.items():
            for dp, ep in layouts:
                ranks = per_layout[f"{name} {dp}x{ep}"]
                totals = [sum(r.values()) for r in ranks]
                worst = max(range(world), key=lambda i: totals[i])
                r = ranks[worst]
                ep_only = one["param_dense"] + one["optim_dense"] + (one["param_expert"] + one["optim_expert"]) / world
                rows.append(
                    {
                        "preset": name,
                        "layout": f"dp={dp} x ep={ep}",
                        "ranks": world,
                        "max_rank_bytes": totals[worst],
                        "params": r["param_expert"] + r["param_dense"],
                        "optimizer": r["optim_expert"] + r["optim_dense"],
                        "sum_over_ranks": sum(totals),
                        "vs_one": totals[worst] / total_one,
                        "ep_only_bytes": ep_only,
                    }
                )
    report = {"torch": torch.__version__, "seconds": time.time() - t0, "rows": rows, "single_process_split": single}
    Path(args.out).write_text(json.dumps(report, indent=2))
    print("| preset | layout | params / rank | AdamW / rank | total / rank | vs one process | EP without FSDP / rank |")
    print("|---|---|---|---|---|---|---|")
    mb = 2**20
    for r in rows:
        print(
            f"| {r['preset']} | {r['layout']} | {r['params'] / mb:.2f} MiB | {r['optimizer'] / mb:.2f} MiB | "
            f"{r['max_rank_bytes'] / mb:.2f} MiB | {r['vs_one']:.3f} | {r['ep_only_bytes'] / mb:.2f} MiB |"
        )
    print(f"\nwrote {args.out} ({report['seconds']:.0f} s)")


if __name__ == "__main__":
    main()

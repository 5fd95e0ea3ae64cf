"""Peak resident memory per rank: every rank builds the full model then shards it (eager), against building on
the meta device and materializing only the rank's shards (``mode.parallel.meta_init``).

    PYTHONPATH=. python benchmarks/parallel/bench_meta_init.py            # 285M and 1.14B parameters; ~3 min on 2 cores
    PYTHONPATH=. python benchmarks/parallel/bench_meta_init.py --quick    # 36M only: a smoke run

Each case is a fresh set of spawned gloo processes on a (dp, ep) = (2, 2) mesh (one process for "eager, one
process"). A rank records its resident size (``/proc/self/statm``) after joining the process group and
building the mesh, then builds the model one way and reports ``ru_maxrss`` minus that: the peak growth, an
upper bound on what building cost it. Eager: ``torch.manual_seed(0); parallelize(LM(cfg), mesh)`` (the
``--eager-init`` path of ``mode train``). Meta: ``parallelize(build_on_meta(lambda: LM(cfg), seed=0), mesh)``
then ``materialize(model, "cpu")`` (the default). Both give the same weights (tests/parallel/test_meta_init.py).
Eager on 4 ranks at once is run only where 4 full models fit this machine's memory (``--eager-max-gb``);
above that, "eager, one process" builds the full model once in one process: what each rank of an eager run
holds at its peak, before sharding. The models: the LM with MoE layers of 16 experts, float32, vocabulary 256
(bytes). AdamW's state is not built here: it is twice the shard, after materializing, in both ways
(benchmarks/parallel/bench_memory.py counts it). Results: benchmarks/results/meta_init.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere without installing
    sys.path.insert(0, str(ROOT))

from benchmarks.common import machine_info, print_table, write_json  # noqa: E402
from mode.model import LM, LMConfig  # noqa: E402

MIB = 2**20
# (d_model, d_hidden, layers): 16 experts per MoE layer, 8 heads, vocabulary 256
CONFIGS = {"36M": (256, 512, 8), "285M": (512, 1024, 16), "1.14B": (1024, 2048, 16)}


def _config(name: str) -> LMConfig:
    d, h, n = CONFIGS[name]
    return LMConfig(
        seq_len=256,
        d_model=d,
        n_heads=8,
        d_hidden=h,
        layers=("moe",) * n,
        num_experts=16,
        top_k=2,
        capacity_factor=None,
        balance_coef=0.0,
    )


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _measure(build) -> dict:
    before = _rss_now()
    t0 = time.perf_counter()
    model = build()
    seconds = time.perf_counter() - t0
    params = list(model.parameters())
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    return {
        "peak_growth": _peak() - before,
        "rss_growth_after": _rss_now() - before,
        "seconds": seconds,
        "shard_bytes": sum(t.numel() * t.element_size() for t in local),
        "full_bytes": sum(p.numel() * p.element_size() for p in params),
        "largest_bytes": max(p.numel() * p.element_size() for p in params),
        "params": sum(p.numel() for p in params),
    }


def _worker(rank: int, world: int, store: str, out: str, config: str, mode: str) -> None:
    torch.set_num_threads(1)
    cfg = _config(config)
    if mode == "eager_one":  # no process group: the full build each eager rank makes first
        torch.manual_seed(0)
        res = _measure(lambda: LM(cfg))
    else:
        import torch.distributed as dist

        from mode.parallel import ParallelDims, build_mesh, parallelize
        from mode.parallel.meta_init import build_on_meta, materialize

        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=900)
        )
        mesh = build_mesh(ParallelDims(2, 2), timeout_s=900)

        def eager():
            torch.manual_seed(0)
            return parallelize(LM(cfg), mesh)

        def meta():
            return materialize(parallelize(build_on_meta(lambda: LM(cfg), seed=0), mesh), "cpu")

        res = _measure(eager if mode == "eager" else meta)
        dist.barrier()
    Path(out, f"rank{rank}.json").write_text(json.dumps(res))
    os._exit(0)


def _run(config: str, mode: str, world: int) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(
            _worker, args=(world, f"{tmp}/store", tmp, config, mode), nprocs=world, join=False, start_method="spawn"
        )
        while not ctx.join(timeout=1):
            pass
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=["285M", "1.14B"], choices=list(CONFIGS))
    p.add_argument("--quick", action="store_true", help="the 36M model only")
    p.add_argument(
        "--eager-max-gb",
        type=float,
        default=8.0,
        help="run eager on 4 ranks at once only when 4 full models take at most this many GB",
    )
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "meta_init.json"))
    args = p.parse_args(argv)
    configs = ["36M"] if args.quick else args.configs
    rows = []
    for name in configs:
        full_gb = sum(_numel(_config(name))) * 4 / 1e9
        modes = [("meta", 4)]
        modes += [("eager", 4)] if 4 * full_gb <= args.eager_max_gb else [("eager_one", 1)]
        for mode, world in modes:
            t0 = time.perf_counter()
            ranks = _run(name, mode, world)
            peaks = [r["peak_growth"] for r in ranks]
            r0 = ranks[0]
            rows.append(
                {
                    "config": name,
                    "params_M": r0["params"] / 1e6,
                    "full_MiB": r0["full_bytes"] / MIB,
                    "largest_MiB": r0["largest_bytes"] / MIB,
                    "how": {"meta": "meta, 4 ranks", "eager": "eager, 4 ranks", "eager_one": "eager, one process"}[
                        mode
                    ],
                    "shard_MiB": max(r["shard_bytes"] for r in ranks) / MIB,
                    "peak_MiB_max": max(peaks) / MIB,
                    "peak_MiB_min": min(peaks) / MIB,
                    "peak_over_full": max(peaks) / r0["full_bytes"],
                    "seconds_build": max(r["seconds"] for r in ranks),
                    "wall_s": time.perf_counter() - t0,
                    "ranks": ranks,
                }
            )
            print(
                f"{name} {rows[-1]['how']}: peak growth {max(peaks) / MIB:,.0f} MiB per rank "
                f"(full model {r0['full_bytes'] / MIB:,.0f} MiB)",
                flush=True,
            )
    print()
    print_table(
        rows,
        [
            ("config", "model", "s"),
            ("params_M", "params (M)", ",.0f"),
            ("how", "built", "s"),
            ("full_MiB", "full weights MiB", ",.0f"),
            ("shard_MiB", "shard MiB", ",.0f"),
            ("largest_MiB", "largest tensor MiB", ",.0f"),
            ("peak_MiB_max", "peak growth MiB", ",.0f"),
            ("peak_over_full", "peak / full", ".2f"),
            ("seconds_build", "build s", ".1f"),
        ],
    )
    payload = {
        "machine": machine_info(),
        "mesh": {"dp": 2, "ep": 2},
        "dtype": "float32",
        "configs": {n: dict(zip(("d_model", "d_hidden", "layers"), CONFIGS[n])) for n in configs},
        "results": rows,
    }
    print(f"\nwrote {write_json(args.out, payload)}")
    return payload


def _numel(cfg: LMConfig):
    """Parameter counts of the LM without building it (on meta)."""
    with torch.device("meta"):
        model = LM(cfg)
    return [p.numel() for p in model.parameters()]


if __name__ == "__main__":
    main()

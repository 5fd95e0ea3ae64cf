"""Spawned process pools for the multi-process tests: every pool starts at once, each rank writes what it saw to
``<tmp>/<pool>/rank<r>.json`` and the parent judges the files (not exit codes: gloo's shutdown may abort a
finished rank). ``worker(rank, world, store, out_dir, pool, out4)`` is the test module's own."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest


def start(worker, pools: dict[str, int], tmp: Path) -> dict:
    """Start every pool (``name -> world size``) on its own file store; returns ``name -> context``."""
    import torch.multiprocessing as mp

    ctxs = {}
    for name, world in pools.items():
        (tmp / name).mkdir()
        ctxs[name] = mp.start_processes(
            worker, args=(world, str(tmp / f"store_{name}"), str(tmp / name), name, str(tmp / "mesh4")),
            nprocs=world, join=False, start_method="spawn")
    return ctxs


def wait(ctxs: dict, pools: dict[str, int], tmp: Path, reporting: dict[str, list[int]], started: float,
         timeout_s: float) -> dict[str, list[dict | None]]:
    """Wait until each pool's reporting ranks wrote their files (or all its processes ended); fail the test
    after ``timeout_s`` from ``started``. Returns ``name -> [rank r's result or None]``."""
    pending = dict(ctxs)
    while pending:
        for name, ctx in list(pending.items()):
            reported = all((tmp / name / f"rank{r}.json").exists() for r in reporting[name])
            if reported or not any(p.is_alive() for p in ctx.processes):
                del pending[name]
        time.sleep(0.2)
        if time.monotonic() - started > timeout_s:
            pytest.fail(f"pools {sorted(pending)} did not finish in {timeout_s:.0f} s (a hang?)")
    return {name: [json.loads(p.read_text()) if (p := tmp / name / f"rank{r}.json").exists() else None
                   for r in range(world)] for name, world in pools.items()}


def kill(ctxs: dict) -> None:
    for ctx in ctxs.values():
        for p in ctx.processes:
            if p.is_alive():
                p.kill()

"""Spawned process pools for the multi-process tests: every pool starts at once, each rank writes what it saw to
``<tmp>/<pool>/rank<r>.json`` and the parent judges the files (not exit codes: gloo's shutdown may abort a
finished rank). ``worker(rank, world, store, out_dir, pool, out4)`` is the test module's own; it calls
``run_rank`` with the work of its pool."""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest

# Ranks are forked from a server process that imported these once (multiprocessing's forkserver), instead of
# spawned: a spawned rank imports torch, mode and its test module again, 2 to 3 CPU-seconds each, for some 50 ranks
# in the suite (issue 70). The server is a fresh interpreter that has run no torch op (no thread pool to inherit);
# its children still import their test module (with its sys.path), and get this process's environment as it was
# when the server started (none of these tests sets a variable for its ranks).
PRELOAD = ("torch", "torch.distributed", "mode", "mode.model", "mode.parallel.apply", "mode.parallel.checkpoint",
           "mode.train.trainer", "numpy")  # fmt: skip


def forkserver() -> str:
    """The start method for ranks, ``"forkserver"``, its server to preload ``PRELOAD`` (read when the server
    starts: at the first rank this process starts)."""
    import multiprocessing

    multiprocessing.set_forkserver_preload(list(PRELOAD))
    return "forkserver"


def start(worker, pools: dict[str, int], tmp: Path) -> dict:
    """Start every pool (``name -> world size``) on its own file store; returns ``name -> context``."""
    import torch.multiprocessing as mp

    method = forkserver()
    ctxs = {}
    for name, world in pools.items():
        (tmp / name).mkdir()
        ctxs[name] = mp.start_processes(
            worker,
            args=(world, str(tmp / f"store_{name}"), str(tmp / name), name, str(tmp / "mesh4")),
            nprocs=world,
            join=False,
            start_method=method,
        )
    return ctxs


def wait(
    ctxs: dict, pools: dict[str, int], tmp: Path, reporting: dict[str, list[int]], started: float, timeout_s: float
) -> dict[str, list[dict | None]]:
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
    return {
        name: [
            json.loads(p.read_text()) if (p := tmp / name / f"rank{r}.json").exists() else None for r in range(world)
        ]
        for name, world in pools.items()
    }


def kill(ctxs: dict) -> None:
    for ctx in ctxs.values():
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


@dataclass
class Running:
    """The pools of one ``running`` block: their folder, when they started, and ``wait`` for their files."""

    tmp: Path
    ctxs: dict
    pools: dict[str, int]
    started: float

    def wait(self, reporting: dict[str, list[int]] | None, timeout_s: float) -> dict[str, list[dict | None]]:
        """``wait`` for the ranks in ``reporting`` (None: every rank of every pool)."""
        if reporting is None:
            reporting = {name: list(range(world)) for name, world in self.pools.items()}
        return wait(self.ctxs, self.pools, self.tmp, reporting, self.started, timeout_s)


@contextlib.contextmanager
def running(worker, pools: dict[str, int]) -> Iterator[Running]:
    """Start every pool in a fresh temporary folder; whatever is still alive is killed when the block ends
    (a module fixture yields inside it)."""
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        ctxs = start(worker, pools, tmp)
        try:
            yield Running(tmp, ctxs, pools, time.monotonic())
        finally:
            kill(ctxs)


def run_rank(
    rank: int,
    world: int,
    store: str,
    out_dir: str,
    timeout_s: float,
    work: Callable[[], dict],
    barrier: bool = False,
    destroy: bool = False,
) -> None:
    """In a rank: join the gloo group (``timeout_s``), run ``work()`` (an exception is reported as
    ``{"failure": traceback}``), write the result to ``out_dir/rank<r>.json``, optionally wait for the peers
    (``barrier``) and leave the group (``destroy``), then exit at once: no teardown that could wait on a
    peer that left, stalls or sleeps."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )
    try:
        res = work()
    except Exception:  # noqa: BLE001 - reported to the parent
        res = {"failure": traceback.format_exc()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))
    if barrier:
        dist.barrier()
    if destroy:
        dist.destroy_process_group()
    os._exit(0)


def run_case(res: dict, key: str, fn: Callable[[], dict]) -> None:
    """``res[key] = fn()``, or the traceback as ``{"failure": ...}``: one failing case does not hide the rest."""
    try:
        res[key] = fn()
    except Exception:  # noqa: BLE001 - reported to the parent
        res[key] = {"failure": traceback.format_exc()}


def wait_for_file(path: Path, deadline_s: float) -> None:
    """Wait for another pool's signal file (e.g. a checkpoint it finished); TimeoutError after ``deadline_s``."""
    t0 = time.monotonic()
    while not path.exists():
        if time.monotonic() - t0 > deadline_s:
            raise TimeoutError(f"{path} did not appear in {deadline_s:.0f} s")
        time.sleep(0.2)


def case_results(results: dict[str, list[dict | None]], pool: str, case: str | None, ranks=None) -> list[dict]:
    """Each rank of ``pool`` (of ``ranks``, default all): its result for ``case`` (``None``: the rank's whole
    result), from ``wait``'s ``results``; fails the test with the rank's traceback when it wrote nothing,
    failed, or has no such case."""
    out = []
    for r, x in enumerate(results[pool]):
        if ranks is not None and r not in ranks:
            continue
        assert x is not None, f"{pool} rank {r} wrote no result"
        assert "failure" not in x, f"{pool} rank {r}:\n{x['failure']}"
        if case is not None:
            assert case in x, f"{pool} rank {r} has no {case!r} result: {sorted(x)}"
            assert "failure" not in x[case], f"{pool} rank {r} {case}:\n{x[case]['failure']}"
            x = x[case]
        out.append(x)
    return out


def assert_curve(actual, expected, what: str, *, tol: float, norm_rtol: float) -> None:
    """A training curve of (loss, grad norm) per step equals the reference: loss within ``tol``, grad norm
    within ``norm_rtol`` (relative)."""
    assert len(actual) == len(expected), (what, len(actual), len(expected))
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(actual, expected), 1):
        assert abs(loss - ref_loss) <= tol, f"{what} step {step}: loss {loss} vs {ref_loss}"
        assert math.isclose(norm, ref_norm, rel_tol=norm_rtol), f"{what} step {step}: grad norm {norm} vs {ref_norm}"


# The variables torchrun sets for its ranks: a test's torchrun must not inherit a parent's (a test run itself
# under torchrun, or a rank's leftovers), nor a fault meant for another run.
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MODE_TEST_FAULT")


def torchrun_train(nproc: int, *args: str, torchrun_args: tuple[str, ...] = ()) -> list[str]:
    """``torchrun --standalone --nproc-per-node N [torchrun_args] -m mode train ARGS`` as this interpreter runs it."""
    import sys

    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            *torchrun_args, "-m", "mode", "train", *args]  # fmt: skip


def torchrun_env(**extra: str) -> dict[str, str]:
    """This process's environment without ``TORCHRUN_VARS``, with ``extra`` added."""
    return {**{k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}, **extra}

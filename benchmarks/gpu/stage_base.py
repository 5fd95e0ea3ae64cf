"""What every stage of the GPU suite (gpu_suite.py) gets: its context (``Ctx``), the device, timing, a logged
subprocess, and the last error line and the process-group kill the runner uses too. Each stage runs in its own
process, ``gpu_suite.py --run-stage NAME``."""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository root: the stages' working folder
KILL_GRACE_S = 5.0


@dataclass
class Ctx:
    smoke: bool
    work: Path  # scratch folder of this stage
    device: object  # torch.device
    limit_s: float  # the stage's time limit (inner timeouts stay under it)
    options: dict = None  # stage options from the command line (the isoflop stage's: out, from, seeds)


def stage_device(smoke: bool):
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if not smoke:
        raise RuntimeError(
            "no CUDA device is visible (torch.cuda.is_available() is False); on a machine without "
            "a GPU run the rehearsal: --smoke"
        )
    return torch.device("cpu")


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn: Callable[[], None], device, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def compiling(ctx: Ctx) -> bool:
    """False with --no-compile: the torch.compile rows are left out (recorded as such)."""
    return not (ctx.options or {}).get("no_compile")


def run_logged(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int, str]:
    print("$ " + " ".join(cmd), flush=True)
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, _ = proc.communicate()
        print(out[-4000:])
        raise RuntimeError(f"{cmd[2:5]} ran past {timeout:.0f} s") from None
    print(out[-4000:])
    return proc.returncode, out


NO_CUDA = "skipped: no CUDA"


def read_stage_numbers(work: Path, name: str) -> dict:
    path = work / name / "result.json"
    try:
        return json.loads(path.read_text()).get("numbers", {})
    except (OSError, ValueError):
        return {}


def last_error(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    errs = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b", line.strip())]
    return (errs or lines or ["(no output)"])[-1].strip()[:500]


def kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the child's whole process group, then SIGKILL after a grace period."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue

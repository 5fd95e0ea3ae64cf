"""One call of ``benchmarks/gpu/gpu_suite.py --smoke`` in a subprocess, for tests/test_gpu_suite*.py: its output
folder is ``<tmp>/out``, its work folder ``<tmp>/work``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.gpu import gpu_suite  # noqa: E402


def run_smoke(
    tmp: Path, *args: str, timeout: float, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess, dict, float]:
    """Run the smoke rehearsal with ``args`` (``env`` added to this process's environment); returns the finished
    process, the result JSON it wrote and its wall seconds."""
    out = tmp / "out"
    t0 = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "gpu" / "gpu_suite.py"),
            "--smoke",
            "--out",
            str(out),
            "--work",
            str(tmp / "work"),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )
    seconds = time.monotonic() - t0
    return proc, json.loads((out / gpu_suite.RESULT_NAME).read_text()), seconds

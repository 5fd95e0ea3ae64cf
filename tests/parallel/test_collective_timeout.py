"""``mode train --collective-timeout``: a peer that is alive but never answers (SIGSTOPped: its connections stay
open, so nothing closes them the way a crash would) makes the other rank fail with a ``CollectiveError`` at the
timeout, not after gloo's 30 minutes. The cross-machine forms of the same fault (a machine whose link is cut, a
machine powered off) are tests/parallel/test_machines.py."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from pools import torchrun_env, torchrun_train

import mode.train.data

TIMEOUT_S = 5.0


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun's workers are not in its process group), from /proc."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def test_a_silent_peer_fails_the_others_within_the_collective_timeout(tmp_path: Path):
    data = tmp_path / "text.txt"
    data.write_text(Path(mode.train.data.__file__).read_text() * 3)
    cmd = torchrun_train(
        2,
        "--preset",
        "quick",
        "--ep",
        "2",
        "--steps",
        "8",
        "--eval-every",
        "100",
        "--data",
        str(data),
        "--device",
        "cpu",
        "--threads",
        "1",
        "--collective-timeout",
        f"{TIMEOUT_S:g}",
        "--no-progress",
        "--out",
        str(tmp_path / "run"),
    )
    env = torchrun_env()
    env["MODE_TEST_FAULT"] = "stop@1:3"
    proc = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env, start_new_session=True
    )
    lines: list[tuple[float, str]] = []

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append((time.time(), line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        failed = None
        while failed is None and time.monotonic() < deadline and proc.poll() is None:
            failed = next((t for t, line in lines if "a collective failed" in line), None)
            time.sleep(0.1)
        text = "".join(line for _, line in lines)
        assert failed is not None, text[-3000:]
    finally:
        for pid in [*descendants(proc.pid), proc.pid]:  # torchrun, both ranks (one of them stopped)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=30)
        reader.join(timeout=10)
    stop = next(line for _, line in lines if "mode fault: rank 1 stops" in line)
    stopped_at = float(stop.rsplit(" at ", 1)[1])
    detected_after = failed - stopped_at
    assert f"no answer within {TIMEOUT_S:g} s; set --collective-timeout" in text
    # the step after the stop waits on the silent rank: it fails at the timeout (+ the rest of rank 0's step)
    assert TIMEOUT_S - 1 <= detected_after <= TIMEOUT_S + 10, detected_after

"""``torchrun --nproc-per-node 2 -m mode train --resume auto`` (gloo): the same command line starts a run in a
folder that holds only a partial sharded save (no ``latest``: it does not count), then continues it from its
sharded checkpoint; without ``--resume`` over that checkpoint every rank refuses to start. Rank 0 decides and
broadcasts (``mode.parallel.command.checkpoint_to_resume``)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from pools import torchrun_env, torchrun_train

import mode.train.data


def torchrun(out: Path, data: Path, steps: int, *extra: str) -> subprocess.CompletedProcess:
    cmd = torchrun_train(
        2,
        "--preset",
        "quick",
        "--ep",
        "2",
        "--steps",
        str(steps),
        "--eval-every",
        "2",
        "--data",
        str(data),
        "--device",
        "cpu",
        "--threads",
        "1",
        "--timeout",
        "60",
        "--no-progress",
        "--out",
        str(out),
        *extra,
    )
    env = torchrun_env()
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)


def test_torchrun_resume_auto_starts_then_continues(tmp_path):
    data = tmp_path / "text.txt"
    data.write_text(Path(mode.train.data.__file__).read_text() * 3)
    out = tmp_path / "run"
    partial = out / "ckpt" / "step-00000009-abcdef"  # a save killed before rank 0 wrote latest
    partial.mkdir(parents=True)
    (partial / "__0_0.distcp").write_bytes(b"half")

    first = torchrun(out, data, 2, "--resume", "auto")
    assert first.returncode == 0, first.stderr[-3000:]
    assert f"mode train: no checkpoint in {out}: starting a new run" in first.stdout
    assert first.stdout.count("no checkpoint in") == 1  # rank 0 says it
    assert (out / "ckpt" / "latest").is_file() and not partial.exists()  # the new save removed the partial one

    again = torchrun(out, data, 4, "--resume", "auto")  # the same command line, more steps
    assert again.returncode == 0, again.stderr[-3000:]
    assert "mode train: resuming at step 2 of 4" in again.stdout and "no checkpoint" not in again.stdout
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "loss" in r] == [2, 4]

    latest = (out / "ckpt" / "latest").read_text()
    refused = torchrun(out, data, 6)
    assert refused.returncode != 0
    for rank in (0, 1):
        assert (
            f"mode train: rank {rank}: error: {str(out)!r} already holds a run's checkpoint ({str(out / 'ckpt')!r})"
        ) in refused.stderr
    assert (out / "ckpt" / "latest").read_text() == latest

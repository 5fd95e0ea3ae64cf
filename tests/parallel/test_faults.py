"""Faults under ``torchrun --nproc-per-node 2`` (gloo), each checked against an uninterrupted run of the same
command: the final parameters (every tensor of the last checkpoint) and the loss curve equal bit for bit.

* a rank SIGKILLed at a step, under ``--max-restarts 1``: the group restarts and resumes from its checkpoint;
* SIGTERM to one rank: every rank stops after the same step, the group saves, status 143; rerun: resumes;
* a second SIGTERM during that save, then a flipped byte in the newest remaining save: the abandoned save is
  never named complete, the corrupt one is skipped with a warning naming it, the one before is used.

The faults come from ``MODE_TEST_FAULT`` (``mode.train.faults``): a rank kills itself, or sends itself SIGTERM,
at a planned step, in the first attempt only. The first run of each case starts with ``--resume auto`` in a new
folder (a fresh start). Every subprocess has a timeout, and so does every collective (``--timeout``)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from pools import torchrun_env, torchrun_train

import mode.train.data
from mode.parallel.checkpoint import LATEST, saves, step_of
from mode.train.checkpoint import load_checkpoint
from mode.train.preempt import EXIT_PREEMPTED

STEPS = 8


def torchrun(out: Path, data: Path, fault: str | None = None, restarts: int = 0) -> subprocess.CompletedProcess:
    cmd = torchrun_train(
        2,
        "--preset",
        "quick",
        "--ep",
        "2",
        "--steps",
        str(STEPS),
        "--ckpt-every",
        "2",
        "--keep",
        "2",
        "--eval-every",
        "4",
        "--log-every",
        "1",
        "--data",
        str(data),
        "--device",
        "cpu",
        "--threads",
        "1",
        "--timeout",
        "60",
        "--no-progress",
        "--resume",
        "auto",
        "--out",
        str(out),
        torchrun_args=("--max-restarts", str(restarts)),
    )
    env = torchrun_env()
    if fault:
        env["MODE_TEST_FAULT"] = fault
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)


def final_state(out: Path) -> tuple[dict, list]:
    params = load_checkpoint(out / "ckpt")["model"]
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    return params, [(r["step"], r["loss"], r["grad_norm"]) for r in log if "loss" in r]


def assert_same_run(out: Path, reference: tuple[dict, list]) -> None:
    params, curve = final_state(out)
    ref_params, ref_curve = reference
    assert curve == ref_curve  # every logged loss and gradient norm, exactly
    assert params.keys() == ref_params.keys()
    for name in params:
        assert torch.equal(params[name], ref_params[name]), name


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "text.txt"
    path.write_text(Path(mode.train.data.__file__).read_text() * 3)
    return path


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory) -> tuple[dict, list]:
    out = tmp_path_factory.mktemp("uninterrupted") / "run"  # does not exist: --resume auto starts fresh
    run = torchrun(out, data)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"mode train: no checkpoint in {out}: starting a new run" in run.stdout
    state = final_state(out)
    assert [s for s, _, _ in state[1]] == list(range(1, STEPS + 1))  # the loss of every step
    return state


def test_a_killed_rank_restarts_and_ends_as_the_uninterrupted_run(data, reference, tmp_path):
    out = tmp_path / "run"
    run = torchrun(out, data, fault="kill@1:5", restarts=1)  # rank 1: kill -9 after step 5, before any save
    assert run.returncode == 0, run.stderr[-3000:]
    assert "a collective failed" in run.stderr  # rank 0 saw its peer die
    assert "mode train: resuming at step 4 of 8" in run.stdout  # the restarted group: the newest checkpoint
    assert_same_run(out, reference)


def test_sigterm_saves_exits_143_and_the_same_command_resumes(data, reference, tmp_path):
    out = tmp_path / "run"
    run = torchrun(out, data, fault="term@0:3")  # SIGTERM to rank 0 only, after step 3
    assert run.returncode != 0
    assert f"exitcode  : {EXIT_PREEMPTED}" in run.stderr  # what torchrun reports for the workers
    assert "mode train: preempted (SIGTERM): stopped after step 4 of 8" in run.stderr  # both ranks did step 4
    assert step_of(out / "ckpt" / (out / "ckpt" / LATEST).read_text().strip()) == 4  # ... and saved it
    again = torchrun(out, data)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "mode train: resuming at step 4 of 8" in again.stdout
    assert_same_run(out, reference)


def test_a_second_sigterm_and_a_corrupt_newest_save_fall_back(data, reference, tmp_path):
    out = tmp_path / "run"
    # SIGTERM after step 5; the preemption's save (step 6) gets a second SIGTERM before it is complete
    run = torchrun(out, data, fault="term@0:5,termsave@0:6")
    assert run.returncode != 0
    assert "a second SIGTERM: exiting now" in run.stderr
    ckpt = out / "ckpt"
    assert (ckpt / LATEST).read_text().strip().startswith("step-00000004-")  # the abandoned save is not named
    newest = [f for f in saves(ckpt) if step_of(f) == 4][0]
    shard = sorted(newest.glob("*.distcp"))[0]
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped byte in the newest complete save
    shard.write_bytes(bytes(raw))

    again = torchrun(out, data)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"mode train: warning: skipping checkpoint {str(newest)!r}" in again.stderr
    assert f"{shard.name} is corrupt" in again.stderr
    assert "mode train: resuming at step 2 of 8" in again.stdout
    assert (ckpt / f"bad-{newest.name}").is_dir()  # moved aside, kept for inspection
    assert_same_run(out, reference)

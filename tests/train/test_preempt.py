"""Preemption in one process: SIGTERM during ``mode train`` finishes the step, saves ``OUT/ckpt.pt`` and returns
status 143; the same command resumes and ends with the uninterrupted run's parameters and losses, bit for bit.
The signal comes from ``MODE_TEST_FAULT`` (``mode.train.faults``): the process sends it to itself after a
step. Also the pieces: the fault specification, the SIGTERM handler, ``--keep`` and ``--grace-s`` checks.
The multi-process cases (torchrun, gloo) are tests/parallel/test_faults.py."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

from mode.cli import main
from mode.train import faults
from mode.train.checkpoint import load_checkpoint
from mode.train.preempt import EXIT_PREEMPTED, Preemption


def train(data: Path, out: Path, *extra: str) -> int:
    return main(
        [
            "train",
            "--preset",
            "quick",
            "--steps",
            "6",
            "--eval-every",
            "3",
            "--log-every",
            "1",
            "--data",
            str(data),
            "--out",
            str(out),
            "--device",
            "cpu",
            "--threads",
            "1",
            "--no-progress",
            "--resume",
            "auto",
            *extra,
        ]
    )


def state(out: Path) -> tuple[dict, list]:
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    return load_checkpoint(out / "ckpt.pt")["model"], [(r["step"], r["loss"]) for r in log if "loss" in r]


def test_sigterm_saves_returns_143_and_the_same_command_resumes(data, tmp_path, monkeypatch, capsys):
    ref = tmp_path / "uninterrupted"
    assert train(data, ref) == 0
    out = tmp_path / "run"
    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setenv(faults.FAULT_ENV, "term@0:2")
    assert train(data, out) == EXIT_PREEMPTED
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is mode train's only while it runs
    err = capsys.readouterr().err
    assert "mode train: SIGTERM: finishing this step" in err
    assert "mode train: preempted (SIGTERM): stopped after step 3 of 6" in err  # the signal came during step 3
    assert load_checkpoint(out / "ckpt.pt")["step"] == 3
    monkeypatch.delenv(faults.FAULT_ENV)
    assert train(data, out) == 0
    assert "mode train: resuming at step 3 of 6" in capsys.readouterr().out
    (params, curve), (ref_params, ref_curve) = state(out), state(ref)
    assert curve == ref_curve and [s for s, _ in curve] == list(range(1, 7))
    for name in ref_params:
        assert torch.equal(params[name], ref_params[name]), name


def test_keep_and_grace_are_checked(data, tmp_path, capsys):
    assert train(data, tmp_path / "a", "--keep", "0") == 2
    assert "--keep=0: must be >= 1" in capsys.readouterr().err
    assert train(data, tmp_path / "c", "--grace-s", "0") == 2
    assert "grace_s=0.0: must be a number of seconds > 0" in capsys.readouterr().err


def test_fault_specifications():
    assert faults.parse("kill@1:7, term@0:5") == [faults.Fault("kill", 1, 7), faults.Fault("term", 0, 5)]
    for bad in ("kill", "boom@1:2", "kill@a:2", "kill@1"):
        with pytest.raises(ValueError, match=f"{faults.FAULT_ENV}=.*must be KIND@RANK:STEP"):
            faults.parse(bad)


def test_faults_fire_in_the_first_attempt_only(monkeypatch):
    monkeypatch.setenv(faults.FAULT_ENV, "kill@1:7,term@0:5")
    assert faults.planned(1) == [faults.Fault("kill", 1, 7)]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # torchrun restarted the group
    assert faults.planned(1) == []


def test_the_handler_sets_the_flag_and_is_removed():
    before = signal.getsignal(signal.SIGTERM)
    p = Preemption(grace_s=60).install()
    try:
        assert not p.requested
        signal.raise_signal(signal.SIGTERM)  # the first one: a flag and a timer, the process goes on
        assert p.requested
    finally:
        p.uninstall()  # cancels the grace timer
    assert signal.getsignal(signal.SIGTERM) is before

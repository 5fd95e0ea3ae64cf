"""``mode train --resume auto``: one command line that starts a run in an empty OUT and continues it from the
checkpoint in OUT when rerun (what a scheduler or torchelastic does), exactly as ``--resume``; without
``--resume``, a checkpoint already in OUT is an error, never overwritten; ``find_checkpoint`` counts only
complete checkpoints. Every run is on the CPU (--device cpu), where resumed and uninterrupted runs equal bit
for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mode.cli import main
from mode.parallel.command import build_parser, find_checkpoint
from mode.train import Trainer
from mode.train.checkpoint import load_checkpoint


def train(data: Path, out: Path, *extra: str, steps: int = 4) -> int:
    return main(
        [
            "train",
            "--preset",
            "quick",
            "--steps",
            str(steps),
            "--eval-every",
            "2",
            "--data",
            str(data),
            "--out",
            str(out),
            "--device",
            "cpu",
            "--threads",
            "1",
            "--no-progress",
            *extra,
        ]
    )


def losses(out: Path) -> list[tuple[int, float]]:
    return [
        (r["step"], r["loss"]) for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "loss" in r
    ]


def assert_same_params(a: Path, b: Path) -> None:
    pa, pb = load_checkpoint(a / "ckpt.pt")["model"], load_checkpoint(b / "ckpt.pt")["model"]
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted")
    assert train(data, out) == 0
    return out


def test_the_same_command_starts_then_continues_a_killed_run(data, uninterrupted, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    run = Trainer.run
    monkeypatch.setattr(Trainer, "run", lambda self, stop_step=None: run(self, stop_step=2))  # "killed" at step 2
    assert train(data, out, "--resume", "auto") == 0
    printed = capsys.readouterr().out
    assert f"mode train: no checkpoint in {out}: starting a new run" in printed
    assert "resuming" not in printed
    assert load_checkpoint(out / "ckpt.pt")["step"] == 2
    monkeypatch.setattr(Trainer, "run", run)
    assert train(data, out, "--resume", "auto") == 0  # the same command line, rerun
    printed = capsys.readouterr().out
    assert "mode train: resuming at step 2 of 4" in printed and "no checkpoint" not in printed
    assert [s for s, _ in losses(out)] == [2, 4]  # the quick preset logs every 10 steps and at the stop
    assert losses(out)[-1] == losses(uninterrupted)[-1]
    assert_same_params(out, uninterrupted)


def test_more_steps_continue_a_finished_run(data, uninterrupted, tmp_path, capsys):
    """The quick preset warms up for 10 steps, so the learning rate of steps 1-4 does not depend on --steps: 2
    steps then 2 more are the uninterrupted 4."""
    out = tmp_path / "run"
    assert train(data, out, "--resume", "auto", steps=2) == 0
    assert train(data, out, "--resume", "auto", steps=4) == 0
    assert "resuming at step 2 of 4" in capsys.readouterr().out
    assert losses(out)[-1] == losses(uninterrupted)[-1]
    assert_same_params(out, uninterrupted)


def test_without_resume_an_existing_checkpoint_is_an_error_and_kept(data, uninterrupted, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    for name in ("ckpt.pt", "log.jsonl"):
        (out / name).write_bytes((uninterrupted / name).read_bytes())
    before = {name: (out / name).read_bytes() for name in ("ckpt.pt", "log.jsonl")}
    capsys.readouterr()
    assert train(data, out, steps=6) == 2
    err = capsys.readouterr().err
    assert f"{str(out)!r} already holds a run's checkpoint ({str(out / 'ckpt.pt')!r})" in err
    assert "--resume auto (or --resume)" in err and "a new or empty --out" in err
    assert {name: (out / name).read_bytes() for name in before} == before  # nothing trained, nothing overwritten
    # --resume-from names the checkpoint to continue from: allowed over one
    assert train(data, out, "--resume-from", str(out / "ckpt.pt"), steps=5) == 0
    assert "resuming at step 4 of 5" in capsys.readouterr().out


def test_plain_resume_still_needs_a_checkpoint(data, tmp_path, capsys):
    out = tmp_path / "empty"
    assert train(data, out, "--resume", steps=1) == 2
    assert f"checkpoint {str(out / 'ckpt.pt')!r}: no such file" in capsys.readouterr().err


def test_resume_values():
    parse = build_parser().parse_args
    assert parse([]).resume is False
    assert parse(["--resume"]).resume is True
    assert parse(["--resume", "auto"]).resume == "auto"
    assert parse(["--resume=auto"]).resume == "auto"
    assert parse(["--resume", "--steps", "3"]).resume is True


@pytest.mark.parametrize("value", ["yes", "Auto", "runs/x"])
def test_a_bad_resume_value_is_refused(value, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--resume", value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --resume: {value!r}: the only value is 'auto'" in err


def test_resume_and_resume_from_together_are_refused(data, tmp_path, capsys):
    assert train(data, tmp_path, "--resume", "auto", "--resume-from", str(tmp_path / "x"), steps=1) == 2
    assert "--resume and --resume-from: give one of them" in capsys.readouterr().err


def test_find_checkpoint_counts_only_complete_ones(tmp_path):
    assert find_checkpoint(tmp_path / "missing") is None
    assert find_checkpoint(tmp_path) is None
    (tmp_path / ".ckpt.pt.123.abcd.tmp").write_bytes(b"half")  # a single-file save killed before its rename
    sharded = tmp_path / "ckpt"
    (sharded / "step-00000004-abcdef").mkdir(parents=True)  # a sharded save killed before rank 0 wrote latest
    (sharded / "step-00000004-abcdef" / ".metadata").write_bytes(b"")
    assert find_checkpoint(tmp_path) is None
    assert find_checkpoint(tmp_path, prefer_sharded=True) is None
    (sharded / "latest").write_text("step-00000004-abcdef\n")
    assert find_checkpoint(tmp_path) == sharded
    (tmp_path / "ckpt.pt").write_bytes(b"whole")
    assert find_checkpoint(tmp_path) == tmp_path / "ckpt.pt"  # one process: its own kind first
    assert find_checkpoint(tmp_path, prefer_sharded=True) == sharded  # a mesh: its own kind first

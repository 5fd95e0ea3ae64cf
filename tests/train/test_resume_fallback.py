"""A checkpoint that fails its checksum, in one process: ``--resume auto`` moves it aside (``bad-ckpt.pt``) with a
warning and starts a new run, which ends as the uninterrupted run does; plain ``--resume`` refuses it, naming
the file. With ``--keep 2`` a corrupt ``ckpt.pt`` is skipped and the previous kept file used. The sharded
fallback is tests/parallel/test_faults.py."""

from __future__ import annotations

from pathlib import Path

import torch

from mode.cli import main
from mode.train.checkpoint import load_checkpoint


def train(data: Path, out: Path, *extra: str, steps: int = 3) -> int:
    return main(
        [
            "train",
            "--preset",
            "quick",
            "--steps",
            str(steps),
            "--eval-every",
            "3",
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


def flip(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_a_corrupt_only_checkpoint(data, tmp_path, capsys):
    ref = tmp_path / "uninterrupted"
    assert train(data, ref) == 0
    out = tmp_path / "run"
    assert train(data, out, steps=2) == 0  # a different schedule: its checkpoint must not be what the run ends with
    flip(out / "ckpt.pt")
    capsys.readouterr()
    assert train(data, out, "--resume") == 2
    err = capsys.readouterr().err
    assert f"checkpoint {str(out / 'ckpt.pt')!r}: corrupt" in err and "CRC32" in err

    assert train(data, out, "--resume", "auto") == 0
    captured = capsys.readouterr()
    assert f"mode train: warning: skipping checkpoint {str(out / 'ckpt.pt')!r}: " in captured.err
    assert f"mode train: warning: no checkpoint in {str(out / 'ckpt.pt')!r} loads" in captured.err
    assert "resuming" not in captured.out
    assert (out / "bad-ckpt.pt").is_file()  # kept for inspection
    got, want = load_checkpoint(out / "ckpt.pt"), load_checkpoint(ref / "ckpt.pt")
    curve = [[(r["step"], r["loss"], r["grad_norm"]) for r in c["history"] if "loss" in r] for c in (got, want)]
    assert got["step"] == 3 and curve[0] == curve[1]
    for name, tensor in want["model"].items():
        assert torch.equal(got["model"][name], tensor), name


def test_keep_in_one_process_falls_back_to_the_previous_file(data, tmp_path, capsys):
    ref = tmp_path / "uninterrupted"
    assert train(data, ref, "--ckpt-every", "2", steps=6) == 0
    out = tmp_path / "run"
    assert train(data, out, "--ckpt-every", "2", "--keep", "2", steps=6) == 0
    kept = sorted(p.name for p in out.glob("ckpt-step-*.pt"))
    assert kept == ["ckpt-step-00000004.pt", "ckpt-step-00000006.pt"]  # the 2 newest; ckpt.pt is step 6's
    flip(out / "ckpt.pt")  # the newest (and its link ckpt-step-00000006.pt: the same file)
    capsys.readouterr()
    assert train(data, out, "--ckpt-every", "2", "--keep", "2", "--resume", "auto", steps=6) == 0
    captured = capsys.readouterr()
    assert f"mode train: warning: skipping checkpoint {str(out / 'ckpt.pt')!r}" in captured.err
    assert "mode train: resuming at step 4 of 6" in captured.out
    assert (out / "bad-ckpt.pt").is_file() and (out / "bad-ckpt-step-00000006.pt").is_file()
    got, want = load_checkpoint(out / "ckpt.pt"), load_checkpoint(ref / "ckpt.pt")
    for name, tensor in want["model"].items():
        assert torch.equal(got["model"][name], tensor), name

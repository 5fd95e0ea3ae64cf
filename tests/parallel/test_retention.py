"""Which saves of a sharded checkpoint folder are kept (``--keep K``: ``mode.parallel.checkpoint.retain``) and
tried on resume, newest first (``mode.parallel.resume.candidates``): a save counts as complete once its
``SHA256SUMS`` exists (written after every other file of the save); partial saves are removed and never
tried. Folders only (no training); the fallback itself runs in tests/parallel/test_faults.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mode.parallel.checkpoint import LATEST, is_complete, retain, saves, step_of
from mode.parallel.command import find_checkpoint
from mode.parallel.resume import candidates


def save(ckpt: Path, name: str, complete: bool = True, mtime: int | None = None) -> Path:
    folder = ckpt / name
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(b"shard")
    if complete:
        (folder / "SHA256SUMS").write_text("")
    if mtime is not None:
        os.utime(folder, ns=(mtime, mtime))
    return folder


def test_saves_newest_first_and_latest_first_at_equal_steps(tmp_path):
    a = save(tmp_path, "step-00000004-aaaaaa", mtime=3)
    b = save(tmp_path, "step-00000012-bbbbbb", mtime=1)
    c = save(tmp_path, "step-00000012-cccccc", mtime=2)
    save(tmp_path, "bad-step-00000016-dddddd")  # set aside: not a save any more
    (tmp_path / LATEST).write_text(b.name + "\n")
    assert saves(tmp_path) == [b, c, a]
    assert [step_of(f) for f in saves(tmp_path)] == [12, 12, 4]
    (tmp_path / LATEST).write_text(a.name + "\n")
    assert saves(tmp_path) == [c, b, a]  # then the most recently written


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_retain_keeps_the_newest_complete_saves_and_no_partial_one(tmp_path, keep):
    old = [save(tmp_path, f"step-{s:08d}-abcdef") for s in (2, 4, 6)]
    partial = save(tmp_path, "step-00000007-abcdef", complete=False)  # a save killed before its SHA256SUMS
    current = save(tmp_path, "step-00000008-abcdef")
    removed = retain(tmp_path, keep, current)
    left = saves(tmp_path)
    assert left == [current, *old[::-1][: keep - 1]]
    assert partial in removed and not partial.exists()


def test_candidates_are_the_complete_saves_newest_first(tmp_path):
    ckpt = tmp_path / "ckpt"
    a = save(ckpt, "step-00000003-aaaaaa")
    b = save(ckpt, "step-00000006-bbbbbb")
    save(ckpt, "step-00000009-cccccc", complete=False)  # never completed: not a candidate
    (ckpt / LATEST).write_text(b.name + "\n")
    assert candidates(ckpt) == [b, a]
    assert candidates(b) == [b]  # one save named explicitly: that one only
    assert candidates(tmp_path / "ckpt.pt") == [tmp_path / "ckpt.pt"]
    assert is_complete(a) and not is_complete(ckpt / "step-00000009-cccccc")


def test_a_complete_save_counts_even_before_latest_names_it(tmp_path):
    save(tmp_path / "ckpt", "step-00000003-aaaaaa", complete=False)
    assert find_checkpoint(tmp_path) is None  # only a partial save: a new run
    save(tmp_path / "ckpt", "step-00000006-bbbbbb")  # killed between its SHA256SUMS and latest
    assert find_checkpoint(tmp_path, prefer_sharded=True) == tmp_path / "ckpt"

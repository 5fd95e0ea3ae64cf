"""The built-in training text: stdlib docstrings read by ``ast`` (never run), and the heal's batch order."""

from __future__ import annotations

import json

import pytest
import torch

from mode.hf.dense.windows import (
    batches_of,
    calibration_docstring_windows,
    docstring_windows,
    heal_batches_of,
    stdlib_docstrings,
)


def _write(root, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def test_docstrings_are_parsed_not_run_and_tests_and_pydoc_data_left_out(tmp_path):
    long = "x" * 90
    marker = tmp_path / "ran"
    _write(
        tmp_path,
        "pkg/a.py",
        f'"""module {long}"""\nopen({str(marker)!r}, "w").close()\n'
        f'class C:\n    """class {long}"""\n    def f(self):\n        """method {long}"""\n'
        f'async def g():\n    """coroutine {long}"""\ndef h():\n    """short"""\n',
    )
    _write(tmp_path, "pkg/b.py", f'def dup():\n    """class {long}"""\n')  # the same text again: once
    _write(tmp_path, "pkg/broken.py", 'def (:\n    """never read"""\n')
    _write(tmp_path, "test/t.py", f'"""a test {long}"""\n')
    _write(tmp_path, "pkg/tests/t.py", f'"""a nested test {long}"""\n')
    _write(tmp_path, "pydoc_data/topics.py", f'"""held-out source {long}"""\n')
    docs = stdlib_docstrings(root=tmp_path)
    assert docs == [f"module {long}", f"class {long}", f"coroutine {long}", f"method {long}"]  # breadth first
    assert not marker.exists()
    assert "short" in stdlib_docstrings(min_chars=1, root=tmp_path) and "short" not in docs


def test_docstrings_are_cached_on_disk_and_parsed_again_when_a_file_changes(tmp_path, monkeypatch):
    import os

    import mode.hf.dense.windows as w

    monkeypatch.setenv("MODE_CACHE", str(tmp_path / "cache"))
    long = "y" * 90
    _write(tmp_path / "lib", "a.py", f'"""first {long}"""\n')
    first = stdlib_docstrings(root=tmp_path / "lib")
    (cached,) = (tmp_path / "cache" / "docstrings").iterdir()
    assert json.loads(cached.read_text()) == first == [f"first {long}"]
    cached.write_text(json.dumps(["from the cache"]))  # a second process reads the file, not the sources
    w._docstrings.cache_clear()
    assert stdlib_docstrings(root=tmp_path / "lib") == ["from the cache"]
    _write(tmp_path / "lib", "a.py", f'"""edited {long}"""\n')
    os.utime(tmp_path / "lib" / "a.py", ns=(1, 1))  # another size and time: another key
    w._docstrings.cache_clear()
    assert stdlib_docstrings(root=tmp_path / "lib") == [f"edited {long}"]
    for path in (tmp_path / "cache" / "docstrings").iterdir():
        path.write_text("{not json")
    w._docstrings.cache_clear()
    assert stdlib_docstrings(root=tmp_path / "lib") == [f"edited {long}"]  # unreadable: parsed again


def test_docstrings_of_this_python_and_bad_input(tmp_path):
    from pydoc_data.topics import topics

    docs = stdlib_docstrings()
    assert len(docs) > 1000 and len(set(docs)) == len(docs) and min(map(len, docs)) >= 80
    assert not set(docs) & set(topics.values())
    with pytest.raises(ValueError, match="root=.*not a directory"):
        stdlib_docstrings(root=tmp_path / "missing")
    with pytest.raises(ValueError, match="min_chars=0"):
        stdlib_docstrings(min_chars=0)


def test_calibration_windows_spread_over_the_docstrings_first_to_last():
    """n windows of docstring_windows at evenly spaced indices, the first and the last included; n < 1 refused."""
    from benchmarks.hf.heal_vs_prune_models import ByteTokenizer

    tok = ByteTokenizer()
    all_WS = docstring_windows(tok, 64)
    got_WS = calibration_docstring_windows(tok, 64, 5)
    assert got_WS.shape == (5, 64)
    assert torch.equal(got_WS[0], all_WS[0]) and torch.equal(got_WS[-1], all_WS[-1])
    assert torch.equal(got_WS[2], all_WS[(len(all_WS) - 1) // 2])
    with pytest.raises(ValueError, match="n=0"):
        calibration_docstring_windows(tok, 64, 0)


def test_heal_batches_take_every_training_window_once_then_the_extra_text():
    train_WS = torch.arange(10 * 2).view(10, 2)
    extra_WS = 100 + torch.arange(30 * 2).view(30, 2)
    plain = heal_batches_of(train_WS, steps=4, per_step=3, seed=0)  # the topics alone: a shuffle
    g = torch.Generator().manual_seed(0)
    assert torch.equal(torch.cat(plain), train_WS[torch.randperm(10, generator=g)])  # cycled by heal beyond
    both = heal_batches_of(train_WS, steps=6, per_step=3, seed=1, extra_WS=extra_WS)
    rows = [tuple(r) for r in torch.cat(both).tolist()]
    assert len(both) == 6 and all(b.shape == (3, 2) for b in both)
    assert len(set(rows)) == 18 and {tuple(r) for r in train_WS.tolist()} <= set(rows)
    assert sum(r[0] >= 100 for r in rows) == 8
    assert torch.equal(torch.cat(both), torch.cat(heal_batches_of(train_WS, 6, 3, seed=1, extra_WS=extra_WS)))
    other = torch.cat(heal_batches_of(train_WS, 6, 3, seed=2, extra_WS=extra_WS))
    assert not torch.equal(torch.cat(both), other)
    small = heal_batches_of(train_WS, steps=2, per_step=3, seed=1, extra_WS=extra_WS)  # under the topics: none
    assert all(int(b.max()) < 100 for b in small)
    with pytest.raises(ValueError, match="steps=0"):
        heal_batches_of(train_WS, steps=0, per_step=3, seed=0)
    with pytest.raises(ValueError, match="per_step=0"):
        heal_batches_of(train_WS, steps=2, per_step=0, seed=0)


def test_batches_of_cut_the_windows_in_order_the_last_batch_the_remainder():
    windows_WS = torch.arange(7 * 3).view(7, 3)
    got = batches_of(windows_WS, 3)
    assert [b.shape for b in got] == [(3, 3), (3, 3), (1, 3)]
    assert torch.equal(torch.cat(got), windows_WS)
    assert batches_of(windows_WS[:0], 3) == []  # no windows, no batches
    assert len(batches_of(windows_WS, 7)) == 1 and len(batches_of(windows_WS, 100)) == 1
    with pytest.raises(ValueError, match="size=0: must be >= 1"):
        batches_of(windows_WS, 0)
    with pytest.raises(TypeError, match="size=2.0: must be an int"):
        batches_of(windows_WS, 2.0)

"""Byte-level data: file and standard-library corpora, the split rules, the samplers."""

from __future__ import annotations

import re
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from mode.train.data import (
    VAL_EVERY_NTH_FILE,
    BatchSampler,
    Corpus,
    decode,
    encode,
    eval_batches,
    file_corpus,
    min_file_bytes,
    stdlib_corpus,
    stdlib_sources,
)

SEQ = 64


def lit(text: str) -> str:
    return re.escape(text)


# --------------------------------------------------------------------------------------------- file corpus


def test_min_file_bytes_hand_computed():
    # two validation windows of seq_len + 1 bytes must fit in the last 10%: 2 * 65 / 0.1 = 1300
    assert min_file_bytes(SEQ) == 1300
    assert min_file_bytes(SEQ, val_fraction=0.5) == 260
    assert min_file_bytes(10, val_fraction=0.3) == 74  # ceil(22 / 0.3) = ceil(73.33)


def test_file_corpus_missing_file(tmp_path):
    path = tmp_path / "nope.txt"
    with pytest.raises(ValueError, match=lit(f"data={str(path)!r}: no such file")):
        file_corpus(path, min_file_bytes(SEQ))


def test_file_corpus_directory_is_not_a_file(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        file_corpus(tmp_path, min_file_bytes(SEQ))


def test_file_corpus_empty_file(tmp_path):
    path = tmp_path / "empty.txt"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match=lit(f"data={str(path)!r}: the file is empty")):
        file_corpus(path, min_file_bytes(SEQ))


def test_file_corpus_too_short(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("x" * 1299)
    with pytest.raises(ValueError, match=lit(f"data={str(path)!r}: 1299 bytes is too short; needs at least 1300")):
        file_corpus(path, min_file_bytes(SEQ))


def test_file_corpus_exactly_min_bytes_is_enough_for_two_eval_windows(tmp_path):
    path = tmp_path / "edge.txt"
    path.write_text("ab" * 650)
    corpus = file_corpus(path, min_file_bytes(SEQ))
    assert len(corpus.train) == 1170 and len(corpus.val) == 130
    batches = eval_batches(corpus.val, batch_size=1, seq_len=SEQ, num_batches=2)
    assert len(batches) == 2


def test_file_corpus_binary_file(tmp_path):
    path = tmp_path / "blob.bin"
    path.write_bytes(b"hello world\n" * 200 + b"\x00\x01\x02" + b"more text" * 10)
    with pytest.raises(ValueError, match=lit(f"data={str(path)!r}: looks binary (contains NUL bytes)")):
        file_corpus(path, min_file_bytes(SEQ))


def test_file_corpus_invalid_utf8(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes(b"hello " + "caf\u00e9".encode("latin-1") + b" world\n" * 300)
    # 'é' in latin-1 is the lone byte 0xe9 at offset 9, not followed by continuation bytes
    with pytest.raises(ValueError, match=r"not valid UTF-8 \(.*at byte 9\); must be UTF-8 text"):
        file_corpus(path, min_file_bytes(SEQ))


def test_file_corpus_checks_encoding_before_length(tmp_path):
    """A tiny binary file is reported as binary, not as merely short (the more useful message)."""
    path = tmp_path / "tiny.bin"
    path.write_bytes(b"\x00\x00")
    with pytest.raises(ValueError, match="looks binary"):
        file_corpus(path, min_file_bytes(SEQ))


def test_file_corpus_split_last_ten_percent_is_validation(tmp_path):
    rng = np.random.default_rng(0)
    text = "".join(rng.choice(list("abcdefgh \n\u00e9\u2211"), size=1800))  # multi-byte characters included
    raw = text.encode("utf-8")
    path = tmp_path / "text.txt"
    path.write_bytes(raw)
    corpus = file_corpus(path, min_file_bytes(SEQ))
    n = len(raw)
    n_val = n - int(n * 0.9)
    assert abs(n_val - n / 10) <= 1
    assert corpus.val.dtype == np.uint8 and corpus.train.dtype == np.uint8
    assert corpus.train.tobytes() == raw[: n - n_val]
    assert corpus.val.tobytes() == raw[n - n_val :]
    assert corpus.source == str(path)


def test_file_corpus_val_fraction(tmp_path):
    path = tmp_path / "text.txt"
    path.write_bytes(bytes(range(32, 127)) * 40)  # 3800 bytes
    corpus = file_corpus(path, 100, val_fraction=0.25)
    assert len(corpus.val) == 950 and len(corpus.train) == 2850
    assert corpus.val.tobytes() == path.read_bytes()[-950:]


def test_corpus_rejects_empty_split():
    with pytest.raises(ValueError, match=lit("corpus 'x': the val split is empty")):
        Corpus(train=np.ones(10, dtype=np.uint8), val=np.zeros(0, dtype=np.uint8), source="x")


# ------------------------------------------------------------------------------------------ stdlib corpus


def test_stdlib_sources_deterministic_sorted_and_filtered():
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_sources()
    assert files == stdlib_sources()
    rel = [p.relative_to(root).as_posix() for p in files]
    assert rel == sorted(rel)
    assert len(set(rel)) == len(rel)
    assert len(files) > 100
    assert all(p.suffix == ".py" and p.is_file() for p in files)
    banned = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
    assert not [r for r in rel if banned & set(r.split("/")[:-1])]
    for expected in ("os.py", "json/__init__.py", "collections/__init__.py"):
        assert expected in rel


def _fake_stdlib(root: Path, n_top: int) -> None:
    """A miniature standard library with every kind of directory the filter must skip."""
    for i in range(n_top):
        (root / f"m{i:02d}.py").write_text(f"# module {i}\n" + "x = 1\n" * (i + 1))
    for rel in (
        "test/test_a.py",
        "pkg/tests/test_b.py",
        "idlelib/idle_test/c.py",
        "site-packages/foo/d.py",
        "dist-packages/e.py",
        "pkg/__pycache__/f.py",
        "pkg/notes.txt",
    ):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("SHOULD NOT APPEAR\n")
    for rel in ("pkg/__init__.py", "pkg/sub/mod.py", "idlelib/run.py", "Upper.py", "pkg_a.py"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(f"# {rel}\n")


def test_stdlib_sources_filter_and_order_on_a_fake_tree(tmp_path, monkeypatch):
    _fake_stdlib(tmp_path, 3)
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {"stdlib": str(tmp_path)})
    rel = [p.relative_to(tmp_path).as_posix() for p in stdlib_sources()]
    assert rel == [
        "Upper.py",
        "idlelib/run.py",
        "m00.py",
        "m01.py",
        "m02.py",
        "pkg/__init__.py",
        "pkg/sub/mod.py",
        "pkg_a.py",
    ]


def test_stdlib_corpus_split_rule_on_a_fake_tree(tmp_path, monkeypatch):
    _fake_stdlib(tmp_path, 2 * VAL_EVERY_NTH_FILE + 5)
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {"stdlib": str(tmp_path)})
    files = stdlib_sources()
    corpus = stdlib_corpus()
    val_idx = [i for i in range(len(files)) if (i + 1) % VAL_EVERY_NTH_FILE == 0]
    assert val_idx == [19, 39]
    assert corpus.val.tobytes() == b"\n".join(files[i].read_bytes() for i in val_idx)
    assert corpus.train.tobytes() == b"\n".join(f.read_bytes() for i, f in enumerate(files) if i not in val_idx)
    assert b"SHOULD NOT APPEAR" not in corpus.train.tobytes() + corpus.val.tobytes()
    assert corpus.source == f"python-stdlib ({len(files)} files)"


def test_stdlib_corpus_cut_to_a_budget_before_the_20th_file_still_has_a_val_file(tmp_path, monkeypatch):
    """A byte budget reached within the first 19 files (Python 3.12's stdlib on the H200 machine: 19 files)
    holds the last one out, so neither split is empty; a budget below the first file still reads 2 files.
    tokenize's built-in corpus splits the same way."""
    from mode.train.data import val_files
    from mode.train.tokenize import documents

    _fake_stdlib(tmp_path, 30)
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {"stdlib": str(tmp_path)})
    files = stdlib_sources()
    assert val_files(1) == [False] and val_files(2) == [False, True] and val_files(19) == [False] * 18 + [True]
    assert val_files(25) == [i == 19 for i in range(25)]  # the every-20th rule, unchanged from 20 files on
    for n in (2, 5, 19):
        budget = sum(f.stat().st_size for f in files[:n])
        corpus = stdlib_corpus(max_bytes=budget)
        assert corpus.source == f"python-stdlib ({n} files)"
        assert corpus.val.tobytes() == files[n - 1].read_bytes()
        assert corpus.train.tobytes() == b"\n".join(f.read_bytes() for f in files[: n - 1])
        docs, _ = documents(None, max_bytes=budget)
        assert [d.val for d in docs] == [False] * (n - 1) + [True]
    tiny = stdlib_corpus(max_bytes=1)
    assert tiny.source == "python-stdlib (2 files)" and tiny.val.tobytes() == files[1].read_bytes()


def _expected_stdlib_split(max_bytes: int) -> tuple[bytes, bytes, int]:
    """Independent restatement of the rule: files in sorted order until ``max_bytes`` is reached;
    file i (0-based) is validation when (i + 1) is a multiple of VAL_EVERY_NTH_FILE."""
    train, val, total, used = [], [], 0, 0
    for i, path in enumerate(stdlib_sources()):
        data = path.read_bytes()
        (val if (i + 1) % VAL_EVERY_NTH_FILE == 0 else train).append(data)
        total += len(data)
        used = i + 1
        if total >= max_bytes:
            break
    return b"\n".join(train), b"\n".join(val), used


def test_stdlib_corpus_splits_by_file():
    files = stdlib_sources()
    # enough bytes for at least 2 * VAL_EVERY_NTH_FILE files, so two files are validation
    sizes = np.cumsum([p.stat().st_size for p in files])
    max_bytes = int(sizes[2 * VAL_EVERY_NTH_FILE]) - 1
    corpus = stdlib_corpus(max_bytes=max_bytes)
    exp_train, exp_val, used = _expected_stdlib_split(max_bytes)
    assert used == 2 * VAL_EVERY_NTH_FILE + 1
    assert corpus.source == f"python-stdlib ({used} files)"
    assert corpus.train.tobytes() == exp_train
    assert corpus.val.tobytes() == exp_val
    # no file contributes to both splits: each validation file is absent from train, and vice versa. Some
    # stdlib installs hold byte-identical files under two names (Debian/Ubuntu's Python 3.12 has two
    # _sysconfigdata*.py), which may land one in each split: only contents unique to one split are checked.
    val_files = [files[i].read_bytes() for i in range(used) if (i + 1) % VAL_EVERY_NTH_FILE == 0]
    train_files = [files[i].read_bytes() for i in range(used) if (i + 1) % VAL_EVERY_NTH_FILE]
    assert len(val_files) == 2
    train_bytes, val_bytes = corpus.train.tobytes(), corpus.val.tobytes()
    assert all(data in val_bytes for data in val_files) and all(data in train_bytes for data in train_files)
    only_val = [d for d in val_files if d and d not in train_files]
    only_train = [d for d in train_files if d and d not in val_files]
    assert only_val and only_train
    for data in only_val:
        assert data not in train_bytes
    assert max(only_train, key=len) not in val_bytes


def test_stdlib_corpus_deterministic():
    a, b = stdlib_corpus(max_bytes=1_000_000), stdlib_corpus(max_bytes=1_000_000)
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)


def test_stdlib_corpus_too_small_for_a_validation_file(tmp_path, monkeypatch):
    """One file cannot be split by file (a budget below the first file now reads 2: the test above)."""
    (tmp_path / "only.py").write_text("x = 1\n")
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {"stdlib": str(tmp_path)})
    with pytest.raises(ValueError, match="the val split is empty"):
        stdlib_corpus(max_bytes=1)


# --------------------------------------------------------------------------------------- encode / decode


@pytest.mark.parametrize("text", ["", "hello", "caf\u00e9 \u2211 \U0001f642\n\ttabs", "\x7f\u0100"])
def test_encode_decode_roundtrip(text):
    ids = encode(text)
    assert ids.dtype == np.uint8
    assert ids.tobytes() == text.encode("utf-8")
    assert decode(ids) == text
    assert decode(torch.from_numpy(ids.astype(np.int64))) == text  # tensors of ids decode too


def test_decode_invalid_bytes_replaced_not_raised():
    assert decode([104, 0xFF, 105]) == "h\ufffdi"


# ------------------------------------------------------------------------------------------------ samplers


def _data(n: int = 600) -> np.ndarray:
    return np.random.default_rng(1).integers(0, 256, size=n).astype(np.uint8)


def _find_window(data: np.ndarray, row: torch.Tensor) -> list[int]:
    r = row.numpy()
    return [s for s in range(len(data) - len(r) + 1) if np.array_equal(data[s : s + len(r)], r)]


def test_batch_sampler_reproducible_and_seed_dependent():
    data = _data()
    a, b, c = BatchSampler(data, 4, 16, seed=3), BatchSampler(data, 4, 16, seed=3), BatchSampler(data, 4, 16, seed=4)
    torch.manual_seed(123)  # the sampler must not depend on the global RNG
    batches_a = [a.next() for _ in range(5)]
    torch.manual_seed(999)
    batches_b = [b.next() for _ in range(5)]
    batches_c = [c.next() for _ in range(5)]
    for (xa, ya), (xb, yb) in zip(batches_a, batches_b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not all(torch.equal(xa, xc) for (xa, _), (xc, _) in zip(batches_a, batches_c))
    assert not torch.equal(batches_a[0][0], batches_a[1][0])  # successive batches differ


def test_batch_sampler_targets_are_inputs_shifted_by_one():
    data = _data()
    x, y = BatchSampler(data, 6, 16, seed=0).next()
    assert x.shape == y.shape == (6, 16)
    assert x.dtype == y.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    for b in range(6):
        starts = _find_window(data, x[b])
        assert starts, "input row is not a contiguous window of the data"
        assert any(np.array_equal(data[s + 1 : s + 17], y[b].numpy()) for s in starts)


def test_batch_sampler_generator_state_resumes():
    data = _data()
    a = BatchSampler(data, 2, 8, seed=5)
    a.next()
    state = a.generator.get_state()
    expected = a.next()
    b = BatchSampler(data, 2, 8, seed=77)
    b.generator.set_state(state)
    got = b.next()
    assert torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1])


def test_batch_sampler_too_little_data():
    with pytest.raises(ValueError, match=lit("data has 17 tokens: needs more than seq_len + 1 = 17")):
        BatchSampler(np.zeros(17, dtype=np.uint8), 2, 16, seed=0)


def test_eval_batches_deterministic_shifted_and_spanning():
    data = _data(300)
    batches = eval_batches(data, batch_size=3, seq_len=16, num_batches=4)
    again = eval_batches(data, batch_size=3, seq_len=16, num_batches=4)
    assert len(batches) == 4
    for (x, y), (x2, y2) in zip(batches, again):
        assert x.shape == y.shape == (3, 16)
        assert torch.equal(x, x2) and torch.equal(y, y2)
        assert torch.equal(x[:, 1:], y[:, :-1])
    xs = torch.cat([x for x, _ in batches])
    ys = torch.cat([y for _, y in batches])
    # first window starts at 0, last one ends at the last token: the split is covered end to end
    assert np.array_equal(xs[0].numpy(), data[:16])
    assert np.array_equal(ys[-1].numpy(), data[-17:-1]) or np.array_equal(ys[-1].numpy(), data[-18:-2])
    # every window is a real window of the data, starts strictly increasing
    starts = [min(_find_window(data, x)) for x in xs]
    assert starts == sorted(starts) and len(set(starts)) == len(starts)
    for s, y in zip(starts, ys):
        assert np.array_equal(data[s + 1 : s + 17], y.numpy())


def test_eval_batches_too_short():
    with pytest.raises(ValueError, match=lit("validation split has 17 tokens: needs more than seq_len + 1 = 17")):
        eval_batches(np.zeros(17, dtype=np.uint8), 2, 16, 1)

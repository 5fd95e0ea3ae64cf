"""The packages corpus (mode.train.packages, ``--data packages``): which files, in which order, which split,
independent of where Python is installed; built once into a memory-mapped cache; sent to worker processes as a
path. Synthetic package trees, so that every rule is checked on known files."""

from __future__ import annotations

import hashlib
import pickle
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest

from mode.experiments import run_record, sweep
from mode.train import packages
from mode.train.data import BatchSampler, eval_batches, split_tokens
from mode.train.sources import load_corpus


def _tree(root: Path) -> tuple[list[tuple[str, Path]], dict[str, bytes]]:
    """A standard library and two site-packages folders; returns the roots and the files that belong in the
    corpus (name -> bytes), before the duplicate rule drops one of the two copies of mod01.py."""
    stdlib, site1, site2 = root / "lib" / "python3.x", root / "site1", root / "site2"
    want: dict[str, bytes] = {}

    def put(folder: Path, rel: str, data: bytes, label: str | None = None) -> None:
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        if label:
            want[f"{label}/{rel}"] = data

    for i in range(60):  # enough files that both splits get some
        put(stdlib, f"mod{i:02d}.py", f"def f{i}(x):\n    return x * {i}  # module {i}\n".encode(), "stdlib")
    put(stdlib, "email/README.txt", b"Notes on the email package.\n", "stdlib")
    put(stdlib, "site-packages/inside.py", b"print('the stdlib root skips its site-packages')\n")
    put(stdlib, "__pycache__/mod00.cpython-312.py", b"cached\n")
    put(site1, "pkg/__init__.py", '"""pkg: ünïcode docstring."""\n'.encode(), "site-packages")
    put(site1, "pkg/core.pyi", b"def g() -> int: ...\n", "site-packages")
    put(site1, "pkg/docs/guide.md", b"# Guide\n\nUse it.\n", "site-packages")
    put(site1, "pkg/docs/api.rst", b"API\n===\n", "site-packages")
    put(site1, "pkg/copy_of_mod01.py", (stdlib / "mod01.py").read_bytes(), "site-packages")  # a vendored copy
    put(site1, "pkg/data.bin", b"\x00\x01")  # not a text suffix
    put(site1, "pkg/blob.py", b"x = 1\x00\n")  # NUL byte
    put(site1, "pkg/latin1.py", "s = 'caf\u00e9'\n".encode("latin-1"))  # not UTF-8
    put(site1, "pkg/empty.py", b"")
    put(site1, "pkg/huge.py", b"#" * (packages.MAX_FILE_BYTES + 1))
    put(site1, "pkg-1.0.dist-info/LICENSE.txt", b"metadata\n")
    put(site2, "pkg/core.pyi", b"def g() -> str: ...  # shadowed by site1's\n")
    put(site2, "other/mod.py", b"import pkg\n", "site-packages")
    return [("stdlib", stdlib), ("site-packages", site1), ("site-packages", site2)], want


@pytest.fixture
def tree(tmp_path):
    roots, want = _tree(tmp_path / "a")
    return roots, want, tmp_path / "cache"


def test_files_order_split_and_what_is_left_out(tree):
    roots, want, cache = tree
    corpus = packages.packages_corpus(roots, cache)
    info = corpus.packages
    files, too_big = packages.list_files(roots)
    names = [f.name for f in files]
    assert names == sorted(names) and too_big == 1
    assert "site-packages/pkg/huge.py" not in names and not any("dist-info" in n or "__pycache__" in n for n in names)
    assert "stdlib/site-packages/inside.py" not in names
    assert next(f for f in files if f.name == "site-packages/pkg/core.pyi").path == roots[1][1] / "pkg" / "core.pyi"
    assert info.skipped == {"too_big": 1, "binary": 1, "not_utf8": 1, "duplicate": 1, "unreadable": 0}
    # the expected bytes, rebuilt from the rules: sorted names, first of each content, split by content hash
    expected = {"train": [], "val": []}
    seen = set()
    for f in files:
        data = f.path.read_bytes()
        if f.name not in want:
            continue
        digest = hashlib.sha256(data).hexdigest()
        if digest in seen:
            continue
        seen.add(digest)
        expected["val" if int(digest[:8], 16) % packages.VAL_EVERY == 0 else "train"].append(data + b"\n")
    assert info.files == len(seen) == len(want) - 1 and 0 < info.val_files < info.files  # the copy: once
    for split in ("train", "val"):
        got = np.asarray(getattr(corpus, split)[0][0 : len(getattr(corpus, split)[0])]).tobytes()
        assert got == b"".join(expected[split]), split
    assert (info.train_bytes, info.val_bytes) == (split_tokens(corpus.train), split_tokens(corpus.val))
    assert corpus.vocab_size == 256 and info.list_sha256[:12] in corpus.source


def test_the_corpus_does_not_depend_on_where_python_is_installed(tree, tmp_path):
    roots, _, cache = tree
    a = packages.packages_corpus(roots, cache).packages
    moved = [(label, tmp_path / "elsewhere" / root.relative_to(tmp_path / "a")) for label, root in roots]
    shutil.copytree(tmp_path / "a", tmp_path / "elsewhere")
    b = packages.packages_corpus(moved, tmp_path / "cache2").packages
    assert (b.list_sha256, b.crc32, b.train_bytes, b.val_bytes, b.files) == (
        a.list_sha256,
        a.crc32,
        a.train_bytes,
        a.val_bytes,
        a.files,
    )
    assert b.roots != a.roots  # recorded, but not part of the corpus's identity


def test_a_changed_file_changes_the_list_hash_and_moves_only_by_content(tree):
    roots, _, cache = tree
    a = packages.packages_corpus(roots, cache).packages
    (roots[0][1] / "mod05.py").write_bytes(b"def f5(x):\n    return x + 5\n")
    b = packages.packages_corpus(roots, cache).packages
    assert b.list_sha256 != a.list_sha256 and b.files == a.files
    assert len(list(cache.glob("packages-*"))) == 2  # a new cache folder: the file list's key changed


def test_the_cache_is_reused_and_a_partial_one_is_rebuilt(tree):
    roots, _, cache = tree
    logs: list[str] = []
    first = packages.packages_corpus(roots, cache, log=logs.append)
    assert len(logs) == 1 and "building the packages corpus" in logs[0]
    again = packages.packages_corpus(roots, cache, log=logs.append)
    assert len(logs) == 1 and again.packages == first.packages  # reused: no second build
    folder = next(cache.glob("packages-*"))
    (folder / packages.META).unlink()  # as if a builder died before its last write
    rebuilt = packages.packages_corpus(roots, cache, log=logs.append)
    assert len(logs) == 2 and rebuilt.packages == first.packages
    with open(folder / "val.bin", "ab") as fh:  # a split file that does not match its meta.json
        fh.write(b"x")
    packages.packages_corpus(roots, cache, log=logs.append)
    assert len(logs) == 3
    assert not list(folder.glob("*.tmp*"))  # no temporary files left behind


def test_fingerprint_crc_and_pickling(tree):
    roots, _, cache = tree
    corpus = packages.packages_corpus(roots, cache)
    train = np.asarray(corpus.train[0][0 : len(corpus.train[0])])
    val = np.asarray(corpus.val[0][0 : len(corpus.val[0])])
    fp = run_record.fingerprint(corpus)
    assert fp["crc32"] == zlib.crc32(val.tobytes(), zlib.crc32(train.tobytes())) == corpus.packages.crc32
    assert fp["list_sha256"] == corpus.packages.list_sha256 and fp["train_bytes"] == len(train)
    # a plain array corpus keeps the fingerprint it had (resumable run records)
    plain = type(corpus)(train=train, val=val, source="x")
    assert run_record.fingerprint(plain) == {"train_bytes": len(train), "val_bytes": len(val), "crc32": fp["crc32"]}
    blob = pickle.dumps(corpus)
    assert len(blob) < 2000  # the path, not the bytes
    back = pickle.loads(blob)
    assert np.array_equal(back.train[0][0 : len(train)], train) and back.packages == corpus.packages
    with pytest.raises(TypeError, match="read by windows"):
        corpus.train[0][3]


def test_training_and_validation_windows_read_the_maps(tree):
    roots, _, cache = tree
    corpus = packages.packages_corpus(roots, cache)
    x_BS, y_BS = BatchSampler(corpus.train, 4, 16, seed=0).next()
    assert x_BS.shape == (4, 16) and int(x_BS.max()) < 256
    assert np.array_equal(x_BS[:, 1:].numpy(), y_BS[:, :-1].numpy())
    batches = eval_batches(corpus.val, 2, 16, 2)
    assert len(batches) == 2 and batches[0][0].shape == (2, 16)


def test_data_packages_names_the_corpus(tree, monkeypatch):
    roots, _, cache = tree
    monkeypatch.setattr(packages, "default_roots", lambda: roots)
    monkeypatch.setenv("MODE_CACHE_DIR", str(cache))
    for corpus in (load_corpus("packages", 16), sweep.load_corpus("packages", 16, log=lambda m: None)):
        assert corpus.packages is not None and corpus.source.startswith("packages (")
    assert sweep.data_identity("packages") == "packages" and sweep.data_identity(None) is None
    record = sweep.data_record(corpus)
    assert record["packages"]["list_sha256"] == record["list_sha256"] and record["files"] == corpus.packages.files


def test_no_files_is_an_error_naming_the_roots(tmp_path):
    with pytest.raises(ValueError, match="data='packages': no .py/.pyi/.md/.rst/.txt files under"):
        packages.packages_corpus([("stdlib", tmp_path)], tmp_path / "cache")


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    """One folder for everything mode caches: the corpus and SmolLM2's GGUF (and the rest, through
    ``cache_root``) move together with $MODE_CACHE, $MODE_CACHE_DIR (its older name) or $XDG_CACHE_HOME."""
    from mode.hf.pretrained import SMOLLM2, smollm2_path

    monkeypatch.delenv("MODE_CACHE", raising=False)
    monkeypatch.setenv("MODE_CACHE_DIR", str(tmp_path / "m"))
    assert packages.cache_dir() == tmp_path / "m" == smollm2_path().parents[1]
    monkeypatch.setenv("MODE_CACHE", str(tmp_path / "first"))
    assert packages.cache_dir() == tmp_path / "first" == smollm2_path().parents[1]
    monkeypatch.delenv("MODE_CACHE")
    monkeypatch.delenv("MODE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert packages.cache_dir() == tmp_path / "x" / "mode" == smollm2_path().parents[1]
    assert smollm2_path().name == SMOLLM2.file_name

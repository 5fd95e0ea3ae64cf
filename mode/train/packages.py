"""The packages corpus (``--data packages``): the Python sources and documentation text of the installed
packages and of the standard library, as bytes, for sweeps that need more text than the standard library
alone (a GPU isoFLOP sweep trains on up to a hundred million bytes per run; docs/isoflop.md).

Shape legend: N bytes of a split.

What it holds
    Roots       the standard library (``sysconfig``'s ``stdlib``, without its ``site-packages`` /
                ``dist-packages``) and every site-packages folder (``site.getsitepackages()``, in import order).
    Files       ``SUFFIXES`` (Python sources and stubs, Markdown, reStructuredText, plain text) under a root,
                skipping ``__pycache__`` and the ``*.dist-info`` / ``*.egg-info`` metadata folders; files of
                more than ``MAX_FILE_BYTES`` (generated tables), empty files, files with a NUL byte and files
                that are not UTF-8 are left out and counted.
    Order       each file is named by its root's label and its path below the root (``stdlib/os.py``,
                ``site-packages/torch/nn/modules/linear.py``), never by where Python is installed; files are
                taken in the sorted order of those names. A name found under two site-packages folders is
                taken from the first (the one ``import`` would use).
    Duplicates  a file whose bytes equal an earlier file's is left out (vendored copies, empty-ish
                ``__init__.py`` files), so no text is in both splits.
    Split       by content: a file is validation when the first 8 hex digits of the SHA-256 of its bytes, as
                an integer, are divisible by ``VAL_EVERY`` (about 1 in 20 files), else training. The split
                does not depend on the file's name, on the order, or on which other files are installed.
    Bytes       each split is its files' bytes in order, each followed by one ``\\n``: byte-level ids,
                vocabulary 256, as the built-in corpus (``mode.train.data``).

The exact corpus depends on the installed versions: ``PackagesInfo`` records the file count, the byte
counts and ``list_sha256``, the SHA-256 of the ordered list of (name, split, content SHA-256); two machines
with that hash train on the same bytes. Sweeps store it in their results JSON.

Memory: the corpus is written once to a cache folder (``cache_dir()``: ``$MODE_CACHE``, else
``$MODE_CACHE_DIR``, else ``$XDG_CACHE_HOME/mode``, else ``~/.cache/mode``), file by file, and then read as memory maps
(``MappedBytes``): hundreds of MB are never held in a process twice, and a worker process that receives the
corpus reopens the maps instead of receiving a copy. The cache folder is named by a hash of the file list
(names, sizes, modification times) and the rules; a complete one is reused. Files appear atomically
(``meta.json`` last), so concurrent builders (ranks of ``torchrun``) write the same bytes and never expose a
half-written corpus.
"""

from __future__ import annotations

import hashlib
import json
import os
import site
import sysconfig
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from mode.train.data import PACKAGES, Corpus

SUFFIXES = (".py", ".pyi", ".md", ".rst", ".txt")
MAX_FILE_BYTES = 2_000_000  # larger files are generated tables (torch's _VariableFunctions.pyi is 1.1 MB)
VAL_EVERY = 20  # a file is validation when int(sha256[:8], 16) % VAL_EVERY == 0
SKIP_DIRS = frozenset({"__pycache__"})
SKIP_DIR_SUFFIXES = (".dist-info", ".egg-info")
STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages"})
FORMAT_VERSION = 1  # of the cache folder and of the rules above: a change of rules builds a new corpus
META = "meta.json"
SPLIT_FILES = {"train": "train.bin", "val": "val.bin"}
CHUNK = 1 << 24  # bytes per step of a checksum over a split


def cache_dir() -> Path:
    """Where built corpora are kept: mode's cache folder (``mode._cache.cache_root``: ``$MODE_CACHE``, else
    ``$MODE_CACHE_DIR``, else ``$XDG_CACHE_HOME/mode``, else ``~/.cache/mode``)."""
    from mode._cache import cache_root

    return cache_root()


def default_roots() -> list[tuple[str, Path]]:
    """(label, folder) of the standard library and of every site-packages folder that exists, import order."""
    roots = [("stdlib", Path(sysconfig.get_paths()["stdlib"]))]
    seen = {roots[0][1].resolve()}
    for folder in [*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]:
        p = Path(folder)
        if p.is_dir() and p.resolve() not in seen:
            seen.add(p.resolve())
            roots.append(("site-packages", p))
    return roots


@dataclass(frozen=True)
class SourceFile:
    name: str  # "<root label>/<path below the root>", with forward slashes
    path: Path
    size: int
    mtime_ns: int


def list_files(roots: list[tuple[str, Path]]) -> tuple[list[SourceFile], int]:
    """The candidate files of ``roots`` in sorted name order, and how many were left out for their size."""
    found: dict[str, SourceFile] = {}
    too_big = 0
    for label, root in roots:
        skip_here = SKIP_DIRS | (STDLIB_SKIP_DIRS if label == "stdlib" else frozenset())
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in skip_here and not d.endswith(SKIP_DIR_SUFFIXES))
            for f in filenames:
                if not f.endswith(SUFFIXES):
                    continue
                path = Path(dirpath) / f
                name = f"{label}/{path.relative_to(root).as_posix()}"
                if name in found:
                    continue  # the first root that has it, as import would
                try:
                    st = path.stat()
                except OSError:
                    continue  # a dangling link
                if st.st_size > MAX_FILE_BYTES:
                    too_big += 1
                    continue
                if st.st_size:
                    found[name] = SourceFile(name, path, st.st_size, st.st_mtime_ns)
    return [found[n] for n in sorted(found)], too_big


def is_val(digest_hex: str) -> bool:
    """The split rule: validation when the content hash's first 8 hex digits are divisible by ``VAL_EVERY``."""
    return int(digest_hex[:8], 16) % VAL_EVERY == 0


@dataclass(frozen=True)
class PackagesInfo:
    """What was built: counts, byte counts per split, and the hashes that identify the corpus."""

    files: int  # files in the corpus (both splits)
    val_files: int
    train_bytes: int
    val_bytes: int
    list_sha256: str  # SHA-256 of the ordered (name, split, content SHA-256) list: same hash, same corpus
    crc32: int  # of the training bytes, continued over the validation bytes (as run_record.fingerprint)
    skipped: dict  # reason -> count: too_big, binary, not_utf8, duplicate
    roots: list  # [label, folder] as found on this machine (for the record; not part of the identity)

    def to_dict(self) -> dict:
        return asdict(self)


class MappedBytes:
    """One split of the corpus: a read-only memory map of its bytes file. Slicing reads; pickling sends the
    path (a worker process maps the same file) instead of the bytes."""

    def __init__(self, path: Path, size: int):
        self.path, self.size = Path(path), size
        self.ids_N = np.memmap(self.path, dtype=np.uint8, mode="r", shape=(size,)) if size else np.zeros(0, np.uint8)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice):
            raise TypeError(f"{self.path}: read by windows (a slice), got {type(key).__name__}")
        return np.asarray(self.ids_N[key])

    def __reduce__(self):
        return MappedBytes, (self.path, self.size)

    def __repr__(self) -> str:
        return f"MappedBytes({str(self.path)!r}, {self.size} bytes)"


def _list_key(files: list[SourceFile], roots: list[tuple[str, Path]]) -> str:
    h = hashlib.sha256(
        json.dumps(
            {
                "format": FORMAT_VERSION,
                "suffixes": SUFFIXES,
                "max_file_bytes": MAX_FILE_BYTES,
                "val_every": VAL_EVERY,
                "roots": [[lb, str(r)] for lb, r in roots],
            }
        ).encode()
    )
    for f in files:
        h.update(f"{f.name}\0{f.size}\0{f.mtime_ns}\n".encode())
    return h.hexdigest()[:20]


def _read_meta(folder: Path) -> PackagesInfo | None:
    try:
        meta = json.loads((folder / META).read_text())
        info = PackagesInfo(**meta["info"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    for split, n in (("train", info.train_bytes), ("val", info.val_bytes)):
        p = folder / SPLIT_FILES[split]
        if not p.is_file() or p.stat().st_size != n:
            return None
    return info


def build(files: list[SourceFile], folder: Path, roots: list[tuple[str, Path]], too_big: int) -> PackagesInfo:
    """Write ``folder/train.bin``, ``val.bin`` and ``meta.json`` from ``files``, one file at a time."""
    folder.mkdir(parents=True, exist_ok=True)
    tag = f".tmp{os.getpid()}"
    tmp = {s: folder / (SPLIT_FILES[s] + tag) for s in SPLIT_FILES}
    listing = hashlib.sha256()
    seen: set[str] = set()
    skipped = {"too_big": too_big, "binary": 0, "not_utf8": 0, "duplicate": 0, "unreadable": 0}
    sizes, crcs, n_files, n_val = {"train": 0, "val": 0}, {"train": 0, "val": 0}, 0, 0
    try:
        with open(tmp["train"], "wb") as out_train, open(tmp["val"], "wb") as out_val:
            outs = {"train": out_train, "val": out_val}
            for f in files:
                try:
                    data = f.path.read_bytes()
                except OSError:
                    skipped["unreadable"] += 1
                    continue
                if not data:
                    continue
                if b"\x00" in data:
                    skipped["binary"] += 1
                    continue
                try:
                    data.decode("utf-8")
                except UnicodeDecodeError:
                    skipped["not_utf8"] += 1
                    continue
                digest = hashlib.sha256(data).hexdigest()
                if digest in seen:
                    skipped["duplicate"] += 1
                    continue
                seen.add(digest)
                split = "val" if is_val(digest) else "train"
                listing.update(f"{f.name}\0{split}\0{digest}\n".encode())
                outs[split].write(data + b"\n")
                crcs[split] = zlib.crc32(data + b"\n", crcs[split])
                sizes[split] += len(data) + 1
                n_files += 1
                n_val += split == "val"
        # the crc of train then val, as run_record.fingerprint computes it over the two splits
        crc = crcs["train"]
        with open(tmp["val"], "rb") as fh:
            while block := fh.read(CHUNK):
                crc = zlib.crc32(block, crc)
        info = PackagesInfo(
            files=n_files,
            val_files=n_val,
            train_bytes=sizes["train"],
            val_bytes=sizes["val"],
            list_sha256=listing.hexdigest(),
            crc32=crc,
            skipped=skipped,
            roots=[[lb, str(r)] for lb, r in roots],
        )
        for s in SPLIT_FILES:
            os.replace(tmp[s], folder / SPLIT_FILES[s])
        meta_tmp = folder / (META + tag)
        meta_tmp.write_text(
            json.dumps({"format": "mode-packages-corpus", "version": FORMAT_VERSION, "info": info.to_dict()}, indent=2)
        )
        os.replace(meta_tmp, folder / META)  # last: a folder with meta.json is complete
    finally:
        for p in tmp.values():
            p.unlink(missing_ok=True)
    return info


def packages_corpus(roots: list[tuple[str, Path]] | None = None, cache: Path | None = None, log=None):
    """The packages corpus (module doc) of ``roots`` (default: this Python's), built into ``cache`` (default
    ``cache_dir()``) unless a complete copy is there. Returns a ``mode.train.data.Corpus`` whose splits are
    memory-mapped and whose ``packages`` field holds the ``PackagesInfo``."""
    roots = default_roots() if roots is None else [(lb, Path(r)) for lb, r in roots]
    files, too_big = list_files(roots)
    if not files:
        raise ValueError(
            f"data={PACKAGES!r}: no {'/'.join(SUFFIXES)} files under {', '.join(str(r) for _, r in roots)}"
        )
    folder = Path(cache or cache_dir()) / f"packages-{_list_key(files, roots)}"
    info = _read_meta(folder)
    if info is None:
        if log is not None:
            log(f"building the packages corpus from {len(files)} files into {folder}")
        info = build(files, folder, roots, too_big)
    train = MappedBytes(folder / SPLIT_FILES["train"], info.train_bytes)
    val = MappedBytes(folder / SPLIT_FILES["val"], info.val_bytes)
    source = (
        f"packages ({info.files} files, {info.train_bytes + info.val_bytes:,} bytes, list sha256 "
        f"{info.list_sha256[:12]})"
    )
    return Corpus(train=(train,), val=(val,), source=source, packages=info)

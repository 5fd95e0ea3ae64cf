"""Pre-tokenized data: a folder of token-id shards (nanoGPT's layout), read lazily as memory maps.

Shape legend: N tokens of a shard (or of a part of one).

The folder (docs/data.md)
    FOLDER/meta.json        {"format": "mode-tokens", "version": 1, "dtype": "uint16", "vocab_size": 512,
                             "tokenizer": {"path": "tokenizer.json", "sha256": "..."},
                             "shards": [{"file": "train_000.bin", "split": "train", "tokens": 1048576}, ...]}
    FOLDER/train_000.bin    a raw little-endian array of ``dtype`` (nanoGPT: ``np.array(ids, np.uint16).tofile``)
    FOLDER/val_000.bin
    FOLDER/*.npy            1-D ``np.save`` arrays of uint16 / uint32: they carry their own dtype
``mode tokenize`` (``mode.train.tokenize``) writes such a folder. By hand, ``meta.json`` needs only
``dtype`` (when there are ``.bin`` shards) and ``vocab_size``; every other key is optional.

The rules
    Shards      meta.json's ``shards`` list when it has one, else every ``*.bin`` and ``*.npy`` file of the
                folder (not of its subfolders), in name order.
    Split       by name: a shard whose name holds the word ``val`` (or ``valid``, ``validation``) is validation,
                one holding ``train`` is training (words are split at anything but letters and digits:
                ``val.bin``, ``val_000.bin``, ``fineweb_train_000001.npy``); any other name is an error.
                A folder without a validation shard holds out the last ``VAL_FRACTION`` of the tokens of its
                last training shard (in name order) as validation; training never reads them.
    Windows     never cross a shard's end: a shard of N tokens offers N - S - 1 window starts
                (``mode.train.data.BatchSampler``), a shard shorter than S + 2 tokens offers none.
    Ids         are read lazily, and checked as they are read: every training and validation window read
                is checked against ``vocab_size`` (a ValueError names the shard, the position and the id).
                Without meta.json (``.npy`` shards only) ``vocab_size`` is the largest id + 1, from a max over
                every shard, chunk by chunk, when the folder is opened.
    Memory      shards are ``np.memmap`` / ``np.load(mmap_mode="r", allow_pickle=False)`` maps: opening a folder
                reads the headers only; a window reads its S + 1 ids.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TypeGuard

import numpy as np

from mode.train.checkpoint import sha256_file

META = "meta.json"
FORMAT = "mode-tokens"
VERSION = 1
DTYPES = ("uint16", "uint32")  # the id types a shard may hold
SUFFIXES = (".bin", ".npy")
VAL_FRACTION = 0.1  # no validation shard: this share of the last training shard is held out
VAL_WORDS = frozenset({"val", "valid", "validation"})
TRAIN_WORDS = frozenset({"train"})
MAX_CHUNK = 1 << 24  # ids per step of the max over a shard (a bounded read, whatever the shard's size)
_META_KEYS = ("format", "version", "dtype", "vocab_size", "tokenizer", "shards", "source")
_SHARD_KEYS = ("file", "split", "tokens")


def dtype_for_vocab(vocab_size: int) -> str:
    """The smallest shard dtype that holds every id of a vocabulary of ``vocab_size``."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


# ---------------------------------------------------------------------------------------------- tokenizer


@dataclass(frozen=True)
class TokenizerRef:
    """The tokenizer a token corpus was made with: a Hugging Face ``tokenizer.json`` and its content hash."""

    path: str  # absolute
    sha256: str

    def to_dict(self) -> dict:
        return {"path": self.path, "sha256": self.sha256}

    @classmethod
    def from_dict(cls, d, where: str) -> TokenizerRef:
        if not isinstance(d, dict) or not isinstance(d.get("path"), str) or not isinstance(d.get("sha256"), str):
            raise ValueError(f"{where}: tokenizer={d!r}: must be a dict with the str fields 'path' and 'sha256'")
        return cls(d["path"], d["sha256"])

    def load(self, where: str, path: str | os.PathLike | None = None):
        """The ``tokenizers.Tokenizer`` of this file (or of ``path``, a copy of it: the hash must match)."""
        file = Path(path if path is not None else self.path)
        if not file.is_file():
            hint = "" if path is not None else "; pass --tokenizer PATH to a copy of it"
            raise ValueError(
                f"{where}: trained on token ids of the tokenizer {str(file)!r} (sha256 "
                f"{self.sha256[:12]}...), which is missing{hint}"
            )
        digest = sha256_file(file)
        if digest != self.sha256:
            raise ValueError(
                f"{where}: tokenizer {str(file)!r} has sha256 {digest[:12]}..., the run was trained "
                f"with {self.sha256[:12]}...: not the same tokenizer, its ids would decode wrong"
            )
        return load_tokenizer(file)


def load_tokenizer(path: str | os.PathLike):
    """``tokenizers.Tokenizer.from_file(path)``, with a clear error when the package or the file is wrong."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError(
            "token data needs the tokenizers package: pip install 'mode-torch[tokens]' (or pip install tokenizers)"
        ) from None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - the Rust side raises a bare Exception on a malformed file
        raise ValueError(
            f"tokenizer={str(path)!r}: not a readable Hugging Face tokenizer.json "
            f"({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else e})"
        ) from None


# -------------------------------------------------------------------------------------------------- shards


class TokenShard:
    """A shard, or a part of one: token ids mapped from disk, checked against the vocabulary as they are read.

    ``shard[a:b]`` reads ids ``a .. b - 1`` (positions within this part) into memory; it is the only read."""

    def __init__(self, path: Path, ids_N: np.ndarray, vocab_size: int, offset: int = 0):
        self.path, self.ids_N, self.vocab_size, self.offset = path, ids_N, vocab_size, offset

    def __len__(self) -> int:
        return len(self.ids_N)

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice):
            raise TypeError(f"{self.path}: a shard is read by windows (a slice), got {type(key).__name__}")
        window_N = np.asarray(self.ids_N[key])
        if window_N.size and int(window_N.max()) >= self.vocab_size:
            at = int(np.argmax(window_N >= self.vocab_size))
            start = key.indices(len(self))[0]
            raise ValueError(
                f"{self.path}: token id {int(window_N[at])} at position {self.offset + start + at} is "
                f">= vocab_size={self.vocab_size}; every id must be < vocab_size (meta.json's "
                "vocab_size, or the tokenizer the shards were written with)"
            )
        return window_N

    def part(self, start: int, stop: int) -> TokenShard:
        """Ids ``start .. stop - 1`` of this part, as a part (still mapped, not read)."""
        return TokenShard(self.path, self.ids_N[start:stop], self.vocab_size, self.offset + start)

    def max_id(self) -> int:
        """The largest id, read chunk by chunk (``MAX_CHUNK`` ids at a time)."""
        return max(int(self.ids_N[i : i + MAX_CHUNK].max()) for i in range(0, len(self), MAX_CHUNK))

    def __repr__(self) -> str:
        return f"TokenShard({str(self.path)!r}, offset={self.offset}, tokens={len(self)})"


def _npy_header(path: Path) -> tuple[np.dtype, tuple, int]:
    """(dtype, shape, data offset) of a ``.npy`` file, from its header alone."""
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
            if version not in read:
                raise ValueError(f"npy format version {version}")
            shape, _, dtype = read[version](f)
            return dtype, shape, f.tell()
    except (ValueError, OSError, EOFError) as e:
        raise ValueError(f"{path}: not a readable .npy file ({str(e).strip() or type(e).__name__})") from None


def map_shard(path: Path, dtype: str | None, tokens: int | None = None) -> np.ndarray:
    """The 1-D id array of a shard file, memory-mapped, after checking its dtype and its size.

    ``dtype``: meta.json's (a ``.bin`` needs it; a ``.npy`` carries its own). ``tokens``: meta.json's count for
    this shard, when it has one (a shorter file is truncated, a longer one does not belong to that meta.json)."""
    size = path.stat().st_size
    if path.suffix == ".npy":
        np_dtype, shape, offset = _npy_header(path)
        if np_dtype.kind != "u" or np_dtype.itemsize not in (2, 4):
            raise ValueError(f"{path}: dtype {np_dtype}: a shard holds token ids as uint16 or uint32")
        if len(shape) != 1:
            raise ValueError(f"{path}: shape {shape}: a shard is a 1-D array of token ids")
        n = shape[0]
        if size < offset + n * np_dtype.itemsize:
            raise ValueError(
                f"{path}: truncated: its header says {n} ids of {np_dtype.itemsize} bytes "
                f"({offset + n * np_dtype.itemsize} bytes with the header), the file has {size} bytes"
            )
    else:
        if dtype is None:
            raise ValueError(
                f"{path}: a .bin shard has no dtype of its own: write {path.parent / META} with "
                '{"dtype": "uint16" or "uint32", "vocab_size": V} (docs/data.md)'
            )
        itemsize = np.dtype(dtype).itemsize
        if size % itemsize:
            raise ValueError(
                f"{path}: truncated: {size} bytes is not a multiple of {itemsize} ({dtype}, meta.json's dtype)"
            )
        n = size // itemsize
    if n == 0:
        raise ValueError(f"{path}: an empty shard (0 tokens); remove it or write ids into it")
    if tokens is not None and n != tokens:
        what = "truncated: " if n < tokens else ""
        raise ValueError(
            f"{path}: {what}holds {n} tokens, meta.json says tokens={tokens}; the file and "
            "meta.json must come from the same run"
        )
    if path.suffix == ".npy":
        return np.load(path, mmap_mode="r", allow_pickle=False)
    return np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")  # nanoGPT: little-endian


def split_of(name: str) -> str | None:
    """'train', 'val' or None, from the words of a shard's file name (see the module doc)."""
    words = set(re.split(r"[^a-z0-9]+", Path(name).stem.lower()))
    if words & VAL_WORDS:
        return "val"
    if words & TRAIN_WORDS:
        return "train"
    return None


# -------------------------------------------------------------------------------------------------- folder


@dataclass(frozen=True)
class ShardSpec:
    file: str  # a name inside the folder
    split: str  # "train" or "val"
    tokens: int | None  # meta.json's count, checked against the file


@dataclass(frozen=True)
class TokenMeta:
    """``meta.json``, validated."""

    dtype: str | None
    vocab_size: int | None
    tokenizer: TokenizerRef | None
    shards: tuple[ShardSpec, ...] | None
    source: str | None

    def to_json(self) -> dict:
        out = {"format": FORMAT, "version": VERSION, "dtype": self.dtype, "vocab_size": self.vocab_size}
        if self.tokenizer is not None:
            out["tokenizer"] = self.tokenizer.to_dict()
        if self.shards is not None:
            out["shards"] = [{"file": s.file, "split": s.split, "tokens": s.tokens} for s in self.shards]
        if self.source is not None:
            out["source"] = self.source
        return out


def _is_int(v) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def read_meta(folder: Path) -> TokenMeta | None:
    """``folder/meta.json`` validated (None when there is none). The tokenizer path is made absolute (a
    relative one is relative to the folder) and its file must exist and match its sha256 when one is given."""
    path = folder / META
    if not path.is_file():
        return None
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: holds a {type(d).__name__}; must be a JSON object")
    unknown = [k for k in d if k not in _META_KEYS]
    if unknown:
        raise ValueError(f"{path}: unknown key {unknown[0]!r}; the keys are {', '.join(_META_KEYS)} (docs/data.md)")
    if d.get("format", FORMAT) != FORMAT:
        raise ValueError(f"{path}: format={d['format']!r}: must be {FORMAT!r}")
    if d.get("version", VERSION) != VERSION:
        raise ValueError(f"{path}: version={d['version']!r}: this mode reads version {VERSION}")
    dtype = d.get("dtype")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"{path}: dtype={dtype!r}: must be one of {', '.join(DTYPES)}")
    vocab = d.get("vocab_size")
    if not _is_int(vocab) or vocab < 1:
        raise ValueError(f"{path}: vocab_size={vocab!r}: must be an int >= 1 (the number of token ids)")
    if dtype is not None and vocab > 1 << (8 * np.dtype(dtype).itemsize):
        raise ValueError(
            f"{path}: vocab_size={vocab} does not fit dtype {dtype} (at most "
            f"{1 << (8 * np.dtype(dtype).itemsize)} ids); use uint32"
        )
    tokenizer = None
    if d.get("tokenizer") is not None:
        t = d["tokenizer"]
        if not isinstance(t, dict) or not isinstance(t.get("path"), str) or not isinstance(t.get("sha256", ""), str):
            raise ValueError(f"{path}: tokenizer={t!r}: must be {{'path': str, 'sha256': str (optional)}}")
        file = (folder / t["path"]).resolve()
        if not file.is_file():
            raise ValueError(f"{path}: tokenizer path {t['path']!r}: no such file ({file})")
        digest = sha256_file(file)
        if t.get("sha256") and t["sha256"] != digest:
            raise ValueError(
                f"{path}: tokenizer {str(file)!r} has sha256 {digest}, meta.json says {t['sha256']}: "
                "not the tokenizer these shards were written with"
            )
        tokenizer = TokenizerRef(str(file), digest)
    shards = None
    if d.get("shards") is not None:
        if not isinstance(d["shards"], list):
            raise ValueError(f"{path}: shards: must be a list of {{'file', 'split', 'tokens'}} entries")
        shards = tuple(_shard_spec(s, i, path) for i, s in enumerate(d["shards"]))
    source = d.get("source")
    return TokenMeta(dtype, vocab, tokenizer, shards, source if isinstance(source, str) else None)


def _shard_spec(s, i: int, path: Path) -> ShardSpec:
    where = f"{path}: shards[{i}]"
    if not isinstance(s, dict) or not isinstance(s.get("file"), str):
        raise ValueError(f"{where}={s!r}: must be a dict with a str 'file'")
    unknown = [k for k in s if k not in _SHARD_KEYS]
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r}; the keys are {', '.join(_SHARD_KEYS)}")
    file = s["file"]
    if Path(file).name != file or file in ("", ".", ".."):
        raise ValueError(f"{where}: file={file!r}: must be a file name inside the folder (no path)")
    if Path(file).suffix not in SUFFIXES:
        raise ValueError(f"{where}: file={file!r}: a shard is a .bin or .npy file")
    split = s.get("split", split_of(file))
    if split not in ("train", "val"):
        raise ValueError(
            f"{where}: split={split!r} for {file!r}: must be 'train' or 'val' (or a name holding the word train or val)"
        )
    tokens = s.get("tokens")
    if tokens is not None and (not _is_int(tokens) or tokens < 0):
        raise ValueError(f"{where}: tokens={tokens!r}: must be an int >= 0")
    return ShardSpec(file, split, tokens)


@dataclass(frozen=True)
class TokenFolder:
    """An opened folder of shards: the training and validation parts, the vocabulary, the tokenizer."""

    path: Path
    train: tuple[TokenShard, ...]
    val: tuple[TokenShard, ...]
    vocab_size: int
    tokenizer: TokenizerRef | None
    held_out: bool  # True: no validation shard, val is the tail of the last training shard

    @property
    def source(self) -> str:
        n_train, n_val = sum(len(p) for p in self.train), sum(len(p) for p in self.val)
        val = (
            f"val the last {VAL_FRACTION:.0%} of {self.train[-1].path.name} ({n_val:,} tokens)"
            if self.held_out
            else f"val {n_val:,} tokens in {len(self.val)} shard(s)"
        )
        return (
            f"token shards {self.path} (vocab {self.vocab_size}; train {n_train:,} tokens in {len(self.train)} "
            f"shard(s), {val})"
        )


def open_token_folder(path: str | os.PathLike, seq_len: int | None = None) -> TokenFolder:
    """Open a folder of shards (the rules are in the module doc). ``seq_len``: also check that training and
    validation each hold a window of ``seq_len + 1`` ids inside one shard."""
    folder = Path(path)
    where = f"data={str(path)!r}"
    if not folder.is_dir():
        raise ValueError(f"{where}: not a folder of token shards")
    meta = read_meta(folder)
    if meta is not None and meta.shards is not None:
        specs = list(meta.shards)
        missing = [s.file for s in specs if not (folder / s.file).is_file()]
        if missing:
            raise ValueError(f"{where}: {missing[0]!r} is listed in {META} but is not in the folder")
    else:
        specs = []
        for f in sorted(p for p in folder.iterdir() if p.suffix in SUFFIXES and p.is_file()):
            split = split_of(f.name)
            if split is None:
                raise ValueError(
                    f"{where}: {f.name!r}: a shard's name must hold the word 'train' or 'val' "
                    "(e.g. train_000.bin, val.bin) to say its split"
                )
            specs.append(ShardSpec(f.name, split, None))
    if not specs:
        raise ValueError(f"{where}: no .bin or .npy shards in the folder (make some with mode tokenize, docs/data.md)")
    dtype = meta.dtype if meta is not None else None
    arrays = {s.file: map_shard(folder / s.file, dtype, s.tokens) for s in specs}
    vocab = meta.vocab_size if meta is not None else None
    if vocab is None:  # .npy only, no meta.json: the data says how many ids there are
        vocab = 1 + max(TokenShard(folder / f, a, 1 << 32).max_id() for f, a in arrays.items())
    train = [TokenShard(folder / s.file, arrays[s.file], vocab) for s in specs if s.split == "train"]
    val = [TokenShard(folder / s.file, arrays[s.file], vocab) for s in specs if s.split == "val"]
    if not train:
        raise ValueError(
            f"{where}: no training shard: {', '.join(s.file for s in specs)} are all validation; "
            "a training shard's name holds the word 'train' (e.g. train_000.bin)"
        )
    held_out = not val
    if held_out:  # the tail of the last training shard becomes validation
        last = train.pop()
        cut = int(len(last) * (1 - VAL_FRACTION))
        train.append(last.part(0, cut))
        val = [last.part(cut, len(last))]
    corpus = TokenFolder(
        folder.resolve(), tuple(train), tuple(val), vocab, meta.tokenizer if meta is not None else None, held_out
    )
    if seq_len is not None:
        for split, parts in (("training", corpus.train), ("validation", corpus.val)):
            if not any(len(p) >= seq_len + 2 for p in parts):
                longest = max(len(p) for p in parts)
                raise ValueError(
                    f"{where}: no {split} shard holds more than seq_len + 1 = {seq_len + 1} tokens "
                    f"(the longest holds {longest}; windows never cross a shard's end"
                    + (
                        f", and the last {VAL_FRACTION:.0%} of the last training shard is validation"
                        if held_out
                        else ""
                    )
                    + ")"
                )
    return corpus

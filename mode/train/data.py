"""Training data: byte-level text (the built-in corpus, the Python standard library's own sources, or any
file), or a folder of pre-tokenized shards (``mode.train.tokens``), and the seeded batch sampler over either.

Shape legend: B batch, S sequence length. Byte tokens have the vocabulary 256, so any UTF-8 text works
without a trained tokenizer; token shards bring their own vocabulary (and tokenizer).

A split (``Corpus.train``, ``Corpus.val``) is one 1-D array of ids, or a tuple of parts (token shards, read
lazily) that no window crosses: part p of N_p ids offers N_p - S - 1 window starts, and the sampler draws
from the starts of all parts at once, so one array gives exactly the windows it gave before parts existed.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from mode.train.tokens import TokenizerRef, load_tokenizer, open_token_folder

VOCAB_SIZE = 256
PACKAGES = "packages"  # ``--data packages``: the installed packages' sources (mode.train.packages)
VAL_EVERY_NTH_FILE = 20  # built-in corpus: every 20th source file (in sorted order) is held out


def encode(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def decode(ids) -> str:
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


Split = np.ndarray | tuple  # one array of ids, or parts (TokenShard) that windows never cross


def split_parts(split: Split) -> tuple:
    return split if isinstance(split, tuple) else (split,)


def split_tokens(split: Split) -> int:
    return sum(len(p) for p in split_parts(split))


@dataclass
class Corpus:
    train: Split  # uint8 byte ids, or token shards
    val: Split
    source: str  # where it came from, for logs
    vocab_size: int = VOCAB_SIZE  # every id is below it
    tokenizer: TokenizerRef | None = None  # token shards: what turns their ids into text
    path: str | None = None  # token shards: the folder
    packages: object = None  # the packages corpus (``--data packages``): its ``PackagesInfo`` (mode.train.packages)

    def __post_init__(self) -> None:
        for split in ("train", "val"):
            if split_tokens(getattr(self, split)) == 0:
                raise ValueError(f"corpus {self.source!r}: the {split} split is empty")

    def record(self) -> dict:
        """What a checkpoint keeps of its data: enough to decode its ids (``text_codec``) and say what it was."""
        return {
            "kind": "bytes" if self.path is None else "tokens",
            "source": self.source,
            "vocab_size": self.vocab_size,
            "path": self.path,
            "tokenizer": None if self.tokenizer is None else self.tokenizer.to_dict(),
        }


def stdlib_sources() -> list[Path]:
    """The standard library's .py files in a deterministic (sorted) order, tests and site-packages excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def val_files(n: int) -> list[bool]:
    """Which of ``n`` files (in sorted order) of a corpus split by file are validation: every
    ``VAL_EVERY_NTH_FILE``-th; when that picks none (fewer files, e.g. a byte budget reached after a few large
    ones: 19 files of Python 3.12's standard library), the last one, so that neither split is empty from 2
    files on."""
    val = [i % VAL_EVERY_NTH_FILE == VAL_EVERY_NTH_FILE - 1 for i in range(n)]
    if n >= 2 and not any(val):
        val[-1] = True
    return val


def stdlib_corpus(max_bytes: int | None = None) -> Corpus:
    """Built-in corpus, split by file (``val_files``: every ``VAL_EVERY_NTH_FILE``-th file is validation, or the
    last one of fewer); ``max_bytes``: whole files in sorted order until that many bytes, at least 2 files."""
    files = stdlib_sources()
    if not files:
        raise ValueError(f"no .py files found under {sysconfig.get_paths()['stdlib']!r}")
    datas, n = [], 0
    for path in files:
        datas.append(path.read_bytes())
        n += len(datas[-1])
        if max_bytes is not None and n >= max_bytes and len(datas) >= 2:
            break
    val = val_files(len(datas))
    train = [d for d, v in zip(datas, val) if not v]
    held = [d for d, v in zip(datas, val) if v]
    joined = [np.frombuffer(b"\n".join(parts), dtype=np.uint8) for parts in (train, held)]
    return Corpus(train=joined[0], val=joined[1], source=f"python-stdlib ({len(datas)} files)")


def file_corpus(path: str | os.PathLike, min_bytes: int, val_fraction: float = 0.1) -> Corpus:
    """Any UTF-8 text file; the last ``val_fraction`` of it is validation."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(
            f"data={str(path)!r}: a folder, no such file: here data is a text file (folders of "
            "token shards are read by load_corpus: mode train, mode report; docs/data.md)"
        )
    if not p.is_file():
        raise ValueError(f"data={str(path)!r}: no such file")
    raw = p.read_bytes()
    if not raw:
        raise ValueError(f"data={str(path)!r}: the file is empty")
    if b"\x00" in raw[: 1 << 20]:
        raise ValueError(f"data={str(path)!r}: looks binary (contains NUL bytes); must be UTF-8 text")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"data={str(path)!r}: not valid UTF-8 ({e.reason} at byte {e.start}); must be UTF-8 text"
        ) from None
    if len(raw) < min_bytes:
        raise ValueError(
            f"data={str(path)!r}: {len(raw)} bytes is too short; needs at least {min_bytes} "
            "(enough for training and validation windows)"
        )
    cut = int(len(raw) * (1 - val_fraction))
    arr = np.frombuffer(raw, dtype=np.uint8)
    return Corpus(train=arr[:cut], val=arr[cut:], source=str(p))


def token_corpus(path: str | os.PathLike, seq_len: int | None = None) -> Corpus:
    """A folder of token shards (rules: ``mode.train.tokens``); ``seq_len`` checks both splits hold a window."""
    folder = open_token_folder(path, seq_len)
    return Corpus(
        train=folder.train,
        val=folder.val,
        source=folder.source,
        vocab_size=folder.vocab_size,
        tokenizer=folder.tokenizer,
        path=str(folder.path),
    )


def min_file_bytes(seq_len: int, val_fraction: float = 0.1) -> int:
    """Smallest file whose validation split still holds two windows of ``seq_len + 1`` bytes."""
    return int(np.ceil(2 * (seq_len + 1) / val_fraction))


class Windows:
    """The windows of ``seq_len + 1`` ids of a split: window g is the g-th start over its parts in order (part
    p offers N_p - S - 1 starts; no window crosses a part's end). Reads only the windows asked for."""

    def __init__(self, split: Split, seq_len: int, what: str = "data"):
        self.parts, self.seq_len = split_parts(split), seq_len
        self.ends_P = np.cumsum([max(0, len(p) - seq_len - 1) for p in self.parts])  # starts before part p + 1
        self.count = int(self.ends_P[-1])
        if self.count < 1:
            n = split_tokens(split)
            many = "" if len(self.parts) == 1 else f" in {len(self.parts)} shards, none longer than {seq_len + 1}"
            raise ValueError(
                f"{what} has {n} tokens{many}: needs more than seq_len + 1 = {seq_len + 1}"
                + (" in one shard (windows never cross a shard's end)" if many else "")
            )

    def read(self, starts_W: Tensor) -> Tensor:
        """The windows ``starts_W`` (global start indices) as int64 ids, shape (W, S + 1)."""
        part_W = np.searchsorted(self.ends_P, starts_W.numpy(), side="right")
        rows = []
        for g, p in zip(starts_W.tolist(), part_W.tolist()):
            at = g - (int(self.ends_P[p - 1]) if p else 0)
            rows.append(np.asarray(self.parts[p][at : at + self.seq_len + 1], dtype=np.int64))
        return torch.from_numpy(np.stack(rows))


class BatchSampler:
    """Random training windows from a seeded generator whose state is checkpointed with the run.

    ``data``: one array of ids or token shards (``Split``); shards stay on disk, each batch reads its windows."""

    def __init__(self, data: Split, batch_size: int, seq_len: int, seed: int):
        self.windows = Windows(data, seq_len)
        self.batch_size, self.seq_len = batch_size, seq_len
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[Tensor, Tensor]:
        starts_B = torch.randint(
            0, self.windows.count, (self.batch_size,), generator=self.generator, device="cpu"
        )  # the generator is a CPU one, whatever the default device
        window_BS = self.windows.read(starts_B)
        return window_BS[:, :-1], window_BS[:, 1:]


def eval_batches(data: Split, batch_size: int, seq_len: int, num_batches: int) -> list[tuple[Tensor, Tensor]]:
    """Fixed, evenly spaced validation windows (the same for every model and every evaluation)."""
    n_windows = batch_size * num_batches
    windows = Windows(data, seq_len, "validation split")
    starts = torch.linspace(0, windows.count - 1, n_windows, device="cpu").long()  # host indices, read by numpy
    window_WS = windows.read(starts)
    return [(w[:, :-1], w[:, 1:]) for w in window_WS.split(batch_size)]


# ----------------------------------------------------------------------------------------------- decoding


@dataclass(frozen=True)
class Codec:
    """Text to ids and back, for prompts and samples."""

    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    name: str


def text_codec(record: dict | None, where: str, tokenizer: str | os.PathLike | None = None) -> Codec:
    """The codec of a checkpoint's data (``Corpus.record()``, None for checkpoints older than it: bytes).
    Token data decodes with its tokenizer: the recorded file, or ``tokenizer`` (a copy of it; same sha256)."""
    if record is None or record.get("kind", "bytes") == "bytes":
        if tokenizer is not None:
            raise ValueError(
                f"{where}: tokenizer={str(tokenizer)!r}: the checkpoint was trained on bytes, which need no tokenizer"
            )
        return Codec(lambda text: encode(text).tolist(), decode, "bytes")
    if record.get("tokenizer") is None:
        if tokenizer is None:
            raise ValueError(
                f"{where}: trained on token ids ({record.get('source')}) with no tokenizer recorded; "
                "pass --tokenizer PATH (the tokenizer.json the shards were written with)"
            )
        tok = load_tokenizer(tokenizer)
    else:
        tok = TokenizerRef.from_dict(record["tokenizer"], where).load(where, tokenizer)
    return Codec(
        lambda text: tok.encode(text, add_special_tokens=False).ids,
        lambda ids: tok.decode([int(i) for i in ids], skip_special_tokens=False),
        "tokens",
    )

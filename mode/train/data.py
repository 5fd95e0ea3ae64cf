"""Byte-level text data: the built-in corpus (the Python standard library's own sources) or any file.

Shape legend: B batch, S sequence length. Tokens are bytes (vocabulary 256), so any UTF-8 text works
without a trained tokenizer.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

VOCAB_SIZE = 256
VAL_EVERY_NTH_FILE = 20  # built-in corpus: every 20th source file (in sorted order) is held out


def encode(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def decode(ids) -> str:
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


@dataclass
class Corpus:
    train: np.ndarray  # uint8 byte ids
    val: np.ndarray
    source: str  # where it came from, for logs

    def __post_init__(self) -> None:
        for split in ("train", "val"):
            if len(getattr(self, split)) == 0:
                raise ValueError(f"corpus {self.source!r}: the {split} split is empty")


def stdlib_sources() -> list[Path]:
    """The standard library's .py files in a deterministic (sorted) order, tests and site-packages excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def stdlib_corpus(max_bytes: int | None = None) -> Corpus:
    """Built-in corpus, split by file: every ``VAL_EVERY_NTH_FILE``-th file is validation."""
    files = stdlib_sources()
    if not files:
        raise ValueError(f"no .py files found under {sysconfig.get_paths()['stdlib']!r}")
    train, val, n = [], [], 0
    for i, path in enumerate(files):
        data = path.read_bytes()
        (val if i % VAL_EVERY_NTH_FILE == VAL_EVERY_NTH_FILE - 1 else train).append(data)
        n += len(data)
        if max_bytes is not None and n >= max_bytes:
            break
    joined = [np.frombuffer(b"\n".join(parts), dtype=np.uint8) for parts in (train, val)]
    return Corpus(train=joined[0], val=joined[1], source=f"python-stdlib ({i + 1} files)")


def file_corpus(path: str | os.PathLike, min_bytes: int, val_fraction: float = 0.1) -> Corpus:
    """Any UTF-8 text file; the last ``val_fraction`` of it is validation."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"data={str(path)!r}: no such file")
    raw = p.read_bytes()
    if not raw:
        raise ValueError(f"data={str(path)!r}: the file is empty")
    if b"\x00" in raw[:1 << 20]:
        raise ValueError(f"data={str(path)!r}: looks binary (contains NUL bytes); must be UTF-8 text")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"data={str(path)!r}: not valid UTF-8 ({e.reason} at byte {e.start}); "
                         "must be UTF-8 text") from None
    if len(raw) < min_bytes:
        raise ValueError(f"data={str(path)!r}: {len(raw)} bytes is too short; needs at least {min_bytes} "
                         "(enough for training and validation windows)")
    cut = int(len(raw) * (1 - val_fraction))
    arr = np.frombuffer(raw, dtype=np.uint8)
    return Corpus(train=arr[:cut], val=arr[cut:], source=str(p))


def min_file_bytes(seq_len: int, val_fraction: float = 0.1) -> int:
    """Smallest file whose validation split still holds two windows of ``seq_len + 1`` bytes."""
    return int(np.ceil(2 * (seq_len + 1) / val_fraction))


class BatchSampler:
    """Random training windows from a seeded generator whose state is checkpointed with the run."""

    def __init__(self, data: np.ndarray, batch_size: int, seq_len: int, seed: int):
        if len(data) < seq_len + 2:
            raise ValueError(f"data has {len(data)} tokens: needs more than seq_len + 1 = {seq_len + 1}")
        self.data = torch.from_numpy(data.astype(np.int64))
        self.batch_size, self.seq_len = batch_size, seq_len
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[Tensor, Tensor]:
        starts_B = torch.randint(0, len(self.data) - self.seq_len - 1, (self.batch_size,), generator=self.generator,
                                 device="cpu")  # the generator is a CPU one, whatever the default device
        window_BS = self.data[starts_B[:, None] + torch.arange(self.seq_len + 1, device="cpu")]
        return window_BS[:, :-1], window_BS[:, 1:]


def eval_batches(data: np.ndarray, batch_size: int, seq_len: int, num_batches: int) -> list[tuple[Tensor, Tensor]]:
    """Fixed, evenly spaced validation windows (the same for every model and every evaluation)."""
    n_windows = batch_size * num_batches
    span = len(data) - seq_len - 1
    if span < 1:
        raise ValueError(f"validation split has {len(data)} tokens: needs more than seq_len + 1 = {seq_len + 1}")
    tokens = torch.from_numpy(data.astype(np.int64))
    starts = torch.linspace(0, span - 1, n_windows).long()
    windows = tokens[starts[:, None] + torch.arange(seq_len + 1)]
    return [(w[:, :-1], w[:, 1:]) for w in windows.split(batch_size)]

"""``mode tokenize``: text to a folder of token shards that ``mode train --data FOLDER`` reads.

    mode tokenize --tokenizer tokenizer.json --out data/stdlib-bpe                  # the built-in corpus
    mode tokenize notes.txt --tokenizer tokenizer.json --out data/notes             # one file
    mode tokenize texts/ --tokenizer tokenizer.json --out data/texts --eot '<|endoftext|>'

The tokenizer is a Hugging Face ``tokenizer.json`` (``tokenizers.Tokenizer.from_file``); nothing is
downloaded. Every document (a file) is encoded on its own, with ``eot``'s id after it when one is given.

The split (the same rules as the byte corpora, ``mode.train.data``)
    the built-in corpus, or a folder of 20 or more files: every ``VAL_EVERY_NTH_FILE``-th file (in sorted
    order) is validation, or the last one when a byte budget keeps fewer (``mode.train.data.val_files``); one file, or a
    folder of fewer: the last ``VAL_FRACTION`` of the tokens.

The output (format: ``mode.train.tokens``)
    OUT/train_000.bin ...   ids as raw little-endian uint16 (vocabularies up to 65536) or uint32, at most
    OUT/val_000.bin ...     ``shard_tokens`` ids a shard
    OUT/tokenizer.json      a copy of the tokenizer, so that the folder is whole on its own
    OUT/meta.json           dtype, vocab_size, the tokenizer's path (relative) and sha256, every shard's tokens
Each file is written atomically (temp file, fsync, rename: ``mode.train.checkpoint.atomic_write``) and
meta.json last: a folder without meta.json is an interrupted run (and its .bin shards are refused).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mode import _checks
from mode.train import checkpoint
from mode.train.data import VAL_EVERY_NTH_FILE, stdlib_sources, val_files
from mode.train.tokens import (
    META,
    SUFFIXES,
    VAL_FRACTION,
    ShardSpec,
    TokenizerRef,
    TokenMeta,
    dtype_for_vocab,
    load_tokenizer,
)

DEFAULT_SHARD_TOKENS = 100_000_000  # ids a shard (200 MB as uint16)
TOKENIZER_FILE = "tokenizer.json"
ENCODE_BATCH = 64  # documents encoded at once (tokenizers' encode_batch)


@dataclass(frozen=True)
class Document:
    name: str  # for errors
    text: str
    val: bool | None  # None: split by token fraction


def _decode(raw: bytes, path: Path) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"text={str(path)!r}: not valid UTF-8 ({e.reason} at byte {e.start}); must be UTF-8 text"
        ) from None


def documents(text: str | os.PathLike | None, max_bytes: int | None = None) -> tuple[list[Document], str]:
    """The documents of ``text`` (None: the built-in corpus, its first ``max_bytes`` bytes in whole files) with
    their split, and a description of the source."""
    if text is None:
        files = stdlib_sources()
        if not files:
            raise ValueError("the built-in corpus: no standard-library .py files found")
        root = Path(os.path.commonpath([str(f) for f in files]))
        by_file = True
        what = "python-stdlib"
    else:
        root = Path(text)
        if root.is_file():
            files, by_file, what = [root], False, str(root)
        elif root.is_dir():
            files = sorted(
                (
                    p
                    for p in root.rglob("*")
                    if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
                ),
                key=lambda p: p.relative_to(root).as_posix(),
            )
            if not files:
                raise ValueError(f"text={str(text)!r}: the folder holds no files")
            by_file, what = len(files) >= VAL_EVERY_NTH_FILE, str(root)
        else:
            raise ValueError(f"text={str(text)!r}: no such file or folder")
    read, n = [], 0
    for path in files:
        raw = path.read_bytes()
        read.append((str(path), raw.decode("utf-8", errors="replace") if text is None else _decode(raw, path)))
        n += len(raw)  # counted as stdlib_corpus counts: bytes of whole files, at least 2 when split by file
        if max_bytes is not None and n >= max_bytes and (len(read) >= 2 or not by_file):
            break
    val = val_files(len(read)) if by_file else [None] * len(read)
    docs = [Document(name, body, v) for (name, body), v in zip(read, val)]
    return docs, f"{what} ({len(docs)} files)" if len(docs) > 1 else what


class ShardWriter:
    """Appends ids to one split's shards, writing a shard (atomically) each time ``shard_tokens`` are held."""

    def __init__(self, out: Path, split: str, dtype: str, shard_tokens: int):
        self.out, self.split, self.dtype, self.shard_tokens = out, split, dtype, shard_tokens
        self.pending: list[np.ndarray] = []
        self.held = 0
        self.shards: list[ShardSpec] = []

    def add(self, ids_N: np.ndarray) -> None:
        while len(ids_N):
            take = min(len(ids_N), self.shard_tokens - self.held)
            self.pending.append(ids_N[:take])
            self.held += take
            ids_N = ids_N[take:]
            if self.held == self.shard_tokens:
                self.flush()

    def flush(self) -> None:
        if not self.held:
            return
        ids_N = np.concatenate(self.pending).astype(np.dtype(self.dtype).newbyteorder("<"))  # nanoGPT's layout
        name = f"{self.split}_{len(self.shards):03d}.bin"
        checkpoint.atomic_write(self.out / name, ids_N.tobytes())
        self.shards.append(ShardSpec(name, self.split, len(ids_N)))
        self.pending, self.held = [], 0


def _encoded(tok, docs: list[Document], eot_id: int | None) -> Iterator[tuple[Document, np.ndarray]]:
    for i in range(0, len(docs), ENCODE_BATCH):
        batch = docs[i : i + ENCODE_BATCH]
        for doc, enc in zip(batch, tok.encode_batch([d.text for d in batch], add_special_tokens=False)):
            ids = enc.ids if eot_id is None else [*enc.ids, eot_id]
            yield doc, np.asarray(ids, dtype=np.int64)


def tokenize(
    tokenizer: str | os.PathLike,
    out: str | os.PathLike,
    text: str | os.PathLike | None = None,
    *,
    max_bytes: int | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    eot: str | None = None,
    progress=None,
    force: bool = False,
) -> TokenMeta:
    """Encode ``text`` (a file, a folder of files, or None: the built-in corpus) with ``tokenizer`` into shards
    in ``out``; returns what meta.json says. ``progress``: called with a line of text per shard written.
    ``out`` must hold no shards, ``meta.json`` or other ``tokenizer.json`` (``ValueError``) unless ``force``,
    which deletes them first."""
    _checks.check_int("shard_tokens", shard_tokens)
    if max_bytes is not None:
        _checks.check_int("max_bytes", max_bytes)
    tok_path = Path(tokenizer)
    if not tok_path.is_file():
        raise ValueError(f"tokenizer={str(tokenizer)!r}: no such file (a Hugging Face tokenizer.json)")
    tok = load_tokenizer(tok_path)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    eot_id = None
    if eot is not None:
        eot_id = tok.token_to_id(eot)
        if eot_id is None:
            raise ValueError(
                f"eot={eot!r}: not a token of {str(tok_path)!r}; give a token in its vocabulary "
                "(e.g. a special token such as <|endoftext|>) or leave it out"
            )
    docs, source = documents(text, max_bytes)
    out_dir = checkpoint.prepare_dir(out, "out")
    tok_copy = out_dir / TOKENIZER_FILE
    other_tokenizer = (
        tok_copy.exists()
        and tok_path.resolve() != tok_copy.resolve()
        and tok_copy.read_bytes() != tok_path.read_bytes()
    )
    taken = sorted(
        p
        for p in out_dir.iterdir()
        if p.suffix in SUFFIXES or p.name == META or (p.name == TOKENIZER_FILE and other_tokenizer)
    )
    if taken and not force:
        more = f" (and {len(taken) - 1} more)" if len(taken) > 1 else ""
        raise ValueError(
            f"out={str(out)!r}: already holds {taken[0].name!r}{more}; write the shards into a new or "
            "empty folder (an old shard there would be read with the new ones), or pass --force to "
            "delete them and write the new ones"
        )
    for path in taken:
        path.unlink()
    dtype = dtype_for_vocab(vocab)
    writers = {split: ShardWriter(out_dir, split, dtype, shard_tokens) for split in ("train", "val")}
    tail: list[np.ndarray] = []  # documents split by token fraction: held until the cut is known
    for doc, ids_N in _encoded(tok, docs, eot_id):
        if len(ids_N) and int(ids_N.max()) >= vocab:  # cannot happen with a consistent tokenizer.json
            raise ValueError(f"{doc.name}: the tokenizer gave id {int(ids_N.max())} >= its vocab_size={vocab}")
        if doc.val is None:
            tail.append(ids_N)
        else:
            writers["val" if doc.val else "train"].add(ids_N)
    if tail:
        ids_N = np.concatenate(tail)
        cut = int(len(ids_N) * (1 - VAL_FRACTION))
        writers["train"].add(ids_N[:cut])
        writers["val"].add(ids_N[cut:])
    for w in writers.values():
        w.flush()
    if not writers["train"].shards:
        raise ValueError(
            f"text={str(text) if text is not None else 'the built-in corpus'!r}: no training tokens (the text is empty)"
        )
    if tok_path.resolve() != tok_copy.resolve():
        checkpoint.atomic_write(tok_copy, tok_path.read_bytes())
    ref = TokenizerRef(TOKENIZER_FILE, checkpoint.sha256_file(tok_copy))  # relative: the folder moves as one
    shards = tuple(writers["train"].shards + writers["val"].shards)
    meta = TokenMeta(dtype, vocab, ref, shards, source)
    checkpoint.atomic_write_text(out_dir / META, json.dumps(meta.to_json(), indent=2) + "\n")
    if progress is not None:
        for s in shards:
            progress(f"{s.file}: {s.tokens:,} tokens")
    return meta

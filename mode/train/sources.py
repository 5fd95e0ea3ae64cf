"""What ``--data`` names, as one ``Corpus``: the built-in corpus (the standard library's sources), the installed
packages' sources (``packages``), a folder of token shards, or a UTF-8 text file. Its own module so that
``mode.train.data`` (the corpora and the sampler) and ``mode.train.packages`` (which builds on it) import no
circle."""

from __future__ import annotations

import os
from pathlib import Path

from mode.train.data import PACKAGES, Corpus, file_corpus, min_file_bytes, stdlib_corpus, token_corpus
from mode.train.packages import packages_corpus


def load_corpus(data: str | os.PathLike | None, seq_len: int, max_bytes: int | None = None) -> Corpus:
    """What ``--data`` names: ``packages`` (the installed packages' sources: ``mode.train.packages``; a file
    of that name is ``./packages``), a folder of token shards, a UTF-8 text file, or (None) the built-in
    corpus (its first ``max_bytes`` bytes, whole files)."""
    if data is None:
        return stdlib_corpus(max_bytes=max_bytes)
    if str(data) == PACKAGES:
        return packages_corpus(log=print)
    if Path(data).is_dir():
        return token_corpus(data, seq_len)
    return file_corpus(data, min_file_bytes(seq_len))

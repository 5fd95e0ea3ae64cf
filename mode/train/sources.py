"""What ``--data`` names, as one ``Corpus``: the built-in corpus (the standard library's sources), the installed
packages' sources (``packages``), a folder of token shards, or a UTF-8 text file. Its own module so that
``mode.train.data`` (the corpora and the sampler) and ``mode.train.packages`` (which builds on it) import no
circle."""

from __future__ import annotations

import os
from pathlib import Path

from mode.train.data import PACKAGES, Corpus, file_corpus, min_file_bytes, stdlib_corpus, token_corpus
from mode.train.packages import packages_corpus


def load_corpus(
    data: str | os.PathLike | None, seq_len: int, max_bytes: int | None = None, log=print, token_folders: bool = True
) -> Corpus:
    """What ``--data`` names: ``packages`` (the installed packages' sources: ``mode.train.packages``; a file
    of that name is ``./packages``), a folder of token shards, a UTF-8 text file, or (None) the built-in
    corpus (its first ``max_bytes`` bytes, whole files). ``token_folders=False`` (the byte-level sweeps) reads
    a folder as a text file, which refuses it. ``log`` takes the packages corpus's progress lines."""
    if data is None:
        return stdlib_corpus(max_bytes=max_bytes)
    if str(data) == PACKAGES:
        return packages_corpus(log=log)
    if token_folders and Path(data).is_dir():
        return token_corpus(data, seq_len)
    return file_corpus(data, min_file_bytes(seq_len))

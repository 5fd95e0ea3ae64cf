"""Text cut into token windows for fitting, healing and held-out losses of a converted model.

Shape legend: W windows, S sequence.

``token_windows`` tokenizes documents, puts the end-of-text id after each, and cuts the stream into whole
windows (the tail shorter than a window is dropped). ``english_windows`` is the built-in English text: the
Python documentation's topics (``pydoc_data.topics``, shipped with CPython), every 4th topic held out, so no
held-out window shares a document with a training one. ``docstring_windows`` is more built-in English text for
training only: the standard library's docstrings, read from its source files by ``ast`` (parsed, never imported
or run), the tests and ``pydoc_data`` (the held-out text's source) left out. ``file_windows`` reads a UTF-8 file
and holds out its last tenth.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import json
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import torch

from mode import _checks


def token_windows(tokenizer, texts: Sequence[str], seq_len: int) -> torch.Tensor:
    """``(W, S)`` token ids of ``texts`` (each followed by the tokenizer's end-of-text id, 0 if it has none)
    cut into windows of ``seq_len``; a tail shorter than a window is dropped."""
    _checks.check_int("seq_len", seq_len, min_value=2)
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    ids: list[int] = []
    for text in texts:
        ids += list(tokenizer(text)["input_ids"]) + [eos]
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def english_windows(tokenizer, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train_WS, held_out_WS)``: the Python documentation's topics, every 4th topic held out."""
    from pydoc_data.topics import topics

    keys = sorted(topics)
    train = [topics[k] for i, k in enumerate(keys) if i % 4 != 3]
    held = [topics[k] for i, k in enumerate(keys) if i % 4 == 3]
    return token_windows(tokenizer, train, seq_len), token_windows(tokenizer, held, seq_len)


# stdlib folders whose docstrings are not training text: tests, and pydoc_data (english_windows' held-out topics)
_DOC_SKIP = frozenset({"test", "tests", "idle_test", "pydoc_data", "site-packages", "dist-packages", "__pycache__"})
_DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def stdlib_docstrings(min_chars: int = 80, root: str | Path | None = None) -> list[str]:
    """The distinct docstrings of at least ``min_chars`` characters of the modules, classes and functions under
    ``root`` (None: this Python's standard library), in sorted file order, each file's breadth first
    (``ast.walk``). Files are parsed with ``ast``, never imported; a file that does not parse is passed over.
    Folders in ``_DOC_SKIP`` (tests, ``pydoc_data``) are left out. The text depends on the Python version.
    Read once per process for each (``min_chars``, ``root``)."""
    _checks.check_int("min_chars", min_chars, min_value=1)
    return list(_docstrings(min_chars, stdlib_root(root)))


def stdlib_root(root: str | Path | None = None) -> Path:
    """``root`` as a folder (None: this Python's standard library); ``ValueError`` when it is not one."""
    base = Path(sysconfig.get_paths()["stdlib"] if root is None else root)
    if not base.is_dir():
        raise ValueError(f"root={str(base)!r}: not a directory")
    return base


def source_files(base: Path) -> list[Path]:
    """The ``*.py`` files under ``base``, sorted, those in ``_DOC_SKIP`` folders (tests, ``pydoc_data``) left out."""
    return [p for p in sorted(base.rglob("*.py")) if not _DOC_SKIP.intersection(p.relative_to(base).parts[:-1])]


@functools.lru_cache(maxsize=4)
def _docstrings(min_chars: int, base: Path) -> tuple[str, ...]:
    files = source_files(base)
    cached = _docstring_cache(min_chars, base, files)
    try:
        return tuple(json.loads(cached.read_text(encoding="utf-8")))
    except (OSError, ValueError):  # not there yet, or unreadable: parse again
        pass
    docs: list[str] = []
    seen: set[str] = set()
    for path in files:
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            doc = ast.get_docstring(node) if isinstance(node, _DOC_NODES) else None
            if doc and len(doc) >= min_chars and doc not in seen:
                seen.add(doc)
                docs.append(doc)
    with contextlib.suppress(OSError):  # a read-only cache only costs the parse next time
        from mode.train.checkpoint import atomic_write_text

        cached.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(cached, json.dumps(docs))
    return tuple(docs)


def _docstring_cache(min_chars: int, base: Path, files: list[Path]) -> Path:
    """Where ``_docstrings`` keeps what it parsed (``$MODE_CACHE/docstrings``, JSON): parsing the standard library
    takes ~9 CPU-seconds, reading this ~0.1. Keyed by the Python version, ``min_chars``, the folder and every
    file's path, size and modification time, so an edited or added file parses again."""
    from mode.hf.pretrained import cache_root

    h = hashlib.sha256(f"{sys.version}|{min_chars}|{base.resolve()}".encode())
    for path in files:
        st = path.stat()
        h.update(f"\n{path.relative_to(base)}|{st.st_size}|{st.st_mtime_ns}".encode())
    return cache_root() / "docstrings" / f"{h.hexdigest()[:32]}.json"


def docstring_windows(tokenizer, seq_len: int) -> torch.Tensor:
    """``(W, S)`` windows of ``stdlib_docstrings()``: training text beside ``english_windows`` (no document of
    its held-out topics is among them)."""
    return token_windows(tokenizer, stdlib_docstrings(), seq_len)


def calibration_docstring_windows(tokenizer, seq_len: int, n: int) -> torch.Tensor:
    """``(n, S)`` windows spread evenly over ``docstring_windows``: text unlike the training text, for setting
    a threshold router's causal thresholds (``calibrate``) where the fit windows would understate the share it
    routes on new text."""
    _checks.check_int("n", n)
    doc_WS = docstring_windows(tokenizer, seq_len)
    return doc_WS[torch.linspace(0, len(doc_WS) - 1, n).long()]


def batches_of(windows_WS: torch.Tensor, size: int) -> list[torch.Tensor]:
    """``windows_WS`` in order as consecutive batches of ``size`` windows, ``(size, S)`` each (the last holds the
    remainder); no windows, no batches."""
    _checks.check_int("size", size)
    return [windows_WS[i : i + size] for i in range(0, len(windows_WS), size)]


def heal_batches_of(
    train_WS: torch.Tensor, steps: int, per_step: int, seed: int, extra_WS: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """A heal's batches, ``(per_step, S)`` each, in an order drawn by ``seed``: ``train_WS`` shuffled, its first
    ``steps * per_step`` windows (``heal`` cycles the batches when the budget is larger). With ``extra_WS`` (e.g.
    ``docstring_windows``): every training window once and the rest of the budget drawn from ``extra_WS``
    without repeats (cycled only beyond both), all shuffled together."""
    _checks.check_int("steps", steps)
    _checks.check_int("per_step", per_step)
    g = torch.Generator().manual_seed(seed)
    need = steps * per_step
    pool_WS = train_WS
    fill = 0 if extra_WS is None else min(len(extra_WS), max(0, need - len(train_WS)))
    if fill:
        assert extra_WS is not None
        pool_WS = torch.cat([train_WS, extra_WS[torch.randperm(len(extra_WS), generator=g)[:fill]]])
    order = torch.randperm(len(pool_WS), generator=g)[:need]
    return batches_of(pool_WS[order], per_step)


def file_windows(tokenizer, path: str | Path, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train_WS, held_out_WS)`` of a UTF-8 text file: its windows, the last tenth (at least one) held out.
    Raises ``ValueError`` when the file makes fewer than 2 windows."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"data={str(path)!r}: not a file (a UTF-8 text file is expected)")
    windows_WS = token_windows(tokenizer, [path.read_text(encoding="utf-8")], seq_len)
    if len(windows_WS) < 2:
        raise ValueError(
            f"data={str(path)!r}: makes {len(windows_WS)} window(s) of {seq_len} tokens; at least 2 are needed "
            "(one to fit on, one held out)"
        )
    held = max(1, len(windows_WS) // 10)
    return windows_WS[:-held], windows_WS[-held:]

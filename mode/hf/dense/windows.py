"""Text cut into token windows for fitting, healing and held-out losses of a converted model.

Shape legend: W windows, S sequence.

``token_windows`` tokenizes documents, puts the end-of-text id after each, and cuts the stream into whole
windows (the tail shorter than a window is dropped). ``english_windows`` is the built-in English text: the
Python documentation's topics (``pydoc_data.topics``, shipped with CPython), every 4th topic held out, so no
held-out window shares a document with a training one. ``file_windows`` reads a UTF-8 file and holds out its
last tenth.
"""

from __future__ import annotations

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

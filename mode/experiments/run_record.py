"""What `mode compare` and `mode isoflop` record in their output folder so that a killed run resumes.

``OUT/<run_file>`` holds the arguments that determine the numbers (the *identity*). A rerun with the same
identity resumes: finished runs (their ``result.json``) are skipped, an interrupted one continues from its
``ckpt.pt``. A rerun with another identity is refused, naming the first difference, unless ``fresh``, which
removes what the earlier run left (its record, reports, checkpoints and results) and starts over.
See docs/checkpoints.md.
"""

from __future__ import annotations

import json
import shutil
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import cast

import numpy as np

from mode.train import checkpoint
from mode.train.data import Corpus, split_parts, split_tokens
from mode.train.packages import PackagesInfo

_CHUNK = 1 << 24


def _crc32(split, crc: int) -> int:
    """CRC32 of a split's bytes (an array, or memory-mapped parts), read in chunks: no copy of the whole."""
    for part in split_parts(split):
        ids = part.ids_N if hasattr(part, "ids_N") else part
        for i in range(0, len(ids), _CHUNK):
            crc = zlib.crc32(np.ascontiguousarray(ids[i : i + _CHUNK]).data, crc)  # .data: the same bytes
    return crc


def fingerprint(corpus: Corpus) -> dict:
    """Sizes and CRC32 of the training and validation bytes: a rerun must train on the same text. The
    packages corpus (``--data packages``) adds its file count and list hash (mode.train.packages)."""
    out = {"train_bytes": split_tokens(corpus.train), "val_bytes": split_tokens(corpus.val)}
    if corpus.packages is not None:  # its CRC was computed as it was built, the same way
        info = cast(PackagesInfo, corpus.packages)
        return {**out, "crc32": info.crc32, "files": info.files, "list_sha256": info.list_sha256}
    return {**out, "crc32": _crc32(corpus.val, _crc32(corpus.train, 0))}


def differences(saved, now, prefix: str = "") -> list[tuple[str, object, object]]:
    """(dotted key, saved value, new value) for every leaf that differs."""
    if isinstance(saved, dict) and isinstance(now, dict):
        out = []
        for key in [*saved, *(k for k in now if k not in saved)]:
            out += differences(saved.get(key), now.get(key), f"{prefix}{key}.")
        return out
    return [] if saved == now else [(prefix[:-1], saved, now)]


def start_or_resume(out: Path, identity: dict, fresh: bool, *, run_file: str, kind: str, stale: Iterable[Path]) -> bool:
    """True: resume the run recorded in ``out / run_file`` (same identity). False: start over, after
    removing the files in ``stale`` (what an earlier run left), so that nothing stale is resumed or shown as
    this run's result. ``kind`` names the command in messages and in the record's format. Without a record, any
    of ``stale`` that exists is refused (``checkpoint.OutputExistsError``) unless ``fresh``: a folder holding
    files of these names that no run recorded is not this command's to replace."""
    record = out / run_file
    identity = json.loads(json.dumps(identity))  # as stored: tuples are lists
    if record.is_file() and not fresh:
        try:
            saved = json.loads(record.read_text())
            saved_args = saved["args"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"{record}: not a readable record of a {kind} run ({type(e).__name__}: {e}); pass --fresh to start over"
            ) from None
        diffs = differences(saved_args, identity)
        if diffs:
            key, was, now = diffs[0]
            more = f" (and {len(diffs) - 1} more)" if len(diffs) > 1 else ""
            raise ValueError(
                f"out={str(out)!r} holds a run with other arguments: {key}={was!r} there, "
                f"{key}={now!r} now{more} (recorded in {record}). Rerun with the same arguments "
                "to resume it, pass --fresh to discard it and start over (--force is the same), or choose "
                "another --out"
            )
        return True
    if not fresh:  # no record: files no run of this kind recorded are not this command's to replace
        checkpoint.refuse_existing(
            [record, *stale],
            hint=f"no {kind} run is recorded in out={str(out)!r} ({run_file}) to resume: choose another --out, or ",
        )
    for path in [record, *stale]:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    checkpoint.atomic_write_text(
        record, json.dumps({"format": f"mode-{kind}-run", "version": 1, "args": identity}, indent=2)
    )
    return False


def read_result(path: Path, required: tuple[str, ...]) -> dict:
    """A finished run's ``result.json`` (a dict holding the keys ``required``)."""
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: unreadable result of a finished run ({e}); pass --fresh to start over") from None
    if not isinstance(result, dict) or any(k not in result for k in required):
        raise ValueError(f"{path}: not the result of a finished run; pass --fresh to start over")
    return result

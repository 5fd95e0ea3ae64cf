"""Resuming from the newest checkpoint that verifies: a newest save that fails its checksums, or was never
completed, is skipped with a warning naming it, and the one before is used.

    candidates(path)         what to try, newest first: the complete saves of a sharded folder (those with a
                             ``SHA256SUMS``, written after every other file of the save; the one ``latest``
                             names comes first at equal steps), or the single file and the older ones kept
                             beside it (``ckpt-step-NNNNNNNN.pt``, ``OneProcess(keep=K)``)
    load_newest(trainer, …)  ``trainer.load`` each in turn until one loads; every failure that is the file's
                             fault (``CheckpointError``: a checksum, a truncated or missing file) is a warning
                             and the next is tried; any other error (a different model: a user mistake) is
                             raised. Then rank 0 moves the skipped saves aside (``bad-step-…``, kept for
                             inspection, never tried again) and points ``latest`` at the one loaded. When none
                             loads: an error naming each, or with ``fresh_if_none`` (``--resume auto``) the bad
                             ones moved aside (a single file too: ``bad-ckpt.pt``) and a new run, with a warning.

Every rank tries the same candidates in the same order and, on a file system they share (docs/distributed.md),
sees the same bytes: a bad file fails the load on every rank alike (DCP gathers the failures of its planning
step, where each rank verifies the files it is about to read, ``mode.parallel.dcp_safe``), before any tensor
changes, so the ranks move to the next candidate together.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from mode.parallel import checkpoint as sharded
from mode.train import checkpoint
from mode.train.runtime import kept_checkpoints, link_or_copy

BAD_PREFIX = "bad-"  # a save that failed to load, moved aside: no longer a ``step-*`` folder


def candidates(path: str | Path) -> list[Path]:
    """The checkpoints to try for ``path``, newest first (see the module docstring)."""
    path = Path(path)
    if (path / ".metadata").is_file():
        return [path]  # one save folder named explicitly
    if not path.is_dir():  # a single file, and those kept beside it (the newest is a link to it: a bad one is
        kept = kept_checkpoints(path)  # skipped twice, and both are moved aside)
        return ([path] if path.is_file() or not kept else []) + kept
    named = (path / sharded.LATEST).read_text().strip() if (path / sharded.LATEST).is_file() else None
    found = [f for f in sharded.saves(path) if sharded.is_complete(f) or f.name == named]  # named: a pre-checksum save
    return found or [path]  # none: the folder itself, whose load names what is missing


def load_newest(trainer, path: str | Path, rank: int = 0, fresh_if_none: bool = False, say=print) -> Path | None:
    """Resume ``trainer`` from the newest of ``candidates(path)`` that loads; returns it. When none does: a
    ``CheckpointError`` naming every one tried, or with ``fresh_if_none`` None (the trainer untouched: a new run)."""
    tried = candidates(path)
    if len(tried) == 1 and not fresh_if_none:  # nothing to fall back to: its own error
        trainer.load(tried[0])
        return tried[0]
    skipped: list[tuple[Path, str]] = []
    for ckpt in tried:
        try:
            trainer.load(ckpt)
        except checkpoint.CheckpointError as e:
            skipped.append((ckpt, str(e)))
            if rank == 0:
                say(f"mode train: warning: skipping checkpoint {str(ckpt)!r}: {e}", file=sys.stderr, flush=True)
            continue
        if rank == 0 and skipped:
            _set_aside(Path(path), ckpt, [s for s, _ in skipped])
            say(
                f"mode train: warning: resumed from the previous verified checkpoint {str(ckpt)!r} (step "
                f"{trainer.step}); the {len(skipped)} newer one(s) that failed were moved aside",
                file=sys.stderr,
                flush=True,
            )
        return ckpt
    reasons = "; ".join(f"{str(c)!r}: {why}" for c, why in skipped)
    if not fresh_if_none:
        raise checkpoint.CheckpointError(f"no checkpoint in {str(path)!r} loads ({len(skipped)} tried: {reasons})")
    if rank == 0:
        _set_aside(Path(path), None, [s for s, _ in skipped])
        say(
            f"mode train: warning: no checkpoint in {str(path)!r} loads ({len(skipped)} tried; moved aside as "
            f"{BAD_PREFIX}*): starting a new run",
            file=sys.stderr,
            flush=True,
        )
    return None


def _set_aside(path: Path, loaded: Path | None, bad: list[Path]) -> None:
    """Rank 0: rename each bad checkpoint (a save of the sharded folder ``path``, or the file ``path`` and the
    files kept beside it) to ``bad-<name>``; make ``latest`` name ``loaded``, or the file ``path`` be it (None:
    nothing loaded, ``latest`` removed)."""
    for b in bad:
        if b.is_file() and b.parent == path.parent or b.parent == path and b.name.startswith(sharded.STEP_PREFIX):
            try:
                os.replace(b, b.parent / f"{BAD_PREFIX}{b.name}")
            except OSError:
                pass  # left in place: the next resume skips it again
    if loaded is not None and loaded.is_file() and loaded != path:
        link_or_copy(loaded, path)  # OUT/ckpt.pt is the checkpoint resumed from, should this run die now
        return
    latest = path / sharded.LATEST
    if loaded is not None and loaded.parent == path:
        checkpoint.atomic_write_text(latest, loaded.name + "\n")
    elif loaded is None and latest.is_file():
        latest.unlink()  # names a bad save: the new run's first save writes it again

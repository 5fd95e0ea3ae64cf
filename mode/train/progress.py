"""A training run's progress, for a person: a bar on a terminal, plain lines in a log file.

``Progress`` says how (a small config); ``Progress.start`` gives the one run's ``RunProgress``, which the
trainer feeds after every step and closes at the end. What it writes:

* the bar: tqdm on stderr, only when ``bar`` is set **and stderr is a terminal**. Redirected to a file, a
  bar's carriage-return redraws make one unreadable line, so there it never draws.
* plain lines on stdout, flushed one by one, every ``every_s`` seconds of the run::

      mod: step 120/248 (48%)  loss 2.8612  5,123 tok/s  ETA 25s

  and one when the run ends (``mod: step 248/248 done in 52s  loss 2.4011  4,980 tok/s``; ``stopped after``
  when it ends early). The periodic lines are left out only while a bar is drawn on the terminal that is
  also stdout (the person watching reads the bar); the end line always prints. So ``--no-progress`` turns
  the bar off, never the log, and ``mode compare > log`` gets lines, not redraws.

``lines=False`` writes no lines (the ranks of a mesh other than rank 0; library use that wants silence).
tokens/s is the trainer's running mean over its training steps (evaluation excluded); the ETA is the
remaining steps at the wall-clock pace of this run so far (evaluation and checkpoints included).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from mode import _checks

DEFAULT_EVERY_S = 20.0  # a 50-minute run writes ~150 lines; a minute-long one a few


def format_duration(seconds: float) -> str:
    """``45s``, ``3m05s``, ``1h02m``: short enough for a log line."""
    if not math.isfinite(seconds):
        return "?"
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def log_line(line: str) -> None:
    """One line on stdout, flushed at once (a log file read while the run goes on shows it)."""
    print(line, flush=True)


def _is_tty(stream) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


@dataclass(frozen=True)
class Progress:
    """How a run shows its progress. ``bar``: draw a tqdm bar when stderr is a terminal. ``every_s``: seconds
    between plain lines (0: one a step). ``lines``: write plain lines at all. ``out``/``err``: the streams
    for lines and bar (default: ``sys.stdout``/``sys.stderr`` as they are when the run starts). ``clock``:
    seconds (default ``time.monotonic``)."""

    bar: bool = True
    every_s: float = DEFAULT_EVERY_S
    lines: bool = True
    out: TextIO | None = None
    err: TextIO | None = None
    clock: Callable[[], float] | None = None  # seconds (default time.monotonic); the tests pass a fake one

    def __post_init__(self) -> None:
        _checks.check_bool("bar", self.bar)
        _checks.check_bool("lines", self.lines)
        _checks.check_non_negative("every_s", self.every_s)

    @classmethod
    def of(cls, progress: bool | Progress) -> Progress:
        """``True``/``False`` (bar or no bar, lines either way), or a ``Progress`` as it is."""
        if isinstance(progress, Progress):
            return progress
        if isinstance(progress, bool):
            return cls(bar=progress)
        raise TypeError(f"progress={progress!r}: must be a bool or a mode.train.progress.Progress")

    def start(self, name: str, total: int, initial: int = 0, clock=None) -> RunProgress:
        """The progress of one run from step ``initial`` to ``total`` (``clock``: seconds, for the tests)."""
        return RunProgress(self, name, total, initial, clock or self.clock or time.monotonic)


class RunProgress:
    """One run's bar and lines, from step ``initial`` to ``total``."""

    def __init__(self, cfg: Progress, name: str, total: int, initial: int = 0, clock=time.monotonic):
        self.name, self.total, self.initial = name, total, initial
        self.out = cfg.out if cfg.out is not None else sys.stdout
        err = cfg.err if cfg.err is not None else sys.stderr
        self.lines = cfg.lines
        self.every_s = cfg.every_s
        self.clock = clock
        self.bar = None
        if cfg.bar and _is_tty(err):  # a bar in a file is one line of carriage returns: never there
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=name, leave=False, dynamic_ncols=True, file=err)
        # periodic lines unless a person watches the bar on stdout's own terminal
        self.periodic = self.lines and not (self.bar is not None and _is_tty(self.out))
        self.t0 = self.last = clock()
        self.step, self.loss, self.tok_s = initial, math.nan, math.nan

    def update(self, step: int, loss: float, tok_s: float, postfix: dict | None = None) -> None:
        """After training step ``step``: ``loss`` (that step's), ``tok_s`` (the run's mean tokens/s);
        ``postfix``: more numbers for the bar."""
        self.step, self.loss, self.tok_s = step, loss, tok_s
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:,.0f}", **(postfix or {}))
        now = self.clock()
        if self.periodic and step < self.total and now - self.last >= self.every_s:
            self.last = now
            pace = (now - self.t0) / max(step - self.initial, 1)  # seconds per step, this run so far
            self._write(
                f"{self.name}: step {step}/{self.total} ({step / self.total:.0%})  loss {loss:.4f}  "
                f"{tok_s:,.0f} tok/s  ETA {format_duration(pace * (self.total - step))}"
            )

    def close(self) -> None:
        """Remove the bar and write the end line (``done in`` at ``total``, else ``stopped after``)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        took = format_duration(self.clock() - self.t0)
        if self.step == self.initial and self.step >= self.total:
            self._write(f"{self.name}: step {self.step}/{self.total}: nothing to train")
            return
        what = "done in" if self.step >= self.total else "stopped after"
        self._write(
            f"{self.name}: step {self.step}/{self.total} {what} {took}  loss {self.loss:.4f}  {self.tok_s:,.0f} tok/s"
        )

    def _write(self, line: str) -> None:
        if self.lines:
            print(line, file=self.out, flush=True)


class PhaseProgress:
    """One phase of a long job that is not training steps (a conversion's skip costs, fits, calibration), as
    lines on stdout: one every ``every_s`` seconds while it runs and one when it ends::

        skip costs (attention): 12/30 layers (40%)  ETA 3m10s
        skip costs (attention): 30 layers done in 8m02s

    Silent where ``lines`` is off (``phase(None, ...)``: library use)."""

    def __init__(self, cfg: Progress, name: str, total: int, unit: str):
        self.name, self.total, self.unit = name, total, unit
        self.out = cfg.out if cfg.out is not None else sys.stdout
        self.lines, self.every_s, self.clock = cfg.lines, cfg.every_s, cfg.clock or time.monotonic
        self.t0 = self.last = self.clock()
        self.done = 0

    def advance(self, n: int = 1) -> None:
        """``n`` more units of the phase are done."""
        self.done += n
        now = self.clock()
        if self.lines and self.done < self.total and now - self.last >= self.every_s:
            self.last = now
            pace = (now - self.t0) / self.done
            print(
                f"{self.name}: {self.done}/{self.total} {self.unit} ({self.done / self.total:.0%})  "
                f"ETA {format_duration(pace * (self.total - self.done))}",
                file=self.out,
                flush=True,
            )

    def close(self) -> None:
        """The end line (``done in``)."""
        if self.lines:
            took = format_duration(self.clock() - self.t0)
            print(f"{self.name}: {self.done} {self.unit} done in {took}", file=self.out, flush=True)


SILENT = Progress(bar=False, lines=False)


def phase(progress: Progress | None, name: str, total: int, unit: str) -> PhaseProgress:
    """A ``PhaseProgress`` of ``total`` ``unit`` as ``progress`` says (None: silent)."""
    return PhaseProgress(SILENT if progress is None else progress, name, total, unit)

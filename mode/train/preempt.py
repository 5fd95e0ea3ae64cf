"""Preemption: SIGTERM (what SLURM, Kubernetes and spot instances send before they kill) ends a run with a
checkpoint, and the same command resumes it (``mode train --resume auto``).

    first SIGTERM   ``requested`` becomes True; the trainer finishes the optimizer step it is in, every rank
                    agrees at the end of that step (the flag rides on the step's one all-reduce, so all ranks
                    stop after the same step), the group saves a checkpoint, and ``mode train`` exits with
                    ``EXIT_PREEMPTED``. A timer of ``grace_s`` starts with the signal: a rank still not done
                    when it expires (a step or a save slower than the grace) exits at once with the same
                    status; the newest complete checkpoint is then the one before (saves are atomic).
    second SIGTERM  exit at once with ``EXIT_PREEMPTED``: a save in progress is abandoned, and as it is not
                    named complete before all of it is written, the newest complete checkpoint stays whole.

Set ``grace_s`` below the time the scheduler waits between SIGTERM and SIGKILL (SLURM's KillWait and
Kubernetes' terminationGracePeriodSeconds: 30 s by default) and below torchrun's ``--shutdown-timeout`` (30 s
by default), which is how long torchrun waits for its workers after forwarding the signal.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

EXIT_PREEMPTED = 143  # 128 + SIGTERM: what a shell reports for a process ended by SIGTERM
DEFAULT_GRACE_S = 25.0


class Preemption:
    """A SIGTERM handler (``install``) and the flag the trainer reads (``requested``)."""

    def __init__(self, grace_s: float = DEFAULT_GRACE_S, who: str = "mode train"):
        if isinstance(grace_s, bool) or not isinstance(grace_s, (int, float)) or not grace_s > 0:
            raise ValueError(f"grace_s={grace_s!r}: must be a number of seconds > 0")
        self.grace_s = float(grace_s)
        self.who = who
        self.requested = False
        self._timer: threading.Timer | None = None
        self._previous = None

    def install(self) -> Preemption:
        """Handle SIGTERM in this process (the main thread must call it); ``uninstall`` restores the handler."""
        self._previous = signal.signal(signal.SIGTERM, self._on_signal)
        return self

    def uninstall(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _on_signal(self, signum, frame) -> None:
        if self.requested:
            self._exit(
                "a second SIGTERM: exiting now; a save in progress is abandoned (the newest complete "
                "checkpoint is the one before it)"
            )
        self.requested = True
        print(
            f"{self.who}: SIGTERM: finishing this step, then saving a checkpoint and exiting with status "
            f"{EXIT_PREEMPTED} (grace {self.grace_s:g} s)",
            file=sys.stderr,
            flush=True,
        )
        self._timer = threading.Timer(
            self.grace_s,
            self._exit,
            args=(
                f"the grace period of {self.grace_s:g} s after SIGTERM ran out before the checkpoint was saved: "
                "exiting; the newest complete checkpoint is the one before",
            ),
        )
        self._timer.daemon = True
        self._timer.start()

    def _exit(self, why: str) -> None:
        print(f"{self.who}: {why}", file=sys.stderr, flush=True)
        os._exit(EXIT_PREEMPTED)  # no teardown: it could wait on peers, and the grace is over

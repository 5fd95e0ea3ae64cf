"""Fault injection for the tests and ``benchmarks/parallel/bench_faults.py``: a process kills itself, or sends itself
SIGTERM, at a chosen step, as ``kill -9`` or a scheduler would from outside, but at a step known in advance
(so that a seeded trial is reproducible).

    MODE_TEST_FAULT="kill@1:7"      rank 1 SIGKILLs itself at the end of step 7 (before any save at 7)
    MODE_TEST_FAULT="term@0:5"      rank 0 sends itself SIGTERM at the end of step 5 (a preemption)
    MODE_TEST_FAULT="killsave@1:6"  rank 1 SIGKILLs itself inside the save of step 6, after its shards are
                                    written and before the save is named complete (``latest``)
    MODE_TEST_FAULT="termsave@0:6"  rank 0 sends itself SIGTERM at that point of the save of step 6 (with
                                    ``term`` before it: the second SIGTERM, during the preemption's save)
    MODE_TEST_FAULT="stop@1:3"      rank 1 SIGSTOPs itself at the end of step 3: alive, connections open, never
                                    answering (a hung rank, or a machine gone silent): the others must fail
                                    at the collective timeout (``--collective-timeout``)
    MODE_TEST_FAULT="stopsave@2:4"  rank 2 SIGSTOPs itself inside the save of step 4 (where ``killsave`` kills),
                                    printing when: a test then kills its whole machine while the save is
                                    being written (tests/parallel/test_machines.py)

Several faults: separated by commas. A fault fires in the first attempt of a torchelastic job only
(``TORCHELASTIC_RESTART_COUNT`` unset or 0), so that the restarted group runs through; a command rerun by
hand gets the variable again only if the caller sets it again. Nothing happens when the variable is unset.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass

FAULT_ENV = "MODE_TEST_FAULT"
KINDS = ("kill", "term", "killsave", "termsave", "stop", "stopsave")


@dataclass(frozen=True)
class Fault:
    kind: str  # one of KINDS
    rank: int
    step: int


def parse(spec: str) -> list[Fault]:
    """``"kind@rank:step,..."`` as faults; ValueError naming the part that is not one."""
    faults = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        kind, _, where = part.partition("@")
        rank, _, step = where.partition(":")
        if kind not in KINDS or not rank.isdigit() or not step.isdigit():
            raise ValueError(
                f"{FAULT_ENV}={spec!r}: {part!r} must be KIND@RANK:STEP with KIND one of "
                f"{', '.join(KINDS)} (e.g. kill@1:7)"
            )
        faults.append(Fault(kind, int(rank), int(step)))
    return faults


def planned(rank: int) -> list[Fault]:
    """This process's faults (none in a restarted attempt)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0"):
        return []
    return [f for f in parse(spec) if f.rank == rank]


def inject(point: str, rank: int, step: int) -> None:
    """Called by the trainer at the end of every step (``point="step"``) and by a sharded save between its
    shards and ``latest`` (``point="save"``): fire this rank's fault planned there, if any."""
    for f in planned(rank):
        if f.step != step:
            continue
        if point == "step" and f.kind == "kill" or point == "save" and f.kind == "killsave":
            os.kill(os.getpid(), signal.SIGKILL)
        elif point == "step" and f.kind == "term" or point == "save" and f.kind == "termsave":
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before the next bytecode
        elif point == "step" and f.kind == "stop" or point == "save" and f.kind == "stopsave":
            where = "after step" if point == "step" else "inside the save of step"
            print(f"mode fault: rank {rank} stops (SIGSTOP) {where} {step} at {time.time():.3f}", file=sys.stderr)
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGSTOP)

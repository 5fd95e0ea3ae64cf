"""Restarts under torchelastic (``torchrun --max-restarts N``): a store of each attempt's own.

Why a restarted group failed to start (torch 2.13, gloo; NCCL likewise, issue pytorch/pytorch#135712)
    torchrun's agent hosts the TCPStore that its workers' process groups meet in and tells them so with
    ``TORCHELASTIC_USE_AGENT_STORE=True`` (the static rendezvous always; the c10d rendezvous unless
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``). That store outlives the workers and is *not* renewed when the
    agent restarts them: the static rendezvous keeps its ``TCPStore`` object, the c10d one builds its shared
    server once, on the first round. ``init_process_group`` then uses it under the fixed prefix
    ``default_pg`` and every sub-group under ``<group name>/``, names that are the same in every attempt. A
    restarted rank that asks for a peer's address (gloo's ``connectFullMesh``) can read the one the dead
    attempt left, before the restarted peer overwrites it, and fails with ``Connection refused``. A plain
    script that makes one group usually wins that race; ``mode train``, which makes the mesh's sub-groups
    right after, lost it in every restart tried here (torchrun --max-restarts 1, kill -9 of rank 1).

The fix (ours)
    ``attempt_store`` wraps the agent's store in a ``PrefixStore`` named after the attempt
    (``TORCHELASTIC_RESTART_COUNT``), and ``init_distributed`` hands it to ``init_process_group``: every key
    of the default group and of every sub-group (they are prefixed from it) is the attempt's own, so nothing
    a dead attempt wrote is ever read. Outside torchelastic, or where the agent does not share its store
    (each attempt then has a fresh store on a fresh port), it returns None and nothing changes.

    The restart count is each agent's own. On one machine (one agent) it is the group's; on several, every
    agent counts a restart when its workers fail, which they all do when a peer dies (``mode train`` exits on
    a failed collective), so the counts agree. Where an agent could restart without counting (a machine
    joining an elastic job), use ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: docs/distributed.md, "When a rank
    dies".
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"


def attempt() -> int:
    """Which attempt of a torchelastic job this process belongs to (0: the first; 0 outside torchrun)."""
    try:
        return int(os.environ.get(RESTART_ENV, "0"))
    except ValueError:
        return 0


def attempt_store(timeout_s: float) -> dist.Store | None:
    """A client of torchrun's agent store under a prefix of this attempt's own, for
    ``init_process_group(store=...)``; None when the agent does not share its store (nothing to isolate)."""
    if os.environ.get(AGENT_STORE_ENV) != str(True):
        return None
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
    )
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return dist.PrefixStore(f"mode/{run_id}/attempt-{attempt()}", store)

"""Process-group set-up, and turning failed collectives into clear errors.

Besides this module, ``torch.distributed`` is imported only by the ``mode.parallel`` package (mesh,
parallelize, sharded checkpoints, the trainer's mesh runtime), ``mode.parallel.stats_reduce`` (inside a
function) and, on the model side, ``mode.dispatch.expert_parallel``. Nothing here runs at import time.

Set-up (``init_distributed``)
    * rank, world size and local rank come from the environment ``torchrun`` sets (``RANK``,
      ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``); without any of them the process
      runs as a group of one (handy for smoke runs), unless ``world_size`` > 1 was asked for: then, and when
      ``RANK``/``WORLD_SIZE`` are set without the rest, it refuses with a ``ValueError`` saying how to start the
      processes (several
      copies of a script started by hand would otherwise each train alone, silently);
    * backend ``"auto"``: NCCL when CUDA is available (one GPU per process, ``cuda:LOCAL_RANK``), else gloo
      on CPU;
    * every collective has a timeout: ``timeout_s`` argument, else ``$MODE_DIST_TIMEOUT_S``, else
      ``DEFAULT_TIMEOUT_S``. A rank that dies makes its peers fail at their next collective (gloo: the
      closed connection is noticed at once); a rank that is stuck makes them fail after the timeout.
      ``collective_guard`` (also ``mode.parallel.collective_guard``, for your own loop) turns such failures
      into a ``CollectiveError`` that says which rank, what it was doing and what probably happened, instead
      of a bare backend message or a hang;
    * NCCL: ``device_id=cuda:LOCAL_RANK`` goes to ``init_process_group``, so the communicator is built there
      (a broken network fails at set-up, not at the first all-to-all). NCCL reports a dead peer or a
      timeout from its watchdog thread, not from the collective call, so ``collective_guard`` never sees
      it: the watchdog ends the process. ``NCCL_ENV_DEFAULTS`` (set only where the user has not set them)
      make that end prompt and leave a flight-recorder dump per rank; docs/gpu.md shows what the user sees.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import MutableMapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from mode.parallel.elastic import attempt_store

TIMEOUT_ENV = "MODE_DIST_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0  # > the longest legitimate wait between collectives (rank 0 writing a checkpoint)
BACKENDS = ("auto", "gloo", "nccl")

# Read by ProcessGroupNCCL when it is constructed (torch 2.13), so they must be in the environment before
# init_process_group. torch's own defaults are the same; stating them keeps the failure mode documented in
# docs/gpu.md independent of the torch version. torchrun exports TORCH_NCCL_ASYNC_ERROR_HANDLING=1 to its
# workers unless it is set, so under torchrun that value (abort the communicator, then end the process) wins.
NCCL_ENV_DEFAULTS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",  # on a timeout or NCCL error the watchdog ends the process
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",  # ... after every rank dumped its flight recorder (what it was doing)
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",  # flight-recorder entries; 0 disables the recorder and the dump
}
# Other names torch reads for the same setting: one set by the user counts as set.
_NCCL_ENV_ALIASES = {"TORCH_NCCL_TRACE_BUFFER_SIZE": ("TORCH_FR_BUFFER_SIZE",)}
_TRUE = ("1", "true", "yes", "on")

# Substrings of the errors gloo / NCCL raise when a peer is gone or a collective timed out.
_FAILURE_MARKERS = (
    "gloo",
    "nccl",
    "connection closed",
    "connection reset",
    "timed out",
    "timeout",
    "broken pipe",
    "socket",
    "watchdog",
    "remote worker",
    "peer",
)


class CollectiveError(RuntimeError):
    """A collective failed: another rank died, is stuck (the timeout expired) or the network broke."""


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    timeout_s: float
    group: object  # the default process group (dist.group.WORLD)


def resolve_timeout(timeout_s: float | None = None) -> float:
    """``timeout_s``, else ``$MODE_DIST_TIMEOUT_S``, else ``DEFAULT_TIMEOUT_S``; must be > 0."""
    source = "timeout_s"
    if timeout_s is None and os.environ.get(TIMEOUT_ENV):
        source, raw = TIMEOUT_ENV, os.environ[TIMEOUT_ENV]
        try:
            timeout_s = float(raw)
        except ValueError:
            raise ValueError(f"{TIMEOUT_ENV}={raw!r}: must be a number of seconds > 0") from None
    if timeout_s is None:
        return DEFAULT_TIMEOUT_S
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"{source}={timeout_s!r}: must be a number of seconds > 0")
    return float(timeout_s)


def resolve_backend(backend: str = "auto") -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: must be one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend='nccl': needs CUDA GPUs (one per process); use 'gloo' on CPUs")
    return backend


def nccl_env_defaults(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Put ``NCCL_ENV_DEFAULTS`` into ``environ`` (default ``os.environ``) where neither the variable nor an
    alias of it is set; returns what was set. With ``TORCH_NCCL_BLOCKING_WAIT`` on, the watchdog does not run
    (the collective call itself raises after the timeout), so the error-handling mode is left alone."""
    environ = os.environ if environ is None else environ
    blocking = environ.get("TORCH_NCCL_BLOCKING_WAIT", "").strip().lower() in _TRUE
    applied = {}
    for name, value in NCCL_ENV_DEFAULTS.items():
        if name == "TORCH_NCCL_ASYNC_ERROR_HANDLING" and blocking:
            continue
        if any(n in environ for n in (name, *_NCCL_ENV_ALIASES.get(name, ()))):
            continue
        environ[name] = applied[name] = value
    return applied


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LAUNCH_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # what torchrun sets for every process


def _check_launch_env(world_size: int | None) -> bool:
    """Whether this process was started as one of a group (``RANK`` and ``WORLD_SIZE`` set); a ``ValueError``
    when only part of ``LAUNCH_ENV`` is, or when neither is and ``world_size`` > 1 was asked for."""
    present = [n for n in ("RANK", "WORLD_SIZE") if n in os.environ]  # MASTER_* alone may be a shell default
    how = (
        "start every process with torchrun (one machine: torchrun --nproc-per-node {n} SCRIPT; several: "
        "docs/distributed.md), or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in each yourself"
    )
    n = world_size if world_size is not None else "N"
    if not present:
        if world_size is not None and world_size > 1:
            raise ValueError(
                f"init_distributed(world_size={world_size}): this process was not started by "
                f"torchrun (RANK and WORLD_SIZE are not set), so it would be a process group of "
                f"one and train alone; " + how.format(n=n)
            )
        return False
    if len(present) == 1:
        missing = [x for x in LAUNCH_ENV if x not in os.environ]
        raise ValueError(
            f"init_distributed: {present[0]} is set but {', '.join(missing)} not: a process of a "
            "group needs all four; " + how.format(n=n)
        )
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        missing = [x for x in LAUNCH_ENV if x not in os.environ]
        raise ValueError(
            f"init_distributed: RANK and WORLD_SIZE set but {', '.join(missing)} not: the "
            "processes need the address and port of rank 0 to meet; " + how.format(n=n)
        )
    if world_size is not None and int(os.environ["WORLD_SIZE"]) != world_size:
        raise ValueError(
            f"init_distributed(world_size={world_size}): WORLD_SIZE={os.environ['WORLD_SIZE']} "
            f"processes were started; start {world_size} (torchrun --nproc-per-node ...)"
        )
    return True


def init_distributed(
    backend: str = "auto", timeout_s: float | None = None, world_size: int | None = None
) -> DistContext:
    """Initialise the default process group from torchrun's environment, or, with none of it set and
    ``world_size`` None or 1, as a group of one. ``world_size``: the number of processes this run needs (e.g.
    ``ParallelDims(dp, ep).world_size``); anything else is a ``ValueError`` before any group exists."""
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this torch build")
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1):
        raise ValueError(f"world_size={world_size!r}: must be an int >= 1")
    timeout_s = resolve_timeout(timeout_s)
    backend = resolve_backend(backend)
    if not _check_launch_env(world_size):  # not under torchrun: a group of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    kwargs = {}
    if backend == "nccl":
        if local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"LOCAL_RANK={local_rank}: this machine has {torch.cuda.device_count()} GPU(s); "
                "start at most one process per GPU (torchrun --nproc-per-node <= GPUs)"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        kwargs["device_id"] = device  # one GPU per process: NCCL builds its communicator now, not lazily
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        if backend == "nccl":
            nccl_env_defaults()
        # under torchrun --max-restarts: keys of this attempt's own in the agent's store (mode.parallel.elastic)
        store = attempt_store(timeout_s)
        if store is not None:
            kwargs.update(store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **kwargs)
    return DistContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=device,
        backend=backend,
        timeout_s=timeout_s,
        group=dist.group.WORLD,
    )


def destroy() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def looks_like_collective_failure(e: BaseException) -> bool:
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    msg = str(e).lower()
    return isinstance(e, RuntimeError) and any(m in msg for m in _FAILURE_MARKERS)


@contextlib.contextmanager
def collective_guard(
    what: str, timeout_s: float | None = None, *, rank: int | None = None, world_size: int | None = None
):
    """Re-raise a failed collective inside the block as a ``CollectiveError`` naming this rank and ``what``
    (e.g. ``"training step 12"``); any other exception passes unchanged. ``timeout_s``: the process group's
    timeout, quoted in the message; ``rank``, ``world_size``: default the default group's.

        with collective_guard(f"step {step}", ctx.timeout_s):
            loss.backward()
    """
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as e:
        if not looks_like_collective_failure(e):
            raise
        initialized = dist.is_available() and dist.is_initialized()
        if rank is None:
            rank = dist.get_rank() if initialized else 0
        if world_size is None:
            world_size = dist.get_world_size() if initialized else 1
        limit = f"{timeout_s:g} s" if timeout_s is not None else "the process-group timeout"
        raise CollectiveError(
            f"rank {rank}/{world_size}: a collective failed during {what}: another rank died, is stuck "
            f"(no answer within {limit}; set --collective-timeout or ${TIMEOUT_ENV}) or the network broke. Check the "
            f"other ranks' logs for the first error. Backend error: {e}"
        ) from e

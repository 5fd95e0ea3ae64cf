"""Where a training run executes: the ``Runtime`` protocol the ``Trainer`` is written against, and its
one-process implementation.

Shape legend: B global batch, b = B / W rows per process (W processes; one process: b = B), S sequence.

The trainer's loop is the same everywhere; what depends on the setting lives behind ``Runtime``: how the
model is prepared, which rows of a batch this process trains on, how scalars, gradient norms and routing
statistics are reduced, and how checkpoints are written and read. Two implementations:

    OneProcess                         (here) no collectives, single-file checkpoints, no torch.distributed
    mode.parallel.runtime.MeshRuntime  a (dp, ep) device mesh: the model parallelized, sharded checkpoints

``train/`` never imports ``parallel/``: a caller hands the trainer a runtime (``Trainer(runtime=...)``), or a
mesh, which becomes a runtime through the factory ``mode.parallel`` registers here when it is imported
(``register_mesh_runtime``). Every method that communicates must be called by every rank in the same order.

Optional, outside the protocol: ``set_gradient_sync(model, enabled)``, which gradient accumulation calls
before each micro-batch's backward (``MeshRuntime``: FSDP reduces the gradients of the last one only). A
runtime without it reduces the way its ``backward`` does, every micro-batch. ``builds_on_meta = True``:
the trainer builds the LM on the meta device (``mode.model.deferred_init.build_on_meta``) and ``prepare``
must materialize it (``MeshRuntime``: its shards only, with the eager build's values).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from mode.measure.stats import RoutingAccumulator
from mode.model.blocks import compile_blocks
from mode.train import checkpoint


@runtime_checkable
class Runtime(Protocol):
    """What the trainer needs from the place it runs in."""

    world_size: int  # W: processes that train together
    rank: int  # this process's rank among them (0 writes the log)
    device: torch.device
    checkpoint_name: str  # the checkpoint's name in the run's folder: "ckpt.pt" (a file), "ckpt" (a folder)

    def describe(self) -> str:
        """One line for the command's banner."""
        ...

    def guard(self, what: str) -> contextlib.AbstractContextManager:
        """A context manager around collectives (turns a failed one into a clear error naming ``what``)."""
        ...

    def prepare(self, model: nn.Module, compile: bool = False) -> nn.Module:
        """The model ready to train here (compiled, parallelized)."""
        ...

    def rows(self, t_BS: Tensor) -> Tensor:
        """This process's rows of a global batch, on its device: ``t_bS``."""
        ...

    def sum_scalars(self, values: list) -> list[float]:
        """Each value summed over the processes (one collective for all of them)."""
        ...

    def mean_over_ranks(self, t: Tensor) -> Tensor:
        """``t`` (float64) averaged over the processes."""
        ...

    def clip_grad_norm_(self, params: list[nn.Parameter], max_norm: float) -> Tensor:
        """Clip by the global gradient norm; returns it."""
        ...

    def reduce_routing(self, acc: RoutingAccumulator) -> RoutingAccumulator:
        """Routing sums over every process (``acc`` itself in one process)."""
        ...

    def save(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, meta: dict) -> Path:
        """Write a checkpoint of ``model``, ``optimizer`` and the non-tensor state ``meta``, atomically."""
        ...

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, check: Callable) -> dict:
        """Resume from ``path``; ``check(state)`` sees the non-tensor state before any tensor changes.
        Returns the non-tensor state."""
        ...


MeshRuntimeFactory = Callable[..., Runtime]  # (mesh, timeout_s) -> Runtime
_mesh_runtimes: list[MeshRuntimeFactory] = []  # filled by mode.parallel when it is imported


def register_mesh_runtime(factory: MeshRuntimeFactory) -> None:
    """Make ``Trainer(mesh=...)`` build its runtime with ``factory(mesh, timeout_s)`` (``mode.parallel``
    registers ``MeshRuntime``; registering the same factory again changes nothing)."""
    if factory not in _mesh_runtimes:
        _mesh_runtimes.append(factory)


def mesh_runtime(mesh, timeout_s: float | None) -> Runtime:
    """The runtime of a device mesh, from the registered factory."""
    if not _mesh_runtimes:
        raise ValueError(
            "mesh: no mesh runtime is registered; build the mesh with mode.parallel.build_mesh "
            "(importing mode.parallel registers it), or pass runtime=mode.parallel.MeshRuntime(mesh)"
        )
    return _mesh_runtimes[-1](mesh, timeout_s)


def to_device(t: Tensor, device: torch.device) -> Tensor:
    """``t`` on ``device``. A CPU tensor bound for a GPU goes through pinned memory with ``non_blocking=True``:
    the copy is queued on the current stream (before the kernels that read it) and the host does not wait
    for it, where a copy from pageable memory synchronises the stream. The pinned buffer is a fresh copy,
    which the caching host allocator keeps until the copy is done. Elsewhere ``t.to(device)`` (on the CPU,
    ``t`` itself)."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"``: the current CUDA GPU when there is one, else the CPU; ``"cpu"``, ``"cuda"``, ``"cuda:N"``."""
    if device == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={device!r}: must be 'auto', 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: must be 'auto', 'cpu', 'cuda' or 'cuda:N'")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r}: torch.cuda.is_available() is False here; use 'cpu' or 'auto'")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def kept_checkpoints(path: Path) -> list[Path]:
    """The older single-file checkpoints kept beside ``path`` (``ckpt.pt`` -> ``ckpt-step-00000060.pt``), newest
    (highest step) first."""
    found = []
    for f in path.parent.glob(f"{path.stem}-step-*{path.suffix}"):
        digits = f.name[len(path.stem) + len("-step-") : -len(path.suffix) or None]
        if digits.isdigit():
            found.append((int(digits), f))
    return [f for _, f in sorted(found, reverse=True)]


def link_or_copy(src: Path, dst: Path) -> None:
    """``dst`` becomes ``src``'s content, atomically: a hard link (no second copy on disk) or, where the file
    system has none, a copy, made under a temporary name and renamed over ``dst``."""
    tmp = dst.parent / f".{dst.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        os.link(src, tmp)
    except OSError:
        checkpoint.atomic_write(tmp, src.read_bytes())
    os.replace(tmp, dst)


class OneProcess:
    """The trainer's runtime in one process without a mesh (``mode compare``, ``mode isoflop``, notebooks):
    nothing to communicate, and it never imports ``torch.distributed``. Checkpoints are written as single
    files; reading takes either kind (``mode.train.checkpoint.load_checkpoint``: a sharded folder through
    the reader ``mode.parallel`` registers). ``keep`` > 1: each save is also kept as ``ckpt-step-NNNNNNNN.pt``
    (a hard link of ``ckpt.pt``: no second copy), the ``keep`` newest of them, for ``mode.parallel.resume`` to
    fall back to."""

    world_size, rank = 1, 0
    checkpoint_name = "ckpt.pt"

    def __init__(self, device: torch.device, keep: int = 1):
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep={keep!r}: must be an int >= 1 (how many checkpoints to keep)")
        self.device = device
        self.keep = keep

    def describe(self) -> str:
        """One line for the command's banner: the device."""
        return f"one process on {self.device}"

    def guard(self, what: str):
        """A context manager that does nothing: one process has no collective to guard."""
        return contextlib.nullcontext()

    def prepare(self, model: nn.Module, compile: bool = False) -> nn.Module:
        """``model`` itself, its blocks compiled with ``compile`` (``compile_blocks``)."""
        if compile:
            compile_blocks(model)
        return model

    def rows(self, t_BS: Tensor) -> Tensor:
        """The whole batch (one process: b = B) on the device, through pinned memory on a GPU (``to_device``)."""
        return to_device(t_BS, self.device)  # on a GPU: pinned, non-blocking

    def sum_scalars(self, values: list) -> list[float]:
        """Each value as a float; the tensors among them (loss, realized FLOPs) read in one transfer, the
        step's one host sync on a GPU. The same floats as ``float(v)`` for each (float64 holds every
        float32 and bfloat16 value exactly)."""
        at = [i for i, v in enumerate(values) if isinstance(v, Tensor)]
        out = [None if isinstance(v, Tensor) else float(v) for v in values]
        if at:
            read = torch.stack([values[i].detach().reshape(()).to(self.device, torch.float64) for i in at]).tolist()
            for i, value in zip(at, read):
                out[i] = value
        return out  # pyright: ignore[reportReturnType] - the loop above replaced every None

    def mean_over_ranks(self, t: Tensor) -> Tensor:
        """``t`` detached, in float64 (one process: nothing to average)."""
        return t.detach().double()

    def clip_grad_norm_(self, params: list[nn.Parameter], max_norm: float) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_``: clip the gradients by their total norm; returns it."""
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def reduce_routing(self, acc: RoutingAccumulator) -> RoutingAccumulator:
        """``acc`` itself: one process already holds every sum."""
        return acc

    def save(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, meta: dict) -> Path:
        """Write ``meta`` with the model's and the optimizer's state dicts as one file, atomically
        (``save_checkpoint``); with ``keep`` > 1 also as ``ckpt-step-NNNNNNNN.pt``, deleting those beyond the ``keep``
        newest. Returns the path written."""
        path = checkpoint.save_checkpoint(
            path, {**meta, "model": model.state_dict(), "optimizer": optimizer.state_dict()}
        )
        if self.keep > 1:
            link_or_copy(path, path.with_name(f"{path.stem}-step-{meta['step']:08d}{path.suffix}"))
            for old in kept_checkpoints(path)[self.keep :]:
                old.unlink(missing_ok=True)
        return path

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, check: Callable) -> dict:
        """Resume from ``path``, a single file or a sharded folder (read in full): ``check(state)`` sees the non-tensor
        state first; a state that does not fit the model or the optimizer raises before the model changes. Returns the
        state."""
        where = f"checkpoint {str(path)!r}"
        state = checkpoint.load_checkpoint(path, training=True)  # a folder: read in full, here
        check(state)
        checkpoint.check_model_state(model.state_dict(), state["model"], where)
        try:  # first: the one step that can still reject the file
            optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError, TypeError) as e:
            raise checkpoint.CheckpointError(f"{where}: its optimizer state does not fit this model: {e}") from None
        model.load_state_dict(state["model"])
        return state

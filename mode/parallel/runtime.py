"""What ``mode.train.Trainer`` needs from a device mesh: the model parallelized, this rank's rows of a batch,
summed scalars, the global gradient norm, routing statistics summed over ranks, sharded checkpoints.

Shape legend: B global batch (sequences per step), W = dp * ep ranks, b = B / W rows per rank, S sequence.

It implements ``mode.train.runtime.Runtime``; one process without a mesh is ``mode.train.runtime.OneProcess``,
the same interface with no collectives. Importing ``mode.parallel`` registers ``MeshRuntime`` as the factory
behind ``Trainer(mesh=...)``. Every method here that communicates must be called by every
rank in the same order (the trainer does).

Rows: every rank draws the same global batch (same seeded sampler as one process) and keeps rows
``[r*b, (r+1)*b)`` of it, ``r`` its flat rank ``d * ep + e``. Each rank's loss is the mean over its own
tokens; the trainer calls ``backward`` on ``loss / W``, and FSDP sums the gradients (``parallelize``), so the
gradient is that of the global mean, as in one process.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from mode.measure.stats import RoutingAccumulator
from mode.parallel import checkpoint as sharded
from mode.parallel import process_group as mdist
from mode.parallel.apply import parallelize
from mode.parallel.mesh import flat_mesh, mesh_dims
from mode.parallel.stats_reduce import all_reduce_accumulator
from mode.train import checkpoint


def clip_grad_norm_(params: list[nn.Parameter], max_norm: float) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for parameters that live on several meshes (dense weights on the
    flat dp x ep mesh, experts on the (dp, ep) mesh): one norm per mesh (a DTensor norm is reduced with
    ``full_tensor``), combined into the global norm, then every gradient scaled by the same coefficient.
    Returns the global norm (float32, on every rank the same). Every rank must pass the same parameters:
    the per-mesh reductions are collectives, taken in the order the meshes first appear."""
    by_mesh: dict = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    if not by_mesh:
        return torch.zeros(())
    norms = []
    for ps in by_mesh.values():
        n = get_total_norm([p.grad for p in ps], norm_type=2.0)
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    total = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))
    for ps in by_mesh.values():
        clip_grads_with_norm_(ps, max_norm, total)
    return total


class MeshRuntime:
    """The trainer's view of a ``(dp, ep)`` mesh (``mode.parallel.build_mesh``)."""

    checkpoint_name = "ckpt"  # a folder of DCP shards

    def __init__(self, mesh, timeout_s: float | None = None, dedup: bool = False):
        self.mesh = mesh
        self.dedup = dedup  # parallelize's: one row per (token, destination rank) in the all-to-alls
        self.dims = mesh_dims(mesh)
        self.timeout_s = timeout_s
        self.world_size = self.dims.world_size
        self.rank = dist.get_rank()
        self.device = (torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda"
                       else torch.device(mesh.device_type))
        self._flat = None  # the flat dp x ep mesh; created by parallelize, in prepare()
        self.row_rank = None

    @property
    def group(self):
        """The process group of all W ranks (the flat mesh's)."""
        return self._flat.get_group()

    def describe(self) -> str:
        plural = "es" if self.world_size > 1 else ""
        return f"mesh dp={self.dims.dp} x ep={self.dims.ep} ({self.world_size} process{plural})"

    def guard(self, what: str):
        return mdist.collective_guard(what, self.rank, self.world_size, self.timeout_s)

    def prepare(self, model: nn.Module, compile: bool = False) -> nn.Module:
        with self.guard("parallelize"):
            model = parallelize(model, self.mesh, compile=compile, dedup=self.dedup)
            self._flat = flat_mesh(self.mesh)
        self.row_rank = self._flat.get_local_rank()
        return model

    def rows(self, t_BS: Tensor) -> Tensor:
        b = t_BS.shape[0] // self.world_size
        lo = self.row_rank * b
        return t_BS[lo:lo + b].to(self.device)

    def sum_scalars(self, values: list) -> list[float]:
        """Each value (a float or a one-element tensor) summed over all ranks, in one all-reduce."""
        t = torch.stack([torch.as_tensor(v, dtype=torch.float64).to(self.device).reshape(()) for v in values])
        dist.all_reduce(t, group=self.group)
        return t.tolist()

    def mean_over_ranks(self, t: Tensor) -> Tensor:
        t = t.detach().to(device=self.device, dtype=torch.float64).clone()
        dist.all_reduce(t, group=self.group)
        return t / self.world_size

    def clip_grad_norm_(self, params: list[nn.Parameter], max_norm: float) -> Tensor:
        return clip_grad_norm_(params, max_norm)

    def reduce_routing(self, acc: RoutingAccumulator) -> RoutingAccumulator:
        """A copy of ``acc``'s sums added over every rank."""
        with self.guard("routing-stats all-reduce"):
            return all_reduce_accumulator(RoutingAccumulator().merge(acc), self.group)

    def save(self, path: Path, model: nn.Module, optimizer, meta: dict) -> Path:
        meta = {**meta, "parallel": {"dp": self.dims.dp, "ep": self.dims.ep, "world_size": self.world_size}}
        with self.guard("checkpoint save"):
            return sharded.save_sharded(path, model, optimizer, meta, group=self.group)

    def load(self, path: Path, model: nn.Module, optimizer, check) -> dict:
        """Resume from ``path``: a sharded checkpoint (each rank reads its chunks, whatever layout saved it)
        or a single file (every rank reads it and keeps its shards: import). ``check(state)`` sees the
        non-tensor state before any tensor is loaded (and may raise); returns that state."""
        with self.guard("checkpoint load"):
            if sharded.is_sharded(path):
                return sharded.load_sharded(path, model, optimizer, check=check)
            state = checkpoint.load_checkpoint(path, training=True)
            check(state)
            sharded.load_full(model, optimizer, state, f"checkpoint {str(path)!r}")
            return {k: v for k, v in state.items() if k not in ("model", "optimizer")}

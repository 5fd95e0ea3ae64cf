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

from datetime import timedelta
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from mode import _checks
from mode.measure.stats import RoutingAccumulator
from mode.parallel import checkpoint as sharded, process_group as mdist
from mode.parallel.apply import parallelize
from mode.parallel.mesh import flat_mesh, mesh_dims
from mode.parallel.meta_init import is_meta_built, materialize
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
    total = (
        norms[0]
        if len(norms) == 1
        else torch.linalg.vector_norm(torch.stack([_checks.at_least_float32(n) for n in norms]))
    )
    for ps in by_mesh.values():
        clip_grads_with_norm_(ps, max_norm, total)
    return total


class MeshRuntime:
    """The trainer's view of a ``(dp, ep)`` mesh (``mode.parallel.build_mesh``)."""

    checkpoint_name = "ckpt"  # a folder of DCP shards

    def __init__(
        self,
        mesh,
        timeout_s: float | None = None,
        dedup: bool = False,
        async_save: bool = False,
        meta_init: bool = True,
        keep: int = 1,
    ):
        self.mesh = mesh
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep={keep!r}: must be an int >= 1 (how many complete checkpoints to keep)")
        self.keep = keep  # complete saves kept in the checkpoint folder, the newest included
        # meta_init: the trainer builds the LM on meta and prepare() materializes this rank's shards only, with
        # the values of the eager build (mode.parallel.meta_init); False: every rank builds the full model first
        self.builds_on_meta = meta_init
        self.dedup = dedup  # parallelize's: one row per (token, destination rank) in the all-to-alls
        # async_save: checkpoints written in the background (dcp.async_save on a gloo group of their own); the
        # step that saves waits only for the copy of this rank's shards to CPU memory
        self.async_save = async_save
        self._save_group = None  # that group, made at the first save (every rank saves together)
        self._pending = None  # the save in flight (checkpoint.PendingSave)
        self.dims = mesh_dims(mesh)
        self.timeout_s = timeout_s
        self.world_size = self.dims.world_size
        self.rank = dist.get_rank()
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if mesh.device_type == "cuda"
            else torch.device(mesh.device_type)
        )
        self._flat = None  # the flat dp x ep mesh; created by parallelize, in prepare()
        self.row_rank = None

    @property
    def group(self):
        """The process group of all W ranks (the flat mesh's)."""
        assert self._flat is not None, "MeshRuntime.group: the flat mesh is made by prepare()"
        return self._flat.get_group()

    def describe(self) -> str:
        """One line for the command's banner: the mesh's dp and ep, and the number of processes."""
        plural = "es" if self.world_size > 1 else ""
        return f"mesh dp={self.dims.dp} x ep={self.dims.ep} ({self.world_size} process{plural})"

    def guard(self, what: str):
        """``collective_guard``: a collective that fails inside the block raises a ``CollectiveError`` naming this rank
        and ``what``."""
        return mdist.collective_guard(what, self.timeout_s, rank=self.rank, world_size=self.world_size)

    def prepare(self, model: nn.Module, compile: bool = False) -> nn.Module:
        """``model`` made expert-parallel and fully sharded over the mesh (``parallelize``; ``compile``: its blocks
        compiled), and materialized on this device where it was built on meta."""
        with self.guard("parallelize"):
            model = parallelize(model, self.mesh, compile=compile, dedup=self.dedup)
            self._flat = flat_mesh(self.mesh)
        if is_meta_built(model):  # built on meta (builds_on_meta): this rank's shards, nothing more
            materialize(model, self.device)
        self.row_rank = self._flat.get_local_rank()
        return model

    def rows(self, t_BS: Tensor) -> Tensor:
        """This rank's ``b = B / W`` rows of the global batch (its block, by its rank in the flat mesh), on its device:
        ``t_bS``."""
        b = t_BS.shape[0] // self.world_size
        assert self.row_rank is not None, "MeshRuntime.rows: the row rank is set by prepare()"
        lo = self.row_rank * b
        return t_BS[lo : lo + b].to(self.device)

    def sum_scalars(self, values: list) -> list[float]:
        """Each value (a float or a one-element tensor) summed over all ranks, in one all-reduce."""
        t = torch.stack(
            [
                torch.as_tensor(v, dtype=torch.float64, device=v.device if isinstance(v, Tensor) else "cpu")
                .to(self.device)
                .reshape(())
                for v in values
            ]
        )
        dist.all_reduce(t, group=self.group)
        return t.tolist()

    def mean_over_ranks(self, t: Tensor) -> Tensor:
        """``t`` in float64, averaged over all W ranks (one all-reduce)."""
        t = t.detach().to(device=self.device, dtype=torch.float64).clone()
        dist.all_reduce(t, group=self.group)
        return t / self.world_size

    def clip_grad_norm_(self, params: list[nn.Parameter], max_norm: float) -> Tensor:
        """Clip the gradients by their global norm over every mesh they live on (``clip_grad_norm_`` in this module);
        returns that norm."""
        return clip_grad_norm_(params, max_norm)

    def set_gradient_sync(self, model: nn.Module, enabled: bool) -> None:
        """Gradient accumulation: FSDP2 reduces (reduce-scatters) the gradients in the backward of a
        micro-batch only when ``enabled``; in between, every FSDP module of ``model`` adds them up unsharded
        (``FSDPModule.set_requires_gradient_sync``, FSDP1's ``no_sync``). The trainer enables it for the
        last micro-batch of a step: one reduction of the sum, the same gradients as one per micro-batch."""
        # the root (fully_shard by prepare): recurses into every block and expert bank
        cast(FSDPModule, model).set_requires_gradient_sync(enabled)

    def reduce_routing(self, acc: RoutingAccumulator) -> RoutingAccumulator:
        """A copy of ``acc``'s sums added over every rank."""
        with self.guard("routing-stats all-reduce"):
            return all_reduce_accumulator(RoutingAccumulator().merge(acc), self.group)

    def save(self, path: Path, model: nn.Module, optimizer, meta: dict) -> Path:
        """A sharded save (every rank calls it). With ``async_save``: waits for the previous save, starts this
        one in the background and returns its folder (complete, and named by ``latest``, after
        ``wait_saves()``)."""
        meta = {**meta, "parallel": {"dp": self.dims.dp, "ep": self.dims.ep, "world_size": self.world_size}}
        self.wait_saves()
        with self.guard("checkpoint save"):
            if not self.async_save:
                return sharded.save_sharded(path, model, optimizer, meta, group=self.group, keep=self.keep)
            if self._save_group is None:
                self._save_group = dist.new_group(
                    dist.get_process_group_ranks(self.group),
                    backend="gloo",
                    timeout=timedelta(seconds=mdist.resolve_timeout(self.timeout_s)),
                )
            self._pending = sharded.save_sharded_async(
                path, model, optimizer, meta, self.group, self._save_group, keep=self.keep
            )
            return self._pending.folder

    def wait_saves(self) -> Path | None:
        """Wait for the background save in flight, if any (``async_save``); returns its folder, or raises what
        it raised. The trainer calls it at the end of ``run()``; the next save and a load call it first."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        with self.guard("checkpoint save (in the background)"):
            return pending.wait()

    def load(self, path: Path, model: nn.Module, optimizer, check) -> dict:
        """Resume from ``path``: a sharded checkpoint (each rank reads its chunks, whatever layout saved it)
        or a single file (every rank reads it and keeps its shards: import). ``check(state)`` sees the
        non-tensor state before any tensor is loaded (and may raise); returns that state."""
        self.wait_saves()
        with self.guard("checkpoint load"):
            if sharded.is_sharded(path):
                return sharded.load_sharded(path, model, optimizer, check=check)
            state = checkpoint.load_checkpoint(path, training=True)
            check(state)
            sharded.load_full(model, optimizer, state, f"checkpoint {str(path)!r}")
            return {k: v for k, v in state.items() if k not in ("model", "optimizer")}

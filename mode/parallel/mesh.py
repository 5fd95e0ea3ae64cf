"""The device mesh of a run: ``dp`` data-parallel groups times ``ep`` expert-parallel ranks.

Shape legend: W = dp * ep processes; flat rank ``r = d * ep + e`` (``d`` the dp index, ``e`` the ep index).

    ranks (dp=2, ep=2):   ep ->
                     dp  [[0, 1],      ranks 0 and 1 hold different experts and exchange tokens;
                          [2, 3]]      ranks 0 and 2 hold the same experts (FSDP shards them over dp)

``ParallelDims`` is the small config (``dp``, ``ep``); ``build_mesh`` turns it into a
``torch.distributed.device_mesh.DeviceMesh`` named ``("dp", "ep")`` on the already initialised default
process group (``mode.parallel.process_group.init_distributed``), plus its flattened ``dp_ep`` dim (all W ranks, what
dense weights are sharded on). Every rank must call ``build_mesh`` with the same dims.

Timeouts: the mesh's sub-groups (one per dim) are new process groups, which torch would give its own
default timeout (30 minutes), not the default group's; ``build_mesh`` passes ``timeout_s`` (default: the
one ``mode.parallel.process_group`` resolves) to every one of them, so a dead or stuck peer fails every collective of
the run within the same time.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from mode import _checks
from mode.parallel import process_group as mdist

MESH_DIMS = ("dp", "ep")
FLAT_DIM = "dp_ep"  # the flattened dp x ep dim: every rank, flat rank d * ep + e


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of a ``(dp, ep)`` device mesh: ``dp`` data-parallel copies of each expert shard, ``ep``
    expert-parallel ranks that split the experts of every MoE layer; ``dp * ep`` is the world size. Dense
    weights shard over all ``dp * ep`` ranks (FSDP2). ``for_world`` derives the missing degree from the number
    of processes; ``check_experts`` refuses an expert count ``ep`` does not divide.

    Args:
        dp: the data-parallel degree (default 1).
        ep: the expert-parallel degree (default 1).
    """

    dp: int = 1  # data-parallel degree: copies of each expert shard; dense weights shard over dp * ep
    ep: int = 1  # expert-parallel degree: ranks that split the experts of every MoE layer

    def __post_init__(self) -> None:
        _checks.check_int("dp", self.dp)
        _checks.check_int("ep", self.ep)

    @property
    def world_size(self) -> int:
        """``dp * ep``: the processes of the mesh."""
        return self.dp * self.ep

    @classmethod
    def for_world(cls, world_size: int, dp: int | None = None, ep: int | None = None) -> ParallelDims:
        """The dims of a run on ``world_size`` processes: give ``dp``, ``ep``, both or neither (neither:
        ``ep = world_size``, all experts spread as far as possible). The product must be the world size."""
        _checks.check_int("world_size", world_size)
        if dp is None and ep is None:
            dp = 1
        if ep is None:
            dp = _checks.check_int("dp", dp)
            if world_size % dp:
                raise ValueError(f"dp={dp}: must divide the number of processes {world_size}")
            ep = world_size // dp
        if dp is None:
            ep = _checks.check_int("ep", ep)
            if world_size % ep:
                raise ValueError(f"ep={ep}: must divide the number of processes {world_size}")
            dp = world_size // ep
        dims = cls(dp, ep)
        if dims.world_size != world_size:
            raise ValueError(
                f"dp={dp}, ep={ep}: dp * ep = {dims.world_size} must equal the number of processes {world_size}"
            )
        return dims

    def check_experts(self, num_experts: int, where: str = "num_experts") -> None:
        """Raise ``ValueError`` unless ``ep`` divides ``num_experts`` (``where`` names the value in the message)."""
        if num_experts % self.ep:
            raise ValueError(
                f"{where}={num_experts}: must be divisible by ep={self.ep} (each expert-parallel "
                "rank holds num_experts / ep experts)"
            )


def _group_options(timeout_s: float):
    """(backend, options carrying the timeout) for new sub-groups of the default group's backend."""
    backend = dist.get_backend()
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()  # pyright: ignore[reportAttributeAccessIssue] - private, not in the stubs
    elif backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
    else:  # another backend: torch's defaults
        return None
    options._timeout = timedelta(seconds=timeout_s)
    return backend, options


def build_mesh(dims: ParallelDims, device_type: str = "cpu", timeout_s: float | None = None) -> DeviceMesh:
    """A ``(dp, ep)`` device mesh over the default process group (which must be initialised, and of size
    ``dims.world_size``); ``device_type`` "cpu" (gloo) or "cuda" (NCCL, one GPU per process)."""
    if not isinstance(dims, ParallelDims):
        raise TypeError(f"dims={dims!r}: must be a ParallelDims")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "build_mesh: torch.distributed is not initialised; call "
            "mode.parallel.process_group.init_distributed (or init_process_group with a timeout) first"
        )
    world = dist.get_world_size()
    if dims.world_size != world:
        alone = (
            f"; this process is a group of one: start the script with torchrun --nproc-per-node "
            f"{dims.world_size} (init_distributed(world_size={dims.world_size}) refuses to start otherwise)"
            if world == 1
            else ""
        )
        raise ValueError(
            f"dp={dims.dp}, ep={dims.ep}: dp * ep = {dims.world_size} must equal the number of processes {world}{alone}"
        )
    override = _group_options(mdist.resolve_timeout(timeout_s))
    mesh = init_device_mesh(
        device_type,
        (dims.dp, dims.ep),
        mesh_dim_names=MESH_DIMS,
        backend_override=None if override is None else {name: override for name in MESH_DIMS},
    )
    mesh._flatten(FLAT_DIM, backend_override=override)
    return mesh


def flat_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh of all W ranks (flat rank ``d * ep + e``): made by ``build_mesh``, else made now."""
    return mesh._flatten(FLAT_DIM)


def mesh_dims(mesh: DeviceMesh) -> ParallelDims:
    """The ``ParallelDims`` of a mesh built by ``build_mesh`` (or any mesh named ``("dp", "ep")``)."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh={type(mesh).__name__}: must be a torch DeviceMesh (mode.parallel.build_mesh)")
    if tuple(mesh.mesh_dim_names or ()) != MESH_DIMS:
        raise ValueError(
            f"mesh.mesh_dim_names={mesh.mesh_dim_names!r}: must be {MESH_DIMS!r} "
            "(build it with mode.parallel.build_mesh)"
        )
    return ParallelDims(mesh.size(0), mesh.size(1))

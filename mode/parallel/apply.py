"""``parallelize(model, mesh)``: expert parallelism and FSDP2 applied from outside to any ``nn.Module`` that
holds this library's layers (the LM, or your own transformer). The model code never learns about the mesh.

Shape legend: E experts of a layer, ep / dp the mesh degrees (``mode.parallel.mesh``), L = E / ep experts
per expert-parallel rank, W = dp * ep processes.

What it does, in this order (every rank calls it with the same model, built with the same seed):
    1. **Expert parallelism.** Every ``MoELayer`` (``IntegratedMoDE`` and the MoE inside a ``StagedMoDE``
       too) keeps its router and gets, through ``MoELayer.set_experts``, an ``ExpertBank`` holding rank e's
       experts ``[e*L, (e+1)*L)`` and an ``ExpertParallelDispatcher`` on ``mesh["ep"]``'s group (ep = 1:
       all experts, the local dispatcher). The bank's two weights become DTensors of the global shape
       ``(E, ...)``, ``Shard(0)`` over ep (torch >= 2.13: ``[Replicate(), Shard(0)]`` on the ``(dp, ep)``
       mesh; older torch: ``[Shard(0)]`` on ``mesh["ep"]``, see 4.): DCP then saves
       all E rows, and FSDP knows that the ep ranks hold different tensors (a plain-tensor shard would be
       silently treated as one replicated tensor: a wrong grad norm, a checkpoint of one ep group only).
       The bank computes on ``weight.to_local()`` (``mode.experts.bank.local_weight``).
    2. Every ``MoD`` wrapper gets ``skip_empty = False``: a rank whose MoD routes no token must still run
       the block, whose FSDP all-gathers and expert all-to-alls every rank enters.
    3. ``compile=True``: ``torch.compile`` per block (``mode.model.blocks``), before sharding.
    4. **FSDP2.** Each expert bank: its L experts sharded over dp, by ``fully_shard(bank, mesh=mesh,
       dp_mesh_dims=DataParallelMeshDims(shard="dp"))`` where torch has it (2.13 and later), else by
       ``fully_shard(bank, mesh=mesh["dp"])`` on the ep DTensors (torch 2.11; 2.12 untested; FSDP joins the two
       meshes into a ``(dp, ep)`` one itself). Either way the weights end up as DTensors on a ``(dp, ep)``
       mesh with placements ``[_StridedShard(0, sf=ep), Shard(0)]`` (``Shard(0)`` over dp when ep = 1).
       Each block, then the root: ``fully_shard`` on the flattened dp x ep mesh (every dense weight sharded
       W ways; attention, norms, routers, embeddings).
    5. Every token-choice router gets ``reduce_counts``: its choice counts summed over the whole dp x ep
       mesh, for the balancing bias (``mode.routing.update_expert_bias``) and the global-batch balance loss.
    6. **Gradient reduction: sums.** Divide factor 1.0 and force-sum on every FSDP module; the training
       loop calls ``backward`` on ``loss / W`` (``mode.train.Trainer``). On gloo a divide factor other
       than 1 fails (``PREMUL_SUM`` is not supported) and torch's own averaging divides twice in one layout;
       summing ``loss / W`` is exact in every layout (tests/parallel/test_ep_training.py).

A model built on the meta device (``mode.parallel.meta_init``) is parallelized the same way, on meta; then
``materialize(model, device)`` gives each rank its shards of the eager initial values.

Gradient clipping with parameters on two meshes: ``mode.parallel.runtime.clip_grad_norm_`` (one norm per
mesh, combined, then applied per mesh); ``torch.nn.utils.clip_grad_norm_`` refuses mixed meshes.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Iterable
from typing import Any, cast

import torch
import torch.distributed.fsdp as _fsdp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

from mode._module_attr import set_module_attr
from mode.dispatch.expert_parallel import ExpertParallelDispatcher
from mode.experts.bank import ExpertBank
from mode.layers.mod import MoD
from mode.layers.moe import MoELayer
from mode.model.blocks import compile_blocks, resolve_blocks
from mode.model.deferred_init import guard_forward, is_meta_built
from mode.parallel.ep_model import shard_experts
from mode.parallel.mesh import flat_mesh, mesh_dims
from mode.parallel.stats_reduce import SumOverGroup

# Chosen once, by what the installed torch offers: fully_shard(..., dp_mesh_dims=) on the whole (dp, ep) mesh
# (torch >= 2.13), or the older EP path (the bank on mesh["ep"], fully_shard on mesh["dp"]; tested on torch 2.11).
SPMD_MESH_DIMS = hasattr(_fsdp, "DataParallelMeshDims") and "dp_mesh_dims" in inspect.signature(fully_shard).parameters
# The oldest torch the mesh path is tested on (2.11 with the older EP path, 2.13 with dp_mesh_dims). Older ones
# (the MegaBlocks stack's 2.7.0, docs/backends.md) run the one-process library only; parallelize refuses them.
MIN_TORCH = (2, 11)
_TORCH_MAJOR_MINOR = re.match(r"(\d+)\.(\d+)", torch.__version__)
assert _TORCH_MAJOR_MINOR is not None, f"torch.__version__={torch.__version__!r}: not major.minor[...]"
TORCH_VERSION = tuple(int(v) for v in _TORCH_MAJOR_MINOR.groups())


def moe_layers(model: nn.Module) -> dict[str, MoELayer]:
    """Module name -> every ``MoELayer`` in ``model`` (the model itself included)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, MoELayer)}


def is_parallelized(model: nn.Module) -> bool:
    return any(isinstance(m, FSDPModule) for m in model.modules())


def _distribute_bank(bank: ExpertBank, mesh: DeviceMesh) -> None:
    """Turn the bank's (L, ...) weights into DTensors of global shape (E, ...), Shard(0) on the ep dim: on the
    whole (dp, ep) mesh, Replicate over dp, where fully_shard takes ``dp_mesh_dims``; else on ``mesh["ep"]``."""
    on, placements = (mesh, [Replicate(), Shard(0)]) if SPMD_MESH_DIMS else (mesh["ep"], [Shard(0)])
    first = None
    for name, p in list(bank.named_parameters(recurse=False)):
        dt = DTensor.from_local(p.detach(), on, placements, run_check=False)
        param = nn.Parameter(dt, requires_grad=p.requires_grad)
        # nn.Parameter detaches a DTensor through the sharding propagator, whose cache may hand back an equal
        # mesh object from an earlier model of this process; fully_shard wants one object for the whole bank
        shard = cast(DTensor, param)  # a Parameter made of a DTensor is one
        first = shard.device_mesh if first is None else first
        if shard.device_mesh is not first:
            shard._spec = dataclasses.replace(shard._spec, mesh=first)
        bank.register_parameter(name, param)


def _shard_bank(bank: ExpertBank, mesh: DeviceMesh, kw: dict) -> None:
    """FSDP2 over dp on a bank made by ``_distribute_bank``."""
    if SPMD_MESH_DIMS:
        # the weights' own mesh object: equal to ``mesh``, but DTensor may hand back an equal one made
        # earlier (its specs are cached), and fully_shard wants the very object
        fully_shard(
            bank, mesh=cast(DTensor, bank.w_in).device_mesh, dp_mesh_dims=_fsdp.DataParallelMeshDims(shard="dp"), **kw
        )
    else:  # FSDP concatenates mesh["dp"] with the weights' ep mesh (torch 2.11: _fsdp_param, DTensor params)
        fully_shard(bank, mesh=mesh["dp"], **kw)


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    blocks: Iterable[nn.Module] | None = None,
    compile: bool = False,
    reshard_after_forward: bool | None = None,
    dedup: bool = False,
) -> nn.Module:
    """Make ``model`` expert-parallel over ``mesh["ep"]`` and fully sharded over the whole mesh, in place;
    returns it. ``blocks``: the FSDP (and compile) units below the root (default: the children of the
    model's outermost ``ModuleList``/``ModuleDict``, ``mode.model.blocks``). ``reshard_after_forward``
    goes to every ``fully_shard`` (None: FSDP's default, True below the root). ``dedup``: the expert-parallel
    dispatchers send one row per (token, destination rank) instead of one per assignment
    (``ExpertParallelDispatcher``; worth it with top-k > 1, above all with device-limited routing)."""
    if TORCH_VERSION < MIN_TORCH:
        raise ValueError(
            f"torch {torch.__version__}: parallelize needs torch>={'.'.join(map(str, MIN_TORCH))} "
            "(the oldest it is tested on; 2.11 and 2.13 are); "
            "install a newer torch, or train in one process"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"model={type(model).__name__}: must be an nn.Module")
    dims = mesh_dims(mesh)
    if is_parallelized(model):
        raise ValueError("model: is already parallelized (it holds FSDP modules); build a fresh model")
    layers = moe_layers(model)
    for name, layer in layers.items():
        if isinstance(layer.dispatcher, ExpertParallelDispatcher):
            raise ValueError(
                f"{name or 'model'}: is already expert-parallel (mode.parallel.ep_model.shard_model); "
                "parallelize a model built for one process"
            )
        dims.check_experts(cast(int, layer.router.num_experts), f"{name or 'model'}.router.num_experts")  # an int
    blocks = resolve_blocks(model, blocks)

    ep_mesh = mesh["ep"]
    ep_rank = ep_mesh.get_local_rank()
    banks = []
    for layer in layers.values():
        E = cast(int, layer.router.num_experts)  # a router's int
        if dims.ep > 1:
            layer.set_experts(
                shard_experts(layer.experts, ep_rank, dims.ep),
                ExpertParallelDispatcher(ep_mesh.get_group(), E, dedup=dedup),
            )  # one per layer
        _distribute_bank(layer.experts, mesh)
        banks.append(layer.experts)
    for m in model.modules():
        if isinstance(m, MoD):
            m.skip_empty = False  # every rank enters the block's collectives, whatever it routed

    if compile:
        compile_blocks(model, blocks)

    kw: dict[str, Any] = {} if reshard_after_forward is None else {"reshard_after_forward": reshard_after_forward}
    for bank in banks:
        _shard_bank(bank, mesh, kw)
    flat = flat_mesh(mesh)
    counts_over_mesh = SumOverGroup(flat.get_group())  # every rank holds a copy of every router
    for m in model.modules():
        if hasattr(m, "reduce_counts"):  # token-choice routers: bias balancing, the global balance loss
            set_module_attr(m, "reduce_counts", counts_over_mesh)
    for block in blocks:
        fully_shard(block, mesh=flat, **kw)
    fully_shard(model, mesh=flat, **kw)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    if is_meta_built(model):  # built on meta: a forward before materialize names the fix (before FSDP's hooks)
        guard_forward(model)
    return model

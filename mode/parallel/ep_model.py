"""Turn a single-process model into this rank's expert-parallel copy, and back (for checkpoints).

Shape legend: E experts in all, P ranks in the expert-parallel group, L = E / P experts per rank.

``shard_model(model, group)`` walks any ``nn.Module`` (the LM, a custom transformer, a bare layer) and
replaces every ``MoELayer`` / ``IntegratedMoDE`` in it — also the one inside a ``StagedMoDE`` block — by
``shard_layer(layer, ExpertParallelDispatcher(group, E))``: the router stays replicated, the experts
become rank p's contiguous shard ``[p*L, (p+1)*L)``. A ``MoD`` wrapper around such a layer is told not
to skip its block when it routes no token (``skip_empty = False``): every rank must enter the all-to-all. The replacement keeps each module at its place, so
``named_parameters()`` lists the same names in the same order as the single-process model: state
dicts and optimizer states map one to one, only the expert tensors are ``L`` long instead of ``E``.

Build the full model with the same seed on every rank (identical weights), then shard it: the model
code itself never learns about the process group.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch import Tensor, nn

from mode import distributed as mdist
from mode.dispatch.expert_parallel import ExpertParallelDispatcher
from mode.experts.bank import ExpertBank
from mode.layers.mod import MoD
from mode.layers.moe import MoELayer


def shard_experts(full: ExpertBank, rank: int, world_size: int) -> ExpertBank:
    """The ``ExpertBank`` of experts ``[rank * L, (rank + 1) * L)``, ``L = E / world_size``, with their
    weights copied from ``full`` (a bank over all E experts, e.g. built identically on every rank)."""
    E = full.num_experts
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: must be an int >= 1")
    if E % world_size:
        raise ValueError(f"num_experts={E}: must be divisible by the expert-parallel group size {world_size} "
                         "(each rank holds num_experts / group size experts)")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank}: must be in [0, world_size={world_size})")
    L = E // world_size
    lo = rank * L
    shard = ExpertBank(dataclasses.replace(full.cfg, num_experts=L))
    shard.to(device=full.w_in_EDF.device, dtype=full.w_in_EDF.dtype)
    with torch.no_grad():
        shard.w_in_EDF.copy_(full.w_in_EDF[lo:lo + L])
        shard.w_out_EHD.copy_(full.w_out_EHD[lo:lo + L])
    return shard


def shard_layer(full: MoELayer, dispatcher: ExpertParallelDispatcher) -> MoELayer:
    """A copy of a single-process ``MoELayer`` (or ``IntegratedMoDE``) for this rank: the router is
    replicated (deep-copied), the experts are this rank's shard, dispatch goes through ``dispatcher``."""
    if full.experts.num_experts != dispatcher.num_experts:
        raise ValueError(f"experts.num_experts={full.experts.num_experts}: must equal the dispatcher's "
                         f"num_experts={dispatcher.num_experts}")
    shard = shard_experts(full.experts, dispatcher.rank, dispatcher.world_size)
    return type(full)(copy.deepcopy(full.router), shard, dispatcher)


def shard_model(model: nn.Module, group=None) -> nn.Module:
    """Shard every MoE layer of ``model`` over ``group`` (default: the world), in place; returns ``model``."""
    if isinstance(model, MoELayer):
        raise ValueError("model: is itself a MoELayer; use shard_layer(layer, ExpertParallelDispatcher(group, E))")
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, MoELayer)]
    for parent, name, layer in targets:
        if isinstance(layer.dispatcher, ExpertParallelDispatcher):
            raise ValueError(f"{type(parent).__name__}.{name}: is already expert-parallel")
        dispatcher = ExpertParallelDispatcher(group, layer.router.num_experts)  # one per layer: its own stats
        setattr(parent, name, shard_layer(layer, dispatcher))  # same slot in _modules: same parameter order
    for m in model.modules():  # a MoD around an expert-parallel layer must call its block even when empty
        if isinstance(m, MoD) and any(isinstance(c, MoELayer) and isinstance(c.dispatcher, ExpertParallelDispatcher)
                                      for c in m.block.modules()):
            m.skip_empty = False
    return model


def expert_parallel_layers(model: nn.Module) -> dict[str, MoELayer]:
    """Module name -> MoE layer whose experts are sharded (expert-parallel dispatcher)."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m, MoELayer) and isinstance(m.dispatcher, ExpertParallelDispatcher)}


def sharded_parameter_names(model: nn.Module) -> list[str]:
    """Names of the expert parameters that are sharded over the group (leading dim L, not E)."""
    return [f"{prefix}.experts.{n}" for prefix, layer in expert_parallel_layers(model).items()
            for n, _ in layer.experts.named_parameters()]


def split_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(replicated, sharded): every parameter once (tied weights included once), in model order."""
    sharded_ids = {id(p) for layer in expert_parallel_layers(model).values() for p in layer.experts.parameters()}
    params = list(model.parameters())
    return [p for p in params if id(p) not in sharded_ids], [p for p in params if id(p) in sharded_ids]


def full_state_dict(model: nn.Module, group=None) -> dict[str, Tensor] | None:
    """The single-process state dict (expert tensors gathered to length E, on CPU) on the group's rank 0;
    None on the other ranks. Every rank of the group must call it (it runs one gather per expert tensor)."""
    rank, _ = mdist.rank_and_size(group)
    sharded = set(sharded_parameter_names(model))
    state = {}
    for key, value in model.state_dict().items():
        if key in sharded:
            value = mdist.gather_cat(value, group)  # rank order == expert order (contiguous shards)
        if rank == 0:
            state[key] = value.detach().cpu().clone()
    return state if rank == 0 else None


def shard_state_dict(model: nn.Module, full: dict[str, Tensor], group=None) -> dict[str, Tensor]:
    """This rank's slice of a single-process state dict, ready for ``model.load_state_dict`` of a model
    sharded by ``shard_model`` (loads single-process checkpoints into expert-parallel training)."""
    rank, world = mdist.rank_and_size(group)
    out = dict(full)
    for key in sharded_parameter_names(model):
        E = full[key].shape[0]
        if E % world:
            raise ValueError(f"{key}: {E} experts are not divisible by the expert-parallel group size {world}")
        L = E // world
        out[key] = full[key][rank * L:(rank + 1) * L]
    return out

"""Plain-tensor expert parallelism: a single-process layer or model turned into this rank's copy.

``mode.parallel.parallelize`` is the way to train (it uses ``shard_experts`` and then makes the expert weights
DTensors and applies FSDP2); the functions here shard the experts of a model over any process group as plain
tensors, for layer-level use and tests (tests/parallel/test_distributed.py) where no DeviceMesh is wanted.

Shape legend: E experts in all, P ranks in the expert-parallel group, L = E / P experts per rank.

``shard_model(model, group)`` walks any ``nn.Module`` (the LM, a custom transformer, a bare layer) and
replaces every ``MoELayer`` / ``IntegratedMoDE`` in it — also the one inside a ``StagedMoDE`` block — by
``shard_layer(layer, ExpertParallelDispatcher(group, E))``: the router stays replicated, the experts
become rank p's contiguous shard ``[p*L, (p+1)*L)``. A ``MoD`` wrapper around such a layer is told not
to skip its block when it routes no token (``skip_empty = False``): every rank must enter the all-to-all.
The replacement keeps each module at its place, so ``named_parameters()`` lists the same names in the same
order as the single-process model; only the expert tensors are ``L`` long instead of ``E`` (and, being plain
tensors, do not say so: FSDP and DCP would treat them as replicated, which is why ``parallelize`` makes
them DTensors).

Build the full model with the same seed on every rank (identical weights), then shard it: the model
code itself never learns about the process group.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import cast

import torch
from torch import nn

from mode.dispatch.expert_parallel import ExpertParallelDispatcher
from mode.experts.bank import ExpertBank
from mode.layers.mod import MoD
from mode.layers.moe import MoELayer
from mode.model.deferred_init import build_draws_only


def shard_experts(full: ExpertBank, rank: int, world_size: int) -> ExpertBank:
    """The ``ExpertBank`` of experts ``[rank * L, (rank + 1) * L)``, ``L = E / world_size``, with their
    weights copied from ``full`` (a bank over all E experts, e.g. built identically on every rank)."""
    E = full.num_experts
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: must be an int >= 1")
    if E % world_size:
        raise ValueError(
            f"num_experts={E}: must be divisible by the expert-parallel group size {world_size} "
            "(each rank holds num_experts / group size experts)"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank}: must be in [0, world_size={world_size})")
    L = E // world_size
    lo = rank * L
    cfg = dataclasses.replace(full.cfg, num_experts=L)
    if full.w_in.is_meta:  # built on meta (mode.parallel.meta_init): no memory, the same draws as the line below
        shard = build_draws_only(lambda: ExpertBank(cfg)).to(dtype=full.w_in.dtype)
    else:
        shard = ExpertBank(cfg)  # its init draws from the global generator (a run's later draws follow them)
        shard.to(device=full.w_in.device, dtype=full.w_in.dtype)
    with torch.no_grad():
        for name, p in full.named_parameters(recurse=False):  # each weight's experts are its rows
            getattr(shard, name).copy_(p[lo : lo + L])
    return shard


def shard_layer(full: MoELayer, dispatcher: ExpertParallelDispatcher) -> MoELayer:
    """A copy of a single-process ``MoELayer`` (or ``IntegratedMoDE``) for this rank: the router is
    replicated (deep-copied), the experts are this rank's shard, dispatch goes through ``dispatcher``; shared
    experts and copy/constant no-op experts, which every token runs on its own rank, are replicated too."""
    if full.experts.num_experts != dispatcher.num_experts:
        raise ValueError(
            f"experts.num_experts={full.experts.num_experts}: must equal the dispatcher's "
            f"num_experts={dispatcher.num_experts}"
        )
    shard = shard_experts(full.experts, dispatcher.rank, dispatcher.world_size)
    return type(full)(
        copy.deepcopy(full.router),
        shard,
        dispatcher,
        copy.deepcopy(full.shared_experts),
        copy.deepcopy(full.shared_gate),
        copy.deepcopy(full.noop),
    )


def shard_model(model: nn.Module, group=None) -> nn.Module:
    """Shard every MoE layer of ``model`` over ``group`` (default: the world), in place; returns ``model``."""
    if isinstance(model, MoELayer):
        raise ValueError("model: is itself a MoELayer; use shard_layer(layer, ExpertParallelDispatcher(group, E))")
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, MoELayer)
    ]
    for parent, name, layer in targets:
        if isinstance(layer.dispatcher, ExpertParallelDispatcher):
            raise ValueError(f"{type(parent).__name__}.{name}: is already expert-parallel")
        # one per layer: its own stats (num_experts: a router's int)
        dispatcher = ExpertParallelDispatcher(group, cast(int, layer.router.num_experts))
        setattr(parent, name, shard_layer(layer, dispatcher))  # same slot in _modules: same parameter order
    for m in model.modules():  # a MoD around an expert-parallel layer must call its block even when empty
        if isinstance(m, MoD) and any(
            isinstance(c, MoELayer) and isinstance(c.dispatcher, ExpertParallelDispatcher) for c in m.block.modules()
        ):
            m.skip_empty = False
    return model


def expert_parallel_layers(model: nn.Module) -> dict[str, MoELayer]:
    """Module name -> MoE layer whose experts are sharded (expert-parallel dispatcher)."""
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, MoELayer) and isinstance(m.dispatcher, ExpertParallelDispatcher)
    }

"""Turn a single-process model into this rank's expert-parallel copy, and back (for checkpoints).

Shape legend: E experts in all, P ranks in the expert-parallel group, L = E / P experts per rank.

``shard_model(model, group)`` walks any ``nn.Module`` (the LM, a custom transformer, a bare layer) and
replaces every ``MoELayer`` / ``IntegratedMoDE`` in it — also the one inside a ``StagedMoDE`` block — by
``ExpertParallelDispatcher(group, E).shard_layer(layer)``: the router stays replicated, the experts
become rank p's contiguous shard ``[p*L, (p+1)*L)``. The replacement keeps each module at its place, so
``named_parameters()`` lists the same names in the same order as the single-process model: state
dicts and optimizer states map one to one, only the expert tensors are ``L`` long instead of ``E``.

Build the full model with the same seed on every rank (identical weights), then shard it: the model
code itself never learns about the process group.
"""

from __future__ import annotations

from torch import Tensor, nn

from mode import distributed as mdist
from mode.dispatch.expert_parallel import ExpertParallelDispatcher
from mode.layers.moe import MoELayer


def shard_model(model: nn.Module, group=None) -> nn.Module:
    """Shard every MoE layer of ``model`` over ``group`` (default: the world), in place; returns ``model``."""
    if isinstance(model, MoELayer):
        raise ValueError("model: is itself a MoELayer; use ExpertParallelDispatcher(group, E).shard_layer(layer)")
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, MoELayer)]
    for parent, name, layer in targets:
        if isinstance(layer.dispatcher, ExpertParallelDispatcher):
            raise ValueError(f"{type(parent).__name__}.{name}: is already expert-parallel")
        dispatcher = ExpertParallelDispatcher(group, layer.router.num_experts)  # one per layer: its own stats
        setattr(parent, name, dispatcher.shard_layer(layer))  # same slot in _modules: same parameter order
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

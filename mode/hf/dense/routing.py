"""Choosing how converted layers route, and reading what they routed.

Training routes the top-C tokens of each sequence; sampling needs the causal decision (``r > 0``, or the
predictor's logit), which looks at no future token. ``"auto"`` (the default) picks top-C in train mode and
the causal decision in eval mode. Pick explicitly with ``routing(model, "topk" | "causal")`` rather than
relying on whether a cache is present: a plain ``model(ids)`` call builds a cache too. ``"dense"`` runs
the original layers without routing (the unconverted model, e.g. the teacher of ``router_tune``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from mode import _checks
from mode.hf.dense.convert import mod_layers
from mode.hf.dense.mod_layer import ROUTING
from mode.routing.plan import Aux


@contextlib.contextmanager
def routing(model: nn.Module, mode: str) -> Iterator[nn.Module]:
    """Route every MoD layer of ``model`` by ``mode`` ("topk", "causal", "dense" or "auto") inside the block."""
    _checks.check_choice("mode", mode, ROUTING)
    layers = mod_layers(model)
    if not layers:
        raise ValueError("routing: the model has no MoD layer (convert it with mode.hf.to_mod first)")
    if mode == "causal":
        for i, layer in layers.items():
            problem = layer.mod_router.cfg.causal_problem()
            if problem is not None:
                raise ValueError(f"layer {i}: {problem}")
    before = {i: layer.mod_routing for i, layer in layers.items()}
    for layer in layers.values():
        layer.mod_routing = mode
    try:
        yield model
    finally:
        for i, layer in layers.items():
            layer.mod_routing = before[i]


def collect_aux(model: nn.Module) -> Aux:
    """The routing results of the last forward: ``layers.{i}.mod.*`` losses (the causal BCE) and stats
    (``layers.{i}.mod.router``), and ``layers.{i}.moe.*`` for upcycled and converted MoE layers. ``total()``
    is what to add to the training loss."""
    aux = Aux()
    for i, layer in mod_layers(model).items():
        if layer.mod_aux is not None:
            aux.merge(layer.mod_aux, f"layers.{i}.mod.")
    from mode.hf.dense.upcycle import MoESlot, upcycled_mlps  # late: upcycling imports the MoE stack

    for i, mlp in upcycled_mlps(model, MoESlot).items():
        if mlp.last_aux is not None:
            aux.merge(mlp.last_aux, f"layers.{i}.moe.")
    return aux

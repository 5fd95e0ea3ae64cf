"""Balancing without an auxiliary loss (DeepSeek-V3, sec. 2.1.2): the update of the routers' choice biases.

Shape legend: X expert slots (real, then no-op).

A token-choice router built with ``bias_balance=True`` adds its buffer ``bias_X`` to the scores it chooses by
(never to the gates) and, in training forwards with gradients on, adds the step's choice counts to
``load_X``. After each optimizer step, ``update_expert_bias(model)`` moves every such bias by

    bias_X += rate * sign(target_X - load_X),    then    bias_X -= mean(bias_X),    load_X = 0

where ``target_X`` spreads the step's choices by the router's ``target_shares()`` (evenly, or holding
``noop_target`` of them on the no-op slots). A slot chosen more than its target becomes less attractive,
one chosen less more attractive; the common shift of the re-centring changes no choice.

The load is summed over every micro-batch since the last update and, under ``mode.parallel.parallelize``,
over every rank holding a copy of the router: the router's ``reduce_counts`` (installed by ``parallelize``)
sums it over the whole dp x ep mesh, one collective for all routers. Your own training loop calls
``update_expert_bias(model)`` after ``optimizer.step()``; the ``Trainer`` does. Nothing here imports
``torch.distributed``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, cast

import torch
from torch import Tensor, nn


class _BiasRouter(Protocol):
    """What ``update_expert_bias`` reads of a router that balances with a bias (``TokenChoiceRouter``'s buffers)."""

    bias_X: Tensor
    load_X: Tensor
    share_X: Tensor
    reduce_counts: Callable[[Tensor], Tensor] | None
    cfg: Any  # its bias_rate


def bias_routers(model: nn.Module) -> list[nn.Module]:
    """The routers of ``model`` that balance with a bias (those with a ``bias_X`` buffer), in module order."""
    return [
        m
        for m in model.modules()
        if isinstance(getattr(m, "bias_X", None), torch.Tensor) and isinstance(getattr(m, "load_X", None), torch.Tensor)
    ]


@torch.no_grad()
def update_expert_bias(model: nn.Module, routers: list[nn.Module] | None = None) -> int:
    """Move every balancing bias of ``model`` towards its target load and clear the counted load; returns
    the number of routers updated. ``routers``: ``bias_routers(model)``, when the caller keeps that list.

    Every rank of a parallelized model must call it at the same point (the load is summed over ranks)."""
    routers = bias_routers(model) if routers is None else routers
    if not routers:
        return 0
    by_reducer: dict[int, list[_BiasRouter]] = {}
    for r in cast("list[_BiasRouter]", routers):  # parallelize gives every router of a model the same group
        by_reducer.setdefault(id(r.reduce_counts), []).append(r)  # one collective in all
    for group in by_reducer.values():
        loads = torch.cat([r.load_X for r in group])
        if group[0].reduce_counts is not None:
            loads = group[0].reduce_counts(loads)
        for r, load_X in zip(group, loads.split([r.load_X.numel() for r in group])):
            bias_X = r.bias_X
            target_X = load_X.sum() * r.share_X
            bias_X += r.cfg.bias_rate * torch.sign(target_X - load_X)  # in place: the buffer itself
            bias_X -= bias_X.mean()
            r.load_X.zero_()
    return len(routers)

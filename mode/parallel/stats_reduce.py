"""Routing statistics summed over the ranks of a process group: a ``RoutingAccumulator``
(``all_reduce_accumulator``) and the routers' choice counts (``SumOverGroup``, which ``parallelize`` installs
as each router's ``reduce_counts`` for bias balancing and the global-batch balance loss).

Every rank of ``group`` must call ``all_reduce_accumulator`` at the same point. Ranks may have seen
different routers (e.g. a staged layer whose MoD routed no token on one rank) and different sequence
lengths: the layouts are exchanged first (``all_gather_object``), every rank pads its sums to the union
(zeros are exact: missing means nothing was counted), and one ``all_reduce(SUM)`` of a flat float64
vector does the rest. Afterwards every rank holds the totals over all ranks.

``torch.distributed`` is imported inside the function, so importing this module (or ``mode.measure.stats``)
never pulls it into model code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mode.measure.stats import RoutingAccumulator


def all_reduce_accumulator(
    acc: RoutingAccumulator, group=None, device: torch.device | None = None
) -> RoutingAccumulator:
    """Replace ``acc``'s sums by their sum over ``group`` (None: the default group); returns ``acc``.

    ``device``: where the flat vector travels; default CUDA's current device for NCCL, else CPU.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "all_reduce_accumulator: torch.distributed is not initialised; call "
            "init_process_group first (or use RoutingAccumulator.merge in one process)"
        )
    if device is None:
        backend = dist.get_backend(group)
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    layout = {k: v.numel() for k, v in acc.sums.items()}
    world = dist.get_world_size(group)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (layout, acc.layer_kinds), group=group)
    union: dict[str, int] = {}
    kinds = None
    for lay, k in gathered:
        for key, n in lay.items():
            union[key] = max(union.get(key, 0), n)
        if k is not None:
            if kinds is not None and tuple(k) != tuple(kinds):
                raise ValueError(f"layer kinds differ across ranks: {tuple(k)} vs {tuple(kinds)}")
            kinds = tuple(k)
    keys = sorted(union)
    parts = []
    for key in keys:
        v = acc.sums.get(key)
        v = (
            torch.zeros(union[key], dtype=torch.float64, device=device)
            if v is None
            else v.detach().to(device=device, dtype=torch.float64)
        )
        parts.append(F.pad(v, (0, union[key] - v.numel())))
    flat = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64, device=device)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    out = flat.split([union[k] for k in keys]) if keys else []
    acc.sums = {k: t.clone() for k, t in zip(keys, out)}
    acc.layer_kinds = kinds
    return acc


class SumOverGroup:
    """``t`` summed over the ranks of ``group`` (a detached copy): a router's ``reduce_counts``. Every rank
    holding a copy of the router must call it at the same point (the router's forward, the bias update)."""

    def __init__(self, group):
        self.group = group

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        out = t.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out

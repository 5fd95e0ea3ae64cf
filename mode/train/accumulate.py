"""Gradient accumulation: one optimizer step over N micro-batches of each process's rows, with the loss and
the gradient of the whole batch.

Shape legend: b rows of this process, m = b / N rows of a micro-batch, S sequence, X expert slots.

The trainer splits its ``b`` rows into N micro-batches of ``m`` rows and calls ``backward`` on each
micro-batch's loss divided by ``N * W`` (W processes): the gradients add up to those of the global mean.
That is exact for every mean over tokens (cross-entropy, router z-loss, the causal BCE), since the
micro-batches hold equally many tokens, and for everything decided per sequence (MoD top-C, expert choice,
the "sequence" balance loss). The Switch balance loss of scope "batch" and a token-choice capacity limit
are per forward, so per micro-batch (as they are per rank on a mesh: docs/distributed.md).

**The "global" balance loss** (``balance_scope="global"``, docs/routing.md) is ``X * sum_x f_x P_x`` with
``f_x`` the share of the choices that picked slot x (counts: no gradient) and ``P_x`` the mean router
probability of x (the gradient). The whole batch's loss takes ``f`` from the counts of every micro-batch
(and every rank) and ``P`` over every token; ``P`` is the mean of the micro-batches' ``P``, so micro-batch
i contributes ``X * sum_x f_x P_x^(i) / N`` -- which needs the whole batch's ``f`` before micro-batch i's
backward, while micro-batch N's routing is not known until its forward. A correction after the fact,
``X * sum_x (f_x - f_x^(i)) dP_x^(i)/dtheta``, would need micro-batch i's graph again (every layer below
the router), which its backward has freed: as costly as the forward it would repeat. So the counts come
first, from a **counting pass**: one forward of every micro-batch under ``torch.no_grad`` (no activations
kept), in which each global-scope router's ``reduce_counts`` is a recorder; the counts are summed over the
micro-batches, then over the ranks (one collective for every router together, where the plain mesh run
does one per layer); then the N training forwards run with ``reduce_counts`` answering those totals
(``FixedCounts``), and each micro-batch's loss is its exact share of the whole batch's.

Cost: one extra forward per step (about a third of the step's compute; the logged FLOPs do not count it),
only when N > 1 and a router has the global scope with ``balance_coef > 0``. The counting pass leaves no
trace: it runs on a fork of the RNG (a ``mod_random`` layer draws the same tokens again in the training
forwards, which is what makes the counts theirs), every buffer of the model is put back after it (the
``causal="threshold"`` EMA), and the bias-balance load is only counted with autograd on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import cast

import torch
from torch import Tensor, nn

from mode.model.checkpointing import preserved_buffers


def global_balance_routers(model: nn.Module) -> list[nn.Module]:
    """The routers of ``model`` whose balance loss is over the whole batch ("global" scope, a coefficient
    above 0): those whose counts a micro-batch cannot know alone. In module order."""
    found = []
    for m in model.modules():
        cfg = getattr(m, "cfg", None)
        if (
            hasattr(m, "reduce_counts")
            and getattr(cfg, "balance_scope", None) == "global"
            and getattr(cfg, "balance_coef", 0) > 0
        ):
            found.append(m)
    return found


class _Recorder:
    """A router's ``reduce_counts`` during the counting pass: adds up what it is given, changes nothing."""

    def __init__(self):
        self.total: Tensor | None = None

    def __call__(self, counts: Tensor) -> Tensor:
        counts = counts.detach()
        self.total = counts.clone() if self.total is None else self.total + counts
        return counts  # this pass's loss is thrown away


class FixedCounts:
    """A router's ``reduce_counts`` that answers the whole batch's counts (choice counts per slot, then the
    token count), whatever this forward counted."""

    def __init__(self, counts: Tensor):
        self.counts = counts

    def __call__(self, counts: Tensor) -> Tensor:
        assert counts.shape == self.counts.shape, (counts.shape, self.counts.shape)
        return self.counts


@contextlib.contextmanager
def _reduce_counts_set(routers: list[nn.Module], reducers: list) -> Iterator[None]:
    saved = [r.reduce_counts for r in routers]
    for r, fn in zip(routers, reducers):
        r.reduce_counts = fn
    try:
        yield
    finally:
        for r, fn in zip(routers, saved):
            r.reduce_counts = fn


class GradAccumulation:
    """The micro-batches of one optimizer step, and the whole batch's routing counts they need.

    ``n``: micro-batches per step. ``autocast``: the trainer's forward context. ``device``: where the
    model runs (its RNG is forked for the counting pass)."""

    def __init__(self, model: nn.Module, n: int, autocast: Callable, device: torch.device):
        self.model, self.n, self.autocast, self.device = model, n, autocast, device
        self.routers = global_balance_routers(model) if n > 1 else []  # the counting pass runs for these

    def split(self, x_bS: Tensor, y_bS: Tensor) -> list[tuple[Tensor, Tensor]]:
        """The ``n`` micro-batches ``(x_mS, y_mS)`` of this process's rows, in row order."""
        assert x_bS.shape[0] % self.n == 0, (x_bS.shape, self.n)  # checked when the trainer is built
        return list(zip(x_bS.chunk(self.n), y_bS.chunk(self.n)))

    @contextlib.contextmanager
    def whole_batch_routing(self, micro: list[tuple[Tensor, Tensor]]) -> Iterator[None]:
        """Inside it, every global-scope router forms its balance loss from the choice counts of all of
        ``micro`` (and of every rank): run the training forwards of ``micro`` in it. Nothing to do without
        such routers (or with one micro-batch: the routers sum over ranks themselves)."""
        if not self.routers:
            yield
            return
        totals = self.count(micro)
        with _reduce_counts_set(self.routers, [FixedCounts(t) for t in totals]):
            yield

    @torch.no_grad()
    def count(self, micro: list[tuple[Tensor, Tensor]]) -> list[Tensor]:
        """The counting pass: per global-scope router, its choice counts and token count summed over every
        micro-batch and every rank (``reduce_counts``' own layout: X counts, then the tokens)."""
        recorders = [_Recorder() for _ in self.routers]
        devices = [self.device] if self.device.type == "cuda" else []
        with (
            _reduce_counts_set(self.routers, recorders),
            torch.random.fork_rng(devices=devices),
            preserved_buffers(self.model),
        ):
            for x_mS, _ in micro:
                with self.autocast():
                    self.model(x_mS)
        totals = []
        for r, rec in zip(self.routers, recorders):  # a router no forward reached counted nothing
            totals.append(
                rec.total if rec.total is not None else torch.zeros(cast(int, r.num_slots) + 1, device=self.device)
            )
        by_reducer: dict[int, list[int]] = {}
        for i, r in enumerate(self.routers):  # parallelize gives every router the same: one collective
            if r.reduce_counts is not None:
                by_reducer.setdefault(id(r.reduce_counts), []).append(i)
        for idx in by_reducer.values():
            reduce = cast("Callable[[Tensor], Tensor]", self.routers[idx[0]].reduce_counts)  # not None: above
            summed = reduce(torch.cat([totals[i] for i in idx]))
            for i, part in zip(idx, summed.split([totals[i].numel() for i in idx])):
                totals[i] = part
        return totals

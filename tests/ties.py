"""The precondition of every test that compares routed runs across layouts, ranks, processes or devices: no
routing decision is a near-tie that the arithmetic of the other run could flip.

Two runs of the same model on the same data (one process against a mesh, a whole batch against micro-batches)
compute the same scores up to rounding: sums taken in another order, matmuls on another row count. A top-k
(token choice over slots, expert choice and MoD top-C over a sequence) whose k-th and (k+1)-th scores lie
closer than that rounding may pick differently in the two runs, and from then on the runs differ by far more
than rounding: a test of their equality then fails on a correct implementation, on some CPUs only.

``TopkGaps`` records, while it is active, the smallest relative gap ``|s_k - s_(k+1)| / max(|s_k|, |s_(k+1)|)``
(rounding is relative to the values' size) at every top-k boundary of a floating tensor (``torch.topk`` and
``Tensor.topk``, the routers' only selection), one minimum per call. A
test runs its reference inside it and asserts ``smallest() > floor``, the floor far above the arithmetic's
error: then, by construction, the other run takes the same decisions, and the equality it asserts is a
property of the implementation, not of the machine. The tests that use it choose their data so that it holds
(no two positions of a sequence with identical hidden states: an exact tie, which ``topk`` breaks by an order
that depends on the tensor's shape) and run in float64 (``Trainer(dtype=torch.float64)``), whose error is
~1e-15 against relative gaps of ~1e-5 and more.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class TopkGaps:
    """Per ``topk`` call on a floating tensor with ``k < n``: ``(shape, dim, k, smallest relative gap)``. A gap of a
    non-finite boundary (masked scores at -inf on both sides) counts as 0: a tie."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[int, ...], int, int, float]] = []

    def record(self, t: torch.Tensor, k: int, dim: int, largest: bool) -> None:
        n = t.shape[dim] if t.dim() else 1
        if not t.is_floating_point() or not 0 < k < n:
            return
        s = t.detach().sort(dim=dim, descending=largest).values
        a, b = s.narrow(dim, k - 1, 1), s.narrow(dim, k, 1)
        # relative to the scores' size, as rounding is: |a - b| / max(|a|, |b|)
        gap = (a - b).abs() / torch.maximum(a.abs(), b.abs()).clamp_min(torch.finfo(t.dtype).tiny)
        gap = torch.where(torch.isnan(gap), torch.zeros_like(gap), gap)
        self.calls.append((tuple(t.shape), dim % t.dim(), k, float(gap.min())))

    def smallest(self) -> float:
        return min((c[3] for c in self.calls), default=float("inf"))

    def assert_above(self, floor: float, what: str) -> None:
        """Every recorded boundary's gap exceeds ``floor``; the message names the closest calls."""
        assert self.calls, f"{what}: no top-k was recorded (is the reference run inside TopkGaps.active()?)"
        closest = sorted(self.calls, key=lambda c: c[3])[:3]
        assert self.smallest() > floor, (
            f"{what}: a routing decision is a near-tie (gap {self.smallest():.3g} <= {floor:g}): the compared run "
            f"may flip it, so its equality cannot be asserted; change the data (closest calls: shape, dim, k, "
            f"gap = {closest})"
        )


@contextlib.contextmanager
def active() -> Iterator[TopkGaps]:
    """Record every ``torch.topk`` / ``Tensor.topk`` in this process until the block ends."""
    gaps = TopkGaps()
    fn, method = torch.topk, torch.Tensor.topk

    def topk_fn(input, k, dim=-1, largest=True, sorted=True, *, out=None):
        gaps.record(input, k, dim, largest)
        return fn(input, k, dim, largest, sorted, out=out) if out is not None else fn(input, k, dim, largest, sorted)

    def topk_method(self, k, dim=-1, largest=True, sorted=True):
        gaps.record(self, k, dim, largest)
        return method(self, k, dim, largest, sorted)

    torch.topk, torch.Tensor.topk = topk_fn, topk_method
    try:
        yield gaps
    finally:
        torch.topk, torch.Tensor.topk = fn, method


def zipf_no_repeat(n: int, vocab: int = 256, seed: int = 0):
    """``n`` token ids drawn from a Zipf law over ``vocab`` values, an id never following itself (numpy int64):
    learnable (the unigram law), and no two positions of a window with identical hidden states (the leading
    positions of a run of one id have them: causal attention over identical values), whose scores would tie
    exactly at a top-k boundary."""
    import numpy as np

    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, vocab + 1)
    data = rng.choice(vocab, size=n + n // 2 + 64, p=p / p.sum())
    data = data[np.r_[True, data[1:] != data[:-1]]][:n]  # drop each repeat of the id before
    assert len(data) == n and not (data[1:] == data[:-1]).any()
    return data

"""The routing plan: the one type every router produces and every layer consumes.

Shape legend
    B  batch size              S  sequence length          T  tokens, T = B * S (flattened, row-major)
    D  hidden size             E  real experts             X  expert slots, X = E + N no-op experts
    A  assignments that are computed (token, real expert) pairs, grouped by expert
    C  per-sequence capacity (MoD: tokens routed per sequence)

Contract (see docs/routing_plan.md)
    * ``token_idx_A[a]`` is the flat token index (``b * S + s``) of assignment ``a``;
      ``expert_idx_A[a]`` its real expert in ``[0, E)``; ``weight_A[a]`` the gate that multiplies the
      expert's output (differentiable, float32).
    * Assignments are grouped by expert (expert 0 first) and, inside one expert, sorted by token index,
      so ``counts_E`` alone tells where each expert's segment starts.
    * The plan has a static size ``A``: the ``counts_E.sum()`` computed assignments come first, then
      padding (no-op choices, capacity drops, masked tokens) with expert index ``E`` and weight 0; they
      are counted in ``stats``. A token with no computed assignment gets a zero update.
    * ``padded=False`` is a promise made when the router is built (dropless token choice without no-op
      experts or a mask): there is no padding, ``A == counts_E.sum()``. The expert bank then skips its
      padding masks. ``True`` (the default) is always safe.
    * Per-sequence routers (MoD top-k) set ``seq_capacity = C``: then ``A = B * C``, there is one expert,
      and ``token_idx_A.view(B, C)`` lists each sequence's routed tokens in their original order.
      ``valid_A`` is False only where a sequence had fewer than ``C`` real (unpadded) tokens and the
      slot had to be filled with a padded position; such slots must produce no update.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class RoutingStats:
    """Detached routing statistics of one router call (tensors stay on device: no host sync).

    ``kept_E``       computed assignments per real expert (after capacity)
    ``requested_X``  assignments each expert slot was asked for before capacity, no-op slots last
    ``dropped``      assignments removed by capacity limits
    ``noop``         assignments that went to a no-op expert
    ``tokens``       real (unpadded) tokens the router saw
    ``compute_T``    real-expert assignments each token received (0 = the token skipped the layer)
    ``entropy``      mean entropy (nats) of the router's distribution over expert slots, None for MoD
    ``batch_shape``  (B, S) of the routed input, to view ``compute_T`` by position
    ``causal_accuracy``  MoD with a causal method: how often the causal decision (logit > 0) agrees with
                     the top-k decision on real tokens; None otherwise
    """

    kept_E: Tensor
    requested_X: Tensor
    dropped: Tensor
    noop: Tensor
    tokens: Tensor
    compute_T: Tensor
    entropy: Tensor | None
    batch_shape: tuple[int, int]
    causal_accuracy: Tensor | None = None

    @property
    def num_experts(self) -> int:
        return self.kept_E.numel()

    @property
    def num_noop(self) -> int:
        return self.requested_X.numel() - self.kept_E.numel()


@dataclass
class Aux:
    """Auxiliary result of a router or a layer: raw (unweighted) losses, their coefficients, stats.

    Every layer returns ``(output, Aux)``. ``total()`` is the quantity to add to the training loss.
    Merging the aux of many layers prefixes the names, so nothing is ever summed by accident.
    """

    losses: dict[str, Tensor] = field(default_factory=dict)
    coefs: dict[str, float] = field(default_factory=dict)
    stats: dict[str, RoutingStats] = field(default_factory=dict)

    def add_loss(self, name: str, value: Tensor, coef: float) -> None:
        self.losses[name] = value
        self.coefs[name] = coef

    def total(self) -> Tensor:
        """Sum of ``coef * loss``; a zero scalar when there are no losses."""
        terms = [self.coefs[k] * v for k, v in self.losses.items() if self.coefs[k] != 0.0]
        if not terms:
            return torch.zeros((), device="cpu")  # a CPU scalar adds to a loss on any device, without a copy
        return torch.stack([t.float() for t in terms]).sum()

    def merge(self, other: Aux, prefix: str = "") -> Aux:
        """Add ``other``'s entries under ``prefix`` (in place); returns self for chaining."""
        for k, v in other.losses.items():
            self.add_loss(prefix + k, v, other.coefs[k])
        for k, s in other.stats.items():
            self.stats[prefix + k] = s
        return self


@dataclass
class RoutingPlan:
    """Which token goes to which real expert with which weight, plus the router's aux result."""

    token_idx_A: Tensor
    expert_idx_A: Tensor
    weight_A: Tensor
    counts_E: Tensor
    num_tokens: int
    aux: Aux
    seq_capacity: int | None = None
    valid_A: Tensor | None = None
    padded: bool = True  # False: the router knows when it is built that A == counts_E.sum() (no padding)
    logits_TX: Tensor | None = None  # the router's logits over its slots (T, X), where it computes them
    noop_gate_TN: Tensor | None = None  # each token's gate on each no-op slot (T, N), when the layer asks

    @property
    def num_experts(self) -> int:
        return self.counts_E.numel()

    @property
    def num_assignments(self) -> int:
        """Static size ``A`` of the plan (computed assignments and padding)."""
        return self.token_idx_A.numel()

    def compact(self) -> RoutingPlan:
        """The same plan without its padding: only the computed assignments. Reads their number on the
        host, so it is for tests, debugging and reference code, never the hot path."""
        n = int(self.counts_E.sum())
        if self.seq_capacity is not None or n == self.num_assignments:
            return self  # per-sequence (MoD) plans keep their slots; nothing to drop
        return RoutingPlan(
            token_idx_A=self.token_idx_A[:n],
            expert_idx_A=self.expert_idx_A[:n],
            weight_A=self.weight_A[:n],
            counts_E=self.counts_E,
            num_tokens=self.num_tokens,
            aux=self.aux,
            seq_capacity=None,
            valid_A=None,
            padded=False,
        )

    def computed_A(self) -> Tensor:
        """True for the assignments that are computed (the first ``counts_E.sum()``), on the device."""
        return torch.arange(self.num_assignments, device=self.counts_E.device) < self.counts_E.sum()


def group_by_expert(
    token_idx_A: Tensor, expert_idx_A: Tensor, weight_A: Tensor, num_experts: int, num_tokens: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Sort assignments by (expert, token) and count them per expert; the size stays ``A``.

    ``expert_idx_A == num_experts`` marks an assignment that is not computed: it sorts last and its
    weight becomes 0. Among computed assignments each (expert, token) pair occurs at most once, so the
    key ``expert * T + token`` is unique; the stable sort keeps padding deterministic too.
    """
    key_A = expert_idx_A * num_tokens + token_idx_A
    order_A = torch.argsort(key_A, stable=True)
    expert_sorted_A = expert_idx_A[order_A]
    counts_E = count_per(expert_sorted_A, num_experts + 1)[:num_experts]
    weight_sorted_A = torch.where(expert_sorted_A < num_experts, weight_A[order_A], 0.0)
    return token_idx_A[order_A], expert_sorted_A, weight_sorted_A, counts_E


def count_per(index_A: Tensor, size: int, weight_A: Tensor | None = None) -> Tensor:
    """How often each value in ``[0, size)`` occurs in ``index_A`` (int64; ``weight_A`` counts an entry
    ``weight`` times). A bincount whose output shape never depends on the data, so torch.compile can
    trace it without a graph break."""
    ones_A = torch.ones_like(index_A) if weight_A is None else weight_A.to(torch.int64)
    return torch.zeros(size, dtype=torch.int64, device=index_A.device).index_add_(0, index_A, ones_A)


def entropy_of(probs_TX: Tensor, valid_T: Tensor | None) -> Tensor:
    """Mean entropy (nats) of per-token distributions over expert slots."""
    ent_T = -torch.special.xlogy(probs_TX, probs_TX).sum(-1)  # xlogy(0, 0) = 0: 0 * log 0 := 0, in one pass
    if valid_T is None:
        return ent_T.sum() / max(1, ent_T.numel())  # not .mean(): no tokens gives 0, not NaN
    return (ent_T * valid_T).sum() / valid_T.sum().clamp_min(1)


def scalar(value: float, device: torch.device) -> Tensor:
    """A float32 0-dim tensor holding a Python number, filled on the device (no host-to-device copy)."""
    return torch.full((), float(value), device=device)

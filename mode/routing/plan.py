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
      and ``token_idx_A.view(B, C)`` lists each sequence's routed tokens in their original order (their
      positions inside the sequence, ``seq_pos_BC``, come with the plan where the router has them).
      ``valid_A`` is False only where a sequence had fewer than ``C`` real (unpadded) tokens and the
      slot had to be filled with a padded position; such slots must produce no update.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class RoutingStats:
    """Detached routing statistics of one router call (tensors stay on device: no host sync).

    Shape legend: E real experts (1 for MoD: the block), X expert slots (E real, then the no-op ones; MoD:
    the block and skipping it), T = B * S tokens of the routed input.

    Args (the fields):
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
        """``E``: the real experts (``kept_E.numel()``; 1 for MoD)."""
        return self.kept_E.numel()

    @property
    def num_noop(self) -> int:
        """``N = X - E``: the no-op slots (1 for MoD: skipping the block)."""
        return self.requested_X.numel() - self.kept_E.numel()


class Losses:
    """Name -> raw (unweighted) loss, a read-only mapping (a plain class with a dict's reading methods, which
    torch.compile traces) whose values may be computed on first access.

    A router gives its raw losses as functions (``set_lazy``) where its training objective is formed from
    them more cheaply in one pre-weighted scalar (``Aux.add_weighted``): the raw values are then computed only
    when someone reads them (logging, tests), from tensors the router kept, still differentiable."""

    def __init__(self) -> None:
        self._values: dict[str, Tensor] = {}
        self._lazy: dict[str, Callable[[], Tensor]] = {}
        self._names: dict[str, None] = {}  # insertion order

    def set(self, name: str, value: Tensor) -> None:
        self._lazy.pop(name, None)
        self._values[name] = value
        self._names[name] = None

    def set_lazy(self, name: str, compute: Callable[[], Tensor]) -> None:
        self._values.pop(name, None)
        self._lazy[name] = compute
        self._names[name] = None

    def is_lazy(self, name: str) -> bool:
        """Not computed yet."""
        return name in self._lazy

    def __getitem__(self, name: str) -> Tensor:
        if name in self._lazy:
            self._values[name] = self._lazy.pop(name)()
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def keys(self):
        return self._names.keys()

    def items(self) -> list[tuple[str, Tensor]]:
        return [(k, self[k]) for k in self._names]

    def values(self) -> list[Tensor]:
        return [self[k] for k in self._names]

    def get(self, name: str, default=None):
        return self[name] if name in self._names else default

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Losses):
            other = dict(other.items())
        return isinstance(other, dict) and dict(self.items()) == other

    __hash__ = None  # pyright: ignore[reportAssignmentType]  # mutable, compared by value: unhashable (the idiom)

    def __repr__(self) -> str:
        return "Losses(" + ", ".join(f"{k}={'<lazy>' if k in self._lazy else self._values[k]}" for k in self) + ")"


_LOSSES_SET = "Aux.losses: a Losses, set in __post_init__"


@dataclass
class Aux:
    """Auxiliary result of a router or a layer: raw (unweighted) losses, their coefficients, stats.

    Every layer returns ``(output, Aux)``. ``total()`` is the quantity to add to the training loss: the sum
    of ``coef * loss`` (a scalar). Merging the aux of many layers prefixes the names (``merge(other,
    "layers.3.")``), so nothing is ever summed by accident.

    Two ways in: ``add_loss(name, value, coef)`` (``total()`` adds ``coef * value``), or ``add_weighted(total,
    losses)``: a router's own pre-weighted scalar, equal to the sum of ``coef * loss`` over its ``losses``
    (name -> (function, coef)), whose raw values are computed only when ``losses[name]`` is read. A router
    forms its objective in a handful of operators that way (docs/performance.md).

    Args (the fields):
        losses: name -> the raw loss, a scalar tensor (e.g. "moe.balance", "mod.causal_bce"); a ``Losses``
            mapping whose lazy entries are computed on first read (a plain dict is accepted).
        coefs: name -> its weight in ``total()``.
        stats: name -> the ``RoutingStats`` of a router call (e.g. "mod.router").
        weighted: pre-weighted terms ``total()`` adds as they are.
    """

    losses: Losses | None = None  # None: an empty Losses (made in __post_init__, which torch.compile traces)
    coefs: dict[str, float] = field(default_factory=dict)
    stats: dict[str, RoutingStats] = field(default_factory=dict)
    weighted: list[Tensor] = field(default_factory=list)  # pre-weighted terms total() adds as they are
    _covered: set[str] = field(default_factory=set, repr=False)  # names a weighted term already accounts for

    def __post_init__(self) -> None:
        if not isinstance(self.losses, Losses):  # None, or a plain dict of raw losses
            given, self.losses = self.losses or {}, Losses()
            for name, value in given.items():
                self.losses.set(name, value)

    def add_loss(self, name: str, value: Tensor, coef: float) -> None:
        """Add the raw scalar loss ``value`` under ``name``, which ``total()`` weighs by ``coef`` (an entry of the same
        name is replaced)."""
        assert self.losses is not None, _LOSSES_SET
        self.losses.set(name, value)
        self.coefs[name] = coef
        self._covered.discard(name)

    def add_weighted(self, total: Tensor | None, losses: dict[str, tuple[Callable[[], Tensor], float]]) -> None:
        """``total`` (None when every coefficient is 0): the sum of ``coef * fn()`` over ``losses``, formed by
        the caller; the raw losses stay available, computed on first read."""
        assert self.losses is not None, _LOSSES_SET
        if total is not None:
            self.weighted.append(total)
        for name, (fn, coef) in losses.items():
            self.losses.set_lazy(name, fn)
            self.coefs[name] = coef
            self._covered.add(name)

    def total(self) -> Tensor:
        """The sum of ``coef * loss`` (pre-weighted terms as they are); a zero scalar when there are none. One
        term is returned as it is (no operator); several are summed in one ``stack`` and ``sum``."""
        assert self.losses is not None, _LOSSES_SET
        terms = [
            self.coefs[k] * self.losses[k] for k in self.losses if k not in self._covered and self.coefs[k] != 0.0
        ] + self.weighted
        if not terms:
            return torch.zeros((), device="cpu")  # a CPU scalar adds to a loss on any device, without a copy
        dtype = torch.float64 if any(t.dtype == torch.float64 for t in terms) else torch.float32  # float64 stays
        if len(terms) == 1:
            return terms[0].to(dtype)
        return torch.stack([t.to(dtype) for t in terms]).sum()

    def merge(self, other: Aux, prefix: str = "") -> Aux:
        """Add ``other``'s entries under ``prefix`` (in place); returns self for chaining. Lazy losses stay lazy."""
        assert self.losses is not None and other.losses is not None, _LOSSES_SET
        for k in other.losses:
            name = prefix + k
            if other.losses.is_lazy(k):  # the same function: each Aux computes (and keeps) the value on first read
                self.losses.set_lazy(name, other.losses._lazy[k])
            else:
                self.losses.set(name, other.losses[k])
            self.coefs[name] = other.coefs[k]
            if k in other._covered:
                self._covered.add(name)
            else:
                self._covered.discard(name)
        self.weighted.extend(other.weighted)
        for k, s in other.stats.items():
            self.stats[prefix + k] = s
        return self


@dataclass
class RoutingPlan:
    """Which token goes to which real expert with which weight, plus the router's aux result: what every
    router returns and every dispatcher reads (docs/routing_plan.md).

    Shape legend: A assignments (the computed ones first, grouped by expert, then padding: static size),
    E real experts, T tokens (flat ``b * S + s``), X slots, N no-op slots.

    Args (the fields):
        token_idx_A: the token of each assignment.
        expert_idx_A: its expert (padding: any value; only the first ``counts_E.sum()`` are computed).
        weight_A: its gate (differentiable).
        counts_E: the computed assignments of each expert, on the device.
        num_tokens: T.
        aux: the router's losses and stats.
        seq_capacity: MoD: C slots per sequence (the plan is (B, C) in row order); None otherwise.
        valid_A: MoD: which slots hold a real routed token; None: all.
        padded: False when the router knows at construction that ``A == counts_E.sum()``.
        logits_TX: the router's logits, where it computes them (token choice).
        noop_gate_TN: each token's gate on each no-op slot, when the layer asks for them.
        seq_pos_BC: per-sequence plans: each routed token's position in its sequence, where the router has it.
        scores_BS: per-sequence plans (MoD): the router's float32 scores ``r`` of every token, the gates' input.
        inv_TK: token choice (K rows per token, padding included): ``inv_TK[t]`` the rows of token t, the
            inverse of ``token_idx_A`` that ``mode.kernels.gather_rows`` / ``combine_rows`` take; None elsewhere.
    """

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
    seq_pos_BC: Tensor | None = None  # per-sequence plans: token_idx_A.view(B, C) - b * S, where the router has it
    inv_TK: Tensor | None = None  # token choice: the K rows of each token (``inverse_of``), where the router has it
    scores_BS: Tensor | None = None  # per-sequence plans: the router's raw scores, where the router has them

    @property
    def num_experts(self) -> int:
        """``E``: the real experts (``counts_E.numel()``)."""
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
    token_idx_A: Tensor,
    expert_idx_A: Tensor,
    weight_A: Tensor,
    num_experts: int,
    num_tokens: int,
    return_order: bool = False,
) -> tuple[Tensor, ...]:
    """Sort assignments by (expert, token) and count them per expert; the size stays ``A``.

    ``expert_idx_A == num_experts`` marks an assignment that is not computed: it sorts last and its
    weight becomes 0. Among computed assignments each (expert, token) pair occurs at most once, so the
    key ``expert * T + token`` is unique; the stable sort keeps padding deterministic too. Returns
    ``(token_A, expert_A, weight_A, counts_E)``, and the sort's permutation ``order_A`` last with
    ``return_order`` (``inverse_of`` makes the plan's inverse index from it).
    """
    key_A = expert_idx_A * num_tokens + token_idx_A
    order_A = torch.argsort(key_A, stable=True)
    expert_sorted_A = expert_idx_A[order_A]
    counts_E = count_per(expert_sorted_A, num_experts + 1)[:num_experts]
    weight_sorted_A = torch.where(expert_sorted_A < num_experts, weight_A[order_A], 0.0)
    if return_order:
        return token_idx_A[order_A], expert_sorted_A, weight_sorted_A, counts_E, order_A
    return token_idx_A[order_A], expert_sorted_A, weight_sorted_A, counts_E


class _Permute(torch.autograd.Function):
    """``values_A[order_A]`` for a permutation ``order_A``, whose backward indexes by the inverse permutation
    (one gather) instead of scattering into zeros (two operators). The same values and gradients, bit for bit:
    a permutation's scatter adds nothing to anything."""

    @staticmethod
    def forward(ctx, values_A: Tensor, order_A: Tensor, inv_A: Tensor) -> Tensor:
        ctx.save_for_backward(inv_A)
        return values_A[order_A]

    @staticmethod
    def backward(ctx, grad_A: Tensor):
        (inv_A,) = ctx.saved_tensors
        return grad_A[inv_A], None, None


def permute(values_A: Tensor, order_A: Tensor, inv_A: Tensor) -> Tensor:
    """``values_A[order_A]``, ``order_A`` a permutation and ``inv_A`` its inverse (``inv_A[order_A[a]] = a``)."""
    return _Permute.apply(values_A, order_A, inv_A)


def inverse_of(order_A: Tensor, num_tokens: int, k: int, choice_major: bool) -> Tensor:
    """``inv_TK``: the plan rows of each token's K choices, from the sort that made the plan: ``order_A[a]`` is
    the choice in plan row ``a``, numbered token-major (``t * K + j``) or choice-major (``j * T + t``). One
    scatter of the permutation (no second sort): ``inv[order_A[a]] = a``. A token's rows come in its choice
    order ``j``, not in increasing row order (``mode.kernels.inverse_index``'s): the fused combine sums them in
    that fixed order, deterministic on every run (for K = 2 the order does not change the sum)."""
    A = order_A.shape[0]
    inv_A = torch.empty_like(order_A).scatter_(0, order_A, torch.arange(A, device=order_A.device))
    return inv_A.view(k, num_tokens).t() if choice_major else inv_A.view(num_tokens, k)


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

"""Mixture-of-Depths router: the top ``C`` tokens of each sequence go through the block.

Shape legend
    B batch   S sequence   D hidden   C = max(1, floor(capacity * S)) routed tokens per sequence (0 when S = 0)
    T = B * S tokens   A = B * C assignments (one expert: the block)

The router weight is the raw linear score ``r = w . x`` (Raposo et al. 2024); the block's delta is
multiplied by it, which is what puts the router on the gradient path. Other gates (``gate=``): "sigmoid"
multiplies by ``sigmoid(r)``; "one" by 1 (no router gradient, for ablations); "ste" by the straight-through
``1 + (r - sg(r))``: the value is exactly 1, so the block's output is unchanged (a pretrained block keeps its
function when it is converted), while the gradient reaches the router's weight as if the gate were ``r``. With
"ste" the router scores a stop-gradient copy of x: nothing depends on r in the forward, so a gradient through
r into x would be the surrogate's alone, and would train the layers below toward the router's scores (healing
a converted model's adapters against it, they did not heal; see ``mode.hf.dense.heal``).

Selection is a per-sequence top-C, so exactly C tokens are routed even when scores tie; routed tokens are
kept in their original order. Padded positions (``mask == False``) score -inf and are only picked when a
sequence has fewer than C real tokens, in which case the slot is marked invalid and makes no update.

``capacity`` is read as the decimal the user wrote (``0.29 * 100`` routes 29 tokens, see
``mode.routing.capacity``). Router math runs in float32, also under autocast. Top-C routing never makes
the host wait for the device: C is known from the shapes, every count stays on the device.

Causal routing (paper sec. 3.5). Top-C looks at future tokens, so sampling needs a per-token decision:
    "predictor": a small MLP on a stop-gradient copy of the router input predicts "in the top-C" (BCE)
    "aux_bce":   a BCE loss on the router logits themselves teaches r > 0 <=> in the top-C
    "threshold": route when r > t, a buffer steered to the target share (MoDification, arXiv 2410.14268):
                 every training forward moves t toward the ``1 - capacity`` quantile of the batch's scores
                 (an EMA, ``threshold_momentum``; the first batch sets it). Nothing is learned for it, so it
                 suits converted models whose router alone is tuned; a causal call before any training
                 forward is refused (the threshold is NaN until then)
``steer_decision=True`` (what ``mode.hf.to_mod`` uses) gives "predictor" and "aux_bce" the same steered
threshold: a token is routed when its decision logit passes ``threshold``, which training forwards move to
the ``1 - capacity`` quantile of the decision logits. An untrained decision then routes the target share
from the first calibrated call on, instead of whatever share ``logit > 0`` happens to give (about half the
tokens for a fresh router); as the BCE loss teaches ``logit > 0 <=> top-C``, the threshold goes to 0.
With ``causal=True`` a token is routed when its decision logit is > 0 (sigmoid > 0.5), and every token at
``capacity=1.0`` (where top-C routes them all, whatever the decision has learned: a layer converted at
capacity 1.0 stays the identity in eval mode too); each sequence
routes its own number of tokens, packed into C = max count slots per row (``valid_A`` marks real ones);
reading that C is the one host sync of a causal call.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mode import _checks
from mode.routing.capacity import floor_of
from mode.routing.plan import Aux, RoutingPlan, RoutingStats, scalar

GATES = ("raw", "sigmoid", "one", "ste")
SELECTIONS = ("learned", "random")
CAUSAL_METHODS = ("none", "predictor", "aux_bce", "threshold")


@dataclass
class MoDRouterConfig:
    """The settings of a ``MoDRouter`` (checked when built: a bad value raises ``ValueError`` naming it).

    Args:
        d_model: the hidden size D of the tokens it scores.
        capacity: the fraction of each sequence routed through the block, in (0, 1]; ``C = max(1,
            floor(capacity * S))`` tokens per sequence (the paper: 0.125).
        gate: what multiplies the block's delta: "raw" the router logit r (the paper), "sigmoid" sigmoid(r),
            "one" 1 (no router gradient: ablations), "ste" the value 1 with the gradient of r.
        selection: "learned" (the top-C scores) or "random" (a uniformly random C: the paper's control).
        causal: how sampling decides token by token: "none" (top-C only: cannot sample), "predictor",
            "aux_bce" or "threshold" (the module doc).
        causal_coef: the weight of the causal BCE loss ("predictor", "aux_bce") in ``Aux.total()``.
        threshold_momentum: "threshold" and ``steer_decision``: the weight of each training batch's quantile in
            the threshold's moving average, in (0, 1].
        steer_decision: "predictor" / "aux_bce": route when the decision logit passes a steered threshold
            instead of 0 (what ``mode.hf.to_mod`` uses).
        predictor_hidden: the hidden size of the "predictor" MLP.
        check_finite: raise ``ValueError`` on NaN or inf router logits.
    """

    d_model: int
    capacity: float = 0.125  # fraction of each sequence routed through the block
    # "raw": r (paper); "sigmoid": sigmoid(r); "one": 1 (no router gradient; ablations);
    # "ste": value 1, gradient of r (straight-through; keeps a converted pretrained block's output)
    gate: str = "raw"
    selection: str = "learned"  # "random": uniformly random top-C (the paper's stochastic-routing control)
    causal: str = "none"  # how sampling decides causally: "predictor", "aux_bce" or "threshold" (module doc)
    causal_coef: float = 0.1  # weight of the causal BCE loss
    threshold_momentum: float = 0.05  # "threshold": the weight of each training batch's quantile in the EMA
    steer_decision: bool = False  # "predictor" / "aux_bce": route when the logit passes a steered threshold
    predictor_hidden: int = 64
    check_finite: bool = True

    def __post_init__(self) -> None:
        _checks.check_int("d_model", self.d_model)
        _checks.check_fraction("capacity", self.capacity)
        _checks.check_choice("gate", self.gate, GATES)
        _checks.check_choice("selection", self.selection, SELECTIONS)
        _checks.check_choice("causal", self.causal, CAUSAL_METHODS)
        _checks.check_non_negative("causal_coef", self.causal_coef)
        if _checks.check_fraction("threshold_momentum", self.threshold_momentum) == 0.0:
            raise ValueError(f"threshold_momentum={self.threshold_momentum}: must be in (0, 1] (0 never moves it)")
        _checks.check_bool("steer_decision", self.steer_decision)
        if self.steer_decision and self.causal not in ("predictor", "aux_bce"):
            raise ValueError(
                f"steer_decision=True with causal={self.causal!r}: only 'predictor' and 'aux_bce' have a "
                "learned decision to steer ('threshold' always steers; 'none' has no decision)"
            )
        _checks.check_int("predictor_hidden", self.predictor_hidden)
        _checks.check_bool("check_finite", self.check_finite)

    # -- what the FLOP and per-token compute code asks (the router protocol, see mode.routing.registry) --
    num_experts = 1  # the block
    num_slots = 2  # the block, and skipping it (the no-op)
    max_assignments_per_token = 1

    def seq_capacity(self, seq_len: int) -> int:
        """``C = max(1, floor(capacity * S))`` routed tokens per sequence (0 for an empty sequence)."""
        return 0 if seq_len == 0 else max(1, floor_of(self.capacity, seq_len))

    def assignments(self, seq_len: int) -> float:
        """Computed assignments for one sequence of ``seq_len`` tokens: ``C``, the routed tokens."""
        return float(self.seq_capacity(seq_len))

    def router_flops(self, seq_len: int) -> float:
        """The score ``x . w`` per token, plus the predictor MLP when there is one."""
        predictor = 2 * (self.d_model + 1) * self.predictor_hidden if self.causal == "predictor" else 0
        return seq_len * (2 * self.d_model + predictor)

    def causal_problem(self) -> str | None:
        """Why this router cannot route token by token (sampling), or None: it needs a causal method."""
        if self.causal != "none":
            return None
        return (
            "causal='none': this model's MoD layers use non-causal top-k routing and cannot sample; "
            "train it with causal='predictor' or 'aux_bce'"
        )


class MoDRouter(nn.Module):
    """The Mixture-of-Depths router: scores each token with one vector, ``r = w . x``, and picks the top ``C``
    tokens of each sequence (or, with ``causal=True``, each token by its causal decision).

    Shape legend: B batch, S sequence, D hidden, C routed tokens per sequence, A = B * C assignments.

    Parameters: ``weight`` (D,), initialised N(0, 1/D); ``predictor`` (a D -> ``predictor_hidden`` -> 1 MLP)
    with ``causal="predictor"``; the buffer ``threshold`` where the decision is steered.

    Args:
        cfg: a ``MoDRouterConfig`` (capacity, gate, selection, causal method).
    """

    threshold: Tensor  # the buffer of a steered decision (registered only then)

    def __init__(self, cfg: MoDRouterConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.d_model))  # the config validated d_model
        nn.init.normal_(self.weight, std=cfg.d_model**-0.5)
        self.predictor = None
        if cfg.causal == "predictor":
            self.predictor = nn.Sequential(
                nn.Linear(cfg.d_model, cfg.predictor_hidden), nn.SiLU(), nn.Linear(cfg.predictor_hidden, 1)
            )
        if self.steers:  # NaN until the first training forward: saved and resumed with the model
            self.register_buffer("threshold", torch.tensor(float("nan")))

    @property
    def steers(self) -> bool:
        """Does the causal decision compare against the steered ``threshold`` buffer?"""
        return self.cfg.causal == "threshold" or self.cfg.steer_decision

    def seq_capacity(self, seq_len: int) -> int:
        """``C``: the tokens routed per sequence of ``seq_len`` tokens (``cfg.seq_capacity``)."""
        return self.cfg.seq_capacity(seq_len)

    def scores(self, x_BSD: Tensor) -> Tensor:
        """Raw router logits ``r_BS = x . w`` in float32 (autocast off: see ``_checks.float32_region``)."""
        with _checks.float32_region(x_BSD.device):
            x_BSD = _checks.at_least_float32(x_BSD)  # float64 stays float64
            return x_BSD @ self.weight.to(x_BSD.dtype)

    def raw_decision_logits(self, x_BSD: Tensor, r_BS: Tensor) -> Tensor:
        """The learned (or, for "threshold", the plain) decision logits before any threshold: the predictor's
        output, else the router's scores. The predictor never sends gradient into x."""
        if self.predictor is not None:
            with _checks.float32_region(x_BSD.device):
                x_in = x_BSD.detach().to(cast(nn.Linear, self.predictor[0]).weight.dtype)
                return _checks.at_least_float32(self.predictor(x_in).squeeze(-1))
        return r_BS

    @property
    def plain_decision(self) -> bool:
        """Is the causal decision the raw logit itself (no capacity-1.0 rule, no steered threshold)? Decoding
        may then compute it in its own fused kernels."""
        return self.cfg.capacity < 1.0 and not self.steers

    def decision_logits(self, x_BSD: Tensor, r_BS: Tensor, *, check_threshold: bool = True) -> Tensor:
        """Causal per-token logits: > 0 means "route". At capacity 1.0, +inf for every token: top-C routes them
        all, so the causal decision does too, trained or not. ``check_threshold=False``: the caller checks
        (``check_calibrated``) when a logit comes out NaN, in a host read it makes anyway."""
        if self.cfg.capacity == 1.0:
            return torch.full_like(r_BS, float("inf"))
        logit_BS = self.raw_decision_logits(x_BSD, r_BS)
        if not self.steers:
            return logit_BS
        if check_threshold:
            self.check_calibrated()  # one host read, on the causal path only
        return logit_BS - self.threshold

    def check_calibrated(self) -> None:
        """A steered threshold (``steers``) must have been set by a train-mode forward before causal routing."""
        if self.steers and bool(torch.isnan(self.threshold)):
            raise ValueError(
                f"causal={self.cfg.causal!r}: the routing threshold is not calibrated yet; run forwards "
                "in train mode first (training, mode.hf.router_tune, or mode.hf.calibrate(model, "
                "batches)): each moves it to the capacity's quantile of the decision logits"
            )

    def forward(
        self, x_BSD: Tensor, mask_BS: Tensor | None = None, causal: bool = False, *, defer_check: bool = False
    ) -> RoutingPlan:
        """Choose the tokens that go through the block.

        Args:
            x_BSD: the hidden states (any float dtype; the scores are computed in float32).
            mask_BS: None, or False at padding (scored -inf: picked only when a row has fewer than C real
                tokens, and then marked invalid in ``valid_A``).
            causal: route by the causal decision (logit > 0) instead of the top-C; needs a causal method.
            defer_check: a top-C call leaves the finite check of the scores (``check_finite``) to the caller,
                which makes it on ``plan.scores_BS`` (the MoD layer: inside its fused write back,
                ``mode.kernels.combine_routed``); causal calls check here whatever it says.

        Returns:
            a ``RoutingPlan`` with one expert (the block): ``token_idx_A`` the routed tokens (flat ``b * S +
            s``, C per row in position order), ``weight_A`` their gates, ``seq_capacity`` C, ``valid_A`` None or
            the real slots, and ``aux`` with the stats under "router" and, in a top-C call of a router with
            ``causal="predictor"`` or "aux_bce", the "causal_bce" loss.
        """
        _checks.check_hidden("x", x_BSD, self.cfg.d_model, device=self.weight.device)
        _checks.check_mask("mask", mask_BS, x_BSD.shape[:2], device=self.weight.device)
        if causal and self.cfg.causal == "none":
            raise ValueError(
                "causal=True: this MoD router was built with causal='none'; build it with "
                "causal='predictor' or 'aux_bce' to route causally"
            )
        # "ste": the router reads a stop-gradient copy of x. Its gate's value is exactly 1, so the block's output
        # does not depend on r, and the surrogate gradient of r (and a causal BCE on r) must reach the router's
        # weight only: let through to x, it would train the layers below toward the router's scores.
        r_BS = self.scores(x_BSD.detach() if self.cfg.gate == "ste" else x_BSD)
        if self.cfg.check_finite and (causal or not defer_check):
            _checks.check_finite_via("MoDRouter", r_BS)  # on the sum of the scores: 4 operators on the device
        if causal:
            routed_BS = self.decision_logits(x_BSD, r_BS) > 0
            if mask_BS is not None:
                routed_BS &= mask_BS
            if routed_BS.numel() == 0:
                return self._empty_plan(r_BS, mask_BS)
            C = int(routed_BS.sum(1).max())  # host sync: the packed width depends on the decisions
            if C == 0:  # most decode steps: skip packing and gathering, which cost more than the skip saves
                return self._empty_plan(r_BS, mask_BS)
            pos_BC = pack_routed(routed_BS, C)
            return self.plan_from_positions(r_BS, pos_BC, routed_BS.gather(1, pos_BC), mask_BS)

        C = self.seq_capacity(x_BSD.shape[1])
        # Random selection draws from the global torch RNG, so seeded runs stay reproducible.
        select_BS = r_BS.detach() if self.cfg.selection == "learned" else torch.rand_like(r_BS)
        if mask_BS is not None:
            select_BS = select_BS.masked_fill(~mask_BS, float("-inf"))
        pos_BC = select_BS.topk(C, dim=1, sorted=False).indices.sort(dim=1).values  # original order
        valid_BC = None if mask_BS is None else mask_BS.gather(1, pos_BC)
        plan = self.plan_from_positions(r_BS, pos_BC, valid_BC, mask_BS)
        if self.cfg.causal != "none":
            logit_BS = self.raw_decision_logits(x_BSD, r_BS)
            if self.cfg.causal != "threshold":
                self._add_causal_loss(plan, logit_BS, pos_BC, mask_BS)
            if self.steers and self.training:
                self._steer_threshold(logit_BS, mask_BS)
        return plan

    @torch.no_grad()
    def _steer_threshold(self, logit_BS: Tensor, mask_BS: Tensor | None) -> None:
        """Move the threshold toward this batch's ``1 - capacity`` quantile of the real tokens' decision
        logits (the first batch sets it), so that ``logit > threshold`` routes the capacity's share of tokens."""
        logit_N = logit_BS.detach().reshape(-1) if mask_BS is None else logit_BS.detach()[mask_BS]
        if logit_N.numel() == 0:
            return
        logit_N = _checks.at_least_float32(logit_N)
        q = torch.quantile(logit_N, 1.0 - self.cfg.capacity)
        # A quantile that lands on a logit (a lump of equal ones: a layer-0 score is a function of the token id,
        # so every occurrence of one id ties) would leave those tokens' decisions at exactly 0, which the
        # rounding of another kernel flips (decoding one token vs a full pass on a GPU). The midpoint up to the
        # next larger logit routes the same tokens of this batch (still "> threshold"), with a margin. No sync.
        above = torch.where(logit_N > q, logit_N, torch.full_like(logit_N, float("inf"))).min()
        tied = (logit_N == q).any() & torch.isfinite(above)
        q = torch.where(tied, (q + above) / 2, q)
        m = self.cfg.threshold_momentum
        self.threshold.copy_(torch.where(torch.isnan(self.threshold), q, (1 - m) * self.threshold + m * q))

    def _add_causal_loss(self, plan: RoutingPlan, logit_BS: Tensor, pos_BC: Tensor, mask_BS: Tensor | None) -> None:
        """BCE teaching the causal decision logit to predict top-C membership (the training target)."""
        target_BS = torch.zeros_like(logit_BS).scatter_(1, pos_BC, 1.0)  # 1 where top-C
        weight_BS = None if mask_BS is None else mask_BS.float()
        loss = F.binary_cross_entropy_with_logits(logit_BS, target_BS, weight=weight_BS, reduction="sum")
        n_real = plan.aux.stats["router"].tokens
        plan.aux.add_loss("causal_bce", loss / n_real.clamp_min(1), self.cfg.causal_coef)
        agree_BS = ((logit_BS.detach() > 0) == (target_BS > 0)).float()
        if weight_BS is not None:
            agree_BS = agree_BS * weight_BS
        plan.aux.stats["router"].causal_accuracy = agree_BS.sum() / n_real.clamp_min(1)

    def plan_from_positions(
        self, r_BS: Tensor, pos_BC: Tensor, valid_BC: Tensor | None, mask_BS: Tensor | None
    ) -> RoutingPlan:
        """The plan for routed slots ``pos_BC`` (real slots first in each row, in position order)."""
        B, S = r_BS.shape
        C = pos_BC.shape[1]
        dev = r_BS.device
        # b * S: each sequence's first token (one operator; S = 0 has no tokens to step over)
        start_B = torch.arange(0, B * S, S, device=dev) if S else torch.zeros(B, dtype=torch.long, device=dev)
        token_A = (pos_BC + start_B[:, None]).reshape(-1)
        # one expert: every expert index is 0, a broadcast view of start_B[0] (= 0; no operator of its own)
        expert_A = start_B[:1].expand(B * C) if B else torch.zeros_like(token_A)
        r_A = r_BS.gather(1, pos_BC).reshape(-1)
        gate = self.cfg.gate
        if gate == "raw":
            weight_A = r_A
        elif gate == "sigmoid":
            weight_A = r_A.sigmoid()
        elif gate == "ste":
            weight_A = (r_A - r_A.detach()) + 1.0  # x - x is exactly 0, so the value is exactly 1
        else:
            weight_A = torch.ones_like(r_A)
        valid_A = None if valid_BC is None else valid_BC.reshape(-1)

        T = B * S
        aux = Aux()
        aux.stats["router"] = MoDStats(token_A, valid_A, mask_BS, (B, S))
        return RoutingPlan(
            token_idx_A=token_A,
            expert_idx_A=expert_A,
            weight_A=weight_A,
            counts_E=torch.full((1,), B * C, dtype=torch.long, device=dev),
            num_tokens=T,
            aux=aux,
            seq_capacity=C,
            valid_A=valid_A,
            seq_pos_BC=pos_BC,
            scores_BS=r_BS,
        )

    def _empty_plan(self, r_BS: Tensor, mask_BS: Tensor | None) -> RoutingPlan:
        """What ``plan_from_positions`` returns when no token is routed (C = 0), in a handful of ops: decoding
        calls a routed layer once per token and most calls route nothing."""
        B, S = r_BS.shape
        dev = r_BS.device
        tokens = scalar(B * S, dev) if mask_BS is None else mask_BS.sum().float()
        aux = Aux()
        aux.stats["router"] = RoutingStats(
            kept_E=torch.zeros(1, device=dev),
            requested_X=torch.stack([torch.zeros((), device=dev), tokens]),
            dropped=torch.zeros((), device=dev),
            noop=tokens.clone(),
            tokens=tokens,
            compute_T=torch.zeros(B * S, device=dev),
            entropy=None,
            batch_shape=(B, S),
        )
        no_A = torch.zeros(0, dtype=torch.long, device=dev)
        return RoutingPlan(
            token_idx_A=no_A,
            expert_idx_A=no_A.clone(),
            weight_A=r_BS.new_zeros(0),
            counts_E=torch.zeros(1, dtype=torch.long, device=dev),
            num_tokens=B * S,
            aux=aux,
            seq_capacity=0,
            valid_A=torch.zeros(0, dtype=torch.bool, device=dev),
        )


class MoDStats(RoutingStats):
    """``RoutingStats`` of one MoD router call, each field computed on first read (on the device, no host sync)
    from the plan's slots: a training step that does not read them launches none of their operators. The values
    are those the fields always had; ``causal_accuracy`` is set by the router where it has one."""

    def __init__(self, token_A: Tensor, valid_A: Tensor | None, mask_BS: Tensor | None, batch_shape: tuple[int, int]):
        self._token_A, self._valid_A, self._mask_BS = token_A, valid_A, mask_BS
        self.batch_shape = batch_shape
        self.entropy = None
        self.causal_accuracy = None

    @functools.cached_property
    def tokens(self) -> Tensor:
        B, S = self.batch_shape
        return scalar(B * S, self._token_A.device) if self._mask_BS is None else self._mask_BS.sum().float()

    @functools.cached_property
    def _routed(self) -> Tensor:
        n = self._token_A.numel()
        return scalar(n, self._token_A.device) if self._valid_A is None else self._valid_A.sum().float()

    @functools.cached_property
    def kept_E(self) -> Tensor:
        return self._routed.reshape(1)

    @functools.cached_property
    def noop(self) -> Tensor:
        return self.tokens - self._routed

    @functools.cached_property
    def requested_X(self) -> Tensor:
        return torch.stack([self._routed, self.tokens - self._routed])  # [block, skip]: skipping is the no-op

    @functools.cached_property
    def dropped(self) -> Tensor:
        return torch.zeros((), device=self._token_A.device)

    @functools.cached_property
    def compute_T(self) -> Tensor:
        B, S = self.batch_shape
        routed_A = (
            torch.ones(self._token_A.shape, device=self._token_A.device)
            if self._valid_A is None
            else self._valid_A.float()
        )
        return torch.zeros(B * S, device=self._token_A.device).index_put_((self._token_A,), routed_A)  # distinct


def pack_routed(routed_BS: Tensor, C: int | None = None) -> Tensor:
    """Positions ``pos_BC`` with C = the largest routed count (pass it if known): each row lists its routed
    positions in increasing order, then fills up with unrouted positions (distinct, so scatters never collide)."""
    B, S = routed_BS.shape
    if C is None:
        C = int(routed_BS.sum(1).max())  # host sync: the packed width depends on the decisions
    descending_pos_S = torch.arange(S - 1, -1, -1, device=routed_BS.device, dtype=torch.float32)
    key_BS = routed_BS.float() * S + descending_pos_S  # routed first; earlier positions first in each group
    return key_BS.topk(C, dim=1).indices

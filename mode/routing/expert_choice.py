"""Expert-choice router (Zhou et al. 2022): each expert picks its top-c tokens of each sequence.

Shape legend
    B batch   S sequence   T = B * S tokens   D hidden   E real experts   N no-op experts
    X = E + N slots   c tokens each slot picks per sequence   A = B * E * c computed assignments

Affinities are the per-token softmax over the X slots; every slot (no-op slots too) picks the ``c``
highest-affinity tokens of each sequence, ``c = ceil(capacity_factor * S / X)`` (the factor read as the
decimal written), and a real expert's gate is the affinity. The plan has the static size ``B * c * E``;
picks of padded positions stay in it as padding after the computed ones (no host sync). Picks by a no-op slot are never
computed; no-op slots still take probability mass
from the real experts. Routing within a sequence keeps sequences independent (no leakage across the
batch), like MoD, which is expert choice with one expert.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mode import _checks
from mode.routing.capacity import ceil_of
from mode.routing.losses import router_z_loss
from mode.routing.plan import Aux, RoutingPlan, RoutingStats, count_per, entropy_of, group_by_expert, scalar


@dataclass
class ExpertChoiceConfig:
    """The settings of an ``ExpertChoiceRouter`` (checked when built: a bad value raises ``ValueError``).

    Args:
        d_model: the hidden size D of the tokens it scores.
        num_experts: the real experts E.
        capacity_factor: the average number of slot picks per token: each of the ``X = E + num_noop`` slots
            picks ``c = ceil(capacity_factor * S / X)`` tokens of each sequence; None: 1.0.
        num_noop: the no-op slots: their picks are never computed, but they take probability mass.
        z_coef: the weight of the router z-loss "z_loss" in ``Aux.total()``.
        check_finite: raise on NaN or inf logits.
    """

    d_model: int
    num_experts: int
    capacity_factor: float | None = 1.0  # average number of slot picks per token; None: 1.0
    num_noop: int = 0
    z_coef: float = 0.0
    check_finite: bool = True

    def __post_init__(self) -> None:
        _checks.check_int("d_model", self.d_model)
        _checks.check_int("num_experts", self.num_experts)
        _checks.check_int("num_noop", self.num_noop, min_value=0)
        if self.capacity_factor is None:
            self.capacity_factor = 1.0
        _checks.check_positive("capacity_factor", self.capacity_factor)
        _checks.check_non_negative("z_coef", self.z_coef)
        _checks.check_bool("check_finite", self.check_finite)

    # -- what the FLOP and per-token compute code asks (the router protocol, see mode.routing.registry) --
    @property
    def num_slots(self) -> int:
        """``X = num_experts + num_noop``: the expert slots, the no-op ones included."""
        return self.num_experts + self.num_noop

    @property
    def max_assignments_per_token(self) -> int:
        """``E``: a token can be picked by every real expert."""
        return self.num_experts

    def causal_problem(self) -> str | None:
        """Why token-by-token decoding would not match the full forward: an expert picks among the whole
        sequence, future tokens included."""
        return (
            "router='expert_choice': expert-choice routing picks tokens across the sequence and is not "
            "causal; generate() needs token-choice MoE layers"
        )

    def tokens_per_slot(self, seq_len: int) -> int:
        """``c = ceil(capacity_factor * S / X)`` tokens each slot picks per sequence."""
        c = ceil_of(cast(float, self.capacity_factor), seq_len, self.num_slots)  # __post_init__: None -> 1.0
        if c > seq_len:
            raise ValueError(
                f"capacity_factor={self.capacity_factor}: each of the {self.num_slots} expert slots would "
                f"pick {c} tokens but a sequence has only {seq_len}; must be <= num_slots = {self.num_slots}"
            )
        return c

    def assignments(self, seq_len: int) -> float:
        """Computed assignments for one sequence of ``seq_len`` tokens: ``E * c`` (each real expert picks ``c`` tokens;
        the no-op slots' picks are not computed)."""
        return float(self.num_experts * self.tokens_per_slot(seq_len))

    def router_flops(self, seq_len: int) -> float:
        """Forward FLOPs of routing one sequence of ``seq_len`` tokens: the (S, D) x (D, X) logits, ``2 S D X``."""
        return 2 * seq_len * self.d_model * self.num_slots


class ExpertChoiceRouter(nn.Module):
    """The expert-choice router (Zhou et al. 2022): each expert slot picks the ``c`` tokens of each sequence
    with the highest affinity (the softmax over the slots of a token's logits); a real expert's gate is the
    affinity. Not causal: an expert picks among the whole sequence.

    Shape legend: B batch, S sequence, T = B * S tokens, D hidden, E real experts, X = E + no-op slots,
    c picks per slot and sequence, A = B * E * c assignments.

    Parameters: ``weight`` (X, D), initialised N(0, 1/D).

    Args:
        cfg: an ``ExpertChoiceConfig``.
    """

    def __init__(self, cfg: ExpertChoiceConfig):
        super().__init__()
        self.cfg = cfg
        self.num_experts = cfg.num_experts
        self.num_slots = cfg.num_experts + cfg.num_noop
        _checks.check_numel("(num_experts + num_noop, d_model)", self.num_slots, cfg.d_model)
        self.weight = nn.Parameter(torch.empty(self.num_slots, cfg.d_model))
        nn.init.normal_(self.weight, std=cfg.d_model**-0.5)

    def tokens_per_slot(self, seq_len: int) -> int:
        """``c``: the tokens each expert slot picks per sequence of ``seq_len`` tokens (``cfg.tokens_per_slot``)."""
        return self.cfg.tokens_per_slot(seq_len)

    def forward(self, x_BSD: Tensor, mask_BS: Tensor | None = None) -> RoutingPlan:
        """Let every expert slot pick its tokens.

        Args:
            x_BSD: the hidden states (the logits are computed in float32).
            mask_BS: None, or False at padding (never computed: a pick of a padded token becomes padding).

        Returns:
            a ``RoutingPlan`` of static size ``A = B * E * c``, grouped by expert, with ``aux`` holding the
            "z_loss" loss and the stats under "router".
        """
        _checks.check_hidden("x", x_BSD, self.cfg.d_model, device=self.weight.device)
        _checks.check_mask("mask", mask_BS, x_BSD.shape[:2], device=self.weight.device)
        B, S, _ = x_BSD.shape
        T, E, X = B * S, self.num_experts, self.num_slots
        c = self.tokens_per_slot(S)
        dev = x_BSD.device

        with _checks.float32_region(dev):  # routing math in float32, also under autocast
            x_BSD = _checks.at_least_float32(x_BSD)  # float64 stays float64
            logits_BSX = F.linear(x_BSD, self.weight.to(x_BSD.dtype))
            probs_BSX = logits_BSX.softmax(-1)
            scores_BSX = probs_BSX if mask_BS is None else probs_BSX.masked_fill(~mask_BS[..., None], -1.0)
            gate_BcX, pos_BcX = scores_BSX.topk(c, dim=1)  # each slot's c best positions per sequence
            valid_T = None if mask_BS is None else mask_BS.reshape(T)
            aux = Aux()
            z_loss = router_z_loss(logits_BSX.reshape(T, X), valid_T)
            aux.add_loss("z_loss", z_loss, self.cfg.z_coef)
            if self.cfg.check_finite:  # on the z-loss, a reduction over every logit (NaN * 0 is NaN: masks keep it)
                _checks.check_finite_via("ExpertChoiceRouter", logits_BSX, z_loss)

        # The real experts' picks are the first E columns (static shape); a pick of a padded position
        # (score -1) is not computed and becomes padding of the plan.
        token_BcE = pos_BcX[..., :E] + (torch.arange(B, device=dev) * S)[:, None, None]
        slot_BcE = torch.arange(E, device=dev).expand(B, c, E)
        gate_BcE = gate_BcX[..., :E]
        if mask_BS is None:
            expert_key_BcE = slot_BcE
        else:
            expert_key_BcE = torch.where(gate_BcE >= 0, slot_BcE, E)
        token_A, expert_A, gate_A, counts_E = group_by_expert(
            token_BcE.reshape(-1), expert_key_BcE.reshape(-1), gate_BcE.reshape(-1), E, T
        )

        aux.stats["router"] = ExpertChoiceStats(counts_E, gate_BcX, token_A, expert_A, probs_BSX, valid_T, (B, S))
        return RoutingPlan(
            token_idx_A=token_A, expert_idx_A=expert_A, weight_A=gate_A, counts_E=counts_E, num_tokens=T, aux=aux
        )


class ExpertChoiceStats(RoutingStats):
    """``RoutingStats`` of one expert-choice call, each field computed on first read (on the device, no host
    sync) from tensors the router kept: a training step that does not read them launches none of their
    operators. The values are those the fields always had."""

    def __init__(
        self,
        counts_E: Tensor,
        gate_BcX: Tensor,
        token_A: Tensor,
        expert_A: Tensor,
        probs_BSX: Tensor,
        valid_T: Tensor | None,
        batch_shape: tuple[int, int],
    ):
        self._counts_E, self._gate_BcX = counts_E.detach(), gate_BcX.detach()
        self._token_A, self._expert_A, self._probs_BSX, self._valid_T = token_A, expert_A, probs_BSX.detach(), valid_T
        self.batch_shape = batch_shape

    @functools.cached_property
    def dropped(self) -> Tensor:
        return torch.zeros((), device=self._counts_E.device)  # expert choice drops nothing

    @functools.cached_property
    def kept_E(self) -> Tensor:
        return self._counts_E.float()

    @functools.cached_property
    def requested_X(self) -> Tensor:
        return (self._gate_BcX >= 0).sum((0, 1)).float()  # a pick is False only for a padded position

    @functools.cached_property
    def noop(self) -> Tensor:
        return self.requested_X[self._counts_E.numel() :].sum()

    @functools.cached_property
    def tokens(self) -> Tensor:
        B, S = self.batch_shape
        return scalar(B * S, self._counts_E.device) if self._valid_T is None else self._valid_T.sum().float()

    @functools.cached_property
    def compute_T(self) -> Tensor:
        B, S = self.batch_shape
        return count_per(self._token_A, B * S, self._expert_A < self._counts_E.numel()).float()

    @functools.cached_property
    def entropy(self) -> Tensor:
        B, S = self.batch_shape
        return entropy_of(self._probs_BSX.reshape(B * S, self._probs_BSX.shape[-1]), self._valid_T)

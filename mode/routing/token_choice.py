"""Token-choice top-k router (Switch / GShard / Mixtral style), with optional no-op experts.

Shape legend
    B batch   S sequence   T = B * S tokens   D hidden   E real experts   N no-op experts
    X = E + N expert slots   K top-k   A assignments

Each token scores the X slots, keeps its top-k, and its gates are the softmax (or sigmoid) probabilities
of those slots, optionally renormalised over the k chosen. Choices of a no-op slot are never computed:
the token simply gets less (or no) expert output. With ``capacity_factor`` set, each real expert takes at
most ``ceil(capacity_factor * T * K / E)`` assignments and the rest are dropped, first choices before
second choices and earlier tokens first; ``capacity_factor=None`` is dropless.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mode import _checks
from mode.routing.losses import load_balancing_loss, router_z_loss
from mode.routing.plan import Aux, RoutingPlan, RoutingStats, count_per, entropy_of, group_by_expert

GATES = ("softmax", "sigmoid")


@dataclass
class TokenChoiceConfig:
    d_model: int
    num_experts: int
    top_k: int = 1
    num_noop: int = 0
    gate: str = "softmax"
    renormalize: bool = False  # divide the k gates by their sum (Mixtral); no-op gates count too
    capacity_factor: float | None = None  # None: dropless
    balance_coef: float = 0.01
    z_coef: float = 1e-3
    check_finite: bool = True  # one host sync per call to reject NaN/inf logits

    def __post_init__(self) -> None:
        _checks.check_int("d_model", self.d_model)
        _checks.check_int("num_experts", self.num_experts)
        _checks.check_int("num_noop", self.num_noop, min_value=0)
        _checks.check_int("top_k", self.top_k)
        slots = self.num_experts + self.num_noop
        if self.top_k > slots:
            raise ValueError(
                f"top_k={self.top_k}: must be <= num_experts + num_noop = {slots} "
                "(a token cannot choose more experts than exist)"
            )
        _checks.check_choice("gate", self.gate, GATES)
        if self.capacity_factor is not None:
            _checks.check_positive("capacity_factor", self.capacity_factor)
        _checks.check_non_negative("balance_coef", self.balance_coef)
        _checks.check_non_negative("z_coef", self.z_coef)


class TokenChoiceRouter(nn.Module):
    def __init__(self, cfg: TokenChoiceConfig):
        super().__init__()
        self.cfg = cfg
        self.num_experts = cfg.num_experts
        self.num_slots = cfg.num_experts + cfg.num_noop
        self.weight = nn.Parameter(torch.empty(self.num_slots, cfg.d_model))
        nn.init.normal_(self.weight, std=cfg.d_model**-0.5)

    def capacity(self, num_tokens: int) -> int | None:
        """Per-expert assignment limit for ``num_tokens`` tokens (None when dropless)."""
        if self.cfg.capacity_factor is None:
            return None
        return math.ceil(self.cfg.capacity_factor * num_tokens * self.cfg.top_k / self.num_experts)

    def forward(self, x_BSD: Tensor, mask_BS: Tensor | None = None) -> RoutingPlan:
        _checks.check_hidden("x", x_BSD, self.cfg.d_model)
        _checks.check_mask("mask", mask_BS, x_BSD.shape[:2])
        B, S, _ = x_BSD.shape
        T, K, E = B * S, self.cfg.top_k, self.num_experts
        valid_T = None if mask_BS is None else mask_BS.reshape(T)

        # Routing math in float32 whatever the activation dtype: top-k on bf16 logits ties too often.
        logits_TX = F.linear(x_BSD.reshape(T, -1).float(), self.weight.float())
        if self.cfg.check_finite:
            _checks.check_finite_logits("TokenChoiceRouter", logits_TX)
        if self.cfg.gate == "softmax":
            probs_TX = logits_TX.softmax(-1)
            balance_probs_TX = probs_TX
        else:
            probs_TX = logits_TX.sigmoid()
            balance_probs_TX = probs_TX / probs_TX.sum(-1, keepdim=True)
        gate_TK, chosen_TK = probs_TX.topk(K, dim=-1)
        if self.cfg.renormalize:
            gate_TK = gate_TK / gate_TK.sum(-1, keepdim=True)

        aux = Aux()
        aux.add_loss("balance", load_balancing_loss(balance_probs_TX, chosen_TK, valid_T), self.cfg.balance_coef)
        aux.add_loss("z_loss", router_z_loss(logits_TX, valid_T), self.cfg.z_coef)

        # Flatten choice-major (all first choices, then all second choices...): that is drop priority.
        slot_A = chosen_TK.t().reshape(-1)
        token_A = torch.arange(T, device=x_BSD.device).repeat(K)
        gate_A = gate_TK.t().reshape(-1)
        valid_A = torch.ones_like(slot_A, dtype=torch.bool) if valid_T is None else valid_T[token_A]
        requested_X = count_per(slot_A, self.num_slots, valid_A)
        keep = (valid_A & (slot_A < E)).nonzero().squeeze(1)  # host sync: the plan's size is data-dependent
        slot_A, token_A, gate_A = slot_A[keep], token_A[keep], gate_A[keep]

        cap = self.capacity(T)
        if cap is not None:
            slot_A, token_A, gate_A = _apply_capacity(slot_A, token_A, gate_A, E, cap)
        token_A, expert_A, gate_A, counts_E = group_by_expert(token_A, slot_A, gate_A, E, T)

        real_requested = requested_X[:E].sum()
        aux.stats["router"] = RoutingStats(
            kept_E=counts_E.detach().float(),
            requested_X=requested_X.detach().float(),
            dropped=(real_requested - counts_E.sum()).float(),
            noop=requested_X[E:].sum().float(),
            tokens=torch.tensor(float(T), device=x_BSD.device) if valid_T is None else valid_T.sum().float(),
            compute_T=count_per(token_A, T).float(),
            entropy=entropy_of(balance_probs_TX.detach(), valid_T),
            batch_shape=(B, S),
        )
        return RoutingPlan(token_idx_A=token_A, expert_idx_A=expert_A, weight_A=gate_A, counts_E=counts_E,
                           num_tokens=T, aux=aux)


def _apply_capacity(slot_A: Tensor, token_A: Tensor, gate_A: Tensor, num_experts: int, cap: int):
    """Keep each expert's first ``cap`` assignments in their current (priority) order."""
    n = slot_A.numel()
    pos_A = torch.arange(n, device=slot_A.device)
    order = torch.argsort(slot_A * n + pos_A)  # unique keys: grouped by expert, priority kept inside
    counts_E = count_per(slot_A, num_experts)
    start_E = torch.cumsum(counts_E, 0) - counts_E
    rank_sorted = pos_A - start_E[slot_A[order]]  # position of each assignment inside its expert
    keep = order[rank_sorted < cap]
    return slot_A[keep], token_A[keep], gate_A[keep]

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

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from legacy.losses import router_z_loss
from legacy.plan import Aux, RoutingPlan, RoutingStats, count_per, entropy_of, group_by_expert, scalar
from torch import Tensor, nn

from mode import _checks
from mode.routing.capacity import ceil_of


@dataclass
class ExpertChoiceConfig:
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
        return self.num_experts + self.num_noop

    @property
    def max_assignments_per_token(self) -> int:
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
        c = ceil_of(self.capacity_factor, seq_len, self.num_slots)
        if c > seq_len:
            raise ValueError(
                f"capacity_factor={self.capacity_factor}: each of the {self.num_slots} expert slots would "
                f"pick {c} tokens but a sequence has only {seq_len}; must be <= num_slots = {self.num_slots}"
            )
        return c

    def assignments(self, seq_len: int) -> float:
        return float(self.num_experts * self.tokens_per_slot(seq_len))

    def router_flops(self, seq_len: int) -> float:
        return 2 * seq_len * self.d_model * self.num_slots


class ExpertChoiceRouter(nn.Module):
    def __init__(self, cfg: ExpertChoiceConfig):
        super().__init__()
        self.cfg = cfg
        self.num_experts = cfg.num_experts
        self.num_slots = cfg.num_experts + cfg.num_noop
        _checks.check_numel("(num_experts + num_noop, d_model)", self.num_slots, cfg.d_model)
        self.weight = nn.Parameter(torch.empty(self.num_slots, cfg.d_model))
        nn.init.normal_(self.weight, std=cfg.d_model**-0.5)

    def tokens_per_slot(self, seq_len: int) -> int:
        return self.cfg.tokens_per_slot(seq_len)

    def forward(self, x_BSD: Tensor, mask_BS: Tensor | None = None) -> RoutingPlan:
        _checks.check_hidden("x", x_BSD, self.cfg.d_model, device=self.weight.device)
        _checks.check_mask("mask", mask_BS, x_BSD.shape[:2], device=self.weight.device)
        B, S, _ = x_BSD.shape
        T, E, X = B * S, self.num_experts, self.num_slots
        c = self.tokens_per_slot(S)
        dev = x_BSD.device

        with _checks.float32_region(dev):  # routing math in float32, also under autocast
            logits_BSX = F.linear(x_BSD.float(), self.weight.float())
            if self.cfg.check_finite:
                _checks.check_finite_logits("ExpertChoiceRouter", logits_BSX)
            probs_BSX = logits_BSX.softmax(-1)
            scores_BSX = probs_BSX if mask_BS is None else probs_BSX.masked_fill(~mask_BS[..., None], -1.0)
            gate_BcX, pos_BcX = scores_BSX.topk(c, dim=1)  # each slot's c best positions per sequence
            valid_T = None if mask_BS is None else mask_BS.reshape(T)
            aux = Aux()
            aux.add_loss("z_loss", router_z_loss(logits_BSX.reshape(T, X), valid_T), self.cfg.z_coef)

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

        picked_BcX = gate_BcX >= 0  # False only for padded positions
        requested_X = picked_BcX.sum((0, 1)).float()
        aux.stats["router"] = RoutingStats(
            kept_E=counts_E.detach().float(),
            requested_X=requested_X,
            dropped=torch.zeros((), device=dev),
            noop=requested_X[E:].sum(),
            tokens=scalar(T, dev) if valid_T is None else valid_T.sum().float(),
            compute_T=count_per(token_A, T, expert_A < E).float(),
            entropy=entropy_of(probs_BSX.detach().reshape(T, X), valid_T),
            batch_shape=(B, S),
        )
        return RoutingPlan(
            token_idx_A=token_A, expert_idx_A=expert_A, weight_A=gate_A, counts_E=counts_E, num_tokens=T, aux=aux
        )

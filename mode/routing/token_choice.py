"""Token-choice top-k router (Switch / GShard / Mixtral style), with optional no-op experts.

Shape legend
    B batch   S sequence   T = B * S tokens   D hidden   E real experts   N no-op experts
    X = E + N expert slots   K top-k   A assignments

Each token scores the X slots, keeps its top-k, and its gates are the softmax (or sigmoid) probabilities
of those slots, optionally renormalised over the k chosen. Choices of a no-op slot are never computed:
the token simply gets less (or no) expert output. With ``capacity_factor`` set, each real expert takes at
most ``ceil(capacity_factor * T * K / E)`` assignments (the factor read as the decimal written) and the
rest are dropped, first choices before second choices and earlier tokens first; ``capacity_factor=None``
is dropless.

The plan has the static size ``A = T * K``: no-op choices, drops and padded tokens stay in it as padding
after the computed assignments, so no step makes the host wait for the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mode import _checks
from mode.routing.losses import router_z_loss
from mode.routing.capacity import ceil_of
from mode.routing.plan import Aux, RoutingPlan, RoutingStats, count_per, entropy_of, group_by_expert, scalar

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
    check_finite: bool = True  # reject NaN/inf logits (an asynchronous device assert on a GPU)

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
        _checks.check_bool("renormalize", self.renormalize)
        _checks.check_bool("check_finite", self.check_finite)

    # -- what the FLOP and per-token compute code asks (the router protocol, see mode.routing.registry) --
    @property
    def num_slots(self) -> int:
        return self.num_experts + self.num_noop

    @property
    def max_assignments_per_token(self) -> int:
        return self.top_k

    def causal_problem(self) -> str | None:
        """Why token-by-token decoding would not match the full forward, or None. Dropless routing decides
        each token alone; capacity drops depend on the other tokens."""
        if self.capacity_factor is None:
            return None
        return (f"capacity_factor={self.capacity_factor}: token-choice capacity drops depend on the other tokens "
                "of the batch, so decoding would not match the full forward; generate() needs dropless MoE layers "
                "(rebuild the LMConfig with capacity_factor=None and load the same weights)")

    def capacity(self, num_tokens: int) -> int | None:
        """Per-expert assignment limit for ``num_tokens`` tokens (None when dropless)."""
        if self.capacity_factor is None:
            return None
        return ceil_of(self.capacity_factor, num_tokens * self.top_k, self.num_experts)

    def assignments(self, seq_len: int) -> float:
        """Computed assignments per sequence under balanced routing (no-op slots take their share)."""
        wanted = seq_len * self.top_k * self.num_experts / self.num_slots
        cap = self.capacity(seq_len)
        return wanted if cap is None else min(wanted, self.num_experts * cap)

    def router_flops(self, seq_len: int) -> float:
        return 2 * seq_len * self.d_model * self.num_slots


class TokenChoiceRouter(nn.Module):
    def __init__(self, cfg: TokenChoiceConfig):
        super().__init__()
        self.cfg = cfg
        self.num_experts = cfg.num_experts
        self.num_slots = cfg.num_experts + cfg.num_noop
        _checks.check_numel("(num_experts + num_noop, d_model)", self.num_slots, cfg.d_model)
        self.weight = nn.Parameter(torch.empty(self.num_slots, cfg.d_model))
        nn.init.normal_(self.weight, std=cfg.d_model**-0.5)

    def capacity(self, num_tokens: int) -> int | None:
        """Per-expert assignment limit for ``num_tokens`` tokens (None when dropless)."""
        return self.cfg.capacity(num_tokens)

    def forward(self, x_BSD: Tensor, mask_BS: Tensor | None = None) -> RoutingPlan:
        _checks.check_hidden("x", x_BSD, self.cfg.d_model, device=self.weight.device)
        _checks.check_mask("mask", mask_BS, x_BSD.shape[:2], device=self.weight.device)
        B, S, _ = x_BSD.shape
        T, K, E = B * S, self.cfg.top_k, self.num_experts
        valid_T = None if mask_BS is None else mask_BS.reshape(T)

        dev = x_BSD.device
        with _checks.float32_region(dev):  # routing math in float32, also under autocast
            # float32 whatever the activation dtype: top-k on bf16 logits ties too often
            logits_TX = F.linear(x_BSD.reshape(T, self.cfg.d_model).float(), self.weight.float())
            if self.cfg.check_finite:
                _check_finite(logits_TX)
            if self.cfg.gate == "softmax":
                probs_TX = logits_TX.softmax(-1)
                balance_probs_TX = probs_TX
            else:
                probs_TX = logits_TX.sigmoid()
                balance_probs_TX = probs_TX / probs_TX.sum(-1, keepdim=True)
            gate_TK, chosen_TK = probs_TX.topk(K, dim=-1)
            if self.cfg.renormalize:
                gate_TK = gate_TK / gate_TK.sum(-1, keepdim=True)

            # Flatten choice-major (all first choices, then all second choices...): that is drop priority.
            slot_A = chosen_TK.t().reshape(-1)
            token_A = torch.arange(T, device=dev).repeat(K)
            valid_A = None if valid_T is None else valid_T[token_A]
            requested_X = count_per(slot_A, self.num_slots, valid_A)  # choices per slot, before capacity

            aux = Aux()
            aux.add_loss("balance", _balance_loss(balance_probs_TX, requested_X, K, valid_T), self.cfg.balance_coef)
            aux.add_loss("z_loss", router_z_loss(logits_TX, valid_T), self.cfg.z_coef)

        gate_A = gate_TK.t().reshape(-1)
        cap = self.capacity(T)
        # padding comes only from a mask, no-op choices or capacity drops: without them A == counts_E.sum()
        padded = valid_T is not None or self.cfg.num_noop > 0 or cap is not None
        if padded:
            computed_A = slot_A < E if valid_A is None else valid_A & (slot_A < E)
            if cap is not None:
                computed_A = computed_A & _within_capacity(slot_A, computed_A, E, cap)
            expert_key_A = torch.where(computed_A, slot_A, E)  # E: not computed, sorts after every expert
        else:
            expert_key_A = slot_A  # every choice is a real expert and is computed
        token_A, expert_A, gate_A, counts_E = group_by_expert(token_A, expert_key_A, gate_A, E, T)

        real_requested = requested_X[:E].sum()
        aux.stats["router"] = RoutingStats(
            kept_E=counts_E.detach().float(),
            requested_X=requested_X.detach().float(),
            dropped=(real_requested - counts_E.sum()).float(),
            noop=requested_X[E:].sum().float(),
            tokens=scalar(T, dev) if valid_T is None else valid_T.sum().float(),
            compute_T=count_per(token_A, T, expert_A < E).float(),
            entropy=entropy_of(balance_probs_TX.detach(), valid_T),
            batch_shape=(B, S),
        )
        return RoutingPlan(token_idx_A=token_A, expert_idx_A=expert_A, weight_A=gate_A, counts_E=counts_E,
                           num_tokens=T, aux=aux, padded=padded)


def _check_finite(logits_TX: Tensor) -> None:
    """``_checks.check_finite_logits`` in one pass: min and max of the logits are finite exactly when every
    logit is (NaN propagates through both). Only a failure runs the full check, for its message."""
    if logits_TX.numel() == 0 or logits_TX.device.type == "meta":
        return
    lo, hi = torch.aminmax(logits_TX)
    try:
        torch._assert_async(torch.isfinite(lo) & torch.isfinite(hi), "TokenChoiceRouter: router logits are NaN or inf")
    except RuntimeError:  # raised at once on the CPU; on a GPU a failure is a device-side assert
        _checks.check_finite_logits("TokenChoiceRouter", logits_TX)
        raise


def _balance_loss(probs_TX: Tensor, requested_X: Tensor, top_k: int, valid_T: Tensor | None) -> Tensor:
    """``losses.load_balancing_loss`` from the choice counts the router has anyway (``requested_X``, valid
    choices per slot) instead of a (T, X) one-hot: the same value bit for bit (a float32 sum of ones is the
    exact count), three passes over (T, X) fewer. ``tests/core/test_routers.py`` checks the two agree."""
    num_slots = probs_TX.shape[-1]
    if valid_T is not None:
        probs_TX = probs_TX * valid_T[:, None]
        n = valid_T.sum().clamp_min(1)
    else:
        n = max(1, probs_TX.shape[0])
    f_X = requested_X.to(probs_TX.dtype) / (n * top_k)
    p_X = probs_TX.sum(0) / n
    return num_slots * (f_X * p_X).sum()


def _within_capacity(slot_A: Tensor, computed_A: Tensor, num_experts: int, cap: int) -> Tensor:
    """True for the computed assignments among each expert's first ``cap`` in their current (priority)
    order. Static shapes: a rank inside each expert, no boolean indexing."""
    n = slot_A.numel()
    pos_A = torch.arange(n, device=slot_A.device)
    expert_key_A = torch.where(computed_A, slot_A, num_experts)
    order_A = torch.argsort(expert_key_A * n + pos_A)  # unique keys: grouped by expert, priority kept inside
    counts_E = count_per(expert_key_A, num_experts + 1)
    start_E = torch.cumsum(counts_E, 0) - counts_E
    rank_sorted_A = pos_A - start_E[expert_key_A[order_A]]  # position of each assignment inside its expert
    within_A = torch.empty_like(computed_A)
    within_A[order_A] = rank_sorted_A < cap  # back to priority order (a permutation: no collisions)
    return within_A

"""Token-choice top-k router (Switch / GShard / Mixtral style), with optional no-op experts.

Shape legend
    B batch   S sequence   T = B * S tokens   D hidden   E real experts   N no-op experts
    X = E + N expert slots   K top-k   A assignments

Each token scores the X slots, keeps its top-k, and its gates are the softmax (or sigmoid, or
``sqrtsoftplus``: DeepSeek-V4's sqrt(softplus(logit))) scores of those slots, optionally renormalised over the
k chosen. Choosing by the scores or by the raw logits is the same choice (each is monotone in the logit); a
softmax over the k chosen logits (gpt-oss, Granite) is the renormalised softmax. Choices of a no-op slot are never
computed:
the token simply gets less (or no) expert output. With ``capacity_factor`` set, each real expert takes at
most ``ceil(capacity_factor * T * K / E)`` assignments (the factor read as the decimal written) and the
rest are dropped, first choices before second choices and earlier tokens first; ``capacity_factor=None``
is dropless.

The plan has the static size ``A = T * K``: no-op choices, drops and padded tokens stay in it as padding
after the computed assignments, so no step makes the host wait for the device.

The recipes of DeepSeek-V3 and Qwen-MoE (docs/routing.md), each off by default:
    scale          ``routed_scaling_factor``: multiplies every gate, after renormalisation
    n_group, topk_group   device-limited routing: the E real experts form ``n_group`` equal groups; a token
                   keeps its ``topk_group`` best groups (a group scores the sum of its two best experts, or
                   its best with ``group_score="max"``: DeepSeek-V2) and chooses inside them; no-op slots
                   belong to no group and stay eligible
    renorm_eps, renorm_min, renorm_p   the renormalisation's denominator is ``max(norm_p + eps, min)``, the
                   p-norm of the k gates (p = 1: their sum; DBRX's p), DeepSeek-V3 adding 1e-20, LFM2 1e-6,
                   ERNIE-4.5 clamping at ``moe_norm_min``
    bias_on        "logits": the balancing bias is added to the raw logits for choosing (Kolibri-1), not to the
                   scores; the gates are the scores at the chosen slots either way
    dropped_groups "zero": the experts of a token's dropped groups score 0 for choosing, not -inf (AXK2: they
                   can still be chosen over an expert whose biased score is negative)
    logit_softcap  ``c * tanh(logit / c)`` on the logits before anything else (Laguna); the recorded and
                   z-loss logits are the capped ones
    logit_bias     a learned bias on the logits (gpt-oss): part of the logits, so of the gates, the losses
                   and the recorded logits; unlike ``bias_X`` it is trained by the gradient
    hash_vocab     hash routing (Roller et al. 2021; DeepSeek-V4's first layers): the k experts of a token are a
                   fixed row of the buffer ``hash_table_VK`` (vocab, k), indexed by the token id the caller passes
                   (``router(x, mask, ids_BS=...)``); the gates are the scores at those experts, renormalised
                   and scaled as configured. Without ids it raises
    gate="sparsemixer", mixer_eps   PhiMoE's gates, deterministic (its evaluation rule): the k slots are
                   chosen one after another by the largest remaining logit, and slot j's gate is the softmax,
                   at that logit, over the remaining logits within a relative gap 2 * mixer_eps of it
                   (``(m_j - s) / max(|s|, m_j) <= 2 eps``). PhiMoE's training samples the choice (Gumbel)
                   and back-propagates a Heun estimate: not this (a converted PhiMoE refuses training)
    bias_balance   balancing without an auxiliary loss: a per-slot bias buffer ``bias_X`` is added to the
                   scores for *choosing* only (the gates come from the unbiased scores); training forwards
                   add their choice counts to ``load_X``, and ``mode.routing.bias_balance.update_expert_bias``
                   moves the bias by ``bias_rate * sign(target - load)`` after each optimizer step
    noop_target    with bias_balance and no-op slots: the target load holds this share of the choices on the
                   no-op slots (a compute budget), the rest spread evenly over the real experts
    balance_scope  the Switch balance loss over "batch" (this forward's tokens), "sequence" (per sequence,
                   then averaged: DeepSeek-V3's complementary loss) or "global" (the choice counts summed over
                   every rank before the loss is formed; ``reduce_counts``, installed by ``mode.parallel``)

``reduce_counts`` (None in one process) is the only way cross-rank information reaches this module: a
callable summing a tensor over the ranks that hold a copy of the router; this module never imports
``torch.distributed``.
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

GATES = ("softmax", "sigmoid", "sqrtsoftplus", "sparsemixer")  # sqrtsoftplus: DeepSeek-V4; sparsemixer: PhiMoE
GROUP_SCORES = ("top2", "max")  # a group scores the sum of its two best experts (DeepSeek-V3) or its best (V2)
BALANCE_SCOPES = ("batch", "sequence", "global")


@dataclass
class TokenChoiceConfig:
    d_model: int
    num_experts: int
    top_k: int = 1
    num_noop: int = 0
    gate: str = "softmax"
    renormalize: bool = False  # divide the k gates by their sum (Mixtral); no-op gates count too
    renorm_eps: float = 0.0  # renormalise by (sum + eps): DeepSeek-V3 1e-20, LFM2 1e-6
    renorm_min: float = 0.0  # ... and by at least this (ERNIE-4.5's moe_norm_min)
    renorm_p: float = 1.0  # ... of the k gates' p-norm (1: their sum; DBRX's moe_normalize_expert_weights)
    logit_bias: bool = False  # a learned bias on the logits, in the recorded logits too (gpt-oss's router.bias)
    capacity_factor: float | None = None  # None: dropless
    balance_coef: float = 0.01
    z_coef: float = 1e-3
    check_finite: bool = True  # reject NaN/inf logits (an asynchronous device assert on a GPU)
    scale: float = 1.0  # routed_scaling_factor (DeepSeek-V3): multiplies the gates after renormalisation
    n_group: int = 1  # device-limited routing: the real experts in n_group equal groups ...
    topk_group: int | None = None  # ... of which each token keeps its best topk_group (None: all of them)
    group_score: str = "top2"  # a group's score: the sum of its two best experts' scores, or the best ("max")
    mixer_eps: float = 0.0  # gate="sparsemixer": the relative logit gap 2 * eps a slot's softmax spans
    hash_vocab: int = 0  # > 0: hash routing, the experts of a token id from a (hash_vocab, top_k) table
    logit_softcap: float = 0.0  # > 0: logits = c * tanh(logits / c) before everything else (Laguna)
    bias_on: str = "scores"  # bias_balance: the bias is added to the scores, or to the raw logits (Kolibri-1)
    dropped_groups: str = "ninf"  # the experts of dropped groups score -inf ("ninf") or 0 ("zero": AXK2)
    bias_balance: bool = False  # aux-loss-free balancing (DeepSeek-V3): a bias on the scores for choosing
    bias_rate: float = 1e-3  # the bias update step (torchtitan's and Megatron's default)
    noop_target: float | None = None  # bias_balance with no-op slots: the share of choices to hold on them
    balance_scope: str = "batch"  # the balance loss over "batch", "sequence" or "global" (all ranks)

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
        _checks.check_non_negative("renorm_eps", self.renorm_eps)
        _checks.check_non_negative("renorm_min", self.renorm_min)
        _checks.check_positive("renorm_p", self.renorm_p)
        if (self.renorm_eps or self.renorm_min or self.renorm_p != 1.0) and not self.renormalize:
            raise ValueError(
                f"renorm_eps={self.renorm_eps}, renorm_min={self.renorm_min}, "
                f"renorm_p={self.renorm_p}: need renormalize=True"
            )
        _checks.check_bool("logit_bias", self.logit_bias)
        _checks.check_non_negative("mixer_eps", self.mixer_eps)
        _checks.check_int("hash_vocab", self.hash_vocab, min_value=0)
        _checks.check_non_negative("logit_softcap", self.logit_softcap)
        _checks.check_choice("bias_on", self.bias_on, ("scores", "logits"))
        _checks.check_choice("dropped_groups", self.dropped_groups, ("ninf", "zero"))
        if self.hash_vocab and (self.bias_balance or self.n_group > 1 or self.num_noop or self.gate == "sparsemixer"):
            raise ValueError(
                f"hash_vocab={self.hash_vocab}: hash routing takes its experts from the table (got "
                f"bias_balance={self.bias_balance}, n_group={self.n_group}, num_noop={self.num_noop}, "
                f"gate={self.gate!r}: none of them applies)"
            )
        if self.gate == "sparsemixer" and (self.renormalize or self.bias_balance or self.n_group > 1):
            raise ValueError(
                f"gate='sparsemixer': gives each slot its own gate, chosen by the logits alone (got "
                f"renormalize={self.renormalize}, bias_balance={self.bias_balance}, "
                f"n_group={self.n_group}: none of them applies)"
            )
        _checks.check_choice("group_score", self.group_score, GROUP_SCORES)
        _checks.check_bool("check_finite", self.check_finite)
        _checks.check_positive("scale", self.scale)
        _checks.check_int("n_group", self.n_group)
        if self.num_experts % self.n_group:
            raise ValueError(f"n_group={self.n_group}: must divide num_experts={self.num_experts} (equal groups)")
        if self.topk_group is None:
            self.topk_group = self.n_group
        _checks.check_int("topk_group", self.topk_group)
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group={self.topk_group}: must be <= n_group={self.n_group}")
        eligible = self.topk_group * (self.num_experts // self.n_group) + self.num_noop
        if self.top_k > eligible:
            raise ValueError(
                f"top_k={self.top_k}: must be <= the slots a token can choose from, topk_group * "
                f"num_experts / n_group + num_noop = {eligible}"
            )
        _checks.check_bool("bias_balance", self.bias_balance)
        _checks.check_positive("bias_rate", self.bias_rate)
        if self.noop_target is not None:
            if not self.bias_balance or self.num_noop < 1:
                raise ValueError(
                    f"noop_target={self.noop_target}: needs bias_balance=True and num_noop >= 1 "
                    f"(got bias_balance={self.bias_balance}, num_noop={self.num_noop})"
                )
            if _checks.check_fraction("noop_target", self.noop_target) == 1.0:
                raise ValueError(f"noop_target={self.noop_target}: must be in (0, 1) (1 would compute nothing)")
        _checks.check_choice("balance_scope", self.balance_scope, BALANCE_SCOPES)

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
        return (
            f"capacity_factor={self.capacity_factor}: token-choice capacity drops depend on the other tokens "
            "of the batch, so decoding would not match the full forward; generate() needs dropless MoE layers "
            "(rebuild the LMConfig with capacity_factor=None and load the same weights)"
        )

    def capacity(self, num_tokens: int) -> int | None:
        """Per-expert assignment limit for ``num_tokens`` tokens (None when dropless)."""
        if self.capacity_factor is None:
            return None
        return ceil_of(self.capacity_factor, num_tokens * self.top_k, self.num_experts)

    @property
    def group_limited(self) -> bool:
        return self.topk_group < self.n_group

    def target_shares(self) -> list[float]:
        """The share of the choices each slot should get under balanced routing: even over all slots, or
        ``noop_target`` over the no-op slots and the rest evenly over the real experts."""
        if self.noop_target is None:
            return [1 / self.num_slots] * self.num_slots
        real, noop = (1 - self.noop_target) / self.num_experts, self.noop_target / self.num_noop
        return [real] * self.num_experts + [noop] * self.num_noop

    def assignments(self, seq_len: int) -> float:
        """Computed assignments per sequence under balanced routing (no-op slots take their share)."""
        wanted = seq_len * self.top_k * sum(self.target_shares()[: self.num_experts])
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
        self.reduce_counts = None  # sums a tensor over the ranks holding this router (mode.parallel sets it)
        self.logit_bias_X = nn.Parameter(torch.zeros(self.num_slots)) if cfg.logit_bias else None
        self.emit_noop_gates = False  # the layer's no-op experts need each token's no-op gates (mode.layers.noop)
        if cfg.hash_vocab:  # saved with the model; a checkpoint's table replaces the zeros
            self.register_buffer("hash_table_VK", torch.zeros(cfg.hash_vocab, cfg.top_k, dtype=torch.long))
        if cfg.bias_balance:
            self.register_buffer("bias_X", torch.zeros(self.num_slots))  # saved and resumed with the model
            self.register_buffer("load_X", torch.zeros(self.num_slots), persistent=False)  # since the update
            self.register_buffer("share_X", torch.tensor(cfg.target_shares()), persistent=False)
        self._choose_by_score = not cfg.bias_balance and not cfg.group_limited  # topk of the gates themselves
        self._dropped_fill = float("-inf") if cfg.dropped_groups == "ninf" else 0.0

    def capacity(self, num_tokens: int) -> int | None:
        """Per-expert assignment limit for ``num_tokens`` tokens (None when dropless)."""
        return self.cfg.capacity(num_tokens)

    def forward(self, x_BSD: Tensor, mask_BS: Tensor | None = None, ids_BS: Tensor | None = None) -> RoutingPlan:
        """``ids_BS``: the token ids, which hash routing (``hash_vocab``) chooses by; ignored otherwise."""
        _checks.check_hidden("x", x_BSD, self.cfg.d_model, device=self.weight.device)
        _checks.check_mask("mask", mask_BS, x_BSD.shape[:2], device=self.weight.device)
        if self.cfg.hash_vocab and (ids_BS is None or tuple(ids_BS.shape) != tuple(x_BSD.shape[:2])):
            raise ValueError(
                f"ids_BS={None if ids_BS is None else tuple(ids_BS.shape)}: hash routing "
                f"(hash_vocab={self.cfg.hash_vocab}) chooses by the token ids; pass them, shaped "
                f"like x's (B, S) = {tuple(x_BSD.shape[:2])}"
            )
        B, S, _ = x_BSD.shape
        T, K, E = B * S, self.cfg.top_k, self.num_experts
        valid_T = None if mask_BS is None else mask_BS.reshape(T)

        dev = x_BSD.device
        with _checks.float32_region(dev):  # routing math in float32, also under autocast
            # float32 whatever the activation dtype: top-k on bf16 logits ties too often
            bias_X = None if self.logit_bias_X is None else self.logit_bias_X.float()
            logits_TX = F.linear(x_BSD.reshape(T, self.cfg.d_model).float(), self.weight.float(), bias_X)
            if self.cfg.logit_softcap:
                logits_TX = torch.tanh(logits_TX / self.cfg.logit_softcap) * self.cfg.logit_softcap
            if self.cfg.check_finite:
                _check_finite(logits_TX)
            if self.cfg.gate in ("softmax", "sparsemixer"):
                probs_TX = logits_TX.softmax(-1)
                balance_probs_TX = probs_TX
            else:
                probs_TX = logits_TX.sigmoid() if self.cfg.gate == "sigmoid" else F.softplus(logits_TX).sqrt()
                balance_probs_TX = probs_TX / probs_TX.sum(-1, keepdim=True)
            if self.cfg.gate == "sparsemixer":
                gate_TK, chosen_TK = _sparsemixer(logits_TX, K, self.cfg.mixer_eps)
            elif self.cfg.hash_vocab:  # the table decides; the scores at its experts are the gates
                chosen_TK = self.hash_table_VK[ids_BS.reshape(T)]
                gate_TK = probs_TX.gather(1, chosen_TK)
            elif self._choose_by_score:
                gate_TK, chosen_TK = probs_TX.topk(K, dim=-1)
            else:  # the bias and the group limit change which slots are chosen, never the gate values
                chosen_TK = self._choice_scores(probs_TX, logits_TX).topk(K, dim=-1).indices
                gate_TK = probs_TX.gather(1, chosen_TK)
            if self.cfg.renormalize:
                if self.cfg.renorm_p == 1.0:
                    denom_T1 = gate_TK.sum(-1, keepdim=True)
                else:
                    denom_T1 = torch.linalg.vector_norm(gate_TK, ord=self.cfg.renorm_p, dim=-1, keepdim=True)
                if self.cfg.renorm_eps:
                    denom_T1 = denom_T1 + self.cfg.renorm_eps
                if self.cfg.renorm_min:
                    denom_T1 = denom_T1.clamp_min(self.cfg.renorm_min)
                gate_TK = gate_TK / denom_T1
            if self.cfg.scale != 1.0:
                gate_TK = gate_TK * self.cfg.scale
            noop_gate_TN = None
            if self.emit_noop_gates:  # each token's gate on each no-op slot (0 where not chosen, and on pads)
                noop_gate_TN = gate_TK.new_zeros(T, self.num_slots).scatter_add(1, chosen_TK, gate_TK)[:, E:]
                if valid_T is not None:
                    noop_gate_TN = noop_gate_TN * valid_T[:, None]

            # Flatten choice-major (all first choices, then all second choices...): that is drop priority.
            slot_A = chosen_TK.t().reshape(-1)
            token_A = torch.arange(T, device=dev).repeat(K)
            valid_A = None if valid_T is None else valid_T[token_A]
            requested_X = count_per(slot_A, self.num_slots, valid_A)  # choices per slot, before capacity
            if self.cfg.bias_balance and self.training and torch.is_grad_enabled():
                self.load_X += requested_X  # eval and no_grad forwards never move the bias

            aux = Aux()
            aux.add_loss(
                "balance", self._balance(balance_probs_TX, requested_X, chosen_TK, valid_T, B), self.cfg.balance_coef
            )
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
        return RoutingPlan(
            token_idx_A=token_A,
            expert_idx_A=expert_A,
            weight_A=gate_A,
            counts_E=counts_E,
            num_tokens=T,
            aux=aux,
            padded=padded,
            logits_TX=logits_TX,
            noop_gate_TN=noop_gate_TN,
        )

    def _choice_scores(self, probs_TX: Tensor, logits_TX: Tensor) -> Tensor:
        """The scores the top-k chooses by: the gates (or the logits, ``bias_on="logits"``) plus the balancing
        bias, with the real experts outside a token's ``topk_group`` best groups at -inf (or 0,
        ``dropped_groups="zero"``)."""
        base_TX = probs_TX if self.cfg.bias_on == "scores" else logits_TX
        choice_TX = base_TX + self.bias_X if self.cfg.bias_balance else base_TX
        if not self.cfg.group_limited:
            return choice_TX
        T, E, G = choice_TX.shape[0], self.num_experts, self.cfg.n_group
        real_TGE = choice_TX[:, :E].reshape(T, G, E // G)
        if self.cfg.group_score == "max":
            group_TG = real_TGE.amax(-1)
        else:  # a group scores its two best experts
            group_TG = real_TGE.topk(min(2, E // G), dim=-1).values.sum(-1)
        keep_TG = torch.zeros_like(group_TG, dtype=torch.bool).scatter_(
            1, group_TG.topk(self.cfg.topk_group, dim=-1).indices, True
        )
        real_TE = real_TGE.masked_fill(~keep_TG[:, :, None], self._dropped_fill).reshape(T, E)
        return torch.cat([real_TE, choice_TX[:, E:]], dim=1)

    def _balance(
        self, probs_TX: Tensor, requested_X: Tensor, chosen_TK: Tensor, valid_T: Tensor | None, batch: int
    ) -> Tensor:
        """The Switch balance loss at the configured scope."""
        K = self.cfg.top_k
        if self.cfg.balance_scope == "sequence":
            return _sequence_balance_loss(probs_TX, chosen_TK, valid_T, batch)
        if self.cfg.balance_scope == "global" and self.reduce_counts is not None:
            n = probs_TX.new_full((1,), probs_TX.shape[0]) if valid_T is None else valid_T.sum().float()[None]
            counts = self.reduce_counts(torch.cat([requested_X.to(probs_TX.dtype), n]))  # one collective
            return _balance_loss(probs_TX, requested_X, K, valid_T, global_counts=counts)
        return _balance_loss(probs_TX, requested_X, K, valid_T)


def _sparsemixer(logits_TX: Tensor, k: int, eps: float) -> tuple[Tensor, Tensor]:
    """PhiMoE's sparsemixer gates, its evaluation rule (see the module docstring): (gate_TK, chosen_TK)."""
    remaining_TX, gates, chosen = logits_TX, [], []
    for _ in range(k):
        top_T1, idx_T1 = remaining_TX.max(dim=-1, keepdim=True)
        with torch.no_grad():
            far_TX = (top_T1 - logits_TX) / logits_TX.abs().clamp(min=top_T1) > 2 * eps
        gates.append(remaining_TX.masked_fill(far_TX, float("-inf")).softmax(-1).gather(-1, idx_T1))
        chosen.append(idx_T1)
        remaining_TX = remaining_TX.scatter(-1, idx_T1, float("-inf"))
    return torch.cat(gates, -1), torch.cat(chosen, -1)


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


def _balance_loss(
    probs_TX: Tensor, requested_X: Tensor, top_k: int, valid_T: Tensor | None, global_counts: Tensor | None = None
) -> Tensor:
    """``losses.load_balancing_loss`` from the choice counts the router has anyway (``requested_X``, valid
    choices per slot) instead of a (T, X) one-hot: the same value bit for bit (a float32 sum of ones is the
    exact count), three passes over (T, X) fewer. ``tests/core/test_routers.py`` checks the two agree.

    ``global_counts``: the choice counts and the token count (last entry) summed over every rank; the
    choice fractions ``f`` then come from them, the mean probabilities ``P`` (the gradient) from this rank."""
    num_slots = probs_TX.shape[-1]
    if valid_T is not None:
        probs_TX = probs_TX * valid_T[:, None]
        n = valid_T.sum().clamp_min(1)
    else:
        n = max(1, probs_TX.shape[0])
    if global_counts is None:
        f_X = requested_X.to(probs_TX.dtype) / (n * top_k)
    else:
        f_X = global_counts[:num_slots] / (global_counts[num_slots].clamp_min(1) * top_k)
    p_X = probs_TX.sum(0) / n
    return num_slots * (f_X * p_X).sum()


def _sequence_balance_loss(probs_TX: Tensor, chosen_TK: Tensor, valid_T: Tensor | None, batch: int) -> Tensor:
    """DeepSeek-V3's sequence-wise balance loss: the Switch loss of each sequence alone, averaged over the
    sequences that hold a real token."""
    T, X = probs_TX.shape
    K = chosen_TK.shape[1]
    S = T // max(1, batch)
    w_T = probs_TX.new_ones(T) if valid_T is None else valid_T.to(probs_TX.dtype)
    seq_TK = torch.arange(T, device=probs_TX.device).div(S, rounding_mode="floor")[:, None].expand(T, K)
    counts_BX = (
        probs_TX.new_zeros(batch * X)
        .index_add_(0, (seq_TK * X + chosen_TK).reshape(-1), w_T[:, None].expand(T, K).reshape(-1))
        .view(batch, X)
    )
    n_B = w_T.view(batch, S).sum(1)
    p_BX = (probs_TX * w_T[:, None]).view(batch, S, X).sum(1)
    per_seq_B = X * (counts_BX * p_BX).sum(1) / (n_B.square().clamp_min(1) * K)
    return per_seq_B.sum() / (n_B > 0).sum().clamp_min(1)


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

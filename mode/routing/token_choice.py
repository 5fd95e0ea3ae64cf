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

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mode import _checks
from mode.kernels.router import RouterOut, router_topk
from mode.routing.capacity import ceil_of
from mode.routing.losses import _masked_mean, router_z_loss
from mode.routing.plan import (
    Aux,
    RoutingPlan,
    RoutingStats,
    count_per,
    entropy_of,
    group_by_expert,
    inverse_of,
    permute,
    scalar,
)

GATES = ("softmax", "sigmoid", "sqrtsoftplus", "sparsemixer")  # sqrtsoftplus: DeepSeek-V4; sparsemixer: PhiMoE
GROUP_SCORES = ("top2", "max")  # a group scores the sum of its two best experts (DeepSeek-V3) or its best (V2)
BALANCE_SCOPES = ("batch", "sequence", "global")


@dataclass
class TokenChoiceConfig:
    """The settings of a ``TokenChoiceRouter`` (checked when built: a bad value raises ``ValueError`` naming it).
    The recipes (scale, groups, bias balancing, softcap, hash routing, sparsemixer) are in the module doc.

    Args:
        d_model: the hidden size D of the tokens it scores.
        num_experts: the real experts E.
        top_k: the expert slots each token chooses, at most ``num_experts + num_noop``.
        num_noop: the no-op slots N (integrated MoDE): a token's choice of one is never computed.
        gate: the gates' function of the logits: "softmax", "sigmoid", "sqrtsoftplus" or "sparsemixer".
        renormalize: divide the k gates by their sum (no-op gates included); ``renorm_eps``, ``renorm_min`` and
            ``renorm_p`` change the denominator to ``max(p-norm + eps, min)``.
        renorm_eps: added to the renormalisation's denominator.
        renorm_min: the renormalisation's smallest denominator.
        renorm_p: the p of the renormalisation's p-norm (1: the sum).
        logit_bias: a learned bias on the logits (gpt-oss).
        capacity_factor: each real expert takes at most ``ceil(capacity_factor * T * k / E)`` assignments, the
            rest are dropped; None: dropless.
        balance_coef: the weight of the Switch load-balancing loss "balance" in ``Aux.total()``.
        z_coef: the weight of the router z-loss "z_loss".
        check_finite: raise on NaN or inf logits (an asynchronous device assert on a GPU).
        scale: multiplies every gate after renormalisation (``routed_scaling_factor``).
        n_group: device-limited routing: the real experts form ``n_group`` equal groups ...
        topk_group: ... of which a token keeps its best ``topk_group`` (None: all).
        group_score: a group's score: "top2" (its two best experts' sum) or "max".
        mixer_eps: ``gate="sparsemixer"``: the relative logit gap a slot's softmax spans.
        hash_vocab: > 0: hash routing, each token id's experts from a (hash_vocab, top_k) table.
        logit_softcap: > 0: ``c * tanh(logit / c)`` on the logits first.
        bias_on: bias balancing adds its bias to the "scores" or to the raw "logits".
        dropped_groups: the experts of a token's dropped groups score "ninf" (-inf) or "zero".
        surplus_from_dropped: a group-limited ``top_k`` may exceed the slots of the kept groups: the surplus
            choices fall on dropped-group experts at their fill score, as ``torch.topk(..., sorted=False)`` breaks
            that tie (transformers' DeepSeek-V3 family computes this); False refuses such a ``top_k``.
        bias_balance: balancing without an aux loss: a per-slot bias, for choosing only, moved after each
            optimizer step (``mode.routing.bias_balance``).
        bias_rate: the bias's update step.
        noop_target: with bias balancing and no-op slots: the share of the choices to hold on them.
        balance_scope: the balance loss over this forward's "batch", each "sequence", or the "global" batch.
        fused_kernels: where the configuration allows it (``TokenChoiceConfig.fusable``), the scores, top-k,
            renormalisation, scale and the loss sums as one op, ``mode.kernels.router_topk`` (Triton on CUDA;
            on the CPU the same torch ops: losses, statistics and gates bit for bit, logit gradients within
            float32 rounding). False: the composed torch path.
    """

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
    surplus_from_dropped: bool = False  # top_k above the kept groups' slots: the rest from dropped groups
    bias_balance: bool = False  # aux-loss-free balancing (DeepSeek-V3): a bias on the scores for choosing
    bias_rate: float = 1e-3  # the bias update step (torchtitan's and Megatron's default)
    noop_target: float | None = None  # bias_balance with no-op slots: the share of choices to hold on them
    balance_scope: str = "batch"  # the balance loss over "batch", "sequence" or "global" (all ranks)
    fused_kernels: bool = True  # mode.kernels.router_topk where the configuration allows it (``fusable``)

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
        _checks.check_bool("surplus_from_dropped", self.surplus_from_dropped)
        if self.surplus_from_dropped:
            eligible = self.num_experts + self.num_noop
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
        _checks.check_bool("fused_kernels", self.fused_kernels)

    # -- what the FLOP and per-token compute code asks (the router protocol, see mode.routing.registry) --
    @property
    def num_slots(self) -> int:
        """``X = num_experts + num_noop``: the expert slots a token scores."""
        return self.num_experts + self.num_noop

    @property
    def max_assignments_per_token(self) -> int:
        """``top_k``: the most real experts one token can receive."""
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
        """Whether device-limited routing keeps a token to fewer than all expert groups (``topk_group < n_group``)."""
        assert self.topk_group is not None, "topk_group: resolved in __post_init__"
        return self.topk_group < self.n_group

    @property
    def fusable(self) -> bool:
        """Whether ``mode.kernels.router_topk`` computes this router's math: a softmax or sigmoid gate chosen by
        its own scores (no bias balancing, no group limit, no hash table), renormalised by the plain sum, and the
        balance loss over the batch (or the global batch: its counts are reduced as before)."""
        return (
            self.gate in ("softmax", "sigmoid")
            and not self.bias_balance
            and not self.group_limited
            and not self.hash_vocab
            and self.renorm_p == 1.0
            and not self.renorm_eps
            and not self.renorm_min
            and self.balance_scope in ("batch", "global")
        )

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
        """Forward FLOPs of routing one sequence of ``seq_len`` tokens: the (S, D) x (D, X) logits, ``2 S D X``."""
        return 2 * seq_len * self.d_model * self.num_slots


class TokenChoiceRouter(nn.Module):
    """The token-choice top-k router (Switch, GShard, Mixtral, DeepSeek): each token scores the ``X = E + N``
    expert slots with a linear map and keeps its best ``top_k``; the gates come from those scores.

    Shape legend: B batch, S sequence, T = B * S tokens, D hidden, E real experts, N no-op slots, X = E + N,
    K top-k, A = T * K assignments.

    Parameters: ``weight`` (X, D), initialised N(0, 1/D); ``logit_bias_X`` with ``logit_bias``; the buffers
    ``hash_table_VK`` (hash routing) and ``bias_X`` (bias balancing).

    Args:
        cfg: a ``TokenChoiceConfig``.
    """

    # buffers, registered only with the setting that uses them
    hash_table_VK: Tensor  # hash_vocab
    bias_X: Tensor  # bias_balance, with load_X and share_X
    load_X: Tensor
    share_X: Tensor

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
        self._fused = cfg.fused_kernels and cfg.fusable  # mode.kernels.router_topk: chosen once
        self._dropped_fill = float("-inf") if cfg.dropped_groups == "ninf" else 0.0
        assert cfg.topk_group is not None, "topk_group: resolved in TokenChoiceConfig.__post_init__"
        self._surplus = cfg.surplus_from_dropped and cfg.top_k > cfg.topk_group * (cfg.num_experts // cfg.n_group)

    def capacity(self, num_tokens: int) -> int | None:
        """Per-expert assignment limit for ``num_tokens`` tokens (None when dropless)."""
        return self.cfg.capacity(num_tokens)

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Give the buffers no checkpoint holds (bias balancing's ``load_X`` and ``share_X``) their built values,
        in place: for a model whose buffers were allocated empty, e.g. loaded by transformers from the meta
        device (``mode.hf.export.modeling``)."""
        if self.cfg.bias_balance:
            self.load_X.zero_()
            self.share_X.copy_(torch.tensor(self.cfg.target_shares()))

    def forward(self, x_BSD: Tensor, mask_BS: Tensor | None = None, ids_BS: Tensor | None = None) -> RoutingPlan:
        """Choose each token's experts.

        Args:
            x_BSD: the hidden states (the logits are computed in float32).
            mask_BS: None, or False at padding (padded tokens choose nothing and count nowhere).
            ids_BS: the token ids, which hash routing (``hash_vocab``) chooses by; ignored otherwise.

        Returns:
            a ``RoutingPlan`` of static size ``A = T * K``: the computed assignments grouped by expert first,
            then no-op choices, drops and padding; ``aux`` with the "balance" and "z_loss" losses and the
            stats under "router"; ``logits_TX`` the router's logits.
        """
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
            x_TD = _checks.at_least_float32(x_BSD.reshape(T, self.cfg.d_model))  # float64 stays float64
            bias_X = None if self.logit_bias_X is None else self.logit_bias_X.to(x_TD.dtype)
            logits_TX = F.linear(x_TD, self.weight.to(x_TD.dtype), bias_X)
            if self.cfg.logit_softcap:
                logits_TX = torch.tanh(logits_TX / self.cfg.logit_softcap) * self.cfg.logit_softcap
            fused = None
            if self._fused:  # scores, top-k, renormalisation, scale, loss sums and counts: one op
                fused = router_topk(
                    logits_TX,
                    K,
                    gate=self.cfg.gate,
                    renormalize=self.cfg.renormalize,
                    scale=self.cfg.scale,
                    valid_T=valid_T,
                )
                gate_TK, chosen_TK, probs_TX, balance_probs_TX = fused.gate_TK, fused.chosen_TK, None, None
            elif self.cfg.gate in ("softmax", "sparsemixer"):
                probs_TX = logits_TX.softmax(-1)
                balance_probs_TX = probs_TX
            else:
                probs_TX = logits_TX.sigmoid() if self.cfg.gate == "sigmoid" else F.softplus(logits_TX).sqrt()
                balance_probs_TX = probs_TX / probs_TX.sum(-1, keepdim=True)
            if fused is not None:
                pass
            elif probs_TX is None:
                raise AssertionError("TokenChoiceRouter: probs_TX is None only on the fused path")
            elif self.cfg.gate == "sparsemixer":
                gate_TK, chosen_TK = _sparsemixer(logits_TX, K, self.cfg.mixer_eps)
            elif self.cfg.hash_vocab:  # the table decides; the scores at its experts are the gates
                assert ids_BS is not None, "hash routing: ids_BS is checked on entry"
                chosen_TK = self.hash_table_VK[ids_BS.reshape(T)]
                gate_TK = probs_TX.gather(1, chosen_TK)
            elif self._choose_by_score:
                gate_TK, chosen_TK = probs_TX.topk(K, dim=-1)
            else:  # the bias and the group limit change which slots are chosen, never the gate values
                # sorted=False where the surplus falls on tied dropped-group experts: torch.topk's tie-break then is
                # transformers' (the same call on the same scores)
                chosen_TK = self._choice_scores(probs_TX, logits_TX).topk(K, dim=-1, sorted=not self._surplus).indices
                gate_TK = probs_TX.gather(1, chosen_TK)
            if self.cfg.renormalize and fused is None:
                if self.cfg.renorm_p == 1.0:
                    denom_T1 = gate_TK.sum(-1, keepdim=True)
                else:
                    denom_T1 = torch.linalg.vector_norm(gate_TK, ord=self.cfg.renorm_p, dim=-1, keepdim=True)
                if self.cfg.renorm_eps:
                    denom_T1 = denom_T1 + self.cfg.renorm_eps
                if self.cfg.renorm_min:
                    denom_T1 = denom_T1.clamp_min(self.cfg.renorm_min)
                gate_TK = gate_TK / denom_T1
            if self.cfg.scale != 1.0 and fused is None:
                gate_TK = gate_TK.mul(self.cfg.scale)  # Tensor.mul: pyright cannot tell gate_TK is bound here
            noop_gate_TN = None
            if self.emit_noop_gates:  # each token's gate on each no-op slot (0 where not chosen, and on pads)
                noop_gate_TN = gate_TK.new_zeros(T, self.num_slots).scatter_add(1, chosen_TK, gate_TK)[:, E:]
                if valid_T is not None:
                    noop_gate_TN = noop_gate_TN * valid_T[:, None]

            cap = self.capacity(T)
            # padding comes only from a mask, no-op choices or capacity drops: without them A == counts_E.sum()
            padded = valid_T is not None or self.cfg.num_noop > 0 or cap is not None
            if padded:
                # Flatten choice-major (all first choices, then all second choices...): that is drop priority.
                slot_A = chosen_TK.t().reshape(-1)
                token_A = torch.arange(T, device=dev).repeat(K)
                valid_A = None if valid_T is None else valid_T[token_A]
                # choices per slot, before capacity (the fused op counts them: the same integers)
                requested_X = fused.count_X if fused is not None else count_per(slot_A, self.num_slots, valid_A)
            else:  # every choice is a computed assignment of a real expert: the counts are the choice counts
                requested_X = fused.count_X if fused is not None else count_per(chosen_TK.reshape(-1), E)
            if self.cfg.bias_balance and self.training and torch.is_grad_enabled():
                self.load_X += requested_X  # eval and no_grad forwards never move the bias

            aux = Aux()
            if fused is not None:
                z_total = self._add_fused_losses(aux, fused, requested_X, valid_T)
            else:  # the unfused path: both are tensors (None only on the fused one)
                probs_TX, balance_probs_TX = cast(Tensor, probs_TX), cast(Tensor, balance_probs_TX)
                z_total = self._add_losses(
                    aux, logits_TX, probs_TX, balance_probs_TX, requested_X, chosen_TK, valid_T, B
                )
            if self.cfg.check_finite:  # on a reduction over every logit the step makes anyway (the z-loss)
                _checks.check_finite_via("TokenChoiceRouter", logits_TX, z_total)

        if padded:
            gate_A = gate_TK.t().reshape(-1)
            # a Tensor: slot_A and valid_A are set above under the same `padded`, which pyright cannot follow (to it
            # they may be unbound, and computed_A a bool)
            computed_A = cast(Tensor, slot_A < E if valid_A is None else valid_A & (slot_A < E))
            if cap is not None:
                computed_A = computed_A & _within_capacity(slot_A, computed_A, E, cap)
            expert_key_A = torch.where(computed_A, slot_A, E)  # E: not computed, sorts after every expert
            token_A, expert_A, gate_A, counts_E, order_A = group_by_expert(
                token_A, expert_key_A, gate_A, E, T, return_order=True
            )
            inv_TK = inverse_of(order_A, T, K, choice_major=True)
        else:
            # One stable sort of the token-major choices (a = t * K + k) by expert: inside an expert the choices
            # stay in token order, the plan's order (group_by_expert's, whose (expert, token) keys are unique)
            expert_A, order_A = torch.sort(chosen_TK.reshape(-1), stable=True)
            token_A = order_A if K == 1 else order_A.div(K, rounding_mode="floor")
            inv_TK = inverse_of(order_A, T, K, choice_major=False)
            gate_A = permute(gate_TK.reshape(-1), order_A, inv_TK.reshape(-1))  # backward: one gather
            counts_E = requested_X

        entropy = None if fused is None else functools.partial(_token_mean, fused.entropy_sum.detach(), T, valid_T)
        aux.stats["router"] = TokenChoiceStats(
            counts_E, requested_X, token_A, expert_A, balance_probs_TX, valid_T, padded, (B, S), entropy=entropy
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
            inv_TK=inv_TK,
        )

    def _add_fused_losses(self, aux: Aux, out: RouterOut, requested_X: Tensor, valid_T: Tensor | None) -> Tensor:
        """The balance and z losses from the fused op's sums (``RouterOut``), bit for bit the values of
        ``_add_losses``. Without a mask or a cross-rank reduction, the objective ``balance_coef * balance + z_coef
        * z_loss`` is one dot product of the sums ``[p_X | z]`` with ``[w_X | z_coef / T]``, ``w_X`` the choice
        counts times ``balance_coef * X / (T^2 K)``, and the raw losses are computed on first read. Returns the
        z-loss sum, NaN or inf whenever a logit is, for the finite check."""
        T, K, X = out.gate_TK.shape[0], self.cfg.top_k, self.num_slots
        c_b, c_z = self.cfg.balance_coef, self.cfg.z_coef
        n = max(1, T) if valid_T is None else valid_T.sum().clamp_min(1)
        if self.cfg.balance_scope == "global" and self.reduce_counts is not None:
            n_1 = out.prob_sum_X.new_full((1,), T) if valid_T is None else valid_T.sum().float()[None]
            counts = self.reduce_counts(torch.cat([requested_X.to(out.prob_sum_X.dtype), n_1]))  # one collective
            aux.add_loss("balance", _balance_from_sums(out.prob_sum_X, requested_X, K, n, global_counts=counts), c_b)
            aux.add_loss("z_loss", out.z_sum / n, c_z)
            return out.z_sum
        if valid_T is not None:  # the masked losses, formed as they are read (n is a device count)
            aux.add_loss("balance", out.balance_loss(n), c_b)
            aux.add_loss("z_loss", out.z_sum / n, c_z)
            return out.z_sum
        n = max(1, T)  # no mask (returned above otherwise): an int, as first set
        total = None
        if c_b or c_z:
            w_X = _counts_times(requested_X, c_b * X / (n * n * K), out.sums_S.dtype)  # no gradient
            w_S = F.pad(w_X, (0, 1), value=c_z / n)  # [w_X | z_coef / T]
            total = torch.dot(out.sums_S[: X + 1], w_S)
        aux.add_weighted(
            total,
            {  # module functions: torch.compile rebuilds their partials
                "balance": (functools.partial(_fused_balance, out.prob_sum_X, requested_X, K, n), c_b),
                "z_loss": (functools.partial(_token_mean, out.z_sum, T, None), c_z),
            },
        )
        return out.z_sum

    def _add_losses(
        self,
        aux: Aux,
        logits_TX: Tensor,
        probs_TX: Tensor,
        balance_probs_TX: Tensor,
        requested_X: Tensor,
        chosen_TK: Tensor,
        valid_T: Tensor | None,
        batch: int,
    ) -> Tensor | None:
        """Put the balance and z losses into ``aux``. Returns a scalar that is NaN or inf whenever a logit is (the
        z-loss, or the objective that holds it), for the finite check; None where none was formed."""
        fast = valid_T is None and (
            self.cfg.balance_scope == "batch" or (self.cfg.balance_scope == "global" and self.reduce_counts is None)
        )
        if fast and logits_TX.numel() and (self.cfg.balance_coef or self.cfg.z_coef):
            total = self._add_weighted(aux, logits_TX, probs_TX, balance_probs_TX, requested_X)
            return total if self.cfg.z_coef else None
        aux.add_loss(
            "balance", self._balance(balance_probs_TX, requested_X, chosen_TK, valid_T, batch), self.cfg.balance_coef
        )
        z_loss = router_z_loss(logits_TX, valid_T)  # a masked token's NaN survives the mask (NaN * 0 is NaN)
        aux.add_loss("z_loss", z_loss, self.cfg.z_coef)
        return z_loss

    def _add_weighted(
        self, aux: Aux, logits_TX: Tensor, probs_TX: Tensor, balance_probs_TX: Tensor, requested_X: Tensor
    ) -> Tensor | None:
        """The router's objective ``balance_coef * balance + z_coef * z_loss`` as one scalar, in a handful of
        operators (no mask, the balance over this forward's tokens). With ``p_X`` the column sums of the
        probabilities and ``n_X`` the choice counts, ``balance = X * sum_x (n_x / (T K)) (p_x / T)`` is one dot
        product ``p_X . n_X`` times a constant, and ``z_loss = sum_t lse_t^2 / T`` one dot product
        ``lse_T . lse_T``. The raw losses (``losses.py``'s formulas, bit for bit) are computed only when read.

        With ``z_coef > 0`` the scalar is also the finite check: a NaN or +inf logit (or a token whose logits
        are all -inf) makes the z term NaN or inf, so ``check_finite`` asserts on the scalar
        (``_checks.check_finite_via``), not on the (T, X) logits. Returns the scalar (None: both coefficients 0)."""
        T, X = probs_TX.shape
        K = self.cfg.top_k
        c_b, c_z = self.cfg.balance_coef, self.cfg.z_coef
        total = None
        if c_b:
            w_X = _counts_times(requested_X, c_b * X / (T * T * K), balance_probs_TX.dtype)  # no gradient
            total = torch.dot(balance_probs_TX.sum(0), w_X)
        lse_T = None
        if c_z:
            lse_T = (
                _logsumexp_from_softmax(logits_TX, probs_TX)
                if self.cfg.gate in ("softmax", "sparsemixer")
                else torch.logsumexp(logits_TX, dim=-1)
            )
            z = torch.dot(lse_T, lse_T)
            total = z * (c_z / T) if total is None else torch.add(total, z, alpha=c_z / T)
        requested = requested_X.detach()
        aux.add_weighted(
            total,
            {
                "balance": (functools.partial(_balance_loss, balance_probs_TX, requested, K, None), c_b),
                "z_loss": (functools.partial(_z_loss, logits_TX, lse_T), c_z),
            },
        )
        return total

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
            1,
            group_TG.topk(cast(int, self.cfg.topk_group), dim=-1).indices,
            True,  # __post_init__: None -> n_group
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


def _counts_times(counts_X: Tensor, scale: float, dtype: torch.dtype) -> Tensor:
    """``counts_X * scale`` in the router's ``dtype``: one operator in float32 (an integer tensor times a Python
    float is float32), a cast first in float64 (a float64 model's exactness runs: float32 would round it)."""
    return counts_X * scale if dtype == torch.float32 else counts_X.to(dtype) * scale


class TokenChoiceStats(RoutingStats):
    """``RoutingStats`` of one token-choice call, each field computed on first read (on the device, no host
    sync) from tensors the router kept: a training step that does not read them launches none of their
    operators. The values are those the fields always had."""

    def __init__(
        self,
        counts_E: Tensor,
        requested_X: Tensor,
        token_A: Tensor,
        expert_A: Tensor,
        probs_TX: Tensor | None,
        valid_T: Tensor | None,
        padded: bool,
        batch_shape: tuple[int, int],
        entropy: Callable[[], Tensor] | None = None,
    ):
        self._counts_E, self._requested_X = counts_E.detach(), requested_X.detach()
        self._token_A, self._expert_A = token_A, expert_A
        self._probs_TX = None if probs_TX is None else probs_TX.detach()
        self._entropy = entropy  # the fused router's entropy from its sum (else computed from probs_TX)
        self._valid_T, self._padded = valid_T, padded
        self.batch_shape = batch_shape

    @functools.cached_property
    def kept_E(self) -> Tensor:
        return self._counts_E.float()

    @functools.cached_property
    def requested_X(self) -> Tensor:
        return self._requested_X.float()

    @functools.cached_property
    def dropped(self) -> Tensor:
        return (self._requested_X[: self.num_experts].sum() - self._counts_E.sum()).float()

    @functools.cached_property
    def noop(self) -> Tensor:
        return self._requested_X[self.num_experts :].sum().float()

    @functools.cached_property
    def tokens(self) -> Tensor:
        T = self.batch_shape[0] * self.batch_shape[1]
        return scalar(T, self._counts_E.device) if self._valid_T is None else self._valid_T.sum().float()

    @functools.cached_property
    def compute_T(self) -> Tensor:
        T, E = self.batch_shape[0] * self.batch_shape[1], self.num_experts
        return count_per(self._token_A, T, self._expert_A < E).float()

    @functools.cached_property
    def entropy(self) -> Tensor:
        if self._entropy is not None:
            return self._entropy()
        return entropy_of(cast(Tensor, self._probs_TX), self._valid_T)  # kept wherever there is no entropy sum

    @property
    def num_experts(self) -> int:
        return self._counts_E.numel()


class _LogSumExp(torch.autograd.Function):
    """``logsumexp(logits_TX, -1)`` whose backward reuses the softmax ``probs_TX`` the router has anyway:
    ``d lse_t / d logit_tx = probs_tx``, one multiply instead of recomputing ``exp(logit - lse)``."""

    @staticmethod
    def forward(ctx, logits_TX: Tensor, probs_TX: Tensor) -> Tensor:
        ctx.save_for_backward(probs_TX)
        return torch.logsumexp(logits_TX, dim=-1)

    @staticmethod
    def backward(ctx, grad_T: Tensor):
        (probs_TX,) = ctx.saved_tensors
        return grad_T[:, None] * probs_TX, None


def _logsumexp_from_softmax(logits_TX: Tensor, probs_TX: Tensor) -> Tensor:
    return _LogSumExp.apply(logits_TX, probs_TX.detach())


def _z_loss(logits_TX: Tensor, lse_T: Tensor | None) -> Tensor:
    """``losses.router_z_loss`` (no mask), from the logsumexp when the router has it: the same value, bit for bit."""
    if lse_T is None:
        return router_z_loss(logits_TX)
    return _masked_mean(lse_T.square(), None)


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


def _token_mean(sum_: Tensor, num_tokens: int, valid_T: Tensor | None) -> Tensor:
    """A sum over the (real) tokens divided by their number, as ``entropy_of`` and ``_masked_mean`` divide."""
    return sum_ / (max(1, num_tokens) if valid_T is None else valid_T.sum().clamp_min(1))


def _fused_balance(prob_sum_X: Tensor, count_X: Tensor, top_k: int, n: int) -> Tensor:
    """``RouterOut.balance_loss(n)``: ``_balance_loss``'s value (scope "batch", no mask) bit for bit."""
    f_X = count_X.to(prob_sum_X.dtype) / (n * top_k)
    return prob_sum_X.shape[0] * (f_X * (prob_sum_X / n)).sum()


def _balance_from_sums(
    prob_sum_X: Tensor, requested_X: Tensor, top_k: int, n: Tensor | int, global_counts: Tensor
) -> Tensor:
    """``_balance_loss`` with global counts, from the fused op's (masked) column sums of the shares: the same
    value bit for bit (``(probs * valid).sum(0)`` is what the op sums)."""
    num_slots = prob_sum_X.shape[-1]
    f_X = global_counts[:num_slots] / (global_counts[num_slots].clamp_min(1) * top_k)
    return num_slots * (f_X * (prob_sum_X / n)).sum()


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

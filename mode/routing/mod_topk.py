"""Mixture-of-Depths top-k router: the top ``C`` tokens of each sequence go through the block.

Shape legend
    B batch   S sequence   D hidden   C = max(1, floor(capacity * S)) routed tokens per sequence
    T = B * S tokens   A = B * C assignments (one expert: the block)

The router weight is the raw linear score ``r = w . x`` (Raposo et al. 2024); the block's delta is
multiplied by it, which is what puts the router on the gradient path. Selection is a per-sequence
top-C, so exactly C tokens are routed even when scores tie; routed tokens are kept in their original
order. Padded positions (``mask == False``) score -inf and are only picked when a sequence has fewer
than C real tokens, in which case the slot is marked invalid and makes no update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from mode import _checks
from mode.routing.plan import Aux, RoutingPlan, RoutingStats

GATES = ("raw", "sigmoid", "one")
SELECTIONS = ("learned", "random")


@dataclass
class MoDRouterConfig:
    d_model: int
    capacity: float = 0.125  # fraction of each sequence routed through the block
    gate: str = "raw"  # "raw": r (paper); "sigmoid": sigmoid(r); "one": 1 (no router gradient; ablations)
    selection: str = "learned"  # "random": uniformly random top-C (the paper's stochastic-routing control)
    check_finite: bool = True

    def __post_init__(self) -> None:
        _checks.check_int("d_model", self.d_model)
        _checks.check_fraction("capacity", self.capacity)
        _checks.check_choice("gate", self.gate, GATES)
        _checks.check_choice("selection", self.selection, SELECTIONS)


class MoDRouter(nn.Module):
    def __init__(self, cfg: MoDRouterConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.d_model))
        nn.init.normal_(self.weight, std=cfg.d_model**-0.5)

    def seq_capacity(self, seq_len: int) -> int:
        return max(1, math.floor(self.cfg.capacity * seq_len))

    def scores(self, x_BSD: Tensor) -> Tensor:
        """Raw router logits ``r_BS = x . w`` in float32."""
        return x_BSD.float() @ self.weight.float()

    def forward(self, x_BSD: Tensor, mask_BS: Tensor | None = None) -> RoutingPlan:
        _checks.check_hidden("x", x_BSD, self.cfg.d_model)
        _checks.check_mask("mask", mask_BS, x_BSD.shape[:2])
        B, S, _ = x_BSD.shape
        C = self.seq_capacity(S)
        r_BS = self.scores(x_BSD)
        if self.cfg.check_finite:
            _checks.check_finite_logits("MoDRouter", r_BS)
        # Random selection draws from the global torch RNG, so seeded runs stay reproducible.
        select_BS = r_BS.detach() if self.cfg.selection == "learned" else torch.rand_like(r_BS)
        if mask_BS is not None:
            select_BS = select_BS.masked_fill(~mask_BS, float("-inf"))
        pos_BC = select_BS.topk(C, dim=1, sorted=False).indices.sort(dim=1).values  # original order
        return self.plan_from_positions(r_BS, pos_BC, mask_BS)

    def plan_from_positions(self, r_BS: Tensor, pos_BC: Tensor, mask_BS: Tensor | None) -> RoutingPlan:
        """Build the plan for routed positions ``pos_BC`` (sorted per row) given router logits."""
        B, S = r_BS.shape
        C = pos_BC.shape[1]
        dev = r_BS.device
        token_A = (pos_BC + torch.arange(B, device=dev)[:, None] * S).reshape(-1)
        r_A = r_BS.gather(1, pos_BC).reshape(-1)
        weight_A = {"raw": r_A, "sigmoid": r_A.sigmoid(), "one": torch.ones_like(r_A)}[self.cfg.gate]
        valid_A = None if mask_BS is None else mask_BS.gather(1, pos_BC).reshape(-1)

        T = B * S
        routed = float(B * C) if valid_A is None else valid_A.sum().float()
        tokens = torch.tensor(float(T), device=dev) if mask_BS is None else mask_BS.sum().float()
        compute_T = torch.zeros(T, device=dev)
        compute_T[token_A] = 1.0 if valid_A is None else valid_A.float()
        routed_t = torch.as_tensor(routed, device=dev)
        aux = Aux()
        aux.stats["router"] = RoutingStats(
            kept_E=routed_t.reshape(1),
            requested_X=torch.stack([routed_t, tokens - routed_t]),  # [block, skip]: skipping is the no-op
            dropped=torch.zeros((), device=dev),
            noop=tokens - routed_t,
            tokens=tokens,
            compute_T=compute_T,
            entropy=None,
            batch_shape=(B, S),
        )
        counts_E = torch.tensor([B * C], device=dev)
        return RoutingPlan(token_idx_A=token_A, expert_idx_A=torch.zeros_like(token_A), weight_A=weight_A,
                           counts_E=counts_E, num_tokens=T, aux=aux, seq_capacity=C, valid_A=valid_A)

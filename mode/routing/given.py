"""The router of an MoE layer whose choices are made elsewhere: each token's top-k experts and their gates come in
from outside (transformers' own Gemma-4 router, which reads another tensor than the experts do), and this builds
the ``RoutingPlan`` the layer's dispatch and experts consume.

Shape legend: T tokens, K choices per token, E experts, A = T * K assignments.

    router = GivenChoices(num_experts=E, top_k=K)
    plan = router.plan(index_TK, weight_TK)        # choice-major, grouped by expert, like TokenChoiceRouter's
    y_BSD, aux = layer.apply_plan(x_BSD, plan)     # MoELayer: local or expert-parallel dispatch

It has no parameters and computes nothing a router would: ``forward`` raises, naming ``plan``. The stats it
reports are the given choices' (no drops, no no-op slots, no entropy: the scores are not seen here).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor, nn

from mode import _checks
from mode.routing.plan import Aux, RoutingPlan, RoutingStats, count_per, group_by_expert, scalar


class GivenChoices(nn.Module):
    def __init__(self, num_experts: int, top_k: int):
        super().__init__()
        _checks.check_int("num_experts", num_experts)
        _checks.check_int("top_k", top_k)
        if top_k > num_experts:
            raise ValueError(f"top_k={top_k}: must be <= num_experts={num_experts}")
        self.num_experts = self.num_slots = num_experts
        self.cfg = SimpleNamespace(top_k=top_k, num_experts=num_experts, num_noop=0)

    def forward(self, x_BSD: Tensor, mask_BS: Tensor | None = None) -> RoutingPlan:
        raise TypeError(
            "GivenChoices: the choices are made elsewhere; build the plan with router.plan(index_TK, weight_TK)"
        )

    def plan(self, index_TK: Tensor, weight_TK: Tensor, batch_shape: tuple[int, int] | None = None) -> RoutingPlan:
        """The plan of ``index_TK`` (T, K) experts with gates ``weight_TK`` (T, K), differentiable in the gates;
        ``batch_shape``: (B, S) with B * S = T, for the per-position stats (default (1, T))."""
        if index_TK.dim() != 2 or index_TK.shape[1] != self.cfg.top_k or index_TK.shape != weight_TK.shape:
            raise ValueError(
                f"index_TK {tuple(index_TK.shape)}, weight_TK {tuple(weight_TK.shape)}: must both be "
                f"(T, top_k={self.cfg.top_k})"
            )
        T, K, E = index_TK.shape[0], self.cfg.top_k, self.num_experts
        dev = index_TK.device
        expert_A = index_TK.t().reshape(-1).long()  # choice-major, as TokenChoiceRouter flattens
        token_A = torch.arange(T, device=dev).repeat(K)
        gate_A = weight_TK.t().reshape(-1).float()
        token_A, expert_A, gate_A, counts_E = group_by_expert(token_A, expert_A, gate_A, E, T)
        aux = Aux()
        aux.stats["router"] = RoutingStats(
            kept_E=counts_E.detach().float(),
            requested_X=counts_E.detach().float(),
            dropped=scalar(0, dev),
            noop=scalar(0, dev),
            tokens=scalar(T, dev),
            compute_T=count_per(token_A, T).float(),
            entropy=None,
            batch_shape=batch_shape or (1, T),
        )
        return RoutingPlan(
            token_idx_A=token_A,
            expert_idx_A=expert_A,
            weight_A=gate_A,
            counts_E=counts_E,
            num_tokens=T,
            aux=aux,
            padded=False,
        )

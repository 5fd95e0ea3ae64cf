"""Local dispatch: gather each assignment's token into expert order, scatter the outputs back.

Shape legend: T tokens, D hidden, A assignments grouped by expert, E experts.

The dispatcher interface (``LocalDispatcher`` here, ``ExpertParallelDispatcher`` across processes):
    dispatch(x_TD, plan) -> (x_RD, counts_R, state)   rows for *this* process's experts, grouped by
                                                       expert, and the row count of each local expert
    combine(y_RD, plan, state) -> y_TD                 weighted sum of each token's expert outputs
    num_local_experts(num_experts) -> int              experts this process's ExpertBank holds
    rows_padded(plan) -> bool                          optional: False when dispatch's rows hold no padding
                                                       (the layer then lets the expert bank skip its masks)
    combine_gated(y_RD, plan, state) -> y_TD           optional: combine rows the expert bank has already
                                                       multiplied by their gates (it picks the cheaper place)
Gates are applied in ``combine``, on the token's own process, so they never travel.
"""

from __future__ import annotations

from torch import Tensor

from mode.routing.plan import RoutingPlan


class LocalDispatcher:
    """All experts live in this process."""

    def num_local_experts(self, num_experts: int) -> int:
        return num_experts

    def rows_padded(self, plan: RoutingPlan) -> bool:
        return plan.padded  # dispatch keeps the plan's rows, padding included

    def dispatch(self, x_TD: Tensor, plan: RoutingPlan) -> tuple[Tensor, Tensor, None]:
        return x_TD.index_select(0, plan.token_idx_A), plan.counts_E, None

    def combine(self, y_AD: Tensor, plan: RoutingPlan, state: None) -> Tensor:
        return scatter_weighted(y_AD, plan)

    def combine_gated(self, y_AD: Tensor, plan: RoutingPlan, state: None) -> Tensor:
        return scatter_rows(y_AD, plan)


def scatter_weighted(y_AD: Tensor, plan: RoutingPlan) -> Tensor:
    """``out[t] = sum_a [token(a) == t] * weight(a) * y[a]``; tokens with no assignment get zeros.

    ``y_AD`` holds the first ``A' <= A`` assignments of the plan: all of them (local: padding rows are
    zeros with weight 0), or only the computed ones (expert-parallel: padding never travels)."""
    n = y_AD.shape[0]
    weighted_AD = y_AD * plan.weight_A[:n].to(y_AD.dtype)[:, None]
    out_TD = y_AD.new_zeros(plan.num_tokens, y_AD.shape[-1])
    return out_TD.index_add_(0, plan.token_idx_A[:n], weighted_AD)  # in place: index_add would copy the zeros


def scatter_rows(y_AD: Tensor, plan: RoutingPlan) -> Tensor:
    """``out[t] = sum_a [token(a) == t] * y[a]``: the combine of rows already multiplied by their gates."""
    out_TD = y_AD.new_zeros(plan.num_tokens, y_AD.shape[-1])
    return out_TD.index_add_(0, plan.token_idx_A[:y_AD.shape[0]], y_AD)  # in place: no copy of the zeros

"""Local dispatch: gather each assignment's token into expert order, scatter the outputs back.

Shape legend: T tokens, D hidden, A assignments grouped by expert, E experts.

The dispatcher interface is ``mode.dispatch.base.Dispatcher``. Here the rows are the plan's assignments in
order, padding included, so the expert bank may apply the gates itself (``gates_in_experts``).

Where the plan carries its inverse index ``inv_TK`` (token choice: K rows per token), the gather and the
(weighted) combine are the fused ops ``mode.kernels.gather_rows`` / ``combine_rows``: one op each way, on the
CPU the very ``index_select`` / ``index_add_`` below (bit for bit), on CUDA a Triton kernel whose combine and
gather-backward sum each token's rows in a fixed order, without atomics. Other plans (expert choice, MoD,
plans made elsewhere) take ``index_select`` / ``index_add_``.
"""

from __future__ import annotations

from torch import Tensor

from mode.dispatch.base import Dispatcher
from mode.kernels.combine import combine_rows, gather_rows
from mode.routing.plan import RoutingPlan


class LocalDispatcher(Dispatcher):
    """The dispatcher of an MoE layer whose experts all live in this process (``MoELayer``'s default).

    Shape legend: T tokens, D hidden, A assignments (the plan's, grouped by expert, padding included).

    ``dispatch`` gathers each assignment's token in the plan's order (``x_AD = x_TD[token_idx_A]``) and
    ``combine`` scatter-adds the gated outputs back to their tokens (``y_TD``; tokens with no assignment get
    zeros). The rows are the plan's own, so the expert bank applies the gates (``gates_in_experts``).
    Takes no arguments.
    """

    gates_in_experts = True  # dispatch keeps the plan's rows in order: combine_gated can scatter gated rows

    def num_local_experts(self, num_experts: int) -> int:
        """``num_experts``: every expert lives in this process."""
        return num_experts

    def rows_padded(self, plan: RoutingPlan) -> bool:
        """``plan.padded``: the rows are the plan's own, padding included."""
        return plan.padded  # dispatch keeps the plan's rows, padding included

    def dispatch(self, x_TD: Tensor, plan: RoutingPlan) -> tuple[Tensor, Tensor, None]:
        """``(x_AD, counts_E, None)``: the token of each assignment in the plan's order (``x_TD[token_idx_A]``, padding
        rows included), the plan's counts, and no state."""
        if plan.inv_TK is not None:
            return gather_rows(x_TD, plan.token_idx_A, plan.inv_TK), plan.counts_E, None
        return x_TD.index_select(0, plan.token_idx_A), plan.counts_E, None

    def combine(self, y_AD: Tensor, plan: RoutingPlan, state: None) -> Tensor:
        """``y_TD``: each row times its gate ``weight_A``, summed into its token (zeros for a token with no row)."""
        return scatter_weighted(y_AD, plan)

    def combine_gated(self, y_AD: Tensor, plan: RoutingPlan, state: None) -> Tensor:
        """``y_TD``: rows the expert bank already multiplied by their gates, summed into their tokens (zeros for a token
        with no row)."""
        return scatter_rows(y_AD, plan)


def scatter_weighted(y_AD: Tensor, plan: RoutingPlan) -> Tensor:
    """``out[t] = sum_a [token(a) == t] * weight(a) * y[a]``; tokens with no assignment get zeros.

    ``y_AD`` holds the first ``A' <= A`` assignments of the plan: all of them (local: padding rows are
    zeros with weight 0), or only the computed ones (expert-parallel: padding never travels)."""
    n = y_AD.shape[0]
    if plan.inv_TK is not None:  # the fused op: the same multiply and index_add_ on the CPU
        all_rows = n == plan.weight_A.shape[0]  # no slice then: its backward would be an operator more
        return combine_rows(
            y_AD,
            plan.weight_A if all_rows else plan.weight_A[:n],
            plan.token_idx_A if all_rows else plan.token_idx_A[:n],
            plan.inv_TK,
        )
    weighted_AD = y_AD * plan.weight_A[:n].to(y_AD.dtype)[:, None]
    out_TD = y_AD.new_zeros(plan.num_tokens, y_AD.shape[-1])
    return out_TD.index_add_(0, plan.token_idx_A[:n], weighted_AD)  # in place: index_add would copy the zeros


def scatter_rows(y_AD: Tensor, plan: RoutingPlan) -> Tensor:
    """``out[t] = sum_a [token(a) == t] * y[a]``: the combine of rows already multiplied by their gates."""
    if plan.inv_TK is not None:
        return combine_rows(y_AD, None, plan.token_idx_A[: y_AD.shape[0]], plan.inv_TK)
    out_TD = y_AD.new_zeros(plan.num_tokens, y_AD.shape[-1])
    return out_TD.index_add_(0, plan.token_idx_A[: y_AD.shape[0]], y_AD)  # in place: no copy of the zeros

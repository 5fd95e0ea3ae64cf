"""The dispatcher interface: what an MoE layer asks of whatever moves its tokens to the experts and back.

Shape legend: T tokens, D hidden, R rows for this process's experts (grouped by expert), E experts.

A dispatcher is handed to ``MoELayer`` (``LocalDispatcher`` by default; ``ExpertParallelDispatcher`` across
processes; an all-gather or DeepEP dispatcher on GPUs would be a third). It implements three methods and
may override two defaults:

    num_local_experts(num_experts) -> int              experts this process's ExpertBank holds
    dispatch(x_TD, plan) -> (x_RD, counts_R, state)    rows for *this* process's experts, grouped by expert,
                                                       the row count of each local expert, and whatever
                                                       ``combine`` needs to send the outputs back
    combine(y_RD, plan, state) -> y_TD                 weighted sum of each token's expert outputs; the
                                                       gates are applied here, on the token's own process,
                                                       so they never travel
    rows_padded(plan) -> bool                          default True: the rows may hold padding (the expert
                                                       bank masks it); False lets the bank skip its masks
    gates_in_experts / combine_gated(y_RD, plan, st)   default off. ``gates_in_experts = True`` says the rows
                                                       ``dispatch`` returns are the plan's own assignments in
                                                       order, so the expert bank may multiply them by their
                                                       gates (where that is cheapest) and the layer calls
                                                       ``combine_gated``, which only sums them per token

The layer reads ``gates_in_experts`` once, when the dispatcher is set. Nothing here imports
``torch.distributed``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from torch import Tensor

from mode.routing.plan import RoutingPlan


class Dispatcher(ABC):
    """The interface of what moves an MoE layer's tokens to its experts and back (subclass it).

    Shape legend: T tokens, D hidden, R rows for this process's experts (grouped by expert), E experts.

    ``num_local_experts(E)``, ``dispatch(x_TD, plan) -> (x_RD, counts_R, state)`` and ``combine(y_RD, plan,
    state) -> y_TD`` must be implemented; ``rows_padded`` and ``gates_in_experts`` / ``combine_gated`` may
    be (the module doc has the contract). ``LocalDispatcher`` keeps every expert in this process,
    ``mode.dispatch.expert_parallel.ExpertParallelDispatcher`` spreads them over a process group.
    """

    gates_in_experts: bool = False  # True: the layer lets the bank apply the gates and calls combine_gated

    @abstractmethod
    def num_local_experts(self, num_experts: int) -> int:
        """How many of the ``num_experts`` experts this process's expert bank holds."""

    @abstractmethod
    def dispatch(self, x_TD: Tensor, plan: RoutingPlan) -> tuple[Tensor, Tensor, object]:
        """``(x_RD, counts_R, state)``: this process's rows grouped by local expert, their counts, the state
        ``combine`` needs."""

    @abstractmethod
    def combine(self, y_RD: Tensor, plan: RoutingPlan, state) -> Tensor:
        """``y_TD``: each token's expert outputs, weighted by their gates and summed (zeros if none)."""

    def rows_padded(self, plan: RoutingPlan) -> bool:
        """Whether ``dispatch``'s rows may hold padding rows (default: yes, the bank masks them)."""
        return True

    def combine_gated(self, y_RD: Tensor, plan: RoutingPlan, state) -> Tensor:
        """Like ``combine``, for rows the expert bank already multiplied by their gates. Only called when
        ``gates_in_experts`` is True."""
        raise NotImplementedError(
            f"{type(self).__name__}.combine_gated: gates_in_experts is False, so the layer never calls it"
        )

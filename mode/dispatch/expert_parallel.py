"""Expert-parallel dispatch: experts sharded across the ranks of a process group, tokens sent by all-to-all.

Shape legend
    T tokens on this rank   D hidden   E experts in all   P ranks in the group   L = E / P local experts
    A this rank's assignments, grouped by expert (the plan's order)
    R rows this rank's experts compute: received from every rank, grouped by local expert

Rank ``p`` of the group owns experts ``[p * L, (p + 1) * L)`` (contiguous shards). Because a plan's
assignments are grouped by expert, they are also grouped by destination rank, so ``dispatch`` is:

    1. exchange per-expert counts: ``all_to_all_single`` of ``counts_E`` viewed as ``(P, L)`` (int64)
    2. ONE host sync: ``.tolist()`` of the send and receive counts, the split sizes of step 4
    3. gather the computed rows ``x_AD = x_TD[token_idx_A[:sent]]`` (plan order: destination-rank-major,
       expert-minor; the plan's padding after them is never sent)
    4. ``all_to_all_single`` of the rows with variable splits (``_AllToAll``: its backward is the
       all-to-all with the splits swapped)
    5. permute the received rows, which arrive source-rank-major, into local-expert-major order

and ``combine`` undoes 5 and 4 (same splits, swapped), then applies the gates and scatter-adds on the
token's own rank. Gates never travel; tokens routed to a no-op expert or dropped by capacity are not
in the plan's assignments, so they never leave their rank. Backward runs the mirrored all-to-alls, so
every rank of the group must call ``backward`` through the layer's output (as data-parallel training does).

Everything the router computes stays per rank: capacity limits and aux losses are over the rank's own
tokens. The router (and every other non-expert parameter) is replicated; its gradient must be
all-reduced by the training loop, like any data-parallel gradient, never inside ``forward``.

``dedup=True`` sends each token once per destination rank instead of once per assignment (DeepSeek-V3's
device-limited routing only saves bytes this way: top-k assignments of one token on the same rank share
its row). Dispatch then also sends, per assignment, the index of its row among the rows sent to that rank
(int64) and its gate (float32, differentiable); the receiving rank gathers each assignment's row from the
received unique rows, and ``combine`` applies the gates there and sums each token's outputs per rank before
sending one row per (token, rank) back. The number of unique rows per destination joins the counts
exchange, so the layer still makes one host sync. With top-1 routing every row is unique: dedup only adds
12 bytes per assignment.

This is the only model-side module that imports ``torch.distributed``; it moves tokens and knows nothing of
layers. Building a rank's shard of a layer or a model is ``mode.parallel.ep_model``'s job.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from mode.dispatch.base import Dispatcher
from mode.dispatch.local import scatter_weighted
from mode.routing.plan import RoutingPlan, count_per


@dataclass(frozen=True)
class ExchangeStats:
    """Rows one all-to-all moved (host ints, read from the split sizes: no extra sync).

    ``sent_rows`` went to other ranks, ``local_rows`` stayed on this rank (the all-to-all copies them
    locally, they never touch the network), ``received_rows`` came from other ranks.
    """

    sent_rows: int
    local_rows: int
    received_rows: int
    row_bytes: int  # D * element size

    @property
    def sent_bytes(self) -> int:
        return self.sent_rows * self.row_bytes

    @property
    def local_bytes(self) -> int:
        return self.local_rows * self.row_bytes

    @property
    def received_bytes(self) -> int:
        return self.received_rows * self.row_bytes


@dataclass
class _EPState:
    send_splits: list[int]  # rows this rank sends to each rank (dispatch)
    recv_splits: list[int]  # rows this rank receives from each rank (dispatch)
    order_R: Tensor | None  # received row -> local-expert-major row; None when L == 1 (already ordered)
    # dedup only: the received unique row of each local assignment, its gate, and the tokens of the sent rows
    row_R: Tensor | None = None
    gate_R: Tensor | None = None
    token_U: Tensor | None = None


class _AllToAll(torch.autograd.Function):
    """Differentiable variable-split ``dist.all_to_all_single`` over dim 0.

    ``torch.distributed._functional_collectives.all_to_all_single_autograd`` computes the same thing,
    but its first call costs seconds of one-time set-up per process on CPU; this plain wrapper does
    not. Uneven splits work on gloo with ``all_to_all_single`` (the list form ``all_to_all`` does not).
    """

    @staticmethod
    def forward(ctx, x_ND: Tensor, out_splits: list[int], in_splits: list[int], group) -> Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out_MD = x_ND.new_empty(sum(out_splits), *x_ND.shape[1:])
        dist.all_to_all_single(out_MD, x_ND.contiguous(), out_splits, in_splits, group=group)
        return out_MD

    @staticmethod
    def backward(ctx, grad_MD: Tensor):
        out_splits, in_splits = ctx.splits
        grad_ND = grad_MD.new_empty(sum(in_splits), *grad_MD.shape[1:])
        dist.all_to_all_single(grad_ND, grad_MD.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad_ND, None, None, None


def all_to_all_rows(x_ND: Tensor, out_splits: list[int], in_splits: list[int], group) -> Tensor:
    """Send ``in_splits[p]`` consecutive rows of ``x_ND`` to rank p, receive ``out_splits[p]`` from it."""
    return _AllToAll.apply(x_ND, out_splits, in_splits, group)


def _exchange_stats(send: list[int], recv: list[int], rank: int, row_bytes: int) -> ExchangeStats:
    return ExchangeStats(
        sent_rows=sum(send) - send[rank],
        local_rows=send[rank],
        received_rows=sum(recv) - recv[rank],
        row_bytes=row_bytes,
    )


class ExpertParallelDispatcher(Dispatcher):
    """Dispatcher for experts sharded contiguously over ``group`` (a process group built by the caller).

    ``last_dispatch`` / ``last_combine`` hold the :class:`ExchangeStats` of the latest forward
    all-to-alls (for benchmarks; backward moves the same rows the other way).
    """

    def __init__(self, group: dist.ProcessGroup | None, num_experts: int, dedup: bool = False):
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "group: torch.distributed must be initialised (init_process_group) before "
                "building an ExpertParallelDispatcher"
            )
        self.group = group if group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        if self.rank < 0:
            raise ValueError(f"group: this process (global rank {dist.get_rank()}) is not a member of it")
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"num_experts={num_experts!r}: must be an int >= 1")
        if num_experts % self.world_size:
            raise ValueError(
                f"num_experts={num_experts}: must be divisible by the expert-parallel group size "
                f"{self.world_size} (each rank holds num_experts / group size experts)"
            )
        self.num_experts = num_experts
        self.local_experts = num_experts // self.world_size
        self.first_expert = self.rank * self.local_experts
        if not isinstance(dedup, bool):
            raise TypeError(f"dedup={dedup!r}: must be a bool")
        self.dedup = dedup  # chosen once: one row per (token, destination rank), or one per assignment
        # Chosen once: with one expert per rank, source-major order already is expert-major.
        self._needs_permute = self.local_experts > 1
        self.last_dispatch: ExchangeStats | None = None
        self.last_combine: ExchangeStats | None = None

    # -- the interface MoELayer uses -------------------------------------------------------------------

    def num_local_experts(self, num_experts: int) -> int:
        """Experts this rank's ExpertBank must hold for a router over ``num_experts`` experts."""
        if num_experts != self.num_experts:
            raise ValueError(
                f"router.num_experts={num_experts}: must equal the expert-parallel dispatcher's "
                f"num_experts={self.num_experts}"
            )
        return self.local_experts

    def dispatch(self, x_TD: Tensor, plan: RoutingPlan) -> tuple[Tensor, Tensor, _EPState]:
        if plan.num_experts != self.num_experts:
            raise ValueError(
                f"plan.num_experts={plan.num_experts}: must equal the dispatcher's num_experts={self.num_experts}"
            )
        if self.dedup:
            return self._dispatch_unique(x_TD, plan)
        P, L = self.world_size, self.local_experts

        # Counts first: recv_counts_PL[p, l] = rows rank p sends to our local expert l.
        send_counts_PL = plan.counts_E.to(torch.int64).reshape(P, L)
        recv_counts_PL = torch.empty_like(send_counts_PL)
        dist.all_to_all_single(recv_counts_PL, send_counts_PL, group=self.group)
        # The one host sync of the layer: the all-to-all below needs its split sizes on the host.
        splits = torch.cat([send_counts_PL.sum(1), recv_counts_PL.sum(1)]).tolist()
        send_splits, recv_splits = splits[:P], splits[P:]
        # The computed assignments come first in the plan, grouped by expert, hence by destination rank.
        x_AD = x_TD.index_select(0, plan.token_idx_A[: sum(send_splits)])

        x_recv_RD = all_to_all_rows(x_AD, recv_splits, send_splits, self.group)

        order_R = self._expert_major_order(recv_counts_PL, sum(recv_splits))
        x_RD = x_recv_RD if order_R is None else x_recv_RD.index_select(0, order_R)
        counts_L = recv_counts_PL.sum(0)

        row_bytes = x_TD.shape[-1] * x_TD.element_size()
        self.last_dispatch = _exchange_stats(send_splits, recv_splits, self.rank, row_bytes)
        return x_RD, counts_L, _EPState(send_splits, recv_splits, order_R)

    def _expert_major_order(self, recv_counts_PL: Tensor, received: int) -> Tensor | None:
        """The permutation that takes received rows (source-major, each source's rows grouped by local
        expert) to local-expert-major order, keeping source order inside an expert; None with one local
        expert (already in order). ``received``: the row count, known on the host (no second sync)."""
        if not self._needs_permute:
            return None
        P, L = recv_counts_PL.shape
        expert_of_row_R = torch.repeat_interleave(
            torch.arange(L, device=recv_counts_PL.device).repeat(P), recv_counts_PL.reshape(-1), output_size=received
        )
        return torch.argsort(expert_of_row_R, stable=True)

    def combine(self, y_RD: Tensor, plan: RoutingPlan, state: _EPState) -> Tensor:
        if self.dedup:
            return self._combine_unique(y_RD, plan, state)
        y_recv_RD = y_RD
        if state.order_R is not None:
            inverse_R = torch.empty_like(state.order_R)
            inverse_R[state.order_R] = torch.arange(state.order_R.numel(), device=state.order_R.device)
            y_recv_RD = y_RD.index_select(0, inverse_R)  # back to source-major order
        y_AD = all_to_all_rows(y_recv_RD, state.send_splits, state.recv_splits, self.group)
        self.last_combine = _exchange_stats(
            state.recv_splits, state.send_splits, self.rank, y_RD.shape[-1] * y_RD.element_size()
        )
        return scatter_weighted(y_AD, plan)  # gates applied on the token's own rank; padding got no rows

    # -- one row per (token, destination rank) ------------------------------------------------------------

    def _dispatch_unique(self, x_TD: Tensor, plan: RoutingPlan) -> tuple[Tensor, Tensor, _EPState]:
        """Shape legend here: A plan assignments (computed first), U unique (destination, token) rows this
        rank sends, V unique rows it receives, R assignments its experts compute (local-expert-major)."""
        P, L, T = self.world_size, self.local_experts, plan.num_tokens
        dev = x_TD.device
        A = plan.num_assignments
        computed_A = plan.computed_A()
        dest_A = torch.where(computed_A, plan.expert_idx_A // L, P)  # padding: a rank after every real one
        key_A = dest_A * T + plan.token_idx_A
        order_A = torch.argsort(key_A, stable=True)
        key_sorted_A = key_A[order_A]
        first_A = torch.ones(A, dtype=torch.bool, device=dev)
        first_A[1:] = key_sorted_A[1:] != key_sorted_A[:-1]
        unique_sorted_A = torch.cumsum(first_A.long(), 0) - 1  # the unique row of each sorted assignment
        unique_A = torch.empty_like(unique_sorted_A)
        unique_A[order_A] = unique_sorted_A
        # per destination: unique rows, then where each destination's rows start
        rows_P = count_per(dest_A[order_A], P + 1, first_A)[:P]
        start_P = torch.cumsum(rows_P, 0) - rows_P
        send_counts_PL = plan.counts_E.to(torch.int64).reshape(P, L)
        send_PL1 = torch.cat([send_counts_PL, rows_P[:, None]], dim=1)  # assignment counts + unique rows
        recv_PL1 = torch.empty_like(send_PL1)
        dist.all_to_all_single(recv_PL1, send_PL1, group=self.group)
        recv_counts_PL = recv_PL1[:, :L]
        # The one host sync of the layer: every split size below, read at once.
        sizes = torch.cat([send_counts_PL.sum(1), recv_counts_PL.sum(1), rows_P, recv_PL1[:, L]]).tolist()
        send_splits, recv_splits = sizes[:P], sizes[P : 2 * P]
        send_rows, recv_rows = sizes[2 * P : 3 * P], sizes[3 * P :]
        n_sent, n_unique = sum(send_splits), sum(send_rows)

        token_U = torch.zeros(A, dtype=plan.token_idx_A.dtype, device=dev).index_put_((unique_A,), plan.token_idx_A)[
            :n_unique
        ]  # duplicates write the same token
        x_recv_VD = all_to_all_rows(x_TD.index_select(0, token_U), recv_rows, send_rows, self.group)
        # per computed assignment (plan order: destination-major): its row among those sent to its rank
        within_A = (unique_A - start_P[dest_A.clamp_max(P - 1)])[:n_sent]
        within_recv_R = torch.empty(sum(recv_splits), dtype=within_A.dtype, device=dev)
        dist.all_to_all_single(within_recv_R, within_A.contiguous(), recv_splits, send_splits, group=self.group)
        gate_recv_R = all_to_all_rows(plan.weight_A[:n_sent], recv_splits, send_splits, self.group)
        # the received assignments, source-major: offset each source's indices by where its rows start
        recv_rows_P = recv_PL1[:, L]
        source_R = torch.repeat_interleave(
            torch.arange(P, device=dev), recv_counts_PL.sum(1), output_size=sum(recv_splits)
        )
        row_R = within_recv_R + (torch.cumsum(recv_rows_P, 0) - recv_rows_P)[source_R]
        order_R = self._expert_major_order(recv_counts_PL, sum(recv_splits))
        if order_R is not None:
            row_R, gate_recv_R = row_R.index_select(0, order_R), gate_recv_R.index_select(0, order_R)
        x_RD = x_recv_VD.index_select(0, row_R)

        row_bytes = x_TD.shape[-1] * x_TD.element_size()
        self.last_dispatch = _exchange_stats(send_rows, recv_rows, self.rank, row_bytes)
        state = _EPState(send_rows, recv_rows, order_R, row_R=row_R, gate_R=gate_recv_R, token_U=token_U)
        return x_RD, recv_counts_PL.sum(0), state

    def _combine_unique(self, y_RD: Tensor, plan: RoutingPlan, state: _EPState) -> Tensor:
        """Gates applied here, each token's outputs summed per received row, one row per (token, rank) back."""
        assert state.gate_R is not None, "_combine_unique: the dedup dispatch keeps the received gates"
        assert state.row_R is not None and state.token_U is not None, "_combine_unique: and the rows and tokens"
        weighted_RD = y_RD * state.gate_R.to(y_RD.dtype)[:, None]
        y_recv_VD = weighted_RD.new_zeros(sum(state.recv_splits), y_RD.shape[-1]).index_add(0, state.row_R, weighted_RD)
        y_UD = all_to_all_rows(y_recv_VD, state.send_splits, state.recv_splits, self.group)
        self.last_combine = _exchange_stats(
            state.recv_splits, state.send_splits, self.rank, y_RD.shape[-1] * y_RD.element_size()
        )
        return y_UD.new_zeros(plan.num_tokens, y_UD.shape[-1]).index_add_(0, state.token_U, y_UD)

    @property
    def last_sent_bytes(self) -> int:
        """Bytes the latest dispatch sent to other ranks (0 before the first call)."""
        return 0 if self.last_dispatch is None else self.last_dispatch.sent_bytes

"""The token-choice router's row math as one op: scores, top-k, renormalisation, and the aux-loss sums.

Shape legend: T tokens, X expert slots, K top-k, S = X + 2 (the sums vector below).

For float32 logits ``l_TX`` (after the router's linear layer and any softcap) and an optional mask ``valid_T``
(v_t = 1 for a real token, 0 for padding; all 1 without a mask):

    score_TX   softmax(l) (gate="softmax") or sigmoid(l) (gate="sigmoid")
    share_TX   the balance loss's distribution: softmax(l), or score / score.sum(-1) for the sigmoid
    chosen_TK  the K largest scores' slots (torch.topk of the scores; the Triton kernel takes the K largest
               logits, the same slots unless two scores round to the same float)
    gate_TK    the scores there, divided by their sum (``renormalize``), times ``scale``
    sums_S     [ sum_t v_t share_tx  (X entries) | sum_t v_t lse_t^2 | sum_t v_t entropy(share_t) ]
    count_X    sum_t v_t [x in chosen_t]  (int64: the choices per slot, before any capacity)

which are what ``TokenChoiceRouter`` (mode/routing/token_choice.py) computes on these paths, bit for bit on
the CPU (the reference runs the same torch ops): with n = sum_t v_t (at least 1),
    balance loss  X * sum_x (count_X[x] / (n K)) * (sums_S[x] / n)   (losses._balance_loss, scope "batch")
    z-loss        sums_S[X] / n                                      (losses.router_z_loss)
    entropy stat  sums_S[X + 1] / n                                  (plan.entropy_of; carries no gradient)

Backward (``mode_kernels::router_backward``): the gradient w.r.t. the logits of gate_TK and of the first X + 1
sums (the entropy sum is a statistic, treated as constant, as the router detaches it):

    dw = dgate * scale;  renormalised: dg = (dw - sum_k dw_k w_k) / sum_k g_k, else dg = dw
    dscore_TX = dg scattered to the chosen slots
    softmax: dp = dscore + v dsums[:X];  dl = p (dp - sum_x dp p)
    sigmoid: dscore += (dq - sum_x dq q) / sum_x s  with dq = v dsums[:X], q = share;  dl = dscore s (1 - s)
    both:    dl += 2 dsums[X] v lse p                                   (p = softmax(l))

Kernels: the torch reference below (CPU, and the default; the backward is this formula in torch ops, not
autograd) and on CUDA, where triton is installed and X <= 256, the Triton kernels of ``router_triton.py``:
one launch and two small sums forward, one launch backward, against ~25 torch ops forward and as many
backward on the router's path. Not supported here (the router keeps its own path): sqrtsoftplus and
sparsemixer gates, hash routing, bias balancing, group-limited choice, renorm_eps/min/p, per-sequence or
global balance scope, no-op gates. The op expects finite logits (the router checks them first).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from mode.kernels import _triton

GATES = ("softmax", "sigmoid")


class RouterOut(NamedTuple):
    gate_TK: Tensor
    chosen_TK: Tensor
    prob_sum_X: Tensor  # sum_t v_t share_tx (differentiable)
    z_sum: Tensor  # sum_t v_t lse_t^2, 0-dim (differentiable)
    entropy_sum: Tensor  # sum_t v_t entropy(share_t), 0-dim (no gradient)
    count_X: Tensor  # int64
    sums_S: Tensor  # [prob_sum_X | z_sum | entropy_sum]: the op's output, of which the three above are views

    def balance_loss(self, num_tokens: Tensor | int) -> Tensor:
        """The Switch balance loss over ``num_tokens`` real tokens (as ``_balance_loss``, scope "batch")."""
        X, K = self.prob_sum_X.shape[0], self.gate_TK.shape[1]
        f_X = self.count_X.to(self.prob_sum_X.dtype) / (num_tokens * K)
        return X * (f_X * (self.prob_sum_X / num_tokens)).sum()


# -- the torch reference (the CPU kernel, and the default) ---------------------------------------------------


def router_reference(
    logits_TX: Tensor, valid_T: Optional[Tensor], k: int, gate: str, renormalize: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(gate_TK, chosen_TK, sums_S, count_X): the ops of TokenChoiceRouter.forward on these paths."""
    T, X = logits_TX.shape
    if gate == "softmax":
        probs_TX = logits_TX.softmax(-1)
        share_TX = probs_TX
    else:
        probs_TX = logits_TX.sigmoid()
        share_TX = probs_TX / probs_TX.sum(-1, keepdim=True)
    gate_TK, chosen_TK = probs_TX.topk(k, dim=-1)
    if renormalize:
        gate_TK = gate_TK / gate_TK.sum(-1, keepdim=True)
    if scale != 1.0:
        gate_TK = gate_TK * scale
    lse_sq_T = torch.logsumexp(logits_TX, dim=-1).square()
    ent_T = -torch.special.xlogy(share_TX, share_TX).sum(-1)
    if valid_T is None:
        picks_TK = torch.ones_like(chosen_TK)
        prob_sum_X, z_sum, ent_sum = share_TX.sum(0), lse_sq_T.sum(), ent_T.sum()
    else:
        picks_TK = valid_T[:, None].expand(T, k).to(torch.int64)
        prob_sum_X = (share_TX * valid_T[:, None]).sum(0)
        z_sum, ent_sum = (lse_sq_T * valid_T).sum(), (ent_T * valid_T).sum()
    count_X = torch.zeros(X, dtype=torch.int64, device=logits_TX.device).index_add_(
        0, chosen_TK.reshape(-1), picks_TK.reshape(-1)
    )
    sums_S = torch.cat([prob_sum_X, z_sum[None], ent_sum[None]])
    return gate_TK, chosen_TK, sums_S, count_X


def router_backward_reference(
    dgate_TK: Tensor,
    dsums_S: Tensor,
    logits_TX: Tensor,
    valid_T: Optional[Tensor],
    chosen_TK: Tensor,
    k: int,
    gate: str,
    renormalize: bool,
    scale: float,
) -> Tensor:
    """d logits_TX, by the formula in the module docstring (torch ops, no autograd)."""
    X = logits_TX.shape[1]
    v_T1 = logits_TX.new_ones(logits_TX.shape[0], 1) if valid_T is None else valid_T[:, None].to(logits_TX.dtype)
    prob_TX = logits_TX.softmax(-1)
    score_TX = prob_TX if gate == "softmax" else logits_TX.sigmoid()
    dw_TK = dgate_TK * scale
    if renormalize:
        g_TK = score_TX.gather(1, chosen_TK)
        g_sum_T1 = g_TK.sum(-1, keepdim=True)
        w_TK = g_TK / g_sum_T1
        dg_TK = (dw_TK - (dw_TK * w_TK).sum(-1, keepdim=True)) / g_sum_T1
    else:
        dg_TK = dw_TK
    dscore_TX = torch.zeros_like(logits_TX).scatter_add_(1, chosen_TK, dg_TK)
    dshare_TX = v_T1 * dsums_S[:X]
    if gate == "softmax":
        dprob_TX = dscore_TX + dshare_TX
        dlogits_TX = prob_TX * (dprob_TX - (dprob_TX * prob_TX).sum(-1, keepdim=True))
    else:
        score_sum_T1 = score_TX.sum(-1, keepdim=True)
        share_TX = score_TX / score_sum_T1
        dscore_TX = dscore_TX + (dshare_TX - (dshare_TX * share_TX).sum(-1, keepdim=True)) / score_sum_T1
        dlogits_TX = dscore_TX * score_TX * (1 - score_TX)
    lse_T1 = torch.logsumexp(logits_TX, dim=-1, keepdim=True)
    return dlogits_TX + (2 * dsums_S[X]) * v_T1 * lse_T1 * prob_TX


# -- the Triton kernels, launched directly (the CUDA ops call these; tests call them on CPU tensors) -----------


def router_triton(
    logits_TX: Tensor, valid_T: Optional[Tensor], k: int, gate: str, renormalize: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    _triton.check_launchable("router_triton", logits_TX, valid_T)
    from mode.kernels import router_triton as kernels

    return kernels.forward(logits_TX, valid_T, k, gate, renormalize, scale)


def router_backward_triton(
    dgate_TK: Tensor,
    dsums_S: Tensor,
    logits_TX: Tensor,
    valid_T: Optional[Tensor],
    chosen_TK: Tensor,
    k: int,
    gate: str,
    renormalize: bool,
    scale: float,
) -> Tensor:
    _triton.check_launchable("router_backward_triton", dgate_TK, dsums_S, logits_TX, valid_T, chosen_TK)
    from mode.kernels import router_triton as kernels

    return kernels.backward(dgate_TK, dsums_S, logits_TX, valid_T, chosen_TK, k, gate, renormalize, scale)


# -- the ops ----------------------------------------------------------------------------------------------


@torch.library.custom_op("mode_kernels::router", mutates_args=())
def _router_op(
    logits_TX: Tensor, valid_T: Optional[Tensor], k: int, gate: str, renormalize: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return router_reference(logits_TX, valid_T, k, gate, renormalize, scale)


@_router_op.register_fake
def _(logits_TX, valid_T, k, gate, renormalize, scale):
    T, X = logits_TX.shape
    return (
        logits_TX.new_empty(T, k),
        logits_TX.new_empty(T, k, dtype=torch.int64),
        logits_TX.new_empty(X + 2),
        logits_TX.new_empty(X, dtype=torch.int64),
    )


@torch.library.custom_op("mode_kernels::router_backward", mutates_args=())
def _router_backward_op(
    dgate_TK: Tensor,
    dsums_S: Tensor,
    logits_TX: Tensor,
    valid_T: Optional[Tensor],
    chosen_TK: Tensor,
    k: int,
    gate: str,
    renormalize: bool,
    scale: float,
) -> Tensor:
    return router_backward_reference(dgate_TK, dsums_S, logits_TX, valid_T, chosen_TK, k, gate, renormalize, scale)


@_router_backward_op.register_fake
def _(dgate_TK, dsums_S, logits_TX, valid_T, chosen_TK, k, gate, renormalize, scale):
    return torch.empty_like(logits_TX)


def _setup(ctx, inputs, output) -> None:
    logits_TX, valid_T, k, gate, renormalize, scale = inputs
    _, chosen_TK, _, count_X = output
    ctx.mark_non_differentiable(chosen_TK, count_X)
    ctx.set_materialize_grads(False)
    ctx.options = (k, gate, renormalize, scale)
    ctx.save_for_backward(logits_TX, valid_T, chosen_TK)


def _backward(ctx, dgate_TK, _dchosen, dsums_S, _dcount):
    logits_TX, valid_T, chosen_TK = ctx.saved_tensors
    if dgate_TK is None and dsums_S is None:
        return None, None, None, None, None, None
    T, X = logits_TX.shape
    if dgate_TK is None:
        dgate_TK = logits_TX.new_zeros(T, ctx.options[0])
    if dsums_S is None:
        dsums_S = logits_TX.new_zeros(X + 2)
    dlogits_TX = _router_backward_op(dgate_TK, dsums_S, logits_TX, valid_T, chosen_TK, *ctx.options)
    return dlogits_TX, None, None, None, None, None


_router_op.register_autograd(_backward, setup_context=_setup)

if _triton.available():  # the CUDA kernels (triton itself is imported on the first launch)

    @_router_op.register_kernel("cuda")
    def _(logits_TX, valid_T, k, gate, renormalize, scale):
        if logits_TX.dtype != torch.float32 or logits_TX.shape[1] > 256:
            return router_reference(logits_TX, valid_T, k, gate, renormalize, scale)
        return router_triton(logits_TX, valid_T, k, gate, renormalize, scale)

    @_router_backward_op.register_kernel("cuda")
    def _(dgate_TK, dsums_S, logits_TX, valid_T, chosen_TK, k, gate, renormalize, scale):
        if logits_TX.dtype != torch.float32 or logits_TX.shape[1] > 256:
            return router_backward_reference(
                dgate_TK, dsums_S, logits_TX, valid_T, chosen_TK, k, gate, renormalize, scale
            )
        return router_backward_triton(dgate_TK, dsums_S, logits_TX, valid_T, chosen_TK, k, gate, renormalize, scale)


def router_topk(
    logits_TX: Tensor,
    k: int,
    *,
    gate: str = "softmax",
    renormalize: bool = False,
    scale: float = 1.0,
    valid_T: Tensor | None = None,
) -> RouterOut:
    """The fused router math on float32 logits (``mode_kernels::router``); see the module docstring. float64
    logits (a float64 model's exactness runs) take the torch reference on every device."""
    if (
        not isinstance(logits_TX, Tensor)
        or logits_TX.dtype not in (torch.float32, torch.float64)
        or logits_TX.dim() != 2
    ):
        raise TypeError(
            f"logits_TX: must be a 2-D float32 (or float64) tensor, got "
            f"{getattr(logits_TX, 'dtype', type(logits_TX))} {tuple(getattr(logits_TX, 'shape', ()))}"
        )
    X = logits_TX.shape[1]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= X:
        raise ValueError(f"k={k!r}: must be an int in [1, X={X}]")
    if gate not in GATES:
        raise ValueError(f"gate={gate!r}: must be one of {GATES}")
    if not isinstance(renormalize, bool):
        raise TypeError(f"renormalize={renormalize!r}: must be a bool")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale={scale!r}: must be a float > 0")
    if valid_T is not None:
        if (
            not isinstance(valid_T, Tensor)
            or valid_T.dtype != torch.bool
            or tuple(valid_T.shape) != (logits_TX.shape[0],)
        ):
            raise ValueError(
                f"valid_T: must be a bool tensor of shape (T,)=({logits_TX.shape[0]},), got "
                f"{getattr(valid_T, 'dtype', type(valid_T))} {tuple(getattr(valid_T, 'shape', ()))}"
            )
    gate_TK, chosen_TK, sums_S, count_X = _router_op(logits_TX, valid_T, k, gate, renormalize, float(scale))
    return RouterOut(gate_TK, chosen_TK, sums_S[:X], sums_S[X], sums_S[X + 1], count_X, sums_S)

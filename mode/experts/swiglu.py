"""SwiGLU on the fused gate+up projection, with a backward that writes one gradient buffer.

Shape legend: A rows, H expert hidden size, F = 2H (gate half first, then up half).

``swiglu(h_AF) = silu(h_AF[:, :H]) * h_AF[:, H:]``, the same function as ``activate(h, "swiglu")`` in
bank.py, bit for bit (the forward runs the same two ops). What differs is the backward. Autograd through
``chunk -> silu -> mul`` allocates three (A, H) gradients and then ``cat``s two of them into the (A, F)
gradient of h: four allocations and two passes over (A, F) more than needed. Here the backward
allocates the (A, F) gradient once and writes both halves in place:

    dh[:, H:] = dact * silu(gate)                      (silu(gate) saved by the forward)
    dh[:, :H] = silu_backward(dact * up, gate)          (the product written into dh, then updated in place)

The gradient values are bit-identical to autograd's (same ops, same order, per element). The pair is
wrapped in custom ops (``mode::swiglu``, ``mode::swiglu_backward``) so that ``torch.compile`` treats them as
opaque calls (as it does ``mode::grouped_mm``) and the ``out=`` writes never reach its tracer.

``swiglu(h_AF, gate_A)`` also multiplies each row by its routing gate (``mode::gated_swiglu``), cast to h's
dtype inside the op (its gradient comes back in the gate's dtype; no separate cast and its backward): the
expert bank applies the gates there, on (A, H), when that is smaller than its (A, D) output (bank.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


@torch.library.custom_op("mode::swiglu", mutates_args=())
def _swiglu_op(h_AF: Tensor) -> tuple[Tensor, Tensor]:
    gate_AH, up_AH = h_AF.chunk(2, dim=-1)
    silu_AH = F.silu(gate_AH)
    return silu_AH * up_AH, silu_AH  # the second output is saved for backward, never differentiated


@_swiglu_op.register_fake
def _(h_AF: Tensor) -> tuple[Tensor, Tensor]:
    shape = (h_AF.shape[0], h_AF.shape[1] // 2)
    return h_AF.new_empty(shape), h_AF.new_empty(shape)


@torch.library.custom_op("mode::swiglu_backward", mutates_args=())
def _swiglu_backward_op(dact_AH: Tensor, h_AF: Tensor, silu_AH: Tensor) -> Tensor:
    gate_AH, up_AH = h_AF.chunk(2, dim=-1)
    H = gate_AH.shape[1]
    dh_AF = torch.empty_like(h_AF, memory_format=torch.contiguous_format)
    dgate_AH, dup_AH = dh_AF[:, :H], dh_AF[:, H:]
    torch.mul(dact_AH, silu_AH, out=dup_AH)
    torch.mul(dact_AH, up_AH, out=dgate_AH)
    # in place (output and grad_output are the same memory, element for element): no temporary
    torch.ops.aten.silu_backward.grad_input(dgate_AH, gate_AH, grad_input=dgate_AH)
    return dh_AF


@_swiglu_backward_op.register_fake
def _(dact_AH: Tensor, h_AF: Tensor, silu_AH: Tensor) -> Tensor:
    return torch.empty_like(h_AF, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output) -> None:
    (h_AF,) = inputs
    _, silu_AH = output
    ctx.mark_non_differentiable(silu_AH)
    ctx.set_materialize_grads(False)  # no zero-filled (A, H) gradient for the saved second output
    ctx.save_for_backward(h_AF, silu_AH)


def _backward(ctx, dact_AH: Tensor, _dsilu: Tensor | None):
    h_AF, silu_AH = ctx.saved_tensors
    return _swiglu_backward_op(dact_AH.contiguous(), h_AF, silu_AH)


_swiglu_op.register_autograd(_backward, setup_context=_setup)


# -- the same, each row multiplied by its routing gate (the expert bank's gated path, see bank.py) --------


@torch.library.custom_op("mode::gated_swiglu", mutates_args=())
def _gated_swiglu_op(h_AF: Tensor, gate_A: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    gate_AH, up_AH = h_AF.chunk(2, dim=-1)
    silu_AH = F.silu(gate_AH)
    act_AH = silu_AH * up_AH
    # the gate in h's dtype (cast here, not by the caller: one operator, as a fused kernel would take it)
    return act_AH * gate_A.to(act_AH.dtype)[:, None], silu_AH, act_AH  # the last two are saved for backward only


@_gated_swiglu_op.register_fake
def _(h_AF: Tensor, gate_A: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    shape = (h_AF.shape[0], h_AF.shape[1] // 2)
    return h_AF.new_empty(shape), h_AF.new_empty(shape), h_AF.new_empty(shape)


@torch.library.custom_op("mode::gated_swiglu_backward", mutates_args=())
def _gated_swiglu_backward_op(
    dout_AH: Tensor, h_AF: Tensor, silu_AH: Tensor, act_AH: Tensor, gate_A: Tensor
) -> tuple[Tensor, Tensor]:
    # the gradients of out = act * gate[:, None], as autograd's mul computes them
    dgate_A = (dout_AH * act_AH).sum(-1).to(gate_A.dtype)
    dact_AH = dout_AH * gate_A.to(dout_AH.dtype)[:, None]
    return _swiglu_backward_op(dact_AH, h_AF, silu_AH), dgate_A


@_gated_swiglu_backward_op.register_fake
def _(dout_AH: Tensor, h_AF: Tensor, silu_AH: Tensor, act_AH: Tensor, gate_A: Tensor) -> tuple[Tensor, Tensor]:
    return torch.empty_like(h_AF, memory_format=torch.contiguous_format), gate_A.new_empty(gate_A.shape)


def _gated_setup(ctx, inputs, output) -> None:
    h_AF, gate_A = inputs
    _, silu_AH, act_AH = output
    ctx.mark_non_differentiable(silu_AH, act_AH)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(h_AF, silu_AH, act_AH, gate_A)


def _gated_backward(ctx, dout_AH: Tensor, _dsilu: Tensor | None, _dact: Tensor | None):
    h_AF, silu_AH, act_AH, gate_A = ctx.saved_tensors
    dh_AF, dgate_A = _gated_swiglu_backward_op(dout_AH.contiguous(), h_AF, silu_AH, act_AH, gate_A)
    return dh_AF, dgate_A


_gated_swiglu_op.register_autograd(_gated_backward, setup_context=_gated_setup)


def swiglu(h_AF: Tensor, gate_A: Tensor | None = None) -> Tensor:
    """``silu(gate) * up`` of the fused (A, 2H) projection, as (A, H); with ``gate_A`` (A,), each row also
    multiplied by its gate (in h's dtype), the same values as ``activate(h, "swiglu") * gate_A[:, None]``."""
    if h_AF.dim() != 2 or h_AF.shape[1] % 2:
        raise ValueError(f"h_AF.shape={tuple(h_AF.shape)}: must be (A, 2 * d_hidden)")
    if gate_A is None:
        return _swiglu_op(h_AF)[0]
    if gate_A.shape != (h_AF.shape[0],):
        raise ValueError(f"gate_A.shape={tuple(gate_A.shape)}: must be (A,)=({h_AF.shape[0]},)")
    return _gated_swiglu_op(h_AF, gate_A)[0]

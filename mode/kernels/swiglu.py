"""The gated SwiGLU as one op: ``out = gate_A[:, None] * silu(h[:, :H]) * h[:, H:]``, forward and backward.

Shape legend: A rows, H expert hidden size, F = 2H (gate half first, then up half: the fused [g | u] layout of
``mode.experts.swiglu`` and ``SwiGLUOptions(fused="concat")``).

    forward    g, u = h_AF[:, :H], h_AF[:, H:]
               out_AH = silu(g) * u                      (no gate)
               out_AH = (silu(g) * u) * gate_A[:, None]  (a routing weight per row)
    backward   dact = dout * gate_A[:, None]             dgate_A = sum_j dout * silu(g) * u
               dh[:, H:] = dact * silu(g)                dh[:, :H] = dact * u * silu'(g)
               silu'(g) = s * (1 + g * (1 - s)),  s = sigmoid(g)

The op ``mode_kernels::swiglu`` (and ``mode_kernels::swiglu_backward``, its backward) runs
    * the torch reference below on the CPU and wherever no other kernel is registered: the ops of
      ``mode.experts.swiglu`` in the same order, so bit for bit its values and gradients;
    * the Triton kernels of ``swiglu_triton.py`` on CUDA, where triton is installed (float32, bfloat16,
      float16; float64 takes the reference): one launch forward, one backward (the reference: 3 ops and 8), all
      arithmetic in float32 with one rounding per output, so in bfloat16 within a rounding or two of the
      reference (tests/kernels/test_swiglu.py measures it).
The backward recomputes silu(g) from h: the op saves only its inputs (the two-output ops of
``mode.experts.swiglu`` save two more (A, H) tensors).

Only the plain SwiGLU (``SwiGLUOptions().is_plain``) has this kernel; the variants (limit, alpha, offset,
interleaved, softcaps, GeGLU) keep their autograd path in the expert bank.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from mode.kernels import _triton

TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# -- the torch reference (the CPU kernel, and the default) ---------------------------------------------------


def swiglu_reference(h_AF: Tensor, gate_A: Optional[Tensor]) -> Tensor:
    gate_AH, up_AH = h_AF.chunk(2, dim=-1)
    act_AH = F.silu(gate_AH) * up_AH
    return act_AH if gate_A is None else act_AH * gate_A[:, None]


def swiglu_backward_reference(dout_AH: Tensor, h_AF: Tensor, gate_A: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """(dh_AF, dgate_A); dgate_A is empty without a gate. The ops and order of mode.experts.swiglu's backward."""
    gate_AH, up_AH = h_AF.chunk(2, dim=-1)
    H = gate_AH.shape[1]
    silu_AH = F.silu(gate_AH)
    if gate_A is None:
        dact_AH, dgate_A = dout_AH, h_AF.new_empty(0)
    else:
        dgate_A = (dout_AH * (silu_AH * up_AH)).sum(-1)
        dact_AH = dout_AH * gate_A[:, None]
    dh_AF = torch.empty_like(h_AF, memory_format=torch.contiguous_format)
    dgate_AH, dup_AH = dh_AF[:, :H], dh_AF[:, H:]
    torch.mul(dact_AH, silu_AH, out=dup_AH)
    torch.mul(dact_AH, up_AH, out=dgate_AH)
    torch.ops.aten.silu_backward.grad_input(dgate_AH, gate_AH, grad_input=dgate_AH)  # in place, element-wise
    return dh_AF, dgate_A


# -- the Triton kernels, launched directly (the CUDA ops call these; tests call them on CPU tensors) -----------


def swiglu_triton(h_AF: Tensor, gate_A: Optional[Tensor]) -> Tensor:
    _triton.check_launchable("swiglu_triton", h_AF, gate_A)
    from mode.kernels import swiglu_triton as kernels

    return kernels.forward(h_AF, gate_A)


def swiglu_backward_triton(dout_AH: Tensor, h_AF: Tensor, gate_A: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    _triton.check_launchable("swiglu_backward_triton", dout_AH, h_AF, gate_A)
    from mode.kernels import swiglu_triton as kernels

    return kernels.backward(dout_AH, h_AF, gate_A)


# -- the ops ----------------------------------------------------------------------------------------------


@torch.library.custom_op("mode_kernels::swiglu", mutates_args=())
def _swiglu_op(h_AF: Tensor, gate_A: Optional[Tensor]) -> Tensor:
    return swiglu_reference(h_AF, gate_A)


@_swiglu_op.register_fake
def _(h_AF: Tensor, gate_A: Optional[Tensor]) -> Tensor:
    return h_AF.new_empty(h_AF.shape[0], h_AF.shape[1] // 2)


@torch.library.custom_op("mode_kernels::swiglu_backward", mutates_args=())
def _swiglu_backward_op(dout_AH: Tensor, h_AF: Tensor, gate_A: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    return swiglu_backward_reference(dout_AH, h_AF, gate_A)


@_swiglu_backward_op.register_fake
def _(dout_AH: Tensor, h_AF: Tensor, gate_A: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    dgate_A = h_AF.new_empty(0) if gate_A is None else gate_A.new_empty(gate_A.shape)
    return torch.empty_like(h_AF, memory_format=torch.contiguous_format), dgate_A


def _setup(ctx, inputs, output) -> None:
    h_AF, gate_A = inputs
    ctx.has_gate = gate_A is not None
    ctx.save_for_backward(h_AF, gate_A)


def _backward(ctx, dout_AH: Tensor):
    h_AF, gate_A = ctx.saved_tensors
    dh_AF, dgate_A = _swiglu_backward_op(dout_AH.contiguous(), h_AF, gate_A)
    return dh_AF, (dgate_A if ctx.has_gate else None)


_swiglu_op.register_autograd(_backward, setup_context=_setup)

if _triton.available():  # the CUDA kernels (triton itself is imported on the first launch)

    @_swiglu_op.register_kernel("cuda")
    def _(h_AF: Tensor, gate_A: Optional[Tensor]) -> Tensor:
        if h_AF.dtype not in TRITON_DTYPES:
            return swiglu_reference(h_AF, gate_A)
        return swiglu_triton(h_AF, gate_A)

    @_swiglu_backward_op.register_kernel("cuda")
    def _(dout_AH: Tensor, h_AF: Tensor, gate_A: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        if h_AF.dtype not in TRITON_DTYPES:
            return swiglu_backward_reference(dout_AH, h_AF, gate_A)
        return swiglu_backward_triton(dout_AH, h_AF, gate_A)


def gated_swiglu(h_AF: Tensor, gate_A: Tensor | None = None) -> Tensor:
    """``silu(gate) * up`` of the fused (A, 2H) projection, as (A, H), each row times ``gate_A`` (A,) when
    given (cast to h's dtype, as ``mode.experts.swiglu.swiglu`` does): one op, ``mode_kernels::swiglu``."""
    if not isinstance(h_AF, Tensor) or not h_AF.is_floating_point():
        raise TypeError(f"h_AF: must be a floating tensor, got {getattr(h_AF, 'dtype', type(h_AF))}")
    if h_AF.dim() != 2 or h_AF.shape[1] % 2:
        raise ValueError(f"h_AF.shape={tuple(h_AF.shape)}: must be (A, 2 * d_hidden)")
    if gate_A is not None:
        if not isinstance(gate_A, Tensor) or tuple(gate_A.shape) != (h_AF.shape[0],):
            raise ValueError(f"gate_A.shape={tuple(getattr(gate_A, 'shape', ()))}: must be (A,)=({h_AF.shape[0]},)")
        gate_A = gate_A.to(h_AF.dtype)
    return _swiglu_op(h_AF, gate_A)

"""Grouped matrix multiply over expert segments, the fast path of the expert bank.

Shape legend: A rows grouped by expert, K in-features, N out-features, E experts.
``grouped_mm(x_AK, w_EKN, offsets_E)[a] = x_AK[a] @ w_EKN[e(a)]`` where e(a) is the expert whose
segment holds row a; ``offsets_E`` is the int32 cumulative row count (the end of each segment).

``torch._grouped_mm`` runs on CPU (float32, bfloat16) and CUDA, but its meta kernel (what
``torch.compile`` traces with) only admits the CUDA dtypes, so it is wrapped here in a custom op with
its own shape function and backward:
    dx_AK = grouped_mm(dy_AN, w_EKN^T)                     (the same segments)
    dw_EKN[e] = x_AK[segment e]^T @ dy_AN[segment e]      (torch._grouped_mm's 2-D x 2-D form)
"""

from __future__ import annotations

import torch
from torch import Tensor


def grouped_mm_available() -> bool:
    return hasattr(torch, "_grouped_mm")


if grouped_mm_available():

    @torch.library.custom_op("mode::grouped_mm", mutates_args=())
    def _grouped_mm_op(x_AK: Tensor, w_EKN: Tensor, offsets_E: Tensor) -> Tensor:
        return torch._grouped_mm(x_AK, w_EKN, offs=offsets_E)

    @_grouped_mm_op.register_fake
    def _(x_AK: Tensor, w_EKN: Tensor, offsets_E: Tensor) -> Tensor:
        return x_AK.new_empty(x_AK.shape[0], w_EKN.shape[-1])

    def _setup(ctx, inputs, output) -> None:
        x_AK, w_EKN, offsets_E = inputs
        ctx.save_for_backward(x_AK, w_EKN, offsets_E)

    def _backward(ctx, dy_AN: Tensor):
        x_AK, w_EKN, offsets_E = ctx.saved_tensors
        dy_AN = dy_AN.contiguous()  # the kernel rejects expanded gradients (e.g. from .sum())
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = _grouped_mm_op(dy_AN, w_EKN.transpose(-2, -1), offsets_E)
        if ctx.needs_input_grad[1]:
            dw = _grouped_mm_t(x_AK, dy_AN, offsets_E)
        return dx, dw, None

    @torch.library.custom_op("mode::grouped_mm_t", mutates_args=())
    def _grouped_mm_t(x_AK: Tensor, dy_AN: Tensor, offsets_E: Tensor) -> Tensor:
        return torch._grouped_mm(x_AK.t(), dy_AN, offs=offsets_E)

    @_grouped_mm_t.register_fake
    def _(x_AK: Tensor, dy_AN: Tensor, offsets_E: Tensor) -> Tensor:
        return x_AK.new_empty(offsets_E.shape[0], x_AK.shape[1], dy_AN.shape[1])

    _grouped_mm_op.register_autograd(_backward, setup_context=_setup)


def grouped_mm(x_AK: Tensor, w_EKN: Tensor, offsets_E: Tensor) -> Tensor:
    return _grouped_mm_op(x_AK, w_EKN, offsets_E)

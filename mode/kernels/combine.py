"""The row gather into expert order and the weighted combine back, as ops with deterministic backwards.

Shape legend: T tokens, D hidden, A assignment rows (grouped by expert), K slots per token.

Given the plan's ``token_A`` (the token of each row) and its inverse ``inv_TK`` (the K rows of each token;
``inverse_index`` builds it), with entries outside [0, A) skipped:

    gather_rows(x_TD)            forward   x_AD[a] = x_TD[token_A[a]]
                                 backward  dx_TD[t] = sum_j dx_AD[inv_TK[t, j]]
    combine_rows(y_AD, w_A)      forward   out_TD[t] = sum_j w_A[a] y_AD[a],  a = inv_TK[t, j]
                                 backward  dy_AD[a] = w_A[a] dout_TD[token_A[a]]
                                           dw_A[a] = sum_d dout_TD[token_A[a], d] y_AD[a, d]
    (w_A optional: without it the combine of rows already gated, ``scatter_rows``)

The torch references (the CPU kernels, and the default) are the local dispatcher's ops: ``index_select`` and
``index_add_`` (mode/dispatch/local.py ``scatter_weighted``, ``scatter_rows``), bit for bit. On CUDA, where
triton is installed, the Triton kernels of ``combine_triton.py`` run instead: one launch per direction.

Why a per-token sum over the inverse index and not an atomic scatter-add: ``index_add_`` on CUDA adds with
atomics, so a token's K rows land in a different order from run to run and its sum changes in the last bits
(in bfloat16 each atomic add also rounds to bfloat16). The per-token sum reads the K rows in a fixed order,
adds in float32 and writes each output row once: the same bits on every run, one rounding, and no zero-filled
output buffer (one launch and T * D writes fewer). It costs the inverse index, (T, K) integers that the
router's sort already determines (``inverse_index`` is a stable argsort of token_A).

With ``inv_TK`` from ``inverse_index`` each token's rows are summed in increasing row order, the order of
``index_add_`` on the CPU: in float32 the Triton combine then adds the same products in the same order
(on a GPU the compiler may fuse a multiply and add into an FMA, which rounds once less).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from mode.kernels import _triton

TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def inverse_index(token_A: Tensor, num_tokens: int, k: int) -> Tensor:
    """``inv_TK``: the rows of each token, in increasing order, for a plan where every token has exactly
    ``k`` rows (token choice: A = T * k, padding rows included)."""
    if token_A.dim() != 1 or token_A.shape[0] != num_tokens * k:
        raise ValueError(
            f"token_A.shape={tuple(token_A.shape)}: must be (num_tokens * k,)=({num_tokens * k},) "
            "(every token has exactly k rows)"
        )
    return torch.argsort(token_A, stable=True).view(num_tokens, k)


# -- the torch references (the CPU kernels, and the default) --------------------------------------------------


def gather_reference(x_TD: Tensor, token_A: Tensor) -> Tensor:
    return x_TD.index_select(0, token_A)


def gather_backward_reference(dx_AD: Tensor, token_A: Tensor, num_tokens: int) -> Tensor:
    return dx_AD.new_zeros(num_tokens, dx_AD.shape[1]).index_add_(0, token_A, dx_AD)


def combine_reference(y_AD: Tensor, weight_A: Optional[Tensor], token_A: Tensor, num_tokens: int) -> Tensor:
    rows_AD = y_AD if weight_A is None else y_AD * weight_A.to(y_AD.dtype)[:, None]
    return y_AD.new_zeros(num_tokens, y_AD.shape[1]).index_add_(0, token_A, rows_AD)


def combine_backward_reference(
    dout_TD: Tensor, y_AD: Tensor, weight_A: Optional[Tensor], token_A: Tensor
) -> tuple[Tensor, Tensor]:
    """(dy_AD, dweight_A); dweight_A is empty without a weight. As autograd differentiates the reference."""
    drows_AD = dout_TD.index_select(0, token_A)
    if weight_A is None:
        return drows_AD, y_AD.new_empty(0)
    dw_A = (drows_AD * y_AD).sum(-1).to(weight_A.dtype)
    return drows_AD * weight_A.to(y_AD.dtype)[:, None], dw_A


# -- the Triton kernels, launched directly (the CUDA ops call these; tests call them on CPU tensors) -----------


def gather_triton(x_TD: Tensor, token_A: Tensor) -> Tensor:
    _triton.check_launchable("gather_triton", x_TD, token_A)
    from mode.kernels import combine_triton as kernels

    return kernels.gather(x_TD, token_A)[0]


def gather_backward_triton(dx_AD: Tensor, inv_TK: Tensor) -> Tensor:
    _triton.check_launchable("gather_backward_triton", dx_AD, inv_TK)
    from mode.kernels import combine_triton as kernels

    return kernels.combine(dx_AD, None, inv_TK)


def combine_triton(y_AD: Tensor, weight_A: Optional[Tensor], inv_TK: Tensor) -> Tensor:
    _triton.check_launchable("combine_triton", y_AD, weight_A, inv_TK)
    from mode.kernels import combine_triton as kernels

    return kernels.combine(y_AD, weight_A, inv_TK)


def combine_backward_triton(
    dout_TD: Tensor, y_AD: Tensor, weight_A: Optional[Tensor], token_A: Tensor
) -> tuple[Tensor, Tensor]:
    _triton.check_launchable("combine_backward_triton", dout_TD, y_AD, weight_A, token_A)
    from mode.kernels import combine_triton as kernels

    if weight_A is None:
        return kernels.gather(dout_TD, token_A)[0], y_AD.new_empty(0)
    dy_AD, dw_A = kernels.gather(dout_TD, token_A, weight_A, y_AD)
    assert dw_A is not None, "gather with a weight returns its gradient"
    return dy_AD, dw_A


# -- the ops ----------------------------------------------------------------------------------------------


@torch.library.custom_op("mode_kernels::gather_rows", mutates_args=())
def _gather_op(x_TD: Tensor, token_A: Tensor, inv_TK: Tensor) -> Tensor:
    return gather_reference(x_TD, token_A)


@_gather_op.register_fake
def _(x_TD, token_A, inv_TK):
    return x_TD.new_empty(token_A.shape[0], x_TD.shape[1])


@torch.library.custom_op("mode_kernels::gather_rows_backward", mutates_args=())
def _gather_backward_op(dx_AD: Tensor, token_A: Tensor, inv_TK: Tensor) -> Tensor:
    return gather_backward_reference(dx_AD, token_A, inv_TK.shape[0])


@_gather_backward_op.register_fake
def _(dx_AD, token_A, inv_TK):
    return dx_AD.new_empty(inv_TK.shape[0], dx_AD.shape[1])


def _gather_setup(ctx, inputs, output) -> None:
    _, token_A, inv_TK = inputs
    ctx.save_for_backward(token_A, inv_TK)


def _gather_backward(ctx, dx_AD):
    token_A, inv_TK = ctx.saved_tensors
    return _gather_backward_op(dx_AD.contiguous(), token_A, inv_TK), None, None


_gather_op.register_autograd(_gather_backward, setup_context=_gather_setup)


@torch.library.custom_op("mode_kernels::combine_rows", mutates_args=())
def _combine_op(y_AD: Tensor, weight_A: Optional[Tensor], token_A: Tensor, inv_TK: Tensor) -> Tensor:
    return combine_reference(y_AD, weight_A, token_A, inv_TK.shape[0])


@_combine_op.register_fake
def _(y_AD, weight_A, token_A, inv_TK):
    return y_AD.new_empty(inv_TK.shape[0], y_AD.shape[1])


@torch.library.custom_op("mode_kernels::combine_rows_backward", mutates_args=())
def _combine_backward_op(
    dout_TD: Tensor, y_AD: Tensor, weight_A: Optional[Tensor], token_A: Tensor
) -> tuple[Tensor, Tensor]:
    return combine_backward_reference(dout_TD, y_AD, weight_A, token_A)


@_combine_backward_op.register_fake
def _(dout_TD, y_AD, weight_A, token_A):
    dw = y_AD.new_empty(0) if weight_A is None else weight_A.new_empty(weight_A.shape)
    return y_AD.new_empty(y_AD.shape), dw


def _combine_setup(ctx, inputs, output) -> None:
    y_AD, weight_A, token_A, _ = inputs
    ctx.has_weight = weight_A is not None
    ctx.save_for_backward(y_AD, weight_A, token_A)


def _combine_backward(ctx, dout_TD):
    y_AD, weight_A, token_A = ctx.saved_tensors
    dy_AD, dw_A = _combine_backward_op(dout_TD.contiguous(), y_AD, weight_A, token_A)
    return dy_AD, (dw_A if ctx.has_weight else None), None, None


_combine_op.register_autograd(_combine_backward, setup_context=_combine_setup)

if _triton.available():  # the CUDA kernels (triton itself is imported on the first launch)

    @_gather_op.register_kernel("cuda")
    def _(x_TD, token_A, inv_TK):
        if x_TD.dtype not in TRITON_DTYPES:
            return gather_reference(x_TD, token_A)
        return gather_triton(x_TD, token_A)

    @_gather_backward_op.register_kernel("cuda")
    def _(dx_AD, token_A, inv_TK):
        if dx_AD.dtype not in TRITON_DTYPES:
            return gather_backward_reference(dx_AD, token_A, inv_TK.shape[0])
        return gather_backward_triton(dx_AD, inv_TK)

    @_combine_op.register_kernel("cuda")
    def _(y_AD, weight_A, token_A, inv_TK):
        if y_AD.dtype not in TRITON_DTYPES:
            return combine_reference(y_AD, weight_A, token_A, inv_TK.shape[0])
        return combine_triton(y_AD, weight_A, inv_TK)

    @_combine_backward_op.register_kernel("cuda")
    def _(dout_TD, y_AD, weight_A, token_A):
        if y_AD.dtype not in TRITON_DTYPES:
            return combine_backward_reference(dout_TD, y_AD, weight_A, token_A)
        return combine_backward_triton(dout_TD, y_AD, weight_A, token_A)


def _check_index(name: str, idx: Tensor, ndim: int, size0: int | None = None) -> None:
    if (
        not isinstance(idx, Tensor)
        or idx.dtype not in (torch.int32, torch.int64)
        or idx.dim() != ndim
        or (size0 is not None and idx.shape[0] != size0)
    ):
        want = f"{ndim}-D" + ("" if size0 is None else f" with {size0} rows")
        raise ValueError(
            f"{name}: must be an int32 or int64 tensor, {want}; got "
            f"{getattr(idx, 'dtype', type(idx))} {tuple(getattr(idx, 'shape', ()))}"
        )


def gather_rows(x_TD: Tensor, token_A: Tensor, inv_TK: Tensor) -> Tensor:
    """``x_TD[token_A]`` (``mode_kernels::gather_rows``); its backward sums each token's rows by ``inv_TK``
    (T, K), entries outside [0, A) skipped."""
    if not isinstance(x_TD, Tensor) or x_TD.dim() != 2:
        raise ValueError(f"x_TD: must be a 2-D tensor, got {tuple(getattr(x_TD, 'shape', ()))}")
    _check_index("token_A", token_A, 1)
    _check_index("inv_TK", inv_TK, 2, x_TD.shape[0])
    return _gather_op(x_TD, token_A, inv_TK)


def combine_rows(y_AD: Tensor, weight_A: Tensor | None, token_A: Tensor, inv_TK: Tensor) -> Tensor:
    """``out_TD[t] = sum over t's rows a of weight_A[a] * y_AD[a]`` (``mode_kernels::combine_rows``): token_A
    (A,) and weight_A (A,) for y_AD's A rows; inv_TK (T, K), entries outside [0, A) skipped."""
    if not isinstance(y_AD, Tensor) or y_AD.dim() != 2:
        raise ValueError(f"y_AD: must be a 2-D tensor, got {tuple(getattr(y_AD, 'shape', ()))}")
    A = y_AD.shape[0]
    _check_index("token_A", token_A, 1, A)
    _check_index("inv_TK", inv_TK, 2)
    if weight_A is not None and (
        not isinstance(weight_A, Tensor) or not weight_A.is_floating_point() or tuple(weight_A.shape) != (A,)
    ):
        raise ValueError(
            f"weight_A: must be a floating tensor of shape (A,)=({A},), got "
            f"{getattr(weight_A, 'dtype', type(weight_A))} {tuple(getattr(weight_A, 'shape', ()))}"
        )
    return _combine_op(y_AD, weight_A, token_A, inv_TK)

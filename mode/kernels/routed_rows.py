"""Mixture-of-Depths rows as ops: the gather of each sequence's routed tokens and the gated write back.

Shape legend: B batch, S sequence, D hidden, C routed slots per sequence.

``pos_BC`` holds each sequence's routed positions (distinct within a row: top-C indices, or ``pack_routed``'s);
``r_BS`` the router's float32 scores, ``valid_BC`` (optional) which slots hold a real routed token, ``gate`` what
multiplies the block's delta (``MoDRouterConfig.gate``):

    gather_routed(x_BSD, pos_BC) -> (x_BCD, x_keep_BSD)
        x_BCD[b, c] = x_BSD[b, pos_BC[b, c]]; ``x_keep_BSD`` is ``x_BSD`` itself, to hand to ``combine_routed``:
        its gradient and x_BCD's meet in this op's backward, which is then one op (``dkeep`` with the routed rows
        plus ``dx_BCD``) instead of a scatter into zeros and an add.
    combine_routed(x_keep_BSD, y_BCD, r_BS, pos_BC, valid_BC, gate) -> (out_BSD, finite)
        out = x, except at the routed positions (valid slots only):
            out[b, p] = x[b, p] + w * (y[b, c] - x[b, p]),  p = pos_BC[b, c],  w = g(r[b, p])
        with g = r ("raw"), sigmoid(r) ("sigmoid"), the value 1 with the gradient of r ("ste"); ``gate="one"``:
        out[b, p] = y[b, c]. ``finite``: a 0-dim bool, every score in r_BS finite (the router's check, folded in:
        this op reads every row anyway).
        backward: dx = dout, at routed positions dout - w dout (0 for "one"); dy = w dout[b, p];
                  dr[b, p] = g'(r) sum_d dout[b, p] (y - x[b, p]), 0 elsewhere.

The torch references (the CPU kernels, and the default) are the ops the MoD layer ran before these ops, in
their order: a ``gather``, ``x + w * (y - x)``, ``where``, ``scatter``, and their autograd backward (the gate's
gradient scattered, x_BCD's gradient summed as autograd summed it): on the CPU the layer's outputs and gradients
are bit for bit those of the composed ops. On CUDA, where triton is installed, the Triton kernels of
``routed_rows_triton.py`` (float32, bfloat16, float16; float64 takes the reference): in each direction one
kernel over all rows (the copy, and the finite check's per-program flags) and one over the routed slots (the
gated rows, computed in float32 and rounded once; its program 0 also folds the flags).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from mode.kernels import _triton

GATES = ("raw", "sigmoid", "ste", "one")
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _index(pos_BC: Tensor, D: int) -> Tensor:
    B, C = pos_BC.shape
    return pos_BC[..., None].expand(B, C, D)


def _weight(r_BC: Tensor, gate: str) -> Tensor:
    if gate == "raw":
        return r_BC
    if gate == "sigmoid":
        return r_BC.sigmoid()
    return (r_BC - r_BC) + 1.0  # "ste": exactly 1 (NaN where r is not finite), as the router's r - sg(r) + 1


# -- the torch references (the CPU kernels, and the default) --------------------------------------------------


def gather_reference(x_BSD: Tensor, pos_BC: Tensor) -> Tensor:
    return x_BSD.gather(1, _index(pos_BC, x_BSD.shape[-1]))


def gather_backward_reference(dkeep_BSD: Tensor, dx_BCD: Tensor, pos_BC: Tensor) -> Tensor:
    """``dkeep`` with ``dx_BCD`` added at the routed rows (distinct positions: nothing else is summed)."""
    return dkeep_BSD.scatter_add(1, _index(pos_BC, dkeep_BSD.shape[-1]), dx_BCD.to(dkeep_BSD.dtype))


def combine_reference(
    x_BSD: Tensor, x_BCD: Tensor, y_BCD: Tensor, r_BS: Tensor, pos_BC: Tensor, valid_BC: Optional[Tensor], gate: str
) -> tuple[Tensor, Tensor]:
    index_BCD = _index(pos_BC, x_BSD.shape[-1])
    if gate != "one":
        w_BC = _weight(r_BS.gather(1, pos_BC), gate)
        y_BCD = x_BCD + w_BC[..., None].to(x_BCD.dtype) * (y_BCD - x_BCD)
    if valid_BC is not None:
        y_BCD = torch.where(valid_BC[..., None], y_BCD, x_BCD)
    return x_BSD.scatter(1, index_BCD, y_BCD.to(x_BSD.dtype)), torch.isfinite(r_BS).all()


def combine_backward_reference(
    dout_BSD: Tensor, x_BCD: Tensor, y_BCD: Tensor, r_BS: Tensor, pos_BC: Tensor, valid_BC: Optional[Tensor], gate: str
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx_BSD, dx_BCD, dy_BCD, dr_BS): autograd's backward of ``combine_reference``, op for op and summed in
    autograd's order (the where's gradient of x_BCD first, then the add's, then the sub's)."""
    index_BCD = _index(pos_BC, dout_BSD.shape[-1])
    dsrc_BCD = dout_BSD.gather(1, index_BCD)  # scatter's backward: the source rows' gradient ...
    dx_BSD = dout_BSD.scatter(1, index_BCD, 0.0)  # ... and the overwritten rows get none
    dx_BCD = None
    if valid_BC is not None:  # where's backward
        keep_BC1 = valid_BC[..., None]
        dx_BCD = torch.where(keep_BC1, 0.0, dsrc_BCD).to(dsrc_BCD.dtype)
        dsrc_BCD = torch.where(keep_BC1, dsrc_BCD, 0.0).to(dsrc_BCD.dtype)
    if gate == "one":
        dy_BCD, dr_BS = dsrc_BCD.to(y_BCD.dtype), torch.zeros_like(r_BS)
    else:
        r_BC = r_BS.gather(1, pos_BC)
        w_BC = _weight(r_BC, gate)
        w_BC1 = w_BC[..., None].to(x_BCD.dtype)
        dw_BC = (dsrc_BCD * (y_BCD - x_BCD)).sum(-1).to(w_BC.dtype)  # mul's backward, summed over the broadcast
        ddiff_BCD = dsrc_BCD * w_BC1
        dy_BCD = ddiff_BCD.to(y_BCD.dtype)
        dx_BCD = dsrc_BCD if dx_BCD is None else dx_BCD + dsrc_BCD  # the add's gradient of x_BCD ...
        dx_BCD = dx_BCD + ddiff_BCD.neg()  # ... then the sub's
        if gate == "sigmoid":
            dw_BC = torch.ops.aten.sigmoid_backward(dw_BC, w_BC)
        dr_BS = torch.zeros_like(r_BS).scatter_add(1, pos_BC, dw_BC)  # the gather's backward
    if dx_BCD is None:
        dx_BCD = torch.zeros_like(dsrc_BCD)
    return dx_BSD, dx_BCD.to(x_BCD.dtype), dy_BCD, dr_BS


# -- the Triton kernels, launched directly (the CUDA ops call these; tests call them on CPU tensors) -----------


def gather_triton(x_BSD: Tensor, pos_BC: Tensor) -> Tensor:
    _triton.check_launchable("routed_rows.gather_triton", x_BSD, pos_BC)
    from mode.kernels import routed_rows_triton as kernels

    return kernels.gather(x_BSD, pos_BC)


def gather_backward_triton(dkeep_BSD: Tensor, dx_BCD: Tensor, pos_BC: Tensor) -> Tensor:
    _triton.check_launchable("routed_rows.gather_backward_triton", dkeep_BSD, dx_BCD, pos_BC)
    from mode.kernels import routed_rows_triton as kernels

    return kernels.gather_backward(dkeep_BSD, dx_BCD, pos_BC)


def combine_triton(
    x_BSD: Tensor, x_BCD: Tensor, y_BCD: Tensor, r_BS: Tensor, pos_BC: Tensor, valid_BC: Optional[Tensor], gate: str
) -> tuple[Tensor, Tensor]:
    _triton.check_launchable("routed_rows.combine_triton", x_BSD, x_BCD, y_BCD, r_BS, pos_BC, valid_BC)
    from mode.kernels import routed_rows_triton as kernels

    return kernels.combine(x_BSD, x_BCD, y_BCD, r_BS, pos_BC, valid_BC, gate)


def combine_backward_triton(
    dout_BSD: Tensor, x_BCD: Tensor, y_BCD: Tensor, r_BS: Tensor, pos_BC: Tensor, valid_BC: Optional[Tensor], gate: str
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    _triton.check_launchable("routed_rows.combine_backward_triton", dout_BSD, x_BCD, y_BCD, r_BS, pos_BC, valid_BC)
    from mode.kernels import routed_rows_triton as kernels

    return kernels.combine_backward(dout_BSD, x_BCD, y_BCD, r_BS, pos_BC, valid_BC, gate)


# -- the ops ----------------------------------------------------------------------------------------------


@torch.library.custom_op("mode_kernels::routed_gather", mutates_args=())
def _gather_op(x_BSD: Tensor, pos_BC: Tensor) -> Tensor:
    return gather_reference(x_BSD, pos_BC)


@_gather_op.register_fake
def _(x_BSD, pos_BC):
    return x_BSD.new_empty(pos_BC.shape[0], pos_BC.shape[1], x_BSD.shape[2])


@torch.library.custom_op("mode_kernels::routed_gather_backward", mutates_args=())
def _gather_backward_op(dkeep_BSD: Tensor, dx_BCD: Tensor, pos_BC: Tensor) -> Tensor:
    return gather_backward_reference(dkeep_BSD, dx_BCD, pos_BC)


@_gather_backward_op.register_fake
def _(dkeep_BSD, dx_BCD, pos_BC):
    return torch.empty_like(dkeep_BSD, memory_format=torch.contiguous_format)


@torch.library.custom_op("mode_kernels::routed_combine", mutates_args=())
def _combine_op(
    x_BSD: Tensor, x_BCD: Tensor, y_BCD: Tensor, r_BS: Tensor, pos_BC: Tensor, valid_BC: Optional[Tensor], gate: str
) -> tuple[Tensor, Tensor]:
    return combine_reference(x_BSD, x_BCD, y_BCD, r_BS, pos_BC, valid_BC, gate)


@_combine_op.register_fake
def _(x_BSD, x_BCD, y_BCD, r_BS, pos_BC, valid_BC, gate):
    return (torch.empty_like(x_BSD, memory_format=torch.contiguous_format), r_BS.new_empty((), dtype=torch.bool))


@torch.library.custom_op("mode_kernels::routed_combine_backward", mutates_args=())
def _combine_backward_op(
    dout_BSD: Tensor, x_BCD: Tensor, y_BCD: Tensor, r_BS: Tensor, pos_BC: Tensor, valid_BC: Optional[Tensor], gate: str
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return combine_backward_reference(dout_BSD, x_BCD, y_BCD, r_BS, pos_BC, valid_BC, gate)


@_combine_backward_op.register_fake
def _(dout_BSD, x_BCD, y_BCD, r_BS, pos_BC, valid_BC, gate):
    return (
        torch.empty_like(dout_BSD, memory_format=torch.contiguous_format),
        torch.empty_like(x_BCD, memory_format=torch.contiguous_format),
        torch.empty_like(y_BCD, memory_format=torch.contiguous_format),
        torch.empty_like(r_BS, memory_format=torch.contiguous_format),
    )


def _combine_setup(ctx, inputs, output) -> None:
    _, x_BCD, y_BCD, r_BS, pos_BC, valid_BC, gate = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)  # no zeros made for the flag's (absent) gradient
    ctx.gate = gate
    ctx.save_for_backward(x_BCD, y_BCD, r_BS, pos_BC, valid_BC)


def _combine_backward(ctx, dout_BSD, _dfinite):
    x_BCD, y_BCD, r_BS, pos_BC, valid_BC = ctx.saved_tensors
    if dout_BSD is None:
        return None, None, None, None, None, None, None
    dx_BSD, dx_BCD, dy_BCD, dr_BS = _combine_backward_op(
        dout_BSD.contiguous(), x_BCD, y_BCD, r_BS, pos_BC, valid_BC, ctx.gate
    )
    return dx_BSD, dx_BCD, dy_BCD, (None if ctx.gate == "one" else dr_BS), None, None, None


_combine_op.register_autograd(_combine_backward, setup_context=_combine_setup)


class _GatherRouted(torch.autograd.Function):
    """x's routed rows, and x itself: the gradients of both meet in one backward op."""

    @staticmethod
    def forward(ctx, x_BSD: Tensor, pos_BC: Tensor) -> tuple[Tensor, Tensor]:
        ctx.save_for_backward(pos_BC)
        return _gather_op(x_BSD, pos_BC), x_BSD

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dx_BCD: Tensor, dkeep_BSD: Tensor):
        (pos_BC,) = ctx.saved_tensors
        return _gather_backward_op(dkeep_BSD.contiguous(), dx_BCD.contiguous(), pos_BC), None


if _triton.available():  # the CUDA kernels (triton itself is imported on the first launch)

    @_gather_op.register_kernel("cuda")
    def _(x_BSD, pos_BC):
        if x_BSD.dtype not in TRITON_DTYPES:
            return gather_reference(x_BSD, pos_BC)
        return gather_triton(x_BSD, pos_BC)

    @_gather_backward_op.register_kernel("cuda")
    def _(dkeep_BSD, dx_BCD, pos_BC):
        if dkeep_BSD.dtype not in TRITON_DTYPES:
            return gather_backward_reference(dkeep_BSD, dx_BCD, pos_BC)
        return gather_backward_triton(dkeep_BSD, dx_BCD, pos_BC)

    @_combine_op.register_kernel("cuda")
    def _(x_BSD, x_BCD, y_BCD, r_BS, pos_BC, valid_BC, gate):
        if x_BSD.dtype not in TRITON_DTYPES or y_BCD.dtype not in TRITON_DTYPES or r_BS.dtype != torch.float32:
            return combine_reference(x_BSD, x_BCD, y_BCD, r_BS, pos_BC, valid_BC, gate)
        return combine_triton(x_BSD, x_BCD, y_BCD, r_BS, pos_BC, valid_BC, gate)

    @_combine_backward_op.register_kernel("cuda")
    def _(dout_BSD, x_BCD, y_BCD, r_BS, pos_BC, valid_BC, gate):
        if dout_BSD.dtype not in TRITON_DTYPES or y_BCD.dtype not in TRITON_DTYPES or r_BS.dtype != torch.float32:
            return combine_backward_reference(dout_BSD, x_BCD, y_BCD, r_BS, pos_BC, valid_BC, gate)
        return combine_backward_triton(dout_BSD, x_BCD, y_BCD, r_BS, pos_BC, valid_BC, gate)


def _check_pos(pos_BC: Tensor, x_BSD: Tensor) -> None:
    if (
        not isinstance(pos_BC, Tensor)
        or pos_BC.dtype not in (torch.int32, torch.int64)
        or pos_BC.dim() != 2
        or pos_BC.shape[0] != x_BSD.shape[0]
    ):
        raise ValueError(
            f"pos_BC: must be a 2-D int32 or int64 tensor with B={x_BSD.shape[0]} rows, got "
            f"{getattr(pos_BC, 'dtype', type(pos_BC))} {tuple(getattr(pos_BC, 'shape', ()))}"
        )


def gather_routed(x_BSD: Tensor, pos_BC: Tensor) -> tuple[Tensor, Tensor]:
    """``(x_BCD, x_keep_BSD)``: the rows of x at each sequence's routed positions (``mode_kernels::routed_gather``),
    and ``x_BSD`` itself, to pass to ``combine_routed``: the backward then adds the block's gradient of x_BCD into
    the combine's gradient of x in one op. ``pos_BC`` must hold distinct positions within each row."""
    if not isinstance(x_BSD, Tensor) or x_BSD.dim() != 3:
        raise ValueError(f"x_BSD: must be a 3-D tensor, got {tuple(getattr(x_BSD, 'shape', ()))}")
    _check_pos(pos_BC, x_BSD)
    return _GatherRouted.apply(x_BSD, pos_BC)


def combine_routed(
    x_keep_BSD: Tensor,
    x_BCD: Tensor,
    y_BCD: Tensor,
    r_BS: Tensor,
    pos_BC: Tensor,
    valid_BC: Tensor | None = None,
    gate: str = "raw",
) -> tuple[Tensor, Tensor]:
    """``(out_BSD, finite)`` (``mode_kernels::routed_combine``; the module docstring has the formula): x with each
    routed row ``x + g(r) (y - x)`` (valid slots only), and whether every score of ``r_BS`` is finite. ``x_keep_BSD``
    and ``x_BCD`` come from ``gather_routed``; ``r_BS`` the float32 router scores."""
    if not isinstance(x_keep_BSD, Tensor) or x_keep_BSD.dim() != 3:
        raise ValueError(f"x_keep_BSD: must be a 3-D tensor, got {tuple(getattr(x_keep_BSD, 'shape', ()))}")
    _check_pos(pos_BC, x_keep_BSD)
    B, S, D = x_keep_BSD.shape
    C = pos_BC.shape[1]
    for name, t in (("x_BCD", x_BCD), ("y_BCD", y_BCD)):
        if not isinstance(t, Tensor) or tuple(t.shape) != (B, C, D):
            raise ValueError(f"{name}: must have shape (B, C, D)=({B}, {C}, {D}), got {tuple(getattr(t, 'shape', ()))}")
    if not isinstance(r_BS, Tensor) or tuple(r_BS.shape) != (B, S) or not r_BS.is_floating_point():
        raise ValueError(
            f"r_BS: must be a floating tensor of shape (B, S)=({B}, {S}), got "
            f"{getattr(r_BS, 'dtype', type(r_BS))} {tuple(getattr(r_BS, 'shape', ()))}"
        )
    if valid_BC is not None and (
        not isinstance(valid_BC, Tensor) or valid_BC.dtype != torch.bool or tuple(valid_BC.shape) != (B, C)
    ):
        raise ValueError(
            f"valid_BC: must be a bool tensor of shape (B, C)=({B}, {C}), got "
            f"{getattr(valid_BC, 'dtype', type(valid_BC))} {tuple(getattr(valid_BC, 'shape', ()))}"
        )
    if gate not in GATES:
        raise ValueError(f"gate={gate!r}: must be one of {GATES}")
    return _combine_op(x_keep_BSD, x_BCD, y_BCD, r_BS, pos_BC, valid_BC, gate)

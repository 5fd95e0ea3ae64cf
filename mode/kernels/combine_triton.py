"""Triton kernels of the row gather and the weighted combine (mode.kernels.combine has the ops, their torch
references and the formulas).

Shape legend: T tokens, D hidden, A assignment rows, K slots per token.

Two kernels serve the four directions:
    gather_kernel    out[a] = src[idx[a]] * w[a] (w optional)   and, with a weight, dw[a] = sum_d src[idx[a]] y[a]
                     (gather forward; combine backward)
    combine_kernel   out[t] = sum_{j < K} w[inv[t, j]] y[inv[t, j]], skipping entries outside [0, rows)
                     (combine forward; gather backward)
Both accumulate in float32 and round once at the store. The combine reads each token's K rows in slot order
and writes its output row once: no atomics, no zero-filled output, the same bits on every run. Only
long-stable triton.language (load/store with masks, sum, where, static_range). Block sizes are first guesses,
not tuned on a GPU.
"""

# Triton's kernel language (tl.static_range loops, [:, None] indexing and tl.constexpr arithmetic in the
# kernels) is typed for its own compiler, not for pyright: these rules are off for this file only.
# pyright: reportOperatorIssue=false, reportGeneralTypeIssues=false

import torch
import triton
import triton.language as tl

from mode.kernels import _triton

BLOCK_ROWS = 8
MAX_BLOCK_D = 256


def gather_kernel(
    src_ptr,
    idx_ptr,
    w_ptr,
    y_ptr,
    out_ptr,
    dw_ptr,
    A,
    D,
    num_src,
    HAS_WEIGHT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < A
    idx = tl.load(idx_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    src_ok = row_ok & (idx >= 0) & (idx < num_src)
    rows64 = rows.to(tl.int64)
    if HAS_WEIGHT:
        w = tl.load(w_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK_R], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        col_ok = cols[None, :] < D
        src = tl.load(src_ptr + idx[:, None] * D + cols[None, :], mask=src_ok[:, None] & col_ok, other=0.0).to(
            tl.float32
        )
        out_off = rows64[:, None] * D + cols[None, :]
        if HAS_WEIGHT:
            y = tl.load(y_ptr + out_off, mask=row_ok[:, None] & col_ok, other=0.0).to(tl.float32)
            dw += tl.sum(src * y, axis=1)
            src = src * w[:, None]
        tl.store(out_ptr + out_off, src.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok)
    if HAS_WEIGHT:
        tl.store(dw_ptr + rows, dw.to(dw_ptr.dtype.element_ty), mask=row_ok)


def combine_kernel(
    y_ptr,
    w_ptr,
    inv_ptr,
    out_ptr,
    T,
    D,
    num_rows,
    K: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    tok_ok = toks < T
    col_ok = cols < D
    toks64 = toks.to(tl.int64)
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(K):
        a = tl.load(inv_ptr + toks64 * K + j, mask=tok_ok, other=-1).to(tl.int64)
        a_ok = tok_ok & (a >= 0) & (a < num_rows)
        y = tl.load(y_ptr + a[:, None] * D + cols[None, :], mask=a_ok[:, None] & col_ok[None, :], other=0.0).to(
            tl.float32
        )
        if HAS_WEIGHT:
            w = tl.load(w_ptr + a, mask=a_ok, other=0.0).to(tl.float32)
            y = y * w[:, None]
        acc += y
    tl.store(
        out_ptr + toks64[:, None] * D + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=tok_ok[:, None] & col_ok[None, :],
    )


def _block_d(D: int) -> int:
    return min(MAX_BLOCK_D, max(16, _triton.next_pow2(D)))


def gather(
    src_ND: torch.Tensor, idx_A: torch.Tensor, weight_A: torch.Tensor | None = None, y_AD: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(src[idx] (* w), and with a weight sum_d src[idx] * y); rows of an index outside [0, N) read zeros."""
    src_ND, idx_A = src_ND.contiguous(), idx_A.contiguous()
    A, D = idx_A.shape[0], src_ND.shape[1]
    out_AD = src_ND.new_empty(A, D)
    dw_A = None if weight_A is None else torch.empty_like(weight_A)
    if A == 0:
        return out_AD, dw_A
    if D == 0:
        return out_AD, (None if dw_A is None else dw_A.zero_())
    has_w = weight_A is not None
    if has_w:
        assert y_AD is not None, "gather: a weight comes with y_AD (its gradient is sum_d src[idx] * y)"
        y_arg = y_AD.contiguous()
    else:
        y_arg = src_ND
    _triton.jit(gather_kernel)[(triton.cdiv(A, BLOCK_ROWS),)](
        src_ND,
        idx_A,
        weight_A.contiguous() if has_w else src_ND,
        y_arg,
        out_AD,
        dw_A if has_w else out_AD,
        A,
        D,
        src_ND.shape[0],
        HAS_WEIGHT=has_w,
        BLOCK_R=BLOCK_ROWS,
        BLOCK_D=_block_d(D),
    )
    return out_AD, dw_A


def combine(y_AD: torch.Tensor, weight_A: torch.Tensor | None, inv_TK: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_j w[inv[t, j]] y[inv[t, j]] over the entries inside [0, A)."""
    y_AD, inv_TK = y_AD.contiguous(), inv_TK.contiguous()
    (T, K), D = inv_TK.shape, y_AD.shape[1]
    out_TD = y_AD.new_empty(T, D)
    if T == 0 or D == 0:
        return out_TD
    if K == 0:
        return out_TD.zero_()
    has_w = weight_A is not None
    block_d = _block_d(D)
    _triton.jit(combine_kernel)[(triton.cdiv(T, BLOCK_ROWS), triton.cdiv(D, block_d))](
        y_AD,
        weight_A.contiguous() if has_w else y_AD,
        inv_TK,
        out_TD,
        T,
        D,
        y_AD.shape[0],
        K=K,
        HAS_WEIGHT=has_w,
        BLOCK_T=BLOCK_ROWS,
        BLOCK_D=block_d,
    )
    return out_TD

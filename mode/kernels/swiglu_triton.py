"""Triton kernels of the gated SwiGLU (mode.kernels.swiglu has the op, its torch reference and the formulas).

Shape legend: A rows, H expert hidden size, F = 2H (gate half first, then up half: ``fused="concat"``).

Imported only on a launch (triton is optional; mode.kernels._triton). Every value is computed in float32
and rounded once, at the store; the rows' gates are read in their own dtype. Only long-stable triton.language
is used (load/store with masks, exp, sum, where, static loops), for triton 3.6 to 3.9.

Tile sizes are first guesses, not tuned on a GPU: 8 rows by up to 256 columns (2048 elements, 4 warps).
"""

import torch
import triton
import triton.language as tl

from mode.kernels import _triton

BLOCK_A = 8
MAX_BLOCK_H = 256


def swiglu_fwd_kernel(
    h_ptr, gate_ptr, out_ptr, A, H, HAS_GATE: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_H: tl.constexpr
):
    """out[a, j] = silu(h[a, j]) * h[a, H + j] (* gate[a]); a 2-D grid of (rows, columns) tiles."""
    rows = tl.program_id(0) * BLOCK_A + tl.arange(0, BLOCK_A)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = rows < A
    mask = row_ok[:, None] & (cols[None, :] < H)
    rows64 = rows.to(tl.int64)
    h_off = rows64[:, None] * (2 * H) + cols[None, :]
    g = tl.load(h_ptr + h_off, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + h_off + H, mask=mask, other=0.0).to(tl.float32)
    act = g / (1.0 + tl.exp(-g)) * u  # silu(g) = g / (1 + exp(-g)), torch's formula
    if HAS_GATE:
        w = tl.load(gate_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        act = act * w[:, None]
    tl.store(out_ptr + rows64[:, None] * H + cols[None, :], act.to(out_ptr.dtype.element_ty), mask=mask)


def swiglu_bwd_kernel(
    dout_ptr,
    h_ptr,
    gate_ptr,
    dh_ptr,
    dgate_ptr,
    A,
    H,
    HAS_GATE: tl.constexpr,
    BLOCK_A: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """dh = [d gate half | d up half] and dgate[a] = sum_j dout[a, j] * silu(g) * u; one program per
    BLOCK_A rows, walking the columns (the row sum for dgate stays in the program: no atomics)."""
    rows = tl.program_id(0) * BLOCK_A + tl.arange(0, BLOCK_A)
    row_ok = rows < A
    rows64 = rows.to(tl.int64)
    if HAS_GATE:
        w = tl.load(gate_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    dgate = tl.zeros([BLOCK_A], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        mask = row_ok[:, None] & (cols[None, :] < H)
        h_off = rows64[:, None] * (2 * H) + cols[None, :]
        o_off = rows64[:, None] * H + cols[None, :]
        g = tl.load(h_ptr + h_off, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(h_ptr + h_off + H, mask=mask, other=0.0).to(tl.float32)
        dact = tl.load(dout_ptr + o_off, mask=mask, other=0.0).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-g))
        silu = g * sig
        if HAS_GATE:
            dgate += tl.sum(dact * (silu * u), axis=1)
            dact = dact * w[:, None]
        du = dact * silu
        dg = dact * u * (sig * (1.0 + g * (1.0 - sig)))  # silu'(g), as torch's silu_backward writes it
        tl.store(dh_ptr + h_off, dg.to(dh_ptr.dtype.element_ty), mask=mask)
        tl.store(dh_ptr + h_off + H, du.to(dh_ptr.dtype.element_ty), mask=mask)
    if HAS_GATE:
        tl.store(dgate_ptr + rows, dgate.to(dgate_ptr.dtype.element_ty), mask=row_ok)


def _block_h(H: int) -> int:
    return min(MAX_BLOCK_H, max(16, _triton.next_pow2(H)))


def forward(h_AF: torch.Tensor, gate_A: torch.Tensor | None) -> torch.Tensor:
    A, H = h_AF.shape[0], h_AF.shape[1] // 2
    h_AF = h_AF.contiguous()
    out_AH = h_AF.new_empty(A, H)
    if A == 0 or H == 0:
        return out_AH
    block_h = _block_h(H)
    grid = (triton.cdiv(A, BLOCK_A), triton.cdiv(H, block_h))
    _triton.jit(swiglu_fwd_kernel)[grid](
        h_AF,
        h_AF if gate_A is None else gate_A.contiguous(),
        out_AH,
        A,
        H,
        HAS_GATE=gate_A is not None,
        BLOCK_A=BLOCK_A,
        BLOCK_H=block_h,
    )
    return out_AH


def backward(
    dout_AH: torch.Tensor, h_AF: torch.Tensor, gate_A: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    A, H = h_AF.shape[0], h_AF.shape[1] // 2
    h_AF, dout_AH = h_AF.contiguous(), dout_AH.contiguous()
    dh_AF = torch.empty_like(h_AF)
    dgate_A = h_AF.new_empty(0) if gate_A is None else torch.empty_like(gate_A)
    if A == 0:
        return dh_AF, dgate_A
    if H == 0:
        return dh_AF, dgate_A.zero_()
    gate = None if gate_A is None else gate_A.contiguous()
    _triton.jit(swiglu_bwd_kernel)[(triton.cdiv(A, BLOCK_A),)](
        dout_AH,
        h_AF,
        h_AF if gate is None else gate,
        dh_AF,
        dh_AF if gate is None else dgate_A,
        A,
        H,
        HAS_GATE=gate is not None,
        BLOCK_A=BLOCK_A,
        BLOCK_H=_block_h(H),
    )
    return dh_AF, dgate_A

"""Triton kernels of the MoD row gather and gated write back (mode.kernels.routed_rows has the ops, their torch
references and the formulas).

Shape legend: B batch, S sequence, D hidden, C routed slots per sequence; a "row" is one of the B * S tokens
(``b * S + s``), a "slot" one of the B * C routed ones (``b * C + c``, its row ``b * S + pos[b, c]``).

    gather_kernel         out[slot] = x[row(slot)]                                    (gather forward)
    add_rows_kernel       out[row(slot)] = keep[row(slot)] + dx[slot], out a copy of keep (gather backward)
    copy_check_kernel     out[row] = x[row]; per program: are its rows' scores finite  (combine forward, 1/2)
    combine_kernel        out[row(slot)] = x + w (y - x), or y ("one"), where the slot is valid; program 0 folds
                          the programs' finite flags into one                           (combine forward, 2/2)
    combine_bwd_kernel    dx[row(slot)] = 0, dx_BCD, dy, dr[row(slot)] (dx a copy of dout, dr zeros elsewhere)
Every value is computed in float32 and rounded once, at the store (the kernels call no helper functions: a
``triton.jit`` kernel may only call other ``triton.jit`` functions, and these are decorated lazily). The positions of a
row are distinct, so no
two programs write the same row. Only long-stable triton.language (masked load/store, sum/min, where, exp).
Block sizes are first guesses, not tuned on a GPU.
"""

# Triton's kernel language (tl.static_range loops, [:, None] indexing and tl.constexpr arithmetic in the
# kernels) is typed for its own compiler, not for pyright: these rules are off for this file only.
# pyright: reportAttributeAccessIssue=false

import torch
import triton
import triton.language as tl

from mode.kernels import _triton

BLOCK_ROWS = 8
MAX_BLOCK_D = 256
GATE_CODES = {"raw": 0, "sigmoid": 1, "ste": 2, "one": 3}


def gather_kernel(x_ptr, pos_ptr, out_ptr, n_slots, S, C, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    slots = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot_ok = slots < n_slots
    rows = (slots // C) * S + tl.load(pos_ptr + slots, mask=slot_ok, other=0).to(tl.int64)  # b * S + pos
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        m = slot_ok[:, None] & (cols[None, :] < D)
        v = tl.load(x_ptr + rows[:, None] * D + cols[None, :], mask=m, other=0.0)
        tl.store(out_ptr + slots[:, None] * D + cols[None, :], v, mask=m)


def add_rows_kernel(keep_ptr, dx_ptr, pos_ptr, out_ptr, n_slots, S, C, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    slots = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot_ok = slots < n_slots
    rows = (slots // C) * S + tl.load(pos_ptr + slots, mask=slot_ok, other=0).to(tl.int64)  # b * S + pos
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        m = slot_ok[:, None] & (cols[None, :] < D)
        row_off = rows[:, None] * D + cols[None, :]
        keep = tl.load(keep_ptr + row_off, mask=m, other=0.0).to(tl.float32)
        dx = tl.load(dx_ptr + slots[:, None] * D + cols[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + row_off, (keep + dx).to(out_ptr.dtype.element_ty), mask=m)


def copy_check_kernel(x_ptr, r_ptr, out_ptr, flag_ptr, n_rows, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    r = tl.load(r_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    ok = (r == r) & (tl.abs(r) < float("inf"))  # NaN fails the first, +-inf the second
    tl.store(flag_ptr + pid, tl.min(tl.where(row_ok & ~ok, 0, 1), 0))
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        m = row_ok[:, None] & (cols[None, :] < D)
        off = rows[:, None] * D + cols[None, :]
        tl.store(out_ptr + off, tl.load(x_ptr + off, mask=m, other=0.0), mask=m)


def combine_kernel(
    xs_ptr,
    y_ptr,
    r_ptr,
    pos_ptr,
    valid_ptr,
    out_ptr,
    flag_ptr,
    finite_ptr,
    n_slots,
    S,
    C,
    D,
    n_flags,
    GATE: tl.constexpr,
    HAS_VALID: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    pid = tl.program_id(0)
    slots = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot_ok = slots < n_slots
    rows = (slots // C) * S + tl.load(pos_ptr + slots, mask=slot_ok, other=0).to(tl.int64)  # b * S + pos
    if HAS_VALID:
        valid = tl.load(valid_ptr + slots, mask=slot_ok, other=0) != 0
    else:
        valid = slot_ok
    r = tl.load(r_ptr + rows, mask=slot_ok, other=0.0).to(tl.float32)
    if GATE == 0:  # raw
        w = r
    elif GATE == 1:  # sigmoid
        w = 1.0 / (1.0 + tl.exp(-r))
    else:  # ste (exactly 1 where r is finite), or "one" (unused)
        w = (r - r) + 1.0
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        m = slot_ok[:, None] & (cols[None, :] < D)
        slot_off = slots[:, None] * D + cols[None, :]
        x = tl.load(xs_ptr + slot_off, mask=m, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + slot_off, mask=m, other=0.0).to(tl.float32)
        if GATE == 3:
            new = y
        else:
            new = x + w[:, None] * (y - x)
        new = tl.where(valid[:, None], new, x)
        tl.store(out_ptr + rows[:, None] * D + cols[None, :], new.to(out_ptr.dtype.element_ty), mask=m)
    if pid == 0:  # fold the copy kernel's per-program finite flags (it ran before this kernel, on the same stream)
        acc = tl.full([BLOCK_F], 1, tl.int32)
        for f0 in range(0, n_flags, BLOCK_F):
            idx = f0 + tl.arange(0, BLOCK_F)
            acc = tl.minimum(acc, tl.load(flag_ptr + idx, mask=idx < n_flags, other=1))
        tl.store(finite_ptr, tl.min(acc, 0).to(tl.int8))


def copy_zero_kernel(dout_ptr, dx_ptr, dr_ptr, n_rows, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    tl.store(dr_ptr + rows, tl.zeros([BLOCK_R], dtype=tl.float32), mask=row_ok)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        m = row_ok[:, None] & (cols[None, :] < D)
        off = rows[:, None] * D + cols[None, :]
        tl.store(dx_ptr + off, tl.load(dout_ptr + off, mask=m, other=0.0), mask=m)


def combine_bwd_kernel(
    dout_ptr,
    xs_ptr,
    y_ptr,
    r_ptr,
    pos_ptr,
    valid_ptr,
    dx_ptr,
    dxs_ptr,
    dy_ptr,
    dr_ptr,
    n_slots,
    S,
    C,
    D,
    GATE: tl.constexpr,
    HAS_VALID: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    slots = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot_ok = slots < n_slots
    rows = (slots // C) * S + tl.load(pos_ptr + slots, mask=slot_ok, other=0).to(tl.int64)  # b * S + pos
    if HAS_VALID:
        valid = tl.load(valid_ptr + slots, mask=slot_ok, other=0) != 0
    else:
        valid = slot_ok
    r = tl.load(r_ptr + rows, mask=slot_ok, other=0.0).to(tl.float32)
    if GATE == 0:  # raw
        w = r
    elif GATE == 1:  # sigmoid
        w = 1.0 / (1.0 + tl.exp(-r))
    else:  # ste (exactly 1 where r is finite), or "one" (unused)
        w = (r - r) + 1.0
    dw = tl.zeros([BLOCK_R], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        m = slot_ok[:, None] & (cols[None, :] < D)
        slot_off = slots[:, None] * D + cols[None, :]
        row_off = rows[:, None] * D + cols[None, :]
        g = tl.load(dout_ptr + row_off, mask=m, other=0.0).to(tl.float32)
        gv = tl.where(valid[:, None], g, 0.0)  # the gradient of the gated row (where's backward)
        if GATE == 3:
            dy = gv
            dxs = g - gv
        else:
            x = tl.load(xs_ptr + slot_off, mask=m, other=0.0).to(tl.float32)
            y = tl.load(y_ptr + slot_off, mask=m, other=0.0).to(tl.float32)
            dw += tl.sum(gv * (y - x), 1)
            dy = gv * w[:, None]
            dxs = g - dy  # invalid slots: g (where's), valid: g - g w (the add's and the sub's)
        tl.store(dy_ptr + slot_off, dy.to(dy_ptr.dtype.element_ty), mask=m)
        tl.store(dxs_ptr + slot_off, dxs.to(dxs_ptr.dtype.element_ty), mask=m)
        tl.store(dx_ptr + row_off, tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32).to(dx_ptr.dtype.element_ty), mask=m)
    if GATE != 3:
        if GATE == 1:
            dw = dw * w * (1.0 - w)
        tl.store(dr_ptr + rows, dw, mask=slot_ok)


def _block_d(D: int) -> int:
    return min(MAX_BLOCK_D, max(16, _triton.next_pow2(D)))


def gather(x_BSD, pos_BC):
    x_BSD, pos_BC = x_BSD.contiguous(), pos_BC.contiguous()
    (B, S, D), C = x_BSD.shape, pos_BC.shape[1]
    out = x_BSD.new_empty(B, C, D)
    n = B * C
    if n and D:
        _triton.jit(gather_kernel)[(triton.cdiv(n, BLOCK_ROWS),)](
            x_BSD, pos_BC, out, n, S, C, D, BLOCK_R=BLOCK_ROWS, BLOCK_D=_block_d(D)
        )
    return out


def gather_backward(dkeep_BSD, dx_BCD, pos_BC):
    dkeep_BSD, dx_BCD, pos_BC = dkeep_BSD.contiguous(), dx_BCD.contiguous(), pos_BC.contiguous()
    (B, S, D), C = dkeep_BSD.shape, pos_BC.shape[1]
    out = dkeep_BSD.clone()
    n = B * C
    if n and D:
        _triton.jit(add_rows_kernel)[(triton.cdiv(n, BLOCK_ROWS),)](
            dkeep_BSD, dx_BCD, pos_BC, out, n, S, C, D, BLOCK_R=BLOCK_ROWS, BLOCK_D=_block_d(D)
        )
    return out


def combine(x_BSD, x_BCD, y_BCD, r_BS, pos_BC, valid_BC, gate: str):
    x_BSD, x_BCD, y_BCD = x_BSD.contiguous(), x_BCD.contiguous(), y_BCD.contiguous()
    r_BS, pos_BC = r_BS.contiguous(), pos_BC.contiguous()
    (B, S, D), C = x_BSD.shape, pos_BC.shape[1]
    out = torch.empty_like(x_BSD)
    rows, slots = B * S, B * C
    programs = triton.cdiv(rows, BLOCK_ROWS)
    flags = torch.empty(max(1, programs), dtype=torch.int32, device=x_BSD.device)
    if rows == 0:
        return out, torch.ones((), dtype=torch.bool, device=x_BSD.device)
    finite = torch.empty((), dtype=torch.int8, device=x_BSD.device)  # program 0 of combine_kernel writes it
    block_d = _block_d(D)
    _triton.jit(copy_check_kernel)[(programs,)](x_BSD, r_BS, out, flags, rows, D, BLOCK_R=BLOCK_ROWS, BLOCK_D=block_d)
    if slots == 0:
        return out, flags.min().to(torch.int8).view(torch.bool)
    has_valid = valid_BC is not None
    valid = valid_BC.contiguous().view(torch.uint8) if has_valid else pos_BC
    _triton.jit(combine_kernel)[(triton.cdiv(slots, BLOCK_ROWS),)](
        x_BCD,
        y_BCD,
        r_BS,
        pos_BC,
        valid,
        out,
        flags,
        finite,
        slots,
        S,
        C,
        D,
        programs,
        GATE=GATE_CODES[gate],
        HAS_VALID=has_valid,
        BLOCK_R=BLOCK_ROWS,
        BLOCK_D=block_d,
        BLOCK_F=256,
    )
    return out, finite.view(torch.bool)


def combine_backward(dout_BSD, x_BCD, y_BCD, r_BS, pos_BC, valid_BC, gate: str):
    dout_BSD, x_BCD, y_BCD = dout_BSD.contiguous(), x_BCD.contiguous(), y_BCD.contiguous()
    r_BS, pos_BC = r_BS.contiguous(), pos_BC.contiguous()
    (B, S, D), C = dout_BSD.shape, pos_BC.shape[1]
    dx_BSD = torch.empty_like(dout_BSD)
    dx_BCD = torch.empty_like(x_BCD)
    dy_BCD = torch.empty_like(y_BCD)
    dr_BS = torch.empty_like(r_BS)
    rows, slots = B * S, B * C
    if rows == 0:
        return dx_BSD, dx_BCD, dy_BCD, dr_BS
    block_d = _block_d(D)
    _triton.jit(copy_zero_kernel)[(triton.cdiv(rows, BLOCK_ROWS),)](
        dout_BSD, dx_BSD, dr_BS, rows, D, BLOCK_R=BLOCK_ROWS, BLOCK_D=block_d
    )
    if slots:
        has_valid = valid_BC is not None
        valid = valid_BC.contiguous().view(torch.uint8) if has_valid else pos_BC
        _triton.jit(combine_bwd_kernel)[(triton.cdiv(slots, BLOCK_ROWS),)](
            dout_BSD,
            x_BCD,
            y_BCD,
            r_BS,
            pos_BC,
            valid,
            dx_BSD,
            dx_BCD,
            dy_BCD,
            dr_BS,
            slots,
            S,
            C,
            D,
            GATE=GATE_CODES[gate],
            HAS_VALID=has_valid,
            BLOCK_R=BLOCK_ROWS,
            BLOCK_D=block_d,
        )
    return dx_BSD, dx_BCD, dy_BCD, dr_BS

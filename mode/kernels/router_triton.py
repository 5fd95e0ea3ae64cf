"""Triton kernels of the fused router (mode.kernels.router has the op, its torch reference and the formulas).

Shape legend: T tokens (rows), X expert slots (columns, padded to the power of two BX <= 256), K top-k.

One program holds BT whole rows (BT * BX <= 4096 elements) in registers: the softmax (or sigmoid), the top-k by
K passes of a row max (ties to the lowest slot), the renormalisation, and the rows' shares of the balance
and z-loss sums, written as one partial row per program and summed by torch afterwards (a fixed order: the
result does not depend on the scheduling, unlike a float atomic_add). float32 throughout. Only long-stable
triton.language (load/store with masks, max/min/sum, exp/log, where, static_range), for triton 3.6 to 3.9.
Block sizes are first guesses, not tuned on a GPU.
"""

# Triton's kernel language (tl.static_range loops, [:, None] indexing and tl.constexpr arithmetic in the
# kernels) is typed for its own compiler, not for pyright: these rules are off for this file only.
# pyright: reportArgumentType=false, reportCallIssue=false, reportOperatorIssue=false, reportGeneralTypeIssues=false

import torch
import triton
import triton.language as tl

from mode.kernels import _triton

MAX_SLOTS = 256  # BX: a row's slots in one block
TILE = 4096  # BT * BX
MAX_ROWS = 64  # BT at most


def router_fwd_kernel(
    logits_ptr,
    valid_ptr,
    gate_ptr,
    chosen_ptr,
    sums_ptr,
    counts_ptr,
    T,
    X,
    scale,
    K: tl.constexpr,
    SIGMOID: tl.constexpr,
    RENORM: tl.constexpr,
    HAS_VALID: tl.constexpr,
    BT: tl.constexpr,
    BX: tl.constexpr,
    BK: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BT + tl.arange(0, BT)
    cols = tl.arange(0, BX)
    kcols = tl.arange(0, BK)
    row_ok = rows < T
    col_ok = cols < X
    rows64 = rows.to(tl.int64)
    mask = row_ok[:, None] & col_ok[None, :]
    logit = tl.load(logits_ptr + rows64[:, None] * X + cols[None, :], mask=mask, other=0.0)
    logit = tl.where(col_ok[None, :], logit, float("-inf"))  # rows past T hold zeros: finite, weighted 0 below
    top = tl.max(logit, 1)
    ex = tl.exp(logit - top[:, None])
    sum_ex = tl.sum(ex, 1)
    prob = ex / sum_ex[:, None]  # the softmax
    lse = top + tl.log(sum_ex)
    if SIGMOID:
        score = tl.where(col_ok[None, :], 1.0 / (1.0 + tl.exp(-logit)), 0.0)
        share = score / tl.sum(score, 1)[:, None]  # the balance loss's distribution: sigmoid scores normalised
    else:
        score = prob
        share = prob
    if HAS_VALID:
        valid = tl.load(valid_ptr + rows, mask=row_ok, other=0).to(tl.float32)
    else:
        valid = tl.where(row_ok, 1.0, 0.0)

    # top-k by K passes of the row max over the logits (the scores are monotone in them)
    gates = tl.zeros([BT, BK], dtype=tl.float32)
    chosen = tl.zeros([BT, BK], dtype=tl.int32)
    picked = tl.zeros([BT, BX], dtype=tl.float32)
    work = logit
    for j in tl.static_range(K):
        best = tl.max(work, 1)
        idx = tl.min(tl.where(work == best[:, None], cols[None, :], BX), 1)  # the lowest slot among ties
        hit = cols[None, :] == idx[:, None]
        gate_j = tl.sum(tl.where(hit, score, 0.0), 1)
        gates = tl.where(kcols[None, :] == j, gate_j[:, None], gates)
        chosen = tl.where(kcols[None, :] == j, idx[:, None], chosen)
        picked = tl.where(hit, 1.0, picked)
        work = tl.where(hit, float("-inf"), work)
    if RENORM:
        gates = gates / tl.sum(gates, 1)[:, None]
    gates = gates * scale
    kmask = row_ok[:, None] & (kcols[None, :] < K)
    k_off = rows64[:, None] * K + kcols[None, :]
    tl.store(gate_ptr + k_off, gates, mask=kmask)
    tl.store(chosen_ptr + k_off, chosen.to(tl.int64), mask=kmask)

    # this program's share of the sums: sum_t v_t * share_tx | sum_t v_t * lse_t^2 | sum_t v_t * entropy_t
    prob_sum = tl.sum(share * valid[:, None], 0)
    z_sum = tl.sum(valid * lse * lse, 0)
    # xlogy(q, q): 0 where q == 0 (the maximum keeps log(0) = -inf out of the unselected branch)
    ent_t = -tl.sum(tl.where(share > 0, share * tl.log(tl.maximum(share, 1e-38)), 0.0), 1)
    ent_sum = tl.sum(valid * ent_t, 0)
    count = tl.sum(picked * valid[:, None], 0)
    base = pid.to(tl.int64) * (X + 2)
    tl.store(sums_ptr + base + cols, prob_sum, mask=col_ok)
    tl.store(sums_ptr + base + X, z_sum)
    tl.store(sums_ptr + base + X + 1, ent_sum)
    tl.store(counts_ptr + pid.to(tl.int64) * X + cols, count.to(tl.int32), mask=col_ok)


def router_bwd_kernel(
    dgate_ptr,
    dsums_ptr,
    logits_ptr,
    valid_ptr,
    chosen_ptr,
    dlogits_ptr,
    T,
    X,
    scale,
    K: tl.constexpr,
    SIGMOID: tl.constexpr,
    RENORM: tl.constexpr,
    HAS_VALID: tl.constexpr,
    BT: tl.constexpr,
    BX: tl.constexpr,
    BK: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BT + tl.arange(0, BT)
    cols = tl.arange(0, BX)
    kcols = tl.arange(0, BK)
    row_ok = rows < T
    col_ok = cols < X
    rows64 = rows.to(tl.int64)
    mask = row_ok[:, None] & col_ok[None, :]
    logit = tl.load(logits_ptr + rows64[:, None] * X + cols[None, :], mask=mask, other=0.0)
    logit = tl.where(col_ok[None, :], logit, float("-inf"))
    top = tl.max(logit, 1)
    ex = tl.exp(logit - top[:, None])
    sum_ex = tl.sum(ex, 1)
    prob = ex / sum_ex[:, None]
    lse = top + tl.log(sum_ex)
    if SIGMOID:
        score = tl.where(col_ok[None, :], 1.0 / (1.0 + tl.exp(-logit)), 0.0)
        score_sum = tl.sum(score, 1)
        share = score / score_sum[:, None]
    else:
        score = prob
    if HAS_VALID:
        valid = tl.load(valid_ptr + rows, mask=row_ok, other=0).to(tl.float32)
    else:
        valid = tl.where(row_ok, 1.0, 0.0)
    dprob_sum = tl.load(dsums_ptr + cols, mask=col_ok, other=0.0)
    dz_sum = tl.load(dsums_ptr + X)

    kmask = row_ok[:, None] & (kcols[None, :] < K)
    k_off = rows64[:, None] * K + kcols[None, :]
    chosen = tl.load(chosen_ptr + k_off, mask=kmask, other=0).to(tl.int32)
    dw = tl.load(dgate_ptr + k_off, mask=kmask, other=0.0) * scale
    if RENORM:  # w = g / sum(g): dg = (dw - sum(dw * w)) / sum(g), with g the scores at the chosen slots
        g = tl.zeros([BT, BK], dtype=tl.float32)
        for j in tl.static_range(K):
            idx = tl.sum(tl.where(kcols[None, :] == j, chosen, 0), 1)
            g_j = tl.sum(tl.where(cols[None, :] == idx[:, None], score, 0.0), 1)
            g = tl.where(kcols[None, :] == j, g_j[:, None], g)
        g_sum = tl.sum(g, 1)
        w = g / g_sum[:, None]
        dg = (dw - tl.sum(dw * w, 1)[:, None]) / g_sum[:, None]
    else:
        dg = dw
    dscore = tl.zeros([BT, BX], dtype=tl.float32)
    for j in tl.static_range(K):
        idx = tl.sum(tl.where(kcols[None, :] == j, chosen, 0), 1)
        dg_j = tl.sum(tl.where(kcols[None, :] == j, dg, 0.0), 1)
        dscore += tl.where(cols[None, :] == idx[:, None], dg_j[:, None], 0.0)
    if SIGMOID:  # share = s / sum(s); s = sigmoid(logit)
        dshare = valid[:, None] * dprob_sum[None, :]
        dscore += (dshare - tl.sum(dshare * share, 1)[:, None]) / score_sum[:, None]
        dlogit = dscore * score * (1.0 - score)
    else:  # softmax: the balance share is the score itself
        dprob = dscore + valid[:, None] * dprob_sum[None, :]
        dlogit = prob * (dprob - tl.sum(dprob * prob, 1)[:, None])
    dlogit += (2.0 * dz_sum) * (valid * lse)[:, None] * prob  # d lse^2 = 2 lse softmax
    tl.store(dlogits_ptr + rows64[:, None] * X + cols[None, :], dlogit, mask=mask)


def _blocks(X: int, K: int) -> tuple[int, int, int]:
    bx = max(2, _triton.next_pow2(X))
    return min(MAX_ROWS, max(1, TILE // bx)), bx, max(2, _triton.next_pow2(K))


def _valid_arg(valid_T, logits_TX):
    return (logits_TX, False) if valid_T is None else (valid_T.contiguous().view(torch.uint8), True)


def forward(logits_TX, valid_T, k: int, gate: str, renormalize: bool, scale: float):
    T, X = logits_TX.shape
    logits_TX = logits_TX.contiguous()
    bt, bx, bk = _blocks(X, k)
    programs = triton.cdiv(T, bt)
    gate_TK = logits_TX.new_empty(T, k)
    chosen_TK = torch.empty(T, k, dtype=torch.int64, device=logits_TX.device)
    sums_PS = logits_TX.new_empty(programs, X + 2)
    counts_PX = torch.empty(programs, X, dtype=torch.int32, device=logits_TX.device)
    if T:
        valid, has_valid = _valid_arg(valid_T, logits_TX)
        _triton.jit(router_fwd_kernel)[(programs,)](
            logits_TX,
            valid,
            gate_TK,
            chosen_TK,
            sums_PS,
            counts_PX,
            T,
            X,
            float(scale),
            K=k,
            SIGMOID=gate == "sigmoid",
            RENORM=renormalize,
            HAS_VALID=has_valid,
            BT=bt,
            BX=bx,
            BK=bk,
        )
    return gate_TK, chosen_TK, sums_PS.sum(0), counts_PX.sum(0)


def backward(dgate_TK, dsums_S, logits_TX, valid_T, chosen_TK, k: int, gate: str, renormalize: bool, scale: float):
    T, X = logits_TX.shape
    logits_TX = logits_TX.contiguous()
    dlogits_TX = torch.empty_like(logits_TX)
    if T:
        bt, bx, bk = _blocks(X, k)
        valid, has_valid = _valid_arg(valid_T, logits_TX)
        _triton.jit(router_bwd_kernel)[(triton.cdiv(T, bt),)](
            dgate_TK.contiguous(),
            dsums_S.contiguous(),
            logits_TX,
            valid,
            chosen_TK.contiguous(),
            dlogits_TX,
            T,
            X,
            float(scale),
            K=k,
            SIGMOID=gate == "sigmoid",
            RENORM=renormalize,
            HAS_VALID=has_valid,
            BT=bt,
            BX=bx,
            BK=bk,
        )
    return dlogits_TX

"""mode.kernels.combine: the Triton gather and combine against float64 truth (and, in float32 with the stable
inverse index, bit for bit the CPU reference), the references against the local dispatcher, opcheck, one op
per direction, the inverse index."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import mode.kernels.combine as kc
from mode.dispatch.local import scatter_rows, scatter_weighted
from mode.kernels import combine_rows, gather_rows, inverse_index
from mode.measure.op_count import OpCounter
from mode.routing import TokenChoiceConfig, TokenChoiceRouter

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CASES = [(13, 3, 40), (5, 1, 300), (4, 2, 8)]  # (T, K, D): D past one 256-column block


def plan_like(T, K, device, seed=0):
    """token_A: each token K times, in a shuffled (expert-like) order; inv_TK its inverse."""
    g = torch.Generator().manual_seed(seed)
    token_A = torch.arange(T).repeat(K)[torch.randperm(T * K, generator=g)].to(device)
    return token_A, inverse_index(token_A, T, K)


def tolerance(dtype):
    """Relative to the sum of the absolute terms: one unit of the dtype (the interpreter truncates), plus K
    float32 additions. Measured: float32 0 (same order, same products), bfloat16 / float16 within one unit."""
    info = torch.finfo(dtype)
    return info.eps + 8 * torch.finfo(torch.float32).eps, info.smallest_normal * info.eps


def assert_within(name, got, truth, mag, dtype):
    rtol, atol = tolerance(dtype)
    err = (got.cpu().double() - truth).abs()
    assert got.dtype == dtype and got.shape == truth.shape, (name, got.dtype, got.shape)
    assert bool((err <= rtol * mag + atol).all()), (name, (err / (rtol * mag + atol)).max().item())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,K,D", CASES)
@pytest.mark.parametrize("weighted", [False, True])
def test_triton_matches_float64_truth(kernel_device, dtype, T, K, D, weighted):
    token_A, inv_TK = plan_like(T, K, kernel_device)
    A = T * K
    x = torch.randn(T, D).to(dtype)
    y = torch.randn(A, D).to(dtype)
    w = torch.rand(A) if weighted else None  # float32 gates, as the plan holds them
    dout = torch.randn(T, D).to(dtype)
    dxa = torch.randn(A, D).to(dtype)
    dev = lambda t: None if t is None else t.to(kernel_device)  # noqa: E731
    tok, w64 = token_A.cpu(), None if w is None else w.double()

    # gather forward is a copy; its backward the unweighted per-token sum
    assert torch.equal(kc.gather_triton(dev(x), token_A).cpu(), x[tok])
    truth = torch.zeros(T, D, dtype=torch.float64).index_add_(0, tok, dxa.double())
    mag = torch.zeros(T, D, dtype=torch.float64).index_add_(0, tok, dxa.double().abs())
    assert_within("gather backward", kc.gather_backward_triton(dev(dxa), inv_TK), truth, mag, dtype)

    # combine forward, and its backward (dy: a scaled copy; dw: a row dot product)
    rows = y.double() if w is None else y.double() * w64[:, None]
    truth = torch.zeros(T, D, dtype=torch.float64).index_add_(0, tok, rows)
    mag = torch.zeros(T, D, dtype=torch.float64).index_add_(0, tok, rows.abs())
    assert_within("combine", kc.combine_triton(dev(y), dev(w), inv_TK), truth, mag, dtype)
    dy, dw = kc.combine_backward_triton(dev(dout), dev(y), dev(w), token_A)
    drows = dout.double()[tok]
    dy_truth = drows if w is None else drows * w64[:, None]
    assert_within("combine dy", dy, dy_truth, dy_truth.abs(), dtype)
    if w is None:
        assert dw.numel() == 0
    else:
        assert dw.dtype == torch.float32
        prod = drows * y.double()
        rtol, _ = tolerance(dtype)
        err = (dw.cpu().double() - prod.sum(1)).abs()
        assert bool((err <= rtol * prod.abs().sum(1) + 1e-30).all())


def test_float32_combine_is_bitwise_the_cpu_reference(kernel_device):
    """With the stable inverse index each token's rows are added in increasing row order, as index_add_ adds
    them on the CPU: the same products in the same order (in the interpreter; a GPU may fuse into FMAs)."""
    T, K, D = 11, 4, 24
    token_A, inv_TK = plan_like(T, K, kernel_device, seed=3)
    y, w = torch.randn(T * K, D), torch.rand(T * K)
    got = kc.combine_triton(y.to(kernel_device), w.to(kernel_device), inv_TK).cpu()
    want = kc.combine_reference(y, w, token_A.cpu(), T)
    if kernel_device.type == "cpu":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=4 * torch.finfo(torch.float32).eps, atol=1e-7)


def test_rows_outside_the_computed_ones_are_skipped(kernel_device):
    """Expert-parallel combines hold only the first A' rows: inverse entries >= A' (and negative ones) add
    nothing, and an index outside x's rows gathers zeros."""
    T, K, D = 6, 2, 16
    token_A, inv_TK = plan_like(T, K, kernel_device, seed=1)
    n = 7
    y = torch.randn(n, D).to(kernel_device)
    inv = inv_TK.clone()
    inv[0, 0] = -1
    got = kc.combine_triton(y, None, inv).cpu()
    want = torch.zeros(T, D)
    for t in range(T):
        for a in inv[t].tolist():
            if 0 <= a < n:
                want[t] += y[a].cpu()
    assert torch.equal(got, want)
    bad = torch.tensor([0, T, -1, 2], device=kernel_device)
    out = kc.gather_triton(torch.randn(T, D).to(kernel_device), bad).cpu()
    assert torch.equal(out[1:3], torch.zeros(2, D))


def test_triton_combine_is_deterministic(kernel_device):
    T, K, D = 32, 4, 64
    token_A, inv_TK = plan_like(T, K, kernel_device, seed=2)
    y, w = torch.randn(T * K, D).to(kernel_device), torch.rand(T * K).to(kernel_device)
    first = kc.combine_triton(y, w, inv_TK)
    for _ in range(2):
        assert torch.equal(kc.combine_triton(y, w, inv_TK), first)


@pytest.mark.parametrize("masked", [False, True])
def test_ops_are_the_local_dispatchers_ops_on_cpu(masked):
    """On a real token-choice plan (padding rows included), the ops' CPU kernels give the dispatcher's values
    and gradients bit for bit: gather == index_select, combine == scatter_weighted / scatter_rows."""
    T, K, E, D = 10, 2, 4, 16
    router = TokenChoiceRouter(TokenChoiceConfig(d_model=D, num_experts=E, top_k=K, capacity_factor=1.0))
    x = torch.randn(2, 5, D)
    plan = router(x, (torch.rand(2, 5) > 0.3) if masked else None)
    inv_TK = inverse_index(plan.token_idx_A, T, K)
    x_TD, y_AD = torch.randn(T, D), torch.randn(T * K, D)
    w_A = plan.weight_A.detach()
    for weighted in (True, False):
        runs = []
        for fused in (True, False):
            xs, ys = x_TD.clone().requires_grad_(), y_AD.clone().requires_grad_()
            ws = w_A.clone().requires_grad_()
            if fused:
                g = gather_rows(xs, plan.token_idx_A, inv_TK)
                out = combine_rows(ys, ws if weighted else None, plan.token_idx_A, inv_TK)
            else:
                g = xs.index_select(0, plan.token_idx_A)
                p = plan if not weighted else type(plan)(**{**plan.__dict__, "weight_A": ws})
                out = scatter_weighted(ys, p) if weighted else scatter_rows(ys, plan)
            (g * 1.5).sum().add((out * torch.arange(D)).sum()).backward()
            runs.append((g, out, xs.grad, ys.grad) + ((ws.grad,) if weighted else ()))
        for a, b in zip(*runs):
            assert torch.equal(a, b)


def test_opcheck():
    T, K, D = 5, 2, 8
    token_A, inv_TK = plan_like(T, K, "cpu")
    x = torch.randn(T, D, dtype=torch.float64, requires_grad=True)
    y = torch.randn(T * K, D, dtype=torch.float64, requires_grad=True)
    w = torch.rand(T * K, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(torch.ops.mode_kernels.gather_rows.default, (x, token_A, inv_TK))
    torch.library.opcheck(torch.ops.mode_kernels.gather_rows_backward.default, (y.detach(), token_A, inv_TK))
    for weight in (w, None):
        torch.library.opcheck(torch.ops.mode_kernels.combine_rows.default, (y, weight, token_A, inv_TK))
        torch.library.opcheck(
            torch.ops.mode_kernels.combine_rows_backward.default,
            (x.detach(), y.detach(), None if weight is None else weight.detach(), token_A),
        )


def test_one_op_each_way():
    token_A, inv_TK = plan_like(4, 2, "cpu")
    x, w = torch.randn(4, 8, requires_grad=True), torch.rand(8, requires_grad=True)
    with OpCounter() as log:
        out = combine_rows(gather_rows(x, token_A, inv_TK), w, token_A, inv_TK)
        out.sum().backward()
    assert [op for op in log.packets if op.startswith("mode_kernels")] == [
        "mode_kernels.gather_rows",
        "mode_kernels.combine_rows",
        "mode_kernels.combine_rows_backward",
        "mode_kernels.gather_rows_backward",
    ]


def test_inverse_index():
    token_A = torch.tensor([2, 0, 1, 0, 2, 1])
    assert inverse_index(token_A, 3, 2).tolist() == [[1, 3], [2, 5], [0, 4]]
    with pytest.raises(ValueError, match="num_tokens \\* k"):
        inverse_index(token_A, 4, 2)


def test_bad_input_raises():
    token_A, inv_TK = plan_like(3, 2, "cpu")
    with pytest.raises(ValueError, match="token_A"):
        combine_rows(torch.randn(5, 4), None, token_A, inv_TK)
    with pytest.raises(ValueError, match="weight_A"):
        combine_rows(torch.randn(6, 4), torch.ones(5), token_A, inv_TK)
    with pytest.raises(ValueError, match="inv_TK"):
        gather_rows(torch.randn(4, 4), token_A, inv_TK)
    with pytest.raises(ValueError, match="token_A"):
        gather_rows(torch.randn(3, 4), token_A.float(), inv_TK)


@pytest.mark.parametrize(
    "kw,masked",
    [
        (dict(), False),
        (dict(), True),
        (dict(num_noop=2), False),
        (dict(capacity_factor=0.5), False),
        (dict(top_k=3), False),
    ],
    ids=["dropless", "mask", "noop", "capacity", "top3"],
)
def test_the_routers_inverse_index_and_the_dispatcher(kernel_device, kw, masked):
    """A token-choice plan carries inv_TK (one scatter of its sort's permutation): token t's K rows, padding rows
    included, each row once. The local dispatcher gathers and combines through the fused ops with it; the Triton
    combine over the plan's inverse agrees with the CPU reference (float32; exactly for K = 2)."""
    from mode.dispatch.local import LocalDispatcher

    torch.manual_seed(0)
    cfg = TokenChoiceConfig(d_model=16, num_experts=4, **{"top_k": 2, **kw})
    B, S, K = 2, 9, cfg.top_k
    x = torch.randn(B, S, 16)
    mask = None
    if masked:
        mask = torch.ones(B, S, dtype=torch.bool)
        mask[1, 6:] = False
    plan = TokenChoiceRouter(cfg)(x, mask)
    T = B * S
    inv = plan.inv_TK
    assert inv is not None and tuple(inv.shape) == (T, K)
    assert torch.equal(plan.token_idx_A[inv], torch.arange(T)[:, None].expand(T, K))
    assert torch.equal(inv.reshape(-1).sort().values, torch.arange(T * K))

    with OpCounter() as log:
        x_AD, _, _ = LocalDispatcher().dispatch(x.reshape(T, 16), plan)
        y_TD = LocalDispatcher().combine(x_AD, plan, None)
    assert [op for op in log.packets if op.startswith("mode_kernels")] == [
        "mode_kernels.gather_rows",
        "mode_kernels.combine_rows",
    ]
    assert torch.equal(y_TD, scatter_weighted(x_AD, dataclasses.replace(plan, inv_TK=None)))
    got = kc.combine_triton(x_AD.to(kernel_device), plan.weight_A.detach().to(kernel_device), inv.to(kernel_device))
    if K == 2:
        assert torch.equal(got.cpu(), y_TD)
    else:
        torch.testing.assert_close(got.cpu(), y_TD, rtol=4 * torch.finfo(torch.float32).eps, atol=1e-7)

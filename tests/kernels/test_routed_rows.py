"""mode.kernels.routed_rows: the MoD gather and gated write back. The Triton kernels against float64 truth; the
ops (their CPU kernels) against the composed torch ops the MoD layer ran before, bit for bit, forward and
backward (x, the router weight, the block); opcheck; one op per direction; the finite flag; bad input."""

from __future__ import annotations

import pytest
import torch

import mode.kernels.routed_rows as rr
from mode.kernels import combine_routed, gather_routed
from mode.measure.op_count import OpCounter

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
GATES = ["raw", "sigmoid", "ste", "one"]
CASES = [(2, 12, 4, 40), (3, 7, 7, 300), (1, 5, 1, 8)]  # (B, S, C, D): D past one 256-column block, C = S


def make(B, S, C, D, dtype, masked, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, D, generator=g).to(dtype)
    y = torch.randn(B, C, D, generator=g).to(dtype)
    r = torch.randn(B, S, generator=g)
    pos = torch.rand(B, S, generator=g).topk(C, dim=1).indices.sort(1).values
    valid = (torch.rand(B, C, generator=g) > 0.3) if masked else None
    return x, y, r, pos, valid


def truth(x, y, r, pos, valid, gate, dout):
    """float64 forward and backward by autograd of the formula."""
    x, y, r = (t.double().requires_grad_() for t in (x, y, r))
    B, C = pos.shape
    idx = pos[..., None].expand(B, C, x.shape[-1])
    xs = x.gather(1, idx)
    rs = r.gather(1, pos)
    w = {"raw": rs, "sigmoid": rs.sigmoid(), "ste": rs - rs.detach() + 1, "one": None}[gate]
    new = y if w is None else xs + w[..., None] * (y - xs)
    if valid is not None:
        new = torch.where(valid[..., None], new, xs)
    out = x.scatter(1, idx, new)
    (out * dout.double()).sum().backward()
    dr = r.grad if r.grad is not None else torch.zeros_like(r)
    return out.detach(), x.grad, y.grad, dr


def bound(dtype, mag):
    """One unit of the dtype (the interpreter truncates float32 -> bfloat16) plus 16 float32 units, of the
    terms' magnitude."""
    return (torch.finfo(dtype).eps + 16 * torch.finfo(torch.float32).eps) * mag + 1e-30


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,S,C,D", CASES)
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("masked", [False, True])
def test_triton_matches_float64_truth(kernel_device, dtype, B, S, C, D, gate, masked):
    x, y, r, pos, valid = make(B, S, C, D, dtype, masked)
    dout = torch.randn(B, S, D).to(dtype)
    dev = lambda t: None if t is None else t.to(kernel_device)  # noqa: E731
    xs = rr.gather_triton(dev(x), dev(pos))
    assert torch.equal(xs.cpu(), rr.gather_reference(x, pos))  # a copy
    out, finite = rr.combine_triton(dev(x), xs, dev(y), dev(r), dev(pos), dev(valid), gate)
    o64, dx64, dy64, dr64 = truth(x, y, r, pos, valid, gate, dout)
    mag = x.double().abs() + (y.double().abs().amax() + x.double().abs().amax()) * 2
    assert out.dtype == dtype and bool(finite) is True
    assert bool(((out.cpu().double() - o64).abs() <= bound(dtype, mag)).all())

    dx, dxs, dy, dr = rr.combine_backward_triton(dev(dout), xs, dev(y), dev(r), dev(pos), dev(valid), gate)
    dkeep = rr.gather_backward_triton(dx, dxs, dev(pos))  # the gather's backward adds the x_BCD part back
    gmag = dout.double().abs().amax() * (1 + r.double().abs().amax())  # |dout| (1 + |w|)
    assert dkeep.dtype == dtype and dy.dtype == dtype and dr.dtype == torch.float32
    assert bool(((dkeep.cpu().double() - dx64).abs() <= bound(dtype, gmag)).all())
    assert bool(((dy.cpu().double() - dy64).abs() <= bound(dtype, gmag)).all())
    drmag = dout.double().abs().amax() * (y.double().abs().amax() + x.double().abs().amax()) * D
    assert bool(((dr.cpu().double() - dr64).abs() <= bound(dtype, drmag)).all())


def test_triton_finite_flag(kernel_device):
    x, y, r, pos, _ = make(2, 40, 3, 16, torch.float32, False)
    for bad in (float("nan"), float("inf"), float("-inf")):
        r_bad = r.clone()
        r_bad[1, 37] = bad  # not necessarily a routed position, and past the first program's rows
        xs = rr.gather_triton(x.to(kernel_device), pos.to(kernel_device))
        _, finite = rr.combine_triton(
            x.to(kernel_device), xs, y.to(kernel_device), r_bad.to(kernel_device), pos.to(kernel_device), None, "raw"
        )
        assert finite.dtype == torch.bool and bool(finite) is False
        _, finite_ref = rr.combine_reference(x, xs.cpu(), y, r_bad, pos, None, "raw")
        assert bool(finite_ref) is False


def _block(x):
    """A block that uses its input twice (as a transformer block does: norm and residual)."""
    return torch.sin(x) * 1.7 + x.square() * 0.3


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_ops_reproduce_the_composed_path_bit_for_bit(gate, masked, dtype):
    """The MoD layer's old ops (gather, x + w (y - x), where, scatter) against the two ops, on the CPU: the output
    and the gradients of x, the router weight and the block bit for bit (the backward sums x_BCD's gradient in
    autograd's order)."""
    B, S, D, C = 2, 12, 8, 4
    x, _, _, pos, valid = make(B, S, C, D, torch.float32, masked, seed=3)
    w = torch.randn(D)
    g = torch.randn(B, S, D)
    scale = torch.randn(D, requires_grad=True)

    def block(t):
        return (_block(t.to(dtype)) * scale.to(dtype)).float()

    x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
    r = x1 @ w1
    idx = pos[..., None].expand(B, C, D)
    xs = x1.gather(1, idx)
    y = block(xs)
    if gate != "one":
        ra = r.gather(1, pos)
        wa = {"raw": ra, "sigmoid": ra.sigmoid(), "ste": (ra - ra.detach()) + 1.0}[gate]
        y = xs + wa[..., None] * (y - xs)
    if valid is not None:
        y = torch.where(valid[..., None], y, xs)
    out1 = x1.scatter(1, idx, y)
    (out1 * g).sum().backward()
    grads1 = (x1.grad, w1.grad, scale.grad.clone())
    scale.grad = None

    x2, w2 = x.clone().requires_grad_(), w.clone().requires_grad_()
    r2 = x2 @ w2
    xs2, keep = gather_routed(x2, pos)
    out2, finite = combine_routed(keep, xs2, block(xs2), r2, pos, valid, gate)
    (out2 * g).sum().backward()
    assert torch.equal(out1, out2) and bool(finite)
    assert torch.equal(grads1[0], x2.grad)
    assert (grads1[1] is None and w2.grad is None) or torch.equal(grads1[1], w2.grad)
    assert torch.equal(grads1[2], scale.grad)


def test_one_op_each_way():
    x, y, r, pos, valid = make(2, 9, 3, 8, torch.float32, True)
    x, y, r = x.requires_grad_(), y.requires_grad_(), r.requires_grad_()
    with OpCounter() as log:
        xs, keep = gather_routed(x, pos)
        out, _ = combine_routed(keep, xs, y, r, pos, valid, "sigmoid")
        (out.sum() + xs.sum()).backward()
    assert [op for op in log.packets if op.startswith("mode_kernels")] == [
        "mode_kernels.routed_gather",
        "mode_kernels.routed_combine",
        "mode_kernels.routed_combine_backward",
        "mode_kernels.routed_gather_backward",
    ]


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("masked", [False, True])
def test_opcheck(gate, masked):
    x, y, r, pos, valid = make(2, 9, 3, 8, torch.float32, masked)
    xs = rr.gather_reference(x, pos)
    torch.library.opcheck(torch.ops.mode_kernels.routed_gather.default, (x, pos))
    torch.library.opcheck(torch.ops.mode_kernels.routed_gather_backward.default, (x, xs, pos))
    torch.library.opcheck(
        torch.ops.mode_kernels.routed_combine.default,
        (x, xs.requires_grad_(), y.requires_grad_(), r.requires_grad_(), pos, valid, gate),
    )
    torch.library.opcheck(
        torch.ops.mode_kernels.routed_combine_backward.default,
        (torch.randn(2, 9, 8), xs.detach(), y.detach(), r.detach(), pos, valid, gate),
    )


def test_bad_input_raises():
    x, y, r, pos, _ = make(2, 9, 3, 8, torch.float32, False)
    xs, keep = gather_routed(x, pos)
    with pytest.raises(ValueError, match="pos_BC"):
        gather_routed(x, pos.float())
    with pytest.raises(ValueError, match="y_BCD"):
        combine_routed(keep, xs, y[:, :2], r, pos)
    with pytest.raises(ValueError, match="r_BS"):
        combine_routed(keep, xs, y, r[:, :4], pos)
    with pytest.raises(ValueError, match="valid_BC"):
        combine_routed(keep, xs, y, r, pos, torch.ones(2, 3))
    with pytest.raises(ValueError, match="gate='tanh'"):
        combine_routed(keep, xs, y, r, pos, gate="tanh")

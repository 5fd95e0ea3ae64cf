"""mode.kernels.swiglu: the Triton kernels against float64 truth, the op's torch reference against
mode.experts.swiglu (bit for bit), opcheck, one op per direction, and the expert bank's use of it."""

from __future__ import annotations

import pytest
import torch

import mode.kernels.swiglu as ks
from mode.experts.bank import ExpertBank, ExpertConfig
from mode.experts.swiglu import swiglu as experts_swiglu
from mode.measure.op_count import OpCounter

SHAPES = [(7, 24), (19, 40), (3, 300), (0, 8)]  # (A, H): H past one 256-column block, and no rows
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) against float64 truth, relative to the magnitudes below: one unit in the last place of the
    dtype (triton's interpreter truncates to bfloat16 and float16 instead of rounding) plus 16 of float32 for
    the float32 arithmetic; atol is the dtype's subnormal spacing. Measured in the interpreter over these shapes
    (inputs ~ N(0, 3)): float32 5.7e-7, bfloat16 7.7e-3, float16 2.5e-4 (away from subnormals)."""
    info = torch.finfo(dtype)
    return info.eps + 16 * torch.finfo(torch.float32).eps, info.smallest_normal * info.eps


def truth_and_magnitudes(h_AF, gate_A, dout_AH):
    """The float64 values (y, dh, dgate) and, per element, the sum of the absolute terms each one is made
    of (the scale its rounding errors have: dgate is a row sum, silu' cancels near g = -1.28)."""
    h = h_AF.double().requires_grad_()
    g = None if gate_A is None else gate_A.double().requires_grad_()
    y = ks.swiglu_reference(h, g)
    y.backward(dout_AH.double())
    H = h_AF.shape[1] // 2
    gate, up, do = h_AF[:, :H].double(), h_AF[:, H:].double(), dout_AH.double()
    s = torch.sigmoid(gate)
    silu = gate * s
    w = torch.ones(h_AF.shape[0], 1, dtype=torch.float64) if gate_A is None else gate_A.double()[:, None]
    mags = (
        (silu * up * w).abs(),
        torch.cat([(do * w * up).abs() * s * (1 + gate.abs() * (1 - s)), (do * w * silu).abs()], 1),
        (do * silu * up).abs().sum(1),
    )
    return (y.detach(), h.grad, None if g is None else g.grad), mags


def assert_within(name, got, truth, mag, dtype):
    rtol, atol = tolerance(dtype)
    err = (got.double() - truth).abs()
    bound = rtol * mag + atol
    assert got.dtype == dtype and got.shape == truth.shape, (name, got.dtype, got.shape)
    assert bool((err <= bound).all()), f"{name}: worst error / bound {(err / bound).max().item():.3g}"


def inputs(A, H, dtype, device, gated):
    h = (torch.randn(A, 2 * H, device=device) * 3).to(dtype)
    gate = torch.rand(A, device=device).to(dtype) if gated else None
    return h, gate, torch.randn(A, H, device=device).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("A,H", SHAPES)
@pytest.mark.parametrize("gated", [False, True])
def test_triton_matches_float64_truth(kernel_device, dtype, A, H, gated):
    h, gate, dout = inputs(A, H, dtype, kernel_device, gated)
    (y64, dh64, dg64), (my, mdh, mdg) = truth_and_magnitudes(h.cpu(), None if gate is None else gate.cpu(), dout.cpu())
    y = ks.swiglu_triton(h, gate)
    dh, dgate = ks.swiglu_backward_triton(dout, h, gate)
    assert_within("y", y.cpu(), y64, my, dtype)
    assert_within("dh", dh.cpu(), dh64, mdh, dtype)
    if gated:
        assert_within("dgate", dgate.cpu(), dg64, mdg, dtype)
    else:
        assert dgate.numel() == 0


def test_triton_is_no_worse_than_the_reference_in_bfloat16(kernel_device):
    """The kernel rounds once; the torch ops round after each step: its worst error is at most the reference's
    plus one bfloat16 unit (the interpreter truncates), never a multiple of it."""
    h, gate, dout = inputs(64, 40, torch.bfloat16, kernel_device, True)
    (y64, dh64, dg64), _ = truth_and_magnitudes(h.cpu(), gate.cpu(), dout.cpu())
    got = (ks.swiglu_triton(h, gate), *ks.swiglu_backward_triton(dout, h, gate))
    ref = (ks.swiglu_reference(h, gate), *ks.swiglu_backward_reference(dout, h, gate))
    for name, g, r, t in zip(("y", "dh", "dgate"), got, ref, (y64, dh64, dg64)):
        e_got = ((g.cpu().double() - t).abs() / t.abs().clamp_min(1e-3)).max().item()
        e_ref = ((r.cpu().double() - t).abs() / t.abs().clamp_min(1e-3)).max().item()
        assert e_got <= e_ref + 2**-7, (name, e_got, e_ref)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy's, in the interpreter
def test_nonfinite_inputs_propagate_like_the_reference(kernel_device):
    h = torch.tensor([[float("inf"), -float("inf"), 2.0, 3.0], [float("nan"), 1.0, 1.0, 1.0]], device=kernel_device)
    got, want = ks.swiglu_triton(h, None).cpu(), ks.swiglu_reference(h.cpu(), None)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[~got.isnan()], want[~want.isnan()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("gated", [False, True])
def test_op_is_bitwise_mode_experts_swiglu_on_cpu(dtype, gated):
    """The op's CPU kernel is the reference: the values and gradients of mode.experts.swiglu, bit for bit."""
    h, gate, dout = inputs(9, 24, dtype, "cpu", gated)
    runs = []
    for fn in (ks.gated_swiglu, experts_swiglu):
        h1 = h.clone().requires_grad_()
        g1 = None if gate is None else gate.clone().requires_grad_()
        y = fn(h1, g1)
        y.backward(dout)
        runs.append((y, h1.grad) + (() if g1 is None else (g1.grad,)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("gated", [False, True])
def test_opcheck(gated):
    h = torch.randn(5, 16, dtype=torch.float64, requires_grad=True)
    gate = torch.rand(5, dtype=torch.float64, requires_grad=True) if gated else None
    torch.library.opcheck(torch.ops.mode_kernels.swiglu.default, (h, gate))
    dout = torch.randn(5, 8, dtype=torch.float64)
    # the backward op has no backward of its own: detached inputs
    torch.library.opcheck(
        torch.ops.mode_kernels.swiglu_backward.default, (dout, h.detach(), None if gate is None else gate.detach())
    )


def test_one_op_each_way():
    h = torch.randn(6, 16, requires_grad=True)
    gate = torch.rand(6, requires_grad=True)
    with OpCounter() as log:
        y = ks.gated_swiglu(h, gate)
        y.backward(torch.ones_like(y))
    kernel_ops = [op for op in log.packets if op.startswith("mode_kernels")]
    assert kernel_ops == ["mode_kernels.swiglu", "mode_kernels.swiglu_backward"], log.packets


def test_bad_input_raises():
    with pytest.raises(ValueError, match="h_AF.shape"):
        ks.gated_swiglu(torch.randn(4, 7))
    with pytest.raises(ValueError, match="gate_A.shape"):
        ks.gated_swiglu(torch.randn(4, 8), torch.ones(3))
    with pytest.raises(TypeError, match="h_AF"):
        ks.gated_swiglu(torch.ones(4, 8, dtype=torch.int64))


def test_cpu_tensors_without_the_interpreter_raise(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        ks.swiglu_triton(torch.randn(2, 8), None)


# -- the expert bank (ExpertConfig.fused_kernels) ----------------------------------------------------------


def run_bank(bank, x, counts, gate, grad):
    x = x.clone().requires_grad_()
    gate = gate.clone().requires_grad_()
    y = bank(x, counts, gate_A=gate)
    y.backward(grad)
    return y, x.grad, gate.grad, *(p.grad for p in bank.parameters())


@pytest.mark.parametrize("d_model,d_hidden", [(32, 16), (16, 32)])  # gate on the hidden / on the output
def test_bank_fused_kernels_match_the_unfused_path(device, d_model, d_hidden):
    """Default on: on the CPU the op is the reference (bit for bit the old path); on CUDA (with triton) the
    Triton kernel, within float32 rounding."""
    counts = torch.tensor([3, 0, 5, 2], device=device)
    x = torch.randn(12, d_model, device=device)  # 10 real rows, 2 padding
    gate, grad = torch.rand(12, device=device), torch.randn(12, d_model, device=device)
    runs = []
    for fused in (True, False):
        torch.manual_seed(0)
        bank = ExpertBank(
            ExpertConfig(
                d_model=d_model,
                d_hidden=d_hidden,
                num_experts=4,
                activation="swiglu",
                backend="grouped",
                fused_kernels=fused,
            )
        ).to(device)
        runs.append(run_bank(bank, x, counts, gate, grad))
    for a, b in zip(*runs):
        if device.type == "cpu":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bank_fused_kernels_is_validated():
    with pytest.raises(TypeError, match="fused_kernels"):
        ExpertConfig(d_model=16, d_hidden=16, num_experts=2, fused_kernels="yes")

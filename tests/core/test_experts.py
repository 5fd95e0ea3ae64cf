"""Expert bank: every backend computes the same function, outputs and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from scaled_close import assert_close_scaled

from mode.experts import ExpertBank, ExpertConfig
from mode.experts.grouped_mm import grouped_mm_available

# float32 results summed in another order: max |d| <= REL * max |expected| (tests/scaled_close.py)
REL = 1e-5

D, H = 16, 24
COUNTS = [3, 0, 5, 1]  # uneven, expert 1 has no rows


def make_bank(backend, activation, dtype=torch.float32, counts=COUNTS):
    torch.manual_seed(0)  # same weights for every backend
    return ExpertBank(
        ExpertConfig(d_model=D, d_hidden=H, num_experts=len(counts), activation=activation, backend=backend)
    ).to(dtype)


def hand_expert_mlp(x_AD, counts, w_in_EDF, w_out_EHD, activation):
    """Row by row: y[a] = act(x[a] @ W_in[e(a)]) @ W_out[e(a)], in float64."""
    rows = []
    expert_of_row = [e for e, c in enumerate(counts) for _ in range(c)]
    for a, e in enumerate(expert_of_row):
        h = x_AD[a].double() @ w_in_EDF[e].double()
        if activation == "gelu":
            h = F.gelu(h)
        else:
            g, u = h[:H], h[H:]
            h = g * torch.sigmoid(g) * u
        rows.append(h @ w_out_EHD[e].double())
    return torch.stack(rows)


def run_bank(bank, x, counts, grad_out):
    x = x.detach().clone().requires_grad_(True)
    y = bank(x, torch.tensor(counts, device=x.device))
    y.backward(grad_out)
    return y.detach(), x.grad, bank.w_in_EDF.grad, bank.w_out_EHD.grad


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_reference_matches_hand_formula(activation):
    bank = make_bank("reference", activation)
    x = torch.randn(sum(COUNTS), D)
    y = bank(x, torch.tensor(COUNTS))
    expected = hand_expert_mlp(x, COUNTS, bank.w_in_EDF.detach(), bank.w_out_EHD.detach(), activation)
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("counts", [COUNTS, [0, 4, 0, 0], [2, 2, 2, 2]])
def test_grouped_matches_reference_outputs_and_all_gradients(activation, dtype, tol, counts):
    ref, grp = make_bank("reference", activation, dtype, counts), make_bank("grouped", activation, dtype, counts)
    assert ref.backend == "reference" and grp.backend == "grouped"
    torch.testing.assert_close(grp.w_in_EDF, ref.w_in_EDF, rtol=0, atol=0)
    x = torch.randn(sum(counts), D, dtype=dtype)
    grad_out = torch.randn(sum(counts), D, dtype=dtype)
    got, want = run_bank(grp, x, counts, grad_out), run_bank(ref, x, counts, grad_out)
    for name, g, w in zip(["y", "x.grad", "w_in.grad", "w_out.grad"], got, want):
        assert g.dtype == dtype, name
        assert torch.isfinite(g.float()).all(), name
        torch.testing.assert_close(g.float(), w.float(), rtol=tol, atol=tol, msg=name)
    # An expert with no rows gets an exactly-zero weight gradient.
    for e, c in enumerate(counts):
        if c == 0:
            assert got[2][e].abs().sum() == 0 and got[3][e].abs().sum() == 0
            assert want[2][e].abs().sum() == 0 and want[3][e].abs().sum() == 0


@pytest.mark.parametrize("backend", ["reference", "grouped"])
def test_bf16_input_with_fp32_weights(backend):
    # Mixed precision without autocast: weights stay float32, activations are bfloat16. Every backend
    # computes in the activation dtype and returns it; weight gradients stay float32.
    bank = make_bank(backend, "swiglu")
    x = torch.randn(sum(COUNTS), D, dtype=torch.bfloat16, requires_grad=True)
    y = bank(x, torch.tensor(COUNTS))
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and bank.w_in_EDF.grad.dtype == torch.float32
    expected = hand_expert_mlp(x.detach(), COUNTS, bank.w_in_EDF.detach(), bank.w_out_EHD.detach(), "swiglu")
    torch.testing.assert_close(y.double(), expected, rtol=5e-2, atol=5e-2)


CPU_BACKENDS = ["reference", "grouped"]  # megablocks: GPU only, tested below
N_REAL, N_PAD = sum(COUNTS), 4  # padding rows after the grouped ones


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_zero_rows_forward_and_backward(backend):
    bank = make_bank(backend, "swiglu")
    x = torch.randn(0, D, requires_grad=True)
    y = bank(x, torch.zeros(len(COUNTS), dtype=torch.long))
    assert y.shape == (0, D) and y.dtype == x.dtype
    y.sum().backward()
    assert x.grad.shape == (0, D)
    assert bank.w_in_EDF.grad.abs().sum() == 0 and bank.w_out_EHD.grad.abs().sum() == 0


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_only_padding_rows(backend):
    """counts all zero but A > 0: every row is padding."""
    bank = make_bank(backend, "gelu")
    x = torch.full((5, D), float("nan"), requires_grad=True)
    y = bank(x, torch.zeros(len(COUNTS), dtype=torch.long))
    assert torch.equal(y, torch.zeros(5, D))
    y.sum().backward()
    assert torch.equal(x.grad, torch.zeros(5, D))


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_padding_rows_every_backend_agrees_and_padding_changes_nothing(activation):
    x = torch.randn(N_REAL + N_PAD, D)
    grad_out = torch.randn(N_REAL + N_PAD, D)
    results = {}
    for backend in CPU_BACKENDS:
        bank = make_bank(backend, activation)
        results[backend] = run_bank(bank, x, COUNTS, grad_out)
        # the same rows without padding: the padding rows change neither the outputs nor the weight grads
        unpadded = run_bank(make_bank(backend, activation), x[:N_REAL], COUNTS, grad_out[:N_REAL])
        y, x_grad, w_in_grad, w_out_grad = results[backend]
        assert torch.equal(y[N_REAL:], torch.zeros(N_PAD, D)), backend
        assert torch.equal(x_grad[N_REAL:], torch.zeros(N_PAD, D)), backend
        torch.testing.assert_close(y[:N_REAL], unpadded[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x_grad[:N_REAL], unpadded[1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(w_in_grad, unpadded[2], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(w_out_grad, unpadded[3], rtol=1e-5, atol=1e-5)
    for name, g, w in zip(["y", "x.grad", "w_in.grad", "w_out.grad"], results["grouped"], results["reference"]):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf")])
def test_padding_rows_with_nan_or_inf_give_zero_output_and_zero_grad(backend, poison):
    x = torch.randn(N_REAL + N_PAD, D)
    x[N_REAL:] = poison
    grad_out = torch.randn(N_REAL + N_PAD, D)
    grad_out[N_REAL:] = poison  # even a poisoned incoming gradient must not leak into x or the weights
    y, x_grad, w_in_grad, w_out_grad = run_bank(make_bank(backend, "swiglu"), x, COUNTS, grad_out)
    assert torch.equal(y[N_REAL:], torch.zeros(N_PAD, D))
    assert torch.equal(x_grad[N_REAL:], torch.zeros(N_PAD, D))
    for t in (y, x_grad, w_in_grad, w_out_grad):
        assert torch.isfinite(t).all()
    clean = run_bank(make_bank(backend, "swiglu"), x[:N_REAL], COUNTS, grad_out[:N_REAL])
    torch.testing.assert_close(w_in_grad, clean[2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w_out_grad, clean[3], rtol=1e-5, atol=1e-5)


def test_grouped_masks_rows_the_kernel_leaves_unwritten(monkeypatch):
    """torch._grouped_mm on CUDA never writes rows past the last offset; simulate that with NaN there."""
    real_grouped_mm = torch._grouped_mm

    def nan_past_last_offset(a, b, offs=None, **kw):
        out = real_grouped_mm(a, b, offs=offs, **kw)
        if a.dim() == 2 and b.dim() == 3:  # the (rows x K) @ (E x K x N) form: rows past offs[-1] unwritten
            out[int(offs[-1]) :] = float("nan")
        return out

    monkeypatch.setattr(torch, "_grouped_mm", nan_past_last_offset)
    x = torch.randn(N_REAL + N_PAD, D)
    grad_out = torch.randn(N_REAL + N_PAD, D)
    got = run_bank(make_bank("grouped", "swiglu"), x, COUNTS, grad_out)
    monkeypatch.undo()
    want = run_bank(make_bank("reference", "swiglu"), x, COUNTS, grad_out)
    assert torch.equal(got[0][N_REAL:], torch.zeros(N_PAD, D))
    assert torch.equal(got[1][N_REAL:], torch.zeros(N_PAD, D))
    for name, g, w in zip(["y", "x.grad", "w_in.grad", "w_out.grad"], got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=name)


def test_reference_rejects_counts_beyond_the_rows():
    bank = make_bank("reference", "gelu")
    with pytest.raises(ValueError, match=r"counts_E.sum\(\)=9: must be <= x_AD.shape\[0\]=8"):
        bank(torch.randn(8, D), torch.tensor(COUNTS))
    with pytest.raises(ValueError, match=r"counts_E=\[3, -1, 5, 1\]: must be >= 0"):
        bank(torch.randn(9, D), torch.tensor([3, -1, 5, 1]))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_bad_inputs_name_the_field(backend):
    bank = make_bank(backend, "gelu")
    with pytest.raises(ValueError, match=r"x_AD.shape=\(9, 8\): must be \(A, d_model=16\)"):
        bank(torch.randn(9, 8), torch.tensor(COUNTS))
    with pytest.raises(ValueError, match=r"counts_E.shape=\(3,\): must be \(num_experts,\)=\(4,\)"):
        bank(torch.randn(9, D), torch.tensor([3, 5, 1]))
    with pytest.raises(TypeError, match=r"counts_E: must be an integer torch.Tensor"):
        bank(torch.randn(9, D), torch.tensor(COUNTS, dtype=torch.float32))


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_float64_auto_matches_reference_outputs_and_gradients(activation):
    """float64: torch._grouped_mm rejects it, so "auto" must pick a backend that takes it."""
    auto, ref = make_bank("auto", activation, torch.float64), make_bank("reference", activation, torch.float64)
    assert auto.backend == "reference"
    x = torch.randn(N_REAL + N_PAD, D, dtype=torch.float64)
    grad_out = torch.randn_like(x)
    got, want = run_bank(auto, x, COUNTS, grad_out), run_bank(ref, x, COUNTS, grad_out)
    for name, g, w in zip(["y", "x.grad", "w_in.grad", "w_out.grad"], got, want):
        assert g.dtype == torch.float64, name
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=name)
    expected = hand_expert_mlp(x[:N_REAL], COUNTS, auto.w_in_EDF.detach(), auto.w_out_EHD.detach(), activation)
    torch.testing.assert_close(got[0][:N_REAL], expected, rtol=1e-10, atol=1e-10)


def test_float64_moe_layer_with_auto_backend_matches_reference():
    """The reported failure: MoELayer.from_config(...).double() with backend "auto" (grouped on float32)."""
    from mode import MoEConfig, MoELayer

    layers = {}
    for backend in ("auto", "reference"):
        torch.manual_seed(0)
        layers[backend] = MoELayer.from_config(
            MoEConfig(d_model=D, d_hidden=H, num_experts=4, top_k=2, backend=backend)
        ).double()
    x = torch.randn(2, 5, D, dtype=torch.float64)
    outs = {}
    for backend, layer in layers.items():
        xb = x.clone().requires_grad_(True)
        y, aux = layer(xb)
        (y.square().sum() + aux.total()).backward()
        outs[backend] = (y.detach(), xb.grad, layer.experts.w_in_EDF.grad)
    for name, g, w in zip(["y", "x.grad", "w_in.grad"], outs["auto"], outs["reference"]):
        assert g.dtype == torch.float64, name
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.skipif(not grouped_mm_available(), reason="needs torch._grouped_mm (torch>=2.9)")
def test_backend_follows_the_weights_dtype():
    bank = make_bank("auto", "gelu")
    assert bank.backend == "grouped"
    assert bank.double().backend == "reference"
    assert bank.float().backend == "grouped"
    assert bank.backend_for(torch.device("cpu"), torch.bfloat16) == "grouped"


def test_auto_backend_resolves_to_a_concrete_one():
    bank = ExpertBank(ExpertConfig(d_model=D, d_hidden=H, num_experts=2))
    assert bank.backend == ("grouped" if grouped_mm_available() else "reference")
    assert bank.backend_for(torch.device("cpu"), torch.float64) == "reference"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error; this machine has CUDA")
def test_megablocks_backend_needs_cuda():
    with pytest.raises(ValueError, match=r"backend='megablocks': needs a CUDA GPU"):
        ExpertBank(ExpertConfig(d_model=D, d_hidden=H, num_experts=2, backend="megablocks"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="bfloat16 CUDA kernels: needs a CUDA GPU")
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("backend", ["megablocks", "grouped"])
def test_cuda_bf16_backends_match_reference_with_padding(activation, backend):
    if backend == "megablocks":
        pytest.importorskip("grouped_gemm", reason="megablocks' grouped_gemm is not installed")
    elif not grouped_mm_available():
        pytest.skip(f"torch {torch.__version__} has no usable torch._grouped_mm")
    dev = torch.device("cuda")
    ref = make_bank("reference", activation, torch.bfloat16).to(dev)
    fast = make_bank(backend, activation, torch.bfloat16).to(dev)
    assert fast.backend == backend
    x = torch.randn(N_REAL + N_PAD, D, dtype=torch.bfloat16, device=dev)
    x[N_REAL:] = float("nan")
    grad_out = torch.randn_like(x)
    got, want = run_bank(fast, x, COUNTS, grad_out), run_bank(ref, x, COUNTS, grad_out)
    assert torch.equal(got[0][N_REAL:], torch.zeros_like(got[0][N_REAL:]))
    assert torch.equal(got[1][N_REAL:], torch.zeros_like(got[1][N_REAL:]))
    for name, g, w in zip(["y", "x.grad", "w_in.grad", "w_out.grad"], got, want):
        torch.testing.assert_close(g.float(), w.float(), rtol=3e-2, atol=3e-2, msg=name)


# -- the fused SwiGLU, routing gates inside the bank, and the unpadded promise ------------------------


def test_swiglu_op_is_bitwise_the_autograd_formula():
    from mode.experts.bank import activate
    from mode.experts.swiglu import swiglu

    h = torch.randn(37, 2 * 12)
    gate = torch.rand(37)
    dy = torch.randn(37, 12)
    for use_gate in (False, True):
        h1, h2 = h.clone().requires_grad_(), h.clone().requires_grad_()
        g1, g2 = gate.clone().requires_grad_(), gate.clone().requires_grad_()
        y1 = swiglu(h1, g1 if use_gate else None)
        y2 = activate(h2, "swiglu") * (g2[:, None] if use_gate else 1)
        assert torch.equal(y1, y2)
        y1.backward(dy), y2.backward(dy)
        assert torch.equal(h1.grad, h2.grad)
        if use_gate:
            assert torch.equal(g1.grad, g2.grad)


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("hidden", [8, 24])  # H < D: gates applied on the (A, H) activation; H > D: on the output
@pytest.mark.parametrize("poison", [None, float("nan")])
def test_gates_inside_the_bank_match_gating_the_output_every_backend(activation, hidden, poison):
    """bank(x, counts, gate_A=g) == bank(x, counts) * g[:, None] (values and the gradients of x, g, weights);
    padding rows (here with NaN inputs and NaN gates) give zero output and zero gradients."""
    counts, n_pad = [3, 0, 5, 1], 4
    A = sum(counts) + n_pad
    x = torch.randn(A, D)
    gate = torch.rand(A)
    if poison is not None:
        x[sum(counts) :] = poison
        gate[sum(counts) :] = poison
    grad_out = torch.randn(A, D)
    results = {}
    for backend in CPU_BACKENDS:
        for inside in (True, False):
            torch.manual_seed(0)
            bank = ExpertBank(
                ExpertConfig(d_model=D, d_hidden=hidden, num_experts=4, activation=activation, backend=backend)
            )
            xr, gr = x.clone().requires_grad_(), gate.clone().requires_grad_()
            c = torch.tensor(counts)
            if inside:
                y = bank(xr, c, gate_A=gr)
            else:  # the reference composition: ungated bank, then the gate (padding gates zeroed first)
                y = bank(xr, c) * torch.where(torch.arange(A) < sum(counts), gr, 0)[:, None]
            y.backward(grad_out)
            results[backend, inside] = (y.detach(), xr.grad, gr.grad, bank.w_in_EDF.grad, bank.w_out_EHD.grad)
    want = results["reference", False]
    for key, got in results.items():
        for name, g, w in zip(["y", "x.grad", "gate.grad", "w_in.grad", "w_out.grad"], got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=f"{key} {name}")
        y, x_grad, gate_grad = got[:3]
        assert torch.equal(y[sum(counts) :], torch.zeros(n_pad, D)), key
        assert torch.equal(x_grad[sum(counts) :], torch.zeros(n_pad, D)), key
        assert torch.equal(gate_grad[sum(counts) :], torch.zeros(n_pad)), key


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_unpadded_promise_changes_nothing_when_kept(activation):
    """padded=False (no masks) gives the same bits as the masked path when counts_E.sum() == A."""
    counts = [3, 0, 5, 1]
    x = torch.randn(sum(counts), D)
    grad_out = torch.randn(sum(counts), D)
    got = {}
    for padded in (True, False):
        bank = make_bank("grouped", activation)
        xr = x.clone().requires_grad_()
        y = bank(xr, torch.tensor(counts), padded=padded)
        y.backward(grad_out)
        got[padded] = (y.detach(), xr.grad, bank.w_in_EDF.grad, bank.w_out_EHD.grad)
    for a, b in zip(got[True], got[False]):
        assert torch.equal(a, b)


def test_gate_of_the_wrong_shape_is_rejected():
    bank = make_bank("grouped", "swiglu")
    with pytest.raises(ValueError, match=r"gate_A: must be a floating tensor of shape \(A,\)=\(9,\)"):
        bank(torch.randn(9, D), torch.tensor(COUNTS), gate_A=torch.rand(8))


@pytest.mark.parametrize("backend", ["reference", "grouped"])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_efd_layout_computes_what_edf_computes_on_the_same_weights(activation, backend):
    """layout="EFD" (transformers' gate_up_proj / down_proj order) holds the transposes and computes the same
    function: outputs, input gradients and (transposed) weight gradients, with padding and gates."""
    cfg = ExpertConfig(d_model=16, d_hidden=24, num_experts=4, activation=activation, backend=backend)
    edf = ExpertBank(cfg)
    efd = ExpertBank(ExpertConfig(**{**cfg.__dict__, "layout": "EFD"}))
    assert sorted(n for n, _ in efd.named_parameters()) == ["w_in_EFD", "w_out_EDH"]
    with torch.no_grad():
        efd.w_in_EFD.copy_(edf.w_in_EDF.transpose(1, 2))
        efd.w_out_EDH.copy_(edf.w_out_EHD.transpose(1, 2))
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(12, 16)  # 10 real rows, 2 padding
    gate = torch.rand(12)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = edf(xa, counts, gate_A=gate), efd(xb, counts, gate_A=gate)
    # the transposed weights make the GEMM kernels sum in another order: bounds scaled to each tensor
    assert_close_scaled(yb, ya, REL, "y")
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    assert_close_scaled(xb.grad, xa.grad, REL, "x.grad")
    assert_close_scaled(efd.w_in_EFD.grad, edf.w_in_EDF.grad.transpose(1, 2), REL, "w_in.grad")
    assert_close_scaled(efd.w_out_EDH.grad, edf.w_out_EHD.grad.transpose(1, 2), REL, "w_out.grad")
    assert efd.w_in is efd.w_in_EFD and edf.w_out is edf.w_out_EHD


def test_layout_is_checked():
    with pytest.raises(ValueError, match="layout='DEF'"):
        ExpertConfig(d_model=16, d_hidden=16, num_experts=2, layout="DEF")


def test_sharding_an_efd_bank_keeps_its_layout_and_rows():
    from mode.parallel.ep_model import shard_experts

    full = ExpertBank(ExpertConfig(d_model=16, d_hidden=16, num_experts=4, activation="swiglu", layout="EFD"))
    shard = shard_experts(full, 1, 2)
    assert shard.cfg.layout == "EFD" and shard.num_experts == 2
    assert torch.equal(shard.w_in_EFD, full.w_in_EFD[2:]) and torch.equal(shard.w_out_EDH, full.w_out_EDH[2:])

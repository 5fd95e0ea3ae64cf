"""Expert bank: every backend computes the same function, outputs and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mode.experts import ExpertBank, ExpertConfig

D, H = 16, 24
COUNTS = [3, 0, 5, 1]  # uneven, expert 1 has no rows


def make_bank(backend, activation, dtype=torch.float32, counts=COUNTS):
    torch.manual_seed(0)  # same weights for every backend
    return ExpertBank(ExpertConfig(d_model=D, d_hidden=H, num_experts=len(counts), activation=activation,
                                   backend=backend)).to(dtype)


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


@pytest.mark.parametrize("backend", ["reference", "grouped"])
def test_all_rows_zero(backend):
    bank = make_bank(backend, "gelu")
    y = bank(torch.randn(0, D), torch.tensor([0, 0, 0, 0]))
    assert y.shape == (0, D)


def test_auto_backend_resolves_to_a_concrete_one():
    bank = ExpertBank(ExpertConfig(d_model=D, d_hidden=H, num_experts=2))
    assert bank.backend == ("grouped" if hasattr(torch, "_grouped_mm") else "reference")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error; this machine has CUDA")
def test_megablocks_backend_needs_cuda():
    with pytest.raises(ValueError, match=r"backend='megablocks': needs a CUDA GPU"):
        ExpertBank(ExpertConfig(d_model=D, d_hidden=H, num_experts=2, backend="megablocks"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="backend='megablocks' needs a CUDA GPU and megablocks")
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_megablocks_matches_reference(activation):
    pytest.importorskip("grouped_gemm", reason="megablocks' grouped_gemm is not installed")
    dev = torch.device("cuda")
    ref = make_bank("reference", activation, torch.bfloat16).to(dev)
    mb = make_bank("megablocks", activation, torch.bfloat16).to(dev)
    x = torch.randn(sum(COUNTS), D, dtype=torch.bfloat16, device=dev)
    grad_out = torch.randn_like(x)
    got, want = run_bank(mb, x, COUNTS, grad_out), run_bank(ref, x, COUNTS, grad_out)
    for name, g, w in zip(["y", "x.grad", "w_in.grad", "w_out.grad"], got, want):
        torch.testing.assert_close(g.float(), w.float(), rtol=3e-2, atol=3e-2, msg=name)

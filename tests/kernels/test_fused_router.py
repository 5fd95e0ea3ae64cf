"""mode.kernels.router: the Triton kernels against float64 truth, the reference backward against autograd, the
op against TokenChoiceRouter's own losses, statistics, gates and logit gradients, opcheck, one op per direction."""

from __future__ import annotations

import pytest
import torch

import mode.kernels.router as kr
from mode.kernels import router_topk
from mode.measure.op_count import OpCounter
from mode.routing import TokenChoiceConfig, TokenChoiceRouter

# (T, X, K): X past one power of two, X = 256 (the widest block), K = X, one row
CASES = [(37, 8, 2), (9, 200, 6), (5, 3, 3), (1, 256, 8), (0, 8, 2)]
# 32 float32 units in the last place, relative: measured worst 6.0e-7 (gates), 4.8e-7 (sums), 5.4e-7 (logit
# gradients, relative to their largest, away from the sigmoid's cancellation) in the interpreter over these
# cases and seeds 0-2, logits ~ N(0, 3)
RTOL = 32 * torch.finfo(torch.float32).eps


def make(T, X, masked, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(T, X, generator=g) * 3).to(device)
    valid = (torch.rand(T, generator=g) > 0.3).to(device) if masked else None
    return logits, valid


@pytest.mark.parametrize("T,X,k", CASES)
@pytest.mark.parametrize("gate", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_triton_matches_float64_truth(kernel_device, T, X, k, gate, renormalize, masked):
    logits, valid = make(T, X, masked, kernel_device)
    opts = (k, gate, renormalize, 2.5)
    gate_TK, chosen_TK, sums_S, count_X = kr.router_triton(logits, valid, *opts)
    valid_cpu = None if valid is None else valid.cpu()
    g64, c64, s64, n64 = kr.router_reference(logits.cpu().double(), valid_cpu, *opts)
    assert torch.equal(chosen_TK.cpu(), c64) and torch.equal(count_X.cpu(), n64)
    assert chosen_TK.dtype == count_X.dtype == torch.int64
    for name, got, want in (("gate_TK", gate_TK, g64), ("sums_S", sums_S, s64)):
        err = (got.cpu().double() - want).abs()
        assert bool((err <= RTOL * want.abs()).all()), (name, (err / want.abs()).max().item())

    dgate_TK = torch.randn(T, k).to(kernel_device)
    dsums_S = torch.randn(X + 2).to(kernel_device)
    got = kr.router_backward_triton(dgate_TK, dsums_S, logits, valid, chosen_TK, *opts).cpu().double()
    want = kr.router_backward_reference(
        dgate_TK.cpu().double(), dsums_S.cpu().double(), logits.cpu().double(), valid_cpu, c64, *opts
    )
    ref = kr.router_backward_reference(dgate_TK.cpu(), dsums_S.cpu(), logits.cpu(), valid_cpu, c64, *opts).double()
    assert got.shape == (T, X)
    if T:  # s (1 - s) cancels for a large logit, in any float32 formula: the bound allows twice the float32
        # reference's own error there, plus RTOL of the largest gradient
        err, ref_err = (got - want).abs(), (ref - want).abs()
        bound = 2 * ref_err + RTOL * want.abs().max()
        assert bool((err <= bound).all()), (err / bound).max().item()


def test_ties_go_to_the_lowest_slot(kernel_device):
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]], device=kernel_device)
    _, chosen, _, count = kr.router_triton(logits, None, 2, "softmax", False, 1.0)
    assert chosen.cpu().tolist() == [[1, 2]] and count.cpu().tolist() == [0, 1, 1, 0, 0]


@pytest.mark.parametrize("gate", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_reference_backward_is_the_gradient(gate, renormalize, masked):
    """The torch backward formula against autograd through the reference forward, in float64."""
    logits, valid = make(11, 6, masked, "cpu", seed=1)
    logits = logits.double().requires_grad_()
    gate_TK, chosen_TK, sums_S, _ = kr.router_reference(logits, valid, 3, gate, renormalize, 1.5)
    dgate_TK, dsums_S = torch.randn(11, 3, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    dsums_S[-1] = 0  # the entropy sum is a statistic: the op gives it no gradient
    (gate_TK * dgate_TK).sum().add((sums_S * dsums_S).sum()).backward()
    got = kr.router_backward_reference(dgate_TK, dsums_S, logits.detach(), valid, chosen_TK, 3, gate, renormalize, 1.5)
    torch.testing.assert_close(got, logits.grad, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("gate", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_op_reproduces_the_token_choice_router(gate, renormalize, masked):
    """On the CPU the op's outputs give the router's balance loss, z-loss, entropy, choice counts and gates bit
    for bit, and the gradient of gates and losses w.r.t. the logits within float32 rounding (summed in
    another order)."""
    E, K, B, S = 8, 2, 2, 6
    cfg = TokenChoiceConfig(d_model=16, num_experts=E, top_k=K, gate=gate, renormalize=renormalize, scale=1.5)
    router = TokenChoiceRouter(cfg)
    x = torch.randn(B, S, 16)
    mask = (torch.rand(B, S) > 0.3) if masked else None
    plan = router(x, mask)
    plan.logits_TX.retain_grad()
    T = B * S
    valid = None if mask is None else mask.reshape(T)
    logits = plan.logits_TX.detach().requires_grad_()
    out = router_topk(logits, K, gate=gate, renormalize=renormalize, scale=1.5, valid_T=valid)
    n = T if valid is None else valid.sum().clamp_min(1)
    stats = plan.aux.stats["router"]
    assert torch.equal(out.balance_loss(n), plan.aux.losses["balance"])
    assert torch.equal(out.z_sum / n, plan.aux.losses["z_loss"])
    assert torch.equal(out.entropy_sum / n, stats.entropy)
    assert torch.equal(out.count_X.float(), stats.requested_X)
    computed = plan.expert_idx_A < E
    dense_plan = torch.zeros(T, E).index_put_(
        (plan.token_idx_A[computed], plan.expert_idx_A[computed]), plan.weight_A[computed].detach()
    )
    dense_op = torch.zeros(T, E).scatter_(1, out.chosen_TK, out.gate_TK.detach())
    keep = torch.ones(T, dtype=torch.bool) if valid is None else valid
    assert torch.equal(dense_op[keep], dense_plan[keep])

    r_TE = torch.randn(T, E)  # a downstream use of the gates, plus the aux losses
    (plan.weight_A * r_TE[plan.token_idx_A, plan.expert_idx_A.clamp_max(E - 1)]).sum().add(plan.aux.total()).backward()
    loss = (out.gate_TK * r_TE.gather(1, out.chosen_TK) * keep[:, None]).sum()
    loss = loss + cfg.balance_coef * out.balance_loss(n) + cfg.z_coef * out.z_sum / n
    loss.backward()
    torch.testing.assert_close(logits.grad, plan.logits_TX.grad, rtol=0, atol=RTOL * plan.logits_TX.grad.abs().max())


@pytest.mark.parametrize("gate", ["softmax", "sigmoid"])
@pytest.mark.parametrize("masked", [False, True])
def test_opcheck(gate, masked):
    logits, valid = make(7, 5, masked, "cpu")
    torch.library.opcheck(torch.ops.mode_kernels.router.default, (logits.requires_grad_(), valid, 2, gate, True, 1.0))
    _, chosen, _, _ = kr.router_reference(logits.detach(), valid, 2, gate, True, 1.0)
    torch.library.opcheck(
        torch.ops.mode_kernels.router_backward.default,
        (torch.randn(7, 2), torch.randn(7), logits.detach(), valid, chosen, 2, gate, True, 1.0),
    )


def test_one_op_each_way():
    logits = torch.randn(6, 4, requires_grad=True)
    with OpCounter() as log:
        out = router_topk(logits, 2, renormalize=True)
        (out.gate_TK.sum() + out.z_sum + out.prob_sum_X.sum()).backward()
    assert [op for op in log.packets if op.startswith("mode_kernels")] == [
        "mode_kernels.router",
        "mode_kernels.router_backward",
    ]


def test_gradient_of_the_gates_alone():
    """Only the gates used: autograd hands the op no gradient for the sums, and it counts them as zero."""
    logits = torch.randn(5, 4, requires_grad=True)
    router_topk(logits, 2).gate_TK.sum().backward()
    plain = logits.detach().requires_grad_()
    plain.softmax(-1).topk(2).values.sum().backward()
    torch.testing.assert_close(logits.grad, plain.grad, rtol=0, atol=RTOL)


def test_bad_input_raises():
    logits = torch.randn(4, 6)
    with pytest.raises(TypeError, match="logits_TX"):
        router_topk(logits.half(), 2)
    with pytest.raises(TypeError, match="logits_TX"):
        router_topk(logits[0], 2)


def test_float64_logits_take_the_reference():
    """A float64 model (exactness runs, Trainer(dtype=torch.float64)) routes through the fused op's torch
    reference in float64: the same choices and gates as the float32 op on the same logits, to float32's rounding."""
    logits = torch.randn(16, 6, dtype=torch.float64)
    out64, out32 = router_topk(logits, 2, renormalize=True), router_topk(logits.float(), 2, renormalize=True)
    assert out64.gate_TK.dtype == torch.float64
    assert torch.equal(out64.chosen_TK, out32.chosen_TK)
    torch.testing.assert_close(out64.gate_TK.float(), out32.gate_TK, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="k=7"):
        router_topk(logits, 7)
    with pytest.raises(ValueError, match="gate='sqrtsoftplus'"):
        router_topk(logits, 2, gate="sqrtsoftplus")
    with pytest.raises(ValueError, match="scale"):
        router_topk(logits, 2, scale=0.0)
    with pytest.raises(ValueError, match="valid_T"):
        router_topk(logits, 2, valid_T=torch.ones(4))

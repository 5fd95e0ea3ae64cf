"""Edge inputs and precision: empty batches, autocast, float64, decimal capacities, static plans.

Each test here failed before the fix it guards (see the edge-inputs issue): empty inputs crashed inside
torch, routers left float32 under autocast, decimal capacities were off by one.
"""

from __future__ import annotations

import math

import pytest
import torch

from mode import (
    MLP,
    ExpertChoiceConfig,
    ExpertChoiceRouter,
    IntegratedMoDE,
    MoD,
    MoDRouter,
    MoDRouterConfig,
    MoEConfig,
    MoELayer,
    StagedMoDE,
    TokenChoiceConfig,
    TokenChoiceRouter,
    TransformerBlock,
)
from mode.measure.stats import RoutingAccumulator
from mode.model import LM, LMConfig
from mode.routing.capacity import ceil_of, floor_of

D, H = 16, 32


def moe(**kw) -> MoELayer:
    return MoELayer.from_config(MoEConfig(d_model=D, d_hidden=H, num_experts=4, **kw))


def layers() -> dict:
    return {
        "mod": lambda: MoD(TransformerBlock(D, 2, MLP(D, H)), MoDRouter(MoDRouterConfig(d_model=D))),
        "mod_no_skip": lambda: MoD(
            TransformerBlock(D, 2, MLP(D, H)), MoDRouter(MoDRouterConfig(d_model=D)), skip_empty=False
        ),
        "mod_causal": lambda: MoD(
            TransformerBlock(D, 2, MLP(D, H)), MoDRouter(MoDRouterConfig(d_model=D, causal="predictor"))
        ),
        "moe_tc": lambda: moe(top_k=2),
        "moe_tc_capacity": lambda: moe(top_k=2, capacity_factor=1.0),
        "moe_tc_reference": lambda: moe(backend="reference"),
        "moe_ec": lambda: moe(router="expert_choice"),
        "integrated": lambda: IntegratedMoDE.from_config(MoEConfig(d_model=D, d_hidden=H, num_experts=4, num_noop=2)),
        "staged": lambda: StagedMoDE(TransformerBlock(D, 2, moe()), MoDRouter(MoDRouterConfig(d_model=D))),
        "staged_no_skip": lambda: StagedMoDE(
            TransformerBlock(D, 2, moe()), MoDRouter(MoDRouterConfig(d_model=D)), skip_empty=False
        ),
        "block_moe": lambda: TransformerBlock(D, 2, moe()),
    }


# ------------------------------------------------------------------------------------------ empty inputs


@pytest.mark.parametrize("shape", [(2, 0), (0, 5), (0, 0)], ids=["S=0", "B=0", "B=S=0"])
@pytest.mark.parametrize("name", list(layers()))
def test_empty_input_gives_empty_output_and_zero_counts(name, shape):
    layer = layers()[name]()
    x = torch.randn(*shape, D, requires_grad=True)
    y, aux = layer(x)
    assert y.shape == x.shape
    (y.sum() + aux.total()).backward()
    assert x.grad is not None and x.grad.shape == x.shape
    for key, st in aux.stats.items():
        assert st.tokens.item() == 0, key
        assert st.kept_E.sum().item() == 0 and st.compute_T.numel() == 0, key
    for key, loss in aux.losses.items():
        assert torch.isfinite(loss).all() and loss.item() == 0, key  # no NaN from a mean over nothing
    acc = RoutingAccumulator()
    acc.add(aux)
    for key in aux.stats:
        assert acc.router_summary(key)["tokens"] == 0


@pytest.mark.parametrize("name", ["mod", "moe_tc", "moe_ec", "integrated", "staged"])
def test_empty_input_with_a_mask(name):
    layer = layers()[name]()
    y, aux = layer(torch.randn(2, 0, D), torch.ones(2, 0, dtype=torch.bool))
    assert y.shape == (2, 0, D)


def test_lm_on_empty_batch():
    lm = LM(
        LMConfig(
            vocab_size=32,
            seq_len=16,
            d_model=D,
            n_heads=2,
            d_hidden=H,
            layers=("dense", "mod", "moe", "staged", "integrated"),
            num_noop=1,
            num_experts=4,
        )
    )
    out = lm(torch.zeros(0, 16, dtype=torch.long))
    assert out.logits_BSV.shape == (0, 16, 32)


# ------------------------------------------------------------------------------------------------ autocast


ROUTERS = {
    "mod": lambda: MoDRouter(MoDRouterConfig(d_model=D, causal="predictor")),
    "token_choice": lambda: TokenChoiceRouter(TokenChoiceConfig(d_model=D, num_experts=4, top_k=2)),
    "expert_choice": lambda: ExpertChoiceRouter(ExpertChoiceConfig(d_model=D, num_experts=4)),
}


@pytest.mark.parametrize("name", list(ROUTERS))
def test_routers_compute_in_float32_under_autocast(name):
    router = ROUTERS[name]()
    x = torch.randn(2, 32, D)
    plain = router(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = router(x)
    assert auto.weight_A.dtype == torch.float32
    assert all(v.dtype == torch.float32 for v in auto.aux.losses.values())
    # the same routing and the same gates as without autocast: nothing was computed in bf16
    assert torch.equal(auto.token_idx_A, plain.token_idx_A) and torch.equal(auto.expert_idx_A, plain.expert_idx_A)
    torch.testing.assert_close(auto.weight_A, plain.weight_A, rtol=0, atol=0)


def test_mod_causal_decision_float32_under_autocast():
    router = ROUTERS["mod"]()
    x = torch.randn(2, 32, D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = router.decision_logits(x, router.scores(x))
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, router.decision_logits(x, router.scores(x)), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["moe_tc", "moe_ec", "integrated", "mod", "staged"])
def test_layers_train_under_bf16_autocast(name):
    layer = layers()[name]()
    x = torch.randn(2, 16, D, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, aux = layer(x)
    (y.float().sum() + aux.total()).backward()
    assert torch.isfinite(x.grad).all()
    grads = [p.grad for n, p in layer.named_parameters() if "router" in n and "predictor" not in n]
    assert grads and all(g is not None and g.dtype == torch.float32 for g in grads)


# ------------------------------------------------------------------------------------------------ float64


@pytest.mark.parametrize("name", ["moe_tc", "moe_ec", "integrated", "staged", "mod"])
def test_float64_with_the_default_backend(name):
    torch.manual_seed(0)
    layer = layers()[name]().double()
    x = torch.randn(2, 8, D, dtype=torch.float64, requires_grad=True)
    y, aux = layer(x)
    assert y.dtype == torch.float64
    (y.sum() + aux.total()).backward()
    assert x.grad.dtype == torch.float64


# --------------------------------------------------------------------------------------- decimal capacity


def test_decimal_helpers_read_what_was_written():
    assert math.floor(0.29 * 100) == 28  # the float trap this guards against
    assert floor_of(0.29, 100) == 29
    assert math.ceil(1.1 * 100 / 11) == 11
    assert ceil_of(1.1, 100, 11) == 10
    assert floor_of(0.125, 512) == 64 and ceil_of(1.25, 4096 * 2, 8) == 1280
    assert floor_of(1 / 3, 3) == 0  # 0.3333333333333333 as written is below 1/3: floor(0.999...) = 0


def test_mod_capacity_0_29_routes_29_of_100():
    router = MoDRouter(MoDRouterConfig(d_model=D, capacity=0.29))
    plan = router(torch.randn(3, 100, D))
    assert plan.seq_capacity == 29 and plan.num_assignments == 3 * 29


def test_expert_choice_capacity_1_1_picks_10_of_100_with_11_slots():
    router = ExpertChoiceRouter(ExpertChoiceConfig(d_model=D, num_experts=11, capacity_factor=1.1))
    assert router.tokens_per_slot(100) == 10
    plan = router(torch.randn(1, 100, D))
    assert plan.counts_E.tolist() == [10] * 11


def test_token_choice_capacity_1_1_keeps_10_per_expert():
    router = TokenChoiceRouter(TokenChoiceConfig(d_model=D, num_experts=11, capacity_factor=1.1))
    assert router.capacity(100) == 10
    with torch.no_grad():
        router.weight.zero_()
        router.weight[0, 0] = 1.0  # everyone picks expert 0
    x = torch.zeros(1, 100, D)
    x[..., 0] = 1.0
    plan = router(x)
    assert plan.counts_E.tolist() == [10] + [0] * 10
    assert plan.aux.stats["router"].dropped.item() == 90


# ----------------------------------------------------------------------------------------- static plans


@pytest.mark.parametrize(
    "cfg",
    [
        dict(num_experts=4, top_k=2, num_noop=2),
        dict(num_experts=4, top_k=1, capacity_factor=0.5),
    ],
    ids=["noop", "capacity"],
)
def test_token_choice_plan_is_static_with_padding_last(cfg):
    router = TokenChoiceRouter(TokenChoiceConfig(d_model=D, **cfg))
    mask = torch.ones(2, 16, dtype=torch.bool)
    mask[1, 10:] = False
    plan = router(torch.randn(2, 16, D), mask)
    T, K, E = 32, cfg["top_k"], cfg["num_experts"]
    assert plan.num_assignments == T * K  # static: depends on shapes and config only
    n = int(plan.counts_E.sum())
    assert n < T * K  # some choices are no-ops, drops or padding
    assert (plan.expert_idx_A[:n] < E).all() and (plan.expert_idx_A[n:] == E).all()
    assert (plan.weight_A[n:] == 0).all()
    assert plan.computed_A().sum().item() == n
    compact = plan.compact()
    assert compact.num_assignments == n and torch.equal(compact.token_idx_A, plan.token_idx_A[:n])


def test_expert_choice_plan_is_static_under_a_mask():
    router = ExpertChoiceRouter(ExpertChoiceConfig(d_model=D, num_experts=2))
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[1, 2:] = False
    a = router(torch.randn(2, 8, D), mask)
    b = router(torch.randn(2, 8, D))
    assert a.num_assignments == b.num_assignments == 2 * 4 * 2
    assert a.counts_E.tolist() == [6, 6]


def test_padding_assignments_never_change_the_output():
    """Garbage in the padding rows (they point at real tokens) must not leak into y or the gradients."""
    torch.manual_seed(0)
    layer = moe(top_k=2, num_noop=2)
    x = torch.randn(2, 16, D, requires_grad=True)
    y, aux = layer(x)
    y.sum().backward()
    plan = layer.router(x.detach()).compact()
    ref = torch.zeros(32, D)
    w_in, w_out = layer.experts.w_in_EDF.detach(), layer.experts.w_out_EHD.detach()
    for t, e, g in zip(plan.token_idx_A.tolist(), plan.expert_idx_A.tolist(), plan.weight_A.tolist()):
        ref[t] += g * (torch.nn.functional.gelu(x[0 if t < 16 else 1, t % 16].detach() @ w_in[e]) @ w_out[e])
    torch.testing.assert_close(y.detach().reshape(32, D), ref, rtol=1e-5, atol=1e-6)

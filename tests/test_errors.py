"""Every user mistake raises ValueError/TypeError whose message names the field, the value and the rule."""

from __future__ import annotations

import re

import pytest
import torch

from mode import (
    MLP,
    ExpertBank,
    ExpertChoiceConfig,
    ExpertChoiceRouter,
    ExpertConfig,
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

D = 8


def lit(text: str) -> str:
    """The literal message fragment as a regex."""
    return re.escape(text)


# ------------------------------------------------------------------------------------------------- configs


@pytest.mark.parametrize("capacity", [0, 0.0, 1.5, -0.1, float("nan"), float("inf")])
def test_mod_capacity_outside_unit_interval(capacity):
    with pytest.raises(ValueError, match=lit(f"capacity={capacity}: must be in (0, 1]")):
        MoDRouterConfig(d_model=D, capacity=capacity)


@pytest.mark.parametrize("capacity", ["0.5", None, True])
def test_mod_capacity_wrong_type(capacity):
    with pytest.raises(TypeError, match=lit(f"capacity={capacity!r}: must be a float in (0, 1]")):
        MoDRouterConfig(d_model=D, capacity=capacity)


def test_mod_capacity_one_is_allowed():
    assert MoDRouterConfig(d_model=D, capacity=1).capacity == 1.0


def test_top_k_larger_than_slots():
    with pytest.raises(ValueError, match=lit("top_k=4: must be <= num_experts + num_noop = 3")):
        TokenChoiceConfig(d_model=D, num_experts=2, num_noop=1, top_k=4)
    with pytest.raises(ValueError, match=lit("top_k=3: must be <= num_experts + num_noop = 2")):
        MoEConfig(d_model=D, d_hidden=D, num_experts=2, top_k=3)
    TokenChoiceConfig(d_model=D, num_experts=2, num_noop=1, top_k=3)  # the boundary is allowed


def test_top_k_zero():
    with pytest.raises(ValueError, match=lit("top_k=0: must be >= 1")):
        TokenChoiceConfig(d_model=D, num_experts=2, top_k=0)


@pytest.mark.parametrize(
    "make",
    [
        lambda: TokenChoiceConfig(d_model=D, num_experts=0),
        lambda: ExpertChoiceConfig(d_model=D, num_experts=0),
        lambda: ExpertConfig(d_model=D, d_hidden=D, num_experts=0),
        lambda: MoEConfig(d_model=D, d_hidden=D, num_experts=0),
    ],
)
def test_zero_experts(make):
    with pytest.raises(ValueError, match=lit("num_experts=0: must be >= 1")):
        make()


def test_num_experts_not_an_int():
    with pytest.raises(TypeError, match=lit("num_experts=2.0: must be an int")):
        TokenChoiceConfig(d_model=D, num_experts=2.0)


def test_negative_noop():
    with pytest.raises(ValueError, match=lit("num_noop=-1: must be >= 0")):
        TokenChoiceConfig(d_model=D, num_experts=2, num_noop=-1)


@pytest.mark.parametrize(
    "field,value", [("capacity_factor", 0.0), ("capacity_factor", -1.0), ("capacity_factor", float("inf"))]
)
def test_bad_capacity_factor(field, value):
    with pytest.raises(ValueError, match=lit(f"{field}={value}: must be finite and > 0")):
        TokenChoiceConfig(d_model=D, num_experts=2, **{field: value})
    with pytest.raises(ValueError, match=lit(f"{field}={value}: must be finite and > 0")):
        ExpertChoiceConfig(d_model=D, num_experts=2, **{field: value})


def test_negative_loss_coefficients():
    with pytest.raises(ValueError, match=lit("balance_coef=-0.1: must be finite and >= 0")):
        TokenChoiceConfig(d_model=D, num_experts=2, balance_coef=-0.1)
    with pytest.raises(ValueError, match=lit("z_coef=nan: must be finite and >= 0")):
        ExpertChoiceConfig(d_model=D, num_experts=2, z_coef=float("nan"))


@pytest.mark.parametrize(
    "make,field,value",
    [
        (lambda: ExpertConfig(d_model=D, d_hidden=D, num_experts=2, backend="cuda"), "backend", "cuda"),
        (lambda: MoEConfig(d_model=D, d_hidden=D, backend="triton"), "backend", "triton"),
        (lambda: ExpertConfig(d_model=D, d_hidden=D, num_experts=2, activation="relu"), "activation", "relu"),
        (lambda: MLP(D, D, activation="tanh"), "activation", "tanh"),
        (lambda: MoDRouterConfig(d_model=D, gate="softmax"), "gate", "softmax"),
        (lambda: TokenChoiceConfig(d_model=D, num_experts=2, gate="raw"), "gate", "raw"),
        (lambda: MoEConfig(d_model=D, d_hidden=D, gate="tanh"), "gate", "tanh"),
        (lambda: MoEConfig(d_model=D, d_hidden=D, router="hash"), "router", "hash"),
    ],
)
def test_unknown_names(make, field, value):
    with pytest.raises(ValueError, match=lit(f"{field}={value!r}: must be one of")):
        make()


def test_unknown_name_lists_the_choices():
    with pytest.raises(ValueError, match=lit("'reference', 'grouped'")):
        ExpertConfig(d_model=D, d_hidden=D, num_experts=2, backend="fast")


@pytest.mark.parametrize("d_model", [0, -3])
def test_bad_d_model(d_model):
    with pytest.raises(ValueError, match=lit(f"d_model={d_model}: must be >= 1")):
        MoDRouterConfig(d_model=d_model)


def test_attention_heads_must_split_evenly():
    with pytest.raises(ValueError, match=lit("n_heads=3: d_model=8 must split into heads of even size")):
        TransformerBlock(D, 3, MLP(D, D))


# -------------------------------------------------------------------------------------------------- inputs

ROUTERS = {
    "mod": lambda: MoDRouter(MoDRouterConfig(d_model=D, capacity=0.5)),
    "token_choice": lambda: TokenChoiceRouter(TokenChoiceConfig(d_model=D, num_experts=2, num_noop=1)),
    "expert_choice": lambda: ExpertChoiceRouter(ExpertChoiceConfig(d_model=D, num_experts=2)),
    "moe_layer": lambda: MoELayer.from_config(MoEConfig(d_model=D, d_hidden=D, num_experts=2)),
    "mod_layer": lambda: MoD(TransformerBlock(D, 2, MLP(D, D)), MoDRouter(MoDRouterConfig(d_model=D))),
}
ROUTER_NAMES = {
    "mod": "MoDRouter",
    "token_choice": "TokenChoiceRouter",
    "expert_choice": "ExpertChoiceRouter",
    "moe_layer": "TokenChoiceRouter",
    "mod_layer": "MoDRouter",
}


@pytest.mark.parametrize("name", list(ROUTERS))
@pytest.mark.parametrize("shape", [(4, D), (1, 2, 4, D)])
def test_wrong_input_rank(name, shape):
    with pytest.raises(ValueError, match=lit(f"x.shape={shape}: must have rank 3 ((B, S, D))")):
        ROUTERS[name]()(torch.randn(*shape))


@pytest.mark.parametrize("name", list(ROUTERS))
def test_wrong_hidden_size(name):
    with pytest.raises(ValueError, match=lit(f"x.shape[-1]={D + 1}: must equal d_model={D}")):
        ROUTERS[name]()(torch.randn(2, 4, D + 1))


@pytest.mark.parametrize("name", list(ROUTERS))
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_non_floating_input(name, dtype):
    with pytest.raises(TypeError, match=lit(f"x.dtype={dtype}: must be a floating dtype")):
        ROUTERS[name]()(torch.ones(2, 4, D, dtype=dtype))


@pytest.mark.parametrize("name", list(ROUTERS))
def test_not_a_tensor(name):
    with pytest.raises(TypeError, match=lit("x: expected a torch.Tensor, got list")):
        ROUTERS[name]()([[[0.0] * D]])


@pytest.mark.device_assert("every router's finite check is a torch._assert_async on CUDA")
@pytest.mark.parametrize("name", list(ROUTERS))
@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_non_finite_router_logits(name, bad):
    module = ROUTERS[name]()
    router = module.router if hasattr(module, "router") else module
    with torch.no_grad():
        router.weight.fill_(1.0)  # logits are sums of the input: one inf input -> inf logit, not nan
    x = torch.randn(2, 4, D)
    x[1, 2, 3] = float(bad)
    with pytest.raises(ValueError, match=lit(f"{ROUTER_NAMES[name]}: ") + r"\d+ router logits are NaN or inf"):
        module(x)


def test_non_finite_check_can_be_disabled():
    router = MoDRouter(MoDRouterConfig(d_model=D, capacity=0.5, check_finite=False))
    x = torch.randn(1, 4, D)
    x[0, 0, 0] = float("nan")
    router(x)  # no error: the caller opted out of the host sync


@pytest.mark.parametrize("name", list(ROUTERS))
def test_bad_mask_dtype(name):
    with pytest.raises(TypeError, match=lit("mask: must be a torch.bool tensor (True = real token), got torch.int64")):
        ROUTERS[name]()(torch.randn(2, 4, D), torch.ones(2, 4, dtype=torch.long))


@pytest.mark.parametrize("name", list(ROUTERS))
@pytest.mark.parametrize("shape", [(2, 5), (4,), (2, 4, 1)])
def test_bad_mask_shape(name, shape):
    with pytest.raises(ValueError, match=lit(f"mask.shape={shape}: must equal (2, 4)")):
        ROUTERS[name]()(torch.randn(2, 4, D), torch.ones(*shape, dtype=torch.bool))


def test_expert_choice_capacity_factor_too_large_for_sequence():
    # 2 slots, S = 4: each slot would pick ceil(3 * 4 / 2) = 6 > 4 tokens.
    router = ExpertChoiceRouter(ExpertChoiceConfig(d_model=D, num_experts=2, capacity_factor=3.0))
    with pytest.raises(
        ValueError,
        match=lit(
            "capacity_factor=3.0: each of the 2 expert slots would pick 6 tokens "
            "but a sequence has only 4; must be <= num_slots = 2"
        ),
    ):
        router(torch.randn(1, 4, D))
    # The boundary is allowed: capacity_factor = num_slots makes every slot pick the whole sequence.
    ExpertChoiceRouter(ExpertChoiceConfig(d_model=D, num_experts=2, capacity_factor=2.0))(torch.randn(1, 4, D))


def test_expert_choice_capacity_factor_too_large_through_moe_layer():
    layer = MoELayer.from_config(
        MoEConfig(d_model=D, d_hidden=D, num_experts=2, num_noop=1, router="expert_choice", capacity_factor=4.0)
    )
    with pytest.raises(ValueError, match=lit("capacity_factor=4.0: each of the 3 expert slots")):
        layer(torch.randn(1, 4, D))


# -------------------------------------------------------------------------------------------------- layers


@pytest.mark.parametrize("router", ["token_choice", "expert_choice"])
def test_integrated_mode_needs_a_noop_expert(router):
    with pytest.raises(ValueError, match=lit("num_noop=0: integrated MoDE needs at least one no-op expert")):
        IntegratedMoDE.from_config(MoEConfig(d_model=D, d_hidden=D, num_experts=2, router=router, num_noop=0))


def test_staged_mode_needs_an_moe_block():
    block = TransformerBlock(D, 2, MLP(D, D))
    with pytest.raises(
        TypeError, match=lit("block.mlp=MLP: staged MoDE needs a TransformerBlock whose mlp is a MoELayer")
    ):
        StagedMoDE(block, MoDRouter(MoDRouterConfig(d_model=D)))
    with pytest.raises(TypeError, match=lit("block.mlp=NoneType")):
        StagedMoDE(torch.nn.Linear(D, D), MoDRouter(MoDRouterConfig(d_model=D)))


def test_moe_layer_router_and_experts_disagree():
    router = TokenChoiceRouter(TokenChoiceConfig(d_model=D, num_experts=4))
    experts = ExpertBank(ExpertConfig(d_model=D, d_hidden=D, num_experts=3))
    with pytest.raises(ValueError, match=lit("router.num_experts=4: must equal experts.num_experts=3")):
        MoELayer(router, experts)
    with pytest.raises(ValueError, match=lit("router.num_experts=4: must equal experts.num_experts=3")):
        IntegratedMoDE(TokenChoiceRouter(TokenChoiceConfig(d_model=D, num_experts=4, num_noop=1)), experts)

"""Fuzz every public constructor and forward with bad and edge inputs.

Rule: each call either works or raises ``ValueError``/``TypeError`` whose message names the argument. Any
other exception (an error from deep inside torch, an ``AssertionError``, an ``IndexError``), or a message
that does not name the argument, fails. The number of cases is printed by ``test_case_count`` and quoted
in the README.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from mode import (
    MLP,
    CausalSelfAttention,
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
from mode.model import LM, LMConfig
from mode.model.generate import generate

D = 8
BAD_VALUES = [None, "x", -1, 0, 1.5, float("nan"), float("inf"), -float("inf"), True, 10**12, [], {}, 3]


def _ok_or_named_error(fn, name: str):
    """Run ``fn``; return "ok" or "error". Fail on any other exception or an error that does not name ``name``."""
    try:
        fn()
    except (ValueError, TypeError) as err:
        assert name in str(err), f"{type(err).__name__} does not name {name!r}: {err}"
        return "error"
    return "ok"


# --------------------------------------------------------------------------------------------- configs

BASE_CONFIGS = {
    MoDRouterConfig: dict(d_model=D),
    TokenChoiceConfig: dict(d_model=D, num_experts=4),
    ExpertChoiceConfig: dict(d_model=D, num_experts=4),
    MoEConfig: dict(d_model=D, d_hidden=16),
    ExpertConfig: dict(d_model=D, d_hidden=16, num_experts=4),
    LMConfig: dict(vocab_size=32, seq_len=16, d_model=D, n_heads=2, d_hidden=16),
}
CONFIG_CASES = [(cls, f.name, v) for cls in BASE_CONFIGS for f in dataclasses.fields(cls) for v in BAD_VALUES]


@pytest.mark.parametrize(
    "cls,field,value", CONFIG_CASES, ids=[f"{c.__name__}.{f}={v!r}"[:60] for c, f, v in CONFIG_CASES]
)
def test_config_fields(cls, field, value):
    kwargs = {**BASE_CONFIGS[cls], field: value}
    # Huge sizes are fine for a config (nothing is allocated); building modules from them is not fuzzed here.
    _ok_or_named_error(lambda: cls(**kwargs), field)


# ------------------------------------------------------------------------------------ module constructors

CTOR_CASES = [
    (MLP, dict(d_model=D, d_hidden=16, activation="gelu")),
    (CausalSelfAttention, dict(d_model=D, n_heads=2)),
    (TransformerBlock, dict(d_model=D, n_heads=2, mlp=None)),
]


@pytest.mark.parametrize("ctor,base", CTOR_CASES, ids=[c.__name__ for c, _ in CTOR_CASES])
@pytest.mark.parametrize("value", BAD_VALUES, ids=[repr(v)[:20] for v in BAD_VALUES])
def test_module_constructor_arguments(ctor, base, value):
    base = dict(base)
    if base.get("mlp", 0) is None:
        base["mlp"] = MLP(D, 16)
    for arg in base:
        if arg == "mlp":
            continue
        kwargs = {**base, arg: value}
        with torch.device("meta"):  # huge sizes must not allocate
            _ok_or_named_error(lambda: ctor(**kwargs), arg)  # noqa: B023 - called in this iteration


def test_layer_constructors_reject_wrong_parts():
    router = MoDRouter(MoDRouterConfig(d_model=D))
    block = TransformerBlock(D, 2, MLP(D, 16))
    moe = MoELayer.from_config(MoEConfig(d_model=D, d_hidden=16, num_experts=4))
    cases = [
        (lambda: MoD(block, "router"), "router"),
        (lambda: MoD("block", router), "block"),
        (lambda: MoD(block, router, skip_empty="no"), "skip_empty"),
        (lambda: StagedMoDE(block, router), "block.mlp"),
        (lambda: MoELayer("router", moe.experts), "router"),
        (lambda: MoELayer(moe.router, "experts"), "experts"),
        (lambda: IntegratedMoDE(moe.router, moe.experts), "num_noop"),
        (lambda: MoELayer(moe.router, ExpertBank(ExpertConfig(D, 16, 3))), "num_experts"),
        (lambda: MoEConfig(d_model=D, d_hidden=16, router="nope"), "router"),
        (lambda: MoEConfig(d_model=D, d_hidden=16, router_options={"nope": 1}), "router_options"),
        (lambda: LMConfig(layers=("dense", "nope")), "layers[1]"),
        (lambda: LMConfig(layers=()), "layers"),
        (lambda: LMConfig(d_model=10, n_heads=4), "d_model"),
    ]
    for fn, name in cases:
        assert _ok_or_named_error(fn, name) == "error", name


# ----------------------------------------------------------------------------------------------- forwards


def _layers() -> dict:
    moe = lambda **kw: MoELayer.from_config(MoEConfig(d_model=D, d_hidden=16, num_experts=4, **kw))  # noqa: E731
    return {
        "mod_router": MoDRouter(MoDRouterConfig(d_model=D)),
        "token_choice": TokenChoiceRouter(TokenChoiceConfig(d_model=D, num_experts=4, top_k=2)),
        "expert_choice": ExpertChoiceRouter(ExpertChoiceConfig(d_model=D, num_experts=4)),
        "mod": MoD(TransformerBlock(D, 2, MLP(D, 16)), MoDRouter(MoDRouterConfig(d_model=D))),
        "moe": moe(top_k=2),
        "moe_ec": moe(router="expert_choice"),
        "integrated": IntegratedMoDE.from_config(MoEConfig(d_model=D, d_hidden=16, num_experts=4, num_noop=2)),
        "staged": StagedMoDE(TransformerBlock(D, 2, moe()), MoDRouter(MoDRouterConfig(d_model=D))),
        "block": TransformerBlock(D, 2, MLP(D, 16)),
        "mlp": MLP(D, 16),
    }


def _bad_inputs():
    x = torch.randn(2, 6, D)
    nan = x.clone()
    nan[0, 1, 2] = float("nan")
    inf = x.clone()
    inf[1, 0, 0] = float("inf")
    return {
        "list": ([[[0.0] * D]], None),
        "rank2": (torch.randn(6, D), None),
        "rank4": (torch.randn(1, 2, 6, D), None),
        "wrong_D": (torch.randn(2, 6, D + 1), None),
        "int": (torch.ones(2, 6, D, dtype=torch.long), None),
        "bool": (torch.ones(2, 6, D, dtype=torch.bool), None),
        "complex": (torch.ones(2, 6, D, dtype=torch.complex64), None),
        "nan": (nan, None),
        "inf": (inf, None),
        "meta": (torch.randn(2, 6, D, device="meta"), None),
        "mask_float": (x, torch.ones(2, 6)),
        "mask_shape": (x, torch.ones(2, 5, dtype=torch.bool)),
        "mask_meta": (x, torch.ones(2, 6, dtype=torch.bool, device="meta")),
        "mask_all_padding": (x, torch.zeros(2, 6, dtype=torch.bool)),
        "zero_D": (torch.randn(2, 6, 0), None),
        "empty": (torch.randn(0, 6, D), None),
        "one_token": (torch.randn(1, 1, D), None),
        "float64": (x.double(), None),
        "bfloat16": (x.bfloat16(), None),
        "noncontiguous": (torch.randn(2, D, 6).transpose(1, 2), None),
    }


FORWARD_CASES = [(layer, inp) for layer in _layers() for inp in _bad_inputs()]
# A router's finite check is a torch._assert_async on CUDA: NaN/inf into a layer with a router is a device-side assert.
_DEVICE_ASSERT = pytest.mark.device_assert("NaN/inf logits trip the router's torch._assert_async on CUDA")
FORWARD_PARAMS = [
    pytest.param(
        layer,
        inp,
        id=f"{layer}-{inp}",
        marks=_DEVICE_ASSERT if inp in ("nan", "inf") and layer not in ("block", "mlp") else (),
    )
    for layer, inp in FORWARD_CASES
]


@pytest.mark.parametrize("layer,inp", FORWARD_PARAMS)
def test_forward_inputs(layer, inp):
    module = _layers()[layer]
    x, mask = _bad_inputs()[inp]
    if inp in ("float64", "bfloat16"):
        module = module.to(x.dtype)
    args = (x,) if mask is None else (x, mask)
    if layer == "block":  # TransformerBlock(x, positions, mask)
        args = (x, None, mask)
    name = "mask" if inp.startswith("mask") else "x"
    if layer in ("block", "mlp") and inp in ("nan", "inf"):
        return  # no router: NaN flows through as it does in any torch layer
    if layer == "mlp" and name == "mask":
        return  # the MLP ignores the mask by contract
    outcome = _ok_or_named_error(lambda: module(*args), name)
    if inp in ("nan", "inf"):
        assert outcome == "error"  # routers must reject non-finite logits
    if inp in ("empty", "one_token", "float64", "bfloat16", "noncontiguous", "mask_all_padding"):
        assert outcome == "ok"


# --------------------------------------------------------------------------------------------- generate


GEN_CASES = {
    "max_new_tokens": [0, -1, 1.5, None, "3"],
    "temperature": [-1.0, float("nan"), "hot"],
    "top_k": [0, -2, 2.5],
    "prompts": [[], [[]], [[1, 2], []], "abc", [[1, 999]], [[-1]], [[1.5]]],
}


@pytest.mark.parametrize(
    "arg,value",
    [(a, v) for a, vs in GEN_CASES.items() for v in vs],
    ids=[f"{a}={v!r}" for a, vs in GEN_CASES.items() for v in vs],
)
def test_generate_arguments(arg, value):
    lm = LM(LMConfig(vocab_size=32, seq_len=16, d_model=D, n_heads=2, d_hidden=16))
    kwargs = dict(prompts=[[1, 2, 3]], max_new_tokens=2, temperature=1.0, top_k=None)
    kwargs[arg] = value
    assert _ok_or_named_error(lambda: generate(lm, **kwargs), arg) == "error"


def test_lm_forward_inputs():
    lm = LM(LMConfig(vocab_size=32, seq_len=16, d_model=D, n_heads=2, d_hidden=16, layers=("dense", "mod")))
    for value in [torch.zeros(2, 17, dtype=torch.long), torch.zeros(2, 4), [[1, 2]]]:
        assert _ok_or_named_error(lambda: lm(value), "idx") == "error", value  # noqa: B023 - called in this iteration
    assert (
        _ok_or_named_error(
            lambda: lm(torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 5, dtype=torch.long)), "targets"
        )
        == "error"
    )


@pytest.mark.device_assert("LM's token-id range check is a torch._assert_async on CUDA")
@pytest.mark.parametrize("fill", [32, -1])
def test_lm_forward_token_ids_out_of_range(fill):
    lm = LM(LMConfig(vocab_size=32, seq_len=16, d_model=D, n_heads=2, d_hidden=16, layers=("dense", "mod")))
    assert _ok_or_named_error(lambda: lm(torch.full((2, 4), fill)), "idx") == "error"


def test_case_count():
    n = (
        len(CONFIG_CASES)
        + len(CTOR_CASES) * len(BAD_VALUES)
        + len(FORWARD_CASES)
        + sum(len(v) for v in GEN_CASES.values())
    )
    print(f"fuzz cases: {n}")
    assert n > 500
    assert math.isfinite(n)

"""The extension seams: a router in one file plus one registry line, a layer kind in one registry call, and
the stats names built and parsed in one place. Nothing else in the library changes for either."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mode import MLP, MoD, MoDRouter, MoEConfig, MoELayer, TransformerBlock
from mode.experiments.report import build_report
from mode.measure.flops import forward_flops_per_token, measured_flops
from mode.measure.stats import RoutingAccumulator
from mode.measure.token_compute import token_compute
from mode.model import LM, LMConfig, alternate
from mode.model.generate import generate
from mode.model.kinds import LAYER_KINDS, LayerKind, register_layer_kind
from mode.routing import ROUTERS, get_router, register_router
from mode.routing.keys import MOD, MOE, layer_prefix, parse_router_key, router_key

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_router.py"


@pytest.fixture
def top_p():
    """Import examples/custom_router.py (which registers "top_p"), and unregister it afterwards."""
    spec = importlib.util.spec_from_file_location("custom_router_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    ROUTERS.pop("top_p", None)
    sys.modules.pop(spec.name, None)


def _lm_cfg(**kw) -> LMConfig:
    base = dict(
        vocab_size=64,
        seq_len=32,
        d_model=32,
        n_heads=2,
        d_hidden=64,
        num_experts=4,
        top_k=3,
        layers=alternate(4, "dense", "moe"),
        router="top_p",
        router_options={"threshold": 0.6},
    )
    return LMConfig(**{**base, **kw})


def test_custom_router_trains_in_an_lm_and_is_counted(top_p):
    cfg = _lm_cfg()
    lm = LM(cfg)
    assert isinstance(lm.layers[1].mlp.router, top_p.TopPRouter)
    opt = torch.optim.AdamW(lm.parameters(), lr=3e-3)
    idx = torch.randint(0, 64, (4, 32))
    losses = []
    for _ in range(15):
        out = lm(idx, idx)
        loss = out.loss + out.aux.total()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(out.loss))
    assert losses[-1] < losses[0]
    # the FLOP code asks the router: realized counts match torch's flop counter exactly
    measured, out = measured_flops(lm, idx)
    assert measured == pytest.approx(forward_flops_per_token(cfg, 32, aux=out.aux) * idx.numel(), rel=1e-9)
    tc = token_compute(cfg, out.aux, (4, 32))
    assert float(tc.flops_BS.sum()) == pytest.approx(
        forward_flops_per_token(cfg, 32, aux=out.aux) * idx.numel(), rel=1e-9
    )
    # nominal: uniform probabilities need ceil(0.6 * 4) = 3 experts per token
    assert top_p.TopPConfig(d_model=32, num_experts=4, top_k=3, threshold=0.6).assignments(10) == 30
    # mode report's builder reads its stats like any router's
    report, _ = build_report(lm, [(idx, idx)])
    moe_layer = report["layers"][1]
    assert moe_layer["routers"]["moe"]["num_experts"] == 4
    assert 1.0 <= moe_layer["mlp_per_token"] <= 3.0
    # the router says it is causal, so the LM can sample
    assert len(generate(lm, [[1, 2, 3]], max_new_tokens=3, temperature=0)[0]) == 3


def test_custom_router_options_are_validated(top_p):
    with pytest.raises(ValueError, match="threshold=1.5: must be in"):
        MoEConfig(d_model=8, d_hidden=16, router="top_p", router_options={"threshold": 1.5})
    with pytest.raises(ValueError, match=r"router_options=.*\['temperature'\] are not fields of TopPConfig"):
        MoEConfig(d_model=8, d_hidden=16, router="top_p", router_options={"temperature": 2.0})
    layer = MoELayer.from_config(MoEConfig(d_model=8, d_hidden=16, num_experts=4, top_k=2, router="top_p"))
    y, aux = layer(torch.randn(2, 5, 8))
    assert y.shape == (2, 5, 8) and set(aux.losses) == {"balance", "z_loss"}


def test_router_registry_rules():
    with pytest.raises(ValueError, match="router='nope': must be one of 'token_choice', 'expert_choice'"):
        get_router("nope")
    spec = get_router("token_choice")
    assert register_router("token_choice", spec.config_cls, spec.router_cls) == spec  # same spec again: fine
    with pytest.raises(ValueError, match="already registered"):
        register_router("token_choice", get_router("expert_choice").config_cls, spec.router_cls)
    with pytest.raises(TypeError, match="config_cls"):
        register_router("x", object, spec.router_cls)


def test_custom_layer_kind_in_one_call():
    """A MoD block with a sigmoid gate, as a new kind: config, model, FLOPs and per-token compute follow."""

    def build(cfg):
        block = TransformerBlock(cfg.d_model, cfg.n_heads, MLP(cfg.d_model, cfg.d_hidden))
        return MoD(block, MoDRouter(replace(cfg.mod_config("learned"), gate="sigmoid")))

    register_layer_kind(LayerKind("mod_sigmoid", build, mod="learned"))
    try:
        cfg = LMConfig(
            vocab_size=64,
            seq_len=32,
            d_model=32,
            n_heads=2,
            d_hidden=64,
            capacity=0.25,
            layers=("dense", "mod_sigmoid", "dense", "mod_sigmoid"),
        )
        assert cfg.uses_mod and not cfg.uses_moe
        lm = LM(cfg)
        assert lm.layers[1].router.cfg.gate == "sigmoid" and lm.routed == [False, True, False, True]
        idx = torch.randint(0, 64, (2, 32))
        measured, out = measured_flops(lm, idx)
        analytic = forward_flops_per_token(cfg, 32, aux=out.aux) * idx.numel()
        router = 2 * 2 * 32 * 32 * 2  # the MoD score x . w (a matrix-vector product torch's counter skips)
        assert measured == analytic - router
        assert set(out.aux.stats) == {router_key(1, MOD), router_key(3, MOD)}
        acc = RoutingAccumulator()
        acc.add_lm(cfg, out.aux, (2, 32))
        assert acc.summary()["layers"]["1"]["routed_frac"] == pytest.approx(0.25)
        with pytest.raises(ValueError, match="already registered"):
            register_layer_kind(LayerKind("mod_sigmoid", lambda cfg: None))
    finally:
        LAYER_KINDS.pop("mod_sigmoid")
    with pytest.raises(ValueError, match="layers\\[0\\]='mod_sigmoid': must be one of"):
        LMConfig(layers=("mod_sigmoid",))


def test_layer_kind_rules():
    with pytest.raises(ValueError, match="noop=True needs experts=True"):
        register_layer_kind(LayerKind("bad", lambda cfg: None, noop=True))
    with pytest.raises(ValueError, match="kind.mod='sometimes'"):
        register_layer_kind(LayerKind("bad", lambda cfg: None, mod="sometimes"))


def test_stats_keys_round_trip():
    assert router_key(3, MOE) == "layers.3.moe.router" and router_key(None, MOD) == "mod.router"
    assert layer_prefix(12) == "layers.12."
    k = parse_router_key("layers.12.moe.router")
    assert (k.layer, k.part, k.sibling(MOD)) == (12, MOE, "layers.12.mod.router")
    assert parse_router_key("router") == parse_router_key("router").__class__(prefix="", layer=None, part=None)
    assert parse_router_key("blocks.attn.mod.router").layer is None  # a user's own prefix
    assert parse_router_key("layers.3.moe.balance") is None
    with pytest.raises(ValueError, match="part='attn'"):
        router_key(0, "attn")

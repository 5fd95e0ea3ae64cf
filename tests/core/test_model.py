"""The decoder-only LM: every layer kind runs, trains (gradients reach every parameter), validates input."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

from mode import MoD, MoDRouter, StagedMoDE
from mode.model import LAYER_KINDS, LM, LMConfig, alternate

B, S, V = 2, 16, 256


def lit(text: str) -> str:
    return re.escape(text)


def small_cfg(kind: str, **kw) -> LMConfig:
    base = dict(
        vocab_size=V,
        seq_len=S,
        d_model=32,
        n_heads=2,
        d_hidden=64,
        layers=("dense", kind),
        num_experts=4,
        capacity=0.25,
        num_noop=2 if kind == "integrated" else 0,
    )
    base.update(kw)
    return LMConfig(**base)


def batch(seq: int = S) -> tuple[torch.Tensor, torch.Tensor]:
    window = torch.randint(0, V, (B, seq + 1))
    return window[:, :-1], window[:, 1:]


def test_layer_kinds_are_the_six_documented_ones():
    assert set(LAYER_KINDS) == {"dense", "mod", "mod_random", "moe", "staged", "integrated"}


def test_alternate_routes_every_other_block():
    assert alternate(5, "dense", "mod") == ("dense", "mod", "dense", "mod", "dense")


@pytest.mark.parametrize("kind", LAYER_KINDS)
def test_forward_shapes_and_finite_loss(kind):
    model = LM(small_cfg(kind))
    x, y = batch()
    out = model(x, y)
    assert out.logits_BSV.shape == (B, S, V)
    assert out.loss.shape == () and torch.isfinite(out.loss)
    # independent: cross-entropy recomputed from the logits; at init it is close to log(V)
    ref = F.cross_entropy(out.logits_BSV.float().reshape(-1, V), y.reshape(-1))
    torch.testing.assert_close(out.loss, ref)
    assert abs(out.loss.detach().item() - math.log(V)) < 0.5
    assert torch.isfinite(out.aux.total())
    # without targets: no loss, same logits
    out2 = model(x)
    assert out2.loss is None
    if kind != "mod_random":  # random routing draws fresh tokens each call
        exact = out.logits_BSV.device.type == "cpu"  # CUDA index_add_ sums top-k outputs in no fixed order
        torch.testing.assert_close(out2.logits_BSV, out.logits_BSV, **(dict(rtol=0, atol=0) if exact else {}))
    # a shorter sequence works too
    assert model(x[:, :5]).logits_BSV.shape == (B, 5, V)


EXPECTED_STATS = {
    "dense": set(),
    "mod": {"layers.1.mod.router"},
    "mod_random": {"layers.1.mod.router"},
    "moe": {"layers.1.moe.router"},
    "staged": {"layers.1.mod.router", "layers.1.moe.router"},
    "integrated": {"layers.1.moe.router"},
}


@pytest.mark.parametrize("kind", LAYER_KINDS)
def test_aux_is_prefixed_by_layer(kind):
    out = LM(small_cfg(kind))(batch()[0])
    assert set(out.aux.stats) == EXPECTED_STATS[kind]
    has_moe = kind in ("moe", "staged", "integrated")
    assert bool(out.aux.losses) == has_moe
    assert all(k.startswith("layers.1.moe.") for k in out.aux.losses)
    if kind in ("mod", "mod_random", "staged"):
        stats = out.aux.stats["layers.1.mod.router"]
        assert float(stats.kept_E.sum()) == B * max(1, math.floor(0.25 * S))  # exactly C per sequence
        assert stats.batch_shape == (B, S)


@pytest.mark.parametrize("backend", ["reference", "grouped"])
@pytest.mark.parametrize("kind", LAYER_KINDS)
def test_backward_reaches_every_parameter(kind, backend):
    model = LM(small_cfg(kind, backend=backend))
    x, y = batch()
    out = model(x, y)
    (out.loss + out.aux.total()).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, f"{name} got an all-zero gradient"
    router_names = [n for n, _ in model.named_parameters() if "router" in n]
    assert len(router_names) == {"dense": 0, "mod": 1, "mod_random": 1, "moe": 1, "staged": 2, "integrated": 1}[kind]


@pytest.mark.parametrize(
    "kind,causal", [("mod", "predictor"), ("staged", "predictor"), ("mod", "aux_bce"), ("staged", "aux_bce")]
)
def test_backward_reaches_every_parameter_with_causal_routing_losses(kind, causal):
    model = LM(small_cfg(kind, causal=causal))
    x, y = batch()
    out = model(x, y)
    assert "layers.1.mod.causal_bce" in out.aux.losses
    (out.loss + out.aux.total()).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    if causal == "predictor":
        assert any(".router.predictor." in n for n, _ in model.named_parameters())


def test_mod_random_router_gets_gradient_only_through_the_delta_scale():
    """Random selection ignores the router's scores, yet r * delta keeps the router on the gradient path;
    with gate "one" the router has no path at all."""
    model = LM(small_cfg("mod_random"))
    layer = model.layers[1]
    assert isinstance(layer, MoD) and isinstance(layer.router, MoDRouter)
    assert layer.router.cfg.selection == "random"
    x, y = batch()
    model(x, y).loss.backward()
    assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0

    torch.manual_seed(0)
    gate_one = LM(small_cfg("mod_random", mod_gate="one"))
    gate_one(x, y).loss.backward()
    g = gate_one.layers[1].router.weight.grad
    assert g is None or torch.count_nonzero(g) == 0


def test_mod_random_selection_uses_the_global_rng():
    model = LM(small_cfg("mod_random")).eval()
    x = batch()[0]
    torch.manual_seed(5)
    a = model(x).logits_BSV
    torch.manual_seed(5)
    b = model(x).logits_BSV
    c = model(x).logits_BSV
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_layer_modules_match_kinds():
    cfg = small_cfg("dense", layers=tuple(LAYER_KINDS), num_noop=1)
    model = LM(cfg)
    kinds = [type(m).__name__ for m in model.layers]
    assert kinds == ["TransformerBlock", "MoD", "MoD", "TransformerBlock", "StagedMoDE", "TransformerBlock"]
    assert isinstance(model.layers[4], StagedMoDE)
    assert type(model.layers[3].mlp).__name__ == "MoELayer"
    assert type(model.layers[5].mlp).__name__ == "IntegratedMoDE"
    assert model.layers[5].mlp.router.num_slots == cfg.num_experts + 1


def test_dense_lm_is_causal():
    model = LM(small_cfg("moe"))
    x = batch()[0]
    x2 = x.clone()
    x2[:, 9:] = (x2[:, 9:] + 1) % V
    a, b = model(x).logits_BSV, model(x2).logits_BSV
    torch.testing.assert_close(a[:, :9], b[:, :9])
    assert not torch.allclose(a[:, 9:], b[:, 9:])


# ------------------------------------------------------------------------------------------------- config


def test_unknown_layer_kind():
    with pytest.raises(ValueError, match=lit("layers[1]='mod_learned': must be one of 'dense', 'mod'")):
        LMConfig(layers=("dense", "mod_learned"))


def test_integrated_needs_a_noop_expert():
    with pytest.raises(ValueError, match=lit("num_noop=0: an 'integrated' layer needs num_noop >= 1")):
        LMConfig(layers=("integrated",), num_noop=0)


def test_empty_layers():
    with pytest.raises(ValueError, match=lit("layers=(): must name at least one layer")):
        LMConfig(layers=())


def test_bad_mod_and_moe_fields_are_checked_at_config_time():
    with pytest.raises(ValueError, match=lit("capacity=1.5: must be in (0, 1]")):
        LMConfig(layers=("mod",), capacity=1.5)
    with pytest.raises(ValueError, match="top_k"):
        LMConfig(layers=("moe",), num_experts=2, top_k=3)
    # fields of unused kinds are not checked: a dense model does not care about capacity
    LMConfig(layers=("dense",), capacity=1.5)


def test_bad_sizes():
    with pytest.raises(ValueError, match=lit("d_model=0: must be >= 1")):
        LMConfig(d_model=0)
    with pytest.raises(TypeError, match=lit("seq_len=16.0: must be an int")):
        LMConfig(seq_len=16.0)


def test_layers_list_becomes_tuple():
    assert LMConfig(layers=["dense", "mod"]).layers == ("dense", "mod")


# --------------------------------------------------------------------------------------------------- input


def test_float_idx_is_a_type_error():
    model = LM(small_cfg("dense"))
    with pytest.raises(TypeError, match=r"idx: must be a \(B, S\) torch\.long tensor of token ids, got torch\.float32"):
        model(torch.zeros(B, S))


def test_one_dimensional_idx_is_a_type_error():
    model = LM(small_cfg("dense"))
    with pytest.raises(TypeError, match=r"idx: must be a \(B, S\) torch\.long tensor"):
        model(torch.zeros(S, dtype=torch.long))


def test_too_long_idx():
    model = LM(small_cfg("dense"))
    with pytest.raises(ValueError, match=lit(f"idx.shape[1]={S + 1}: must be <= seq_len={S}")):
        model(torch.zeros(B, S + 1, dtype=torch.long))


# --------------------------------------------------------------------------------------------- embeddings


def test_tied_embeddings_share_storage():
    model = LM(small_cfg("mod"))
    assert model.head.weight is model.embed.weight
    assert model.head.weight.data_ptr() == model.embed.weight.data_ptr()
    with torch.no_grad():
        model.embed.weight[3, 0] = 123.0
    assert model.head.weight[3, 0] == 123.0
    # counted once
    n_unique = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert model.num_params() == n_unique
    assert model.num_params(exclude_embeddings=True) == n_unique - V * 32
    # the tied matrix gets gradient from both uses (embedding rows of absent tokens still move via the head)
    x, y = batch()
    model(x, y).loss.backward()
    absent = sorted(set(range(V)) - set(x.flatten().tolist()))[0]
    assert model.embed.weight.grad[absent].abs().sum() > 0


def test_untied_embeddings_are_separate():
    model = LM(small_cfg("dense", tie_embeddings=False))
    assert model.head.weight.data_ptr() != model.embed.weight.data_ptr()
    assert model.num_params() == sum(p.numel() for p in model.parameters())
    n_tied = LM(small_cfg("dense")).num_params()
    assert model.num_params() == n_tied + V * 32


def test_init_is_seeded_and_router_keeps_its_own_init():
    torch.manual_seed(1)
    a = LM(small_cfg("staged"))
    torch.manual_seed(1)
    b = LM(small_cfg("staged"))
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    # the MoD router vector keeps std d_model ** -0.5 (not the 0.02 of the other matrices)
    w = a.layers[1].router.weight
    assert 0.08 < float(w.detach().std()) < 0.3

"""No-op expert kinds (``mode.layers.noop``): "zero", "copy" (LongCat-Flash, MoE++) and "constant" (MoE++) beside
real experts in an integrated MoDE layer. Each adds what its formula says, computed from the router's gates by
hand here; none costs expert FLOPs; the routing stats count them as the no-op share; the config refuses what it
cannot compute. Expert parallelism: tests/parallel/test_distributed.py, case ``integrated_copy_constant``."""

from __future__ import annotations

import pytest
import torch

from mode.layers.moe import IntegratedMoDE, MoEConfig, MoELayer
from mode.layers.noop import NOOP_KINDS, NoopExperts, noop_kinds
from mode.measure.flops import forward_flops
from mode.model.config import LMConfig

D, H, E = 16, 32, 4


def _layer(kinds, num_noop=3, top_k=2, seed=0, **kw) -> IntegratedMoDE:
    torch.manual_seed(seed)
    cfg = MoEConfig(
        d_model=D,
        d_hidden=H,
        num_experts=E,
        num_noop=num_noop,
        top_k=top_k,
        noop_kinds=kinds,
        activation="swiglu",
        **kw,
    )
    layer = IntegratedMoDE.from_config(cfg)
    if layer.noop is not None and layer.noop.const_idx:
        with torch.no_grad():  # zero at init: draw it, so a wrong formula shows
            layer.noop.const_v_CD.normal_()
    return layer


def _by_hand(layer: IntegratedMoDE, x_BSD: torch.Tensor) -> torch.Tensor:
    """The routed experts' output (the same layer with every no-op slot "zero") plus, per token and chosen
    no-op slot n: g * x (copy) or g * (a1 x + a2 v) (constant), from the router's own gates."""
    B, S, _ = x_BSD.shape
    x_TD = x_BSD.reshape(B * S, D)
    logits_TX = x_TD @ layer.router.weight.t()
    probs_TX = logits_TX.softmax(-1)
    gate_TK, chosen_TK = probs_TX.topk(layer.router.cfg.top_k, dim=-1)
    if layer.router.cfg.renormalize:
        gate_TK = gate_TK / gate_TK.sum(-1, keepdim=True)
    zero = IntegratedMoDE(layer.router, layer.experts)  # same router and experts, no-op slots add nothing
    layer.router.emit_noop_gates = False
    y_TD = zero(x_BSD)[0].reshape(B * S, D)
    layer.router.emit_noop_gates = layer.noop is not None and layer.noop.needs_gates
    kinds = layer.noop.kinds if layer.noop is not None else ("zero",) * (layer.router.num_slots - E)
    const_of = {n: c for c, n in enumerate(layer.noop.const_idx)} if layer.noop is not None else {}
    for t in range(B * S):
        for k in range(layer.router.cfg.top_k):
            slot, g = int(chosen_TK[t, k]), gate_TK[t, k]
            if slot < E or kinds[slot - E] == "zero":
                continue
            if kinds[slot - E] == "copy":
                y_TD[t] += g * x_TD[t]
            else:
                c = const_of[slot - E]
                a = (layer.noop.const_w_C2D[c] @ x_TD[t]).softmax(-1)
                y_TD[t] += g * (a[0] * x_TD[t] + a[1] * layer.noop.const_v_CD[c])
    return y_TD.view(B, S, D)


@pytest.mark.parametrize("kinds", ["zero", "copy", "constant", ("copy", "constant", "zero")])
@pytest.mark.parametrize("renormalize", [False, True])
def test_each_kind_adds_its_formula(kinds, renormalize):
    layer = _layer(kinds, renormalize=renormalize)
    x = torch.randn(2, 7, D)
    y, aux = layer(x)
    with torch.no_grad():
        expected = _by_hand(layer, x)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-6)
    assert float(aux.stats["router"].noop) > 0  # the no-op slots were chosen: the test exercised them


def test_gradients_reach_the_input_and_the_constant_parameters():
    layer = _layer(("copy", "constant", "constant"))
    x = torch.randn(3, 5, D, requires_grad=True)
    y, _ = layer(x)
    y.square().sum().backward()
    assert x.grad is not None and layer.noop.const_v_CD.grad.abs().sum() > 0
    assert layer.noop.const_w_C2D.grad.abs().sum() > 0
    assert layer.router.weight.grad.abs().sum() > 0  # the gates of copy slots are trained


def test_padding_gets_no_noop_output_and_empty_input_gives_empty_output():
    layer = _layer("copy", num_noop=4, top_k=3)
    x = torch.randn(2, 6, D)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, :3] = False
    plan = layer.router(x, mask)
    assert torch.all(plan.noop_gate_TN.view(2, 6, -1)[0, :3] == 0)
    y, _ = layer(torch.randn(0, 4, D))
    assert y.shape == (0, 4, D)


def test_no_op_kinds_cost_no_expert_flops_and_count_as_the_no_op_share():
    base = dict(
        seq_len=32,
        d_model=32,
        n_heads=2,
        d_hidden=64,
        vocab_size=64,
        num_experts=4,
        num_noop=2,
        top_k=2,
        layers=("integrated", "integrated"),
    )
    flops = {k: forward_flops(LMConfig(**base, noop_kinds=k)) for k in NOOP_KINDS}
    assert flops["copy"] == flops["zero"] == flops["constant"]
    layer = _layer("copy", num_noop=3, top_k=2)
    _, aux = layer(torch.randn(4, 8, D))
    stats = aux.stats["router"]
    assert float(stats.noop) == float(stats.requested_X[E:].sum()) > 0
    assert float(stats.kept_E.sum()) + float(stats.noop) == 4 * 8 * 2  # every choice is an expert or a no-op


def test_lm_config_builds_integrated_layers_with_the_kinds():
    from mode.model.lm import LM

    cfg = LMConfig(
        seq_len=16,
        d_model=32,
        n_heads=2,
        d_hidden=64,
        vocab_size=64,
        num_experts=4,
        num_noop=2,
        top_k=2,
        layers=("dense", "integrated"),
        noop_kinds=("copy", "constant"),
    )
    model = LM(cfg)
    noops = [m for m in model.modules() if isinstance(m, NoopExperts)]
    assert len(noops) == 1 and noops[0].kinds == ("copy", "constant")
    logits = model(torch.randint(0, 64, (2, 16))).logits_BSV
    assert logits.shape == (2, 16, 64)


def test_bad_kinds_are_refused_by_name():
    with pytest.raises(ValueError, match="noop_kinds"):
        noop_kinds("identity", 2)
    with pytest.raises(ValueError, match="one kind per no-op slot, num_noop=2"):
        noop_kinds(("copy",), 2)
    with pytest.raises(TypeError, match="noop_kinds=3"):
        noop_kinds(3, 1)
    with pytest.raises(ValueError, match="need router='token_choice'"):
        MoEConfig(d_model=D, d_hidden=H, num_experts=E, num_noop=2, router="expert_choice", noop_kinds="copy")
    cfg = MoEConfig(d_model=D, d_hidden=H, num_experts=E, num_noop=2, top_k=2)
    with pytest.raises(ValueError, match="one kind per no-op slot of the router"):
        MoELayer(MoELayer.from_config(cfg).router, MoELayer.from_config(cfg).experts, noop=NoopExperts(("copy",), D))

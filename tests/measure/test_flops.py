"""Analytic FLOPs: hand-computed values, and agreement with torch's FLOP counter for every layer kind."""

from __future__ import annotations

import math

import pytest
import torch

from mode.measure.flops import (
    TRAIN_MULTIPLIER,
    attention_flops,
    forward_flops,
    forward_flops_per_token,
    layer_flops,
    measured_flops,
    mlp_flops_per_token,
    realized_assignments,
    train_flops_per_token,
)
from mode.model import LAYER_KINDS, LM, LMConfig, alternate
from mode.model.kinds import get_layer_kind

B, S, D, H, V, E = 2, 32, 32, 64, 256, 4


def cfg_for(kind: str, **kw) -> LMConfig:
    base = dict(
        vocab_size=V,
        seq_len=S,
        d_model=D,
        n_heads=2,
        d_hidden=H,
        layers=("dense", kind),
        num_experts=E,
        capacity=0.25,
        num_noop=2 if kind == "integrated" else 0,
    )
    base.update(kw)
    return LMConfig(**base)


# ------------------------------------------------------------------------------------------ hand-computed


def test_dense_layer_hand_computed():
    f = layer_flops(cfg_for("dense"), "dense", S)
    # q, k, v, out projections: 4 * 2 * S * D * D; scores + values: 2 * 2 * S * S * D; MLP: 2 * 2 * S * D * H
    assert f.attention == 4 * 2 * 32 * 32 * 32 + 2 * 2 * 32 * 32 * 32 == 393_216
    assert f.mlp == 2 * 2 * 32 * 32 * 64 == 262_144
    assert f.router == 0
    assert f.total == 655_360


def test_mod_layer_hand_computed():
    f = layer_flops(cfg_for("mod"), "mod", S)
    c = 8  # floor(0.25 * 32)
    assert f.attention == 8 * c * D * D + 4 * c * c * D == 73_728
    assert f.mlp == c * 4 * D * H == 65_536
    assert f.router == 2 * S * D == 2_048  # every token is scored


def test_moe_layers_nominal_hand_computed():
    cfg = cfg_for("moe")
    f = layer_flops(cfg, "moe", S)
    assert f.mlp == S * 1 * 4 * D * H  # dropless top-1: one expert row per token
    assert f.router == 2 * S * D * E
    staged = layer_flops(cfg, "staged", S)
    assert staged.attention == 8 * 8 * D * D + 4 * 8 * 8 * D
    assert staged.mlp == 8 * 4 * D * H
    assert staged.router == 2 * 8 * D * E + 2 * S * D  # MoE router on the C routed tokens + MoD router on all
    icfg = cfg_for("integrated")  # 4 real + 2 no-op: balanced routing computes 4/6 of the tokens
    integ = layer_flops(icfg, "integrated", S)
    assert integ.mlp == pytest.approx(S * 4 / 6 * 4 * D * H)
    assert integ.router == 2 * S * D * 6
    assert integ.attention == attention_flops(S, D)


def test_capacity_factor_and_expert_choice_nominal():
    # token choice, capacity factor 1.0, top-2: at most E * ceil(1.0 * S * 2 / E) = 64 rows, wanted 64
    cfg = cfg_for("moe", top_k=2, capacity_factor=1.0)
    assert layer_flops(cfg, "moe", S).mlp == 64 * 4 * D * H
    # expert choice, capacity factor 2 with 2 no-op slots: each real expert takes ceil(2 * 32 / 6) = 11 tokens
    cfg = cfg_for("integrated", router="expert_choice", capacity_factor=2.0)
    assert layer_flops(cfg, "integrated", S).mlp == 4 * 11 * 4 * D * H


def test_swiglu_mlp_counts_three_matmuls():
    assert mlp_flops_per_token(D, H, "swiglu") == 6 * D * H
    assert mlp_flops_per_token(D, H, "gelu") == 4 * D * H


def test_forward_includes_head_and_per_token_divides_by_seq_len():
    cfg = cfg_for("mod")
    per_layer = forward_flops(cfg, S)
    assert [f.kind for f in per_layer] == ["dense", "mod", "head"]
    assert per_layer[-1].total == 2 * S * D * V
    assert forward_flops_per_token(cfg, S) == pytest.approx(sum(f.total for f in per_layer) / S)
    # default seq_len is the config's
    assert forward_flops_per_token(cfg) == forward_flops_per_token(cfg, cfg.seq_len)


@pytest.mark.parametrize("kind", LAYER_KINDS)
def test_train_flops_are_three_times_forward(kind):
    cfg = cfg_for(kind)
    assert TRAIN_MULTIPLIER == 3
    assert train_flops_per_token(cfg, S) == pytest.approx(3 * forward_flops_per_token(cfg, S), rel=1e-12)
    out = LM(cfg)(torch.randint(0, V, (B, S)))
    assert train_flops_per_token(cfg, S, aux=out.aux) == pytest.approx(
        3 * forward_flops_per_token(cfg, S, aux=out.aux), rel=1e-12
    )


@pytest.mark.parametrize("kind", LAYER_KINDS)
def test_realized_flops_left_on_the_device_equal_the_read_ones_bit_for_bit(kind):
    """read=False (the trainer's step: the FLOPs are read with the loss in the step's one host sync) computes
    the same float64 value by the same operations, without reading anything."""
    from mode.measure.host_sync import HostSyncCounter

    cfg = cfg_for(kind, capacity_factor=1.25, top_k=2, layers=("dense", kind, kind))
    out = LM(cfg)(torch.randint(0, V, (3, S)))  # 3 rows: the per-sequence mean is not a dyadic fraction
    with HostSyncCounter() as syncs:
        kept = train_flops_per_token(cfg, S, aux=out.aux, read=False)
    assert syncs.count == 0, syncs.events
    read = train_flops_per_token(cfg, S, aux=out.aux)
    if any(k.experts for k in map(get_layer_kind, cfg.layers)):
        assert isinstance(kept, torch.Tensor) and kept.dtype == torch.float64 and kept.dim() == 0
        assert kept.device == out.logits_BSV.device and float(kept) == read
    else:
        assert kept == read  # no realized routing: a float either way


def test_nominal_mod_is_cheaper_than_dense():
    n = 4
    dense = LMConfig(seq_len=256, d_model=128, n_heads=4, d_hidden=512, layers=("dense",) * n)
    mod = LMConfig(seq_len=256, d_model=128, n_heads=4, d_hidden=512, layers=alternate(n, "dense", "mod"))
    ratio = forward_flops_per_token(mod) / forward_flops_per_token(dense)
    assert ratio < 1
    # independent estimate: the routed blocks cost ~capacity of a dense block (attention by capacity squared)
    s, d, h, c = 256, 128, 512, 32
    dense_layer = 8 * s * d * d + 4 * s * s * d + 4 * s * d * h
    mod_layer = 8 * c * d * d + 4 * c * c * d + 4 * c * d * h + 2 * s * d
    head = 2 * s * d * 256
    assert ratio == pytest.approx((2 * dense_layer + 2 * mod_layer + head) / (4 * dense_layer + head))
    assert ratio < 0.7
    # random routing has the same nominal cost as learned routing
    rnd = LMConfig(seq_len=256, d_model=128, n_heads=4, d_hidden=512, layers=alternate(n, "dense", "mod_random"))
    assert forward_flops_per_token(rnd) == forward_flops_per_token(mod)


# --------------------------------------------------------------------------------- measured vs analytic

CASES = [(kind, {}, backend) for kind in LAYER_KINDS for backend in ("reference", "grouped")] + [
    (kind, extra, "grouped")
    for kind, extra in [
        ("moe", {"router": "expert_choice"}),
        ("moe", {"top_k": 2, "capacity_factor": 0.5}),  # drops tokens: realized < nominal
        ("integrated", {"router": "expert_choice"}),
        ("integrated", {"top_k": 2}),
        ("staged", {"router": "expert_choice", "activation": "swiglu"}),
        ("mod", {"causal": "predictor", "predictor_hidden": 48}),  # the predictor MLP scores every token
        ("staged", {"causal": "predictor"}),
        ("mod", {"causal": "aux_bce"}),
        # the recipes of DeepSeek-V3 and Qwen-MoE (docs/routing.md)
        ("moe", {"num_shared": 2, "activation": "swiglu"}),  # DeepSeek: one shared MLP of 2 experts' width
        ("moe", {"num_shared": 1, "shared_hidden": 48, "shared_gate": True, "top_k": 2}),  # Qwen2-MoE
        ("staged", {"num_shared": 1, "shared_gate": True}),  # only the MoD-routed tokens reach the shared MLP
        ("integrated", {"num_shared": 1, "router_options": {"bias_balance": True, "noop_target": 0.5}}),
        (
            "moe",
            {
                "top_k": 2,
                "router_options": {
                    "gate": "sigmoid",
                    "n_group": 2,
                    "topk_group": 1,
                    "bias_balance": True,
                    "scale": 2.5,
                },
            },
        ),
    ]
]


@pytest.mark.parametrize(
    "kind,extra,backend", CASES, ids=["-".join([k, b, *(f"{x}={y}" for x, y in e.items())]) for k, e, b in CASES]
)
def test_analytic_matches_flop_counter(kind, extra, backend):
    cfg = cfg_for(kind, backend=backend, **extra)
    model = LM(cfg)
    idx = torch.randint(0, V, (B, S))
    measured, out = measured_flops(model, idx)
    analytic = forward_flops_per_token(cfg, S, aux=out.aux) * S * B
    assert measured > 0
    assert measured == pytest.approx(analytic, rel=0.02), (measured, analytic)
    if kind == "dense":
        assert measured == analytic  # nothing routed, nothing element-wise: exact


def test_realized_assignments_follow_the_routing():
    cfg = cfg_for("moe", top_k=2, capacity_factor=0.5)
    out = LM(cfg)(torch.randint(0, V, (B, S)))
    stats = out.aux.stats["layers.1.moe.router"]
    realized = realized_assignments(out.aux, 1)
    assert realized == float(stats.kept_E.sum()) / B
    assert realized <= E * math.ceil(0.5 * S * 2 / E)  # capacity bound per sequence
    assert realized_assignments(out.aux, 0) is None  # the dense layer has no router
    f = forward_flops(cfg, S, aux=out.aux)[1]
    assert f.mlp == pytest.approx(realized * 4 * D * H)


def test_realized_flops_differ_from_nominal_for_unbalanced_noop_routing():
    """Integrated MoDE's compute depends on how many tokens pick a no-op: realized must track it."""
    cfg = cfg_for("integrated", num_noop=4)
    model = LM(cfg)
    with torch.no_grad():  # all logits tie: the whole batch lands on one slot instead of spreading evenly
        model.layers[1].mlp.router.weight.zero_()
    idx = torch.randint(0, V, (B, S))
    measured, out = measured_flops(model, idx)
    realized = forward_flops_per_token(cfg, S, aux=out.aux) * S * B
    nominal = forward_flops_per_token(cfg, S) * S * B
    assert measured == pytest.approx(realized, rel=0.02)
    # balanced routing would compute 4/8 of the 32 tokens per sequence; a tie sends them all to one slot,
    # real (32 rows) or no-op (0 rows), and the realized count must say which
    assert realized_assignments(out.aux, 1) in (0.0, 32.0)
    assert forward_flops(cfg, S)[1].mlp == 16 * 4 * D * H
    assert abs(nominal - realized) == pytest.approx(16 * 4 * D * H * B)

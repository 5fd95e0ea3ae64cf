"""``router_fit`` and ``to_mod(skip_rank=...)``: the router fitted to the original model's biggest updates, the
skipped tokens' estimated update (``SkipUpdate``), and that both keep what MoD layers promise: capacity 1.0
is the original, ``generate()`` equals recomputation, the conversion saves and loads."""

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from mod_models import V, batch, generate_matches_recomputation, tiny


def _batches(n: int = 4, seed: int = 3):
    g = torch.Generator().manual_seed(seed)  # a CPU generator, the ids then moved (the same on every device)
    return [torch.randint(1, V, (4, 24), generator=g, device="cpu").to(torch.get_default_device()) for _ in range(n)]


def test_skip_update_starts_at_zero_and_fits_a_planted_map():
    from mode.hf.dense.skip_update import SkipUpdate

    torch.manual_seed(0)
    est = SkipUpdate(32, 4)
    x_ND = torch.randn(2000, 32)
    assert torch.equal(est(x_ND[None]), torch.zeros(1, 2000, 32))  # a fresh estimate is the plain skip
    w_DD = torch.randn(32, 4) @ torch.randn(4, 32)  # rank 4
    bias_D = torch.randn(32)
    left = est.fit(x_ND, x_ND @ w_DD + bias_D, ridge=0.0)
    assert left < 1e-8
    torch.testing.assert_close(est(x_ND[None])[0], x_ND @ w_DD + bias_D, rtol=1e-4, atol=1e-4)
    const = SkipUpdate(32, 0)
    const.fit(x_ND, x_ND @ w_DD + bias_D)
    torch.testing.assert_close(const.bias, (x_ND @ w_DD + bias_D).mean(0))
    with pytest.raises(ValueError, match="skip_rank=33"):
        SkipUpdate(32, 33)


@pytest.mark.parametrize("part,kv", [("attention", "all"), ("layer", "all"), ("layer", "routed"), ("mlp", "routed")])
def test_router_fit_learns_the_oracle_and_the_estimate(hf, part, kv):
    model = hf.to_mod(tiny("llama"), layers=[1, 2], capacity=0.5, causal="threshold", part=part, kv=kv, skip_rank=8)
    agreement = hf.router_fit(model, _batches())
    assert set(agreement) == {1, 2}
    assert all(a > 0.65 for a in agreement.values()), agreement  # a coin would agree on half
    for layer in hf.mod_layers(model).values():
        assert not torch.isnan(layer.mod_router.threshold)  # calibrated: causal routing works at once
        assert layer.mod_skip.up.abs().sum() > 0  # fitted, no longer the zero update
    ids, mask = batch(S=16)
    with torch.no_grad():
        model(ids, attention_mask=mask)  # eval mode: causal routing


def test_the_estimate_brings_skipped_tokens_closer_to_the_original(hf):
    """On the text it was fitted on, each converted layer's output is nearer the original layer's output with
    the fitted estimate than with the plain skip (the same routing)."""
    base = tiny("qwen2")
    data = _batches()
    with_est = hf.to_mod(
        copy.deepcopy(base), layers=[1], capacity=0.5, causal="threshold", part="attention", kv="all", skip_rank=16
    )
    hf.router_fit(with_est, data)
    plain = copy.deepcopy(with_est)
    plain.model.layers[1].mod_skip = None
    outs = {}
    for name, model in (("orig", base), ("est", with_est), ("plain", plain)):
        seen = {}
        h = model.model.layers[1].register_forward_hook(
            lambda m, a, k, out, seen=seen: seen.update(y=out), with_kwargs=True
        )
        with torch.no_grad():
            model(torch.cat(data), use_cache=False)
        h.remove()
        outs[name] = seen["y"]
    err_est = (outs["est"] - outs["orig"]).pow(2).sum()
    err_plain = (outs["plain"] - outs["orig"]).pow(2).sum()
    assert err_est < 0.8 * err_plain


@pytest.mark.parametrize("part,kv", [("attention", "all"), ("layer", "routed"), ("mlp", "routed")])
def test_capacity_one_and_generate_with_an_estimate(hf, part, kv):
    base = tiny("llama")
    ids, mask = batch(left_pad=3)
    same = hf.to_mod(
        copy.deepcopy(base), layers=[1, 3], capacity=1.0, causal="threshold", part=part, kv=kv, skip_rank=4
    )
    for layer in hf.mod_layers(same).values():
        torch.nn.init.normal_(layer.mod_skip.up)  # a nonzero estimate: never used when every token routes
    with torch.no_grad():
        ref = base(ids, attention_mask=mask, use_cache=False).logits
        out = same(ids, attention_mask=mask, use_cache=False).logits
    assert (out[mask.bool()] - ref[mask.bool()]).abs().max() <= 1e-6

    model = hf.to_mod(
        copy.deepcopy(base), layers=[0, 2], capacity=0.5, causal="threshold", part=part, kv=kv, skip_rank=4
    )
    hf.router_fit(model, _batches())
    _, _, fed_mask, routed = generate_matches_recomputation(hf, model)
    assert any(0 < r[fed_mask.bool()].float().mean() < 1 for r in routed.values())


def test_the_estimate_is_saved_with_the_conversion_and_tuned_with_the_routers(hf, tmp_path):
    model = hf.to_mod(
        tiny("llama"), layers=[1, 3], capacity=0.5, causal="threshold", part="attention", kv="all", skip_rank=4
    )
    hf.router_fit(model, _batches())
    assert any(".mod_skip." in name for name in hf.router_parameters(model))
    hf.save_conversion(model, tmp_path)
    fresh = tiny("llama")
    fresh.load_state_dict({k: v for k, v in model.state_dict().items() if ".mod_" not in k})
    hf.load_conversion(fresh, tmp_path)
    ids = torch.randint(1, V, (2, 12))
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, model(ids).logits)


def test_router_fit_refuses_what_it_cannot_fit(hf):
    with pytest.raises(ValueError, match="no MoD layer"):
        hf.router_fit(tiny("llama"), _batches())
    with pytest.raises(ValueError, match="causal='predictor'"):
        hf.router_fit(hf.to_mod(tiny("llama"), layers=[1], causal="predictor"), _batches())
    model = hf.to_mod(tiny("llama"), layers=[1], causal="threshold")
    with pytest.raises(ValueError, match="batches: empty"):
        hf.router_fit(model, [])
    with pytest.raises(ValueError, match="ridge=-1"):
        hf.router_fit(model, _batches(), ridge=-1)
    with pytest.raises(ValueError, match="skip_rank=65"):
        hf.to_mod(tiny("llama"), skip_rank=65)


def test_top_share_rows_matches_the_per_row_top_share():
    from mode.hf.dense.router_fit import _top_share, _top_share_rows

    g = torch.Generator().manual_seed(0)
    y_BS = torch.randn(5, 11, generator=g)
    real_BS = torch.ones(5, 11, dtype=torch.bool)
    real_BS[1, :4] = False  # left padding in one row
    row_BS = torch.arange(5)[:, None].expand(5, 11)
    for capacity in (0.05, 0.3, 0.5, 1.0):
        want_N = _top_share(y_BS, real_BS, capacity)[real_BS]
        perm_N = torch.randperm(int(real_BS.sum()), generator=g)  # the order of the flattened tokens is free
        got_N = _top_share_rows(y_BS[real_BS][perm_N], row_BS[real_BS][perm_N], capacity)
        assert torch.equal(got_N, want_N[perm_N]), capacity


def test_the_residual_label_routes_what_the_estimate_misses():
    """Planted: every update is a rank-4 map of the input, and large for the tokens with large inputs; a few
    small-input tokens get an extra update the map cannot predict. ``label="update"`` routes the large (and
    predictable) tokens; the residual label routes the unpredictable ones, so the estimate fitted on the
    tokens it skips leaves far less of their update."""
    from mode.hf.dense.router_fit import _residual_label, _top_share_rows
    from mode.hf.dense.skip_update import SkipUpdate

    g = torch.Generator().manual_seed(1)
    N, D, R = 4000, 16, 4
    f_ND = torch.randn(N, D, generator=g) * (1 + 2 * torch.rand(N, 1, generator=g))
    u_ND = f_ND @ (torch.randn(D, R, generator=g) @ torch.randn(R, D, generator=g))
    odd_N = torch.rand(N, generator=g) < 0.2
    u_ND[odd_N] += 6 * torch.randn(int(odd_N.sum()), D, generator=g)
    row_N = torch.arange(N) // 100
    label_N = _top_share_rows(u_ND.norm(dim=-1), row_N, 0.25).float()

    def left(label_N):  # the skipped tokens' update energy the estimate fitted on them leaves
        est = SkipUpdate(D, R)
        skip_N = ~label_N.bool()
        est.fit(f_ND[skip_N], u_ND[skip_N], ridge=0.0)
        with torch.no_grad():
            return float((u_ND[skip_N] - est(f_ND[skip_N][None])[0]).pow(2).sum())

    residual_N = _residual_label(SkipUpdate(D, R), f_ND, u_ND, label_N, row_N, 0.25, rounds=3, ridge=0.0)
    assert residual_N.sum() == label_N.sum()  # the same share routed, row by row
    assert left(residual_N) < 0.5 * left(label_N)
    assert residual_N[odd_N].mean() > 2 * label_N[odd_N].mean()  # it routes the unpredictable tokens


def test_router_fit_with_the_residual_label(hf):
    data = _batches()
    model = hf.to_mod(tiny("llama"), layers=[1, 2], capacity=0.5, causal="threshold", part="layer", skip_rank=8)
    agreement = hf.router_fit(model, data, label="residual", rounds=2)
    assert set(agreement) == {1, 2} and all(a > 0.6 for a in agreement.values()), agreement
    for layer in hf.mod_layers(model).values():
        assert not torch.isnan(layer.mod_router.threshold) and layer.mod_skip.up.abs().sum() > 0
    with pytest.raises(ValueError, match="label='residual'.*no estimate"):
        hf.router_fit(hf.to_mod(tiny("llama"), layers=[1], capacity=0.5, causal="threshold"), data, label="residual")
    with pytest.raises(ValueError, match="label"):
        hf.router_fit(model, data, label="norm")
    with pytest.raises(ValueError, match="rounds"):
        hf.router_fit(model, data, label="residual", rounds=0)


def test_router_fit_calibrates_on_the_calibration_batches(hf):
    """calibration_batches: the thresholds ``calibrate`` sets on them afterwards (exactly), not those of the fit
    batches; the weights and estimates are fitted on the fit batches either way."""
    data, other, base = _batches(), _batches(3, seed=11), tiny("llama")

    def fitted(**kw):
        model = hf.to_mod(copy.deepcopy(base), layers=[1, 2], capacity=0.5, causal="threshold", skip_rank=8)
        hf.router_fit(model, data, **kw)
        return model

    on_fit, on_other = fitted(), fitted(calibration_batches=iter(other))  # any iterable, read once
    for (i, a), b in zip(hf.mod_layers(on_fit).items(), hf.mod_layers(on_other).values(), strict=True):
        assert torch.equal(a.mod_router.weight, b.mod_router.weight), i
        assert torch.equal(a.mod_skip.up, b.mod_skip.up), i
        assert float(a.mod_router.threshold) != float(b.mod_router.threshold), i
    assert hf.calibrate(on_fit, other) == {i: float(b.mod_router.threshold) for i, b in hf.mod_layers(on_other).items()}
    with pytest.raises(ValueError, match="calibration_batches: empty"):
        fitted(calibration_batches=[])

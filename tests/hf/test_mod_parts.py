"""``to_mod(part=...)``: skip the whole layer, only its attention, or only its MLP. Capacity 1.0 is the original
model for every part; a skipped sublayer runs for no token the router did not pick (its calls are counted);
with ``part="attention"`` the layer's cache holds K/V of picked tokens only; ``generate()`` equals
cache-free recomputation for every part (greedy, left padding, batch 2)."""

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from mod_models import FAMILIES, V, batch, converted, generate_matches_recomputation, layer_io, tiny

PARTS = ("layer", "attention", "mlp")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("part", ["attention", "mlp"])
@pytest.mark.parametrize("causal", ["aux_bce", "predictor", "threshold"])
def test_capacity_one_is_the_original_for_every_part(hf, family, part, causal):
    model = tiny(family)
    ids, mask = batch(left_pad=3)
    real = mask.bool()
    conv = hf.to_mod(copy.deepcopy(model), layers=[1, 3], capacity=1.0, gate="ste", causal=causal, part=part)
    for training in (True, False):
        model.train(training)
        conv.train(training)
        with torch.no_grad():
            ref = model(ids, attention_mask=mask, use_cache=False).logits
            out = conv(ids, attention_mask=mask, use_cache=False).logits
        assert (out[real] - ref[real]).abs().max() <= 1e-6, training
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(conv.generate(ids, **kw), model.generate(ids, **kw))


def _count_rows(layer) -> dict[str, list[int]]:
    """Token rows each half of ``layer`` sees, call by call."""
    seen: dict[str, list[int]] = {"self_attn": [], "mlp": []}
    layer.self_attn.register_forward_hook(
        lambda m, args, kwargs, out: seen["self_attn"].append(kwargs["hidden_states"].shape[:2].numel()),
        with_kwargs=True,
    )
    layer.mlp.register_forward_hook(lambda m, args, out: seen["mlp"].append(args[0].shape[:2].numel()))
    return seen


@pytest.mark.parametrize("part", ["attention", "mlp"])
def test_the_skipped_sublayer_runs_for_picked_tokens_only(hf, part):
    model = converted(hf, "llama", layers=[1], capacity=0.5, part=part)
    layer = model.model.layers[1]
    seen = _count_rows(layer)
    routed_half, other_half = ("self_attn", "mlp") if part == "attention" else ("mlp", "self_attn")

    ids, mask = batch(B=2, S=12)
    with torch.no_grad(), hf.routing(model, "topk"):  # top-C: C = 6 per row, nothing padded
        model(ids, attention_mask=mask, use_cache=False)
    assert seen[routed_half] == [2 * 6] and seen[other_half] == [2 * 12]

    for half in seen.values():
        half.clear()
    ids, mask = batch(B=1, S=40)  # one row: the causal call packs no filler slots
    with torch.no_grad(), hf.routing(model, "causal"):
        model(ids, attention_mask=mask, use_cache=False)
    picked = int(layer.mod_aux.stats["router"].compute_T.sum())
    assert 0 < picked < 40  # the test has teeth
    assert seen[routed_half] == [picked] and seen[other_half] == [40]

    # generate(): over the prompt and every decode step, the routed half saw exactly the picked tokens
    for half in seen.values():
        half.clear()
    ids, mask = batch(B=1, S=10)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
    fed = out.sequences[:, :-1]
    with torch.no_grad(), hf.routing(model, "causal"):
        model(fed, use_cache=False)
    picked = int(layer.mod_aux.stats["router"].compute_T.sum())
    assert sum(seen[routed_half][:-1]) == picked  # the last call is the recomputation itself
    assert sum(seen[other_half][:-1]) == fed.shape[1]
    if part == "attention":  # K/V of the picked tokens only
        assert int(out.past_key_values.layers[1].len_B.sum()) == picked


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("part", PARTS)
def test_generate_equals_recomputation_for_every_part(hf, family, part):
    model = converted(hf, family, layers=[0, 2], capacity=0.5, gate="raw", part=part)
    cache, fed, fed_mask, routed = generate_matches_recomputation(hf, model)
    B = fed.shape[0]
    for i, routed_BS in routed.items():
        assert 0 < routed_BS[fed_mask.bool()].float().mean() < 1  # mixed routing: the test has teeth
        layer = cache.layers[i]
        if part == "mlp":  # the attention ran for every token: transformers' own dense cache
            assert not isinstance(layer, hf.MoDCacheLayer) and layer.keys.shape[2] == fed.shape[1]
            continue
        assert isinstance(layer, hf.MoDCacheLayer)
        assert layer.len_B.tolist() == routed_BS.sum(1).tolist()  # K/V of routed tokens only
        for b in range(B):
            assert torch.equal(layer.slot_BL[b, : layer.len_B[b]], routed_BS[b].nonzero().squeeze(1))


def test_attention_part_skips_attention_but_not_the_mlp(hf):
    """An unpicked token's output is its input plus the MLP's update, not its input: only attention was
    skipped (``part="layer"`` copies it through unchanged)."""
    model = converted(hf, "qwen2", layers=[1], capacity=0.5, part="attention")
    layer = model.model.layers[1]
    x, y, routed = layer_io(hf, model, 1, *batch(S=12, left_pad=4))
    with torch.no_grad():
        torch.testing.assert_close(y[~routed], layer.mlp_sublayer(x)[~routed], rtol=0, atol=1e-6)
    assert not torch.allclose(y[routed], layer.mlp_sublayer(x)[routed])


def test_part_is_saved_with_the_conversion_and_checked(hf, tmp_path):
    model = converted(hf, "llama", layers=[1, 3], capacity=0.5, part="attention")
    hf.save_conversion(model, tmp_path)
    fresh = tiny("llama")
    fresh.load_state_dict({k: v for k, v in model.state_dict().items() if ".mod_router." not in k})
    hf.load_conversion(fresh, tmp_path)
    assert [layer.mod_part for layer in hf.mod_layers(fresh).values()] == ["attention", "attention"]
    ids = torch.randint(1, V, (2, 12))
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, model(ids).logits)  # eval: the saved thresholds route the same
    with pytest.raises(ValueError, match="part='attn'"):
        hf.to_mod(tiny("llama"), part="attn")

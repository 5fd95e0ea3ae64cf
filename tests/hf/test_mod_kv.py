"""``to_mod(kv="all")``: every token writes its K/V, only routed tokens ask a query. Capacity 1.0 is the
original model; the skipped tokens' queries, attention and output projection never run; the layer's cache
is transformers' own dense one holding every token; ``generate()`` equals cache-free recomputation (greedy,
left padding, batch 2) for both parts and both attention backends; routed tokens see skipped tokens' keys."""

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from mod_models import (
    ATTENTIONS,
    FAMILIES,
    batch,
    converted,
    generate_matches_recomputation,
    layer_io,
    tiny,
)

PARTS = ("layer", "attention")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("part", PARTS)
@pytest.mark.parametrize("attn", ATTENTIONS)
def test_capacity_one_is_the_original(hf, family, part, attn):
    model = tiny(family, attn)
    ids, mask = batch(left_pad=3)
    real = mask.bool()
    conv = hf.to_mod(copy.deepcopy(model), layers=[1, 3], capacity=1.0, causal="threshold", part=part, kv="all")
    for training in (True, False):
        model.train(training)
        conv.train(training)
        with torch.no_grad():
            ref = model(ids, attention_mask=mask, use_cache=False).logits
            out = conv(ids, attention_mask=mask, use_cache=False).logits
        assert (out[real] - ref[real]).abs().max() <= 1e-6, training
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(conv.generate(ids, **kw), model.generate(ids, **kw))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("part", PARTS)
@pytest.mark.parametrize("attn", ATTENTIONS)
def test_generate_equals_recomputation(hf, family, part, attn):
    model = converted(hf, family, attn, layers=[0, 2], capacity=0.5, gate="raw", part=part, kv="all")
    cache, fed, fed_mask, routed = generate_matches_recomputation(hf, model)
    for i, routed_BS in routed.items():
        assert 0 < routed_BS[fed_mask.bool()].float().mean() < 1  # mixed routing: the test has teeth
        layer = cache.layers[i]
        assert not isinstance(layer, hf.MoDCacheLayer)  # the model's own cache, every token's K/V
        assert layer.keys.shape[2] == fed.shape[1]


@pytest.mark.parametrize("part", PARTS)
def test_skipped_tokens_ask_no_query(hf, part):
    """q_proj and o_proj see the routed tokens only, k_proj and v_proj every token; the MLP sees every token
    for part="attention", the routed ones for part="layer"."""
    model = converted(hf, "llama", layers=[1], capacity=0.5, part=part, kv="all")
    layer = model.model.layers[1]
    rows: dict[str, list[int]] = {}
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        getattr(layer.self_attn, name).register_forward_hook(
            lambda m, args, out, name=name: rows.setdefault(name, []).append(args[0].shape[:-1].numel())
        )
    layer.mlp.register_forward_hook(lambda m, args, out: rows.setdefault("mlp", []).append(args[0].shape[:-1].numel()))
    ids, mask = batch(B=1, S=40)
    with torch.no_grad(), hf.routing(model, "causal"):
        model(ids, attention_mask=mask, use_cache=False)
    picked = int(layer.mod_aux.stats["router"].compute_T.sum())
    assert 0 < picked < 40
    assert rows["q_proj"] == rows["o_proj"] == [picked]
    assert rows["k_proj"] == rows["v_proj"] == [40]
    assert rows["mlp"] == [40 if part == "attention" else picked]


def test_routed_tokens_see_skipped_tokens(hf):
    """kv="all" against kv="routed" on the same routing: the routed tokens' attention differs (it sees the
    skipped tokens' keys) and equals the original attention at the routed rows; the skipped tokens get the
    MLP only, as with kv="routed"."""
    base = tiny("qwen2")
    ids, mask = batch(S=12, left_pad=4)
    every = hf.to_mod(copy.deepcopy(base), layers=[1], capacity=0.5, causal="threshold", part="attention", kv="all")
    x, y, routed = layer_io(hf, every, 1, ids, mask)
    layer = every.model.layers[1]
    with torch.no_grad():
        torch.testing.assert_close(y[~routed], layer.mlp_sublayer(x)[~routed], rtol=0, atol=1e-6)
        # the original layer on the same input, every token attending: equal at the routed rows
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        cos_sin = every.model.rotary_emb(x, pos)
        full_mask = torch.ones(2, 1, 12, 12, dtype=torch.bool).tril()
        full_mask = full_mask & mask.bool()[:, None, None, :]
        full_mask |= torch.eye(12, dtype=torch.bool)  # pads attend to themselves (their rows are discarded)
        dense = layer.mlp_sublayer(layer.attention_sublayer(x, attention_mask=full_mask, position_embeddings=cos_sin))
    torch.testing.assert_close(y[routed], dense[routed], rtol=0, atol=1e-5)
    sparse = hf.to_mod(copy.deepcopy(base), layers=[1], capacity=0.5, causal="threshold", part="attention", kv="routed")
    sparse.model.layers[1].mod_router.load_state_dict(layer.mod_router.state_dict())
    _, y_sparse, routed_sparse = layer_io(hf, sparse, 1, ids, mask)
    assert torch.equal(routed, routed_sparse)  # the same router: the same routing, another context
    assert not torch.allclose(y[routed], y_sparse[routed], atol=1e-4)


def test_kv_is_saved_with_the_conversion_and_checked(hf, tmp_path):
    model = converted(hf, "llama", layers=[1, 3], capacity=0.5, part="layer", kv="all")
    hf.save_conversion(model, tmp_path)
    fresh = tiny("llama")
    fresh.load_state_dict({k: v for k, v in model.state_dict().items() if ".mod_router." not in k})
    hf.load_conversion(fresh, tmp_path)
    assert [layer.mod_kv for layer in hf.mod_layers(fresh).values()] == ["all", "all"]
    with pytest.raises(ValueError, match="kv='every'"):
        hf.to_mod(tiny("llama"), kv="every")
    with pytest.raises(ValueError, match="part='mlp'"):
        hf.to_mod(tiny("llama"), part="mlp", kv="all")


@pytest.mark.parametrize("part", PARTS)
@pytest.mark.parametrize("attn", ATTENTIONS)
@pytest.mark.parametrize("B,dense_rows", [(1, 16), (4, 16), (4, 0)])
def test_decode_fast_paths_agree_with_the_routed_path(hf, part, attn, B, dense_rows, monkeypatch):
    """Inference fast paths of kv="all" (``mod_fast_path``): a call that routes every token runs the original
    layer's forward (a batch-1 decode step the router takes); a decode step of at most
    ``mod_dense_decode_rows`` rows where some rows routed computes every row and keeps the routed rows'
    outputs (no routed-query call); above it, only the rows that routed ask queries and run the MLP. The
    reference path (``mod_fast_path = False``) gives the same tokens and logits; generate() still equals
    cache-free recomputation (batch 2, left-padded)."""
    import mode.hf.dense.mod_layer as mod_layer

    model = converted(hf, "llama", attn, layers=[1, 3], capacity=0.5, part=part, kv="all")  # gate "ste"
    q_rows = {"n": 0, "routed_calls": 0}
    routed_path = mod_layer.routed_query_attention

    def counting(*args, **kwargs):
        q_rows["routed_calls"] += 1
        return routed_path(*args, **kwargs)

    monkeypatch.setattr(mod_layer, "routed_query_attention", counting)
    for layer in hf.mod_layers(model).values():
        layer.self_attn.q_proj.register_forward_hook(
            lambda m, args, out: q_rows.update(n=q_rows["n"] + args[0].shape[:-1].numel())
        )
    ids, mask = batch(B=B, S=8)
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True)
    outs, seen = {}, {}
    for layer in hf.mod_layers(model).values():
        layer.mod_dense_decode_rows = dense_rows
    for fast in (False, True):
        for layer in hf.mod_layers(model).values():
            layer.mod_fast_path = fast
        q_rows.update(n=0, routed_calls=0)
        with torch.no_grad():
            outs[fast] = model.generate(ids, **kw)
        seen[fast] = dict(q_rows)
    assert torch.equal(outs[True].sequences, outs[False].sequences)
    assert (torch.stack(outs[True].logits) - torch.stack(outs[False].logits)).abs().max() <= 1e-5
    if B <= dense_rows:  # steps with a routed row ran the layer on every row, not the routed path: teeth
        assert seen[True]["routed_calls"] < seen[False]["routed_calls"]
    else:  # rows the router did not take asked no query
        assert seen[True]["n"] < seen[False]["n"]
    generate_matches_recomputation(hf, model)


@pytest.mark.parametrize("fast", (True, False))
def test_a_decode_step_refuses_scores_that_are_not_finite(hf, fast):
    """Both the decode step's own routing (``mod_fast_path``) and the router's plan say so rather than route
    on NaN scores."""
    model = converted(hf, "llama", layers=[1], capacity=0.5, kv="all")
    layer = model.model.layers[1]
    layer.mod_fast_path = fast
    ids, mask = batch(B=1, S=6)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, use_cache=True)
        layer.mod_router.weight.fill_(float("nan"))
        with pytest.raises(ValueError, match="finite"):
            model(ids[:, -1:], attention_mask=torch.ones(1, 7, dtype=torch.long), past_key_values=out.past_key_values)


@pytest.mark.parametrize("fast", (True, False))
def test_a_decode_step_refuses_a_threshold_never_calibrated(hf, fast):
    """A steered threshold that is NaN (never set by a train-mode forward) is refused at a decode step too: the
    fast path finds it in the NaN decision logits of its one host read."""
    model = converted(hf, "llama", layers=[1], capacity=0.5, kv="all", causal="threshold")
    layer = model.model.layers[1]
    layer.mod_fast_path = fast
    ids, mask = batch(B=2, S=6)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, use_cache=True)
        layer.mod_router.threshold.fill_(float("nan"))
        with pytest.raises(ValueError, match="not calibrated"):
            mask7 = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
            model(ids[:, -1:], attention_mask=mask7, past_key_values=out.past_key_values)

"""mode.hf: MoD / MoE conversion of transformers decoders (Llama, Qwen2, Mistral), sparse KV caches inside
generate(), upcycling, router tuning, save/load. Tiny random configs only (no downloads), a few seconds.

Every test that needs transformers takes the ``hf`` fixture, which skips it when transformers is not
installed (CI installs only ``.[test]``); the straight-through gate of ``MoDRouter`` is tested without it.
"""

import copy
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from mode.routing.mod_topk import GATES, MoDRouter, MoDRouterConfig

sys.path.insert(0, str(Path(__file__).parent))
from mod_models import (
    ATTENTIONS,
    FAMILIES,
    V,
    batch,
    causal_forward,
    converted,
    layer_io,
    positions,
    tiny,
)

# -- the straight-through gate (no transformers needed) --


def test_ste_gate_is_one_with_router_gradient():
    assert "ste" in GATES
    torch.manual_seed(0)
    router = MoDRouter(MoDRouterConfig(d_model=16, capacity=0.5, gate="ste"))
    x = torch.randn(2, 8, 16, requires_grad=True)
    plan = router(x)
    assert torch.equal(plan.weight_A, torch.ones_like(plan.weight_A))  # exactly 1, not 1 +- an ulp
    (plan.weight_A * torch.arange(plan.weight_A.numel())).sum().backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    # the same gradient as the raw gate's (d weight / d r = 1)
    raw = MoDRouter(MoDRouterConfig(d_model=16, capacity=0.5, gate="raw"))
    raw.load_state_dict(router.state_dict())
    x2 = x.detach().clone().requires_grad_(True)
    (raw(x2).weight_A * torch.arange(plan.weight_A.numel())).sum().backward()
    torch.testing.assert_close(raw.weight.grad, router.weight.grad)


# -- to_mod: conversion keeps the model --


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attn", ATTENTIONS)
@pytest.mark.parametrize("left_pad", [0, 4])
def test_capacity_one_equals_original(hf, family, attn, left_pad):
    model = tiny(family, attn)
    ids, mask = batch(left_pad=left_pad)
    with torch.no_grad():
        ref = model(ids, attention_mask=mask, output_hidden_states=True)
    keys = set(model.state_dict())
    real = mask.bool()
    for gate in ("one", "ste"):
        conv = hf.to_mod(copy.deepcopy(model), layers=[0, 2], capacity=1.0, gate=gate)
        with torch.no_grad(), hf.routing(conv, "topk"):
            out = conv(ids, attention_mask=mask, output_hidden_states=True)
        assert (out.logits[real] - ref.logits[real]).abs().max() <= 1e-6, gate
        assert [h.shape for h in out.hidden_states] == [h.shape for h in ref.hidden_states]
        added = set(conv.state_dict()) - keys
        assert keys <= set(conv.state_dict())
        assert added == {f"model.layers.{i}.mod_router.{n}" for i in (0, 2) for n in ("weight", "threshold")}
        assert type(conv.model.layers[0]).__name__ == f"MoD{type(model.model.layers[0]).__name__}"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("causal", ["aux_bce", "predictor"])
def test_capacity_one_is_the_identity_in_train_and_eval_for_every_causal_method(hf, family, causal):
    """The default routing ("auto"): top-C in train(), the causal decision in eval(). At capacity 1.0 the causal
    decision routes every token, trained or not (it once routed the untrained ``r > 0``: about half of them),
    so the converted model is the original in both modes, and so is greedy generation."""
    model = tiny(family)
    ids, mask = batch(left_pad=3)
    real = mask.bool()
    for gate in ("one", "ste"):
        conv = hf.to_mod(copy.deepcopy(model), layers=[1, 3], capacity=1.0, gate=gate, causal=causal)
        for training in (True, False):
            model.train(training)
            conv.train(training)
            with torch.no_grad():
                ref = model(ids, attention_mask=mask, use_cache=False).logits
                out = conv(ids, attention_mask=mask, use_cache=False).logits
            assert (out[real] - ref[real]).abs().max() <= 1e-6, (gate, training)
        kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert torch.equal(conv.generate(ids, **kw), model.generate(ids, **kw)), gate


@pytest.mark.parametrize("capacity", [0.25, 0.5, 0.75])
@pytest.mark.parametrize("causal", ["threshold", "aux_bce", "predictor"])
def test_steered_thresholds_route_the_target_share_on_unseen_windows(hf, capacity, causal):
    """causal="threshold", and the untrained aux_bce / predictor decisions (steer_decision): forwards in train
    mode steer each layer's threshold to the capacity's quantile of the decision logits; eval mode (the causal
    decision) then routes about the target share of real tokens on windows of text the calibration never saw,
    in every converted layer, without any training. Before calibration, eval mode refuses.

    The band here is 4 points on unseen windows of the same files. The issue's 3 points on held-out *files*
    is not met by this tiny random model (its scores follow the byte statistics of a file: 0.22-0.31 at a
    target of 0.25 on the validation files, docs/hf.md), so it is not claimed here; on the pretrained model
    it is measured by benchmarks/hf/hf_mod_pretrained.py."""
    from mode.measure.stats import RoutingAccumulator
    from mode.train.data import stdlib_corpus

    torch.manual_seed(0)
    data = stdlib_corpus(max_bytes=2_000_000).train
    model = hf.to_mod(tiny("llama"), layers=[1, 3], capacity=capacity, gate="ste", causal=causal)

    def windows(n, seed):
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, len(data) - 64, (n,), generator=g, device="cpu").tolist()
        rows = torch.stack([torch.from_numpy(data[i : i + 64].astype("int64")) % (V - 1) + 1 for i in starts])
        return rows.to(torch.get_default_device())  # on the model's device (the CPU, or CUDA's default device)

    with pytest.raises(ValueError, match="threshold is not calibrated"):
        with torch.no_grad():
            model(windows(2, 0), use_cache=False)
    thresholds = hf.calibrate(model, (windows(16, step) for step in range(100)))  # nothing is trained
    assert sorted(thresholds) == [1, 3] and model.training is False
    acc = RoutingAccumulator()
    with torch.no_grad():
        for step in range(16):  # other windows (other seeds): text the calibration did not see
            model(windows(32, 10_000 + step), use_cache=False)
            acc.add(hf.collect_aux(model))
    # An untrained predictor's logits take few distinct values on this tiny model (its layer-3 input is
    # mostly a function of the byte itself), so a quantile lands on a lump: 0.83 at 0.75. Its band is wider.
    band = 0.10 if causal == "predictor" else 0.04
    for name in ("layers.1.mod.router", "layers.3.mod.router"):
        share = acc.router_summary(name)["selected_frac"]
        assert abs(share - capacity) <= band, (name, share, capacity)
    assert "model.layers.1.mod_router.threshold" in model.state_dict()  # saved and resumed with the model


def test_raw_and_sigmoid_gates_change_the_model_ste_keeps_it_and_trains_the_router(hf):
    model = tiny("llama")
    ids, mask = batch()
    with torch.no_grad():
        ref = model(ids).logits
    diffs = {}
    for gate in ("raw", "sigmoid", "ste"):
        conv = hf.to_mod(copy.deepcopy(model), layers="every_other", capacity=1.0, gate=gate)
        with hf.routing(conv, "topk"):
            out = conv(ids).logits
        diffs[gate] = (out - ref).abs().max().item()
        out.float().logsumexp(-1).mean().backward()
        grads = [layer.mod_router.weight.grad for layer in hf.mod_layers(conv).values()]
        assert all(g is not None and g.abs().sum() > 0 for g in grads), gate
    assert diffs["ste"] <= 1e-6 and diffs["raw"] > 1e-3 and diffs["sigmoid"] > 1e-3


@pytest.mark.parametrize("attn", ATTENTIONS)
def test_skipped_tokens_copied_bit_for_bit_and_c_routed(hf, attn):
    model = hf.to_mod(tiny("qwen2", attn), layers=[1], capacity=0.5)
    ids, mask = batch(S=12, left_pad=4)
    x, y, routed = layer_io(hf, model, 1, ids, mask)
    assert routed.sum(1).tolist() == [6, 6]  # C = 0.5 * 12 per row; row 1 has 8 real tokens for its 6 slots
    assert not routed[~mask.bool()].any()  # padding never routes
    assert torch.equal(y[~routed], x[~routed])
    assert not torch.equal(y[routed], x[routed])
    assert y.shape == x.shape


def test_frozen_base_only_routers_learn_and_base_is_bitwise_unchanged(hf):
    model = hf.to_mod(tiny("llama"), layers=[1, 3], capacity=0.5, causal="predictor")
    model.train()
    names = hf.freeze_base(model)
    assert names and all(".mod_router." in n for n in names)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    ids, mask = batch(left_pad=3)
    out = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100), use_cache=False)
    (out.loss + hf.collect_aux(model).total()).backward()
    for n, p in model.named_parameters():
        assert (p.grad is not None) == (n in names), n
    assert model.model.layers[1].mod_router.weight.grad.abs().sum() > 0
    opt.step()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) != (n in names), n
    # activation checkpointing runs through the converted layers and gives the same router gradient
    grads = []
    for checkpointing in (False, True):
        if checkpointing:
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.23's name
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:  # transformers 5.17 (the lent GPU machine's)
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            assert model.model.layers[1].gradient_checkpointing
        model.zero_grad()
        model(ids, attention_mask=mask, labels=ids, use_cache=False).loss.backward()
        grads.append(model.model.layers[1].mod_router.weight.grad.clone())
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0])


# -- sparse KV caches inside generate() --


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("attn", ATTENTIONS)
@pytest.mark.parametrize("B,left_pad", [(1, 0), (2, 3)])
def test_greedy_generate_equals_full_forward_and_caches_hold_routed_tokens(hf, family, attn, B, left_pad):
    model = converted(hf, family, attn, layers=[0, 2], capacity=0.5, gate="raw")
    ids, mask = batch(B=B, S=8, left_pad=left_pad)
    N = 10
    with torch.no_grad():
        g = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=N,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    seq, cache = g.sequences, g.past_key_values
    fed = seq[:, :-1]  # the last token is sampled, never fed
    fed_mask = torch.cat([mask, torch.ones(B, N - 1, dtype=torch.long)], 1)
    ref, routed = causal_forward(hf, model, fed, fed_mask)
    steps = torch.stack(g.logits, 1)
    assert (steps - ref[:, 7:]).abs().max() <= 1e-5
    assert torch.equal(ref[:, 7:].argmax(-1), seq[:, 8:])
    assert cache.get_seq_length() == fed.shape[1]  # the dense length, pads included
    for i, routed_BS in routed.items():
        layer = cache.layers[i]
        assert isinstance(layer, hf.MoDCacheLayer)
        assert layer.len_B.tolist() == routed_BS.sum(1).tolist()  # each layer stores exactly its routed tokens
        for b in range(B):
            stored = layer.slot_BL[b, : layer.len_B[b]]
            assert torch.equal(stored, routed_BS[b].nonzero().squeeze(1))
        assert 0 < routed_BS[fed_mask.bool()].float().mean() < 1  # mixed routing: the test has teeth
        assert not routed_BS[~fed_mask.bool()].any()
    assert type(cache.layers[1]).__name__ == "DynamicLayer"  # dense layers keep transformers' own cache


def test_manual_decode_loop_equals_full_forward_and_skipped_token_writes_nothing(hf):
    from transformers import DynamicCache

    model = converted(hf, "mistral", layers=[1], capacity=0.5)
    ids, mask = batch(B=2, S=6, left_pad=2)
    cont = torch.randint(1, V, (2, 8))
    full = torch.cat([ids, cont], 1)
    full_mask = torch.cat([mask, torch.ones(2, 8, dtype=torch.long)], 1)
    ref, routed = causal_forward(hf, model, full, full_mask)
    cache = DynamicCache(config=model.config)
    pos = positions(full_mask)
    with torch.no_grad(), hf.routing(model, "causal"):
        out = model(ids, attention_mask=mask, position_ids=pos[:, :6], past_key_values=cache, use_cache=True)
        logits = [out.logits]
        layer = cache.layers[1]
        for t in range(6, 14):
            stored_before = layer.len_B.clone()
            keys_before = layer.keys.clone()
            out = model(
                full[:, t : t + 1],
                attention_mask=full_mask[:, : t + 1],
                position_ids=pos[:, t : t + 1],
                past_key_values=cache,
                use_cache=True,
            )
            logits.append(out.logits)
            skipped = ~routed[1][:, t]
            assert torch.equal(layer.len_B, stored_before + routed[1][:, t].long())
            for b in skipped.nonzero().squeeze(1).tolist():  # a skipped token writes nothing into the cache
                n = int(stored_before[b])
                assert torch.equal(layer.keys[b, :, :n], keys_before[b, :, :n])
                assert int(layer.len_B[b]) == n
    assert (torch.cat(logits, 1) - ref)[full_mask.bool()].abs().max() <= 1e-5
    assert routed[1][:, 6:].any() and not routed[1][:, 6:].all()


def test_beam_search_and_sampling_with_sparse_caches_match_cache_free_generation(hf):
    model = converted(hf, "llama", layers=[1, 3], capacity=0.5)
    ids, mask = batch(B=2, S=7, left_pad=2)
    kw = dict(attention_mask=mask, max_new_tokens=6, num_beams=3, num_return_sequences=2, do_sample=False)
    with torch.no_grad():
        cached = model.generate(ids, use_cache=True, **kw)
        uncached = model.generate(ids, use_cache=False, **kw)
    assert cached.shape == (4, 13) and torch.equal(cached, uncached)
    with torch.no_grad():
        torch.manual_seed(1)
        s1 = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=True)
        torch.manual_seed(1)
        s2 = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=True, use_cache=False)
    assert torch.equal(s1, s2)


# -- unsupported cases raise clear errors --


def test_unsupported_cases_raise(hf):
    model = converted(hf, "llama", layers=[0, 2], capacity=0.5)
    ids, mask = batch(B=1, S=6)
    with pytest.raises(ValueError, match="StaticLayer: MoD layers need a DynamicCache"):
        model.generate(ids, max_new_tokens=3, do_sample=False, cache_implementation="static")
    with pytest.raises(ValueError, match="assisted / speculative decoding"):
        model.generate(ids, max_new_tokens=3, do_sample=False, prompt_lookup_num_tokens=2)
    with pytest.raises(ValueError, match="assisted / speculative decoding"):
        model.generate(ids, max_new_tokens=3, do_sample=False, assistant_model=tiny("llama"))
    cache = model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True).past_key_values
    cache.crop(0)  # a no-op is fine
    with pytest.raises(ValueError, match=r"crop\(-1\): a MoD layer's sparse KV cache cannot be cropped"):
        cache.crop(-1)
    # top-C routing cannot decode token by token
    with pytest.raises(ValueError, match="routing='topk' with a cache that already holds tokens"):
        with hf.routing(model, "topk"):
            model.generate(ids, max_new_tokens=3, do_sample=False)
    # a router without a causal method cannot sample
    nocausal = hf.to_mod(tiny("llama"), layers=[1], causal="none")
    with pytest.raises(ValueError, match="causal='none'"):
        with hf.routing(nocausal, "causal"):
            pass
    # flash attention: refused at conversion; flex (switched after conversion): refused at the MoD layer
    flash = tiny("llama")
    flash.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attn_implementation='flash_attention_2'"):
        hf.to_mod(flash)
    flex = hf.to_mod(tiny("llama"), layers=[0])
    flex.config._attn_implementation = "flex_attention"  # (building a real BlockMask compiles: seconds)
    x = torch.randn(1, 6, 64)
    cos_sin = flex.model.rotary_emb(x, torch.arange(6)[None])
    with pytest.raises(ValueError, match="attn_implementation='flex_attention'"), torch.no_grad():
        flex.model.layers[0](x, attention_mask=None, position_embeddings=cos_sin)
    # a sliding window shorter than the cached sequence
    for kv in ("all", "routed"):
        short = hf.to_mod(tiny("mistral", sliding_window=6), layers=[1], steer_decision=False, kv=kv)
        with pytest.raises(ValueError, match="sliding_window=6"):
            short.generate(ids, max_new_tokens=4, do_sample=False)
    # bad layer choice, bad gate, converting twice
    with pytest.raises(ValueError, match="layers: index 7 must be an int in \\[0, 4\\)"):
        hf.to_mod(tiny("llama"), layers=[7])
    with pytest.raises(ValueError, match="gate='relu'"):
        hf.to_mod(tiny("llama"), gate="relu")
    with pytest.raises(ValueError, match="layer 1 is already a MoD layer"):
        hf.to_mod(hf.to_mod(tiny("llama"), layers=[1]), layers=[1])


def test_unsupported_model_type_raises(hf):
    import transformers as tf

    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=V))
    with pytest.raises(ValueError, match="model_type='gpt2': mode.hf supports 'llama', 'qwen2', 'mistral'"):
        hf.to_mod(gpt2)


# -- upcycling --


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("backend", ["reference", "grouped"])
def test_upcycled_renormalised_dropless_equals_dense(hf, top_k, backend):
    model = tiny("llama")
    ids, _ = batch()
    with torch.no_grad():
        ref = model(ids).logits
    up = hf.upcycle(copy.deepcopy(model), num_experts=4, top_k=top_k, renormalize=True, backend=backend)
    with torch.no_grad():
        out = up(ids).logits
    assert (out - ref).abs().max() <= 1e-6
    assert all(m.moe.experts.backend == backend for m in hf.upcycled_mlps(up).values())
    assert "model.layers.0.mlp.moe.experts.w_in_EDF" in up.state_dict()


def test_upcycle_documented_inequalities_bf16_and_router_signal(hf):
    model = tiny("llama")
    ids, _ = batch()
    with torch.no_grad():
        ref = model(ids).logits
    for kw in (
        dict(renormalize=False),
        dict(capacity_factor=1.0),
        dict(num_noop=1),
        dict(router="expert_choice", capacity_factor=1.0),
    ):
        up = hf.upcycle(copy.deepcopy(model), num_experts=4, top_k=2, **kw)
        with torch.no_grad():
            assert (up(ids).logits - ref).abs().max() > 1e-3, kw  # equality cannot hold (docs/hf.md)
    bf = hf.upcycle(copy.deepcopy(model).to(torch.bfloat16), num_experts=4, top_k=2)
    with torch.no_grad():
        assert (bf(ids).logits.float() - ref).abs().max() <= 1e-2  # bf16 rounding (dense bf16: the same)
    assert bf.model.layers[0].mlp.moe.router.weight.dtype == torch.float32  # routers stay in float32
    # at the start the LM loss does not move the router (identical experts, gates summing to 1) ...
    up = hf.upcycle(copy.deepcopy(model), layers=[0], num_experts=4, top_k=2)
    router = up.model.layers[0].mlp.moe.router
    lm_loss = up(ids, labels=ids).loss
    aux_loss = hf.collect_aux(up).total()
    (lm_grad,) = torch.autograd.grad(lm_loss, router.weight, retain_graph=True)
    (aux_grad,) = torch.autograd.grad(aux_loss, router.weight)  # ... the balance and z losses do
    assert lm_grad.abs().max() < 1e-6 < aux_grad.abs().max()


def test_staged_mode_mod_and_upcycle_on_the_same_layer(hf):
    model = tiny("qwen2")
    ids, _ = batch()
    with torch.no_grad():
        ref = model(ids).logits
    conv = hf.to_mod(hf.upcycle(copy.deepcopy(model), layers=[1], num_experts=2, top_k=1), layers=[1], capacity=1.0)
    with torch.no_grad(), hf.routing(conv, "topk"):
        assert (conv(ids).logits - ref).abs().max() <= 1e-6
    aux = hf.collect_aux(conv)
    assert "layers.1.mod.router" in aux.stats and "layers.1.moe.router" in aux.stats


# -- router tuning, save / load --


def test_router_tune_changes_only_routers_and_save_load_round_trip(hf, tmp_path):
    model = tiny("llama")
    original = copy.deepcopy(model)
    hf.upcycle(model, layers=[0], num_experts=2, top_k=1)
    hf.to_mod(model, layers=[1, 3], capacity=0.5, causal="predictor")
    base = {n: p.detach().clone() for n, p in model.named_parameters() if n not in hf.router_parameters(model)}
    routers = {n: p.detach().clone() for n, p in hf.router_parameters(model).items()}
    data = [batch(left_pad=2) for _ in range(2)]
    hist = hf.router_tune(model, [{"input_ids": i, "attention_mask": m} for i, m in data], steps=5, lr=1e-2)
    assert len(hist) == 5 and all(torch.isfinite(torch.tensor(h["loss"] + h["aux"])) for h in hist)
    assert all(0.5 <= h["routed"] <= 12 / 22 + 1e-6 for h in hist)  # C = 6 of 12 per row; row 1 has 10 real tokens
    for n, p in model.named_parameters():
        if n in base:
            assert torch.equal(p, base[n]), n
    assert any(not torch.equal(p, routers[n]) for n, p in hf.router_parameters(model).items())
    with pytest.raises(ValueError, match="pass teacher="):
        hf.router_tune(model, [data[0][0]], steps=1, objective="distill")
    hf.router_tune(model, [data[0][0]], steps=2, objective="distill", teacher=original)

    hf.save_conversion(model, tmp_path)
    loaded = hf.load_conversion(copy.deepcopy(original), tmp_path)
    ids, mask = data[0]
    model.eval()
    for mode in ("topk", "causal"):
        with torch.no_grad(), hf.routing(model, mode), hf.routing(loaded, mode):
            a = model(ids, attention_mask=mask).logits
            b = loaded(ids, attention_mask=mask).logits
        assert torch.equal(a, b), mode
    with pytest.raises(ValueError, match="already converted"):
        hf.load_conversion(loaded, tmp_path)


def test_distill_without_teacher_uses_the_dense_model(hf):
    model = hf.to_mod(tiny("qwen2"), layers=[1], capacity=0.5)
    ids, _ = batch()
    with torch.no_grad(), hf.routing(model, "dense"):
        dense = model(ids).logits
    hist = hf.router_tune(model, [ids], steps=2, objective="distill")
    assert hist[0]["loss"] > 0 and all(torch.isfinite(torch.tensor(h["loss"])) for h in hist)
    with torch.no_grad(), hf.routing(model, "dense"):
        assert torch.equal(model(ids).logits, dense)  # the base did not move


def _example(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


CONVERT_SMALLEST = [
    "--tune-steps",
    "2",
    "--capacities",
    "0.5",
    "--new-tokens",
    "4",
    "--repeats",
    "1",
    "--eval-batches",
    "1",
    "--seq-len",
    "32",
    "--batch",
    "2",
    "--corpus-bytes",
    "600000",
]


def test_example_runs_end_to_end(hf, tmp_path):
    """examples/hf_convert.py at its smallest: convert, router-tune, measure, generate."""
    rows = _example("hf_convert").main([*CONVERT_SMALLEST, "--json", str(tmp_path / "out.json")])
    assert [r["model"] for r in rows] == ["original", "mod"] and (tmp_path / "out.json").is_file()
    mod = rows[1]
    assert 0 < mod["routed"] < 1 and all(v <= mod["dense_len"] for v in mod["stored_per_layer"].values())


def test_pretrain_example_saves_a_checkpoint_that_converts(hf, tmp_path):
    """examples/hf_pretrain.py writes a transformers checkpoint (config + safetensors) that hf_convert.py
    loads with --model and converts."""
    with torch.device("cpu"):  # CPU scripts: their batches (BatchSampler, eval_batches) stay on the CPU, and a
        _pretrain_convert_and_bench(tmp_path)  # model built under a CUDA default device would not be there


def _pretrain_convert_and_bench(tmp_path):
    out = tmp_path / "llama"
    summary = _example("hf_pretrain").main(
        [
            "--out",
            str(out),
            "--hidden",
            "32",
            "--layers",
            "2",
            "--steps",
            "3",
            "--batch",
            "2",
            "--seq-len",
            "32",
            "--corpus-bytes",
            "3000000",
        ]
    )
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert summary["steps"] == 3 and summary["val_loss"] < 5.6  # below uniform over bytes (ln 256 = 5.545)
    rows = _example("hf_convert").main([*CONVERT_SMALLEST, "--model", str(out)])
    assert [r["model"] for r in rows] == ["original", "mod"]

    # benchmarks/hf/hf_mod_pretrained.py at its smallest on the same checkpoint: every row measured, then resumed
    bench = _example("../benchmarks/hf/hf_mod_pretrained")
    args = [
        "--model",
        str(out),
        "--capacities",
        "0.5",
        "--parts",
        "attention",
        "mlp",
        "--methods",
        "threshold",
        "random",
        "--steps",
        "1",
        "--batch",
        "2",
        "--seq-len",
        "32",
        "--val-batches",
        "1",
        "--new-tokens",
        "2",
        "--repeats",
        "1",
        "--mode",
        "--layer-sets",
        "every_other",
        "cheapest:1",
        "--out",
        str(tmp_path / "bench.json"),
    ]
    first = bench.main(args)
    names = [r["name"] for r in first["rows"]]
    kinds = [r["kind"] for r in first["rows"]]  # 2 layer sets x 2 parts x (2 tunings, random); staged x 2; integrated
    assert len(names) == len(set(names)) == 15
    assert (kinds.count("mod"), kinds.count("staged"), kinds.count("integrated")) == (12, 2, 1)
    costs = json.loads((tmp_path / "bench.json").read_text())["skip_costs"]  # per part, per layer
    assert sorted(costs) == ["attention", "layer", "mlp"] and len(costs["mlp"]) == 2
    for r in first["rows"]:
        if "layers=cheapest:1" in r["name"]:  # the layer whose part costs least when skipped
            assert r["layers"] == [int(min(costs[r["part"]], key=costs[r["part"]].get))], r
        else:
            assert r["layers"] == [1]
    for r in first["rows"]:
        if r.get("method") == "random":  # exactly C of each sequence's 32 tokens, no decode measured
            assert r["share"] == 0.5 and r["tuning"] == "none" and r["kv_ratio"] is None
            continue
        assert 0 < r["share"] < 1 and math.isfinite(r["loss"]) and r["kv_ratio"] > 0
    attention = next(r for r in first["rows"] if r.get("part") == "attention")
    assert attention["kv_ratio"] < 1  # skipped tokens store no K/V; the MLP part keeps every token's
    assert next(r for r in first["rows"] if r.get("part") == "mlp")["kv_ratio"] == 1
    assert bench.main(args)["rows"] == first["rows"]  # done rows are read back, not measured again

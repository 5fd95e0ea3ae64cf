"""Tiny random Llama / Qwen2 / Mistral decoders and batches for the MoD conversion tests (no downloads), and
``converted`` (a tiny model after ``to_mod(kv="routed", ...)`` and ``calibrate``). The ``hf`` fixture is in
conftest.py."""

import torch

FAMILIES = ("llama", "qwen2", "mistral")
ATTENTIONS = ("sdpa", "eager")
V, PAD = 97, 0


def tiny(family: str, attn: str = "sdpa", layers: int = 4, **overrides):
    """A tiny random decoder (hidden 64, GQA 4/2), eval mode."""
    import transformers as tf

    cfg_cls, model_cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
    }[family]
    kw = dict(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attn_implementation=attn,
        pad_token_id=PAD,
        bos_token_id=None,
        eos_token_id=None,
    )
    kw.update(overrides)
    return model_cls(cfg_cls(**kw)).eval()


def batch(B: int = 2, S: int = 12, left_pad: int = 0):
    """Token ids and a 2D mask; row 1 is left-padded by ``left_pad`` tokens."""
    ids = torch.randint(1, V, (B, S))
    mask = torch.ones(B, S, dtype=torch.long)
    if left_pad:
        ids[1, :left_pad], mask[1, :left_pad] = PAD, 0
    return ids, mask


def positions(mask):
    """Positions as generate() numbers them: real tokens only."""
    return (mask.cumsum(-1) - 1).clamp_min(0)


def converted(hf, family: str, attn: str = "sdpa", **kw):
    """``tiny(family)`` converted by ``to_mod(**kw)``, its steered thresholds calibrated on random ids."""
    kw.setdefault("kv", "routed")  # these tests check the sparse cache; tests/hf/test_mod_kv.py the default "all"
    model = hf.to_mod(tiny(family, attn), **kw)
    ids = torch.randint(1, V, (4, 16), generator=torch.Generator().manual_seed(7), device="cpu")  # same on every device
    hf.calibrate(model, [ids.to(torch.get_default_device())])
    return model


def causal_forward(hf, model, seq, mask):
    """Per MoD layer, the causal decisions of one cache-free full forward: (B, S) bool."""
    with torch.no_grad(), hf.routing(model, "causal"):
        logits = model(seq, attention_mask=mask, position_ids=positions(mask), use_cache=False).logits
    stats = hf.collect_aux(model).stats
    return logits, {i: stats[f"layers.{i}.mod.router"].compute_T.view(seq.shape).bool() for i in hf.mod_layers(model)}


def generate_matches_recomputation(hf, model, B: int = 2, N: int = 10, atol: float = 1e-5):
    """Greedy ``generate()`` of ``N`` tokens from a batch of ``B`` (row 1 left-padded by 3) against one
    cache-free causal forward over the generated sequence: the step logits agree within ``atol`` and the
    tokens are its argmax. Returns ``(cache, fed, fed_mask, routed)`` for the caller's cache checks."""
    ids, mask = batch(B=B, S=8, left_pad=3)
    with torch.no_grad():
        g = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=N,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    fed = g.sequences[:, :-1]  # the last token is sampled, never fed
    fed_mask = torch.cat([mask, torch.ones(B, N - 1, dtype=torch.long)], 1)
    ref, routed = causal_forward(hf, model, fed, fed_mask)
    assert (torch.stack(g.logits, 1) - ref[:, 7:]).abs().max() <= atol
    assert torch.equal(ref[:, 7:].argmax(-1), g.sequences[:, 8:])
    return g.past_key_values, fed, fed_mask, routed


def layer_io(hf, model, i: int, ids, mask):
    """One top-k forward: MoD layer ``i``'s input and output hidden states and its routed tokens, (B, S) bool."""
    layer = model.model.layers[i]
    seen = {}
    handle = layer.register_forward_hook(lambda m, args, kwargs, out: seen.update(x=args[0], y=out), with_kwargs=True)
    try:
        with torch.no_grad(), hf.routing(model, "topk"):
            model(ids, attention_mask=mask)
    finally:
        handle.remove()
    return seen["x"], seen["y"], layer.mod_aux.stats["router"].compute_T.view(ids.shape).bool()

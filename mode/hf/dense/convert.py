"""``to_mod``: turn chosen decoder layers of a transformers model into Mixture-of-Depths layers, in place."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from mode import _checks
from mode._module_attr import set_module_attr
from mode.hf._compat import check_attention, check_model_type, decoder_config, decoder_layers, layer_index
from mode.hf.dense.mod_layer import KV, PARTS, MoDLayerMixin, mod_class
from mode.hf.dense.skip_update import SkipUpdate
from mode.routing.mod_topk import CAUSAL_METHODS, GATES, MoDRouter, MoDRouterConfig

LAYER_PATTERNS = ("every_other", "all")


def resolve_layers(layers: str | Sequence[int], n_layers: int) -> list[int]:
    """``"every_other"``: 1, 3, 5, ... (the paper's placement, first layer dense); ``"all"``; or indices."""
    if isinstance(layers, str):
        _checks.check_choice("layers", layers, LAYER_PATTERNS)
        return list(range(1, n_layers, 2)) if layers == "every_other" else list(range(n_layers))
    if not isinstance(layers, Sequence) or len(layers) == 0:
        raise ValueError(f"layers={layers!r}: must be 'every_other', 'all' or a non-empty list of layer indices")
    out = []
    for i in layers:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n_layers:
            raise ValueError(f"layers: index {i!r} must be an int in [0, {n_layers})")
        if i in out:
            raise ValueError(f"layers: index {i} appears twice")
        out.append(i)
    return sorted(out)


def to_mod(
    model: nn.Module,
    layers: str | Sequence[int] = "every_other",
    capacity: float = 0.125,
    gate: str = "ste",
    causal: str = "aux_bce",
    causal_coef: float = 0.1,
    predictor_hidden: int = 64,
    part: str = "layer",
    steer_decision: bool = True,
    kv: str | None = None,
    skip_rank: int | None = None,
) -> nn.Module:
    """Convert decoder layers of ``model`` (Llama, Qwen2, Mistral; sdpa or eager attention) to MoD, in place.

    ``capacity``: fraction of each sequence routed through a converted layer when training (top-C).
    ``part``: what a token the router does not pick skips: ``"layer"`` (the whole layer), ``"attention"``
    (only the attention half) or ``"mlp"`` (only the MLP half).
    ``kv`` (parts "layer" and "attention"; None: "all"): ``"all"``, every token writes its K/V (it pays the
    input norm and the K/V projections) and only routed tokens ask a query, so routed tokens see the whole
    context, as the pretrained layer was trained to (``mode.hf.dense.routed_queries``); ``"routed"``, a skipped
    token writes no K/V in the layer (the layer's cache stores routed tokens only: less K/V memory, but on
    SmolLM2 it costs far more loss, docs/hf.md).
    ``skip_rank``: None, a skipped token's part adds nothing; an int R, it adds a rank-R affine estimate of
    the skipped update (``mode.hf.dense.skip_update``; R=0: a constant), zero until ``router_fit`` fits it or
    ``router_tune`` trains it.
    ``gate``: what multiplies a routed token's update, see ``mode.routing.mod_topk``; the default ``"ste"``
    leaves the model's output unchanged at capacity 1.0 and still trains the router. ``causal``: how the
    layer decides token by token when sampling (``"aux_bce"``, ``"predictor"``, ``"threshold"``; ``"none"``
    cannot generate). ``steer_decision`` (aux_bce / predictor): the decision passes a threshold steered to
    the capacity's share by train-mode forwards, so an untrained decision routes the target share; below
    capacity 1.0, causal routing is refused until a train-mode forward (``router_tune``, ``calibrate``) has
    set it. Returns ``model``; the spec of the conversion is kept in ``model.mode_conversion``.
    """
    check_model_type(model)
    config = decoder_config(model)
    check_attention(config)
    _checks.check_choice("gate", gate, GATES)
    _checks.check_choice("causal", causal, CAUSAL_METHODS)
    _checks.check_choice("part", part, PARTS)
    if kv is None:
        kv = "routed" if part == "mlp" else "all"  # part "mlp": the attention runs for every token anyway
    _checks.check_choice("kv", kv, KV)
    if skip_rank is not None:
        SkipUpdate(config.hidden_size, skip_rank)  # validates the rank before any layer changes
    if kv == "all" and part == "mlp":
        raise ValueError(
            "kv='all' with part='mlp': the attention already runs for every token (the model's own "
            "cache); kv applies to part='layer' or 'attention'"
        )
    _checks.check_bool("steer_decision", steer_decision)
    steer = steer_decision and causal in ("aux_bce", "predictor")
    all_layers = decoder_layers(model)
    chosen = resolve_layers(layers, len(all_layers))
    d_model = config.hidden_size
    ref = next(model.parameters())
    for i in chosen:
        layer = all_layers[i]
        if isinstance(layer, MoDLayerMixin):
            raise ValueError(f"layers: layer {i} is already a MoD layer")
        assert layer_index(layer) == i, "decoder layer order differs from self_attn.layer_idx"
        missing = [
            name
            for name in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
            if not hasattr(layer, name)
        ]
        if missing:
            raise ValueError(
                f"layers: layer {i} ({type(layer).__name__}) has no {missing}: to_mod needs the "
                "Llama-style pre-norm layer (attention, then MLP)"
            )
        router = MoDRouter(
            MoDRouterConfig(
                d_model=d_model,
                capacity=capacity,
                gate=gate,
                causal=causal,
                causal_coef=causal_coef,
                predictor_hidden=predictor_hidden,
                steer_decision=steer,
            )
        )
        layer.mod_router = router.to(device=ref.device, dtype=torch.float32)  # routers stay in float32
        set_module_attr(layer, "mod_part", part)
        set_module_attr(layer, "mod_kv", kv)
        skip = None if skip_rank is None else SkipUpdate(d_model, skip_rank).to(device=ref.device, dtype=torch.float32)
        set_module_attr(layer, "mod_skip", skip)
        layer.__class__ = mod_class(type(layer))
    if hasattr(model, "_get_candidate_generator"):  # generate()'s entry to assisted / speculative decoding
        set_module_attr(model, "_get_candidate_generator", _refuse_assisted)
    spec = getattr(model, "mode_conversion", None) or {}
    mod = spec.setdefault("mod", {})
    for i in chosen:
        mod[str(i)] = {
            "capacity": capacity,
            "gate": gate,
            "causal": causal,
            "causal_coef": causal_coef,
            "predictor_hidden": predictor_hidden,
            "part": part,
            "steer_decision": steer_decision,
            "kv": kv,
            "skip_rank": skip_rank,
        }
    set_module_attr(model, "mode_conversion", spec)
    return model


def mod_layers(model: nn.Module) -> dict[int, MoDLayerMixin]:
    """The converted MoD layers of ``model`` by layer index."""
    return {layer_index(layer): layer for layer in decoder_layers(model) if isinstance(layer, MoDLayerMixin)}


def _refuse_assisted(*args, **kwargs):
    raise ValueError(
        "assisted / speculative decoding (assistant_model=, prompt_lookup_num_tokens=, ...): not "
        "supported with mode.hf MoD layers: it rolls rejected tokens back with cache.crop, which a "
        "sparse per-row MoD cache cannot undo"
    )

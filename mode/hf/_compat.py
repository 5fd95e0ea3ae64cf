"""What ``mode.hf`` needs from transformers, checked once: the version, the model family, the attention.

``mode.hf`` hooks into transformers internals that move between minor releases (the decoder-layer
signature, the 4D mask formats, the per-layer cache objects), so it refuses what it was not tested on
instead of computing something subtly different.
"""

from __future__ import annotations

from typing import cast

from torch import nn

try:
    import transformers
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("mode.hf needs transformers 5.x: pip install 'mode-torch[hf]'") from e

TESTED_VERSION = "5.23.0"
if int(transformers.__version__.split(".")[0]) != 5:
    raise ImportError(
        f"transformers=={transformers.__version__}: mode.hf needs transformers 5.x "
        f"(tested on {TESTED_VERSION}); pip install 'mode-torch[hf]'"
    )

# Decoder families whose layer contract mode.hf was tested on: forward(hidden_states, attention_mask,
# position_ids, past_key_values, use_cache, position_embeddings) returning a bare tensor, with
# ``self_attn.layer_idx`` and a ``mlp`` of gate/up/down projections.
MODEL_TYPES = ("llama", "qwen2", "mistral")
# Attention backends whose mask is a 4D tensor mode.hf can restrict to the routed tokens: sdpa takes a bool
# mask (or None for plain causal), eager an additive float mask (0 / finfo.min).
ATTENTIONS = ("sdpa", "eager")


def decoder_config(model: nn.Module):
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"model={type(model).__name__}: must be a transformers PreTrainedModel (it has no .config)")
    return config.get_text_config(decoder=True)


def check_model_type(model: nn.Module) -> None:
    model_type = getattr(decoder_config(model), "model_type", None)
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"model_type={model_type!r}: mode.hf supports {', '.join(map(repr, MODEL_TYPES))} "
            "(decoder layers with the Llama layer contract, tested on transformers "
            f"{TESTED_VERSION})"
        )


def check_attention(config) -> None:
    """sdpa and eager only: flash attention takes a 2D mask and flex a BlockMask, neither of which can be
    restricted to a subset of queries and keys the way the MoD layer needs."""
    impl = getattr(config, "_attn_implementation", None)
    if impl not in ATTENTIONS:
        raise ValueError(
            f"attn_implementation={impl!r}: mode.hf MoD layers support "
            f"{', '.join(map(repr, ATTENTIONS))} (flash attention's 2D mask and flex's BlockMask "
            "cannot be restricted to the routed tokens); load the model with "
            "attn_implementation='sdpa' or call model.set_attn_implementation('sdpa')"
        )


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder's ``layers`` (``model.model.layers`` for a ``*ForCausalLM``, ``model.layers`` for the base)."""
    for owner in (model, getattr(model, "model", None)):
        layers = getattr(owner, "layers", None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise ValueError(
        f"model={type(model).__name__}: found no decoder `layers` ModuleList "
        "(expected model.layers or model.model.layers)"
    )


def layer_index(layer: nn.Module) -> int:
    return cast(int, layer.get_submodule("self_attn").layer_idx)  # transformers' attention modules number themselves

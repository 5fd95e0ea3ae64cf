"""Saving a conversion as a spec plus the new weights, and putting it back onto the original checkpoint.

``save_pretrained`` cannot serialise the class swap of a MoD layer, and a pickled model would reference a
class made at run time. So a conversion is saved as two files in a directory:

    mode_conversion.json        which layers became MoD / MoE and with which settings, the model type,
                                the transformers version it was made with
    mode_weights.safetensors    only what the conversion added or replaced: ``...mod_router.*``,
                                ``...mod_skip.*``, every upcycled ``...mlp.moe.*``, the deleted layers'
                                estimates ``...prune_est.*`` and the base weights healing changed (the
                                spec's ``"healed"`` names: LoRA adapters merged by ``merge_lora``, or every
                                weight after ``heal(trainable="all")``)

A pruned model (``prune_layers``) is saved as its spec (``"pruned"``: which original layers went) and loads
onto the original by deleting them again. Unmerged LoRA adapters are refused: ``merge_lora`` first.

``load_conversion(model, dir)`` applies the same conversion to a freshly loaded original model (the same
checkpoint it was made from) and loads those weights; any key missing or left over raises.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from mode._module_attr import set_module_attr
from mode.hf._compat import decoder_config, decoder_layers
from mode.hf.dense.convert import to_mod
from mode.hf.dense.lora import lora_parameters
from mode.hf.dense.prune import delete_layers
from mode.hf.dense.skip_update import SkipUpdate
from mode.hf.dense.upcycle import upcycle

SPEC_FILE = "mode_conversion.json"
WEIGHTS_FILE = "mode_weights.safetensors"
FORMAT_VERSION = 1


def conversion_state(model: nn.Module) -> dict:
    """The tensors a conversion added or replaced, by their state-dict names (healed base weights included)."""
    healed = set((getattr(model, "mode_conversion", None) or {}).get("healed", []))
    keys = (".mod_router.", ".mod_skip.", ".prune_est.", ".mlp.moe.")
    return {k: v for k, v in model.state_dict().items() if k in healed or any(s in k for s in keys)}


def save_conversion(model: nn.Module, directory: str | Path) -> Path:
    """Save the conversion ``model`` carries (``model.mode_conversion``, set by ``to_mod`` and ``upcycle``) into
    ``directory`` as ``mode_conversion.json`` (the spec, the model type, the transformers version) and
    ``mode_weights.safetensors`` (only the tensors the conversion added or replaced); ``load_conversion`` puts
    it back onto the original checkpoint. Returns the directory; raises ``ValueError`` for an unconverted model."""
    spec = getattr(model, "mode_conversion", None)
    if not spec:
        raise ValueError("save_conversion: the model carries no mode.hf conversion (model.mode_conversion)")
    if lora_parameters(model):
        raise ValueError(
            "save_conversion: the model has unmerged LoRA adapters; call mode.hf.merge_lora(model) first "
            "(the merged weights are saved)"
        )
    import transformers

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "format": FORMAT_VERSION,
        "model_type": decoder_config(model).model_type,
        "transformers": transformers.__version__,
        **spec,
    }
    (out / SPEC_FILE).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    save_file({k: v.detach().contiguous() for k, v in conversion_state(model).items()}, str(out / WEIGHTS_FILE))
    return out


def load_conversion(model: nn.Module, directory: str | Path) -> nn.Module:
    """Convert ``model`` (the original, unconverted checkpoint) as saved in ``directory``; in place."""
    src = Path(directory)
    if not (src / SPEC_FILE).is_file() or not (src / WEIGHTS_FILE).is_file():
        raise ValueError(
            f"directory={str(src)!r}: must hold {SPEC_FILE} and {WEIGHTS_FILE} (written by mode.hf.save_conversion)"
        )
    doc = json.loads((src / SPEC_FILE).read_text())
    if doc.get("format") != FORMAT_VERSION:
        raise ValueError(f"{SPEC_FILE}: format={doc.get('format')!r}: this mode reads format {FORMAT_VERSION}")
    model_type = decoder_config(model).model_type
    if doc.get("model_type") != model_type:
        raise ValueError(f"{SPEC_FILE}: model_type={doc.get('model_type')!r} but the model is {model_type!r}")
    if getattr(model, "mode_conversion", None):
        raise ValueError("load_conversion: the model is already converted; load the original checkpoint")
    pruned = doc.get("pruned")
    if pruned:
        _prune_as_saved(model, pruned)
    for settings, layers in _grouped(doc.get("upcycle", {})):
        upcycle(model, layers=layers, **settings)
    for settings, layers in _grouped(doc.get("mod", {})):
        # written before part / steer_decision / kv existed: the whole layer, the decision at logit > 0, the
        # routed tokens' K/V only
        to_mod(model, layers=layers, **{"part": "layer", "steer_decision": False, "kv": "routed", **settings})
    if doc.get("healed"):
        spec = getattr(model, "mode_conversion", None) or {}
        set_module_attr(model, "mode_conversion", {**spec, "healed": doc["healed"]})
    tensors = load_file(str(src / WEIGHTS_FILE), device=str(next(model.parameters()).device))
    expected = conversion_state(model)
    missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or extra:
        raise ValueError(f"{WEIGHTS_FILE} does not match the conversion: missing {missing[:4]}, unexpected {extra[:4]}")
    for name, t in tensors.items():
        if t.shape != expected[name].shape:
            raise ValueError(
                f"{WEIGHTS_FILE}: {name}.shape={tuple(t.shape)}, the conversion has {tuple(expected[name].shape)}"
            )
    model.load_state_dict(tensors, strict=False)
    return model


def _prune_as_saved(model: nn.Module, pruned: dict) -> None:
    """Delete the saved layers from the original, with fresh estimates (their weights are loaded after)."""
    n_layers = len(decoder_layers(model))
    if pruned["n_layers"] != n_layers:
        raise ValueError(f"{SPEC_FILE}: pruned from {pruned['n_layers']} layers, but the model has {n_layers}")
    rank, d_model = pruned["estimate_rank"], decoder_config(model).hidden_size
    ref = next(model.parameters())
    estimates = None
    if rank is not None:
        estimates = {i: SkipUpdate(d_model, rank).to(device=ref.device, dtype=torch.float32) for i in pruned["layers"]}
    delete_layers(model, pruned["layers"], estimates)
    set_module_attr(model, "mode_conversion", {"pruned": pruned})


def _grouped(per_layer: dict) -> list[tuple[dict, list[int]]]:
    """Layers with identical settings together, so each group is one to_mod / upcycle call."""
    groups: dict[str, tuple[dict, list[int]]] = {}
    for layer, settings in per_layer.items():
        key = json.dumps(settings, sort_keys=True)
        groups.setdefault(key, (settings, []))[1].append(int(layer))
    return list(groups.values())

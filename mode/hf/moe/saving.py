"""A converted model written, and read, in its family's own layout: transformers' names and tensors.

    state = transformers_state_dict(model)   # the family's checkpoint keys (mlp.gate.weight, experts.gate_up_proj)
    save_transformers(model, "out")          # the whole folder, replaced atomically (every rank calls it)
    model.save_pretrained("out")             # the same bytes: to_mode_moe installs ``save_pretrained`` below
    model.load_state_dict(theirs)            # a family checkpoint loads into the converted model too

Why a per-instance ``save_pretrained`` and not a state-dict hook. transformers 5.23's ``save_pretrained`` takes
``self.state_dict()`` (or the ``state_dict=`` it is given), drops tied weights, and reverts the family's load-time
weight conversions (``revert_weight_conversion``) by key patterns before writing. A root state-dict hook that
renamed our keys would also rename them for everything else that reads ``state_dict()`` (DCP checkpoints,
FSDP2's ``get_model_state_dict``, optimisers resumed by name), and a ``_weight_conversions`` entry would be one
more transformers internal to follow. So the converted model's ``state_dict()`` keeps mode's names, and its
``save_pretrained`` (an instance attribute set by ``to_mode_moe``: the class, and so ``config.architectures``,
stay the family's) builds the plain family model on the meta device, assigns it our tensors under the family's
names (``transformers_names``: the renaming found by tensor identity at conversion, plus the few derived tensors)
and calls *that* model's ``save_pretrained`` with the caller's arguments: whatever transformers does there
(sharding, tied weights, weight-conversion reverts, ``push_to_hub``, other files in the folder left in place)
it does for the family's own model, so the bytes are those of ``save_transformers``. Nothing can be silently
re-initialised by plain ``from_pretrained``: the twin is checked key for key against a fresh family model
first, and a mismatch raises naming ``save_transformers``.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch import Tensor, nn

from mode._module_attr import set_module_attr
from mode.train.checkpoint import replace_dir

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from mode.layers.moe import MoELayer

CONVERTED_MARK = "_mode_converted_slot"  # a class attribute of convert's ConvertedMoE and ConvertedExperts


class ConvertedSlot(Protocol):
    """What this module and ``weight_init`` read of a converted slot (``ConvertedMoE``, ``ConvertedExperts``; they
    sit above both): its layer, and the names that lead to the family's layout and back."""

    moe: MoELayer
    names: dict[str, str]  # the layer's state-dict name -> the block's
    kept_names: dict[str, str]  # the slot's kept tensors -> the block's names
    derived: dict  # the block's name -> (our slot-relative names, function)
    inverse: dict  # the block's name -> its parts' values from its value
    hf_skeletons: list[tuple[str, nn.Module]]  # set by convert._keep_family_init

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...  # the nn.Module's methods it calls
    def get_parameter(self, target: str) -> nn.Parameter: ...
    def get_buffer(self, target: str) -> Tensor: ...
    def get_submodule(self, target: str) -> nn.Module: ...


def converted_slots(model: nn.Module) -> dict:
    """Module name -> every slot ``to_mode_moe`` put in ``model`` (``ConvertedMoE`` and ``ConvertedExperts``),
    found by their class's ``CONVERTED_MARK``: this module sits below ``mode.hf.moe.convert``, which imports it."""
    return {name: m for name, m in model.named_modules() if getattr(type(m), CONVERTED_MARK, False)}


def transformers_names(model: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state`` (the converted model's state dict, full tensors) under transformers' names: each slot's tensors
    renamed to the block's, the derived ones (LongCat's ``gate_up_proj``, DBRX's ``w1`` / ``v1`` / ``w2``) rebuilt
    from their parts; keys that are not ours pass unchanged (so a state already in the family's names is kept)."""
    rename, derived = {}, {}
    for slot_name, slot in converted_slots(model).items():
        for ours, theirs in slot.names.items():
            rename[f"{slot_name}.moe.{ours}"] = f"{slot_name}.{theirs}"
        for ours, theirs in slot.kept_names.items():
            rename[f"{slot_name}.{ours}"] = f"{slot_name}.{theirs}"
        for theirs, (parts, fn) in slot.derived.items():
            derived[f"{slot_name}.{theirs}"] = ([f"{slot_name}.{p}" for p in parts], fn)
    # Any: a state_dict handed to save_pretrained may hold None for a tensor, which stays None (derived ones too)
    out: dict[str, Any] = {rename.get(k, k): v for k, v in state.items()}
    used = set()
    for theirs, (parts, fn) in derived.items():
        if all(p in out for p in parts):
            got = [out[p] for p in parts]
            out[theirs] = None if any(g is None for g in got) else fn(*got)
            used.update(parts)
    for p in used:
        del out[p]
    return out


def mode_names(model: nn.Module, names) -> list[str]:
    """``names`` of the family's layout (a load report's ``missing_keys``, a checkpoint's keys) as the converted
    ``model`` names the same tensors: the inverse of ``transformers_names``. A derived tensor (LongCat's
    ``gate_up_proj``) names each of its parts; a name that is not a converted block's passes unchanged."""
    ours: dict[str, list[str]] = {}
    for slot_name, slot in converted_slots(model).items():
        for o, t in slot.names.items():
            ours[f"{slot_name}.{t}"] = [f"{slot_name}.moe.{o}"]
        for o, t in slot.kept_names.items():
            ours[f"{slot_name}.{t}"] = [f"{slot_name}.{o}"]
        for t, (parts, _) in slot.derived.items():
            ours[f"{slot_name}.{t}"] = [f"{slot_name}.{p}" for p in parts]
    return [o for n in names for o in ours.get(n, [n])]


def transformers_state_dict(model: nn.Module) -> dict[str, Tensor] | None:
    """The converted model's full state dict in its family's layout (what ``save_pretrained`` writes), for
    transformers' loaders (``from_pretrained(None, config=..., state_dict=...)``, ``load_state_dict`` of a plain
    family model). A parallelized model is gathered (every rank calls it; ranks other than 0 get None)."""
    from mode.parallel.full_state import full_state_dict

    state = full_state_dict(model)
    return None if state is None else transformers_names(model, state)


def transformers_twin(model: nn.Module, state: dict[str, Tensor]) -> PreTrainedModel:
    """The family's own model (``model``'s class, or the causal LM of its config) built on the meta device with
    ``state`` (transformers' names, full tensors) assigned: nothing is allocated twice. Raises ``ValueError``
    where ``state`` is not exactly the family model's keys (plain transformers would initialise the missing
    ones afresh)."""
    from transformers import AutoModelForCausalLM, PreTrainedModel

    config = copy.deepcopy(model.config)  # what transformers' init and save write into it stays off the model's
    with torch.device("meta"):
        if isinstance(model, PreTrainedModel):  # a causal LM, or a multimodal model around the MoE decoder
            fresh = type(model)._from_config(config)
        else:
            fresh = AutoModelForCausalLM.from_config(config)
    expected = set(fresh.state_dict())
    if set(state) != expected:
        raise ValueError(
            f"the converted model's tensors do not match a fresh {type(fresh).__name__}: missing "
            f"{sorted(expected - set(state))[:5]}, unexpected {sorted(set(state) - expected)[:5]}; "
            "plain transformers would initialise the missing ones afresh: save with "
            "mode.hf.save_transformers(model, path), which writes the full state"
        )
    fresh.load_state_dict(state, strict=True, assign=True)
    generation = getattr(model, "generation_config", None)
    if generation is not None:  # a base model or a non-generative head has none (and writes none)
        set_module_attr(fresh, "generation_config", generation)
    return fresh


def save_transformers(model: nn.Module, path: str | os.PathLike) -> Path | None:
    """Write a converted model (parallelized or not) as an ordinary transformers checkpoint folder
    (``save_pretrained``: config, generation config, safetensors), gathered from the shards. Every rank of
    a parallelized model calls it; rank 0 writes (into a temporary folder renamed into place, so ``path``
    is either the previous folder or the complete new one) and returns the path, the others return None
    once it is written. ``AutoModelForCausalLM.from_pretrained(path)`` needs no ``mode`` to load it."""
    from mode.parallel.full_state import barrier

    if not converted_slots(model):
        raise ValueError(
            "model: holds no ConvertedMoE layer (convert it with mode.hf.to_mode_moe first); "
            "save a plain transformers model with its own save_pretrained"
        )
    state = transformers_state_dict(model)
    out = None
    if state is not None:
        out = _write_atomically(transformers_twin(model, state), Path(path))
    barrier(model)
    return out


def _write_atomically(twin: PreTrainedModel, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        twin.save_pretrained(tmp, safe_serialization=True)
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def save_pretrained(self, save_directory, *args, state_dict: dict | None = None, **kwargs):
    """transformers' ``save_pretrained`` for a converted model (installed on the instance by ``to_mode_moe``):
    writes the family's own checkpoint layout, the bytes ``mode.hf.save_transformers`` writes, into
    ``save_directory`` (other files there stay, as with transformers). Every argument is transformers' own
    (``push_to_hub``, ``max_shard_size``, ``variant``, ...); a ``state_dict`` given in mode's names (HF Trainer's,
    accelerate's) is renamed the same way. Every rank of a parallelized model calls it; rank 0 writes."""
    from mode.parallel.full_state import barrier, full_state_dict

    state = full_state_dict(self) if state_dict is None else dict(state_dict)
    out = None
    if state is not None:
        out = transformers_twin(self, transformers_names(self, state)).save_pretrained(save_directory, *args, **kwargs)
    barrier(self)
    return out


def install_save_pretrained(model: nn.Module) -> None:
    """Every transformers model in ``model`` that holds converted layers (the causal LM, a multimodal model's text
    model) saves in its family's layout (``save_pretrained`` above, bound to it)."""
    from transformers import PreTrainedModel

    for m in model.modules():
        if isinstance(m, PreTrainedModel) and converted_slots(m):
            m.save_pretrained = types.MethodType(save_pretrained, m)


def load_family_names(slot: ConvertedSlot, state: dict, prefix: str, *args) -> None:
    """``load_state_dict`` pre-hook of a converted slot: keys of the family's layout (a transformers checkpoint,
    ``transformers_state_dict``) become the slot's own, derived tensors split back into their parts, so a family
    checkpoint loads into the converted model (HF Trainer's resume loads with ``strict=False``: nothing is
    skipped silently). Keys already in mode's names pass unchanged."""
    for ours, theirs in slot.names.items():
        if prefix + theirs in state:
            state[f"{prefix}moe.{ours}"] = state.pop(prefix + theirs)
    for ours, theirs in slot.kept_names.items():
        if prefix + theirs in state:
            state[prefix + ours] = state.pop(prefix + theirs)
    for theirs, (parts, _) in slot.derived.items():
        if prefix + theirs not in state:
            continue
        current = [
            state.get(prefix + p, slot.get_parameter(p) if p in dict(slot.named_parameters()) else slot.get_buffer(p))
            for p in parts
        ]
        inverse = cast(dict, slot.inverse)[theirs]  # the converted slot's: the block's name -> its inverse
        for p, value in zip(parts, inverse(state.pop(prefix + theirs), *current)):
            state[prefix + p] = value

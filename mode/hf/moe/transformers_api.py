"""The transformers API of a converted model, kept true: its metadata names mode's tensors, and
``set_experts_implementation`` picks mode's experts backends (or raises). ``to_mode_moe`` calls ``adopt``.

    model.set_experts_implementation("grouped")     # mode's backends: "reference", "grouped", "megablocks", "auto"
    model.set_experts_implementation("eager")       # transformers' names: eager -> reference, grouped_mm -> grouped
    model._keep_in_fp32_modules_strict               # {"moe.router.bias_X"} (DeepSeek-V3's e_score_correction_bias)

Metadata, per transformers model in the tree that holds converted slots (the causal LM, a multimodal model's
text model), all instance attributes (the class and the config, and so a saved checkpoint, stay the family's):
    _keep_in_fp32_modules(_strict)   each pattern that names a tensor of a converted block names ours instead
                                     (DeepSeek-V3's ``e_score_correction_bias`` -> ``moe.router.bias_X``); the
                                     family's pattern stays where it still names a tensor of the model (the
                                     checkpoint it saves is the family twin's, with the class's own list)
    _no_split_modules                 the converted block classes become ``ConvertedMoE`` / ``ConvertedExperts``
    tp_plan, ep_plan                  entries for the converted blocks' own tensors (router, experts) are dropped:
                                      transformers' tensor or expert parallelism would shard tensors that are no
                                      longer there (mode's expert parallelism is ``mode.parallel.parallelize``);
                                      entries for the modules a slot keeps (shared experts) follow them to their
                                      new path
"""

from __future__ import annotations

import re
import types

from torch import nn

from mode._module_attr import set_module_attr
from mode.hf.moe.saving import converted_slots

# transformers' experts implementation names -> mode's ExpertBank backend (mode's own names pass as they are)
EXPERTS_IMPLEMENTATIONS = {"eager": "reference", "grouped_mm": "grouped"}


def _owners(model: nn.Module) -> list[nn.Module]:
    from transformers import PreTrainedModel

    return [m for m in model.modules() if isinstance(m, PreTrainedModel) and converted_slots(m)]


def set_experts_implementation(self, experts_implementation) -> None:
    """transformers' ``set_experts_implementation`` on a converted model (installed on the instance): selects
    mode's experts backend for every converted layer. ``experts_implementation``: a mode backend ("auto",
    "reference", "grouped", "megablocks") or transformers' "eager" (-> "reference") / "grouped_mm" (->
    "grouped"); any other raises ``ValueError`` naming these (transformers' own kernels no longer run: the
    experts are mode's)."""
    from mode.experts.bank import BACKENDS

    if not isinstance(experts_implementation, str):
        raise TypeError(
            f"experts_implementation={experts_implementation!r}: a converted model takes one name for "
            "all its converted layers (a str), not a per-sub-config dict"
        )
    backend = EXPERTS_IMPLEMENTATIONS.get(experts_implementation, experts_implementation)
    if backend not in BACKENDS:
        raise ValueError(
            f"experts_implementation={experts_implementation!r}: a converted model's experts are "
            f"mode's; call set_experts_implementation with one of {', '.join(map(repr, BACKENDS))} "
            f"(or transformers' {', '.join(map(repr, EXPERTS_IMPLEMENTATIONS))}), or convert with "
            "mode.hf.to_mode_moe(model, backend=...)"
        )
    for slot in converted_slots(self).values():
        slot.moe.experts.set_backend(backend)
    if experts_implementation in EXPERTS_IMPLEMENTATIONS:  # the config says what transformers would say
        self.config._experts_implementation = experts_implementation


def _names(pattern: str, name: str) -> bool:
    """Whether an fp32 module pattern names the tensor ``name`` (transformers' rule: whole dotted parts)."""
    return re.search(rf"(^|\.){re.escape(pattern)}($|\.)", name) is not None


def _pattern(key: str) -> re.Pattern:
    """A plan key (``layers.*.mlp.experts``) as a regex over module paths."""
    return re.compile("^" + re.escape(key).replace(r"\*", r"\d+") + "$")


def _plan(plan: dict | None, owner: nn.Module, slots: dict) -> dict | None:
    """``plan`` (keys relative to ``owner``, ``*`` for a layer index) with what it names in the converted model:
    a key naming an existing module or tensor stays; one naming a module a slot keeps (shared experts, their
    gate) moves to its path in the slot; one naming only a converted block's router or experts goes."""
    if not plan:
        return plan
    existing = {n for n, _ in owner.named_modules()} | {n for n, _ in owner.named_parameters()}
    kept = []  # (slot, the module's path in the block, its path in the slot): modules the slot keeps
    for name, slot in slots.items():
        for ours, theirs in slot.names.items():
            if ours.startswith(("shared_experts.", "shared_gate.")):
                kept.append((name, theirs.rpartition(".")[0], f"moe.{ours.rpartition('.')[0]}"))
    out = {}
    for key, style in plan.items():
        pat = _pattern(key)
        if any(pat.match(n) for n in existing):
            out[key] = style
            continue
        hit = next(
            (
                (rel_t, rel_o)
                for name, rel_t, rel_o in kept
                if key.endswith("." + rel_t) and pat.match(f"{name}.{rel_t}")
            ),
            None,
        )
        if hit is not None:  # the same key (its layer index still a *) at the module's path in the slot
            out[key[: len(key) - len(hit[0])] + hit[1]] = style
    return out


def adopt(model: nn.Module) -> None:
    """Install the converted model's transformers API (``set_experts_implementation``) and bring its metadata to
    mode's names, on every transformers model in ``model`` that holds converted slots."""
    for owner in _owners(model):
        slots = converted_slots(owner)
        set_module_attr(owner, "set_experts_implementation", types.MethodType(set_experts_implementation, owner))
        names = list(owner.state_dict())
        for attr in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
            patterns = set(getattr(owner, attr, None) or ())
            ours = {
                f"moe.{o}" for p in patterns for slot in slots.values() for o, t in slot.names.items() if _names(p, t)
            }
            # a family pattern that named only converted tensors names nothing now (the checkpoint the twin
            # saves takes the class's own list)
            kept = {p for p in patterns if any(_names(p, n) for n in names)}
            if patterns:
                setattr(owner, attr, kept | ours)
        no_split = set(getattr(owner, "_no_split_modules", None) or ())
        converted = {s.block_class for s in slots.values()}
        set_module_attr(owner, "_no_split_modules", (no_split - converted) | {type(s).__name__ for s in slots.values()})
        for attr in ("_tp_plan", "_ep_plan"):
            plan = getattr(owner, attr, None)
            if plan:
                setattr(owner, attr, _plan(plan, owner, slots))

"""transformers' weight initialisation (``_init_weights``, ``init_weights``, ``post_init``) on a converted model:
mode's router, experts and buffers initialised as the family initialises its own.

    model = AutoModelForCausalLM.from_config(config)  # under torch.device("meta"): nothing allocated
    mh.to_mode_moe(model)
    model.to_empty(device="cpu")
    model.init_weights()                               # the family's init on every tensor, ours included

How. transformers initialises module by module (``smart_apply``: children first, then the module, each through
the owning ``PreTrainedModel._init_weights``), matching modules by class: its router class gets
``normal_(weight, std=initializer_range)``, its experts class ``normal_(gate_up_proj)`` ..., DeepSeek-V3's router
``zeros_(e_score_correction_bias)``. A converted slot no longer holds those modules, so at conversion it keeps a
*skeleton* of each one that owned tensors (``copy.copy`` of the module with its tensor slots emptied: the class,
and the plain attributes ``_init_weights`` may read, without the tensors). ``_init_weights`` of the model (an
instance attribute set by ``to_mode_moe``, around the class's own) meets the slot, fills each skeleton with the
slot's current tensors under the family's names, and hands it to the family's own ``_init_weights``: the very
rules, the very ``initializer_range``, written into our tensors. Derived tensors (LongCat's ``gate_up_proj``,
DBRX's ``w1`` / ``v1`` / ``w2``) are built, initialised and split back. Then mode's own state the family has no
counterpart for is reset to its construction value: the bias balancer's ``load_X`` (zeros) and ``share_X``
(the target shares). The skeletons are plain attributes, not submodules, so they hold no tensors in between.

transformers' ``_is_hf_initialized`` flags are kept as meaning: a slot converted from a block transformers had
initialised (or loaded) is flagged, so ``init_weights()`` / ``post_init()`` on a converted pretrained model leaves
its experts alone, as it leaves its own modules; mode's inner modules are always flagged (the slot initialises
them), so transformers' generic rules never meet them.
"""

from __future__ import annotations

import copy
import types
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor, nn

from mode._module_attr import set_module_attr
from mode.routing.token_choice import TokenChoiceRouter

if TYPE_CHECKING:
    from mode.hf.moe.saving import ConvertedSlot


def skeletons(block: nn.Module, alive: set[int]) -> list[tuple[str, nn.Module]]:
    """(path in the block, skeleton) of each module of ``block`` not kept alive in the converted slot (``alive``:
    ids of the modules the slot still holds, such as shared experts), in the order transformers initialises them
    (children first, then the module). A skeleton's children are skeletons too (or the live module), so a rule
    that reads a child (LongCat's ``router.classifier.weight``) finds it."""
    out = []

    def visit(module: nn.Module, path: str) -> nn.Module:
        if id(module) in alive:
            return module
        children = {name: visit(child, f"{path}.{name}" if path else name) for name, child in module.named_children()}
        sk = copy.copy(module)
        object.__setattr__(sk, "_parameters", dict.fromkeys(module._parameters))
        object.__setattr__(sk, "_buffers", dict.fromkeys(module._buffers))
        object.__setattr__(sk, "_modules", children)
        out.append((path, sk))
        return sk

    visit(block, "")
    return out


def _theirs_to_ours(slot: ConvertedSlot) -> dict[str, str]:
    """The block's tensor name -> the slot's (slot-relative) name."""
    back = {theirs: f"moe.{ours}" for ours, theirs in slot.names.items()}
    back.update({theirs: ours for ours, theirs in slot.kept_names.items()})
    return back


def _tensor(slot: ConvertedSlot, name: str) -> Tensor:
    module_path, _, leaf = name.rpartition(".")
    return getattr(slot.get_submodule(module_path), leaf)


@torch.no_grad()
def init_slot(slot: ConvertedSlot, family_init) -> None:
    """Initialise ``slot``'s tensors with ``family_init`` (the family's ``PreTrainedModel._init_weights``)
    through its skeletons, then reset mode's own buffers."""
    back = _theirs_to_ours(slot)
    # what convert._keep_family_init and the slot's __init__ attached (attributes of the converted slots)
    skeletons = slot.hf_skeletons
    derived, inverse = cast(dict, slot.derived), cast(dict, slot.inverse)
    written = []  # (derived temporary, the block's name): split back into the parts after the init
    try:
        for path, sk in skeletons:  # every skeleton filled first: a rule may read a child's tensor
            # a skeleton's parameter entries hold the slot's tensors as they are (Parameters or not) for the init
            for store in cast(tuple[dict[str, Tensor | None], ...], (sk._parameters, sk._buffers)):
                for name in store:
                    theirs = f"{path}.{name}" if path else name
                    if theirs in back:
                        store[name] = _tensor(slot, back[theirs])
                    elif theirs in derived:
                        parts, fn = derived[theirs]
                        store[name] = fn(*(_tensor(slot, p) for p in parts)).detach().clone()
                        written.append((store[name], theirs))
        for _, sk in skeletons:
            family_init(sk)
        for t, theirs in written:
            current = [_tensor(slot, p) for p in derived[theirs][0]]
            for part, value in zip(current, inverse[theirs](t, *current)):
                part.copy_(value)
    finally:
        for _, sk in skeletons:  # the skeletons hold no tensor in between
            for store in (sk._parameters, sk._buffers):
                for name in store:
                    store[name] = None
    router = slot.moe.router
    if getattr(router, "load_X", None) is not None:  # the bias balancer's counts since its last update
        router = cast(TokenChoiceRouter, router)  # the router that balances with a bias
        router.load_X.zero_()
        router.share_X.copy_(torch.tensor(router.cfg.target_shares(), dtype=router.share_X.dtype))


def _init_weights(self, module: nn.Module) -> None:
    """``PreTrainedModel._init_weights`` of a model holding converted slots (installed on the instance by
    ``install_init``): a slot is initialised as its family's modules; every other module as before."""
    family_init = types.MethodType(type(self)._init_weights, self)
    if getattr(module, "hf_skeletons", None) is not None:  # only a converted slot has skeletons
        init_slot(cast("ConvertedSlot", module), family_init)
    else:
        family_init(module)


def mark_initialised(slot: nn.Module, block: nn.Module) -> None:
    """transformers' flags on a new slot: its inner mode modules are always flagged (the slot initialises their
    tensors; transformers' own modules it keeps, such as shared experts, keep theirs); the slot itself is flagged
    where transformers had initialised or loaded the block."""
    theirs = {id(m) for m in block.modules()}
    for m in slot.modules():
        if m is not slot and id(m) not in theirs:
            set_module_attr(m, "_is_hf_initialized", True)
    if getattr(block, "_is_hf_initialized", False):
        set_module_attr(slot, "_is_hf_initialized", True)


def install_init(model: nn.Module) -> None:
    """Every transformers model in ``model`` initialises converted slots as their family (``_init_weights``
    above, bound to the instance: the class stays the family's)."""
    from transformers import PreTrainedModel

    for m in model.modules():
        if isinstance(m, PreTrainedModel) and any(getattr(s, "hf_skeletons", None) is not None for s in m.modules()):
            m._init_weights = types.MethodType(_init_weights, m)


def block_skeletons(block: nn.Module, slot: nn.Module) -> list[tuple[str, nn.Module]]:
    """The skeletons of ``block`` for ``slot`` (the modules the slot still holds, such as shared experts and their
    gate, are initialised by transformers as they are)."""
    alive = {id(m) for m in slot.modules()} & {id(m) for m in block.modules()}
    return skeletons(block, alive)

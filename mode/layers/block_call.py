"""How ``MoD`` calls the block it wraps: which of the positions, the mask and the KV cache the block takes,
read once from the signature of ``block.forward`` when the ``MoD`` is built, and what its output means.

Shape legend: B batch, C routed slots per sequence, D hidden.

The three things ``MoD`` can pass besides the routed tokens ``x_BCD`` (always the first argument):
    positions  ``positions_BC``: each routed token's original position (for RoPE)
    mask       ``mask_BC``: None, or True where a slot holds a real routed token (the others, present only
               with padding or causal routing, are discarded)
    cache      a ``RowView`` of the layer's ``KVCache`` to attend to and extend (KV-cached decoding only)

The parameters of ``forward`` after the first are matched to them in three steps:
    1. by name: ``positions_BS`` or ``positions``; ``mask_BS`` or ``mask``; ``cache``
    2. in order: positions, then mask (those not matched by name) go to the next parameters that can be
       given positionally (``forward(x, pos, attn_mask)``), or through ``*args`` when ``x`` is followed by
       ``*args`` alone
    3. the rest by keyword (``positions_BS=``, ``mask_BS=``, ``cache=``) when ``forward`` takes ``**kwargs``
What matches nothing is not passed: ``forward(x)`` gets ``x`` alone, and a parameter named ``causal`` keeps
its default. A parameter without a default that nothing fills, or a name that contradicts its place (a mask
or a cache where the positions go), is a ``TypeError`` when the ``MoD`` is built, not at its first call.

Output: ``y_BCD``, or a tuple whose first element is ``y_BCD`` (transformers-style blocks); ``Aux`` elements
of the tuple are merged into the layer's ``Aux``, anything else in it (attention weights, a present key/value)
is dropped. ``y_BCD`` must have ``x_BCD``'s shape.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import cast

from torch import Tensor, nn

from mode.routing.plan import Aux

ROLES = ("positions", "mask")  # what can go by position, in this order; the cache only goes by name
NAMES = {"positions": ("positions_BS", "positions"), "mask": ("mask_BS", "mask"), "cache": ("cache",)}
KEYWORD = {"positions": "positions_BS", "mask": "mask_BS", "cache": "cache"}  # through **kwargs
UNFILLED = ("causal",)  # TransformerBlock's flag: MoD routes causally itself and never passes it on
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_WRONG_PLACE = {"positions": ("mask", "cache"), "mask": ("pos", "cache")}  # names that contradict a role


@dataclass(frozen=True)
class BlockCall:
    """The call ``MoD`` makes: ``block(x, *[value of each role in positional], **{name: value of role})``.

    ``positional``: roles passed by position after ``x``; ``keyword``: ``(parameter name, role)`` pairs;
    ``cache``: the parameter that takes the cache, or None (the block cannot decode with a KV cache);
    ``signature``: the signature read, for error messages."""

    positional: tuple[str, ...]
    keyword: tuple[tuple[str, str], ...]
    cache: str | None
    signature: str

    @property
    def takes(self) -> frozenset[str]:
        """The roles the block receives."""
        return frozenset(self.positional) | {role for _, role in self.keyword} | ({"cache"} if self.cache else set())

    def __call__(
        self, block: nn.Module, x_BCD: Tensor, positions_BC: Tensor, mask_BC: Tensor | None, cache=None
    ) -> tuple[Tensor, Aux]:
        values = {"positions": positions_BC, "mask": mask_BC}
        kwargs = {name: values[role] for name, role in self.keyword}
        if cache is not None:  # decoding; MoD refuses a cache for a block without a cache parameter
            kwargs[cast(str, self.cache)] = cache
        return block_output(block, block(x_BCD, *(values[r] for r in self.positional), **kwargs), x_BCD)


def block_output(block: nn.Module, out, x_BCD: Tensor) -> tuple[Tensor, Aux]:
    """``(y_BCD, Aux)`` from what the block returned (the module doc's output rule)."""
    aux = Aux()
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        for extra in out[1:]:
            if isinstance(extra, Aux):
                aux.merge(extra)
        out = out[0]
    if not isinstance(out, Tensor):
        raise TypeError(
            f"block={type(block).__name__} returned {type(out).__name__}: MoD needs the output "
            "y_BCD (a tensor), or a tuple whose first element is y_BCD"
        )
    if out.shape != x_BCD.shape:
        raise ValueError(
            f"block={type(block).__name__} returned shape {tuple(out.shape)}: must equal its input's "
            f"shape {tuple(x_BCD.shape)} (MoD puts the output back in the routed tokens' places)"
        )
    return out, aux


def forward_signature(block: nn.Module) -> inspect.Signature | None:
    """The signature of the block's own ``forward`` (a compiled block's original module's), or None where
    Python cannot read it."""
    forward = getattr(block, "_orig_mod", block).forward  # torch.compile wraps the module: read the original
    try:
        return inspect.signature(forward)
    except (TypeError, ValueError):
        return None


def block_call(block: nn.Module) -> BlockCall:
    """Read ``block.forward``'s signature once and decide what ``MoD`` passes it (the module doc's rules)."""
    sig = forward_signature(block)
    name = type(block).__name__
    if sig is None:  # a builtin: the full protocol, positionally
        return BlockCall(ROLES, (), "cache", "(unreadable)")
    text = f"{name}.forward{sig}"
    params = list(sig.parameters.values())
    if not params or params[0].kind not in (*_POSITIONAL, inspect.Parameter.VAR_POSITIONAL):
        raise TypeError(f"block={name}: {text} must take the routed tokens x as its first positional argument")
    if params[0].kind == inspect.Parameter.VAR_POSITIONAL:  # forward(*args, ...): the full protocol
        var_kw = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)
        cache = "cache" if var_kw or "cache" in sig.parameters else None
        return BlockCall(ROLES, (), cache, text)
    rest = params[1:]
    role_of: dict[str, str] = {}  # parameter name -> role
    for p in rest:  # 1. by name
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
            role = next((r for r, names in NAMES.items() if p.name in names), None)
            if role is not None and role not in role_of.values():
                role_of[p.name] = role
    left = [r for r in ROLES if r not in role_of.values()]
    slots = [p for p in rest if p.kind in _POSITIONAL and p.name not in role_of and p.name not in UNFILLED]
    for p in slots:  # 2. in order
        if not left:
            break
        role = left.pop(0)
        if any(word in p.name.lower() for word in _WRONG_PLACE[role]):
            raise TypeError(
                f"block={name}: {text}: MoD would pass the {role} as '{p.name}' (its order: x, positions, "
                "mask); name the parameters positions_BS / mask_BS / cache, or reorder them"
            )
        role_of[p.name] = role
    var_args = any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in rest)
    through_args = tuple(left) if var_args and not any(p.kind in _POSITIONAL for p in rest) else ()
    left = [r for r in left if r not in through_args]
    var_kw = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in rest)
    for p in rest:  # what nothing fills must have a default
        if (
            p.name not in role_of
            and p.default is inspect.Parameter.empty
            and p.kind in (*_POSITIONAL, inspect.Parameter.KEYWORD_ONLY)
        ):
            raise TypeError(
                f"block={name}: {text}: MoD cannot fill the parameter '{p.name}' (it passes x, then the "
                "positions, the mask and, when decoding, cache=); give it a default"
            )
    positional: list[str] = []
    keyword: list[tuple[str, str]] = []
    gap = None  # a positional-only parameter left at its default: none after it can be filled
    for p in rest:
        role = role_of.get(p.name)
        if p.kind == inspect.Parameter.POSITIONAL_ONLY:
            if role is None:
                gap = gap or p.name
            elif gap is not None:
                raise TypeError(
                    f"block={name}: {text}: MoD would pass the {role} as '{p.name}', after '{gap}', "
                    "which it does not fill; reorder the parameters"
                )
            else:
                positional.append(role)
        elif role is not None and role != "cache":
            keyword.append((p.name, role))
    positional += through_args
    if var_kw:
        keyword += [(KEYWORD[r], r) for r in left]
    cache = next((n for n, r in role_of.items() if r == "cache"), None)
    if cache is None and var_kw:
        cache = "cache"
    return BlockCall(tuple(positional), tuple(keyword), cache, text)

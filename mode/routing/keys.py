"""Names of routing statistics: one place that builds and parses them.

Every router stores its ``RoutingStats`` under ``"router"``; layers prefix the names of what they wrap when
they merge ``Aux`` results (``MoD``: ``"mod."``; ``TransformerBlock``: ``"moe."`` for its MLP's router; the
LM: ``"layers.{i}."``). So an LM's stats are named, for example::

    layers.3.mod.router      the MoD router of layer 3 (MoD, staged MoDE)
    layers.3.moe.router      the MoE router of layer 3 (MoE, staged and integrated MoDE)

Code that needs a name builds it with ``router_key`` and reads one with ``parse_router_key``; nothing else
splits names on dots.
"""

from __future__ import annotations

from dataclasses import dataclass

ROUTER = "router"  # a router's own stats
MOD = "mod"  # prefix a MoD layer gives its router's entries
MOE = "moe"  # prefix a block gives its MLP's (an MoE's) entries
LAYERS = "layers"  # prefix the LM gives layer i's entries: "layers.{i}."
PARTS = (MOD, MOE)


def layer_prefix(layer: int) -> str:
    """``"layers.{i}."``: what the LM puts before layer ``i``'s names."""
    return f"{LAYERS}.{layer}."


def router_key(layer: int | None, part: str) -> str:
    """The stats name of layer ``layer``'s ``part`` router (``part`` is ``MOD`` or ``MOE``); ``layer=None``
    names it inside a single layer's ``Aux``."""
    if part not in PARTS:
        raise ValueError(f"part={part!r}: must be one of {PARTS}")
    return ("" if layer is None else layer_prefix(layer)) + f"{part}.{ROUTER}"


@dataclass(frozen=True)
class RouterKey:
    """A parsed stats name: ``prefix`` (everything before the part), ``layer`` (the LM layer index, when the
    name starts with ``layers.{i}.``), ``part`` (``"mod"``, ``"moe"`` or None for a bare ``"router"``)."""

    prefix: str
    layer: int | None
    part: str | None

    def sibling(self, part: str) -> str:
        """The name of the ``part`` router beside this one (staged MoDE: its MoD router beside its MoE router)."""
        return f"{self.prefix}{part}.{ROUTER}"


def parse_router_key(name: str) -> RouterKey | None:
    """Parse a stats name ending in ``router``; None for any other name."""
    if name != ROUTER and not name.endswith("." + ROUTER):
        return None
    head = name[: -len(ROUTER)]  # "layers.3.moe." or ""
    part = None
    for p in PARTS:
        if head == f"{p}." or head.endswith(f".{p}."):
            part, head = p, head[: -len(p) - 1]
            break
    layer = None
    if head.startswith(f"{LAYERS}."):
        index = head[len(LAYERS) + 1 :].split(".", 1)[0]
        if index.isdigit():
            layer = int(index)
    return RouterKey(prefix=head, layer=layer, part=part)

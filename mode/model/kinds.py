"""The layer kinds of the LM: one registry that the config, the model, the FLOP count and the per-token
compute all read. Adding a kind is one ``register_layer_kind`` call.

A kind says what a layer routes and how it is built:
    mod       the MoD selection in front of the whole block ("learned" top-C, "random" top-C), or None
    experts   whether the block's MLP is an MoE (else a dense MLP)
    noop      whether that MoE's router also has ``num_noop`` no-op experts (integrated MoDE)
    build     ``build(cfg) -> nn.Module``: the layer, called as
              ``layer(x_BSD, mask_BS=..., positions_BS=..., cache=..., causal=...) -> (y_BSD, Aux)``
              (``TransformerBlock`` and ``MoD`` both take this call).

Everything else follows from these three facts and from the routers' own answers (``mode.routing.registry``):
a MoD-routed layer runs attention and MLP on the C routed tokens of each sequence; an MoE's computed
assignments and router cost come from its router config.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from mode.layers.block import TransformerBlock
from mode.layers.mlp import MLP
from mode.layers.mod import MoD, StagedMoDE
from mode.layers.moe import IntegratedMoDE, MoELayer
from mode.routing.mod_topk import MoDRouter


@dataclass(frozen=True)
class LayerKind:
    name: str
    build: Callable[..., nn.Module]  # build(cfg: LMConfig) -> layer
    mod: str | None = None  # MoD selection routing the block: "learned", "random", or None
    experts: bool = False  # the MLP is an MoE
    noop: bool = False  # the MoE router has cfg.num_noop no-op experts (needs num_noop >= 1)
    doc: str = ""


LAYER_KINDS: dict[str, LayerKind] = {}


def register_layer_kind(kind: LayerKind, *, replace: bool = False) -> LayerKind:
    if not isinstance(kind, LayerKind):
        raise TypeError(f"kind={kind!r}: must be a LayerKind")
    if kind.mod not in (None, "learned", "random"):
        raise ValueError(f"kind.mod={kind.mod!r}: must be None, 'learned' or 'random'")
    if kind.noop and not kind.experts:
        raise ValueError(f"kind {kind.name!r}: noop=True needs experts=True (no-op experts live in an MoE router)")
    if kind.name in LAYER_KINDS and not replace and LAYER_KINDS[kind.name] != kind:
        raise ValueError(f"kind.name={kind.name!r}: already registered; pass replace=True")
    LAYER_KINDS[kind.name] = kind
    return kind


def get_layer_kind(name: str, field: str = "layers") -> LayerKind:
    if not isinstance(name, str) or name not in LAYER_KINDS:
        raise ValueError(
            f"{field}={name!r}: must be one of {', '.join(map(repr, LAYER_KINDS))} "
            "(or a kind registered with mode.model.kinds.register_layer_kind)"
        )
    return LAYER_KINDS[name]


# -- builders of the built-in kinds ----------------------------------------------------------------------


def _block(cfg, mlp: nn.Module) -> TransformerBlock:
    return TransformerBlock(cfg.d_model, cfg.n_heads, mlp, rope_base=cfg.rope_base)


def _dense(cfg) -> TransformerBlock:
    return _block(cfg, MLP(cfg.d_model, cfg.d_hidden, cfg.activation))


def _moe(cfg, noop: bool) -> TransformerBlock:
    layer_cls = IntegratedMoDE if noop else MoELayer
    return _block(cfg, layer_cls.from_config(cfg.moe_config(with_noop=noop)))


register_layer_kind(LayerKind("dense", _dense, doc="attention + dense MLP"))
register_layer_kind(
    LayerKind(
        "mod",
        lambda cfg: MoD(_dense(cfg), MoDRouter(cfg.mod_config("learned"))),
        mod="learned",
        doc="MoD-routed dense block (top-C of each sequence, raw router weight)",
    )
)
register_layer_kind(
    LayerKind(
        "mod_random",
        lambda cfg: MoD(_dense(cfg), MoDRouter(cfg.mod_config("random"))),
        mod="random",
        doc="MoD block whose top-C is drawn at random (the paper's stochastic-routing control)",
    )
)
register_layer_kind(LayerKind("moe", lambda cfg: _moe(cfg, noop=False), experts=True, doc="attention + MoE MLP"))
register_layer_kind(
    LayerKind(
        "staged",
        lambda cfg: StagedMoDE(_moe(cfg, noop=False), MoDRouter(cfg.mod_config("learned"))),
        mod="learned",
        experts=True,
        doc="staged MoDE: MoD routing in front of an attention + MoE block",
    )
)
register_layer_kind(
    LayerKind(
        "integrated",
        lambda cfg: _moe(cfg, noop=True),
        experts=True,
        noop=True,
        doc="integrated MoDE: attention + MoE MLP whose router also has num_noop no-op experts",
    )
)

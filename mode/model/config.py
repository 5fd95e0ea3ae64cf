"""Configuration of the decoder-only LM: one kind per layer, plus the knobs each kind uses.

Layer kinds live in ``mode.model.kinds.LAYER_KINDS`` (built in: "dense", "mod", "mod_random", "moe",
"staged", "integrated"); MoE routers in ``mode.routing.registry.ROUTERS``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mode import _checks
from mode.layers.moe import MoEConfig
from mode.model.kinds import LAYER_KINDS, LayerKind, get_layer_kind
from mode.routing.mod_topk import MoDRouterConfig

__all__ = ["LAYER_KINDS", "LMConfig", "alternate"]


def alternate(n_layers: int, even: str, odd: str) -> tuple[str, ...]:
    """``even`` on layers 0, 2, 4, ... and ``odd`` on 1, 3, 5, ... (the paper routes every other block)."""
    return tuple(even if i % 2 == 0 else odd for i in range(n_layers))


@dataclass
class LMConfig:
    vocab_size: int = 256
    seq_len: int = 256
    d_model: int = 128
    n_heads: int = 4
    d_hidden: int = 512
    layers: tuple[str, ...] = field(default_factory=lambda: ("dense",) * 4)
    activation: str = "gelu"
    tie_embeddings: bool = True
    rope_base: float = 10000.0
    # MoD ("mod", "mod_random", "staged")
    capacity: float = 0.125
    mod_gate: str = "raw"
    causal: str = "none"  # causal routing for sampling: "none", "predictor" or "aux_bce" (MoDRouter)
    causal_coef: float = 0.1
    predictor_hidden: int = 64
    # MoE ("moe", "staged", "integrated")
    num_experts: int = 8
    expert_hidden: int | None = None  # None: d_hidden
    top_k: int = 1
    router: str = "token_choice"  # a name in mode.routing.registry.ROUTERS
    router_options: dict = field(default_factory=dict)  # extra fields of that router's config
    capacity_factor: float | None = None
    num_noop: int = 0  # "integrated" only; must be >= 1 there
    noop_kinds: str | tuple = "zero"  # the no-op slots' kinds: "zero", "copy", "constant" (mode.layers.noop)
    balance_coef: float = 0.01
    z_coef: float = 1e-3
    backend: str = "auto"
    num_shared: int = 0  # shared experts of every MoE layer (MoEConfig.num_shared)
    shared_hidden: int | None = None  # None: num_shared * expert hidden size
    shared_gate: bool = False  # Qwen2-MoE's sigmoid gate on the shared output

    def __post_init__(self) -> None:
        if isinstance(self.layers, str) or not isinstance(self.layers, (list, tuple)):
            raise TypeError(f"layers={self.layers!r}: must be a tuple (or list) of layer kind names")
        self.layers = tuple(self.layers)
        for name in ("vocab_size", "seq_len", "d_model", "n_heads", "d_hidden"):
            _checks.check_int(name, getattr(self, name))
        if self.expert_hidden is not None:
            _checks.check_int("expert_hidden", self.expert_hidden)
        _checks.check_positive("rope_base", self.rope_base)
        _checks.check_bool("tie_embeddings", self.tie_embeddings)
        if not isinstance(self.router_options, dict):
            raise TypeError(f"router_options={self.router_options!r}: must be a dict")
        if not self.layers:
            raise ValueError("layers=(): must name at least one layer")
        for i, name in enumerate(self.layers):
            kind = get_layer_kind(name, f"layers[{i}]")
            if kind.noop and self.num_noop < 1:
                raise ValueError(f"num_noop={self.num_noop}: an {name!r} layer needs num_noop >= 1")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model}: must be divisible by n_heads={self.n_heads}")
        if self.uses_mod:
            self.mod_config("learned")
        if self.uses_moe:
            self.moe_config(with_noop=True)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def kinds(self) -> tuple[LayerKind, ...]:
        """The registered ``LayerKind`` of each layer."""
        return tuple(LAYER_KINDS[name] for name in self.layers)

    @property
    def uses_mod(self) -> bool:
        return any(k.mod is not None for k in self.kinds)

    @property
    def uses_moe(self) -> bool:
        return any(k.experts for k in self.kinds)

    def mod_config(self, selection: str) -> MoDRouterConfig:
        return MoDRouterConfig(
            d_model=self.d_model,
            capacity=self.capacity,
            gate=self.mod_gate,
            selection=selection,
            causal=self.causal,
            causal_coef=self.causal_coef,
            predictor_hidden=self.predictor_hidden,
        )

    def moe_config(self, with_noop: bool) -> MoEConfig:
        """The MoE config of a layer (``with_noop``: an integrated layer, with the no-op slots). A
        ``noop_target`` in ``router_options`` applies to the layers that have no-op slots only."""
        options = {k: v for k, v in self.router_options.items() if with_noop or k != "noop_target"}
        return MoEConfig(
            d_model=self.d_model,
            d_hidden=self.expert_hidden or self.d_hidden,
            num_experts=self.num_experts,
            router=self.router,
            top_k=self.top_k,
            num_noop=self.num_noop if with_noop else 0,
            capacity_factor=self.capacity_factor,
            balance_coef=self.balance_coef,
            z_coef=self.z_coef,
            activation=self.activation,
            backend=self.backend,
            router_options=options,
            num_shared=self.num_shared,
            shared_hidden=self.shared_hidden,
            shared_gate=self.shared_gate,
            noop_kinds=self.noop_kinds if with_noop else "zero",
        )

    def router_config(self, kind: LayerKind):
        """The MoE router config of a layer of ``kind`` (which has experts)."""
        return self.moe_config(with_noop=kind.noop).router_config()

"""Configuration of the decoder-only LM: one kind per layer, plus the knobs each kind uses.

Layer kinds
    "dense"       attention + dense MLP
    "mod"         MoD-routed dense block (top-C of each sequence, raw router weight)
    "mod_random"  MoD block whose top-C is drawn at random (the paper's stochastic-routing control)
    "moe"         attention + MoE MLP
    "staged"      staged MoDE: MoD routing in front of an attention + MoE block
    "integrated"  integrated MoDE: attention + MoE MLP whose router also has ``num_noop`` no-op experts
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mode import _checks
from mode.layers.moe import MoEConfig
from mode.routing.mod_topk import MoDRouterConfig

LAYER_KINDS = ("dense", "mod", "mod_random", "moe", "staged", "integrated")


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
    router: str = "token_choice"
    capacity_factor: float | None = None
    num_noop: int = 0  # "integrated" only; must be >= 1 there
    balance_coef: float = 0.01
    z_coef: float = 1e-3
    backend: str = "auto"

    def __post_init__(self) -> None:
        self.layers = tuple(self.layers)
        for name in ("vocab_size", "seq_len", "d_model", "n_heads", "d_hidden"):
            _checks.check_int(name, getattr(self, name))
        if not self.layers:
            raise ValueError("layers=(): must name at least one layer")
        for i, kind in enumerate(self.layers):
            _checks.check_choice(f"layers[{i}]", kind, LAYER_KINDS)
        if "integrated" in self.layers and self.num_noop < 1:
            raise ValueError(f"num_noop={self.num_noop}: an 'integrated' layer needs num_noop >= 1")
        if self.uses_mod:
            self.mod_config("learned")
        if self.uses_moe:
            self.moe_config(with_noop=True)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def uses_mod(self) -> bool:
        return any(k in ("mod", "mod_random", "staged") for k in self.layers)

    @property
    def uses_moe(self) -> bool:
        return any(k in ("moe", "staged", "integrated") for k in self.layers)

    def mod_config(self, selection: str) -> MoDRouterConfig:
        return MoDRouterConfig(d_model=self.d_model, capacity=self.capacity, gate=self.mod_gate, selection=selection,
                               causal=self.causal, causal_coef=self.causal_coef,
                               predictor_hidden=self.predictor_hidden)

    def moe_config(self, with_noop: bool) -> MoEConfig:
        return MoEConfig(
            d_model=self.d_model, d_hidden=self.expert_hidden or self.d_hidden, num_experts=self.num_experts,
            router=self.router, top_k=self.top_k, num_noop=self.num_noop if with_noop else 0,
            capacity_factor=self.capacity_factor, balance_coef=self.balance_coef, z_coef=self.z_coef,
            activation=self.activation, backend=self.backend)

"""Analytic FLOPs of the LM's forward pass, layer by layer, and a measured count to check them.

Conventions: a matmul of (m, k) by (k, n) costs 2mkn; attention scores and values count the full
S x S product (as torch's flop counter does; causal kernels may skip half); element-wise work (norms,
activations, softmax, RoPE) is not counted. Training FLOPs are 3x forward (backward = 2x forward).

A routed block counts attention and MLP for its C routed tokens only; tokens routed to a no-op expert
or dropped count nothing. For layers whose compute depends on the routing (token choice with no-op
experts or capacity), ``nominal`` assumes balanced routing and ``realized`` reads the counts from the
forward pass's ``Aux`` stats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode

from mode.model.config import LMConfig
from mode.routing.plan import Aux

TRAIN_MULTIPLIER = 3


def attention_flops(n: float, d: int) -> float:
    """q, k, v and output projections plus scores and weighted values for ``n`` tokens attending to each other."""
    return 8 * n * d * d + 4 * n * n * d


def mlp_flops_per_token(d: int, h: int, activation: str) -> float:
    return (6 if activation == "swiglu" else 4) * d * h


@dataclass
class LayerFlops:
    kind: str
    attention: float
    mlp: float
    router: float

    @property
    def total(self) -> float:
        return self.attention + self.mlp + self.router


def _moe_assignments_nominal(cfg: LMConfig, n_tokens: int, with_noop: bool) -> float:
    """Expected computed assignments for ``n_tokens`` tokens under balanced routing."""
    noop = cfg.num_noop if with_noop else 0
    slots = cfg.num_experts + noop
    if cfg.router == "expert_choice":
        cf = 1.0 if cfg.capacity_factor is None else cfg.capacity_factor
        return cfg.num_experts * math.ceil(cf * n_tokens / slots)
    wanted = n_tokens * cfg.top_k * cfg.num_experts / slots
    if cfg.capacity_factor is None:
        return wanted
    return min(wanted, cfg.num_experts * math.ceil(cfg.capacity_factor * n_tokens * cfg.top_k / cfg.num_experts))


def layer_flops(cfg: LMConfig, kind: str, seq_len: int, assignments: float | None = None) -> LayerFlops:
    """Forward FLOPs of one layer on one sequence. ``assignments``: realized expert rows per sequence."""
    d, s = cfg.d_model, seq_len
    c = max(1, math.floor(cfg.capacity * s))
    mlp_tok = mlp_flops_per_token(d, cfg.d_hidden, cfg.activation)
    exp_tok = mlp_flops_per_token(d, cfg.expert_hidden or cfg.d_hidden, cfg.activation)
    if kind == "dense":
        return LayerFlops(kind, attention_flops(s, d), s * mlp_tok, 0.0)
    mod_router = 2 * s * d + (2 * s * (d + 1) * cfg.predictor_hidden if cfg.causal == "predictor" else 0)
    if kind in ("mod", "mod_random"):
        return LayerFlops(kind, attention_flops(c, d), c * mlp_tok, mod_router)
    n = c if kind == "staged" else s
    with_noop = kind == "integrated"
    slots = cfg.num_experts + (cfg.num_noop if with_noop else 0)
    a = _moe_assignments_nominal(cfg, n, with_noop) if assignments is None else assignments
    router = 2 * n * d * slots + (mod_router if kind == "staged" else 0)
    return LayerFlops(kind, attention_flops(n, d), a * exp_tok, router)


def realized_assignments(aux: Aux, layer: int) -> float | None:
    """Expert rows per sequence that layer ``layer`` actually computed in the forward pass behind ``aux``."""
    stats = aux.stats.get(f"layers.{layer}.moe.router")
    if stats is None:
        return None
    return float(stats.kept_E.sum()) / stats.batch_shape[0] if stats.batch_shape[0] else 0.0


def forward_flops(cfg: LMConfig, seq_len: int | None = None, aux: Aux | None = None) -> list[LayerFlops]:
    """Per-layer forward FLOPs of one sequence (nominal, or realized when ``aux`` is given), plus the head."""
    s = seq_len or cfg.seq_len
    out = []
    for i, kind in enumerate(cfg.layers):
        a = realized_assignments(aux, i) if aux is not None else None
        out.append(layer_flops(cfg, kind, s, a))
    out.append(LayerFlops("head", 0.0, 2 * s * cfg.d_model * cfg.vocab_size, 0.0))
    return out


def forward_flops_per_token(cfg: LMConfig, seq_len: int | None = None, aux: Aux | None = None) -> float:
    s = seq_len or cfg.seq_len
    return sum(f.total for f in forward_flops(cfg, s, aux)) / s


def train_flops_per_token(cfg: LMConfig, seq_len: int | None = None, aux: Aux | None = None) -> float:
    return TRAIN_MULTIPLIER * forward_flops_per_token(cfg, seq_len, aux)


def _sdpa_cpu_flops(query_shape, key_shape, value_shape, *args, **kwargs) -> int:
    b, h, sq, k = query_shape
    return 4 * b * h * sq * key_shape[2] * k  # scores + weighted values, full S_q x S_k


def _grouped_mm_flops(a_shape, b_shape, *args, **kwargs) -> int:
    # 2-D x 3-D with offsets: every row of a meets exactly one (K, N) matrix.
    return 2 * a_shape[0] * a_shape[1] * b_shape[-1]


def measured_flops(fn, *args, **kwargs) -> tuple[int, object]:
    """Run ``fn`` under ``torch.utils.flop_counter.FlopCounterMode`` and return (FLOPs, fn's result).

    Adds formulas for the CPU attention kernel and ``torch._grouped_mm``, which the stock counter leaves
    at zero on CPU."""
    custom = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_flops}
    if hasattr(torch.ops.aten, "_grouped_mm"):
        custom[torch.ops.aten._grouped_mm] = _grouped_mm_flops
        import mode.experts.grouped_mm  # noqa: F401  (registers the mode::grouped_mm custom op)

        if hasattr(torch.ops.mode, "grouped_mm"):  # the counter cannot see inside a custom op
            custom[torch.ops.mode.grouped_mm] = _grouped_mm_flops
    with FlopCounterMode(display=False, custom_mapping=custom) as counter:
        result = fn(*args, **kwargs)
    return counter.get_total_flops(), result

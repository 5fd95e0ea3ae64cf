"""Analytic FLOPs of the LM's forward pass, layer by layer, and a measured count to check them.

Conventions: a matmul of (m, k) by (k, n) costs 2mkn; attention scores and values count the full
S x S product (as torch's flop counter does; causal kernels may skip half); element-wise work (norms,
activations, softmax, RoPE) is not counted. Training FLOPs are 3x forward (backward = 2x forward).

A routed block counts attention and MLP for its C routed tokens only; tokens routed to a no-op expert
or dropped count nothing. Shared experts count for every token that reaches the MoE layer. For layers whose
compute depends on the routing (token choice with no-op experts or capacity), ``nominal`` assumes balanced
routing and ``realized`` reads the counts from the forward pass's ``Aux`` stats (one host read for the whole
model; ``read=False`` leaves them on the device and returns a float64 0-dim tensor there instead, the same
value computed by the same operations in the same order, for the trainer to read with the step's other
scalars in its one host sync).

Nothing here knows a layer kind or a router by name: a layer's ``LayerKind`` (``mode.model.kinds``) says
whether MoD routes it and whether its MLP has experts, and the router configs answer how many tokens they
route (``seq_capacity``), how many assignments they compute (``assignments``) and what routing costs
(``router_flops``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, overload

import torch
from torch import Tensor

from mode.model.config import LMConfig
from mode.model.kinds import get_layer_kind
from mode.routing.keys import MOE, router_key
from mode.routing.plan import Aux

TRAIN_MULTIPLIER = 3
_N = TypeVar("_N", float, Tensor)  # a token count: a number, or per-row counts as a tensor (token_compute)


def attention_flops(n: _N, d: int) -> _N:
    """q, k, v and output projections plus scores and weighted values for ``n`` tokens attending to each other."""
    return 8 * n * d * d + 4 * n * n * d


def mlp_flops_per_token(d: int, h: int, activation: str) -> float:
    return (6 if activation == "swiglu" else 4) * d * h


def shared_flops_per_token(cfg: LMConfig) -> float:
    """The shared experts of one MoE layer, per token that reaches the layer (0 without them): their MLP,
    and the gate's projection when there is one."""
    if not cfg.num_shared:
        return 0.0
    hidden = cfg.shared_hidden or cfg.num_shared * (cfg.expert_hidden or cfg.d_hidden)
    return mlp_flops_per_token(cfg.d_model, hidden, cfg.activation) + (2 * cfg.d_model if cfg.shared_gate else 0)


@dataclass
class LayerFlops:
    kind: str
    attention: float
    mlp: float | Tensor  # a float64 0-dim tensor on the device for realized routing not read (forward_flops)
    router: float

    @property
    def total(self) -> float | Tensor:
        return self.attention + self.mlp + self.router


def layer_flops(cfg: LMConfig, kind: str, seq_len: int, assignments: float | Tensor | None = None) -> LayerFlops:
    """Forward FLOPs of one layer on one sequence. ``assignments``: realized expert rows per sequence (a 0-dim
    tensor: ``mlp`` is one too)."""
    k = get_layer_kind(kind, "kind")
    d, s = cfg.d_model, seq_len
    router = 0.0
    n = s  # tokens that go through the block
    if k.mod is not None:
        mod_cfg = cfg.mod_config(k.mod)
        n = mod_cfg.seq_capacity(s)
        router += mod_cfg.router_flops(s)
    if k.experts:
        rcfg = cfg.router_config(k)
        a = rcfg.assignments(n) if assignments is None else assignments
        mlp = a * mlp_flops_per_token(
            d, cfg.expert_hidden or cfg.d_hidden, cfg.activation
        ) + n * shared_flops_per_token(cfg)
        router += rcfg.router_flops(n)
    else:
        mlp = n * mlp_flops_per_token(d, cfg.d_hidden, cfg.activation)
    return LayerFlops(kind, attention_flops(n, d), mlp, router)


def realized_assignments(aux: Aux, layer: int) -> float | None:
    """Expert rows per sequence that layer ``layer`` actually computed in the forward pass behind ``aux``."""
    return realized_assignments_per_layer(aux, layer + 1)[layer]


@overload
def realized_assignments_per_layer(aux: Aux, n_layers: int, read: Literal[True] = True) -> list[float | None]: ...
@overload
def realized_assignments_per_layer(aux: Aux, n_layers: int, read: bool) -> list[float | Tensor | None]: ...
def realized_assignments_per_layer(aux: Aux, n_layers: int, read: bool = True) -> list[Any]:  # as the overloads say
    """``realized_assignments`` of layers ``0 .. n_layers - 1`` (None for a layer without experts), read to
    the host in one transfer; ``read=False``: left on the device as float64 0-dim tensors (no host sync)."""
    found = {i: aux.stats[router_key(i, MOE)] for i in range(n_layers) if router_key(i, MOE) in aux.stats}
    if not found:
        return [None] * n_layers
    kept = torch.stack([st.kept_E.double().sum() / max(1, st.batch_shape[0]) for st in found.values()])
    values = dict(zip(found, kept.tolist() if read else kept.unbind()))  # the one host read (read=True)
    return [values.get(i) for i in range(n_layers)]


def forward_flops(
    cfg: LMConfig, seq_len: int | None = None, aux: Aux | None = None, read: bool = True
) -> list[LayerFlops]:
    """Per-layer forward FLOPs of one sequence (nominal, or realized when ``aux`` is given), plus the head.
    ``read=False``: a realized layer's ``mlp`` and ``total`` are float64 0-dim tensors on the device."""
    s = seq_len or cfg.seq_len
    realized = realized_assignments_per_layer(aux, cfg.n_layers, read) if aux is not None else [None] * cfg.n_layers
    out = [layer_flops(cfg, kind, s, a) for kind, a in zip(cfg.layers, realized)]
    out.append(LayerFlops("head", 0.0, 2 * s * cfg.d_model * cfg.vocab_size, 0.0))
    return out


@overload
def forward_flops_per_token(
    cfg: LMConfig, seq_len: int | None = None, aux: Aux | None = None, read: Literal[True] = True
) -> float: ...
@overload
def forward_flops_per_token(cfg: LMConfig, seq_len: int | None, aux: Aux | None, read: bool) -> float | Tensor: ...
@overload
def forward_flops_per_token(
    cfg: LMConfig, seq_len: int | None = None, aux: Aux | None = None, *, read: bool
) -> float | Tensor: ...
def forward_flops_per_token(
    cfg: LMConfig, seq_len: int | None = None, aux: Aux | None = None, read: bool = True
) -> float | Tensor:
    """``read=False`` with realized routing: a float64 0-dim tensor on the device (no host sync)."""
    s = seq_len or cfg.seq_len
    return sum(f.total for f in forward_flops(cfg, s, aux, read)) / s


@overload
def train_flops_per_token(
    cfg: LMConfig, seq_len: int | None = None, aux: Aux | None = None, read: Literal[True] = True
) -> float: ...
@overload
def train_flops_per_token(cfg: LMConfig, seq_len: int | None, aux: Aux | None, read: bool) -> float | Tensor: ...
@overload
def train_flops_per_token(
    cfg: LMConfig, seq_len: int | None = None, aux: Aux | None = None, *, read: bool
) -> float | Tensor: ...
def train_flops_per_token(
    cfg: LMConfig, seq_len: int | None = None, aux: Aux | None = None, read: bool = True
) -> float | Tensor:
    """Training FLOPs per token (3x forward). With ``aux``, the realized routing: read to the host once, or with
    ``read=False`` kept on the device as a float64 0-dim tensor (the same value; the trainer reads it with
    the step's other scalars). A model without experts gives a float either way."""
    return TRAIN_MULTIPLIER * forward_flops_per_token(cfg, seq_len, aux, read)


def _sdpa_cpu_flops(query_shape, key_shape, value_shape, *args, **kwargs) -> int:
    b, h, sq, k = query_shape
    return 4 * b * h * sq * key_shape[2] * k  # scores + weighted values, full S_q x S_k


def _grouped_mm_flops(a, b, offs=None, *args, **kwargs) -> int:
    """2-D x 3-D with offsets: every row of ``a`` up to the last offset meets one (K, N) matrix; rows past
    it are a routing plan's padding and are not computed. (Reads the last offset: measurement only.)"""
    rows = int(offs[-1]) if offs is not None and offs.numel() else a.shape[0]
    return 2 * rows * a.shape[1] * b.shape[-1]


_grouped_mm_flops._get_raw = True  # FlopCounterMode passes the tensors themselves, not only their shapes


def _grouped_mm_op_flops(x_AK, w_EKN, offsets_E, *args, **kwargs) -> int:
    return _grouped_mm_flops(x_AK, w_EKN, offsets_E)


_grouped_mm_op_flops._get_raw = True


def measured_flops(fn, *args, **kwargs) -> tuple[int, object]:
    """Run ``fn`` under ``torch.utils.flop_counter.FlopCounterMode`` and return (FLOPs, fn's result).

    Adds formulas for the CPU attention kernel and ``torch._grouped_mm``, which the stock counter leaves
    at zero on CPU."""
    custom: dict[Any, Callable[..., int]] = {
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_flops
    }
    if hasattr(torch.ops.aten, "_grouped_mm"):
        custom[torch.ops.aten._grouped_mm] = _grouped_mm_flops
        import mode.experts.grouped_mm  # noqa: F401  (registers the mode::grouped_mm custom op)

        if hasattr(torch.ops.mode, "grouped_mm"):  # the counter cannot see inside a custom op
            custom[torch.ops.mode.grouped_mm] = _grouped_mm_op_flops
    from torch.utils.flop_counter import FlopCounterMode  # here: it imports triton and torch.export (~0.4 s)

    with FlopCounterMode(display=False, custom_mapping=custom) as counter:
        result = fn(*args, **kwargs)
    return counter.get_total_flops(), result

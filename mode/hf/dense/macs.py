"""Analytic multiply-adds per token of a converted or pruned decoder, and a MoD conversion planned to a budget.

Shape legend: D hidden, V vocabulary, I MLP width, S sequence (attention at the mean context ``(S + 1) / 2``).

``macs_per_token`` counts the projections, the attention scores and values, the MLP and the head, plus for a
changed layer its router (D), its skipped tokens' estimate (``2 * D * R + D``) and, with ``kv="all"``, the
skipped tokens' K/V projections. A MoD layer is counted at its capacity's share (what top-C routes in
training; causal routing in eval mode routes about that share once calibrated), a deleted layer at share 0
without a router. It is the count of the SmolLM2 table's "MACs ÷ orig" column (docs/hf.md). Norms, rotary
embeddings and softmax are not counted.

``plan_to_macs`` picks MoD layers and one capacity so that ``conversion_macs`` of the converted model is a
target fraction of the original's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from mode import _checks
from mode.hf._compat import check_model_type, decoder_config, decoder_layers
from mode.hf.dense.mod_layer import PARTS


def macs_per_token(config, seq_len: int, parts: dict[int, dict], n_layers: int | None = None) -> float:
    """Multiply-adds per token of a forward over ``seq_len`` tokens of a decoder shaped as ``config``
    (``n_layers`` layers; None: ``config.num_hidden_layers``). ``parts``: per changed layer ``{"part",
    "share", "kv_all", "rank", "router"}`` (``part`` "layer" at share 0 without a router: deleted)."""
    D, V, inter = config.hidden_size, config.vocab_size, config.intermediate_size
    hd = getattr(config, "head_dim", None) or D // config.num_attention_heads
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    ctx = (seq_len + 1) / 2
    attn_qo, attn_kv, attn_core, mlp = 2 * D * q, 2 * D * kv, 2 * q * ctx, 3 * D * inter
    total = float(D * V)
    for i in range(config.num_hidden_layers if n_layers is None else n_layers):
        p = parts.get(i)
        if p is None:
            total += attn_qo + attn_kv + attn_core + mlp
            continue
        s, rest = p["share"], 1 - p["share"]
        est = 0 if p["rank"] is None else (2 * D * p["rank"] + D) * rest
        router = D if p["router"] else 0
        if p["part"] == "mlp":
            total += attn_qo + attn_kv + attn_core + s * mlp + est + router
        else:
            attn = s * (attn_qo + attn_kv + attn_core) + (rest * attn_kv if p["kv_all"] else 0)
            total += attn + (s * mlp if p["part"] == "layer" else mlp) + est + router
    return total


def _parts(model: nn.Module) -> tuple[dict[int, dict], int]:
    """The changed layers of ``model``'s conversion in original indices, and the original depth."""
    spec = getattr(model, "mode_conversion", None) or {}
    if spec.get("upcycle"):
        raise ValueError("conversion_macs: upcycled MLPs (MoE) are not counted here; see mode.hf.moe_report")
    pruned = spec.get("pruned")
    kept = pruned["kept"] if pruned else list(range(len(decoder_layers(model))))
    n_layers = pruned["n_layers"] if pruned else len(kept)
    parts: dict[int, dict] = {}
    if pruned:
        rank = pruned["estimate_rank"]
        for i in pruned["layers"]:
            parts[i] = {"part": "layer", "share": 0.0, "kv_all": False, "rank": rank, "router": False}
    for j, s in spec.get("mod", {}).items():
        parts[kept[int(j)]] = {
            "part": s["part"],
            "share": s["capacity"],
            "kv_all": s["kv"] == "all",
            "rank": s["skip_rank"],
            "router": True,
        }
    return parts, n_layers


def conversion_macs(model: nn.Module, seq_len: int) -> float:
    """Multiply-adds per token of ``model`` (MoD layers at their capacity's share, deleted layers with their
    estimates) divided by the original model's, at ``seq_len`` tokens (``macs_per_token``)."""
    check_model_type(model)
    _checks.check_int("seq_len", seq_len)
    parts, n_layers = _parts(model)
    config = decoder_config(model)
    return macs_per_token(config, seq_len, parts, n_layers) / macs_per_token(config, seq_len, {}, n_layers)


@dataclass(frozen=True)
class MacsPlan:
    """A MoD conversion meeting a MAC budget: ``to_mod(model, layers=plan.layers, capacity=plan.capacity,
    part=plan.part, kv=plan.kv, skip_rank=plan.skip_rank)``; ``macs`` is what it reaches (÷ the original)."""

    layers: list[int]
    capacity: float
    part: str
    kv: str
    skip_rank: int | None
    macs: float
    target: float


def _order(order: str | Sequence[int], n_layers: int) -> list[int]:
    if isinstance(order, str):
        _checks.check_choice("order", order, ("every_other",))
        return list(range(1, n_layers, 2)) + list(range(2, n_layers, 2)) + [0]
    out = list(order)
    if not out or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n_layers for i in out):
        raise ValueError(
            f"order={order!r}: must be 'every_other' or a non-empty list of layer indices in [0, {n_layers})"
        )
    if len(set(out)) != len(out):
        raise ValueError(f"order={order!r}: a layer appears twice")
    return out


def plan_to_macs(
    model: nn.Module,
    macs: float,
    seq_len: int,
    part: str = "layer",
    kv: str | None = None,
    skip_rank: int | None = None,
    order: str | Sequence[int] = "every_other",
    min_capacity: float = 0.125,
) -> MacsPlan:
    """The fewest layers, taken in ``order`` (``"every_other"``: 1, 3, 5, ..., then 2, 4, ..., then 0; or a
    list, e.g. ``sorted(costs, key=costs.get)`` from ``skip_costs``), at which one capacity of at least
    ``min_capacity`` brings ``model``'s MACs per token to ``macs`` times the original's (``macs_per_token`` at
    ``seq_len``), and that capacity, rounded to whole tokens of ``seq_len`` (``C / seq_len``, what top-C
    routes). Returns a ``MacsPlan`` with the MACs reached; the model is not changed (pass the plan to
    ``to_mod``). ``kv`` None: "all", or "routed" for part "mlp", as ``to_mod`` defaults."""
    check_model_type(model)
    if isinstance(macs, bool) or not isinstance(macs, (int, float)) or not 0 < macs < 1:
        raise ValueError(f"macs={macs!r}: must be a fraction of the original's MACs in (0, 1)")
    _checks.check_int("seq_len", seq_len)
    _checks.check_choice("part", part, PARTS)
    _checks.check_fraction("min_capacity", min_capacity)
    kv = ("routed" if part == "mlp" else "all") if kv is None else kv
    _checks.check_choice("kv", kv, ("all", "routed"))
    if getattr(model, "mode_conversion", None):
        raise ValueError("plan_to_macs: the model already carries a conversion; plan on the original")
    config = decoder_config(model)
    n_layers = len(decoder_layers(model))
    base = macs_per_token(config, seq_len, {}, n_layers)
    chosen: list[int] = []
    reachable = 1.0
    for i in _order(order, n_layers):
        chosen.append(i)

        def ratio(share: float, layers=tuple(chosen)) -> float:
            p = {"part": part, "share": share, "kv_all": kv == "all", "rank": skip_rank, "router": True}
            return macs_per_token(config, seq_len, dict.fromkeys(layers, p), n_layers) / base

        lo, hi = ratio(0.0), ratio(1.0)
        reachable = ratio(min_capacity)
        share = (macs - lo) / (hi - lo)  # MACs are linear in the share
        if share >= min_capacity:
            tokens = min(max(round(share * seq_len), 1), seq_len)
            capacity = tokens / seq_len
            return MacsPlan(sorted(chosen), capacity, part, kv, skip_rank, ratio(capacity), float(macs))
    raise ValueError(
        f"macs={macs}: below what part={part!r} reaches on every layer of order at min_capacity={min_capacity} "
        f"({reachable:.4f} of the original); lower min_capacity or convert more of each layer"
    )

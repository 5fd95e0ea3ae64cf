"""Analytic multiply-adds per token of a converted or pruned decoder, and a MoD conversion planned to a budget.

Shape legend: D hidden, V vocabulary, I MLP width, S sequence (attention at the mean context ``(S + 1) / 2``).

``macs_per_token`` counts the projections, the attention scores and values, the MLP and the head, plus for a
changed layer its router (D), its skipped tokens' estimate (``2 * D * R + D``) and, with ``kv="all"``, the
skipped tokens' K/V projections. A MoD layer is counted at its capacity's share (what top-C routes in
training; causal routing in eval mode routes about that share once calibrated), a deleted layer at share 0
without a router. It is the count of the SmolLM2 table's "MACs ÷ orig" column (docs/hf.md). Norms, rotary
embeddings and softmax are not counted.

``plan_to_macs`` picks MoD layers and one capacity so that ``conversion_macs`` of the converted model is a
target fraction of the original's: of one part, or ``part="mixed"``, attention halves in some layers and MLP
halves in others, taken in the order ``mixed_order`` gives (cheapest loss per multiply-add saved first).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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


MIXED = "mixed"
PLAN_PARTS = (*PARTS, MIXED)
HALVES = ("attention", "mlp")  # the units of a mixed plan; both halves of one layer make it part "layer"


@dataclass(frozen=True)
class MacsPlan:
    """A MoD conversion meeting a MAC budget; ``macs`` is what it reaches (÷ the original). ``parts``: the part
    each of ``layers`` skips (``part`` for every layer, or a mix when ``part`` is ``"mixed"``); ``kv`` is that
    of the attention and whole-layer parts (an MLP part runs the attention for every token: ``"routed"``).
    Convert with ``for kwargs in plan.groups(): to_mod(model, **kwargs, causal=...)``."""

    layers: list[int]
    capacity: float
    part: str
    kv: str
    skip_rank: int | None
    macs: float
    target: float
    parts: dict[int, str]

    def groups(self) -> list[dict]:
        """``to_mod`` keyword arguments (layers, capacity, part, kv, skip_rank), one dict per part planned."""
        out = []
        for part in PARTS:
            layers = sorted(i for i, p in self.parts.items() if p == part)
            if layers:
                kv = "routed" if part == "mlp" else self.kv
                out.append(
                    {"layers": layers, "capacity": self.capacity, "part": part, "kv": kv, "skip_rank": self.skip_rank}
                )
        return out


def _mod_part(part: str, share: float, kv: str, skip_rank: int | None) -> dict:
    """``macs_per_token``'s entry for a MoD layer skipping ``part`` (an MLP part keeps no skipped K/V)."""
    return {"part": part, "share": share, "kv_all": kv == "all" and part != "mlp", "rank": skip_rank, "router": True}


def _unit_macs(config, seq_len: int, layer: int, part: str, kv: str, skip_rank: int | None, n_layers: int) -> float:
    """The multiply-adds per token that skipping ``part`` of ``layer`` for every token saves (with its router
    and estimate), ÷ the original's."""
    base = macs_per_token(config, seq_len, {}, n_layers)
    return 1 - macs_per_token(config, seq_len, {layer: _mod_part(part, 0.0, kv, skip_rank)}, n_layers) / base


def mixed_order(
    model: nn.Module,
    costs: Mapping[str, Mapping[int, float]],
    seq_len: int,
    kv: str = "all",
    skip_rank: int | None = None,
) -> list[tuple[int, str]]:
    """The (layer, half) units of ``costs`` (``{"attention": skip_costs(..., "attention"), "mlp":
    skip_costs(..., "mlp")}``; either may be left out) cheapest first by loss per multiply-add saved: a
    unit's skip cost ÷ the share of the original's MACs skipping it for every token saves (``kv``: the
    attention halves', ``skip_rank``: the estimate's, both as the conversion will use them). The ``order`` of
    ``plan_to_macs(part="mixed")``; ties go to the lower layer, then attention."""
    check_model_type(model)
    _checks.check_int("seq_len", seq_len)
    _checks.check_choice("kv", kv, ("all", "routed"))
    unknown = sorted(set(costs) - set(HALVES))
    if unknown or not costs:
        raise ValueError(f"costs: keys {sorted(costs)}; must be 'attention' and / or 'mlp' (skip_costs per half)")
    config, n_layers = decoder_config(model), len(decoder_layers(model))
    ranked = []
    for part, per_layer in costs.items():
        for i, cost in per_layer.items():
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n_layers:
                raise ValueError(f"costs[{part!r}]: layer {i!r} is not a layer index in [0, {n_layers})")
            saved = _unit_macs(config, seq_len, i, part, kv, skip_rank, n_layers)
            ranked.append((float(cost) / saved, i, HALVES.index(part), part))
    return [(i, part) for _, i, _, part in sorted(ranked)]


def _order(order: str | Sequence, n_layers: int, mixed: bool) -> list[tuple[int, str | None]]:
    """``order`` as (layer, half) units: half None for a one-part plan."""
    rule = "a non-empty list of (layer, 'attention' | 'mlp') pairs" if mixed else "a non-empty list of layer indices"
    if isinstance(order, str):
        if mixed:
            raise ValueError(f"order={order!r}: part='mixed' needs {rule} (mixed_order gives one from skip_costs)")
        _checks.check_choice("order", order, ("every_other",))
        return [(i, None) for i in [*range(1, n_layers, 2), *range(2, n_layers, 2), 0]]

    def layer(i) -> bool:
        return isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n_layers

    def unit(u) -> bool:
        if not mixed:
            return layer(u)
        return isinstance(u, (tuple, list)) and len(u) == 2 and layer(u[0]) and u[1] in HALVES

    given = list(order)
    if not given or not all(map(unit, given)):
        either = "" if mixed else "'every_other' or "
        raise ValueError(f"order={order!r}: must be {either}{rule} in [0, {n_layers})")
    units: list[tuple[int, str | None]] = [(int(u[0]), str(u[1])) if mixed else (int(u), None) for u in given]
    if len(set(units)) != len(units):
        raise ValueError(f"order={order!r}: a {'unit' if mixed else 'layer'} appears twice")
    return units


def plan_to_macs(
    model: nn.Module,
    macs: float,
    seq_len: int,
    part: str = "layer",
    kv: str | None = None,
    skip_rank: int | None = None,
    order: str | Sequence = "every_other",
    min_capacity: float = 0.125,
) -> MacsPlan:
    """The fewest layers, taken in ``order`` (``"every_other"``: 1, 3, 5, ..., then 2, 4, ..., then 0; or a
    list, e.g. ``sorted(costs, key=costs.get)`` from ``skip_costs``), at which one capacity of at least
    ``min_capacity`` brings ``model``'s MACs per token to ``macs`` times the original's (``macs_per_token`` at
    ``seq_len``), and that capacity, rounded to whole tokens of ``seq_len`` (``C / seq_len``, what top-C
    routes). Returns a ``MacsPlan`` with the MACs reached; the model is not changed (convert with
    ``plan.groups()``). ``kv`` None: "all", or "routed" for part "mlp", as ``to_mod`` defaults.

    ``part="mixed"``: ``order`` is a list of (layer, "attention" | "mlp") units (``mixed_order``), taken
    fewest first the same way; a layer whose two halves are both taken skips as a whole layer (one router).
    ``kv`` then applies to the attention and whole-layer parts."""
    check_model_type(model)
    if isinstance(macs, bool) or not isinstance(macs, (int, float)) or not 0 < macs < 1:
        raise ValueError(f"macs={macs!r}: must be a fraction of the original's MACs in (0, 1)")
    _checks.check_int("seq_len", seq_len)
    _checks.check_choice("part", part, PLAN_PARTS)
    _checks.check_fraction("min_capacity", min_capacity)
    kv = ("routed" if part == "mlp" else "all") if kv is None else kv
    _checks.check_choice("kv", kv, ("all", "routed"))
    if kv == "all" and part == "mlp":
        raise ValueError("kv='all' with part='mlp': the attention runs for every token; kv applies to attention")
    if getattr(model, "mode_conversion", None):
        raise ValueError("plan_to_macs: the model already carries a conversion; plan on the original")
    config = decoder_config(model)
    n_layers = len(decoder_layers(model))
    base = macs_per_token(config, seq_len, {}, n_layers)
    chosen: dict[int, str] = {}  # layer -> the part it skips
    reachable = 1.0

    def ratio(share: float) -> float:
        spec = {i: _mod_part(p, share, kv, skip_rank) for i, p in chosen.items()}
        return macs_per_token(config, seq_len, spec, n_layers) / base

    for i, half in _order(order, n_layers, mixed=part == MIXED):
        chosen[i] = part if half is None else ("layer" if chosen.get(i, half) != half else half)
        lo, hi = ratio(0.0), ratio(1.0)
        reachable = ratio(min_capacity)
        share = (macs - lo) / (hi - lo)  # MACs are linear in the share
        if share >= min_capacity:
            tokens = min(max(round(share * seq_len), 1), seq_len)
            capacity = tokens / seq_len
            parts = dict(sorted(chosen.items()))
            return MacsPlan(sorted(chosen), capacity, part, kv, skip_rank, ratio(capacity), float(macs), parts)
    raise ValueError(
        f"macs={macs}: below what part={part!r} reaches on every layer of order at min_capacity={min_capacity} "
        f"({reachable:.4f} of the original); lower min_capacity or convert more of each layer"
    )

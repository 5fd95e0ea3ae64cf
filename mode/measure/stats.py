"""Load balance and per-token compute, accumulated over router calls, layers, steps and ranks.

Shape legend: E real experts, X expert slots (real first, then no-op), S sequence positions, L layers.

``RoutingAccumulator`` keeps only raw **sums** (counts, token-weighted entropies, per-position counts,
histograms), never averages, so adding calls, merging accumulators and all-reducing them over ranks
are all plain additions, and every summary is computed from the totals at the end. Sums are float64
tensors kept on the device the stats live on (adding them causes no host sync).

What gets summed, per router (the key is the stats name, e.g. ``layers.3.moe.router``):
    calls, kept_E, requested_X, dropped, noop, tokens,
    entropy * tokens and tokens (for a token-weighted mean entropy), the same for causal accuracy,
    per original position: tokens, tokens with >= 1 computed assignment, assignments
and per LM forward (``add_lm``, see ``mode.measure.token_compute``) the per-token compute: token count, sums of
blocks, MLP assignments and FLOPs, histograms of blocks and assignments, the same by position, and per
layer the tokens that took the layer's routed path, by position.

The exact definitions of every summary number are in docs/reports.md. Summaries are plain dicts of
Python floats (JSON-ready). Summing over ranks is ``mode.parallel.stats_reduce.all_reduce_accumulator``;
this module never imports ``torch.distributed``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from mode.measure.token_compute import TokenCompute, max_mlp_per_layer, slots_to_positions, token_compute
from mode.model.config import LMConfig
from mode.routing.keys import MOD, MOE, parse_router_key, router_key
from mode.routing.plan import Aux, RoutingStats

TOKENS = "tokens"  # scope of the LM-level per-token compute sums


# ------------------------------------------------------------------------------------ summary functions


def expert_fractions(kept_E: Tensor) -> list[float]:
    """Share of the computed assignments each real expert received (sums to 1; zeros when none)."""
    total = float(kept_E.sum())
    return [float(k) / total if total > 0 else 0.0 for k in kept_E]


def max_over_mean(kept_E: Tensor) -> float:
    """Load of the busiest expert over the mean load (1 = perfectly balanced, E = all on one expert)."""
    mean = float(kept_E.double().mean())
    return float(kept_E.max()) / mean if mean > 0 else float("nan")


def coefficient_of_variation(kept_E: Tensor) -> float:
    """Population standard deviation of the per-expert loads over their mean (0 = balanced)."""
    k = kept_E.double()
    mean = float(k.mean())
    return float(k.std(unbiased=False)) / mean if mean > 0 else float("nan")


def dropped_fraction(dropped: float, requested_real: float) -> float:
    """Assignments removed by capacity limits over the assignments requested of real experts."""
    return dropped / requested_real if requested_real > 0 else 0.0


def noop_share(noop: float, requested_all: float) -> float:
    """Assignments that chose a no-op slot over all requested assignments (MoD: the skip rate)."""
    return noop / requested_all if requested_all > 0 else 0.0


def rate_by_position(selected_S: Tensor, tokens_S: Tensor, buckets: int | None = None) -> list[float]:
    """``selected / tokens`` per position, or per bucket of consecutive positions (``buckets`` equal
    ranges of ``[0, S)``; sums within a bucket are divided, not rates averaged). NaN where no tokens."""
    sel, tok = selected_S.double().cpu(), tokens_S.double().cpu()
    if buckets is not None:
        S = sel.numel()
        b = min(buckets, S)
        bucket_S = torch.arange(S, device="cpu") * b // S  # on the host with sel and tok, whatever the default
        sel = torch.zeros(b, dtype=torch.float64, device="cpu").index_add_(0, bucket_S, sel)
        tok = torch.zeros(b, dtype=torch.float64, device="cpu").index_add_(0, bucket_S, tok)
    return [float(s) / float(t) if t > 0 else float("nan") for s, t in zip(sel, tok)]


def _r(x: float | None) -> float | None:
    """Round to 6 significant digits (keeps logs small); None and NaN pass through as None."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return None
    return float(f"{x:.6g}")


# ------------------------------------------------------------------------------------------ accumulator


class RoutingAccumulator:
    """Sums routing statistics over router calls, layers, training steps and (``all_reduce``) ranks.

    ``add(aux)`` takes any layer's or model's ``Aux`` (or a ``{name: RoutingStats}`` dict);
    ``add_lm(cfg, aux, batch_shape)`` also adds the per-token compute of an LM forward pass.
    """

    def __init__(self) -> None:
        self.sums: dict[str, Tensor] = {}  # "scope|field" -> 1-D float64 tensor
        self.layer_kinds: tuple[str, ...] | None = None  # set by add_lm

    # -- adding ------------------------------------------------------------------------------------------
    def _acc(self, key: str, value: Tensor | float) -> None:
        cur = self.sums.get(key)
        if not isinstance(value, Tensor) and cur is not None and cur.numel() == 1:
            # a Python number onto a one-element sum: the number goes to the kernel as an argument (float64,
            # the same bits as adding it as a tensor); as_tensor would copy it to a GPU, a blocking copy per call
            self.sums[key] = cur + float(value)
            return
        # named whatever the default device (as_tensor with device=None takes it: a CPU tensor or a first Python
        # number went to a CUDA default device, a copy each): the sum's, else the tensor's own, else the host
        device = cur.device if cur is not None else value.device if isinstance(value, Tensor) else "cpu"
        v = torch.as_tensor(value, dtype=torch.float64, device=device)
        v = v.detach().to(torch.float64).reshape(-1)
        if cur is None:
            self.sums[key] = v.clone()
            return
        if cur.device != v.device:  # e.g. sums loaded from a checkpoint (CPU), stats on the GPU
            cur = cur.to(v.device)
        if cur.numel() != v.numel():  # per-position sums and histograms grow to the longest seen
            n = max(cur.numel(), v.numel())
            cur, v = F.pad(cur, (0, n - cur.numel())), F.pad(v, (0, n - v.numel()))
        self.sums[key] = cur + v

    def add(self, aux: Aux | dict[str, RoutingStats], mask_BS: Tensor | None = None) -> None:
        """Add every router call in ``aux``. ``mask_BS`` (False = padding) is the routed input's mask, used
        for the per-position token counts. A ``*moe.router`` behind a ``*mod.router`` of the same prefix
        (staged MoDE) is mapped from its routed slots back to the original positions."""
        stats = aux.stats if isinstance(aux, Aux) else aux
        for name, st in stats.items():
            key = parse_router_key(name)
            outer = stats.get(key.sibling(MOD)) if key is not None and key.part == MOE else None
            self._add_router(name, st, outer, mask_BS)

    def _add_router(self, name: str, st: RoutingStats, outer: RoutingStats | None, mask_BS: Tensor | None) -> None:
        k = name + "|"
        self._acc(k + "calls", 1.0)
        if st.entropy is None:
            self._acc(k + "mod_calls", 1.0)  # MoD routers (one expert: the block) carry no entropy
        self._acc(k + "kept_E", st.kept_E)
        self._acc(k + "requested_X", st.requested_X)
        self._acc(k + "dropped", st.dropped)
        self._acc(k + "noop", st.noop)
        self._acc(k + "tokens", st.tokens)
        if st.entropy is not None:
            self._acc(k + "entropy_wsum", st.entropy * st.tokens)
            self._acc(k + "entropy_w", st.tokens)
        if st.causal_accuracy is not None:
            self._acc(k + "causal_wsum", st.causal_accuracy * st.tokens)
            self._acc(k + "causal_w", st.tokens)
        compute_BS = st.compute_T.view(st.batch_shape).double()
        if outer is not None:  # staged MoDE: slots -> positions of the MoD router's input
            compute_BS = slots_to_positions(compute_BS, outer.compute_T.view(outer.batch_shape) > 0)
        count_BS = torch.ones_like(compute_BS)
        if mask_BS is not None and tuple(mask_BS.shape) == tuple(compute_BS.shape):
            count_BS = mask_BS.to(compute_BS)
            compute_BS = compute_BS * count_BS  # a padding position's compute is not a token's
        self._acc(k + "pos_tokens_S", count_BS.sum(0))
        self._acc(k + "pos_selected_S", (compute_BS > 0).double().sum(0))
        self._acc(k + "pos_compute_S", compute_BS.sum(0))

    def add_tokens(self, tc: TokenCompute, mlp_bound: int | None = None) -> None:
        """Add the per-token compute of one LM forward pass (all tokens count; no padding)."""
        L = len(tc.kinds)
        if self.layer_kinds is None:
            self.layer_kinds = tc.kinds
        elif self.layer_kinds != tc.kinds:
            raise ValueError(f"layer kinds {tc.kinds}: must match those already accumulated {self.layer_kinds}")
        blocks_BS, mlp_BS, flops_BS = tc.blocks_BS.double(), tc.mlp_BS.double(), tc.flops_BS.double()
        n = float(blocks_BS.numel())
        dev = blocks_BS.device
        k = TOKENS + "|"
        self._acc(k + "count", n)
        self._acc(k + "blocks_sum", blocks_BS.sum())
        self._acc(k + "mlp_sum", mlp_BS.sum())
        self._acc(k + "flops_sum", flops_BS.sum())
        self._acc(k + "flops_sqsum", flops_BS.square().sum())
        self._acc(k + "dense_flops_sum", n * tc.dense_flops_per_token)
        # histograms with static bounds: scatter_add, no host sync
        self._acc(k + "blocks_hist", _hist(blocks_BS, L + 1, dev))
        self._acc(k + "mlp_hist", _hist(mlp_BS, (mlp_bound if mlp_bound is not None else L) + 1, dev))
        self._acc(k + "pos_count_S", torch.full((blocks_BS.shape[1],), float(blocks_BS.shape[0]), device=dev))
        self._acc(k + "pos_blocks_S", blocks_BS.sum(0))
        self._acc(k + "pos_mlp_S", mlp_BS.sum(0))
        self._acc(k + "pos_flops_S", flops_BS.sum(0))
        routed_LBS = tc.routed_LBS.double()
        for i in range(L):
            self._acc(f"layer.{i}|pos_routed_S", routed_LBS[i].sum(0))
            self._acc(f"layer.{i}|attn_sum", tc.attn_LBS[i].double().sum())
            self._acc(f"layer.{i}|mlp_sum", tc.mlp_LBS[i].double().sum())

    def add_lm(self, cfg: LMConfig, aux: Aux, batch_shape: Sequence[int]) -> TokenCompute:
        """Add an LM forward pass: its router stats and its per-token compute (returned). ``batch_shape``: (B, S)."""
        self.add(aux)
        B, S = batch_shape
        tc = token_compute(cfg, aux, (B, S))
        self.add_tokens(tc, mlp_bound=sum(max_mlp_per_layer(cfg, kind) for kind in cfg.layers))
        return tc

    # -- combining ---------------------------------------------------------------------------------------
    def merge(self, other: RoutingAccumulator) -> RoutingAccumulator:
        """Add ``other``'s sums into this one (in place); returns self."""
        if other.layer_kinds is not None:
            if self.layer_kinds is not None and self.layer_kinds != other.layer_kinds:
                raise ValueError(f"layer kinds {other.layer_kinds}: must match {self.layer_kinds}")
            self.layer_kinds = other.layer_kinds
        for key, v in other.sums.items():
            self._acc(key, v)
        return self

    def reset(self) -> None:
        self.sums.clear()
        self.layer_kinds = None

    def __bool__(self) -> bool:
        return bool(self.sums)

    def state_dict(self) -> dict:
        return {"sums": {k: v.cpu() for k, v in self.sums.items()}, "layer_kinds": self.layer_kinds}

    def load_state_dict(self, state: dict) -> None:
        self.sums = {k: v.clone() for k, v in state.get("sums", {}).items()}
        kinds = state.get("layer_kinds")
        self.layer_kinds = None if kinds is None else tuple(kinds)

    # -- reading -----------------------------------------------------------------------------------------
    def _get(self, key: str) -> Tensor | None:
        return self.sums.get(key)

    def _scalar(self, key: str, default: float = 0.0) -> float:
        v = self.sums.get(key)
        return default if v is None else float(v.sum())

    def router_names(self) -> list[str]:
        names = {k.split("|", 1)[0] for k in self.sums if k.endswith("|calls")}
        return sorted(names, key=_natural_key)

    def is_mod(self, name: str) -> bool:
        return self._scalar(name + "|mod_calls") > 0

    def router_summary(self, name: str, buckets: int | None = None, positions: bool = True) -> dict:
        """Every number about one router (definitions: docs/reports.md)."""
        k = name + "|"
        if k + "calls" not in self.sums:
            raise KeyError(f"no router {name!r} accumulated; have {self.router_names()}")
        kept_E = self.sums[k + "kept_E"].cpu()
        requested_X = self.sums[k + "requested_X"].cpu()
        E = kept_E.numel()
        ent_w, causal_w = self._scalar(k + "entropy_w"), self._scalar(k + "causal_w")
        pos_tok, pos_sel, pos_cmp = (
            self.sums[k + f].cpu() for f in ("pos_tokens_S", "pos_selected_S", "pos_compute_S")
        )
        n_pos = float(pos_tok.sum())
        out = {
            "mod": self.is_mod(name),
            "calls": int(self._scalar(k + "calls")),
            "tokens": self._scalar(k + "tokens"),
            "kept": [float(v) for v in kept_E],
            "requested": [float(v) for v in requested_X],
            "num_experts": E,
            "num_noop": requested_X.numel() - E,
            "expert_frac": expert_fractions(kept_E),
            "max_mean": max_over_mean(kept_E),
            "cv": coefficient_of_variation(kept_E),
            "dropped": self._scalar(k + "dropped"),
            "dropped_frac": dropped_fraction(self._scalar(k + "dropped"), float(requested_X[:E].sum())),
            "noop": self._scalar(k + "noop"),
            "noop_share": noop_share(self._scalar(k + "noop"), float(requested_X.sum())),
            "entropy": self._scalar(k + "entropy_wsum") / ent_w if ent_w > 0 else None,
            "max_entropy": math.log(requested_X.numel()) if ent_w > 0 else None,
            "causal_accuracy": self._scalar(k + "causal_wsum") / causal_w if causal_w > 0 else None,
            "selected_frac": float(pos_sel.sum()) / n_pos if n_pos > 0 else float("nan"),
            "assignments_per_token": float(pos_cmp.sum()) / n_pos if n_pos > 0 else float("nan"),
        }
        if positions:
            out["selected_by_position"] = rate_by_position(pos_sel, pos_tok, buckets)
        return out

    # -- LM-level summaries ------------------------------------------------------------------------------
    def _layer_ids(self) -> list[int]:
        keys = (parse_router_key(name) for name in self.router_names())
        return sorted({k.layer for k in keys if k is not None and k.layer is not None})

    def layer_summary(self, i: int, buckets: int | None = None, positions: bool = False) -> dict:
        """One layer of an LM: its MoD router (``routed_frac``) and its MoE router (expert numbers)."""
        mod_name, moe_name = router_key(i, MOD), router_key(i, MOE)
        kind = self.layer_kinds[i] if self.layer_kinds is not None and i < len(self.layer_kinds) else None
        out: dict = {"kind": kind}
        routed = self._get(f"layer.{i}|pos_routed_S")
        n_tok = self._scalar(TOKENS + "|count")
        if routed is not None and n_tok > 0:
            out["routed_frac"] = float(routed.sum()) / n_tok
            out["mlp_per_token"] = self._scalar(f"layer.{i}|mlp_sum") / n_tok
        elif mod_name in self.router_names():
            out["routed_frac"] = self.router_summary(mod_name, positions=False)["selected_frac"]
        if mod_name in self.router_names():
            mod = self.router_summary(mod_name, positions=False)
            out["causal_accuracy"] = mod["causal_accuracy"]
        if moe_name in self.router_names():
            moe = self.router_summary(moe_name, positions=False)
            for f in ("expert_frac", "max_mean", "cv", "dropped_frac", "noop_share", "entropy"):
                out[f] = moe[f]
        if positions and routed is not None:
            out["routed_by_position"] = rate_by_position(routed, self.sums[TOKENS + "|pos_count_S"], buckets)
        return out

    def token_summary(self, buckets: int | None = None, positions: bool = False) -> dict:
        """Per-token compute over everything added with ``add_lm``/``add_tokens``."""
        k = TOKENS + "|"
        n = self._scalar(k + "count")
        if n == 0:
            return {}
        mean_flops = self._scalar(k + "flops_sum") / n
        var = max(0.0, self._scalar(k + "flops_sqsum") / n - mean_flops**2)
        out = {
            "tokens": n,
            "blocks_per_token": self._scalar(k + "blocks_sum") / n,
            "mlp_per_token": self._scalar(k + "mlp_sum") / n,
            "flops_per_token": mean_flops,
            "flops_std": math.sqrt(var),
            "flops_vs_dense": self._scalar(k + "flops_sum") / self._scalar(k + "dense_flops_sum"),
            "blocks_hist": [float(v) / n for v in self.sums[k + "blocks_hist"].cpu()],
            "mlp_hist": [float(v) / n for v in self.sums[k + "mlp_hist"].cpu()],
        }
        if positions:
            cnt = self.sums[k + "pos_count_S"]
            for f in ("blocks", "mlp", "flops"):
                out[f"{f}_by_position"] = rate_by_position(self.sums[k + f"pos_{f}_S"], cnt, buckets)
        return out

    def summary(self) -> dict:
        """Small per-layer and overall record (what training logs): ``{"layers": {i: ...}, "overall": ...}``."""
        layers = {
            str(i): {f: _round(v) for f, v in self.layer_summary(i).items() if v is not None} for i in self._layer_ids()
        }
        moe = [self.router_summary(n, positions=False) for n in self.router_names() if not self.is_mod(n)]
        mod = [self.router_summary(n, positions=False) for n in self.router_names() if self.is_mod(n)]
        overall: dict = {}
        if moe:
            requested_real = sum(sum(r["requested"][: r["num_experts"]]) for r in moe)
            requested_all = sum(sum(r["requested"]) for r in moe)
            ent = [(r["entropy"], r["tokens"]) for r in moe if r["entropy"] is not None]
            ent_w = sum(w for _, w in ent)
            mm = [r["max_mean"] for r in moe if not math.isnan(r["max_mean"])]
            cv = [r["cv"] for r in moe if not math.isnan(r["cv"])]
            overall.update(
                max_mean=sum(mm) / len(mm) if mm else None,
                max_mean_worst=max(mm) if mm else None,
                cv=sum(cv) / len(cv) if cv else None,
                dropped_frac=dropped_fraction(sum(r["dropped"] for r in moe), requested_real),
                noop_share=noop_share(sum(r["noop"] for r in moe), requested_all),
                entropy=sum(e * w for e, w in ent) / ent_w if ent_w > 0 else None,
            )
        if mod:
            overall["routed_frac"] = sum(r["selected_frac"] * r["tokens"] for r in mod) / max(
                1.0, sum(r["tokens"] for r in mod)
            )
            causal = [(r["causal_accuracy"], r["tokens"]) for r in mod if r["causal_accuracy"] is not None]
            if causal:
                overall["causal_accuracy"] = sum(a * w for a, w in causal) / sum(w for _, w in causal)
        tok = self.token_summary()
        for f in ("blocks_per_token", "mlp_per_token", "flops_per_token", "flops_vs_dense"):
            if f in tok:
                overall[f] = tok[f]
        return {"layers": layers, "overall": {f: _round(v) for f, v in overall.items() if v is not None}}


def _round(v):
    if isinstance(v, list):
        return [_r(x) for x in v]
    if isinstance(v, float):
        return _r(v)
    return v


def _hist(values: Tensor, bins: int, device) -> Tensor:
    idx = values.round().long().clamp(0, bins - 1)
    return torch.zeros(bins, dtype=torch.float64, device=device).scatter_add_(
        0, idx.reshape(-1), torch.ones(idx.numel(), dtype=torch.float64, device=device)
    )


def _natural_key(name: str):
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.replace("|", ".").split(".")]

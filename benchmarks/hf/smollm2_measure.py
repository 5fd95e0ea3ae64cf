"""What hf_mod_smollm2.py measures with, apart from its main loop: the English windows, per-window losses, MACs per
token and KV-cache bytes, decode speed, a layer part deleted (with its fitted estimate), oracle routing, the
paired bootstrap intervals, and the Markdown table."""

from __future__ import annotations

import contextlib
import copy
import statistics
import time

import torch
import torch.nn.functional as F

import mode.hf as mh
from mode.hf.dense.skip_cost import skipped
from mode.hf.dense.skip_update import SkipUpdate
from mode.hf.dense.windows import (
    batches_of,
    english_windows,  # noqa: F401  (re-exported: the benchmarks' data)
)


# -- data -----------------------------------------------------------------------------------------------------
@torch.no_grad()
def window_losses(model, windows_WS: torch.Tensor, batch: int = 8, shares: dict | None = None) -> torch.Tensor:
    """Mean next-token loss of each window ``(W,)``; ``shares``, if given, gets each MoD layer's routed share."""
    model.eval()
    out, seen = [], {}
    for x_BS in batches_of(windows_WS, batch):
        logits = model(x_BS, use_cache=False).logits
        out.append(F.cross_entropy(logits[:, :-1].transpose(1, 2), x_BS[:, 1:], reduction="none").mean(1))
        if shares is not None:
            for key, stats in mh.collect_aux(model).stats.items():
                if key.endswith(".mod.router"):
                    seen.setdefault(int(key.split(".")[1]), []).append(float(stats.compute_T.float().mean()))
    if shares is not None:
        shares.update({i: statistics.mean(v) for i, v in seen.items()})
    return torch.cat(out)


# -- compute and K/V ------------------------------------------------------------------------------------------
def kv_bytes(cache, n_layers: int) -> int:
    """K/V bytes every layer's cache holds after ``generate()`` (a MoD cache counts its stored rows only)."""
    total = 0
    for i in range(n_layers):
        layer = cache.layers[i]
        per = (
            layer.keys.shape[1] * layer.keys.shape[3] + layer.values.shape[1] * layer.values.shape[3]
        ) * layer.keys.element_size()
        total += per * (
            int(layer.len_B.sum()) if isinstance(layer, mh.MoDCacheLayer) else layer.keys.shape[0] * layer.keys.shape[2]
        )
    return total


# -- speed ----------------------------------------------------------------------------------------------------
def _generate(model, prompt_BS: torch.Tensor, new: int):
    with torch.no_grad():
        return model.generate(
            prompt_BS,
            attention_mask=torch.ones_like(prompt_BS),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
            return_dict_in_generate=True,
        )


def paired_times(model, original, prompt_BS: torch.Tensor, new: int, repeats: int) -> dict[str, dict[str, list]]:
    """Seconds of prefill (one forward over the prompt) and decode (generate of ``new`` tokens − prefill) of
    ``original`` then ``model``, alternated ``repeats`` times after a warm-up: ``{"original" | "model":
    {"prefill" | "decode": [seconds per repeat]}}``; repeat i of one is timed beside repeat i of the other."""
    times: dict[str, dict[str, list]] = {k: {"prefill": [], "decode": []} for k in ("model", "original")}
    for m in (model, original):
        _generate(m, prompt_BS, 2)  # warm-up
    for _ in range(repeats):
        for name, m in (("original", original), ("model", model)):
            start = time.perf_counter()
            with torch.no_grad():
                m(prompt_BS, use_cache=True)
            prefill = time.perf_counter() - start
            start = time.perf_counter()
            _generate(m, prompt_BS, new)
            times[name]["prefill"].append(prefill)
            times[name]["decode"].append(max(time.perf_counter() - start - prefill, 1e-9))
    return times


def speed_ratios(model, original, prompt_BS: torch.Tensor, new: int, repeats: int) -> dict[str, float]:
    """Prefill and decode tokens/s ÷ the original's, timed alternately (``paired_times``); medians of
    ``repeats``."""
    return median_ratios(paired_times(model, original, prompt_BS, new, repeats))


def median_ratios(times: dict[str, dict[str, list]]) -> dict[str, float]:
    """``paired_times``'s result as tokens/s ÷ the original's: the original's median seconds ÷ the model's, for
    prefill and decode."""
    return {
        k: statistics.median(times["original"][k]) / statistics.median(times["model"][k]) for k in ("prefill", "decode")
    }


# -- the baselines' hooks -------------------------------------------------------------------------------------
@contextlib.contextmanager
def deleted(model, layers: list[int], part: str, estimates: dict[int, SkipUpdate] | None = None):
    """``part`` of ``layers`` removed for every token, or replaced by ``estimates[i](layer input)``."""
    with contextlib.ExitStack() as stack:
        if estimates is None:
            for i in layers:
                stack.enter_context(skipped(model, i, part))
        else:
            handles = []
            for i in layers:
                layer, est = model.model.layers[i], estimates[i]
                store: dict = {}
                if part == "mlp":  # the estimate reads what the MLP's norm reads: the attention's output
                    handles.append(
                        layer.post_attention_layernorm.register_forward_pre_hook(
                            lambda m, args, store=store: store.update(x=args[0])
                        )
                    )
                else:
                    handles.append(
                        layer.register_forward_pre_hook(
                            lambda m, args, kwargs, store=store: store.update(
                                x=args[0] if args else kwargs["hidden_states"]
                            ),
                            with_kwargs=True,
                        )
                    )
                if part == "layer":
                    handles.append(
                        layer.register_forward_hook(
                            lambda m, args, out, store=store, est=est: store["x"] + est(store["x"])
                        )
                    )
                else:
                    sub = layer.self_attn if part == "attention" else layer.mlp
                    handles.append(
                        sub.register_forward_hook(
                            lambda m, args, out, store=store, est=est: (est(store["x"]),) + tuple(out[1:])
                            if isinstance(out, tuple)
                            else est(store["x"])
                        )
                    )
            stack.callback(lambda: [h.remove() for h in handles])
        yield model


def fit_deletion_estimates(model, layers: list[int], part: str, windows_WS, rank: int) -> dict[int, SkipUpdate]:
    """A rank-``rank`` estimate of each layer's part update from its input, fitted on every token (the
    deletion baseline's strongest form). For part "mlp" the input is the attention's output, as for MoD."""
    from mode.hf.dense.router_fit import _collect

    probe = mh.to_mod(
        copy.deepcopy(model),
        layers=layers,
        capacity=1.0,
        causal="threshold",
        part=part,
        kv="routed" if part == "mlp" else "all",
        skip_rank=rank,
    )
    data = _collect(probe, batches_of(windows_WS, 8), mh.mod_layers(probe))
    out = {}
    for i, layer in mh.mod_layers(probe).items():
        f_ND, _, u_ND, _ = data[i]
        layer.mod_skip.fit(f_ND, u_ND)
        out[i] = layer.mod_skip
    return out


def oracle_routing(model) -> None:
    """Route each MoD layer's top-C by the norm of the update its part would make (an upper bound)."""
    from mode.hf.dense.router_fit import _update

    for layer in mh.mod_layers(model).values():

        def pre(m, args, kwargs):
            x_BSD = args[0] if args else kwargs["hidden_states"]
            with torch.no_grad():
                m._oracle_BS = _update(m, x_BSD, kwargs)[1].norm(dim=-1)

        layer.register_forward_pre_hook(pre, with_kwargs=True)
        layer.mod_router.scores = lambda x_BSD, layer=layer: layer._oracle_BS


# -- the run --------------------------------------------------------------------------------------------------
def bootstrap_ci(diff_W: torch.Tensor, n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% interval of the mean of ``diff_W`` over windows (paired bootstrap)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(diff_W), (n, len(diff_W)), generator=g)
    means = diff_W[idx].mean(1).sort().values
    return float(means[int(0.025 * n)]), float(means[int(0.975 * n) - 1])


def fill_intervals(rows: dict[str, dict], base: float) -> None:
    """The paired interval against deletion with the estimate, for rows measured before that row existed
    (both rows' per-window losses are kept)."""
    for row in rows.values():
        if row.get("method") not in ("random", "oracle", "fit") or "window_losses" not in row:
            continue
        ref = next(
            (
                r
                for r in rows.values()
                if r.get("part") == row["part"] and r.get("method") == "delete+est" and "window_losses" in r
            ),
            None,
        )
        if ref is not None and "vs_delete_est_ci_pct" not in row:
            diff = torch.tensor(row["window_losses"]) - torch.tensor(ref["window_losses"])
            row["vs_delete_est_ci_pct"] = list(bootstrap_ci(100 * diff / base))


@contextlib.contextmanager
def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _num(value, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def table_markdown(base: float, rows: list[dict]) -> str:
    lines = [
        f"SmolLM2-135M-Instruct, held-out loss {base:.4f} nats/token (pydoc topics, every 4th topic)",
        "",
        "| row | Δ loss % (mean ± std) | 95% CI vs delete | 95% CI vs delete +est | share | MACs ÷ orig | "
        "KV ÷ orig | prefill b1 / b8 | decode b1 / b8 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def interval(ci) -> str:
        return "—" if ci is None else f"[{ci[0]:+.2f}, {ci[1]:+.2f}]"

    parts, methods = ["attention", "layer", "mlp"], ["delete", "delete+est", "random", "oracle", "fit"]
    rows = sorted(
        rows,
        key=lambda r: (
            parts.index(r["part"]),
            methods.index(r["method"]),
            len(r["layers"]),
            r.get("kv") or "",
            -1 if r.get("rank") is None else r["rank"],
            r.get("distill_steps") or 0,
        ),
    )
    for r in rows:
        std = "" if r.get("d_loss_pct_std") is None else f" ± {r['d_loss_pct_std']:.2f}"
        lines.append(
            f"| {r['name']} | {r['d_loss_pct']:+.2f}{std} | {interval(r.get('vs_delete_ci_pct'))} "
            f"| {interval(r.get('vs_delete_est_ci_pct'))} "
            f"| {_num(r.get('share'), '.3f')} | {_num(r.get('macs_ratio'), '.3f')} | {_num(r.get('kv_ratio'), '.3f')} "
            f"| {_num(r.get('prefill_b1'), '.2f')} / {_num(r.get('prefill_b8'), '.2f')} "
            f"| {_num(r.get('decode_b1'), '.2f')} / {_num(r.get('decode_b8'), '.2f')} |"
        )
    return "\n".join(lines) + "\n"

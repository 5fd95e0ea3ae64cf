"""The report of ``heal_vs_prune.py``: per (method, point) mean ± std over seeds, MoD − pruning with its paired
intervals, the table and the PNG (Δ loss vs MACs, one line per method).

Run as a script it merges results of runs split over processes or machines (one point or method each, into
their own ``--out``) into one, checks that every MoD row had its pruning partners' healing budget, and writes
the summary, the intervals and the PNG again::

    python benchmarks/hf/heal_vs_prune_report.py --into benchmarks/results/heal_vs_prune.json part_a.json part_b.json
    python benchmarks/hf/heal_vs_prune_report.py --into benchmarks/results/heal_vs_prune.json  # the report only
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import NamedTuple

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere without installing
    sys.path.insert(0, str(ROOT))

from benchmarks.common import save_figure  # noqa: E402
from benchmarks.hf.heal_vs_prune_ood import t_interval, unseen_intervals, unseen_summary  # noqa: E402
from benchmarks.hf.smollm2_measure import _num, bootstrap_ci  # noqa: E402
from mode.train.checkpoint import atomic_write_text  # noqa: E402


class Prune(NamedTuple):
    """A pruning method: with the fitted estimate, LoRA on every kept layer (rather than on the kept layer after
    each deleted block), and how the layers are chosen (``prune_layers(by=...)``; ``"skip_cost"`` with the
    estimate measures each layer's cost with its estimate standing in)."""

    est: bool
    every_layer: bool
    by: str = "block_influence"


class Mod(NamedTuple):
    """A MoD method: the part, the causal rule, with the estimate for skipped tokens, ``min_capacity`` (None:
    ``--min-capacity``), LoRA on every layer rather than on the converted ones (the counterpart of
    prune-bi-est-all), the layer order (``"skip_cost"``: ``skip_costs`` of the part, or of each half for
    ``"mixed"``; ``"skip_cost_est"``: the same with the estimate standing in), ``router_fit``'s label
    (``"update"`` / ``"residual"``) and the text the causal thresholds are calibrated on (``"fit"``: the fit
    windows; ``"docstrings"``: stdlib docstring windows, text no fit saw and unlike it, where the residual router
    routes more, as on held-out text), and the pruning method it is drawn against ("": the one with the same
    estimate, adapters and layer choice)."""

    part: str
    causal: str
    est: bool
    min_capacity: float | None
    every_layer: bool
    order: str = "skip_cost"
    label: str = "update"
    calibrate: str = "fit"
    partner: str = ""


PRUNE = {
    "prune-bi": Prune(False, False),
    "prune-bi-est": Prune(True, False),
    "prune-bi-est-all": Prune(True, True),
    "prune-sc-est-all": Prune(True, True, "skip_cost"),  # the layers whose deletion with the estimate costs least
}
MOD: dict[str, Mod] = {
    "mod-layer-thr": Mod("layer", "threshold", False, None, False),
    "mod-layer-thr-est": Mod("layer", "threshold", True, None, False),
    "mod-layer-thr-est-c0.4": Mod("layer", "threshold", True, 0.4, False),  # fewer layers at a lower capacity
    "mod-layer-thr-est-c0.3": Mod("layer", "threshold", True, 0.3, False),
    "mod-layer-thr-est-c0.4-all": Mod("layer", "threshold", True, 0.4, True),
    # the layers cheapest with their estimate, the tokens the estimate misses most routed: prune-sc-est-all's pair
    "mod-layer-thr-est-c0.4-all-sc": Mod("layer", "threshold", True, 0.4, True, "skip_cost_est"),
    "mod-layer-thr-est-c0.4-all-sc-res": Mod("layer", "threshold", True, 0.4, True, "skip_cost_est", "residual"),
    "mod-layer-thr-est-c0.4-all-sc-res-cd": Mod(
        "layer", "threshold", True, 0.4, True, "skip_cost_est", "residual", "docstrings"
    ),
    "mod-layer-bce": Mod("layer", "aux_bce", False, None, False),
    "mod-attn-thr": Mod("attention", "threshold", False, None, False),
    "mod-mlp-thr": Mod("mlp", "threshold", False, None, False),
    "mod-mix-thr": Mod("mixed", "threshold", False, None, False),
    "mod-mix-thr-est": Mod("mixed", "threshold", True, None, False),
    # the halves mixed with the best whole-layer row's other choices (floor, adapters, label, calibration text)
    "mod-mix-thr-est-c0.4-all-res-cd": Mod(
        "mixed", "threshold", True, 0.4, True, "skip_cost", "residual", "docstrings", "prune-sc-est-all"
    ),  # drawn against the strongest pruning, as the best whole-layer row
    # and each half ranked with its estimate standing in, as the best row ranks its whole layers
    "mod-mix-thr-est-c0.4-all-sc-res-cd": Mod(
        "mixed", "threshold", True, 0.4, True, "skip_cost_est", "residual", "docstrings", "prune-sc-est-all"
    ),
}
METHODS = (*PRUNE, *MOD)
BUDGET_KEYS = ("steps", "tokens", "data_digest", "objective", "trainable_kind")  # what "the same healing" means


def _partner(m: Mod) -> str:
    """The pruning method a MoD method is drawn against: its own, or the same estimate, adapters and layer
    choice."""
    if m.partner:
        return m.partner
    if m.order == "skip_cost_est":
        return "prune-sc-est-all"
    return "prune-bi-est-all" if m.every_layer else "prune-bi-est" if m.est else "prune-bi"


def summarize(
    rows: dict[str, dict], base: float, unseen_base: dict[str, float] | None = None
) -> tuple[list[dict], list[dict]]:
    """Per (method, point): mean ± std over seeds; per (MoD method, pruning method, point) over the seeds both
    have: the paired intervals of MoD − pruning. ``unseen_base``: each out-of-domain set's original loss; the
    rows measured on them get the same per set (``"unseen"``)."""
    unseen_base = unseen_base or {}
    done = [r for r in rows.values() if "d_loss_pct" in r]
    groups: dict[tuple[str, float], list[dict]] = {}
    for r in done:
        groups.setdefault((r["method"], r["point"]), []).append(r)
    summary = []
    for (method, point), rs in sorted(groups.items(), key=lambda kv: (METHODS.index(kv[0][0]), -kv[0][1])):
        pct = [r["d_loss_pct"] for r in rs]

        def mean(key, rs=rs):
            vals = [r[key] for r in rs if r.get(key) is not None]
            return statistics.mean(vals) if vals else None

        summary.append(
            {
                "method": method,
                "point": point,
                "seeds": sorted(r["seed"] for r in rs),
                "macs_ratio": mean("macs_ratio"),
                "macs_ratio_measured": mean("macs_ratio_measured"),
                "d_loss_pct": statistics.mean(pct),
                "d_loss_pct_std": statistics.stdev(pct) if len(pct) > 1 else None,
                "d_loss_pct_before": mean("d_loss_pct_before"),
                "d_loss_pct_topc": mean("d_loss_pct_topc"),
                **{k: mean(k) for k in ("decode_b1", "decode_b8", "prefill_b1", "prefill_b8", "cpu_seconds")},
                "unseen": unseen_summary(rs, list(unseen_base)),
            }
        )
    intervals = []
    for (method, point), rs in groups.items():
        if method not in MOD:
            continue
        for partner in PRUNE:
            ps = {r["seed"]: r for r in groups.get((partner, point), [])}
            pairs = [(r, ps[r["seed"]]) for r in rs if r["seed"] in ps]
            if not pairs:
                continue
            diffs = [a["d_loss_pct"] - b["d_loss_pct"] for a, b in pairs]
            diff_W = torch.stack(
                [torch.tensor(a["window_losses"]) - torch.tensor(b["window_losses"]) for a, b in pairs]
            ).mean(0)
            intervals.append(
                {
                    "mod": method,
                    "prune": partner,
                    "point": point,
                    "seeds": sorted(a["seed"] for a, _ in pairs),
                    "diff_pct": statistics.mean(diffs),
                    "bootstrap_ci_pct": list(bootstrap_ci(100 * diff_W / base)),
                    "t_ci_pct": t_interval(diffs),
                    "unseen": unseen_intervals(pairs, unseen_base),
                }
            )
    intervals.sort(key=lambda r: (METHODS.index(r["mod"]), METHODS.index(r["prune"]), -r["point"]))
    return summary, intervals


def _macs_drawn(s: dict) -> float:
    """Where a summary row sits on the MACs axis: what it spent on the held-out windows (a threshold router routes
    what it routes there, not what was planned); the planned ratio where nothing was measured."""
    return s["macs_ratio"] if s.get("macs_ratio_measured") is None else s["macs_ratio_measured"]


def plot(summary: list[dict], intervals: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ox, bx) = plt.subplots(1, 3, figsize=(21, 4.6))
    tab20 = plt.get_cmap("tab20")  # the dark shades first, then the light ones: one colour per method
    colour = {m: tab20((2 * i) % 20 + i // 10) for i, m in enumerate(METHODS)}
    for method in METHODS:
        rs = sorted((s for s in summary if s["method"] == method), key=_macs_drawn)
        if not rs:
            continue
        err = [s["d_loss_pct_std"] or 0.0 for s in rs]
        style = dict(marker="o", capsize=3, linestyle="--" if method in PRUNE else "-", color=colour[method])
        ax.errorbar([_macs_drawn(s) for s in rs], [s["d_loss_pct"] for s in rs], yerr=err, label=method, **style)
        out = [s for s in rs if "mean" in s.get("unseen", {})]  # the out-of-domain sets' mean, where all measured
        if out:
            ox.plot(
                [_macs_drawn(s) for s in out],
                [s["unseen"]["mean"]["d_loss_pct"] for s in out],
                label=method,
                **{k: v for k, v in style.items() if k != "capsize"},
            )
    ax.set_xlabel("MACs per token ÷ original, measured (threshold routers: their held-out shares)")
    ax.set_ylabel("Δ held-out loss, % of original (healed)")
    ax.set_title(f"{title}: in-domain held-out, mean ± std over seeds", fontsize=9)
    ox.set_xlabel("MACs per token ÷ original (as left)")
    ox.set_ylabel("Δ loss out of domain, % (mean of the sets)")
    ox.set_title("out of domain: text no step saw (prose, dialogue, code), mean over seeds", fontsize=9)
    if not ox.lines:
        ox.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ox.transAxes)
    for a in (ax, ox):
        a.invert_xaxis()
        lo, hi = a.get_ylim()
        a.set_ylim(lo, hi + 0.45 * (hi - lo))  # room above the points for the legend
    ax.legend(fontsize=7, ncol=2, loc="upper right")
    if ox.lines:
        ox.legend(fontsize=7, ncol=2, loc="upper right")
    # Right: each MoD method against the pruning of its kind (with the estimate against prune-bi-est, without it
    # against prune-bi, adapters on every layer against prune-bi-est-all), in the method's colour of the left
    # panel; the table and JSON hold every pair.
    kind = {m: _partner(MOD[m]) for m in MOD}
    pairs = [(m, kind[m]) for m in MOD if any(r["mod"] == m and r["prune"] == kind[m] for r in intervals)]
    for k, (mod, partner) in enumerate(pairs):
        rs = sorted((r for r in intervals if r["mod"] == mod and r["prune"] == partner), key=lambda r: r["point"])
        shift = 0.003 * (k - (len(pairs) - 1) / 2)  # side by side: the intervals of one point do not overlap
        xs = [r["point"] + shift for r in rs]
        mid = [r["diff_pct"] for r in rs]
        lo = [m - r["bootstrap_ci_pct"][0] for m, r in zip(mid, rs)]
        hi = [r["bootstrap_ci_pct"][1] - m for m, r in zip(mid, rs)]
        bx.errorbar(
            xs,
            mid,
            yerr=[[max(v, 0.0) for v in lo], [max(v, 0.0) for v in hi]],
            marker="o",
            capsize=3,
            color=colour[mod],
            label=f"{mod} − {partner}",
        )
        for x, r in zip(xs, rs):  # the t interval over seeds, where there are >= 2: a wide pale bar behind
            if r["t_ci_pct"] is not None:
                bx.vlines(x, *r["t_ci_pct"], colors=[colour[mod]], linewidth=7, alpha=0.25)
        out = [(x + 0.0015, r["unseen"]["mean"]) for x, r in zip(xs, rs) if "mean" in r.get("unseen", {})]
        if out:  # the same pair on the out-of-domain sets (their mean): squares, dashed
            mid = [u["diff_pct"] for _, u in out]
            lo = [max(m - u["bootstrap_ci_pct"][0], 0.0) for m, (_, u) in zip(mid, out)]
            hi = [max(u["bootstrap_ci_pct"][1] - m, 0.0) for m, (_, u) in zip(mid, out)]
            bx.errorbar(
                [x for x, _ in out],
                mid,
                yerr=[lo, hi],
                marker="s",
                capsize=3,
                linestyle=":",
                color=colour[mod],
                label=f"{mod} − {partner}, out of domain",
            )
    points = sorted({r["point"] for r in intervals})
    if points:
        bx.set_xticks(points)
    bx.axhline(0.0, color="gray", linewidth=0.8)
    bx.set_xlabel("MACs point (÷ original)")
    bx.set_ylabel("MoD − pruning, points of %")
    bx.set_title("paired 95%: bootstrap over windows (bars), t over seeds (pale)", fontsize=9)
    bx.invert_xaxis()
    if pairs:  # a run of one method (a part file) has no pair to name
        bx.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: it hid intervals
    save_figure(fig, path)


def _ci(ci: list[float] | None) -> str:
    return "—" if ci is None else f"[{ci[0]:+.2f}, {ci[1]:+.2f}]"


def table(summary: list[dict], intervals: list[dict], base: float, unseen_base: dict[str, float] | None = None) -> str:
    names = list(unseen_base or {})
    out_head = f"Δ % out of domain, healed ({' / '.join(names)}; mean) | " if names else ""
    lines = [
        f"held-out loss of the original {base:.4f} nats/token"
        + "".join(f"; {k} {v:.4f}" for k, v in (unseen_base or {}).items()),
        "",
        "| method | point | MACs ÷ orig (measured) | Δ loss % before heal | Δ loss % healed (mean ± std) | "
        f"{out_head}top-C Δ % | decode b1 / b8 | CPU s per heal | seeds |",
        "|---|---|---|---|---|" + ("---|" if names else "") + "---|---|---|---|",
    ]
    for s in summary:
        std = "" if s["d_loss_pct_std"] is None else f" ± {s['d_loss_pct_std']:.2f}"
        u = s.get("unseen", {})
        out = " / ".join(_num(u[k]["d_loss_pct"] if k in u else None, "+.2f") for k in names)
        out_cell = f"{out}; {_num(u['mean']['d_loss_pct'] if 'mean' in u else None, '+.2f')} | " if names else ""
        lines.append(
            f"| {s['method']} | {s['point']:.2f} | {s['macs_ratio']:.3f} ({_num(s['macs_ratio_measured'], '.3f')}) "
            f"| {_num(s['d_loss_pct_before'], '+.2f')} | {s['d_loss_pct']:+.2f}{std} | {out_cell}"
            f"{_num(s['d_loss_pct_topc'], '+.2f')} | {_num(s['decode_b1'], '.2f')} / {_num(s['decode_b8'], '.2f')} "
            f"| {_num(s['cpu_seconds'], '.1f')} | {len(s['seeds'])} |"
        )
    lines += ["", "| MoD − pruning | point | text | diff (points of %) | 95% bootstrap (windows) | 95% t (seeds) |"]
    lines.append("|---|---|---|---|---|---|")
    for r in intervals:
        texts = [("in-domain", r)] + [(k, v) for k, v in r.get("unseen", {}).items()]
        for text, v in texts:
            lines.append(
                f"| {r['mod']} − {r['prune']} | {r['point']:.2f} | {text} | {v['diff_pct']:+.2f} | "
                f"{_ci(v['bootstrap_ci_pct'])} | {_ci(v['t_ci_pct'])} |"
            )
    return "\n".join(lines) + "\n"


def settings_of(doc: dict) -> dict:
    """A result's settings, as runs now write them (files from before ``--router-lr`` lack it: None; from before
    ``--heal-text``: the topics)."""
    return {"router_lr": None, "heal_text": "topics", **doc.get("settings", {})}


def unseen_base_of(doc: dict) -> dict[str, float]:
    """A result's out-of-domain sets: each one's original loss (none in results from before them)."""
    return {k: u["original_loss"] for k, u in doc.get("unseen", {}).items()}


def model_title(smoke: bool) -> str:
    """The PNG's name for the model measured."""
    return "tiny random Llama (smoke)" if smoke else "SmolLM2-135M"


def merge(into: Path, sources: list[Path]) -> dict:
    """Add the rows of the ``heal_vs_prune.py`` results ``sources`` to ``into`` (created from the first source if
    missing), check budgets, recompute the summary and intervals, write ``into`` and its PNG; returns the result.

    Refused (``ValueError`` naming the file): other settings, another original loss (another model or text), a
    row measured in two files with different results, a MoD row whose healing budget differs from a pruning
    row's at its point and seed. Rows are keyed ``method@point#sSEED``; a row in both files with the same
    result is kept once."""
    paths = ([into] if into.is_file() else []) + list(sources)
    if not paths:
        raise ValueError(f"into={str(into)!r}: does not exist and no source to merge into it")
    docs = [json.loads(p.read_text()) for p in paths]
    names = [str(p) for p in paths]
    doc, rows = docs[0], {r["key"]: r for r in docs[0]["rows"]}
    for name, other in zip(names[1:], docs[1:]):
        if settings_of(other) != settings_of(doc):
            raise ValueError(f"{name}: settings {other.get('settings')} differ from {names[0]}'s {doc.get('settings')}")
        if not math.isclose(other["base_loss"], doc["base_loss"], rel_tol=1e-5):
            raise ValueError(
                f"{name}: original held-out loss {other['base_loss']:.6f}, {names[0]} has {doc['base_loss']:.6f} "
                "(another model or text?)"
            )
        for r in other["rows"]:
            have = rows.get(r["key"])
            if have is not None and have.get("d_loss_pct") != r.get("d_loss_pct"):
                raise ValueError(f"{name}: row {r['key']} was measured differently in {names[0]}; drop one of them")
            rows.setdefault(r["key"], r)
        doc["skip_costs"] = {**other.get("skip_costs", {}), **doc.get("skip_costs", {})}
        for k, u in other.get("unseen", {}).items():
            have = doc.setdefault("unseen", {}).setdefault(k, u)
            if have["text_sha256"] != u["text_sha256"]:
                raise ValueError(f"{name}: unseen set {k!r} is other text than {names[0]}'s (its sha256 differs)")
    healed = {k: r for k, r in rows.items() if "steps" in r}
    for key, r in healed.items():
        if r["method"] not in MOD:
            continue
        partners = [healed[k] for m in PRUNE if (k := f"{m}@{r['point']}#s{r['seed']}") in healed]
        for p in partners:
            if any(r[f] != p[f] for f in BUDGET_KEYS):
                raise ValueError(f"{key}: healed with another budget than {p['key']} ({', '.join(BUDGET_KEYS)})")
        r["same_budget_as"] = [p["key"] for p in partners]
    doc["rows"] = sorted(rows.values(), key=lambda r: (-r["point"], r["seed"], METHODS.index(r["method"])))
    doc["summary"], doc["intervals"] = summarize(rows, doc["base_loss"], unseen_base_of(doc))
    into.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(into, json.dumps(doc, indent=2) + "\n")
    plot(doc["summary"], doc["intervals"], into.with_suffix(".png"), model_title(settings_of(doc).get("smoke", False)))
    return doc


def main(argv: list[str] | None = None) -> dict:
    about = (__doc__ or "").split("\n\n")[0]
    p = argparse.ArgumentParser(description=about, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--into", required=True, help="the result to merge into (and to report)")
    p.add_argument("sources", nargs="*", help="heal_vs_prune.py results to add to --into")
    args = p.parse_args(argv)
    doc = merge(Path(args.into), [Path(s) for s in args.sources])
    print(table(doc["summary"], doc["intervals"], doc["base_loss"], unseen_base_of(doc)))
    print(f"wrote {args.into} and {Path(args.into).with_suffix('.png')}")
    return doc


if __name__ == "__main__":
    main()

"""What an isoFLOP sweep found: per budget and variant the best size and the parabola fit, the claimed
differences between best models paired over seeds, and their tables and plots. docs/isoflop.md."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import cast

import numpy as np

from mode.experiments import stats_ci
from mode.experiments.compare import CLAIMS
from mode.experiments.isoflop_plan import IsoflopPreset, RunSpec, Size
from mode.train import checkpoint

# Claims made when both sides were trained (the extra variants are trained only when named in ``only``):
# staged MoDE against integrated MoDE with 7 no-op slots per expert, which sends 1/8 of the tokens to an MLP
# expert under balanced routing, as staged MoDE's 12.5% capacity does: the same FLOPs per token at each size
SWEEP_CLAIMS = {**CLAIMS, "staged - integrated MoDE, same FLOPs/token": ("staged_mode", "integrated_mode_matched")}

# -- analysis ---------------------------------------------------------------------------------------------


def parabola_fit(log_params: list[float], losses: list[float]) -> dict | None:
    """Least-squares ``loss = a x^2 + b x + c`` with ``x = log10(params)``; its minimum when ``a > 0``.
    ``interior``: the minimum lies inside the sizes tried (outside, it is an extrapolation)."""
    if len(log_params) < 3:
        return None
    a, b, c = (float(v) for v in np.polyfit(log_params, losses, 2))
    fit = {"a": a, "b": b, "c": c, "params_opt": None, "loss_opt": None, "interior": False}
    if a > 0:
        x = -b / (2 * a)
        fit.update(params_opt=10**x, loss_opt=c - b * b / (4 * a), interior=min(log_params) <= x <= max(log_params))
    return fit


def summarize(
    p: IsoflopPreset, specs: list[RunSpec], results: dict[Path, dict], seeds: list[int], names: list[str]
) -> dict:
    """Per budget and variant: every size (losses per seed), the best size, the parabola fit; per budget
    the claimed differences between best models, paired over seeds; the validation-set noise."""
    by_key = {(s.budget, s.variant, s.size, s.seed): results[s.dir] for s in specs}
    budgets_out = []
    noise_single, noise_pair = [], []
    for budget in p.budgets:
        entry = {"budget": budget, "variants": {}, "claims": {}}
        for name in names:
            sizes = []
            for size in p.sizes:
                found = [by_key.get((budget, name, size, s)) for s in seeds]
                if any(r is None for r in found):
                    continue
                runs = cast("list[dict]", found)  # none is None
                losses = [r["val_loss"] for r in runs]
                sizes.append(
                    {
                        "size": size.name,
                        "n_layers": size.n_layers,
                        "d_model": size.d_model,
                        "params": runs[0]["params"],
                        "params_non_embedding": runs[0]["params_non_embedding"],
                        "steps": runs[0]["steps"],
                        "nominal_flops": runs[0]["nominal_flops"],
                        "train_flops": {str(s): r["train_flops"] for s, r in zip(seeds, runs)},
                        "loss": {str(s): v for s, v in zip(seeds, losses)},
                        "loss_mean": stats_ci.mean(losses),
                        "loss_std": stats_ci.std(losses),
                    }
                )
                noise_single += [stats_ci.window_noise(r["window_losses"]) for r in runs]
            if not sizes:
                continue
            i_best = min(range(len(sizes)), key=lambda i: sizes[i]["loss_mean"])
            best = dict(sizes[i_best], at_edge=len(sizes) > 1 and i_best in (0, len(sizes) - 1))
            fit = parabola_fit([math.log10(s["params"]) for s in sizes], [s["loss_mean"] for s in sizes])
            entry["variants"][name] = {"sizes": sizes, "best": best, "fit": fit}
        best_dense_ratio = None
        if "dense" in entry["variants"]:
            best_dense_ratio = entry["variants"]["dense"]["best"]["loss_mean"]
        for v in entry["variants"].values():
            v["best"]["vs_best_dense"] = None if best_dense_ratio is None else v["best"]["loss_mean"] / best_dense_ratio
        entry["per_size"] = _per_size(p, budget, seeds, by_key, entry["variants"])
        for label, (a, b) in SWEEP_CLAIMS.items():
            if a not in entry["variants"] or b not in entry["variants"]:
                continue
            ba, bb = entry["variants"][a]["best"], entry["variants"][b]["best"]
            runs_a = [by_key[(budget, a, _size(p, ba["size"]), s)] for s in seeds]
            runs_b = [by_key[(budget, b, _size(p, bb["size"]), s)] for s in seeds]
            d = stats_ci.paired_difference([r["val_loss"] for r in runs_a], [r["val_loss"] for r in runs_b])
            eval_se = max(  # a float for eval_windows >= 2 (every preset: 512+), which the report assumes
                cast(float, stats_ci.window_noise(ra["window_losses"], rb["window_losses"]))
                for ra, rb in zip(runs_a, runs_b)
            )
            noise_pair.append(eval_se)
            # a best size at the edge of the sizes tried is not an optimum: the true one may lie beyond it
            entry["claims"][label] = {
                "a": f"{a} {ba['size']}",
                "b": f"{b} {bb['size']}",
                **d,
                "eval_se": eval_se,
                "at_edge": [n for n, best in ((a, ba), (b, bb)) if best["at_edge"]],
            }
        budgets_out.append(entry)
    validation = {
        "windows": p.eval_windows,
        "seq_len": p.base.seq_len,
        "loss_se_max": max(noise_single, default=None),
        "difference_se_max": max(noise_pair, default=None),
    }
    return {"budgets": budgets_out, "validation": validation}


def _per_size(p: IsoflopPreset, budget: float, seeds: list[int], by_key: dict, variants: dict) -> dict:
    """Each claim at each size where both sides were trained on every seed: the same size, the same training
    FLOPs, paired over seeds; ``flops_per_token_ratio`` is a's nominal FLOPs per token over b's (1.0 for the
    matched staged/integrated pair, below 1 where a runs more steps in the budget)."""
    out = {}
    for label, (a, b) in SWEEP_CLAIMS.items():
        if a not in variants or b not in variants:
            continue
        rows = []
        for size in p.sizes:
            runs_a = [by_key.get((budget, a, size, s)) for s in seeds]
            runs_b = [by_key.get((budget, b, size, s)) for s in seeds]
            if any(r is None for r in runs_a + runs_b):
                continue
            runs_a, runs_b = cast("list[dict]", runs_a), cast("list[dict]", runs_b)  # none is None
            d = stats_ci.paired_difference([r["val_loss"] for r in runs_a], [r["val_loss"] for r in runs_b])
            rows.append(
                {
                    "size": size.name,
                    **{k: v for k, v in d.items() if k != "diffs"},
                    "flops_per_token_ratio": runs_a[0]["step_flops"] / runs_b[0]["step_flops"],
                }
            )
        out[label] = rows
    return out


def _size(p: IsoflopPreset, name: str) -> Size:
    return next(s for s in p.sizes if s.name == name)


# -- tables -----------------------------------------------------------------------------------------------


def _rows(report: dict):
    for entry in report["budgets"]:
        for name, v in entry["variants"].items():
            yield entry["budget"], name, v


def format_params(n: float) -> str:
    """``2.8k``, ``213k``, ``1.61M``."""
    if n >= 1e6:
        return f"{n / 1e6:.3g}M"
    return f"{n / 1e3:.3g}k" if n >= 1e3 else f"{n:.3g}"


def _fit_text(fit: dict | None) -> str:
    if not fit or fit["params_opt"] is None:
        return "no minimum"
    return format_params(fit["params_opt"]) + ("" if fit["interior"] else " (outside)")


def validation_note(report: dict) -> str:
    v = report["validation"]
    text = (
        f"validation: {v['windows']} fixed windows of {v['seq_len']} bytes, the same for every run; "
        f"its noise (standard error over windows): one loss <= {v['loss_se_max']:.4f}"
    )
    if v["difference_se_max"] is not None:
        text += f", a paired difference between two models <= {v['difference_se_max']:.4f}"
    return text


def _edge_text(claim: dict) -> str:
    edge = claim.get("at_edge") or []
    return f"  ! {', '.join(edge)} best at the edge of the sizes: not an optimum" if edge else ""


def format_report(report: dict) -> str:
    """The sweep as the terminal prints it: best size per budget and variant, then the claims."""
    seeds = report.get("config", {}).get("seeds", [])
    head = (
        f"{'budget':>8} {'variant':<16}{'best size':>10}{'params':>11}{'steps':>7}{'val loss':>20}"
        f"{'vs best dense':>14}{'fit: params at min':>20}"
    )
    lines = [
        f"isoFLOP-optimal size per variant ({len(seeds)} seed(s); loss = mean ± std over seeds)",
        head,
        "-" * len(head),
    ]
    for budget, name, v in _rows(report):
        b = v["best"]
        ratio = "-" if b["vs_best_dense"] is None else f"{b['vs_best_dense']:.4f}"
        edge = "*" if b["at_edge"] else " "
        lines.append(
            f"{budget:>8.2g} {name:<16}{b['size'] + edge:>10}{b['params']:>11,}{b['steps']:>7}"
            f"{stats_ci.format_pm(b['loss_mean'], b['loss_std']):>20}{ratio:>14}{_fit_text(v['fit']):>20}"
        )
    lines += [
        "(* best at the edge of the sizes tried)",
        "",
        "claims (best vs best, paired over seeds; mean ± std [95% t interval], * = interval excludes 0)",
    ]
    for entry in report["budgets"]:
        for label, c in entry["claims"].items():
            lines.append(
                f"{entry['budget']:>8.2g} {label:<26}{stats_ci.format_difference(c):>44}"
                f"  ({c['rel']:+.2%}; eval SE {c['eval_se']:.4f}){_edge_text(c)}"
            )
    for entry in report["budgets"]:
        for label, rows in entry.get("per_size", {}).items():
            if rows:
                lines.append(
                    f"{entry['budget']:>8.2g} {label + ', same size:':<26}"
                    + "; ".join(f"{r['size']} {stats_ci.format_difference(r)}" for r in rows)
                )
    lines += ["", validation_note(report)]
    return "\n".join(lines)


def markdown_report(report: dict) -> str:
    """The same as Markdown tables (written as isoflop.md, pasted into docs)."""
    lines = [
        "| budget (FLOPs) | variant | best size | params | steps | val loss (mean ± std) | vs best dense | "
        "parabola: params at min | loss at min |",
        "|---" * 9 + "|",
    ]
    for budget, name, v in _rows(report):
        b, fit = v["best"], v["fit"]
        ratio = "–" if b["vs_best_dense"] is None else f"{b['vs_best_dense']:.4f}"
        fit_loss = "–" if not fit or not fit["interior"] else f"{fit['loss_opt']:.4f}"  # no extrapolated losses
        lines.append(
            f"| {budget:.2g} | {name} | {b['size']}{' (edge)' if b['at_edge'] else ''} | {b['params']:,} | "
            f"{b['steps']} | {stats_ci.format_pm(b['loss_mean'], b['loss_std'])} | {ratio} | "
            f"{_fit_text(fit)} | {fit_loss} |"
        )
    lines += [
        "",
        "| budget (FLOPs) | difference (best vs best) | models | mean ± std | 95% interval | significant | "
        "relative | eval SE | caveat |",
        "|---" * 9 + "|",
    ]
    for entry in report["budgets"]:
        for label, c in entry["claims"].items():
            interval = "–" if c["low"] is None else f"[{c['low']:+.4f}, {c['high']:+.4f}]"
            sig = "–" if c["significant"] is None else ("**yes**" if c["significant"] else "no")
            lines.append(
                f"| {entry['budget']:.2g} | {label} | {c['a']} − {c['b']} | "
                f"{stats_ci.format_pm(c['mean'], c['std'], '+.4f')} | {interval} | {sig} | {c['rel']:+.2%} | "
                f"{c['eval_se']:.4f} |{_edge_text(c)[3:] or ' '} |"
            )
    per_size = [
        (e["budget"], label, rows) for e in report["budgets"] for label, rows in e.get("per_size", {}).items() if rows
    ]
    if per_size:
        lines += [
            "",
            "| budget (FLOPs) | difference (same size) | size | mean ± std | 95% interval | significant | "
            "relative | FLOPs/token a ÷ b |",
            "|---" * 8 + "|",
        ]
        for budget, label, rows in per_size:
            for r in rows:
                interval = "–" if r["low"] is None else f"[{r['low']:+.4f}, {r['high']:+.4f}]"
                sig = "–" if r["significant"] is None else ("**yes**" if r["significant"] else "no")
                lines.append(
                    f"| {budget:.2g} | {label} | {r['size']} | "
                    f"{stats_ci.format_pm(r['mean'], r['std'], '+.4f')} | {interval} | {sig} | "
                    f"{r['rel']:+.2%} | {r['flops_per_token_ratio']:.3f} |"
                )
    lines += ["", validation_note(report)]
    return "\n".join(lines)


# -- plots ------------------------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    _pyplot().close(fig)
    checkpoint.atomic_write(path, buf.getvalue())


def plot_loss_vs_params(report: dict, path: Path) -> None:
    """The paper's isoFLOP figure: loss against parameters, one panel per budget, one curve per variant
    (mean ± std over seeds); a star marks each variant's best size, dashes its parabola fit."""
    plt = _pyplot()
    n = len(report["budgets"])
    fig, axes = plt.subplots(1, n, figsize=(4.6 * n, 4.2), squeeze=False, sharey=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, entry in zip(axes[0], report["budgets"]):
        for i, (name, v) in enumerate(entry["variants"].items()):
            c = colors[i % len(colors)]
            xs = [s["params"] for s in v["sizes"]]
            ys = [s["loss_mean"] for s in v["sizes"]]
            err = [s["loss_std"] or 0.0 for s in v["sizes"]]
            ax.errorbar(xs, ys, yerr=err, marker="o", ms=3, color=c, label=name, capsize=2)
            ax.plot([v["best"]["params"]], [v["best"]["loss_mean"]], marker="*", ms=11, color=c)
            fit = v["fit"]
            if fit:
                lx = np.linspace(math.log10(min(xs)), math.log10(max(xs)), 50)
                ax.plot(10**lx, fit["a"] * lx**2 + fit["b"] * lx + fit["c"], ls="--", lw=0.8, color=c)
        ax.set_xscale("log")
        ax.set_xlabel("parameters")
        ax.set_title(f"budget {entry['budget']:.2g} training FLOPs")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("validation loss (nats/byte)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)


def plot_best_vs_budget(report: dict, path: Path) -> None:
    """Each variant's isoFLOP-optimal loss (mean ± std over seeds) against the training budget."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.3))
    names = list(dict.fromkeys(name for e in report["budgets"] for name in e["variants"]))
    for name in names:
        pts = [(e["budget"], e["variants"][name]["best"]) for e in report["budgets"] if name in e["variants"]]
        line = ax.errorbar(
            [b for b, _ in pts],
            [x["loss_mean"] for _, x in pts],
            yerr=[x["loss_std"] or 0.0 for _, x in pts],
            marker="o",
            ms=4,
            capsize=2,
            label=name,
        )
        edge = [(b, x["loss_mean"]) for b, x in pts if x["at_edge"]]
        if edge:  # hollow: the best size tried is at the edge of the sizes, not an optimum
            ax.plot(*zip(*edge), ls="none", marker="o", ms=7, mfc="white", color=line[0].get_color())
    ax.set_xscale("log")
    ax.set_xlabel("training FLOPs")
    ax.set_ylabel("isoFLOP-optimal validation loss (nats/byte)")
    ax.set_title("Best loss at each budget (hollow: best size at the edge of the sizes tried)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)

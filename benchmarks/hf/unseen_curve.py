"""In-domain and out-of-domain losses along the MAC curve: ``mode convert`` folders at several budgets, methods and
seeds, grouped into one curve per recipe, with MoD − pruning paired by seed at every budget (issue 68).

    for m in 0.95 0.90 0.80 0.75; do
      mode convert smollm2 --macs $m --out runs/mod_$m --skip-rank 64 --min-capacity 0.4 --router-label residual \\
          --heal-layers all --calibrate docstrings --threads 1 --seed 0
      mode convert smollm2 --macs $m --out runs/prune_$m --method prune --prune-by skip_cost --skip-rank 64 \\
          --heal-layers all --threads 1 --seed 0
    done
    python benchmarks/hf/unseen_curve.py --folders runs/* --out benchmarks/results/heal_vs_prune_unseen_curve.json

A recipe is a folder's method, ``--fit-text`` and ``--heal-text``; a point its ``--macs`` target. Per recipe,
point and text (the held-out windows of the training text, and each out-of-domain set of ``mode.hf.dense.unseen``):
the Δ loss % against the original, mean ± std over the seeds there, and the MACs the conversion spent on that
text. Where MoD and pruning with the same fit and heal texts share a point, their difference with
``heal_vs_prune_unseen.compare``'s intervals (a paired bootstrap over windows, and a t interval over seeds with two
or more). Writes the JSON and a PNG beside it: one panel per text, Δ loss % against the MACs spent on it, one line
per recipe.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere without installing
    sys.path.insert(0, str(ROOT))

from benchmarks.common import machine_info  # noqa: E402
from benchmarks.hf.heal_vs_prune_unseen import compare, measure_folder  # noqa: E402
from mode.train.checkpoint import atomic_write_text  # noqa: E402


def texts_of(settings: dict) -> str:
    """What the fits and healing read, where not the training text: ``", fit mix, heal mix"``, or ``""``."""
    fit, heal = settings.get("fit_text", "train"), settings.get("heal_text", "train")
    return ("" if fit == "train" else f", fit {fit}") + ("" if heal == "train" else f", heal {heal}")


def recipe(report: dict) -> str:
    """``mod`` or ``prune``, with what the fits and healing read (``texts_of``)."""
    return report["settings"]["method"] + texts_of(report["settings"])


def curves(measured: list[dict]) -> dict:
    """``{recipe: {target: {"seeds", "macs", "texts": {text: {mean, std, macs, per_seed}}}}}``."""
    groups: dict[str, dict[float, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for m in measured:
        groups[recipe(m["report"])][float(m["report"]["settings"]["macs"])].append(m)
    out: dict = {}
    for name, points in sorted(groups.items()):
        out[name] = {}
        for target, runs in sorted(points.items()):
            seeds = [r["report"]["settings"]["seed"] for r in runs]
            if len(set(seeds)) != len(seeds):
                raise ValueError(f"{name} at {target}: seed repeated in {seeds}")
            texts = {}
            for text in runs[0]["texts"]:
                if not all(text in r["texts"] for r in runs):
                    continue
                pct = []
                for r in runs:
                    t = r["texts"][text]
                    orig = t["original_loss"] if "original_loss" in t else statistics.mean(t["original_W"])
                    pct.append(100 * (statistics.mean(t["loss_W"]) / orig - 1))
                texts[text] = {
                    "mean": statistics.mean(pct),
                    "std": statistics.stdev(pct) if len(pct) > 1 else None,
                    "per_seed": pct,
                    "macs": statistics.mean(r["texts"][text]["macs"] for r in runs),
                }
            out[name][str(target)] = {
                "seeds": seeds,
                "macs": statistics.mean(r["report"]["result"]["macs"] for r in runs),
                "texts": texts,
            }
    return out


def pairs(measured: list[dict]) -> dict:
    """MoD − pruning at every target where both ran with the same fit and heal texts, paired by seed
    (``compare``)."""
    by: dict[tuple[str, float, str], dict[int, dict]] = defaultdict(dict)
    for m in measured:
        st = m["report"]["settings"]
        by[(st["method"], float(st["macs"]), texts_of(st))][st["seed"]] = m
    out: dict = {}
    for (method, target, texts), mods in sorted(by.items()):
        prunes = by.get(("prune", target, texts), {}) if method == "mod" else {}
        seeds = sorted(set(mods) & set(prunes))
        if seeds:
            key = f"{target}{texts}"
            out[key] = {"seeds": seeds, "texts": compare([mods[s] for s in seeds], [prunes[s] for s in seeds])}
    return out


def plot_panels(png: Path, title: str, xlabel: str, panels: dict[str, list[tuple[str, list, list, list]]]) -> None:
    """One panel per text, Δ loss % on y: ``panels[text]`` lists ``(label, x, mean, std)`` lines (a std of None
    draws no bar); also heal_curve.py's plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (text, lines) in zip(axes[0], panels.items()):
        for label, x, mean, std in lines:
            ax.errorbar(x, mean, yerr=[v or 0.0 for v in std], marker="o", capsize=3, label=label)
        ax.set_title(text)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("Δ loss vs the original (%)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def plot(result: dict, png: Path) -> None:
    texts = list(dict.fromkeys(t for c in result["curves"].values() for p in c.values() for t in p["texts"]))
    panels = {}
    for text in texts:
        panels[text] = []
        for name, points in result["curves"].items():
            pts = [p["texts"][text] for p in points.values() if text in p["texts"]]
            panels[text].append((name, [p["macs"] for p in pts], [p["mean"] for p in pts], [p["std"] for p in pts]))
    plot_panels(png, result["title"], "MACs spent on the text (of the original)", panels)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--folders", nargs="+", required=True, help="mode convert folders (any budgets, methods, seeds)")
    p.add_argument("--out", required=True, help="the result JSON (the PNG beside it)")
    p.add_argument("--cache", default=None, help="losses measured here for reports without them (default: --out's)")
    args = p.parse_args(argv)
    cache_path = Path(args.cache or Path(args.out).with_suffix(".cache.json"))
    cache = json.loads(cache_path.read_text()) if cache_path.is_file() else {}
    measured = []
    for folder in args.folders:
        measured.append(measure_folder(Path(folder), cache))
        if cache:
            atomic_write_text(cache_path, json.dumps(cache) + "\n")  # a killed run keeps what it measured
    result = {
        "title": f"{measured[0]['report'].get('model', measured[0]['report']['source'])}: in- and out-of-domain "
        "loss along the MAC curve",
        "folders": args.folders,
        "machine": machine_info(),
        "curves": curves(measured),
        "mod_minus_prune": pairs(measured),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(result, indent=2) + "\n")
    plot(result, out.with_suffix(".png"))
    for name, points in result["curves"].items():
        for target, point in points.items():
            cells = "  ".join(
                f"{t} {v['mean']:+.2f}%" + ("" if v["std"] is None else f"±{v['std']:.2f}") + f" ({v['macs']:.3f})"
                for t, v in point["texts"].items()
            )
            print(f"{name:<16} {target:<6} seeds {point['seeds']}: {cells}")
    for key, pair in result["mod_minus_prune"].items():
        cells = "  ".join(
            f"{t} {v['diff_pct']:+.2f} [{v['bootstrap_ci_pct'][0]:+.2f}, {v['bootstrap_ci_pct'][1]:+.2f}]"
            for t, v in pair["texts"].items()
        )
        print(f"MoD - pruning at {key}: {cells}")
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return result


if __name__ == "__main__":
    main()

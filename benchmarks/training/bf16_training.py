"""Mixed-precision training against float32: does bf16 autocast track float32 on the ``mode compare`` preset?

    PYTHONPATH=. python benchmarks/training/bf16_training.py --seeds 3              # quick preset (docs/performance.md)
    PYTHONPATH=. python benchmarks/training/bf16_training.py --full --only dense mod  # the default preset, slower
    PYTHONPATH=. python benchmarks/training/bf16_training.py --quick-test           # seconds: the smoke test

Runs ``mode compare`` twice into ``--work`` (``fp32/`` and ``bf16/``, resumable like any compare run):
the same variants, seeds, budget and data, once in float32 and once with ``--bf16`` (forward under
``torch.autocast(bfloat16)``; routers, weights, gradients and AdamW in float32). A seed fixes the data
order and the initial weights, so the two precisions are paired per seed.

Per variant it reports the final validation loss of both (measured in float32 on the same fixed windows,
so the number compares the trained weights, not the evaluation's rounding), the paired difference
bf16 - fp32 with its 95% t interval over seeds, the gap between the training-loss curves (logged every
10 steps on the same batches: the mean over seeds of bf16 - fp32 at each step, averaged over the second
half of training, and its largest absolute value) and the training throughput ratio. Writes a table,
``bf16_training.json`` and ``bf16_training.png`` (the training-loss curves, one line per seed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere without installing
    sys.path.insert(0, str(ROOT))

from benchmarks.common import machine_info, print_table, save_figure, write_json  # noqa: E402
from mode.experiments import stats_ci  # noqa: E402
from mode.experiments.compare import RESULT_FILE, run_compare, run_dir  # noqa: E402

VARIANTS = ("dense", "mod", "moe", "staged_mode", "integrated_mode")
PRECISIONS = ("fp32", "bf16")


def per_seed(work: Path, precision: str, name: str, seeds: list[int]) -> list[dict]:
    """The per-seed result files ``mode compare`` wrote for one variant, each with its training-loss curve
    (``train``: (step, loss) from the run's log.jsonl)."""
    runs = []
    for s in seeds:
        d = run_dir(work / precision, name, s, len(seeds))
        result = json.loads((d / RESULT_FILE).read_text())
        records = [json.loads(line) for line in (d / "log.jsonl").read_text().splitlines() if line.strip()]
        result["train"] = [(r["step"], r["loss"]) for r in records if "loss" in r and "step" in r]
        runs.append(result)
    return runs


def train_gap(fp32: list[dict], bf16: list[dict]) -> tuple[float, float]:
    """The training-loss curves, paired by seed and step (same batches): the mean over seeds of bf16 - fp32
    at each logged step; returns (its mean over the second half of training, its largest |value|)."""
    steps = sorted(set.intersection(*(set(dict(r["train"])) for r in fp32 + bf16)))
    diffs = [stats_ci.mean([dict(b["train"])[t] - dict(a["train"])[t] for a, b in zip(fp32, bf16)]) for t in steps]
    if not diffs:
        return float("nan"), float("nan")
    return stats_ci.mean(diffs[len(diffs) // 2 :]), max(abs(d) for d in diffs)


def summarize(work: Path, names: list[str], seeds: list[int]) -> list[dict]:
    rows = []
    for name in names:
        runs = {p: per_seed(work, p, name, seeds) for p in PRECISIONS}
        loss = {p: [r["val_loss"] for r in runs[p]] for p in PRECISIONS}
        diff = stats_ci.paired_difference(loss["bf16"], loss["fp32"])
        gap_late, gap_max = train_gap(runs["fp32"], runs["bf16"])
        rows.append(
            dict(
                variant=name,
                steps=runs["fp32"][0]["steps"],
                fp32=stats_ci.mean(loss["fp32"]),
                fp32_std=stats_ci.std(loss["fp32"]),
                bf16=stats_ci.mean(loss["bf16"]),
                bf16_std=stats_ci.std(loss["bf16"]),
                diff=diff,
                diff_text=stats_ci.format_difference(diff),
                rel_pct=100 * diff["rel"],
                train_gap_late=gap_late,
                train_gap_max=gap_max,
                tok_s_ratio=statistics.median(b["tok_s"] / a["tok_s"] for a, b in zip(runs["fp32"], runs["bf16"])),
                curves={p: [r["train"] for r in runs[p]] for p in PRECISIONS},
            )
        )
    return rows


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(3.2 * len(rows), 3.2), squeeze=False)
    for ax, r in zip(axes[0], rows):
        for precision, style in (("fp32", "-"), ("bf16", "--")):
            for i, curve in enumerate(r["curves"][precision]):
                step, loss = zip(*curve)
                ax.plot(
                    step,
                    loss,
                    style,
                    color="C0" if precision == "fp32" else "C3",
                    lw=1,
                    alpha=0.8,
                    label=precision if i == 0 else None,
                )
        ax.set_title(f"{r['variant']}\nbf16 - fp32 {r['diff']['mean']:+.4f}", fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.set_yscale("log")
        ax.tick_params(labelsize=7)
    axes[0][0].set_ylabel("training loss (one line per seed)", fontsize=8)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--full", action="store_true", help="the default compare preset (default: --quick's)")
    p.add_argument("--quick-test", action="store_true", help="20 dense steps, 1 seed, dense and MoE (smoke test)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--only", nargs="+", default=list(VARIANTS), help=f"variants (default: {' '.join(VARIANTS)})")
    p.add_argument("--dense-steps", type=int, help="budget = this many dense steps (default: the preset's)")
    p.add_argument("--work", default="runs/bf16_training", help="where the two compare runs go (resumable)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/bf16_training.json)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads(N)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.quick_test:
        args.seeds, args.only, args.dense_steps = 1, ["dense", "moe"], args.dense_steps or 20
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    work = Path(args.work)
    seeds = list(range(args.seeds))
    reports = {}
    for precision in PRECISIONS:
        print(f"== {precision} ==", flush=True)
        reports[precision] = run_compare(
            work / precision,
            quick=not args.full,
            seeds=args.seeds,
            only=args.only,
            dense_steps=args.dense_steps,
            progress=not args.no_progress,
            bf16=precision == "bf16",
        )
    rows = summarize(work, args.only, seeds)
    print()
    print_table(
        rows,
        [
            ("variant", "variant", ""),
            ("steps", "steps", "d"),
            ("fp32", "fp32 loss", ".4f"),
            ("fp32_std", "± std", ".4f"),
            ("bf16", "bf16 loss", ".4f"),
            ("bf16_std", "± std", ".4f"),
            ("diff_text", "bf16 - fp32 (paired, 95% interval)", ""),
            ("rel_pct", "%", "+.2f"),
            ("train_gap_late", "train loss gap, 2nd half", "+.4f"),
            ("train_gap_max", "max |gap|", ".4f"),
            ("tok_s_ratio", "tok/s bf16 / fp32", ".2f"),
        ],
    )
    print(
        f"\n{args.seeds} seed(s); * = the interval excludes 0. Final losses in float32 on "
        f"{reports['fp32']['validation']['windows']} fixed windows; eval noise of one loss <= "
        f"{reports['fp32']['validation']['loss_se_max']:.4f}"
    )
    info = machine_info()
    payload = dict(
        benchmark="bf16_training",
        command=" ".join(["bf16_training.py"] + (argv if argv is not None else sys.argv[1:])),
        preset="default" if args.full else "quick",
        seeds=seeds,
        machine=info,
        budget_flops=reports["fp32"]["config"]["budget_flops"],
        validation=reports["fp32"]["validation"],
        results=rows,
    )
    name = "bf16_training_quick.json" if args.quick_test else "bf16_training.json"
    path = write_json(Path(args.out) if args.out else ROOT / "benchmarks" / "results" / name, payload)
    png = path.with_suffix(".png")
    plot(
        rows,
        png,
        f"bf16 autocast vs float32, mode compare {'default' if args.full else 'quick'} preset, "
        f"{args.seeds} seed(s), {info['torch_threads']} thread(s)",
    )
    print(f"\nwrote {path} and {png}")
    return payload


if __name__ == "__main__":
    main()

"""Load balancing on the same MoE LM: the Switch balance loss against DeepSeek-V3's bias balancing.

    PYTHONPATH=. python benchmarks/layers/bench_balance.py --seeds 3        # mode compare's quick preset, MoE layers
    PYTHONPATH=. python benchmarks/layers/bench_balance.py --quick-test     # seconds: the smoke test

One MoE LM (``mode compare --quick``'s width and depth, every layer MoE, 8 experts, top-2), trained the same
number of steps on the same batches (a seed fixes the data order and the initial weights: runs are paired
per seed) with four balancing recipes:

    none        no balancing at all (the control: how unbalanced does routing get by itself?)
    switch      the Switch balance loss, coefficient 0.01 (``balance_coef``)
    bias        bias balancing without an auxiliary loss (``bias_balance``, rate 1e-3)
    bias+seq    bias balancing plus DeepSeek-V3's sequence-wise loss at 1e-4

Per recipe: the final validation loss (fixed windows, the same for every run) with the paired difference
against ``switch`` and its 95% t interval over seeds, and the worst expert's load over the mean load,
``max/mean`` of each MoE layer (real experts, after routing), averaged over layers and over the last 20% of
the training steps (the routing statistics are logged every step). Writes a table, ``bench_balance.json`` and
``bench_balance.png`` (max/mean against step, one line per seed).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere without installing
    sys.path.insert(0, str(ROOT))

from benchmarks.common import machine_info, print_table, save_figure, write_json  # noqa: E402
from mode.experiments import stats_ci, sweep  # noqa: E402
from mode.experiments.compare import preset  # noqa: E402
from mode.train.data import stdlib_corpus  # noqa: E402

RECIPES = {
    "none": dict(balance_coef=0.0),
    "switch": dict(balance_coef=0.01),
    "bias": dict(balance_coef=0.0, router_options=dict(bias_balance=True)),
    "bias+seq": dict(balance_coef=1e-4, router_options=dict(bias_balance=True, balance_scope="sequence")),
}
BASELINE = "switch"
CURVE_EVERY = 10  # the JSON keeps every 10th step of the max/mean curves (the PNG has them all)


def run(name: str, seed: int, steps: int, work: Path, corpus, val, progress: bool) -> dict:
    p = preset(quick=True)
    cfg = replace(p.model, layers=("moe",) * p.model.n_layers, num_experts=8, top_k=2, z_coef=1e-3, **RECIPES[name])
    tcfg = replace(sweep.run_train_config(p.train, steps, seed, None), stats_every=1, eval_every=10**9)
    trainer = sweep.train(cfg, tcfg, corpus, work / f"{name}_seed{seed}", f"{name} seed {seed}", progress, resume=False)
    routing = [(r["step"], r["routing"]["overall"]["max_mean"]) for r in trainer.history if "routing" in r]
    late = [v for s, v in routing if s > 0.8 * steps]
    return {
        "val_loss": stats_ci.mean(sweep.window_losses(trainer.model, val)),
        "max_mean_curve": routing,
        "max_mean_late": stats_ci.mean(late),
        "tok_s": trainer.tokens / trainer.wall,
    }


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for i, (name, runs) in enumerate(results.items()):
        for j, r in enumerate(runs):
            step, mm = zip(*r["max_mean_curve"])
            ax.plot(step, mm, color=f"C{i}", lw=1, alpha=0.7, label=name if j == 0 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("worst expert load / mean (avg over layers)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=300, help="training steps of every run (default 300)")
    p.add_argument("--only", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    p.add_argument("--quick-test", action="store_true", help="10 steps, 1 seed, switch and bias (smoke test)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/bench_balance.json)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads(N)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.quick_test:
        args.seeds, args.steps, args.only = 1, 10, ["switch", "bias"]
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    pre = preset(quick=True)
    corpus = stdlib_corpus(max_bytes=pre.max_corpus_bytes)
    val = sweep.validation_windows(corpus, pre.model.seq_len, pre.eval_windows, pre.eval_batch_size)
    seeds = list(range(args.seeds))
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_balance_") as tmp:
        for name in args.only:
            results[name] = [run(name, s, args.steps, Path(tmp), corpus, val, not args.no_progress) for s in seeds]
            print(
                f"{name}: val loss {[round(r['val_loss'], 4) for r in results[name]]}, max/mean (last 20%) "
                f"{[round(r['max_mean_late'], 3) for r in results[name]]}",
                flush=True,
            )
    rows = []
    for name, runs in results.items():
        loss, mm = [r["val_loss"] for r in runs], [r["max_mean_late"] for r in runs]
        row = dict(
            recipe=name,
            loss=stats_ci.mean(loss),
            loss_std=stats_ci.std(loss),
            max_mean=stats_ci.mean(mm),
            max_mean_std=stats_ci.std(mm),
            tok_s=stats_ci.mean([r["tok_s"] for r in runs]),
        )
        if name != BASELINE and BASELINE in results:
            d = stats_ci.paired_difference(loss, [r["val_loss"] for r in results[BASELINE]])
            row.update(vs_switch=d, vs_switch_text=stats_ci.format_difference(d))
            dm = stats_ci.paired_difference(
                mm,
                [r["max_mean_late"] for r in results[BASELINE]],
            )
            row.update(max_mean_vs_switch=dm, max_mean_vs_switch_text=stats_ci.format_difference(dm, "+.3f"))
        rows.append(row)
    print()
    print_table(
        rows,
        [
            ("recipe", "recipe", ""),
            ("loss", "val loss", ".4f"),
            ("loss_std", "± std", ".4f"),
            ("vs_switch_text", f"- {BASELINE} (paired, 95% interval)", ""),
            ("max_mean", "max/mean, last 20%", ".3f"),
            ("max_mean_std", "± std", ".3f"),
            ("max_mean_vs_switch_text", f"- {BASELINE}", ""),
            ("tok_s", "tok/s", ",.0f"),
        ],
    )
    print(f"\n{args.seeds} seed(s), {args.steps} steps each; * = the interval excludes 0")
    info = machine_info()
    payload = dict(
        benchmark="bench_balance",
        command=" ".join(["bench_balance.py"] + (argv if argv is not None else sys.argv[1:])),
        seeds=seeds,
        steps=args.steps,
        recipes={k: RECIPES[k] for k in args.only},
        machine=info,
        results=rows,
        curve_every=CURVE_EVERY,
        runs={k: [{**r, "max_mean_curve": r["max_mean_curve"][::CURVE_EVERY]} for r in v] for k, v in results.items()},
    )
    name = "bench_balance_quick.json" if args.quick_test else "bench_balance.json"
    path = write_json(Path(args.out) if args.out else ROOT / "benchmarks" / "results" / name, payload)
    png = path.with_suffix(".png")
    plot(
        results,
        png,
        f"MoE LM ({pre.model.n_layers} layers, 8 experts, top-2): load balance per recipe, {args.seeds} seed(s)",
    )
    print(f"\nwrote {path} and {png}")
    return payload


if __name__ == "__main__":
    main()

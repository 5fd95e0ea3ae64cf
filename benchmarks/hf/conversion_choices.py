"""Which layers and which tokens: the choices of a MoD conversion with an estimate, compared before healing.

    python benchmarks/hf/conversion_choices.py --threads 2     # SmolLM2-135M at 0.85, floor 0.4: ~20 minutes
    python benchmarks/hf/conversion_choices.py --smoke         # a tiny random Llama: seconds

A MoD layer with an estimate (``to_mod(skip_rank=R)``) gives a skipped token ``x + estimate(x)``, so what
skipping costs is what the estimate misses. Two choices of the conversion ignored that:

    order   which layers to convert: ``skip_costs`` of the layer skipped outright ("skip_cost"), or with its
            fitted estimate standing in ("skip_cost_est": ``skip_costs(estimate_rank=R)``)
    label   which tokens the router learns to route (``router_fit``): the largest updates ("update"), or the
            largest the estimate misses ("residual": ``router_fit(label="residual")``)

    calibrate  the text the causal thresholds are set on (``calibrate``): the fit windows ("fit", what
            ``router_fit`` does), or stdlib docstring windows no fit saw ("docstrings", as
            ``heal_vs_prune.py``'s ``-cd`` rows)

For each (order, label, calibrate) the conversion is planned to the MACs of deleting the nearest whole-layer count
(``plan_to_macs``, the same target as ``heal_vs_prune.py``), converted, fitted, and measured on held-out windows
no step saw (``english_windows``: every 4th pydoc topic held out): Δ loss % of the original's with causal
routing (what ``generate()`` does) and with top-C (the planned share in every row), the share causal routing
took on the held-out, the fit, training windows no fit saw ("unseen": the next ``--val-windows`` after the fit
windows) and the docstring windows, and the MACs ÷ original at the held-out share: where a threshold router's
compute drifts from the plan, and on which text. No healing: this
isolates the conversion; ``heal_vs_prune.py`` heals the choices that matter.

Writes ``--out`` (default ``benchmarks/results/conversion_choices.json``; ``--smoke``:
``conversion_choices_smoke.json``) and prints a table.

Shape legend: W windows, S sequence.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere without installing
    sys.path.insert(0, str(ROOT))

import mode.hf as mh  # noqa: E402
from benchmarks.common import machine_info  # noqa: E402
from benchmarks.hf.heal_vs_prune_models import fill_defaults, load_original  # noqa: E402
from benchmarks.hf.smollm2_measure import english_windows, window_losses  # noqa: E402
from mode.hf.dense.budget import layers_to_delete, pruned_macs  # noqa: E402
from mode.hf.dense.macs import _parts, macs_per_token  # noqa: E402
from mode.hf.dense.windows import batches_of, calibration_docstring_windows  # noqa: E402
from mode.train.checkpoint import atomic_write_text  # noqa: E402

ORDERS = ("skip_cost", "skip_cost_est")
LABELS = ("update", "residual")
CALIBRATIONS = ("fit", "docstrings")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="a tiny random Llama, few windows")
    p.add_argument("--macs", type=float, default=0.85, help="the point: MACs ÷ original")
    p.add_argument("--min-capacity", type=float, default=0.4, help="plan_to_macs's min_capacity")
    p.add_argument("--est-rank", type=int, default=None, help="the estimate's rank (64; smoke 8)")
    p.add_argument("--rounds", type=int, default=3, help="router_fit's rounds for label 'residual'")
    p.add_argument("--orders", nargs="+", default=list(ORDERS), choices=ORDERS)
    p.add_argument("--labels", nargs="+", default=list(LABELS), choices=LABELS)
    p.add_argument(
        "--calibrate", nargs="+", default=["fit"], choices=CALIBRATIONS, help="texts the thresholds are set on"
    )
    p.add_argument("--fit-windows", type=int, default=None)
    p.add_argument("--cost-windows", type=int, default=None)
    p.add_argument("--val-windows", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    real = dict(est_rank=64, fit_windows=64, cost_windows=8, val_windows=32, seq_len=256)
    smoke = dict(est_rank=8, fit_windows=8, cost_windows=4, val_windows=8, seq_len=64)
    fill_defaults(args, smoke if args.smoke else real)
    if args.out is None:
        args.out = f"benchmarks/results/conversion_choices{'_smoke' if args.smoke else ''}.json"
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    original, tokenizer, name = load_original(args.smoke, args.cache_dir)
    S, R = args.seq_len, args.est_rank
    train_WS, held_WS = english_windows(tokenizer, S)
    val_WS = held_WS[torch.linspace(0, len(held_WS) - 1, args.val_windows).long()]
    fit_WS = train_WS[: args.fit_windows]
    fit_batches = batches_of(fit_WS, 8)
    cost_batch = [train_WS[: args.cost_windows]]
    doc_WS = calibration_docstring_windows(tokenizer, S, len(fit_WS))  # as heal_vs_prune's -cd rows
    cal_batches = {"fit": fit_batches, "docstrings": batches_of(doc_WS, 8)}
    texts = {
        "fit": fit_WS,
        "unseen": train_WS[args.fit_windows : args.fit_windows + args.val_windows],
        "docstrings": doc_WS,
    }
    base = float(window_losses(original, val_WS).mean())
    n_layers = original.config.num_hidden_layers
    target = pruned_macs(original, S, layers_to_delete(original, S, args.macs))
    print(f"{name}: held-out loss {base:.4f}; point {args.macs}: MoD planned to MACs {target:.4f}", flush=True)
    costs = {
        "skip_cost": mh.skip_costs(original, cost_batch, "layer"),
        "skip_cost_est": mh.skip_costs(original, cost_batch, "layer", estimate_rank=R, fit_batches=fit_batches),
    }

    def pct(loss_W: torch.Tensor) -> float:
        return 100 * (float(loss_W.mean()) / base - 1)

    rows = []
    for order in args.orders:
        ranked = sorted(range(n_layers), key=lambda i: (costs[order][i], i))
        plan = mh.plan_to_macs(
            original, target, S, part="layer", skip_rank=R, order=ranked, min_capacity=args.min_capacity
        )
        for label in args.labels:
            model = copy.deepcopy(original)
            for group in plan.groups():
                mh.to_mod(model, **group, causal="threshold")
            mh.router_fit(model, fit_batches, label=label, rounds=args.rounds)  # calibrates on the fit batches
            with mh.routing(model, "topk"):
                topc = pct(window_losses(model, val_WS))  # the planned share: no threshold involved
            for cal in args.calibrate:
                if cal != "fit":
                    mh.calibrate(model, cal_batches[cal])
                elif cal != args.calibrate[0]:
                    mh.calibrate(model, fit_batches)  # router_fit's thresholds again
                shares: dict[int, float] = {}
                loss_W = window_losses(model, val_WS, shares=shares)
                parts, n = _parts(model)
                for i, s in shares.items():
                    parts[i]["share"] = s
                row = {
                    "order": order,
                    "label": label,
                    "calibrate": cal,
                    "layers": sorted(plan.layers),
                    "capacity": plan.capacity,
                    "macs_planned": plan.macs,
                    "macs_measured": macs_per_token(original.config, S, parts, n)
                    / macs_per_token(original.config, S, {}, n),
                    "d_loss_pct": pct(loss_W),
                    "d_loss_pct_topc": topc,
                    "share_held_out": statistics.mean(shares.values()),
                    "share_held_out_per_layer": {str(i): s for i, s in sorted(shares.items())},
                    "window_losses": loss_W.tolist(),
                }
                for text, text_WS in texts.items():
                    text_shares: dict[int, float] = {}
                    window_losses(model, text_WS, shares=text_shares)
                    row[f"share_{text}"] = statistics.mean(text_shares.values())
                rows.append(row)
                print(
                    f"{order:<14} {label:<9} {cal:<10} {len(plan.layers)} layers at {plan.capacity:.3f}: "
                    f"Δ {row['d_loss_pct']:+.2f}% (top-C {topc:+.2f}%), share held-out {row['share_held_out']:.3f} "
                    f"fit {row['share_fit']:.3f} unseen {row['share_unseen']:.3f} docstrings "
                    f"{row['share_docstrings']:.3f}, MACs {row['macs_measured']:.4f}",
                    flush=True,
                )
    doc = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "threads", "cache_dir")},
        "model": name,
        "machine": machine_info(),
        "base_loss": base,
        "target_macs": target,
        "skip_costs": {order: {str(i): c for i, c in cs.items()} for order, cs in costs.items()},
        "rows": rows,
        "seconds": time.perf_counter() - t0,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(doc, indent=2) + "\n")
    lines = [
        "| order | label | calibrated on | layers | Δ loss, causal | Δ loss, top-C | share held-out / fit / unseen / "
        "docstrings | MACs measured |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['order']} | {r['label']} | {r['calibrate']} | {len(r['layers'])} at {r['capacity']:.3f} | "
            f"{r['d_loss_pct']:+.2f}% | {r['d_loss_pct_topc']:+.2f}% | {r['share_held_out']:.3f} / "
            f"{r['share_fit']:.3f} / {r['share_unseen']:.3f} / {r['share_docstrings']:.3f} | {r['macs_measured']:.4f} |"
        )
    print("\n".join(lines))
    print(f"wrote {out} ({doc['seconds']:.0f} s)")
    return doc


if __name__ == "__main__":
    main()

"""MoD recipe ablations: which router gate, initialisation, learning rate, capacity, routed blocks and causal
method make learned MoD routing beat random routing and the best dense model, at equal training FLOPs.

Every configuration is trained on the same seeds (a seed fixes the data order, so runs are paired), to the
same training-FLOP budget (``--mult`` x 150 steps of the quick preset's 4-layer dense model, d=64), and
evaluated on the same 512 fixed validation windows. For learned routers two diagnostics are recorded:

    gate       mean |router weight| of the routed tokens at the end (what multiplies the block's delta)
    sel_value  validation loss with a random top-C at evaluation minus the loss with the learned top-C,
               same weights and gate values: how much the learned *selection* is worth to the trained model

Each line of ``--out`` (JSONL) is one run; the summary at the end gives mean ± std over seeds and the paired
95% interval of each configuration against ``--ref`` (default: the best dense model) and of each learned
configuration against its random-routing twin. docs/isoflop.md has the results.

    PYTHONPATH=. python benchmarks/training/ablate_mod_recipe.py --configs all --seeds 0 1 2 --out /tmp/ablate.jsonl
    PYTHONPATH=. python benchmarks/training/ablate_mod_recipe.py --summary /tmp/ablate.jsonl

``router_lr10`` multiplies the router's learning rate by 10 without touching the trainer: the router weight
is reparametrised as ``10 * v`` (Adam's step on ``v`` is about ``lr``, so on the weight about ``10 lr``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn
from torch.nn.utils import parametrize

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere without installing
    sys.path.insert(0, str(ROOT))

from mode.experiments import stats_ci, sweep  # noqa: E402
from mode.layers.mod import MoD  # noqa: E402
from mode.model import LMConfig, alternate  # noqa: E402
from mode.train import TrainConfig, Trainer, build_optimizer  # noqa: E402
from mode.train.data import stdlib_corpus  # noqa: E402

BASE = LMConfig(seq_len=128, d_model=64, n_heads=2, d_hidden=256, layers=("dense",) * 4, num_experts=4)
TRAIN = TrainConfig(batch_size=8, lr=3e-3, warmup_steps=20, eval_every=10**9, eval_batches=1, log_every=10**6)
EVERY_OTHER, ALL_BUT_FIRST = alternate(4, "dense", "mod"), ("dense", "mod", "mod", "mod")


def _random(layers: tuple[str, ...]) -> tuple[str, ...]:
    return tuple("mod_random" if k == "mod" else k for k in layers)


def configs() -> dict[str, tuple[LMConfig, dict]]:
    """name -> (model config, options). ``*_rand`` is the random-routing twin of the name without it."""
    p = dict(causal="predictor")
    c = {f"dense_L{n}": (replace(BASE, layers=("dense",) * n), {}) for n in (1, 2, 3, 4)}
    for tag, gate in (("raw", "raw"), ("sigmoid", "sigmoid"), ("ste", "ste"), ("one", "one")):
        c[tag] = (replace(BASE, layers=EVERY_OTHER, mod_gate=gate, **p), {})
        if gate != "one":
            c[f"{tag}_rand"] = (replace(BASE, layers=_random(EVERY_OTHER), mod_gate=gate), {})
    c["router_init30"] = (replace(BASE, layers=EVERY_OTHER, **p), {"init_scale": 30.0})
    c["router_lr10"] = (replace(BASE, layers=EVERY_OTHER, **p), {"lr_mult": 10.0})
    for cap in (25, 50):
        c[f"cap{cap}"] = (replace(BASE, layers=EVERY_OTHER, capacity=cap / 100, **p), {})
        c[f"cap{cap}_rand"] = (replace(BASE, layers=_random(EVERY_OTHER), capacity=cap / 100), {})
    c["all_but_first"] = (replace(BASE, layers=ALL_BUT_FIRST, **p), {})
    c["all_but_first_rand"] = (replace(BASE, layers=_random(ALL_BUT_FIRST)), {})
    c["all_but_first_sigmoid"] = (replace(BASE, layers=ALL_BUT_FIRST, mod_gate="sigmoid", **p), {})
    c["all_routed"] = (replace(BASE, layers=("mod",) * 4, **p), {})
    c["L2_every_other"] = (replace(BASE, layers=("dense", "mod"), **p), {})
    c["causal_aux_bce"] = (replace(BASE, layers=EVERY_OTHER, causal="aux_bce"), {})
    c["causal_none"] = (replace(BASE, layers=EVERY_OTHER, causal="none"), {})
    return c


class _Scale(nn.Module):
    def __init__(self, m: float):
        super().__init__()
        self.m = m

    def forward(self, v):
        return v * self.m


def _mod_layers(model):
    return [layer for layer in model.layers if isinstance(layer, MoD)]


def selection_value(model, val) -> float:
    """Loss with a random top-C at evaluation minus the loss with the learned one (same weights, gates)."""
    routers = [layer.router for layer in _mod_layers(model)]
    learned = stats_ci.mean(sweep.window_losses(model, val))
    saved = [r.cfg for r in routers]
    for r in routers:
        r.cfg = replace(r.cfg, selection="random")
    torch.manual_seed(123)
    rand = stats_ci.mean(sweep.window_losses(model, val))
    for r, cfg in zip(routers, saved):
        r.cfg = cfg
    return rand - learned


def mean_gate(model, val) -> float | None:
    values = []
    hooks = [
        layer.router.register_forward_hook(lambda m, i, plan: values.append(plan.weight_A.abs().mean().item()))
        for layer in _mod_layers(model)
    ]
    model.eval()
    with torch.no_grad():
        model(val[0][0])
    for h in hooks:
        h.remove()
    return sum(values) / len(values) if values else None


def run(name: str, cfg: LMConfig, opts: dict, budget: float, seed: int, corpus, val, out: Path) -> dict:
    steps = sweep.steps_for_budget(cfg, budget, TRAIN.batch_size, name)
    tcfg = sweep.run_train_config(TRAIN, steps, seed, None)
    trainer = Trainer(cfg, tcfg, corpus, out / name / f"seed{seed}", name=name, progress=False)
    for layer in _mod_layers(trainer.model):
        with torch.no_grad():
            layer.router.weight.mul_(opts.get("init_scale", 1.0))
            if "lr_mult" in opts:
                layer.router.weight.div_(opts["lr_mult"])
                parametrize.register_parametrization(layer.router, "weight", _Scale(opts["lr_mult"]), unsafe=True)
    if "lr_mult" in opts:
        trainer.optimizer = build_optimizer(trainer.model, tcfg)  # it must hold the reparametrised weight
    t0 = time.perf_counter()
    trainer.run()
    losses = sweep.window_losses(trainer.model, val)
    learned = any(k.mod == "learned" for k in cfg.kinds)
    return {
        "config": name,
        "seed": seed,
        "steps": steps,
        "budget": budget,
        "params": trainer.model.num_params(),
        "loss": stats_ci.mean(losses),
        "gate": mean_gate(trainer.model, val),
        "sel_value": selection_value(trainer.model, val) if learned else None,
        "wall_s": time.perf_counter() - t0,
        "window_losses": losses,
    }


def summary(rows: list[dict], ref: str | None) -> str:
    by = defaultdict(dict)
    for r in rows:
        by[(r["budget"], r["config"])][r["seed"]] = r
    lines = []
    for budget in sorted({b for b, _ in by}):
        names = [n for b, n in by if b == budget]
        dense = {
            n: stats_ci.mean([r["loss"] for r in by[(budget, n)].values()]) for n in names if n.startswith("dense_")
        }
        base = ref or (min(dense, key=dense.get) if dense else None)
        lines += [
            f"budget {budget:.3g} FLOPs; reference {base}; differences are paired over the common seeds, "
            "mean ± std [95% t interval], * significant",
            f"{'config':<24}{'n':>3}{'loss':>18}{'steps':>7}{'gate':>8}{'sel_value':>10}  "
            f"{'vs ' + str(base):<46}vs random twin",
        ]
        for n in names:
            runs = by[(budget, n)]
            seeds = sorted(runs)
            losses = [runs[s]["loss"] for s in seeds]

            def versus(other: str) -> str:
                o = by.get((budget, other), {})  # noqa: B023 - called in this iteration
                common = [s for s in seeds if s in o]  # noqa: B023 - called in this iteration
                if not common or other == n:  # noqa: B023 - called in this iteration
                    return "-"
                return stats_ci.format_difference(
                    stats_ci.paired_difference([runs[s]["loss"] for s in common], [o[s]["loss"] for s in common])  # noqa: B023 - called in this iteration
                )

            gate = runs[seeds[0]]["gate"]
            sel = [runs[s]["sel_value"] for s in seeds if runs[s]["sel_value"] is not None]
            twin = n.replace("_rand", "") if n.endswith("_rand") else None
            rand_twin = f"{n}_rand" if (budget, f"{n}_rand") in by else None
            lines.append(
                f"{n:<24}{len(seeds):>3}{stats_ci.format_pm(stats_ci.mean(losses), stats_ci.std(losses)):>18}"
                f"{runs[seeds[0]]['steps']:>7}{'-' if gate is None else f'{gate:.3f}':>8}"
                f"{'-' if not sel else f'{stats_ci.mean(sel):+.4f}':>10}  "
                f"{versus(base) if base else '-':<46}"
                f"{versus(rand_twin) if rand_twin else ('(twin of ' + twin + ')' if twin else '-')}"
            )
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=["all"], help="names from configs(), or all")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--mult", type=float, default=1.0, help="budget = mult x 150 steps of the 4-layer dense model")
    ap.add_argument("--out", type=Path, default=Path("/tmp/ablate_mod_recipe.jsonl"))
    ap.add_argument("--runs", type=Path, default=Path("/tmp/ablate_mod_recipe_runs"))
    ap.add_argument("--summary", type=Path, nargs="*", help="only print the summary of these JSONL files")
    ap.add_argument("--ref", help="reference config for the paired differences (default: the best dense_L*)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if args.summary is not None:
        rows = [json.loads(line) for f in args.summary for line in f.read_text().splitlines() if line.strip()]
        print(summary(rows, args.ref))
        return
    torch.set_num_threads(args.threads)
    table = configs()
    names = list(table) if args.configs == ["all"] else args.configs
    unknown = [n for n in names if n not in table]
    if unknown:
        ap.error(f"unknown config {unknown[0]!r}; choose among {', '.join(table)}")
    corpus = stdlib_corpus(max_bytes=3_000_000)
    val = sweep.validation_windows(corpus, BASE.seq_len, 512, 32)
    budget = args.mult * 150 * sweep.step_flops(BASE, TRAIN.batch_size)
    rows = []
    with args.out.open("a") as f:
        for seed in args.seeds:
            for name in names:
                cfg, opts = table[name]
                r = run(name, cfg, opts, budget, seed, corpus, val, args.runs / f"x{args.mult:g}")
                rows.append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "window_losses"}), flush=True)
                f.write(json.dumps(r) + "\n")
                f.flush()
    print(summary(rows, args.ref))


if __name__ == "__main__":
    main()

"""`mode compare`: dense, MoD, random-routing MoD, MoE, staged and integrated MoDE trained to the same
training-FLOP budget on the same data, then compared on held-out loss.

The budget is ``dense_steps`` steps of the dense model; every other variant gets
``round(budget / its nominal training FLOPs per step)`` steps, so cheaper variants train on more tokens.
FLOPs actually spent (from the realized routing) are logged too.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from mode import _checks
from mode.data import Corpus, file_corpus, min_file_bytes, stdlib_corpus
from mode.flops import forward_flops_per_token, train_flops_per_token
from mode.model import LMConfig, alternate
from mode.model.causal_eval import causal_eval
from mode.train import Trainer, TrainConfig


@dataclass
class ComparePreset:
    model: LMConfig
    train: TrainConfig
    dense_steps: int
    max_corpus_bytes: int | None


def preset(quick: bool) -> ComparePreset:
    if quick:  # a few minutes on 2 CPU cores
        model = LMConfig(seq_len=128, d_model=64, n_heads=2, d_hidden=256, layers=("dense",) * 4, num_experts=4)
        train = TrainConfig(batch_size=8, lr=3e-3, warmup_steps=20, eval_every=50, eval_batches=4, log_every=10)
        return ComparePreset(model, train, dense_steps=150, max_corpus_bytes=3_000_000)
    model = LMConfig(seq_len=256, d_model=128, n_heads=4, d_hidden=512, layers=("dense",) * 6, num_experts=8)
    train = TrainConfig(batch_size=8, lr=3e-3, warmup_steps=50, eval_every=100, eval_batches=16, log_every=10)
    return ComparePreset(model, train, dense_steps=1200, max_corpus_bytes=None)


def variants(base: LMConfig, causal: str = "predictor") -> dict[str, LMConfig]:
    """The six models, all of the same width and depth. Learned MoD routers also train the causal
    method ``causal`` so they can sample (random routing has nothing to predict)."""
    n = base.n_layers
    return {
        "dense": replace(base, layers=("dense",) * n),
        "mod": replace(base, layers=alternate(n, "dense", "mod"), causal=causal),
        "mod_random": replace(base, layers=alternate(n, "dense", "mod_random"), causal="none"),
        "moe": replace(base, layers=("moe",) * n),
        "staged_mode": replace(base, layers=alternate(n, "moe", "staged"), causal=causal),
        "integrated_mode": replace(base, layers=("integrated",) * n, num_noop=base.num_experts),
    }


def _routing_summary(history: list[dict]) -> dict:
    last = [r for r in history if "routing" in r]
    return last[-1]["routing"] if last else {}


def run_compare(out_dir: str | Path, quick: bool = False, data: str | None = None, seed: int = 0,
                dense_steps: int | None = None, only: list[str] | None = None, progress: bool = True,
                causal: str = "predictor") -> dict:
    p = preset(quick)
    base = p.model
    models = variants(base, causal)
    if dense_steps is not None:
        _checks.check_int("dense_steps", dense_steps)
    unknown = [name for name in only or () if name not in models]
    if unknown:  # a typo must not silently train nothing
        raise ValueError(f"only={only!r}: unknown variant {unknown[0]!r}; must be among {', '.join(models)}")
    steps_dense = p.dense_steps if dense_steps is None else dense_steps  # 0 is an error, not "the default"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    corpus: Corpus = (file_corpus(data, min_file_bytes(base.seq_len)) if data
                      else stdlib_corpus(max_bytes=p.max_corpus_bytes))
    tokens_per_step = p.train.batch_size * base.seq_len
    budget = steps_dense * train_flops_per_token(models["dense"]) * tokens_per_step
    dense_fwd = forward_flops_per_token(models["dense"])
    results = {}
    for name, cfg in models.items():
        if only and name not in only:
            continue
        steps = max(1, round(budget / (train_flops_per_token(cfg) * tokens_per_step)))
        tcfg = replace(p.train, steps=steps, seed=seed, warmup_steps=min(p.train.warmup_steps, steps // 5))
        trainer = Trainer(cfg, tcfg, corpus, out / name, name=name, progress=progress)
        t0 = time.perf_counter()
        history = trainer.run()
        wall = time.perf_counter() - t0
        vals = [r for r in history if "val_loss" in r]
        results[name] = {
            "layers": list(cfg.layers), "steps": steps, "params": trainer.model.num_params(),
            "val_loss": vals[-1]["val_loss"], "train_flops": trainer.flops, "tokens": trainer.tokens,
            "fwd_flops_per_token": forward_flops_per_token(cfg), "wall_s": wall,
            "tok_s": trainer.tokens / trainer.wall, "curve": [(r["flops"], r["val_loss"]) for r in vals],
            "routing": _routing_summary(history),
            "causal": causal_eval(trainer.model, trainer.val_batches) if cfg.causal != "none" else None,
        }
    for r in results.values():
        if "dense" in results:
            r["loss_ratio"] = r["val_loss"] / results["dense"]["val_loss"]
        r["flop_ratio"] = r["fwd_flops_per_token"] / dense_fwd
    report = {"config": {"quick": quick, "seed": seed, "dense_steps": steps_dense, "budget_flops": budget,
                         "corpus": corpus.source, "model": asdict(base), "train": asdict(p.train)},
              "machine": {"torch": torch.__version__, "threads": torch.get_num_threads(),
                          "platform": platform.platform()},
              "results": results}
    (out / "compare.json").write_text(json.dumps(report, indent=2))
    (out / "compare.md").write_text(markdown_table(results) + "\n")
    print(format_table(results))
    plot_curves(results, out / "val_loss_vs_flops.png")
    print(f"\nwrote {out / 'compare.json'} and {out / 'val_loss_vs_flops.png'}")
    return report


def format_table(results: dict) -> str:
    head = (f"{'variant':<16}{'val loss':>9}{'vs dense':>9}{'fwd FLOP/tok':>14}{'vs dense':>9}{'params':>10}"
            f"{'steps':>7}{'wall s':>8}{'tok/s':>8}{'causal acc':>11}{'routed':>8}{'AR gap':>8}"
            f"{'max/mean':>9}{'dropped':>8}{'no-op':>7}{'blocks/tok':>11}")
    lines = [head, "-" * len(head)]
    for name, r in results.items():
        lines.append(f"{name:<16}{r['val_loss']:>9.4f}{r.get('loss_ratio', float('nan')):>9.4f}"
                     f"{r['fwd_flops_per_token']:>14.3e}{r['flop_ratio']:>9.3f}{r['params']:>10,}"
                     f"{r['steps']:>7}{r['wall_s']:>8.1f}{r['tok_s']:>8,.0f}" + _causal_cells(r.get("causal"))
                     + _routing_cells(r.get("routing")))
    return "\n".join(lines)


def _causal_cells(c: dict | None) -> str:
    if not c:
        return f"{'-':>11}{'-':>8}{'-':>8}"
    return f"{c['causal_accuracy']:>11.1%}{c['routed_fraction']:>8.1%}{c['ar_gap']:>+8.2%}"


def _routing_cells(routing: dict | None) -> str:
    """Load balance and compute from the last logged "routing" record (training batches; docs/reports.md)."""
    o = (routing or {}).get("overall", {})

    def cell(key: str, width: int, fmt: str) -> str:
        v = o.get(key)
        return f"{'-':>{width}}" if v is None else f"{v:>{width}{fmt}}"

    return cell("max_mean", 9, ".2f") + cell("dropped_frac", 8, ".1%") + cell("noop_share", 7, ".1%") \
        + cell("blocks_per_token", 11, ".2f")


def markdown_table(results: dict) -> str:
    """The comparison as a Markdown table (written as compare.md, pasted into docs)."""
    head = ("| variant | val loss | vs dense | fwd FLOP/token | vs dense | params | steps | tokens | causal acc "
            "| routed | AR gap | max/mean load | dropped | no-op | blocks/token |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, r in results.items():
        c, o = r.get("causal") or {}, (r.get("routing") or {}).get("overall", {})

        def fmt(v, spec: str) -> str:
            return "–" if v is None else format(v, spec)

        lines.append(
            f"| {name} | {r['val_loss']:.4f} | {fmt(r.get('loss_ratio'), '.4f')} | {r['fwd_flops_per_token']:.3e} "
            f"| {r['flop_ratio']:.3f} | {r['params']:,} | {r['steps']} | {r['tokens']:,} "
            f"| {fmt(c.get('causal_accuracy'), '.1%')} | {fmt(c.get('routed_fraction'), '.1%')} "
            f"| {fmt(c.get('ar_gap'), '+.2%')} | {fmt(o.get('max_mean'), '.2f')} | {fmt(o.get('dropped_frac'), '.1%')} "
            f"| {fmt(o.get('noop_share'), '.1%')} | {fmt(o.get('blocks_per_token'), '.2f')} |")
    return "\n".join(lines)


def plot_curves(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in results.items():
        xs, ys = zip(*r["curve"])
        ax.plot(xs, ys, marker="o", ms=3, label=name)
    ax.set_xlabel("training FLOPs")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_title("Validation loss at equal training FLOPs")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

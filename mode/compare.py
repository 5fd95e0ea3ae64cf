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


def extra_variants(base: LMConfig, causal: str = "predictor") -> dict[str, LMConfig]:
    """Variants trained only when named in ``only`` (not part of the default six): staged and integrated
    MoDE paired at matching per-token FLOPs, each pair sending the same nominal share of tokens to work.

    ``integrated_mode_matched``: integrated MoDE with 7 no-op experts per real expert, so that under
    balanced routing 1/8 of the tokens reach an MLP expert, as 1/8 of the tokens pass staged MoDE's
    capacity (per-token FLOPs 0.60 of dense at the default preset, staged MoDE's are 0.58).
    ``staged_mode_matched``: staged MoDE at capacity 0.5, the share of tokens that the default integrated
    MoDE (as many no-ops as experts) sends to a real expert (0.74 of dense per token; integrated 0.76).
    """
    n = base.n_layers
    return {
        "integrated_mode_matched": replace(base, layers=("integrated",) * n, num_noop=7 * base.num_experts),
        "staged_mode_matched": replace(base, layers=alternate(n, "moe", "staged"), capacity=0.5, causal=causal),
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
    extras = extra_variants(base, causal)
    if dense_steps is not None:
        _checks.check_int("dense_steps", dense_steps)
    unknown = [name for name in only or () if name not in models and name not in extras]
    if unknown:  # a typo must not silently train nothing
        raise ValueError(f"only={only!r}: unknown variant {unknown[0]!r}; must be among "
                         f"{', '.join([*models, *extras])}")
    models.update({name: cfg for name, cfg in extras.items() if name in (only or ())})
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


# One spec for both tables: (key, where it lives, text header, text width, format, Markdown header).
# A None width leaves the column out of the terminal table, a None Markdown header out of compare.md.
_COLUMNS = (
    ("val_loss", "result", "val loss", 9, ".4f", "val loss"),
    ("loss_ratio", "result", "vs dense", 9, ".4f", "vs dense"),
    ("fwd_flops_per_token", "result", "fwd FLOP/tok", 14, ".3e", "fwd FLOP/token"),
    ("flop_ratio", "result", "vs dense", 9, ".3f", "vs dense"),
    ("params", "result", "params", 10, ",", "params"),
    ("steps", "result", "steps", 7, "", "steps"),
    ("tokens", "result", None, None, ",", "tokens"),
    ("wall_s", "result", "wall s", 8, ".1f", None),
    ("tok_s", "result", "tok/s", 8, ",.0f", None),
    ("causal_accuracy", "causal", "causal acc", 11, ".1%", "causal acc"),
    ("routed_fraction", "causal", "routed", 8, ".1%", "routed"),
    ("ar_gap", "causal", "AR gap", 8, "+.2%", "AR gap"),
    # load balance and compute from the last logged "routing" record (training batches; docs/reports.md)
    ("max_mean", "routing", "max/mean", 9, ".2f", "max/mean load"),
    ("dropped_frac", "routing", "dropped", 8, ".1%", "dropped"),
    ("noop_share", "routing", "no-op", 7, ".1%", "no-op"),
    ("blocks_per_token", "routing", "blocks/tok", 11, ".2f", "blocks/token"),
)


def _cell(r: dict, key: str, where: str, fmt: str, missing: str) -> str:
    source = {"result": r, "causal": r.get("causal") or {},
              "routing": (r.get("routing") or {}).get("overall", {})}[where]
    v = source.get(key)
    return missing if v is None else format(v, fmt)


def format_table(results: dict) -> str:
    """The comparison as the fixed-width table `mode compare` prints."""
    cols = [c for c in _COLUMNS if c[3] is not None]
    first = max([16, *(len(name) + 1 for name in results)])
    head = f"{'variant':<{first}}" + "".join(f"{c[2]:>{c[3]}}" for c in cols)
    lines = [head, "-" * len(head)]
    for name, r in results.items():
        lines.append(f"{name:<{first}}" + "".join(_cell(r, key, where, fmt, "-").rjust(width)
                                               for key, where, _, width, fmt, _ in cols))
    return "\n".join(lines)


def markdown_table(results: dict) -> str:
    """The comparison as a Markdown table (written as compare.md, pasted into docs)."""
    cols = [c for c in _COLUMNS if c[5] is not None]
    lines = ["| variant | " + " | ".join(c[5] for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, r in results.items():
        cells = [_cell(r, key, where, fmt, "–") for key, where, _, _, fmt, _ in cols]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
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

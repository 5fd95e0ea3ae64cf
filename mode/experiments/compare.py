"""`mode compare`: dense, MoD, random-routing MoD, MoE, staged and integrated MoDE trained to the same
training-FLOP budget on the same data, then compared on held-out loss.

The budget is ``dense_steps`` steps of the dense model; every other variant gets
``round(budget / its nominal training FLOPs per step)`` steps, so cheaper variants train on more tokens.
FLOPs actually spent (from the realized routing) are logged too.

The headline baseline is the **best of a small dense sweep** at the same budget: dense models of the same
width at several depths (``dense_sweep``; the shallower ones train on more tokens). A dense model of MoD's
own size is usually too big for a small budget, and beating it says little (issue 11; docs/compare.md).
``mode isoflop`` sweeps width and depth together over several budgets.

``seeds`` trains every variant once per seed; a seed fixes the data order, so runs of one seed are paired.
The loss is measured on ``eval_windows`` fixed validation windows (the same for every run), and each
claimed difference (``CLAIMS``) gets a paired t interval over the seeds (``mode.experiments.stats_ci``).

A run survives being killed (docs/checkpoints.md): ``OUT/compare_run.json`` records the arguments, each
variant checkpoints every ``ckpt_every_s`` seconds and writes ``OUT/<variant>/result.json`` when done. A
rerun with the same arguments skips the finished variants, resumes the interrupted one from its last
checkpoint and ends with the same numbers as an uninterrupted run; other arguments are refused (name the
difference) unless ``fresh``.
"""

from __future__ import annotations

import io
import json
import platform
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import cast

import torch

from mode import _checks
from mode.experiments import run_record, stats_ci, sweep
from mode.measure.flops import forward_flops_per_token, train_flops_per_token
from mode.model import LMConfig, alternate
from mode.model.causal_eval import causal_eval
from mode.routing.mod_topk import GATES
from mode.train import TrainConfig, checkpoint
from mode.train.data import PACKAGES, Corpus
from mode.train.progress import format_duration, log_line

# The differences the comparison claims, as (variant a, variant b): a - b < 0 means a is better. "dense"
# stands for the best dense model (the best of the dense sweep here, the isoFLOP-optimal size in isoflop).
CLAIMS = {
    "MoD - best dense": ("mod", "dense"),
    "learned - random routing": ("mod", "mod_random"),
    "staged - integrated MoDE": ("staged_mode", "integrated_mode"),
    "MoE - best dense": ("moe", "dense"),
}
# Claims about the variants trained only on request (``extra_variants``), made when both sides were trained.
EXTRA_CLAIMS = {"budget-held integrated MoDE - MoD": ("integrated_budget", "mod")}


@dataclass
class ComparePreset:
    model: LMConfig
    train: TrainConfig
    dense_steps: int
    max_corpus_bytes: int | None
    eval_windows: int  # fixed validation windows for the final loss, the same for every variant and seed
    eval_batch_size: int = 32
    data: str | None = None  # the corpus when none is given: None the built-in one, "packages" (mode.train.packages)


PRESETS = ("quick", "default", "gpu")


def preset(quick: bool | str) -> ComparePreset:
    """``"quick"`` (or True), ``"default"`` (or False), ``"gpu"``."""
    name = ("quick" if quick else "default") if isinstance(quick, bool) else quick
    _checks.check_choice("preset", name, PRESETS)
    if name == "gpu":
        # One H100/H200: the isoflop gpu preset's largest size (L4_d256) and its batch of 256 x 512 bytes, on
        # the packages corpus. Budget: 200 steps of the 4-layer dense model = 6.7e14 training FLOPs; the dense
        # sweep's 1-layer model trains 765 steps (1.0e8 tokens, 0.46 epochs of 219 MB), MoD 355, staged
        # MoDE 354. Expected (isoflop_plan.estimate_step_s, eager bf16): 80 s a seed for the 9 runs, plus
        # the evaluations every 50 steps; about 3 minutes for --seeds 2.
        model = LMConfig(seq_len=512, d_model=256, n_heads=4, d_hidden=1024, layers=("dense",) * 4, num_experts=8)
        train = TrainConfig(batch_size=256, lr=2e-3, warmup_steps=50, eval_every=50, eval_batches=4, log_every=25)
        return ComparePreset(
            model, train, dense_steps=200, max_corpus_bytes=None, eval_windows=1024, eval_batch_size=128, data=PACKAGES
        )
    if name == "quick":  # a few minutes on 2 CPU cores
        model = LMConfig(seq_len=128, d_model=64, n_heads=2, d_hidden=256, layers=("dense",) * 4, num_experts=4)
        train = TrainConfig(batch_size=8, lr=3e-3, warmup_steps=20, eval_every=50, eval_batches=4, log_every=10)
        return ComparePreset(model, train, dense_steps=150, max_corpus_bytes=3_000_000, eval_windows=512)
    model = LMConfig(seq_len=256, d_model=128, n_heads=4, d_hidden=512, layers=("dense",) * 6, num_experts=8)
    train = TrainConfig(batch_size=8, lr=3e-3, warmup_steps=50, eval_every=100, eval_batches=16, log_every=10)
    return ComparePreset(model, train, dense_steps=1200, max_corpus_bytes=None, eval_windows=1024)


ROUTED_BLOCKS = ("every_other", "all_but_first")


@dataclass(frozen=True)
class MoDRecipe:
    """How the MoD variants (``mod``, ``mod_random``, ``staged_mode``) route.

    ``routed``: "every_other" routes blocks 1, 3, 5, ... (the paper's placement); "all_but_first" routes
    every block after the first. ``capacity``: the share of each sequence a routed block processes.
    ``gate``: what multiplies a routed block's delta (``MoDRouterConfig.gate``; "raw" is the paper's ``r``).
    docs/isoflop.md has the ablations behind the default."""

    routed: str = "every_other"
    capacity: float = 0.125
    gate: str = "raw"

    def __post_init__(self) -> None:
        _checks.check_choice("routed", self.routed, ROUTED_BLOCKS)
        _checks.check_fraction("capacity", self.capacity)
        _checks.check_choice("gate", self.gate, GATES)

    def layers(self, n_layers: int, dense: str, routed: str) -> tuple[str, ...]:
        if self.routed == "every_other":
            return alternate(n_layers, dense, routed)
        return (dense,) + (routed,) * (n_layers - 1)


DEFAULT_RECIPE = MoDRecipe()


def variants(base: LMConfig, causal: str = "predictor", recipe: MoDRecipe = DEFAULT_RECIPE) -> dict[str, LMConfig]:
    """The six models, all of the same width and depth. Learned MoD routers also train the causal
    method ``causal`` so they can sample (random routing has nothing to predict)."""
    n = base.n_layers
    routed = replace(base, capacity=recipe.capacity, mod_gate=recipe.gate)
    return {
        "dense": replace(base, layers=("dense",) * n),
        "mod": replace(routed, layers=recipe.layers(n, "dense", "mod"), causal=causal),
        "mod_random": replace(routed, layers=recipe.layers(n, "dense", "mod_random"), causal="none"),
        "moe": replace(base, layers=("moe",) * n),
        "staged_mode": replace(routed, layers=recipe.layers(n, "moe", "staged"), causal=causal),
        "integrated_mode": replace(base, layers=("integrated",) * n, num_noop=base.num_experts),
    }


EXTRA_VARIANTS = ("integrated_mode_matched", "staged_mode_matched", "integrated_budget")


def extra_variants(base: LMConfig, causal: str = "predictor", names=EXTRA_VARIANTS) -> dict[str, LMConfig]:
    """Variants trained only when named in ``only`` (not part of the default six): staged and integrated
    MoDE paired at matching per-token FLOPs, each pair sending the same nominal share of tokens to work.

    ``integrated_mode_matched``: integrated MoDE with 7 no-op experts per real expert, so that under
    balanced routing 1/8 of the tokens reach an MLP expert, as 1/8 of the tokens pass staged MoDE's
    capacity (per-token FLOPs 0.60 of dense at the default preset, staged MoDE's are 0.58).
    ``staged_mode_matched``: staged MoDE at capacity 0.5, the share of tokens that the default integrated
    MoDE (as many no-ops as experts) sends to a real expert (0.74 of dense per token; integrated 0.76).
    ``names``: build only these (``integrated_budget`` cannot be built where attention alone costs more than
    MoD's FLOPs per token).
    """
    n = base.n_layers
    build = {
        "integrated_mode_matched": lambda: replace(base, layers=("integrated",) * n, num_noop=7 * base.num_experts),
        "staged_mode_matched": lambda: replace(base, layers=alternate(n, "moe", "staged"), capacity=0.5, causal=causal),
        "integrated_budget": lambda: budget_held_integrated(base, variants(base, causal)["mod"]),
    }
    return {name: build[name]() for name in EXTRA_VARIANTS if name in names}  # only those asked for


# The budget's bias must outpace the router's own learning, which pulls tokens towards real experts: at 1e-3
# (DeepSeek's rate) the quick preset's no-op share ends at 0.80 for a target of 0.85; at 5e-3 it holds 0.858
# over the second half of training and 0.857 on held-out text (docs/routing.md)
BUDGET_BIAS_RATE = 5e-3


def budget_held_integrated(base: LMConfig, match: LMConfig) -> LMConfig:
    """Integrated MoDE whose compute budget is held by the router itself (docs/routing.md): every layer
    integrated, as many no-op slots as experts, aux-loss-free bias balancing that holds the share of choices
    on no-op slots at the target that gives ``match``'s nominal forward FLOPs per token (MoD at 12.5% on
    every other block: 0.85 to 0.89 of the choices skip the MLP at the presets, attention runs for all).
    Each token decides alone, so sampling needs no predictor."""

    def at(target: float) -> LMConfig:
        return replace(
            base,
            layers=("integrated",) * base.n_layers,
            num_noop=base.num_experts,
            balance_coef=0.0,
            router_options={
                **base.router_options,
                "bias_balance": True,
                "noop_target": target,
                "bias_rate": BUDGET_BIAS_RATE,
            },
        )

    lo, hi = forward_flops_per_token(at(0.25)), forward_flops_per_token(at(0.75))  # linear in the target
    target = 0.25 + 0.5 * (lo - forward_flops_per_token(match)) / (lo - hi)
    if not 0 < target < 1:
        raise ValueError(
            f"integrated_budget: matching {forward_flops_per_token(match):.4g} FLOPs per token needs "
            f"noop_target={target:.3f}, outside (0, 1): attention alone costs more or the MLPs too little"
        )
    return at(round(target, 6))


def dense_depths(n_layers: int) -> list[int]:
    """The depths of the dense sweep: about 1/3, 1/2, 2/3 of ``n_layers`` and ``n_layers`` itself."""
    return sorted({max(1, round(n_layers * f)) for f in (1 / 3, 1 / 2, 2 / 3, 1)})


def dense_sweep(base: LMConfig) -> dict[str, LMConfig]:
    """Dense models of ``base``'s width at the depths ``dense_depths`` other than its own (``dense_<n>l``),
    trained to the same budget; with ``dense`` they form the sweep whose best is the headline baseline."""
    return {
        f"dense_{n}l": replace(base, layers=("dense",) * n) for n in dense_depths(base.n_layers) if n != base.n_layers
    }


def _routing_summary(history: list[dict]) -> dict:
    last = [r for r in history if "routing" in r]
    return last[-1]["routing"] if last else {}


RUN_FILE = "compare_run.json"  # the arguments of the run in OUT: a rerun resumes only with the same ones
RESULT_FILE = "result.json"  # OUT/<variant>/result.json: written when the variant is done
DEFAULT_CKPT_EVERY_S = 300.0
_OUTPUTS = ("compare.json", "compare.md", "val_loss_vs_flops.png")


def run_dir(out: Path, name: str, seed: int, n_seeds: int) -> Path:
    """OUT/<variant> for a one-seed run, OUT/<variant>/seed<s> for each seed of a several-seed run."""
    return out / name if n_seeds == 1 else out / name / f"seed{seed}"


def run_compare(
    out_dir: str | Path,
    quick: bool | str = False,
    data: str | None = None,
    seed: int = 0,
    dense_steps: int | None = None,
    only: list[str] | None = None,
    progress: bool = True,
    causal: str = "predictor",
    ckpt_every_s: float = DEFAULT_CKPT_EVERY_S,
    fresh: bool = False,
    seeds: int = 1,
    recipe: MoDRecipe = DEFAULT_RECIPE,
    device: str | None = None,
    bf16: bool = False,
) -> dict:
    """Train the variants at equal training FLOPs into ``out_dir`` and return the report (also written as
    ``compare.json``). ``quick``: True/False for the quick/default preset, or a preset name (``PRESETS``).
    ``data``: None for the preset's corpus (the built-in one; the gpu preset's is ``"packages"``),
    ``"packages"``, or a UTF-8 text file. ``seeds``: train each variant on seeds ``seed .. seed + seeds - 1``.
    Checkpoints
    every ``ckpt_every_s`` seconds (0: only when a variant ends); resumes a killed run of the same
    arguments found in ``out_dir``, or starts over when ``fresh``. ``device``: where to train (default the
    CPU). ``bf16``: train under bfloat16 autocast (weights, gradients and AdamW stay float32; routers run in
    float32); the final loss is measured in float32 either way, so float32 and bf16 runs compare directly."""
    p = preset(quick)
    data = p.data if data is None else data
    base = p.model
    models = variants(base, causal, recipe)
    sweep_models = dense_sweep(base)
    extras = extra_variants(base, causal)
    if dense_steps is not None:
        _checks.check_int("dense_steps", dense_steps)
    _checks.check_int("seeds", seeds)
    _checks.check_bool("bf16", bf16)
    if ckpt_every_s != 0:
        _checks.check_positive("ckpt_every_s", ckpt_every_s)
    known = {**sweep_models, **models, **extras}
    unknown = [name for name in only or () if name not in known]
    if unknown:  # a typo must not silently train nothing
        raise ValueError(f"only={only!r}: unknown variant {unknown[0]!r}; must be among {', '.join(known)}")
    # order: the dense sweep (shallow to deep, ending with "dense"), the other variants, requested extras
    ordered = {**sweep_models, **models, **{n: c for n, c in extras.items() if n in (only or ())}}
    selected = {name: cfg for name, cfg in ordered.items() if not only or name in only}
    seed_list = list(range(seed, seed + seeds))
    steps_dense = p.dense_steps if dense_steps is None else dense_steps  # 0 is an error, not "the default"
    out = checkpoint.prepare_dir(out_dir, "out")  # bad output folders fail before any training
    corpus: Corpus = sweep.load_corpus(data, base.seq_len, p.max_corpus_bytes)
    val = sweep.validation_windows(corpus, base.seq_len, p.eval_windows, p.eval_batch_size)
    identity = {
        "quick": quick,
        "data": sweep.data_identity(data),
        "seed": seed,
        "seeds": seeds,
        "dense_steps": steps_dense,
        "only": sorted(only) if only else None,
        "causal": causal,
        "mod_recipe": asdict(recipe),
        "corpus": run_record.fingerprint(corpus),
        "model": asdict(base),
        "train": p.train.identity(),
        "eval_windows": p.eval_windows,
    }
    if bf16:  # only when set: run records written before the option existed stay resumable
        identity["bf16"] = True
    if device is not None:
        identity["device"] = str(device)
    stale = [out / f for f in _OUTPUTS]
    for name in known:
        for d in [out / name, *(out / name).glob("seed*")]:
            stale += [d / "ckpt.pt", d / RESULT_FILE, d / "log.jsonl"]
    resume = run_record.start_or_resume(out, identity, fresh, run_file=RUN_FILE, kind="compare", stale=stale)
    for name in selected:  # after the check above: a refused --out gets no new folders either
        for s in seed_list:
            checkpoint.prepare_dir(run_dir(out, name, s, seeds), "out")
    tokens_per_step = p.train.batch_size * base.seq_len
    budget = steps_dense * train_flops_per_token(models["dense"]) * tokens_per_step
    dense_fwd = forward_flops_per_token(models["dense"])
    runs: dict[str, dict[int, dict]] = {}
    n_runs, k = len(selected) * len(seed_list), 0
    for s in seed_list:  # seed by seed: a run stopped early has whole seeds done
        for name, cfg in selected.items():
            d = run_dir(out, name, s, seeds)
            label = name if seeds == 1 else f"{name} seed {s}"
            k += 1
            result_path = d / RESULT_FILE
            if resume and result_path.is_file():
                runs.setdefault(name, {})[s] = run_record.read_result(result_path, ("val_loss", "curve"))
                log_line(f"[{k}/{n_runs}] {label}: done in an earlier run, results from {result_path}")
                continue
            steps = sweep.steps_for_budget(cfg, budget, p.train.batch_size, name)
            layers = f"{cfg.n_layers} layer{'s' * (cfg.n_layers != 1)}"
            log_line(
                f"[{k}/{n_runs}] {label}: {layers}, {steps} steps of {tokens_per_step:,} tokens (budget "
                f"{budget:.3g} training FLOPs)"
            )
            tcfg = sweep.run_train_config(p.train, steps, s, ckpt_every_s or None)
            trainer = sweep.train(cfg, tcfg, corpus, d, label, progress, resume, log=log_line, device=device, bf16=bf16)
            history = trainer.history
            vals = [r for r in history if "val_loss" in r]
            losses = sweep.window_losses(trainer.model, val)
            result = {
                "layers": list(cfg.layers),
                "seed": s,
                "steps": steps,
                "params": trainer.model.num_params(),
                "val_loss": stats_ci.mean(losses),
                "train_flops": trainer.flops,
                "tokens": trainer.tokens,
                "fwd_flops_per_token": forward_flops_per_token(cfg),
                "wall_s": trainer.elapsed,
                "tok_s": trainer.tokens / trainer.wall,
                "curve": [(r["flops"], r["val_loss"]) for r in vals],
                "routing": _routing_summary(history),
                "causal": causal_eval(trainer.model, trainer.val_batches) if cfg.causal != "none" else None,
                "window_losses": losses,
            }
            checkpoint.atomic_write_text(result_path, json.dumps(result, indent=2))
            runs.setdefault(name, {})[s] = result
            log_line(
                f"[{k}/{n_runs}] {label}: val loss {result['val_loss']:.4f} (final evaluation, "
                f"{p.eval_windows} held-out windows); {format_duration(trainer.elapsed)} in training"
            )
    results = {name: _combine(runs[name], seed_list) for name in selected}
    baseline = _baseline(results, base.n_layers)
    for r in results.values():
        if baseline is not None:
            r["loss_ratio"] = r["val_loss"] / results[baseline["variant"]]["val_loss"]
        if "dense" in results:
            r["loss_ratio_same_size"] = r["val_loss"] / results["dense"]["val_loss"]
        r["flop_ratio"] = r["fwd_flops_per_token"] / dense_fwd
    claims, diff_se = _claims(runs, baseline, seed_list)
    validation = {
        "windows": p.eval_windows,
        "seq_len": base.seq_len,
        "loss_se_max": max(r["eval_se"] for r in results.values()),
        "difference_se_max": max(diff_se, default=None),
    }
    report = {
        "config": {
            "quick": quick,
            "seed": seed,
            "seeds": seed_list,
            "dense_steps": steps_dense,
            "mod_recipe": asdict(recipe),
            "bf16": bf16,
            "device": str(device or "cpu"),
            "budget_flops": budget,
            "corpus": corpus.source,
            "model": asdict(base),
            "train": asdict(p.train),
            "eval_windows": p.eval_windows,
        },
        "machine": {"torch": torch.__version__, "threads": torch.get_num_threads(), "platform": platform.platform()},
        "baseline": baseline,
        "claims": claims,
        "validation": validation,
        "results": results,
    }
    train_bytes = run_record.fingerprint(corpus)["train_bytes"]
    epochs = {name: r["tokens"] / train_bytes for name, r in results.items()}  # byte-level: a token is a byte
    report["data"] = {**sweep.data_record(corpus), "epochs": epochs}
    print(
        f"data: {corpus.source}; the most epochs of its {train_bytes:,} training bytes a run read: "
        f"{max(epochs.values()):.3f} ({max(epochs, key=epochs.__getitem__)})"
    )
    # each file appears whole or not at all: a crash here never leaves a half report that looks complete
    checkpoint.atomic_write_text(out / "compare.json", json.dumps(report, indent=2))
    checkpoint.atomic_write_text(
        out / "compare.md", "\n\n".join([markdown_table(results), legend(report, "md"), notes(report, "md")]) + "\n"
    )
    print(format_table(results))
    print(legend(report, "text"))
    print(notes(report, "text"))
    plot_curves(report, out / "val_loss_vs_flops.png")
    print(f"\nwrote {out / 'compare.json'} and {out / 'val_loss_vs_flops.png'}")
    return report


def _combine(by_seed: dict[int, dict], seeds: list[int]) -> dict:
    """One row of the report: the first seed's run, with the loss replaced by its mean over the seeds."""
    first = by_seed[seeds[0]]
    losses = [by_seed[s]["val_loss"] for s in seeds]
    row = {k: v for k, v in first.items() if k not in ("window_losses", "seed")}
    row.update(
        val_loss=stats_ci.mean(losses),
        val_loss_std=stats_ci.std(losses),
        val_loss_seeds={str(s): v for s, v in zip(seeds, losses)},
        eval_se=stats_ci.window_noise(first["window_losses"]),
    )
    return row


_DENSE_NAME = re.compile(r"dense(_[0-9]+l)?")  # "dense" and the dense sweep's "dense_<n>l"


def _baseline(results: dict, n_layers: int) -> dict | None:
    """The best dense model trained (lowest mean loss), and what it was chosen from."""
    dense = {name: r["val_loss"] for name, r in results.items() if _DENSE_NAME.fullmatch(name)}
    if not dense:
        return None
    best = min(dense, key=dense.__getitem__)
    depths = sorted(len(results[n]["layers"]) for n in dense)
    rule = (
        f"best of {len(dense)} dense depths ({', '.join(map(str, depths))} layers) of the same width at the "
        "same training FLOPs"
    )
    if len(dense) < 3:
        rule += " (fewer than 3: not a sweep; run without --only for the full one)"
    return {
        "variant": best,
        "layers": len(results[best]["layers"]),
        "val_loss": dense[best],
        "rule": rule,
        "candidates": dense,
    }


def _claims(runs: dict, baseline: dict | None, seeds: list[int]) -> tuple[dict, list[float]]:
    """The paired differences of ``CLAIMS`` (``dense`` read as the baseline) and their validation noise."""
    claims, noise = {}, []
    for label, (a, b) in {**CLAIMS, **EXTRA_CLAIMS}.items():
        if b == "dense":
            b = baseline["variant"] if baseline else b
        if a not in runs or b not in runs:
            continue
        ra, rb = [runs[a][s] for s in seeds], [runs[b][s] for s in seeds]
        d = stats_ci.paired_difference([r["val_loss"] for r in ra], [r["val_loss"] for r in rb])
        # a float: every preset evaluates hundreds of windows (None only for fewer than two)
        se = max(cast(float, stats_ci.window_noise(x["window_losses"], y["window_losses"])) for x, y in zip(ra, rb))
        noise.append(se)
        claims[label] = {"a": a, "b": b, **d, "eval_se": se}
    return claims, noise


def notes(report: dict, style: str) -> str:
    """What the headline column is measured against, the claimed differences, and the validation noise."""
    lines = []
    b = report["baseline"]
    if b is not None:
        lines.append(f"best dense model: {b['variant']} ({b['rule']}; val loss {b['val_loss']:.4f})")
    n = len(report["config"]["seeds"])
    if report["claims"]:
        lines.append(
            f"differences, paired over {n} seed(s): mean ± std [95% t interval], * = significant "
            "(the interval excludes 0); eval SE = the validation set's own noise in that difference"
        )
        for label, c in report["claims"].items():
            text = (
                f"{label} ({c['a']} - {c['b']}): {stats_ci.format_difference(c)} ({c['rel']:+.2%}), "
                f"eval SE {c['eval_se']:.4f}"
            )
            lines.append(f"- {text}" if style == "md" else f"  {text}")
    v = report["validation"]
    noise = (
        f"validation: {v['windows']} fixed windows of {v['seq_len']} bytes; noise of one loss <= {v['loss_se_max']:.4f}"
    )
    if v["difference_se_max"] is not None:
        noise += f", of a paired difference <= {v['difference_se_max']:.4f}"
    if style == "text":
        return "\n".join([*lines, noise])
    parts = ["\n".join(lines[:1]), "\n".join(lines[1:]), noise]  # Markdown: paragraphs, the list in one
    return "\n\n".join(part for part in parts if part)


@dataclass(frozen=True)
class _Column:
    """A column of both tables: ``key`` read from ``where`` ("result": the row, "causal": its ``causal``
    report, "routing": the ``overall`` numbers of its last routing record), its terminal header and width
    (no width: not in the terminal table), format, Markdown header (None: not in compare.md) and what it
    means (the legend printed under the table; None: self-explaining)."""

    key: str
    where: str
    text: str | None
    width: int | None
    fmt: str
    md: str | None
    meaning: str | None = None


# {windows}, {seq_len}, {val_windows}, {dense}, {best}, {capacity}: filled in by ``legend`` from the report
_COLUMNS = (
    _Column(
        "val_loss",
        "result",
        "val loss",
        9,
        ".4f",
        "val loss",
        "held-out loss in nats/byte (lower is better): mean over {windows} fixed windows of {seq_len} bytes",
    ),
    _Column("val_loss_std", "result", "± std", 8, ".4f", "± std (seeds)", "std of val loss over the seeds"),
    _Column(
        "loss_ratio",
        "result",
        "loss/best dense",
        16,
        ".4f",
        "loss / best dense",
        "val loss / the best dense model's ({best}); below 1 beats it",
    ),
    _Column(
        "loss_ratio_same_size",
        "result",
        "loss/same-size dense",
        21,
        ".4f",
        "loss / same-size dense",
        "val loss / dense's (the same depth: {dense})",
    ),
    _Column(
        "fwd_flops_per_token",
        "result",
        "fwd FLOP/tok",
        14,
        ".3e",
        "fwd FLOP/token",
        "nominal forward FLOPs per token (balanced routing; a training step costs 3x)",
    ),
    _Column(
        "flop_ratio",
        "result",
        "FLOP/tok / dense",
        17,
        ".3f",
        "fwd FLOP/token / same-size dense",
        "forward FLOPs per token / dense's ({dense})",
    ),
    _Column("params", "result", "params", 10, ",", "params"),
    _Column("steps", "result", "steps", 7, "", "steps", "training steps the FLOP budget buys (cheaper steps: more)"),
    _Column("tokens", "result", None, None, ",", "tokens"),
    _Column("wall_s", "result", "wall s", 8, ".1f", None, "seconds of training, periodic evaluation included"),
    _Column("tok_s", "result", "tok/s", 8, ",.0f", None, "training bytes per second of training steps"),
    _Column(
        "causal_accuracy",
        "causal",
        "causal acc",
        11,
        ".1%",
        "causal acc",
        "learned MoD: how often the causal decision (what sampling uses) agrees with top-k routing",
    ),
    _Column(
        "routed_fraction",
        "causal",
        "routed",
        8,
        ".1%",
        "routed",
        "share of tokens the causal decision routes through a routed block; top-k routes exactly "
        "{capacity:.1%}: lower when the decision misses more top-k tokens than it adds",
    ),
    _Column(
        "ar_gap",
        "causal",
        "AR gap",
        8,
        "+.2%",
        "AR gap",
        "loss with causal routing / loss with top-k - 1: what routing as in sampling costs",
    ),
    # load balance and compute from the last logged "routing" record (training batches; docs/reports.md)
    _Column(
        "max_mean",
        "routing",
        "max/mean",
        9,
        ".2f",
        "max/mean load",
        "MoE routers: the busiest expert's load / the mean load (1 = balanced), mean over the routers",
    ),
    _Column(
        "dropped_frac", "routing", "dropped", 8, ".1%", "dropped", "share of expert assignments dropped by capacity"
    ),
    _Column(
        "noop_share",
        "routing",
        "no-op",
        7,
        ".1%",
        "no-op",
        "share of router choices that went to a no-op expert (the MLP skipped)",
    ),
    _Column(
        "blocks_per_token",
        "routing",
        "blocks/tok",
        11,
        ".2f",
        "blocks/token",
        "blocks a token passes through on average (a skipped MoD block does not count)",
    ),
)
# said once under the legend instead of in every line it concerns
_LEGEND_NOTES = (
    "the val loss is measured once, after training (the plot's end points; its lines are the smaller periodic "
    "evaluation)",
    "causal acc, routed, AR gap: means over the routed blocks (unrouted blocks are not averaged in), on the "
    "{val_windows} windows of the periodic evaluation",
    "max/mean load, dropped, no-op, blocks per token: the last window of training statistics (docs/reports.md)",
)


def _cell(r: dict, col: _Column, missing: str) -> str:
    source = {"result": r, "causal": r.get("causal") or {}, "routing": (r.get("routing") or {}).get("overall", {})}[
        col.where
    ]
    v = source.get(col.key)
    return missing if v is None else format(v, col.fmt)


def format_table(results: dict) -> str:
    """The comparison as the fixed-width table `mode compare` prints."""
    cols = [c for c in _COLUMNS if c.width is not None]
    # two spaces at least between titles; a column with a width has a terminal title
    widths = [max(cast(int, c.width), len(cast(str, c.text)) + 2) for c in cols]
    first = max([16, *(len(name) + 1 for name in results)])
    head = f"{'variant':<{first}}" + "".join(f"{c.text:>{w}}" for c, w in zip(cols, widths))
    lines = [head, "-" * len(head)]
    for name, r in results.items():
        lines.append(f"{name:<{first}}" + "".join(_cell(r, c, "-").rjust(w) for c, w in zip(cols, widths)))
    return "\n".join(lines)


def markdown_table(results: dict) -> str:
    """The comparison as a Markdown table (written as compare.md, pasted into docs)."""
    cols = [c for c in _COLUMNS if c.md is not None]
    titles = [c.md for c in _COLUMNS if c.md is not None]
    lines = ["| variant | " + " | ".join(titles) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, r in results.items():
        cells = [_cell(r, c, "–") for c in cols]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def legend(report: dict, style: str) -> str:
    """What each column of the table means (``style`` "text": under the printed table, "md": a list under
    compare.md's), with the run's numbers filled in: windows, the dense models, the MoD capacity."""
    cfg, b = report["config"], report["baseline"]
    values = {
        "windows": cfg["eval_windows"],
        "seq_len": cfg["model"]["seq_len"],
        "val_windows": cfg["train"]["eval_batches"] * cfg["train"]["batch_size"],
        "dense": f"{len(cfg['model']['layers'])} layers",
        "best": "none trained" if b is None else b["variant"],
        "capacity": cfg["mod_recipe"]["capacity"],
    }
    shown = [c for c in _COLUMNS if c.meaning and (c.width if style == "text" else c.md) is not None]
    said_once = [n.format(**values) for n in _LEGEND_NOTES]
    if style == "md":
        return "\n".join(
            [f"- *{c.md}*: {cast(str, c.meaning).format(**values)}" for c in shown] + [f"- {n}" for n in said_once]
        )
    width = max(len(cast(str, c.text)) for c in shown)  # text style: shown columns have a width, so a title
    return "\n".join(
        ["columns:"]
        + [f"  {c.text:<{width}}  {cast(str, c.meaning).format(**values)}" for c in shown]  # shown: has one
        + [f"  {n}" for n in said_once]
    )


def _plot_label(name: str, r: dict) -> str:
    """A curve's name in the plot: "dense" says its depth (the dense sweep's names already do)."""
    return f"dense ({len(r['layers'])} layers)" if name == "dense" else name


def plot_curves(report: dict, path: Path) -> None:
    """Validation loss against training FLOPs: each variant's periodic evaluations (the trainer's small
    validation set) as a line, and its final evaluation on the fixed windows -- the table's val loss (the
    mean over seeds; the line is the first seed's) -- as a star at its end. The legend sits outside the axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    results, cfg = report["results"], report["config"]
    periodic = cfg["train"]["eval_batches"] * cfg["train"]["batch_size"]
    fig, ax = plt.subplots(figsize=(9.5, 4.8))
    for name, r in results.items():
        xs, ys = zip(*r["curve"])
        (line,) = ax.plot(xs, ys, marker="o", ms=3, lw=1.2, label=f"{_plot_label(name, r)}: {r['val_loss']:.4f}")
        ax.plot(
            [r["train_flops"]],
            [r["val_loss"]],
            marker="*",
            ms=11,
            color=line.get_color(),
            markeredgecolor="black",
            markeredgewidth=0.6,
            ls="none",
            zorder=3,
        )
    ax.set_xlabel("training FLOPs")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_title("Validation loss at equal training FLOPs")
    ax.grid(alpha=0.3)
    seeds = cfg["seeds"]
    periodic_label = f"periodic evaluation,\n{periodic} windows" + (f" (seed {seeds[0]})" if len(seeds) > 1 else "")
    final_label = f"final evaluation,\n{cfg['eval_windows']} windows = table" + (
        f"\n(mean of {len(seeds)} seeds)" if len(seeds) > 1 else ""
    )
    marks = [
        Line2D([], [], color="black", marker="o", ms=3, lw=1.2, label=periodic_label),
        Line2D(
            [],
            [],
            color="white",
            marker="*",
            ms=11,
            markeredgecolor="black",
            markeredgewidth=0.6,
            ls="none",
            label=final_label,
        ),
    ]
    gap = Line2D([], [], ls="none", label=" ")
    handles, _ = ax.get_legend_handles_labels()
    ax.legend(
        handles=[*handles, gap, *marks],
        loc="upper left",
        bbox_to_anchor=(1.02, 1.0),
        fontsize=8,
        borderaxespad=0,
        title="variant: val loss (table)",
        title_fontsize=8,
    )
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    checkpoint.atomic_write(path, buf.getvalue())

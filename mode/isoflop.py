"""`mode isoflop`: isoFLOP curves of dense, MoD, random-routing MoD, MoE, staged and integrated MoDE.

The paper's protocol (Raposo et al. 2024, fig. 4; Chinchilla's "approach 2"): at each training-FLOP budget,
each variant is trained at several model sizes, every size for as many steps as the budget buys; the
size with the lowest held-out loss is the variant's isoFLOP-optimal model at that budget, and a parabola
of loss against log10(parameters) through the budget's points estimates where the true optimum lies.
Variants are then compared optimum against optimum: best MoD against the best dense model, not against
a dense model of MoD's own size.

Sizes scale depth and width together along a fixed aspect ratio (``d_model = aspect * n_layers``; heads of
``head_dim``, MLP hidden ``mlp_ratio * d_model``). Every run of a seed sees the same batches in the same
order (the sampler is seeded by the seed), and every run is evaluated on the same fixed validation
windows, so differences between variants are paired (``mode.stats_ci``).

A run lives in ``OUT/runs/<budget>/<variant>/<size>/seed<s>/`` (``log.jsonl``, ``ckpt.pt``, and
``result.json`` once done). ``OUT/isoflop_run.json`` records what every run depends on (data, preset,
causal method); a rerun with the same record skips finished runs and resumes an interrupted one from its
checkpoint. Seeds, budgets and variants may change between reruns: runs already done are reused.
"""

from __future__ import annotations

import io
import json
import math
import platform
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field, replace
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import torch

from mode import _checks, checkpoint, run_record, stats_ci, sweep
from mode.compare import CLAIMS, DEFAULT_RECIPE, MoDRecipe, variants
from mode.data import Corpus, file_corpus, min_file_bytes, stdlib_corpus
from mode.model import LMConfig
from mode.train import TrainConfig

RUN_FILE = "isoflop_run.json"
RESULT_FILE = "result.json"
OUTPUTS = ("isoflop.json", "isoflop.md", "loss_vs_params.png", "best_loss_vs_budget.png")
DEFAULT_CKPT_EVERY_S = 300.0


@dataclass(frozen=True)
class Size:
    n_layers: int
    d_model: int

    @property
    def name(self) -> str:
        return f"L{self.n_layers}_d{self.d_model}"


@dataclass
class IsoflopPreset:
    """A sweep: the sizes (one aspect ratio), the budgets, and what every run shares."""
    base: LMConfig  # vocabulary, sequence, experts, the MoD recipe; width and depth come from each size
    train: TrainConfig  # batch, learning rate and schedule; steps and seed are set per run
    budgets: tuple[float, ...]  # training FLOPs per run
    aspect: int = 16  # d_model = aspect * n_layers
    n_layers: tuple[int, ...] = (2, 3, 4, 6)
    head_dim: int = 32
    mlp_ratio: int = 4
    eval_windows: int = 512  # fixed validation windows, the same for every run
    eval_batch_size: int = 32
    max_corpus_bytes: int | None = None
    sizes: tuple[Size, ...] = field(init=False)

    def __post_init__(self) -> None:
        _checks.check_int("aspect", self.aspect)
        for n in self.n_layers:
            _checks.check_int("n_layers", n, min_value=2)  # MoD routes every other block: 1 layer routes none
        if len(set(self.n_layers)) != len(self.n_layers):
            raise ValueError(f"n_layers={self.n_layers}: sizes must be distinct")
        for b in self.budgets:
            _checks.check_positive("budget", b)
        _checks.check_int("eval_windows", self.eval_windows)
        _checks.check_int("eval_batch_size", self.eval_batch_size)
        self.sizes = tuple(Size(n, self.aspect * n) for n in sorted(self.n_layers))


PRESETS = ("quick", "default", "gpu")


def preset(quick: bool | str) -> IsoflopPreset:
    """``"quick"`` (or True), ``"default"`` (or False), ``"gpu"``; docs/isoflop.md has their sizes and times."""
    name = ("quick" if quick else "default") if isinstance(quick, bool) else quick
    _checks.check_choice("preset", name, PRESETS)
    if name == "gpu":  # 1.4M to 50M parameters; not run yet (no GPU so far): docs/isoflop.md
        base = LMConfig(seq_len=512, d_model=256, n_heads=4, d_hidden=1024, num_experts=8)
        train = TrainConfig(batch_size=64, lr=1e-3, warmup_steps=200, eval_every=10**9, eval_batches=1,
                            log_every=50)
        return IsoflopPreset(base, train, budgets=(1e15, 3e15, 1e16), aspect=64, n_layers=(3, 4, 6, 8, 10),
                             head_dim=64, eval_windows=2048, eval_batch_size=64)
    if name == "quick":  # 10k to 180k parameters
        base = LMConfig(seq_len=128, d_model=64, n_heads=2, d_hidden=256, num_experts=4)
        train = TrainConfig(batch_size=8, lr=3e-3, warmup_steps=20, eval_every=10**9, eval_batches=1,
                            log_every=10)
        return IsoflopPreset(base, train, budgets=(2e10, 6e10, 2e11), aspect=8, n_layers=(2, 3, 4, 6),
                             head_dim=16, eval_windows=512, max_corpus_bytes=3_000_000)
    # default: 10k to 410k parameters, 5x the quick budgets
    base = LMConfig(seq_len=256, d_model=128, n_heads=4, d_hidden=512, num_experts=8)
    train = TrainConfig(batch_size=8, lr=3e-3, warmup_steps=50, eval_every=10**9, eval_batches=1, log_every=10)
    return IsoflopPreset(base, train, budgets=(1e11, 3e11, 1e12), aspect=8, n_layers=(2, 3, 4, 6, 8),
                         head_dim=16, eval_windows=1024)


def size_config(p: IsoflopPreset, size: Size) -> LMConfig:
    """The dense model of ``size``: ``p.base`` at that width and depth."""
    d = size.d_model
    return replace(p.base, d_model=d, n_heads=max(1, d // p.head_dim), d_hidden=p.mlp_ratio * d,
                   layers=("dense",) * size.n_layers, predictor_hidden=max(16, d // 2))


def budget_name(budget: float) -> str:
    return f"{budget:.3g}".replace("+", "")


@dataclass
class RunSpec:
    budget: float
    variant: str
    size: Size
    seed: int
    cfg: LMConfig
    steps: int
    dir: Path

    @property
    def label(self) -> str:
        return f"{budget_name(self.budget)} {self.variant} {self.size.name} seed {self.seed}"


def plan(p: IsoflopPreset, out: Path, seeds: list[int], causal: str = "predictor",
         only: list[str] | None = None, recipe: MoDRecipe = DEFAULT_RECIPE) -> list[RunSpec]:
    """Every run of the sweep, seed by seed (a sweep stopped early has whole seeds done)."""
    specs = []
    for seed in seeds:
        for budget in p.budgets:
            for size in p.sizes:
                for name, cfg in variants(size_config(p, size), causal, recipe).items():
                    if only and name not in only:
                        continue
                    steps = sweep.steps_for_budget(cfg, budget, p.train.batch_size, f"{name} {size.name}")
                    specs.append(RunSpec(budget, name, size, seed, cfg, steps,
                                         out / "runs" / budget_name(budget) / name / size.name / f"seed{seed}"))
    order = {name: i for i, name in enumerate(variants(size_config(p, p.sizes[0]), causal))}
    return sorted(specs, key=lambda s: (seeds.index(s.seed), p.budgets.index(s.budget), order[s.variant],
                                        p.sizes.index(s.size)))


# -- one run (also in a worker process) -------------------------------------------------------------------

_WORKER: dict = {}  # per worker process: the corpus and validation windows, sent once by the initializer


def _init_worker(corpus: Corpus, val, threads: int | None) -> None:
    if threads is not None:
        torch.set_num_threads(threads)
    _WORKER.update(corpus=corpus, val=val)


def _run_in_worker(spec: RunSpec, p: IsoflopPreset, ckpt_every_s: float | None, resume: bool,
                   device: str | None, bf16: bool) -> dict:
    return run_one(spec, p, _WORKER["corpus"], _WORKER["val"], ckpt_every_s, resume, progress=False,
                   device=device, bf16=bf16)


def run_one(spec: RunSpec, p: IsoflopPreset, corpus: Corpus, val, ckpt_every_s: float | None, resume: bool,
            progress: bool, log=print, device: str | None = None, bf16: bool = False) -> dict:
    """Train ``spec`` (resuming its checkpoint when ``resume``), evaluate it on ``val``, write its result."""
    tcfg = sweep.run_train_config(p.train, spec.steps, spec.seed, ckpt_every_s)
    trainer = sweep.train(spec.cfg, tcfg, corpus, spec.dir, spec.label, progress, resume, log, device, bf16)
    losses = sweep.window_losses(trainer.model, val)
    cost = sweep.step_flops(spec.cfg, p.train.batch_size)
    result = {
        "budget": spec.budget, "variant": spec.variant, "size": spec.size.name, "n_layers": spec.size.n_layers,
        "d_model": spec.size.d_model, "seed": spec.seed, "layers": list(spec.cfg.layers), "steps": spec.steps,
        "params": trainer.model.num_params(), "params_non_embedding": trainer.model.num_params(True),
        "nominal_flops": spec.steps * cost, "step_flops": cost, "train_flops": trainer.flops,
        "tokens": trainer.tokens, "val_loss": stats_ci.mean(losses), "window_losses": losses,
        "wall_s": trainer.elapsed,
    }
    checkpoint.atomic_write_text(spec.dir / RESULT_FILE, json.dumps(result))
    return result


def _check_result(spec: RunSpec, result: dict) -> dict:
    for key, want in (("steps", spec.steps), ("layers", list(spec.cfg.layers)), ("seed", spec.seed)):
        if result.get(key) != want:
            raise ValueError(f"{spec.dir / RESULT_FILE}: {key}={result.get(key)!r} there, {want!r} for this run; "
                             "pass --fresh to start over")
    return result


# -- the sweep --------------------------------------------------------------------------------------------


def run_isoflop(out_dir: str | Path, quick: bool | str = False, data: str | None = None, seeds: int = 1,
                first_seed: int = 0, budgets: list[float] | None = None, only: list[str] | None = None,
                causal: str = "predictor", jobs: int = 1, threads: int | None = None, progress: bool = True,
                ckpt_every_s: float = DEFAULT_CKPT_EVERY_S, fresh: bool = False,
                recipe: MoDRecipe = DEFAULT_RECIPE, device: str | None = None, bf16: bool = False,
                preset_override: IsoflopPreset | None = None) -> dict:
    """Run (or resume) the sweep into ``out_dir``; write and return the report (``isoflop.json``).

    ``quick``: True/False for the quick/default preset, or a preset name (``PRESETS``). ``device``/``bf16``:
    where and how each run trains (None: the trainer's default, the CPU). ``jobs`` > 1 trains that many runs
    at once in worker processes of ``threads`` threads each (CPU)."""
    name = ("quick" if quick else "default") if isinstance(quick, bool) else quick
    p = preset_override or preset(name)
    _checks.check_int("seeds", seeds)
    _checks.check_int("first_seed", first_seed, min_value=0)
    _checks.check_int("jobs", jobs)
    if ckpt_every_s != 0:
        _checks.check_positive("ckpt_every_s", ckpt_every_s)
    if budgets:
        p = replace(p, budgets=tuple(float(b) for b in budgets))
    names = list(variants(size_config(p, p.sizes[0]), causal))
    unknown = [n for n in only or () if n not in names]
    if unknown:
        raise ValueError(f"only={only!r}: unknown variant {unknown[0]!r}; must be among {', '.join(names)}")
    if device is not None and str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: torch.cuda.is_available() is False here (torch {torch.__version__}); "
                         "install a CUDA build of torch, or leave --device out to train on the CPU")
    seed_list = list(range(first_seed, first_seed + seeds))
    out = checkpoint.prepare_dir(out_dir, "out")
    specs = plan(p, out, seed_list, causal, only, recipe)  # budgets below one step of a size fail here, before training
    corpus: Corpus = (file_corpus(data, min_file_bytes(p.base.seq_len)) if data
                      else stdlib_corpus(max_bytes=p.max_corpus_bytes))
    val = sweep.validation_windows(corpus, p.base.seq_len, p.eval_windows, p.eval_batch_size)
    identity = {"preset": name if preset_override is None else "custom",
                "data": None if data is None else str(Path(data).resolve()), "causal": causal,
                "bf16": bf16,
                "mod_recipe": asdict(recipe),
                "corpus": run_record.fingerprint(corpus), "model": asdict(p.base),
                "train": {k: v for k, v in asdict(p.train).items() if k != "ckpt_every_s"},
                "sweep": {"aspect": p.aspect, "head_dim": p.head_dim, "mlp_ratio": p.mlp_ratio,
                          "eval_windows": p.eval_windows, "eval_batch_size": p.eval_batch_size}}
    stale = [out / f for f in OUTPUTS]
    if (out / "runs").is_dir():
        stale += [*(out / "runs").glob("**/ckpt.pt"), *(out / "runs").glob(f"**/{RESULT_FILE}")]
    resume = run_record.start_or_resume(out, identity, fresh, run_file=RUN_FILE, kind="isoflop", stale=stale)
    ckpt_s = ckpt_every_s or None

    t0 = time.perf_counter()
    results: dict[Path, dict] = {}
    todo = []
    for spec in specs:
        path = spec.dir / RESULT_FILE
        if resume and path.is_file():
            results[spec.dir] = _check_result(spec, run_record.read_result(path, ("val_loss", "window_losses")))
        else:
            checkpoint.prepare_dir(spec.dir, "out")
            todo.append(spec)
    if results:
        print(f"{len(results)} of {len(specs)} runs done in an earlier run: reusing their results", flush=True)
    n_done = len(results)

    def report_done(spec: RunSpec, r: dict) -> None:
        nonlocal n_done
        n_done += 1
        print(f"[{n_done}/{len(specs)}] {spec.label}: val loss {r['val_loss']:.4f}  ({spec.steps} steps, "
              f"{r['params']:,} params, {r['wall_s']:.1f} s)", flush=True)

    if jobs == 1 or len(todo) <= 1:
        if threads is not None:
            torch.set_num_threads(threads)
        for spec in todo:
            results[spec.dir] = run_one(spec, p, corpus, val, ckpt_s, resume, progress, device=device, bf16=bf16)
            report_done(spec, results[spec.dir])
    else:
        # small models: one thread per process, several processes, beats several threads in one process
        with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn"), initializer=_init_worker,
                                 initargs=(corpus, val, threads or 1)) as pool:
            futures = {pool.submit(_run_in_worker, spec, p, ckpt_s, resume, device, bf16): spec for spec in todo}
            for fut in as_completed(futures):
                spec = futures[fut]
                results[spec.dir] = fut.result()
                report_done(spec, results[spec.dir])

    report = summarize(p, specs, results, seed_list, names if not only else [n for n in names if n in only])
    report["config"] = {"preset": identity["preset"], "seeds": seed_list, "budgets": list(p.budgets),
                        "sizes": [s.name for s in p.sizes], "aspect": p.aspect, "causal": causal,
                        "mod_recipe": asdict(recipe),
                        "corpus": corpus.source, "model": asdict(p.base), "train": asdict(p.train),
                        "eval": {"windows": p.eval_windows, "seq_len": p.base.seq_len}}
    report["machine"] = {"torch": torch.__version__, "threads": threads or torch.get_num_threads(), "jobs": jobs,
                         "device": device or "cpu", "bf16": bf16, "platform": platform.platform()}
    report["wall_s"] = time.perf_counter() - t0
    report["run_s"] = sum(r["wall_s"] for r in results.values())
    checkpoint.atomic_write_text(out / "isoflop.json", json.dumps(report, indent=2))
    checkpoint.atomic_write_text(out / "isoflop.md", markdown_report(report) + "\n")
    print()
    print(format_report(report))
    plot_loss_vs_params(report, out / "loss_vs_params.png")
    plot_best_vs_budget(report, out / "best_loss_vs_budget.png")
    print(f"\nwrote {out / 'isoflop.json'}, {out / 'isoflop.md'}, {out / 'loss_vs_params.png'} and "
          f"{out / 'best_loss_vs_budget.png'}")
    return report


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
        fit.update(params_opt=10 ** x, loss_opt=c - b * b / (4 * a),
                   interior=min(log_params) <= x <= max(log_params))
    return fit


def summarize(p: IsoflopPreset, specs: list[RunSpec], results: dict[Path, dict], seeds: list[int],
              names: list[str]) -> dict:
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
                runs = [by_key.get((budget, name, size, s)) for s in seeds]
                if any(r is None for r in runs):
                    continue
                losses = [r["val_loss"] for r in runs]
                sizes.append({
                    "size": size.name, "n_layers": size.n_layers, "d_model": size.d_model,
                    "params": runs[0]["params"], "params_non_embedding": runs[0]["params_non_embedding"],
                    "steps": runs[0]["steps"], "nominal_flops": runs[0]["nominal_flops"],
                    "train_flops": {str(s): r["train_flops"] for s, r in zip(seeds, runs)},
                    "loss": {str(s): v for s, v in zip(seeds, losses)},
                    "loss_mean": stats_ci.mean(losses), "loss_std": stats_ci.std(losses),
                })
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
        for label, (a, b) in CLAIMS.items():
            if a not in entry["variants"] or b not in entry["variants"]:
                continue
            ba, bb = entry["variants"][a]["best"], entry["variants"][b]["best"]
            runs_a = [by_key[(budget, a, _size(p, ba["size"]), s)] for s in seeds]
            runs_b = [by_key[(budget, b, _size(p, bb["size"]), s)] for s in seeds]
            d = stats_ci.paired_difference([r["val_loss"] for r in runs_a], [r["val_loss"] for r in runs_b])
            eval_se = max(stats_ci.window_noise(ra["window_losses"], rb["window_losses"])
                          for ra, rb in zip(runs_a, runs_b))
            noise_pair.append(eval_se)
            # a best size at the edge of the sizes tried is not an optimum: the true one may lie beyond it
            entry["claims"][label] = {"a": f"{a} {ba['size']}", "b": f"{b} {bb['size']}", **d, "eval_se": eval_se,
                                      "at_edge": [n for n, best in ((a, ba), (b, bb)) if best["at_edge"]]}
        budgets_out.append(entry)
    validation = {"windows": p.eval_windows, "seq_len": p.base.seq_len,
                  "loss_se_max": max(noise_single, default=None),
                  "difference_se_max": max(noise_pair, default=None)}
    return {"budgets": budgets_out, "validation": validation}


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
    text = (f"validation: {v['windows']} fixed windows of {v['seq_len']} bytes, the same for every run; "
            f"its noise (standard error over windows): one loss <= {v['loss_se_max']:.4f}")
    if v["difference_se_max"] is not None:
        text += f", a paired difference between two models <= {v['difference_se_max']:.4f}"
    return text


def _edge_text(claim: dict) -> str:
    edge = claim.get("at_edge") or []
    return f"  ! {', '.join(edge)} best at the edge of the sizes: not an optimum" if edge else ""


def format_report(report: dict) -> str:
    """The sweep as the terminal prints it: best size per budget and variant, then the claims."""
    seeds = report.get("config", {}).get("seeds", [])
    head = (f"{'budget':>8} {'variant':<16}{'best size':>10}{'params':>11}{'steps':>7}{'val loss':>20}"
            f"{'vs best dense':>14}{'fit: params at min':>20}")
    lines = [f"isoFLOP-optimal size per variant ({len(seeds)} seed(s); loss = mean ± std over seeds)", head,
             "-" * len(head)]
    for budget, name, v in _rows(report):
        b = v["best"]
        ratio = "-" if b["vs_best_dense"] is None else f"{b['vs_best_dense']:.4f}"
        edge = "*" if b["at_edge"] else " "
        lines.append(f"{budget:>8.2g} {name:<16}{b['size'] + edge:>10}{b['params']:>11,}{b['steps']:>7}"
                     f"{stats_ci.format_pm(b['loss_mean'], b['loss_std']):>20}{ratio:>14}{_fit_text(v['fit']):>20}")
    lines += ["(* best at the edge of the sizes tried)", "", "claims (best vs best, paired over seeds; "
              "mean ± std [95% t interval], * = interval excludes 0)"]
    for entry in report["budgets"]:
        for label, c in entry["claims"].items():
            lines.append(f"{entry['budget']:>8.2g} {label:<26}{stats_ci.format_difference(c):>44}"
                         f"  ({c['rel']:+.2%}; eval SE {c['eval_se']:.4f}){_edge_text(c)}")
    lines += ["", validation_note(report)]
    return "\n".join(lines)


def markdown_report(report: dict) -> str:
    """The same as Markdown tables (written as isoflop.md, pasted into docs)."""
    lines = ["| budget (FLOPs) | variant | best size | params | steps | val loss (mean ± std) | vs best dense | "
             "parabola: params at min | loss at min |", "|---" * 9 + "|"]
    for budget, name, v in _rows(report):
        b, fit = v["best"], v["fit"]
        ratio = "–" if b["vs_best_dense"] is None else f"{b['vs_best_dense']:.4f}"
        fit_loss = "–" if not fit or not fit["interior"] else f"{fit['loss_opt']:.4f}"  # no extrapolated losses
        lines.append(f"| {budget:.2g} | {name} | {b['size']}{' (edge)' if b['at_edge'] else ''} | {b['params']:,} | "
                     f"{b['steps']} | {stats_ci.format_pm(b['loss_mean'], b['loss_std'])} | {ratio} | "
                     f"{_fit_text(fit)} | {fit_loss} |")
    lines += ["", "| budget (FLOPs) | difference (best vs best) | models | mean ± std | 95% interval | significant | "
              "relative | eval SE | caveat |", "|---" * 9 + "|"]
    for entry in report["budgets"]:
        for label, c in entry["claims"].items():
            interval = "–" if c["low"] is None else f"[{c['low']:+.4f}, {c['high']:+.4f}]"
            sig = "–" if c["significant"] is None else ("**yes**" if c["significant"] else "no")
            lines.append(f"| {entry['budget']:.2g} | {label} | {c['a']} − {c['b']} | "
                         f"{stats_ci.format_pm(c['mean'], c['std'], '+.4f')} | {interval} | {sig} | {c['rel']:+.2%} | "
                         f"{c['eval_se']:.4f} |{_edge_text(c)[3:] or ' '} |")
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
                ax.plot(10 ** lx, fit["a"] * lx ** 2 + fit["b"] * lx + fit["c"], ls="--", lw=0.8, color=c)
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
        line = ax.errorbar([b for b, _ in pts], [x["loss_mean"] for _, x in pts],
                           yerr=[x["loss_std"] or 0.0 for _, x in pts], marker="o", ms=4, capsize=2, label=name)
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

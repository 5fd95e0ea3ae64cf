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
windows, so differences between variants are paired (``mode.experiments.stats_ci``).

A run lives in ``OUT/runs/<budget>/<variant>/<size>/seed<s>/`` (``log.jsonl``, ``ckpt.pt``, and
``result.json`` once done). ``OUT/isoflop_run.json`` records what every run depends on (data, preset,
causal method); a rerun with the same record skips finished runs and resumes an interrupted one from its
checkpoint. Seeds, budgets and variants may change between reruns: runs already done are reused.

The grid of runs is ``mode.experiments.isoflop_plan``; the fits, tables and plots ``isoflop_report``.
"""

from __future__ import annotations

import json
import platform
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, replace
from multiprocessing import get_context
from pathlib import Path

import torch

from mode import _checks
from mode.experiments import run_record, stats_ci, sweep
from mode.experiments.compare import DEFAULT_RECIPE, MoDRecipe
from mode.experiments.isoflop_plan import (
    IsoflopPreset,
    RunSpec,
    plan,
    preset,
    run_cost,
    size_config,
    sweep_variants,
    variant_names,
)
from mode.experiments.isoflop_report import (
    format_report,
    markdown_report,
    plot_best_vs_budget,
    plot_loss_vs_params,
    summarize,
)
from mode.train import checkpoint
from mode.train.data import Corpus
from mode.train.progress import log_line

RUN_FILE = "isoflop_run.json"
RESULT_FILE = "result.json"
OUTPUTS = ("isoflop.json", "isoflop.md", "loss_vs_params.png", "best_loss_vs_budget.png")
DEFAULT_CKPT_EVERY_S = 300.0


# -- one run (also in a worker process) -------------------------------------------------------------------

_WORKER: dict = {}  # per worker process: the corpus and validation windows, sent once by the initializer


def _init_worker(corpus: Corpus, val, threads: int | None) -> None:
    if threads is not None:
        torch.set_num_threads(threads)
    _WORKER.update(corpus=corpus, val=val)


def _run_in_worker(
    spec: RunSpec, p: IsoflopPreset, ckpt_every_s: float | None, resume: bool, device: str | None, bf16: bool
) -> dict:
    return run_one(
        spec, p, _WORKER["corpus"], _WORKER["val"], ckpt_every_s, resume, progress=False, device=device, bf16=bf16
    )


def run_one(
    spec: RunSpec,
    p: IsoflopPreset,
    corpus: Corpus,
    val,
    ckpt_every_s: float | None,
    resume: bool,
    progress: bool,
    log=log_line,
    device: str | None = None,
    bf16: bool = False,
) -> dict:
    """Train ``spec`` (resuming its checkpoint when ``resume``), evaluate it on ``val``, write its result."""
    t_start = time.perf_counter()
    tcfg = sweep.run_train_config(p.train, spec.steps, spec.seed, ckpt_every_s)
    log(f"{spec.label}: {spec.size.n_layers} layers, d_model {spec.size.d_model}, {spec.steps} steps")
    trainer = sweep.train(spec.cfg, tcfg, corpus, spec.dir, spec.label, progress, resume, log, device, bf16)
    losses = sweep.window_losses(trainer.model, val)
    cost = sweep.step_flops(spec.cfg, p.train.batch_size)
    result = {
        "budget": spec.budget,
        "variant": spec.variant,
        "size": spec.size.name,
        "n_layers": spec.size.n_layers,
        "d_model": spec.size.d_model,
        "seed": spec.seed,
        "layers": list(spec.cfg.layers),
        "steps": spec.steps,
        "params": trainer.model.num_params(),
        "params_non_embedding": trainer.model.num_params(True),
        "nominal_flops": spec.steps * cost,
        "step_flops": cost,
        "train_flops": trainer.flops,
        "tokens": trainer.tokens,
        "val_loss": stats_ci.mean(losses),
        "window_losses": losses,
        "wall_s": trainer.elapsed,
        "total_s": time.perf_counter() - t_start,  # this process's: built, trained, saved and evaluated
    }
    checkpoint.atomic_write_text(spec.dir / RESULT_FILE, json.dumps(result))
    return result


def epochs_per_budget(p: IsoflopPreset, specs: list[RunSpec], costs: dict[Path, dict]) -> dict[float, float]:
    """Per budget, the most epochs of the training data that any of its runs reads (byte-level: a token is a
    byte): above 1 a run sees some text twice, and what it learns depends on the repetition."""
    return {
        b: max(costs[s.dir]["epochs"] for s in specs if s.budget == b)
        for b in p.budgets
        if any(s.budget == b for s in specs)
    }


def timing(specs: list[RunSpec], results: dict[Path, dict], costs: dict[Path, dict]) -> dict:
    """The planning estimate (``isoflop_plan.run_cost``: seconds on one H100/H200) beside what the runs took,
    run by run: ``total_s`` from the model's construction to its evaluation, ``wall_s`` the training loop's."""
    runs = [
        {
            "run": s.label,
            "steps": s.steps,
            "tokens": costs[s.dir]["tokens"],
            "epochs": costs[s.dir]["epochs"],
            "est_s": costs[s.dir]["est_s"],
            "wall_s": results[s.dir].get("wall_s"),
            "total_s": results[s.dir].get("total_s"),
        }
        for s in specs
    ]
    est = sum(r["est_s"] for r in runs)
    wall = sum(r["total_s"] if r["total_s"] is not None else (r["wall_s"] or 0.0) for r in runs)
    return {"estimated_s": est, "run_s": wall, "measured_over_estimated": wall / est if est else None, "runs": runs}


def _check_result(spec: RunSpec, result: dict) -> dict:
    for key, want in (("steps", spec.steps), ("layers", list(spec.cfg.layers)), ("seed", spec.seed)):
        if result.get(key) != want:
            raise ValueError(
                f"{spec.dir / RESULT_FILE}: {key}={result.get(key)!r} there, {want!r} for this run; "
                "pass --fresh to start over"
            )
    return result


# -- the sweep --------------------------------------------------------------------------------------------


def run_isoflop(
    out_dir: str | Path,
    quick: bool | str = False,
    data: str | None = None,
    seeds: int = 1,
    first_seed: int = 0,
    budgets: list[float] | None = None,
    only: list[str] | None = None,
    causal: str = "predictor",
    jobs: int = 1,
    threads: int | None = None,
    progress: bool = True,
    ckpt_every_s: float = DEFAULT_CKPT_EVERY_S,
    fresh: bool = False,
    recipe: MoDRecipe = DEFAULT_RECIPE,
    device: str | None = None,
    bf16: bool = False,
    preset_override: IsoflopPreset | None = None,
) -> dict:
    """Run (or resume) the sweep into ``out_dir``; write and return the report (``isoflop.json``).

    ``quick``: True/False for the quick/default preset, or a preset name (``PRESETS``). ``data``: None for the
    preset's corpus (the built-in one, or ``"packages"`` for the gpu preset), ``"packages"``, or a UTF-8 text
    file. ``only`` may also name the extra variants (``isoflop_plan.variant_names``). ``device``/``bf16``:
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
    known = variant_names(causal)
    unknown = [n for n in only or () if n not in known]
    if unknown:
        raise ValueError(f"only={only!r}: unknown variant {unknown[0]!r}; must be among {', '.join(known)}")
    names = list(sweep_variants(size_config(p, p.sizes[0]), causal, recipe, only))
    data = p.data if data is None else data
    if device is not None and str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(
            f"device={device!r}: torch.cuda.is_available() is False here (torch {torch.__version__}); "
            "install a CUDA build of torch, or leave --device out to train on the CPU"
        )
    seed_list = list(range(first_seed, first_seed + seeds))
    out = checkpoint.prepare_dir(out_dir, "out")
    specs = plan(p, out, seed_list, causal, only, recipe)  # budgets below one step of a size fail here, before training
    corpus: Corpus = sweep.load_corpus(data, p.base.seq_len, p.max_corpus_bytes)
    val = sweep.validation_windows(corpus, p.base.seq_len, p.eval_windows, p.eval_batch_size)
    identity = {
        "preset": name if preset_override is None else "custom",
        "data": sweep.data_identity(data),
        "causal": causal,
        "bf16": bf16,
        "mod_recipe": asdict(recipe),
        "corpus": run_record.fingerprint(corpus),
        "model": asdict(p.base),
        "train": p.train.identity(),
        "sweep": {
            "aspect": p.aspect,
            "head_dim": p.head_dim,
            "mlp_ratio": p.mlp_ratio,
            "eval_windows": p.eval_windows,
            "eval_batch_size": p.eval_batch_size,
        },
    }
    stale = [out / f for f in OUTPUTS]
    if (out / "runs").is_dir():
        stale += [
            *(out / "runs").glob("**/ckpt.pt"),
            *(out / "runs").glob(f"**/{RESULT_FILE}"),
            *(out / "runs").glob("**/log.jsonl"),
        ]
    resume = run_record.start_or_resume(out, identity, fresh, run_file=RUN_FILE, kind="isoflop", stale=stale)
    ckpt_s = ckpt_every_s or None
    train_bytes = run_record.fingerprint(corpus)["train_bytes"]
    costs = {spec.dir: run_cost(spec, p, train_bytes) for spec in specs}
    epochs = epochs_per_budget(p, specs, costs)
    print(
        f"data: {corpus.source}; epochs of its {train_bytes:,} training bytes that a run reads, most per budget: "
        + ", ".join(f"{b:.3g}: {e:.3f}" for b, e in epochs.items())
        + ("" if max(epochs.values()) <= 1 else "  (more than one: the data repeats)"),
        flush=True,
    )

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
        print(
            f"[{n_done}/{len(specs)}] {spec.label}: val loss {r['val_loss']:.4f}  ({spec.steps} steps, "
            f"{r['params']:,} params, {r['wall_s']:.1f} s)",
            flush=True,
        )

    if jobs == 1 or len(todo) <= 1:
        if threads is not None:
            torch.set_num_threads(threads)
        for spec in todo:
            results[spec.dir] = run_one(spec, p, corpus, val, ckpt_s, resume, progress, device=device, bf16=bf16)
            report_done(spec, results[spec.dir])
    else:
        # small models: one thread per process, several processes, beats several threads in one process
        with ProcessPoolExecutor(
            max_workers=jobs,
            mp_context=get_context("spawn"),
            initializer=_init_worker,
            initargs=(corpus, val, threads or 1),
        ) as pool:
            futures = {pool.submit(_run_in_worker, spec, p, ckpt_s, resume, device, bf16): spec for spec in todo}
            for fut in as_completed(futures):
                spec = futures[fut]
                results[spec.dir] = fut.result()
                report_done(spec, results[spec.dir])

    report = summarize(p, specs, results, seed_list, names if not only else [n for n in names if n in only])
    report["data"] = {**sweep.data_record(corpus), "epochs_per_budget": {f"{b:.6g}": e for b, e in epochs.items()}}
    report["estimate"] = timing(specs, results, costs)
    report["config"] = {
        "preset": identity["preset"],
        "seeds": seed_list,
        "budgets": list(p.budgets),
        "sizes": [s.name for s in p.sizes],
        "aspect": p.aspect,
        "causal": causal,
        "mod_recipe": asdict(recipe),
        "corpus": corpus.source,
        "model": asdict(p.base),
        "train": asdict(p.train),
        "eval": {"windows": p.eval_windows, "seq_len": p.base.seq_len},
    }
    report["machine"] = {
        "torch": torch.__version__,
        "threads": threads or torch.get_num_threads(),
        "jobs": jobs,
        "device": device or "cpu",
        "bf16": bf16,
        "platform": platform.platform(),
        "device_name": (
            torch.cuda.get_device_name(torch.device(device))
            if device is not None and str(device).startswith("cuda")
            else None
        ),
    }
    report["wall_s"] = time.perf_counter() - t0
    report["run_s"] = sum(r["wall_s"] for r in results.values())
    checkpoint.atomic_write_text(out / "isoflop.json", json.dumps(report, indent=2))
    checkpoint.atomic_write_text(out / "isoflop.md", markdown_report(report) + "\n")
    print()
    print(format_report(report))
    plot_loss_vs_params(report, out / "loss_vs_params.png")
    plot_best_vs_budget(report, out / "best_loss_vs_budget.png")
    print(
        f"\nwrote {out / 'isoflop.json'}, {out / 'isoflop.md'}, {out / 'loss_vs_params.png'} and "
        f"{out / 'best_loss_vs_budget.png'}"
    )
    return report

"""The isoflop stage: the paper's questions at the scale one GPU reaches in minutes (docs/isoflop.md). The
sweep runs in a process of its own (``gpu_suite.py --isoflop-sweep DIR``) that the stage can stop; its finished
runs are packed into an archive in OUT as it goes, so a later call can go on from them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.gpu.stage_base import ROOT, Ctx, kill_group

SUITE = Path(__file__).resolve().with_name("gpu_suite.py")  # runs the sweep: --isoflop-sweep DIR

ISOFLOP_DIR = "isoflop"  # OUT/isoflop: the report, the plots and the archive of every finished run


ISOFLOP_ARCHIVE = "isoflop_runs.tar.gz"


ISOFLOP_REPORT_FILES = ("isoflop.json", "isoflop.md", "loss_vs_params.png", "best_loss_vs_budget.png")


ISOFLOP_SEEDS = 2


ISOFLOP_RESERVE_S = 45.0  # of the stage's limit, kept for the report of a sweep that ran out of time


ISOFLOP_PACK_EVERY_S = 20.0  # the archive in OUT is rewritten this often while the sweep runs


CLAIM_KEYS = {
    "MoD - best dense": "mod_minus_dense",
    "learned - random routing": "learned_minus_random",
    "staged - integrated MoDE": "staged_minus_integrated",
    "MoE - best dense": "moe_minus_dense",
}


def isoflop_smoke_preset():
    """The gpu preset at toy sizes for the rehearsal on a CPU: the same variants, seeds, batch layout, corpus
    and code path, with budgets of a few steps."""
    from dataclasses import replace

    from mode.experiments.isoflop_plan import IsoflopPreset, preset

    gpu = preset("gpu")
    base = replace(gpu.base, seq_len=32, d_model=16, n_heads=1, d_hidden=64, num_experts=4)
    train = replace(gpu.train, batch_size=4, warmup_steps=2, log_every=5)
    return IsoflopPreset(
        base,
        train,
        budgets=(3e8,),
        aspect=16,
        n_layers=(2, 3),
        head_dim=16,
        eval_windows=32,
        eval_batch_size=16,
        data=gpu.data,
    )


def run_isoflop_sweep(out: Path, smoke: bool, seeds: int) -> int:
    """The sweep itself (``gpu_suite.py --isoflop-sweep DIR``, a process of its own that the stage can stop):
    ``mode isoflop --preset gpu --data packages --device cuda --bf16``, resuming what ``DIR`` holds."""
    import torch

    from mode.experiments.isoflop import run_isoflop

    device = "cuda" if torch.cuda.is_available() else None  # the rehearsal: the CPU, under bf16 autocast too
    run_isoflop(
        out,
        quick="gpu",
        preset_override=isoflop_smoke_preset() if smoke else None,
        seeds=seeds,
        data="packages",
        device=device,
        bf16=True,
        progress=False,
    )
    return 0


def _finished_files(sweep: Path) -> list[Path]:
    files = [sweep / "isoflop_run.json"] if (sweep / "isoflop_run.json").is_file() else []
    runs = sweep / "runs"
    if runs.is_dir():
        for result in sorted(runs.glob("**/result.json")):
            files.append(result)
            if (result.parent / "log.jsonl").is_file():
                files.append(result.parent / "log.jsonl")
    return files


def pack_isoflop(sweep: Path, archive: Path) -> int:
    """Write (atomically) ``archive``: the sweep's record and every finished run's result and log, paths
    relative to ``sweep``: what a later call needs to resume the sweep (checkpoints of unfinished runs are
    left out: too large to bring back). Returns the number of finished runs in it."""
    import tarfile

    files = _finished_files(sweep)
    archive.parent.mkdir(parents=True, exist_ok=True)
    tmp = archive.with_name(archive.name + ".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for f in files:
            tar.add(f, arcname=f.relative_to(sweep).as_posix())
    os.replace(tmp, archive)
    return sum(1 for f in files if f.name == "result.json")


def unpack_isoflop(source: Path, sweep: Path) -> int:
    """Put an earlier call's finished runs (``source``: its archive, or a folder holding it) into ``sweep``, so
    the sweep reuses them. Only the files ``pack_isoflop`` writes are taken. Returns the runs unpacked."""
    import tarfile

    archive = source / ISOFLOP_ARCHIVE if source.is_dir() else source
    if not archive.is_file():
        raise RuntimeError(f"--isoflop-from {str(source)!r}: no {ISOFLOP_ARCHIVE} there")
    sweep.mkdir(parents=True, exist_ok=True)
    n = 0
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar.getmembers():
            name = member.name
            ok = (
                member.isfile()
                and not name.startswith("/")
                and ".." not in Path(name).parts
                and (
                    name == "isoflop_run.json"
                    or (name.startswith("runs/") and name.endswith(("/result.json", "/log.jsonl")))
                )
            )
            if not ok:
                raise RuntimeError(f"--isoflop-from {str(archive)!r}: unexpected member {name!r}")
            tar.extract(member, sweep, filter="data")
            n += name.endswith("/result.json")
    return n


def complete_seeds(sweep: Path, smoke: bool, seeds: int) -> tuple[int, int, int]:
    """(leading seeds whose every run is finished, finished runs, runs of the whole grid)."""
    from mode.experiments.isoflop_plan import plan, preset

    p = isoflop_smoke_preset() if smoke else preset("gpu")
    specs = plan(p, sweep, list(range(seeds)))
    done = {s.dir for s in specs if (s.dir / "result.json").is_file()}
    full = 0
    while full < seeds and all(s.dir in done for s in specs if s.seed == full):
        full += 1
    return full, len(done), len(specs)


def isoflop_numbers(report: dict) -> dict:
    """The headline of an isoflop report: per budget each claim's mean difference, interval and edge flags."""
    numbers: dict = {
        "seeds": len(report["config"]["seeds"]),
        "budgets": report["config"]["budgets"],
        "run_s": report.get("run_s"),
        "estimated_s": report["estimate"]["estimated_s"],
        "measured_over_estimated": report["estimate"]["measured_over_estimated"],
        "corpus_files": report["data"].get("files"),
        "corpus_list_sha256": report["data"].get("list_sha256"),
        "train_bytes": report["data"]["train_bytes"],
        "epochs_max": max(report["data"]["epochs_per_budget"].values()),
    }
    for i, entry in enumerate(report["budgets"]):
        tag = "" if i == len(report["budgets"]) - 1 else f"_{entry['budget']:.0e}".replace("+", "")
        dense = entry["variants"].get("dense", {}).get("best")
        if dense:
            numbers[f"dense_best{tag}"] = dense["size"] + (" (edge)" if dense["at_edge"] else "")
        for label, c in entry["claims"].items():
            key = CLAIM_KEYS.get(label)
            if key:
                numbers[f"{key}{tag}"] = c["mean"]
                numbers[f"{key}_interval{tag}"] = None if c["low"] is None else [c["low"], c["high"]]
                numbers[f"{key}_significant{tag}"] = c["significant"]
                numbers[f"{key}_at_edge{tag}"] = c["at_edge"]
    return numbers


def stage_isoflop(ctx: Ctx) -> dict:
    opts = ctx.options or {}
    seeds = int(opts.get("isoflop_seeds") or ISOFLOP_SEEDS)
    keep = Path(opts["isoflop_out"]) if opts.get("isoflop_out") else ctx.work / "keep"
    sweep = ctx.work / "sweep"
    details: dict = {"sweep_dir": str(sweep), "kept_in": str(keep)}
    if opts.get("isoflop_from"):
        details["reused_from"] = opts["isoflop_from"]
        details["runs_reused"] = unpack_isoflop(Path(opts["isoflop_from"]), sweep)
        print(f"isoflop: {details['runs_reused']} finished runs from {opts['isoflop_from']}", flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("MODE_CACHE_DIR", str(ctx.work.parent / "cache"))  # the packages corpus, built once per --work
    cmd = [
        sys.executable,
        str(SUITE),
        "--isoflop-sweep",
        str(sweep),
        "--isoflop-seeds",
        str(seeds),
    ] + (["--smoke"] if ctx.smoke else [])
    t_start = time.monotonic()
    deadline = t_start + ctx.limit_s - ISOFLOP_RESERVE_S
    print("$ " + " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)  # its output: the stage's log
    packed, timed_out = -1, False
    while True:
        try:
            proc.wait(timeout=max(1.0, min(ISOFLOP_PACK_EVERY_S, deadline - time.monotonic())))
            break
        except subprocess.TimeoutExpired:
            if time.monotonic() >= deadline:
                timed_out = True
                kill_group(proc)
                break
            n = len(_finished_files(sweep))
            if n != packed:  # what is finished so far reaches OUT even if this call is cut off
                pack_isoflop(sweep, keep / ISOFLOP_ARCHIVE)
                packed = n
    details["sweep_s"] = time.monotonic() - t_start
    runs_packed = pack_isoflop(sweep, keep / ISOFLOP_ARCHIVE)
    full, done, total = complete_seeds(sweep, ctx.smoke, seeds)
    numbers: dict = {
        "complete": done == total and proc.returncode == 0,
        "runs_done": done,
        "runs_total": total,
        "seeds_complete": full,
    }
    details.update(timed_out=timed_out, returncode=proc.returncode, runs_in_archive=runs_packed)
    if not timed_out and proc.returncode != 0:  # an error, not the clock: the log holds its traceback
        raise RuntimeError(
            f"the sweep exited with {proc.returncode} ({done} of {total} runs finished, kept in "
            f"{keep / ISOFLOP_ARCHIVE})"
        )
    if not numbers["complete"]:
        details["next"] = (
            f"{done} of {total} runs finished: rerun the stage with --isoflop-from "
            f"{keep / ISOFLOP_ARCHIVE} (brought back and carried) to train the rest"
        )
        print(f"isoflop: {details['next']}", flush=True)
        if full == 0:  # cut off by the clock before a seed was whole: the archive is what there is
            return {"numbers": numbers, "details": details}
        # the report of the complete seeds: every run of them is finished, so this trains nothing
        rc = subprocess.run(
            cmd[:4] + ["--isoflop-seeds", str(full)] + (["--smoke"] if ctx.smoke else []),
            cwd=ROOT,
            env=env,
            timeout=max(10.0, ctx.limit_s - (time.monotonic() - t_start) - 5),
        ).returncode
        if rc != 0:
            raise RuntimeError(f"the report of the {full} complete seed(s) failed (exit {rc})")
    for name in ISOFLOP_REPORT_FILES:
        shutil.copy2(sweep / name, keep / name)
    report = json.loads((sweep / "isoflop.json").read_text())
    numbers.update(isoflop_numbers(report))
    details["claims"] = {f"{e['budget']:.3g}": e["claims"] for e in report["budgets"]}
    details["best"] = {
        f"{e['budget']:.3g}": {n: v["best"] for n, v in e["variants"].items()} for e in report["budgets"]
    }
    details["data"] = report["data"]
    details["estimate"] = {k: v for k, v in report["estimate"].items() if k != "runs"}
    details["machine"] = report["machine"]
    details["device_name"] = report["machine"].get("device_name")
    return {"numbers": numbers, "details": details}

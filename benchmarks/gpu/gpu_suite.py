"""The GPU suite: one command that turns a few minutes of GPU time into every GPU number ``mode`` lacks.

    PYTHONPATH=. python benchmarks/gpu/gpu_suite.py --out DIR [--budget-s 480]     # on the GPU (docs/gpu.md)
    PYTHONPATH=. python benchmarks/gpu/gpu_suite.py --smoke --out DIR               # the rehearsal, on a CPU (~2 min)

Stages, in this order, each in its own subprocess with its own time limit, under one overall deadline: env,
gtests, graphs, gdecode, gpumfu, tests, moe, mod, decode, train, nccl, profile (and isoflop, in a call of its
own). stages.py lists them with what each measures; the code of each is in stage_env, stage_tests,
stage_layers, stage_train, stage_nccl, stage_profile and stage_isoflop (stage_base: what they share). This
file is the runner: the command line, the stage subprocesses and their limits, the JSON; summary.py holds the
goals and the table printed at the end.

A stage that raises, exits non-zero or runs past its limit is recorded with its error and the last lines of
its output, and the next stage starts. After every stage ``DIR/gpu_suite.json`` is rewritten (atomically)
with the device, the versions and each stage's status, seconds and numbers; ``DIR/gpu_suite.log`` holds
every stage's output. At the end one short table is printed (only the last lines of a GPU run's output come
back) together with the goals (met / missed / not measured).

``--smoke`` runs every stage at its smallest on whatever device there is (the CPU here): it proves that the
command, the JSON and the table work before GPU time is spent on them. Its stage budgets are yardsticks, not
limits: a stage over its budget (a loaded or older CPU) is recorded ``ok`` with a ``slow`` note, and is killed
only past ``SMOKE_HANG_FACTOR`` times it; a rehearsal has no overall deadline unless ``--budget-s`` is given.
``--only``/``--skip`` pick stages
(a second run after a failure reruns only what failed). ``--inject STAGE=raise|hang`` makes a stage fail
on purpose (the isolation test).

Scratch files (training runs, benchmark JSONs) go to ``--work`` (default: a temporary folder), so that DIR
holds only the three files a GPU run can bring back.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere without installing
    sys.path.insert(0, str(ROOT))

from benchmarks.gpu.stage_base import Ctx, kill_group, last_error, stage_device  # noqa: E402
from benchmarks.gpu.stage_isoflop import ISOFLOP_ARCHIVE, ISOFLOP_DIR, ISOFLOP_SEEDS, run_isoflop_sweep  # noqa: E402
from benchmarks.gpu.stages import STAGE_FNS, STAGE_NAMES, STAGES  # noqa: E402
from benchmarks.gpu.summary import evaluate_goals, print_summary  # noqa: E402

RESULT_NAME = "gpu_suite.json"
LOG_NAME = "gpu_suite.log"
TAIL_LINES = 25
MIN_STAGE_S = 10.0  # a stage with less time than this left before the deadline is not started
# --smoke: a stage's rehearsal budget is what it takes on an idle 2-core CPU with room to spare, not a limit. On a
# loaded or older CPU a stage may take several times as long (the nccl stage: 68 s against a 60 s inner limit
# with two other jobs on the cores), and that is reported as slow, not failed. The limit that kills a stage
# is this many times its budget: a guard against a hang only. --stage-budget and --budget-s still apply as given.
SMOKE_HANG_FACTOR = 6.0
GPU_BUDGET_S = 480.0  # the overall deadline of a GPU run (the device's time is short); --smoke has none


def run_stage_child(
    name: str, work: Path, smoke: bool, limit_s: float, inject: str | None, options: dict | None = None
) -> int:
    """The child process: run one stage, write ``work/NAME/result.json``; exit 0 on success."""
    stage_work = work / name
    stage_work.mkdir(parents=True, exist_ok=True)
    if inject == "raise":
        raise RuntimeError(f"injected failure in stage {name!r}")
    if inject == "hang":
        print(f"stage {name!r}: hanging on purpose", flush=True)
        while True:
            time.sleep(1)
    ctx = Ctx(smoke=smoke, work=stage_work, device=stage_device(smoke), limit_s=limit_s, options=options or {})
    result = STAGE_FNS[name](ctx)
    _write_json_atomic(stage_work / "result.json", result)
    return 0


def _write_json_atomic(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def _parse_inject(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        name, _, how = item.partition("=")
        if name not in STAGE_NAMES or how not in ("raise", "hang"):
            raise SystemExit(
                f"--inject {item!r}: must be STAGE=raise or STAGE=hang with STAGE one of {', '.join(STAGE_NAMES)}"
            )
        out[name] = how
    return out


def _pick(names: list[str] | None, flag: str) -> list[str]:
    for n in names or []:
        if n not in STAGE_NAMES:
            raise SystemExit(f"{flag} {n!r}: must be one of {', '.join(STAGE_NAMES)}")
    return list(names or [])


def run_suite(
    out: Path,
    work: Path,
    budget_s: float | None,
    smoke: bool,
    only: list[str],
    skip: list[str],
    inject: dict[str, str],
    stage_budget: dict[str, float],
    isoflop_from: str | None = None,
    isoflop_seeds: int = ISOFLOP_SEEDS,
    no_compile: bool = False,
) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + (budget_s if budget_s is not None else float("inf"))
    started = time.time()
    payload = {
        "suite": "gpu_suite",
        "command": " ".join(["gpu_suite.py", *sys.argv[1:]]),
        "smoke": smoke,
        "budget_s": budget_s,
        "started_unix": started,
        "stages": {},
    }
    log_path = out / LOG_NAME
    log_path.write_text("")
    for stage in STAGES:
        if (only and stage.name not in only) or stage.name in skip or (not only and not stage.default):
            continue
        record: dict = {"doc": stage.doc}
        left = deadline - time.monotonic()
        budget = stage_budget.get(stage.name, stage.smoke_budget_s if smoke else stage.budget_s)
        hang_guard = smoke and stage.name not in stage_budget  # a rehearsal's budget is a yardstick, not a limit
        limit = min(budget * SMOKE_HANG_FACTOR if hang_guard else budget, left)
        if left < MIN_STAGE_S:
            record.update(status="not run", reason=f"the overall deadline ({budget_s:.0f} s): {left:.0f} s left")
            payload["stages"][stage.name] = record
            _write_json_atomic(out / RESULT_NAME, payload)
            continue
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--run-stage",
            stage.name,
            "--work",
            str(work),
            "--stage-limit-s",
            f"{limit:.1f}",
        ] + (["--smoke"] if smoke else [])
        if stage.name in inject:
            cmd += ["--inject", f"{stage.name}={inject[stage.name]}"]
        if no_compile:
            cmd.append("--no-compile")
        if stage.name == "isoflop":
            cmd += ["--isoflop-out", str((out / ISOFLOP_DIR).resolve()), "--isoflop-seeds", str(isoflop_seeds)]
            if isoflop_from:
                cmd += ["--isoflop-from", str(Path(isoflop_from).resolve())]
        print(f"[gpu_suite] stage {stage.name}: limit {limit:.0f} s", file=sys.stderr, flush=True)
        stage_log = work / f"{stage.name}.log"
        t0 = time.monotonic()
        with open(stage_log, "w") as fh:
            proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                stdout=fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=dict(
                    os.environ,
                    PYTHONUNBUFFERED="1",
                    PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                    # a cache of this run's own: a shared one left truncated by a killed
                    # compile ("file too short") failed a rehearsal's compiled run
                    TORCHINDUCTOR_CACHE_DIR=str(work / "inductor_cache"),
                    # the rehearsal on a CPU: one intra-op thread in every process a stage starts (torchrun's
                    # ranks, mode train), as in the test suite; two threads per process beside other work
                    # spun in OpenMP's barriers (the nccl stage took 91 s instead of 12, issue 70)
                    **({"OMP_NUM_THREADS": "1"} if smoke else {}),
                ),
            )
            try:
                proc.wait(timeout=limit)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
                kill_group(proc)
        seconds = time.monotonic() - t0
        text = stage_log.read_text(errors="replace")
        with open(log_path, "a") as fh:
            fh.write(f"\n===== stage {stage.name} ({seconds:.1f} s, rc {proc.returncode}) =====\n{text}")
        tail = text.strip().splitlines()[-TAIL_LINES:]
        result_path = work / stage.name / "result.json"
        record["seconds"] = round(seconds, 1)
        record["limit_s"] = round(limit, 1)
        record["budget_s"] = round(budget, 1)
        if hang_guard and seconds > budget and not timed_out:
            record["slow"] = (
                f"took {seconds:.0f} s, over its rehearsal budget of {budget:.0f} s (a loaded or slower "
                f"CPU; killed only past {limit:.0f} s)"
            )
        if timed_out:
            record.update(status="timeout", error=f"ran past its limit of {limit:.0f} s and was killed", tail=tail)
        elif proc.returncode != 0 or not result_path.exists():
            record.update(status="failed", error=last_error(text), returncode=proc.returncode, tail=tail)
        else:
            result = json.loads(result_path.read_text())
            record.update(status="ok", numbers=result["numbers"], details=result["details"])
        if record["status"] != "ok" and result_path.exists():
            result_path.unlink()  # a failed rerun must not leave an earlier run's numbers for later stages
        if stage.name == "isoflop" and record["status"] == "ok" and not payload.get("device"):
            payload["device"] = record["details"].get("device_name")  # an isoflop-only call runs no env stage
            payload.setdefault("versions", {"torch": record["details"].get("machine", {}).get("torch")})
        if stage.name == "env" and record["status"] == "ok":
            payload["device"] = record["details"].get("device_name")
            payload["versions"] = {
                k: record["details"].get(k)
                for k in (
                    "python",
                    "torch",
                    "torch_cuda",
                    "cudnn",
                    "nccl",
                    "triton",
                    "transformers",
                    "torchtitan",
                    "nvidia_smi",
                )
            }
        payload["stages"][stage.name] = record
        payload["goals"] = evaluate_goals(payload["stages"], smoke)
        _write_json_atomic(out / RESULT_NAME, payload)
        print(f"[gpu_suite] stage {stage.name}: {record['status']} in {seconds:.1f} s", file=sys.stderr, flush=True)
    payload["seconds"] = round(time.time() - started, 1)
    payload["goals"] = evaluate_goals(payload["stages"], smoke)
    _write_json_atomic(out / RESULT_NAME, payload)
    return payload


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="folder for gpu_suite.json and gpu_suite.log (on the GPU machine: $OUT)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help=f"overall deadline in seconds (default {GPU_BUDGET_S:.0f}; with --smoke none: a rehearsal's "
        f"stages are killed only past {SMOKE_HANG_FACTOR:g} x their budget, and a slow one is "
        "reported as slow)",
    )
    p.add_argument("--smoke", action="store_true", help="every stage at its smallest, on any device (rehearsal)")
    p.add_argument("--only", nargs="+", help=f"run only these stages ({', '.join(STAGE_NAMES)})")
    p.add_argument("--skip", nargs="+", help="leave these stages out")
    p.add_argument(
        "--stage-budget",
        nargs="+",
        default=[],
        metavar="STAGE=S",
        help="override a stage's time limit in seconds, e.g. tests=60",
    )
    p.add_argument(
        "--inject",
        nargs="+",
        default=[],
        metavar="STAGE=raise|hang",
        help="make a stage fail on purpose (to test that stages are isolated)",
    )
    p.add_argument("--work", help="scratch folder (default: a new temporary folder)")
    p.add_argument(
        "--no-compile",
        action="store_true",
        help="leave out the torch.compile rows of the moe, mod and train stages (recorded as not run); "
        "on a CPU they take most of a smoke run's time",
    )
    p.add_argument(
        "--isoflop-from",
        metavar="PATH",
        help=f"isoflop stage: the {ISOFLOP_ARCHIVE} an earlier call left in OUT/{ISOFLOP_DIR} (or its "
        "folder): its finished runs are reused and the sweep goes on from there",
    )
    p.add_argument(
        "--isoflop-seeds", type=int, default=ISOFLOP_SEEDS, help=f"isoflop stage: seeds (default {ISOFLOP_SEEDS})"
    )
    p.add_argument("--run-stage", choices=STAGE_NAMES, help=argparse.SUPPRESS)
    p.add_argument("--isoflop-out", help=argparse.SUPPRESS)
    p.add_argument("--isoflop-sweep", help=argparse.SUPPRESS)
    p.add_argument("--stage-limit-s", type=float, default=60.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.isoflop_sweep:
        return run_isoflop_sweep(Path(args.isoflop_sweep), args.smoke, args.isoflop_seeds)
    if args.run_stage:
        inject = _parse_inject(args.inject).get(args.run_stage)
        options = {
            "isoflop_out": args.isoflop_out,
            "isoflop_from": args.isoflop_from,
            "isoflop_seeds": args.isoflop_seeds,
            "no_compile": args.no_compile,
        }
        try:
            return run_stage_child(args.run_stage, Path(args.work), args.smoke, args.stage_limit_s, inject, options)
        except Exception:  # noqa: BLE001 - the parent records the error from this output
            traceback.print_exc()
            return 1

    if not args.out:
        raise SystemExit("--out DIR: required (the folder for gpu_suite.json and gpu_suite.log)")
    if args.budget_s is None and not args.smoke:
        args.budget_s = GPU_BUDGET_S
    if args.budget_s is not None and args.budget_s <= 0:
        raise SystemExit(f"--budget-s={args.budget_s}: must be > 0")
    stage_budget = {}
    for item in args.stage_budget:
        name, _, secs = item.partition("=")
        try:
            value = float(secs)
        except ValueError:
            value = -1.0
        if name not in STAGE_NAMES or value <= 0:
            raise SystemExit(
                f"--stage-budget {item!r}: must be STAGE=SECONDS with STAGE one of "
                f"{', '.join(STAGE_NAMES)} and SECONDS > 0"
            )
        stage_budget[name] = value
    only, skip = _pick(args.only, "--only"), _pick(args.skip, "--skip")
    inject = _parse_inject(args.inject)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gpu_suite_"))
    if args.isoflop_seeds < 1:
        raise SystemExit(f"--isoflop-seeds={args.isoflop_seeds}: must be >= 1")
    if args.isoflop_from and not Path(args.isoflop_from).exists():
        raise SystemExit(f"--isoflop-from {args.isoflop_from!r}: no such file or folder")
    payload = run_suite(
        Path(args.out),
        work,
        args.budget_s,
        args.smoke,
        only,
        skip,
        inject,
        stage_budget,
        args.isoflop_from,
        args.isoflop_seeds,
        args.no_compile,
    )
    print_summary(payload)
    print(f"\nwrote {Path(args.out) / RESULT_NAME} and {LOG_NAME}", file=sys.stderr)
    return 0 if all(r["status"] == "ok" for r in payload["stages"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

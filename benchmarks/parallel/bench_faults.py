"""Fault injection: does ``mode train`` under torchrun survive a dead rank, a preemption, a corrupt checkpoint and
a kill during a save, and end exactly where the uninterrupted run ends?

    PYTHONPATH=. python benchmarks/parallel/bench_faults.py --world 2 --trials 20    # ~6 min on 2 CPU cores
    PYTHONPATH=. python benchmarks/parallel/bench_faults.py --world 4 --trials 20
    PYTHONPATH=. python benchmarks/parallel/bench_faults.py --world 2 --trials 4 --steps 6   # a smoke run

Every run is the documented launcher line (``torchrun --standalone --nproc-per-node W --max-restarts 1 -m mode
train ... --resume auto``, gloo, CPU, one thread per process) with the quick preset, ``--steps`` steps (12),
a checkpoint every ``--ckpt-every`` steps (3), ``--keep 2``, the loss logged every step. First one uninterrupted
run; then ``--trials`` trials, each in a fresh folder, its fault drawn from a seeded generator (``--seed``):
trial i injects kind i mod 4,

    kill       rank r (random) SIGKILLs itself after step s (random, 1 .. steps-1); torchrun restarts the group
    sigterm    SIGTERM to the torchrun agent (what a scheduler sends) once the log shows step s; the workers
               save and exit 143, the agent exits; the same command is run again
    corrupt    SIGTERM at step s as above, then one byte of a random shard of the newest save is flipped before
               the command is run again (it must skip that save and use the one before)
    killsave   rank r SIGKILLs itself inside the save of checkpoint step s (its shards written, the save not yet
               complete); torchrun restarts the group

(``kill`` and ``killsave`` come from ``MODE_TEST_FAULT``, ``mode.train.faults``, in the first attempt only.)
A trial **survives** when the last command ends with status 0; its **final state equals** the uninterrupted one
when every tensor of the final checkpoint and every step's loss and gradient norm are equal, bit for bit.
**Steps lost** = the last step the group finished before the fault (kill: the step the rank died after;
SIGTERM: the step the group stopped and saved at; killsave: the step being saved) minus the step the run
resumed from: the steps trained twice. Prints a
table by fault kind and writes benchmarks/results/bench_faults_{W}.json (``--out``) with every trial.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere without installing
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.common import machine_info, print_table, write_json  # noqa: E402
from mode.parallel.checkpoint import saves  # noqa: E402
from mode.train.checkpoint import load_checkpoint  # noqa: E402

KINDS = ("kill", "sigterm", "corrupt", "killsave")
_RESUMED = re.compile(r"mode train: resuming at step (\d+) of")
_STOPPED = re.compile(r"mode train: preempted \(SIGTERM\): stopped after step (\d+) of")


def command(args, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(args.world),
        "--max-restarts",
        "1",
        "-m",
        "mode",
        "train",
        "--preset",
        "quick",
        "--ep",
        str(args.world),
        "--steps",
        str(args.steps),
        "--ckpt-every",
        str(args.ckpt_every),
        "--keep",
        "2",
        "--log-every",
        "1",
        "--eval-every",
        str(args.steps),
        "--data",
        str(args.data),
        "--device",
        "cpu",
        "--threads",
        "1",
        "--timeout",
        "60",
        "--no-progress",
        "--resume",
        "auto",
        "--out",
        str(out),
    ]


def environment(fault: str | None = None) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MODE_TEST_FAULT")
    }
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if fault:
        env["MODE_TEST_FAULT"] = fault
    return env


def run(args, out: Path, fault: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        command(args, out), capture_output=True, text=True, timeout=args.timeout_s, env=environment(fault), cwd=ROOT
    )


def last_logged_step(out: Path) -> int:
    try:
        lines = (out / "log.jsonl").read_text().splitlines()
    except OSError:
        return 0
    steps = [json.loads(line)["step"] for line in lines if line.strip().endswith("}") and '"loss"' in line]
    return max(steps, default=0)


def run_preempted(args, out: Path, at_step: int) -> tuple[subprocess.CompletedProcess, int]:
    """Start the command, send SIGTERM to the torchrun agent once the log reaches ``at_step``; returns the
    finished process and the step the signal was sent at (the last step logged then)."""
    proc = subprocess.Popen(
        command(args, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment(), cwd=ROOT
    )
    deadline = time.monotonic() + args.timeout_s
    sent_at = None
    while proc.poll() is None and time.monotonic() < deadline:
        step = last_logged_step(out)
        if step >= at_step:
            sent_at = step
            proc.send_signal(signal.SIGTERM)
            break
        time.sleep(0.05)
    stdout, stderr = proc.communicate(timeout=args.timeout_s)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), (sent_at or last_logged_step(out))


def flip_byte(out: Path, rng: random.Random) -> str:
    """Flip one byte of a random shard of the newest save; returns the file's path relative to ``out``."""
    newest = saves(out / "ckpt")[0]
    shard = rng.choice(sorted(newest.glob("*.distcp")))
    raw = bytearray(shard.read_bytes())
    raw[rng.randrange(len(raw))] ^= 0xFF
    shard.write_bytes(bytes(raw))
    return str(shard.relative_to(out))


def final_state(out: Path) -> tuple[dict, list]:
    params = load_checkpoint(out / "ckpt")["model"]
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    return params, [(r["step"], r["loss"], r["grad_norm"]) for r in log if "loss" in r]


def same_state(a: tuple[dict, list], b: tuple[dict, list]) -> bool:
    (pa, ca), (pb, cb) = a, b
    return ca == cb and pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


def trial(args, i: int, rng: random.Random, folder: Path, reference) -> dict:
    kind = KINDS[i % len(KINDS)]
    out = folder / f"trial{i:03d}"
    rank = rng.randrange(args.world)
    row = {"trial": i, "kind": kind, "rank": rank}
    t0 = time.perf_counter()
    if kind == "kill":
        step = rng.randrange(1, args.steps)
        done = run(args, out, f"kill@{rank}:{step}")
    elif kind == "killsave":
        step = args.ckpt_every * rng.randrange(1, args.steps // args.ckpt_every)  # a periodic save before the end
        done = run(args, out, f"killsave@{rank}:{step}")
    else:
        row["rank"] = "agent"
        first, row["signal_step"] = run_preempted(args, out, rng.randrange(1, args.steps))
        row["first_status"] = first.returncode
        stopped = _STOPPED.findall(first.stderr)  # every rank finished this step, then the group saved it
        row["saved_on_sigterm"] = bool(stopped)
        step = int(stopped[-1]) if stopped else row["signal_step"]
        if kind == "corrupt":
            row["flipped"] = flip_byte(out, rng)
        done = run(args, out)
        row["skipped_warning"] = "mode train: warning: skipping checkpoint" in done.stderr
    row["fault_step"] = step
    resumed = [int(m) for m in _RESUMED.findall(done.stdout)]
    row["resumed_from"] = resumed[-1] if resumed else 0  # none: a fresh start
    row["steps_lost"] = step - row["resumed_from"]
    row["status"] = done.returncode
    row["survived"] = done.returncode == 0
    row["equal"] = row["survived"] and same_state(final_state(out), reference)
    row["wall_s"] = time.perf_counter() - t0
    if not row["survived"]:
        row["stderr_tail"] = done.stderr[-2000:]
    shutil.rmtree(out, ignore_errors=True)
    return row


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for kind in (*KINDS, "all"):
        rs = [r for r in rows if kind in ("all", r["kind"])]
        if not rs:
            continue
        lost = [r["steps_lost"] for r in rs]
        out.append(
            {
                "kind": kind,
                "trials": len(rs),
                "survived": sum(r["survived"] for r in rs),
                "equal": sum(r["equal"] for r in rs),
                "lost_mean": statistics.mean(lost),
                "lost_max": max(lost),
                "wall_mean": statistics.mean(r["wall_s"] for r in rs),
            }
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2, help="gloo processes (a (1, W) mesh: --ep W)")
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--ckpt-every", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", help="training text (default: a few of mode's own sources, ~55 kB)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per command")
    p.add_argument("--out", help="JSON path (default benchmarks/results/bench_faults_{world}.json)")
    args = p.parse_args()
    if args.steps // args.ckpt_every < 2:
        p.error("--steps must hold at least two checkpoints (--ckpt-every)")
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="bench_faults_") as tmp:
        folder = Path(tmp)
        if args.data is None:
            args.data = folder / "text.txt"
            args.data.write_text(
                "".join((ROOT / "mode" / "train" / f).read_text() for f in ("data.py", "trainer.py", "tokens.py"))
            )
        t0 = time.perf_counter()
        ref = run(args, folder / "uninterrupted")
        if ref.returncode != 0:
            sys.exit(f"the uninterrupted run failed:\n{ref.stderr[-3000:]}")
        reference = final_state(folder / "uninterrupted")
        reference_s = time.perf_counter() - t0
        rows = []
        for i in range(args.trials):
            rows.append(trial(args, i, rng, folder, reference))
            r = rows[-1]
            print(
                f"trial {i:3d} {r['kind']:8s} rank {r['rank']!s:5s} step {r['fault_step']:3d}: "
                f"{'survived' if r['survived'] else 'FAILED'}, resumed from {r['resumed_from']}, "
                f"lost {r['steps_lost']}, {'equal' if r['equal'] else 'NOT EQUAL'} ({r['wall_s']:.1f} s)",
                flush=True,
            )
    table = summarize(rows)
    print(
        f"\nFault injection: {args.world} gloo processes (torchrun --max-restarts 1, --ep {args.world}), "
        f"{args.steps} steps, a checkpoint every {args.ckpt_every}, --keep 2, seed {args.seed}; uninterrupted "
        f"run {reference_s:.1f} s\n"
    )
    print_table(
        table,
        [
            ("kind", "fault", ""),
            ("trials", "trials", "d"),
            ("survived", "survived", "d"),
            ("equal", "final state = uninterrupted", "d"),
            ("lost_mean", "steps lost (mean)", ".2f"),
            ("lost_max", "steps lost (max)", "d"),
            ("wall_mean", "seconds per trial", ".1f"),
        ],
    )
    path = args.out or ROOT / "benchmarks" / "results" / f"bench_faults_{args.world}.json"
    payload = dict(
        benchmark="bench_faults",
        machine=machine_info(torch.device("cpu")),
        world=args.world,
        trials=args.trials,
        steps=args.steps,
        ckpt_every=args.ckpt_every,
        seed=args.seed,
        command=" ".join(command(args, Path("OUT"))[1:]).replace(str(args.data), "DATA"),
        reference_s=reference_s,
        summary=table,
        rows=rows,
    )
    print(f"wrote {write_json(path, payload)}")


if __name__ == "__main__":
    main()

"""Peak memory of one training step of the `mode train` preset `small`, one process, with and without
activation checkpointing (``--ac``) and gradient accumulation (``--grad-accum``).

    PYTHONPATH=. python benchmarks/layers/bench_activation_checkpointing.py                 # CPU: peak RSS
    PYTHONPATH=. python benchmarks/layers/bench_activation_checkpointing.py --device cuda   # GPU: the allocator's peak

Each case runs in a fresh subprocess: the trainer is built (preset small: 6 layers of MoE, staged and integrated
MoDE, d_model 128, 8 experts, causal predictor; global batch 16 x 256 tokens), one step warms it up (AdamW's
state exists after it), then a second step is measured.

    CPU   peak resident memory of the process during the step (``VmHWM``, reset through ``/proc/self/clear_refs``
          just before it) minus the resident memory before it. glibc is told to map every block of 64 KiB or
          more on its own and to keep no freed memory (``mode.cpu_allocator.retain_freed_memory`` with
          ``mmap_threshold=64 KiB, trim_threshold=0``), so the resident size follows the live tensors.
    CUDA  ``torch.cuda.max_memory_allocated`` during the step minus ``memory_allocated`` before it.

Both are what the step adds on top of the weights and AdamW's state: activations kept for backward, the
gradients (freed after every step), the recompute's and the optimizer's temporaries. The step time is
printed too (one measured step: a rough number, not a timing benchmark). Results:
benchmarks/results/activation_checkpointing.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere without installing
    sys.path.insert(0, str(ROOT))

CASES = [  # (activation checkpointing, micro-batches)
    (False, 1),
    (True, 1),
    (False, 2),
    (True, 2),
    (False, 4),
    (True, 4),
]
MIB = 1 << 20


def child(ac: bool, n: int, device: str, threads: int) -> dict:
    """One case, in this (fresh) process: what the measured step added, in bytes, and its time."""
    import numpy as np
    import torch

    from benchmarks.common import proc_status_bytes
    from mode.parallel.command import PRESETS
    from mode.train import Trainer
    from mode.train.data import Corpus

    torch.set_num_threads(threads)
    dev = torch.device(device)
    if dev.type == "cpu":
        from mode.cpu_allocator import retain_freed_memory

        tuning = retain_freed_memory(mmap_threshold=64 * 1024, trim_threshold=0, top_pad=0)
        assert tuning.applied, tuning.reason
    preset = PRESETS["small"]
    data = np.random.default_rng(0).integers(0, 256, 400_000, dtype=np.uint8)
    corpus = Corpus(train=data[:360_000], val=data[360_000:], source="random")
    tcfg = replace(preset.train, grad_accum=n, activation_checkpointing=ac, eval_batches=1)
    with tempfile.TemporaryDirectory() as tmp:
        t = Trainer(preset.model, tcfg, corpus, tmp, progress=False, device=dev)
        t.train_step()  # warm-up: AdamW's state is allocated here
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            before = torch.cuda.memory_allocated(dev)
        else:
            before = proc_status_bytes("VmRSS")
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
        t0 = time.perf_counter()
        t.train_step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            peak = torch.cuda.max_memory_allocated(dev)
        else:
            peak = proc_status_bytes("VmHWM")
        seconds = time.perf_counter() - t0
        params = sum(p.numel() * p.element_size() for p in t.model.parameters())
    return {
        "activation_checkpointing": ac,
        "grad_accum": n,
        "step_peak_bytes": peak - before,
        "before_bytes": before,
        "param_bytes": params,
        "step_seconds": seconds,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "activation_checkpointing.json"))
    p.add_argument("--child", nargs=2, metavar=("AC", "N"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0] == "1", int(args.child[1]), args.device, args.threads)))
        return
    import torch

    from benchmarks.common import machine_info
    from mode.parallel.command import PRESETS

    rows = []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    for ac, n in CASES:
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--device",
                args.device,
                "--threads",
                str(args.threads),
                "--child",
                str(int(ac)),
                str(n),
            ],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = rows[0]["step_peak_bytes"]
    for r in rows:
        r["vs_plain"] = r["step_peak_bytes"] / base
    preset = PRESETS["small"]
    measure = (
        "peak resident memory (VmHWM) - resident before the step"
        if args.device == "cpu"
        else "torch.cuda.max_memory_allocated - memory_allocated before the step"
    )
    report = {
        "preset": "small",
        "batch": [preset.train.batch_size, preset.model.seq_len],
        "measure": measure,
        "machine": machine_info(torch.device(args.device)),
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(
        f"preset small, global batch {preset.train.batch_size} x {preset.model.seq_len}, one process on "
        f"{args.device} ({measure}); weights {rows[0]['param_bytes'] / MIB:.1f} MiB"
    )
    print("| activation checkpointing | micro-batches | step peak over weights + AdamW | vs plain | step time |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {'on' if r['activation_checkpointing'] else 'off'} | {r['grad_accum']} | "
            f"{r['step_peak_bytes'] / MIB:.1f} MiB | {r['vs_plain']:.2f} | {r['step_seconds']:.2f} s |"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

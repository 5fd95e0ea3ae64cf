"""The nccl stage: ``torchrun --nproc-per-node 1 -m mode train`` over NCCL (the mesh path, a sharded
checkpoint) and a resume from it."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time

from benchmarks.gpu.stage_base import Ctx, last_error, run_logged


def stage_nccl(ctx: Ctx) -> dict:
    import torch

    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    device = "cuda" if ctx.device.type == "cuda" else "cpu"
    out = ctx.work / "nccl_run"
    shutil.rmtree(out, ignore_errors=True)
    common = [
        "-m",
        "mode",
        "train",
        "--preset",
        "quick",
        "--device",
        device,
        "--no-progress",
        "--out",
        str(out),
        "--timeout",
        "60",
    ]
    if device == "cuda":
        common.append("--bf16")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t_start = time.monotonic()
    rc, text = run_logged(torchrun + common + ["--steps", "20"], timeout=ctx.limit_s / 2, env=env)
    if rc != 0:
        raise RuntimeError(f"torchrun mode train exited with {rc}: {last_error(text)}")
    first_s = time.monotonic() - t_start
    if not (out / "ckpt").is_dir():
        raise RuntimeError(f"no sharded checkpoint in {out}: {sorted(p.name for p in out.iterdir())}")
    rc, text2 = run_logged(
        torchrun + common + ["--steps", "30", "--resume"],
        timeout=max(ctx.limit_s - (time.monotonic() - t_start) - 5, 10),
        env=env,
    )
    if rc != 0:
        raise RuntimeError(f"torchrun mode train --resume exited with {rc}: {last_error(text2)}")
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in records if "loss" in r]
    backend = "nccl" if device == "cuda" else "gloo"
    said = re.findall(r"\b(nccl|gloo)\b", text)
    numbers = {
        "backend": backend,
        "backend_in_output": said[0] if said else None,
        "last_step": max(steps),
        "final_loss": [r["loss"] for r in records if "loss" in r][-1],
        "first_run_s": first_s,
        "nccl_version": ".".join(map(str, torch.cuda.nccl.version())) if device == "cuda" else None,
    }
    if max(steps) != 30:
        raise RuntimeError(f"the resumed run logged steps {steps}, expected to end at 30")
    return {"numbers": numbers, "details": {"log": records[-3:]}}

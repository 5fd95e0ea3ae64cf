"""The training stages: train (``mode train --preset base --bf16``, eager and compiled), graphs (the step
replayed from one CUDA graph vs eager) and gpumfu (the "gpu" preset's MFU, eager and with CUDA graphs)."""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import time
from pathlib import Path

from benchmarks.gpu.stage_base import NO_CUDA, Ctx, compiling, last_error, read_stage_numbers, run_logged


def steady_speed(records: list[dict], skip_steps: int) -> dict:
    """tokens/s and FLOP/s between the first logged step past ``skip_steps`` and the last one (the logged
    ``tok_s`` averages from step 1, start-up and compilation included)."""
    rows = [r for r in records if "tok_s" in r and "val_loss" not in r]
    if len(rows) < 2:
        raise RuntimeError(f"need two logged training steps to time the steady state, found {len(rows)}")
    later = [r for r in rows if r["step"] > skip_steps] or rows[-1:]
    a = next((r for r in reversed(rows) if r["step"] <= later[0]["step"] - 1), rows[0])
    b = rows[-1]
    dt = b["wall"] - a["wall"]
    return {
        "from_step": a["step"],
        "to_step": b["step"],
        "tok_s": (b["tokens"] - a["tokens"]) / dt,
        "flop_s": (b["flops"] - a["flops"]) / dt,
        "final_loss": b["loss"],
        "first_loss": rows[0]["loss"],
        "tok_s_logged_cumulative": b["tok_s"],
        "mfu_logged_cumulative": b.get("mfu"),
    }


TRAIN_GPU = dict(preset="base", steps=60, skip=20)


TRAIN_SMOKE = dict(preset="quick", steps=20, skip=10)


def stage_train(ctx: Ctx) -> dict:
    from mode.train.log_sinks import peak_flops  # the datasheet peak the trainer's MFU uses

    p = TRAIN_SMOKE if ctx.smoke else TRAIN_GPU
    device = "cuda" if ctx.device.type == "cuda" else "cpu"
    numbers: dict = {}
    details: dict = {}
    env_ceiling = read_stage_numbers(ctx.work.parent, "env").get("matmul_bf16_tflops")
    peak = peak_flops(ctx.device)
    t_start = time.monotonic()
    for variant, extra in (("eager", []), ("compile", ["--compile"])):
        if variant == "compile" and not compiling(ctx):
            details[variant] = {"error": "not run: --no-compile"}
            continue
        left = ctx.limit_s - (time.monotonic() - t_start) - 5
        if left < 20:
            details[variant] = {"error": f"not run: {left:.0f} s left in the stage"}
            continue
        out = ctx.work / f"train_{variant}"
        shutil.rmtree(out, ignore_errors=True)
        cmd = [
            sys.executable,
            "-m",
            "mode",
            "train",
            "--preset",
            p["preset"],
            "--bf16",
            "--device",
            device,
            "--steps",
            str(p["steps"]),
            "--eval-every",
            str(10 * p["steps"]),
            "--no-progress",
            "--out",
            str(out),
            *extra,
        ]
        try:  # a variant that fails or runs out of time is recorded; the other one's numbers stay
            rc, text = run_logged(cmd, timeout=left)
            if rc != 0:
                raise RuntimeError(f"mode train ({variant}) exited with {rc}: {last_error(text)}")
            records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines() if line.strip()]
            speed = steady_speed(records, p["skip"])
        except RuntimeError as err:
            details[variant] = {"command": " ".join(cmd[1:]), "error": str(err)}
            print(f"train ({variant}): {err}", flush=True)
            continue
        numbers[f"tok_s_{variant}"] = speed["tok_s"]
        numbers[f"tflops_{variant}"] = speed["flop_s"] / 1e12
        if peak:
            numbers[f"mfu_{variant}"] = speed["flop_s"] / peak
        if env_ceiling:
            numbers[f"mfu_vs_measured_{variant}"] = speed["flop_s"] / (env_ceiling * 1e12)
        details[variant] = {"command": " ".join(cmd[1:]), **speed}
    if not numbers:
        raise RuntimeError(
            "neither training run gave numbers: "
            + "; ".join(f"{v}: {details[v].get('error')}" for v in ("eager", "compile"))
        )
    if "tok_s_eager" in numbers and "tok_s_compile" in numbers:
        numbers["compile_speedup"] = numbers["tok_s_compile"] / numbers["tok_s_eager"]
    details["peak_flops_datasheet"] = peak
    details["measured_ceiling_tflops"] = env_ceiling
    return {"numbers": numbers, "details": details}


def train_in_process(
    preset: str,
    steps: int,
    skip: int,
    device,
    cuda_graphs: bool,
    work: Path,
    batch_size: int | None = None,
    measured_peak: float | None = None,
) -> dict:
    """``steps`` training steps of a ``mode train`` preset under bf16 autocast, in this process (no evaluation,
    no checkpoint: an 873M-parameter run's would write 10 GB), each timed to its end (a step ends with its one
    host sync); steady state = the median of the steps after ``skip`` (warm-up and capture before)."""
    from dataclasses import replace

    import torch

    from mode.parallel.command import PRESETS
    from mode.train import Trainer
    from mode.train.sources import load_corpus

    p = PRESETS[preset]
    train_cfg = replace(
        p.train,
        steps=steps,
        eval_every=10 * steps,
        log_every=1,
        **({} if batch_size is None else {"batch_size": batch_size}),
    )
    corpus = load_corpus(None, p.model.seq_len, 4_000_000)
    model_cfg = replace(p.model, vocab_size=corpus.vocab_size)
    import gc

    gc.collect()  # a previous run's trainer (a cycle through its graphed step) and its graph's memory pool go first
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.monotonic()
    trainer = Trainer(
        model_cfg, train_cfg, corpus, work, progress=False, device=str(device), bf16=True, cuda_graphs=cuda_graphs
    )
    trainer.measured_peak_flops = measured_peak
    build_s = time.monotonic() - t0
    times, losses, flops = [], [], []
    for _ in range(steps):
        f0, t1 = trainer.flops, time.perf_counter()
        loss, _ = trainer.train_step()
        times.append(time.perf_counter() - t1)
        losses.append(loss)
        flops.append(trainer.flops - f0)
    steady = times[skip:] or times[-1:]
    step_s = statistics.median(steady)
    flop_s = statistics.median(flops[skip:] or flops[-1:]) / step_s
    tokens = train_cfg.batch_size * model_cfg.seq_len
    out = {
        "preset": preset,
        "cuda_graphs": cuda_graphs,
        "batch_size": train_cfg.batch_size,
        "seq_len": model_cfg.seq_len,
        "params": trainer.model.num_params(),
        "steps": steps,
        "skip": skip,
        "build_s": build_s,
        "first_steps_ms": [1e3 * t for t in times[:skip]],
        "step_ms": 1e3 * step_s,
        "tok_s": tokens / step_s,
        "tflops": flop_s / 1e12,
        "losses": losses,
        "mfu": None if trainer.peak_flops is None else flop_s / trainer.peak_flops,
        "mfu_measured": None if not measured_peak else flop_s / measured_peak,
    }
    if device.type == "cuda":
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    if trainer.graphed is not None:
        out["captures"] = trainer.graphed.captures
    del trainer
    return out


def _loss_agreement(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(x), 1e-9) for x, y in zip(a, b))


GRAPHS_GPU = dict(preset="base", steps=30, skip=10)


GRAPHS_SMOKE = dict(preset="quick", steps=8, skip=4)


def stage_graphs(ctx: Ctx) -> dict:
    """The training step replayed from one CUDA graph against the eager step, same preset, same batches."""
    p = GRAPHS_SMOKE if ctx.smoke else GRAPHS_GPU
    eager = train_in_process(p["preset"], p["steps"], p["skip"], ctx.device, False, ctx.work / "eager")
    numbers = {"step_ms_eager": eager["step_ms"], "tok_s_eager": eager["tok_s"]}
    details = {"eager": eager}
    if ctx.device.type != "cuda":
        details["graphs"] = NO_CUDA
        numbers["graphs"] = NO_CUDA
    else:
        graphs = train_in_process(p["preset"], p["steps"], p["skip"], ctx.device, True, ctx.work / "graphs")
        details["graphs"] = graphs
        numbers.update(
            step_ms_graphs=graphs["step_ms"],
            tok_s_graphs=graphs["tok_s"],
            graph_speedup=eager["step_ms"] / graphs["step_ms"],
            captures=graphs.get("captures"),
            loss_rel_diff_max=_loss_agreement(eager["losses"], graphs["losses"]),
        )
    print(f"graphs: {numbers}", flush=True)
    return {"numbers": numbers, "details": details}


GPUMFU_GPU = dict(steps=24, skip=8)


def stage_gpumfu(ctx: Ctx) -> dict:
    """The "gpu" preset (873M parameters) under bf16 autocast, eager and with CUDA graphs: MFU against the
    datasheet peak and against the bf16 matmul ceiling measured at start-up (as ``mode train`` states it).
    Batch 32 where the device has >= 100 GiB (H200), else 16 (H100, 80 GB). The rehearsal builds the preset on
    the meta device (its size) and runs the same code on the quick preset."""
    import torch

    from mode.measure.flops import train_flops_per_token
    from mode.model import LM
    from mode.parallel.command import PRESETS
    from mode.train.log_sinks import measure_matmul_flops

    cfg = PRESETS["gpu"].model
    with torch.device("meta"):
        params = LM(cfg).num_params()
    numbers: dict = {"params": params, "train_gflop_per_token": train_flops_per_token(cfg) / 1e9}
    details: dict = {}
    if ctx.device.type != "cuda":
        details["quick"] = train_in_process("quick", 6, 3, ctx.device, False, ctx.work / "quick")
        numbers["gpu_preset"] = NO_CUDA
        return {"numbers": numbers, "details": details}
    measured = measure_matmul_flops(ctx.device)
    numbers["measured_tflops"] = measured / 1e12
    memory_gib = torch.cuda.get_device_properties(ctx.device).total_memory / 2**30
    batch = 32 if memory_gib >= 100 else 16
    numbers["batch_size"] = batch
    p = GPUMFU_GPU
    t_start = time.monotonic()
    for name, graphs in (("graphs", True), ("eager", False)):  # graphs first: the number the goal is about
        if ctx.limit_s - (time.monotonic() - t_start) < 40:
            details[name] = {"error": "not run: under 40 s left in the stage"}
            continue
        try:
            r = train_in_process(
                "gpu",
                p["steps"],
                p["skip"],
                ctx.device,
                graphs,
                ctx.work / name,
                batch_size=batch,
                measured_peak=measured,
            )
        except torch.cuda.OutOfMemoryError as err:
            details[name] = {"error": f"out of memory at batch {batch}: {str(err)[:300]}"}
            torch.cuda.empty_cache()
            continue
        details[name] = r
        numbers.update(
            {
                f"mfu_{name}": r["mfu"],
                f"mfu_measured_{name}": r["mfu_measured"],
                f"tok_s_{name}": r["tok_s"],
                f"step_ms_{name}": r["step_ms"],
                f"peak_memory_gib_{name}": r.get("peak_memory_gib"),
            }
        )
        print(
            f"gpu preset ({name}): MFU {r['mfu']:.1%} of nominal, {r['mfu_measured']:.1%} of measured "
            f"{measured / 1e12:.0f} TFLOP/s; {r['tok_s']:,.0f} tokens/s; step {r['step_ms']:.1f} ms; peak "
            f"{r.get('peak_memory_gib', 0):.1f} GiB",
            flush=True,
        )
    if "step_ms_graphs" in numbers and "step_ms_eager" in numbers:
        numbers["graph_speedup"] = numbers["step_ms_eager"] / numbers["step_ms_graphs"]
        numbers["loss_rel_diff_max"] = _loss_agreement(details["eager"]["losses"], details["graphs"]["losses"])
    if not any(k.startswith("mfu_") for k in numbers):
        raise RuntimeError(
            "no gpu-preset run gave numbers: " + "; ".join(f"{k}: {v.get('error')}" for k, v in details.items())
        )
    return {"numbers": numbers, "details": details}

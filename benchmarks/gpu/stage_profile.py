"""The profile stage: torch.profiler over the MoE layers, the MoD and dense blocks and a training step: wall
time against the device's busy time, and the kernels that take the most of it."""

from __future__ import annotations

import time
from collections.abc import Callable

from benchmarks.gpu.stage_base import Ctx, sync
from benchmarks.gpu.stage_layers import MOD_GPU_BLOCK, MOD_SMOKE_BLOCK


def profile_step(step: Callable[[], None], device, iters: int, top: int = 8) -> dict:
    """Where one step's time goes: wall time per step against the device's busy time (the sum of its kernels),
    and the kernels (ops on a CPU) that take the most of it, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    for _ in range(3):
        step()
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        sync(device)
        wall = (time.perf_counter() - t0) / iters

    def own(e) -> float:  # microseconds of the event itself, on the device (CUDA) or the CPU
        if cuda:
            return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
        return e.self_cpu_time_total

    from torch.autograd import DeviceType

    # on CUDA only the kernels (device events) count: an aten op's device time is its kernels' time again
    averages = prof.key_averages()
    events = [e for e in averages if own(e) > 0 and (not cuda or getattr(e, "device_type", None) == DeviceType.CUDA)]
    busy_us = sum(own(e) for e in events) / iters
    ranked = sorted(events, key=own, reverse=True)[:top]
    total_us = sum(own(e) for e in events) or 1.0
    # the host side: CPU time of the ops themselves (dispatch, autograd, Python custom-op wrappers), the
    # launch cost a host-bound step pays; on a CPU this is the same list as "top"
    host = [
        e for e in averages if getattr(e, "device_type", DeviceType.CPU) == DeviceType.CPU and e.self_cpu_time_total > 0
    ]
    host_us = sum(e.self_cpu_time_total for e in host) or 1.0
    host_ranked = sorted(host, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return {
        "wall_ms": 1e3 * wall,
        "device_busy_ms": busy_us / 1e3 if cuda else None,
        "busy_fraction": (busy_us / 1e6) / wall if cuda else None,
        "host_ms": host_us / iters / 1e3,
        "host_ops_per_step": sum(e.count for e in host) / iters,
        "top": [
            {
                "name": e.key[:120],
                "ms_per_step": own(e) / iters / 1e3,
                "share": own(e) / total_us,
                "calls_per_step": e.count / iters,
            }
            for e in ranked
        ],
        "top_host": [
            {
                "name": e.key[:120],
                "ms_per_step": e.self_cpu_time_total / iters / 1e3,
                "share": e.self_cpu_time_total / host_us,
                "calls_per_step": e.count / iters,
            }
            for e in host_ranked
        ],
    }


def stage_profile(ctx: Ctx) -> dict:
    import torch

    from benchmarks.common import fwd_bwd_step
    from mode import MLP, MoD, MoDRouter, MoDRouterConfig, MoEConfig, MoELayer, TransformerBlock
    from mode.model import LM
    from mode.parallel.command import PRESETS

    device = ctx.device
    if ctx.smoke:
        T, d, moe_cfgs, blk, preset, batch, iters = 256, 64, ((4, 64), (16, 16)), MOD_SMOKE_BLOCK, "quick", 4, 2
    else:
        T, d, moe_cfgs, blk, preset, batch, iters = 16384, 1024, ((8, 2048), (64, 512)), MOD_GPU_BLOCK, "base", 64, 5
    workloads: dict[str, Callable[[], None]] = {}
    torch.manual_seed(0)
    x = torch.randn(1, T, d, device=device, requires_grad=True)
    g = torch.randn(1, T, d, device=device)
    for E, H in moe_cfgs:
        moe = MoELayer.from_config(
            MoEConfig(d_model=d, d_hidden=H, num_experts=E, top_k=2, activation="swiglu", capacity_factor=None)
        ).to(device)
        workloads[f"moe E={E} H={H}"] = fwd_bwd_step(moe, x, g)
        workloads[f"dense MLP 2H={2 * H}"] = fwd_bwd_step(MLP(d, 2 * H, activation="swiglu").to(device), x, g)
    dm, heads, B, S = blk["d_model"], blk["n_heads"], blk["mod_batch"], blk["mod_seq"]
    xb = torch.randn(B, S, dm, device=device, requires_grad=True)
    gb = torch.randn(B, S, dm, device=device)
    workloads["MoD block c=0.125"] = fwd_bwd_step(
        MoD(TransformerBlock(dm, heads, MLP(dm, 4 * dm)), MoDRouter(MoDRouterConfig(d_model=dm, capacity=0.125))).to(
            device
        ),
        xb,
        gb,
    )
    workloads["dense block"] = fwd_bwd_step(TransformerBlock(dm, heads, MLP(dm, 4 * dm)).to(device), xb, gb)
    model_cfg = PRESETS[preset].model
    model = LM(model_cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, model_cfg.vocab_size, (batch, model_cfg.seq_len), device=device)

    def train_step() -> None:
        out = model(idx, idx)
        (out.loss + out.aux.total()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    workloads[f"train step, preset {preset}, batch {batch}"] = train_step
    results = {}
    for name, step in workloads.items():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            results[name] = profile_step(step, device, iters)
        r = results[name]
        busy = "" if r["device_busy_ms"] is None else f", device busy {r['device_busy_ms']:.2f} ms"
        print(
            f"{name}: {r['wall_ms']:.2f} ms per step{busy}, host ops {r['host_ms']:.2f} ms "
            f"({r['host_ops_per_step']:.0f} ops)"
        )
        for t in r["top"][:5]:
            print(f"    {t['ms_per_step']:8.3f} ms  {100 * t['share']:5.1f}%  x{t['calls_per_step']:.0f}  {t['name']}")
    numbers = {f"{k}: wall_ms": v["wall_ms"] for k, v in results.items()}
    numbers.update(
        {f"{k}: busy_fraction": v["busy_fraction"] for k, v in results.items() if v["busy_fraction"] is not None}
    )
    return {"numbers": numbers, "details": {"dtype": "bf16 autocast", "iters": iters, "workloads": results}}

"""The env stage: nvidia-smi, versions, and two measured ceilings (a large bf16 matmul and a device-to-device
copy)."""

from __future__ import annotations

import shutil
import subprocess

from benchmarks.gpu.stage_base import Ctx, median_time


def _versions() -> dict:
    import importlib.metadata
    import platform

    import torch

    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
    }
    try:
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    except Exception as err:  # noqa: BLE001 - a version probe must not end the stage
        out["nccl"] = f"unavailable: {err}"
    for dist in ("triton", "transformers", "torchtitan", "tokenizers", "accelerate", "numpy"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def stage_env(ctx: Ctx) -> dict:
    import torch

    smi = shutil.which("nvidia-smi")
    nvidia_smi = None
    if smi:
        query = "name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,power.limit,pcie.link.gen.max"
        nvidia_smi = subprocess.run(
            [smi, f"--query-gpu={query}", "--format=csv"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
        print(nvidia_smi)
    device = ctx.device
    info = {"device": str(device), "nvidia_smi": nvidia_smi or "nvidia-smi not found", **_versions()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            device_name=props.name,
            capability=f"{props.major}.{props.minor}",
            memory_gib=round(props.total_memory / 2**30, 1),
            sm_count=props.multi_processor_count,
        )
    else:
        import platform

        info.update(device_name=platform.processor() or platform.machine())

    # the matmul ceiling: bf16 (n, n) @ (n, n), 2 n^3 FLOPs
    n = 8192 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    mm_s = median_time(lambda: torch.mm(a, b), device, warmup=3, repeats=10 if ctx.smoke else 30)
    tflops = 2 * n**3 / mm_s / 1e12
    # the copy ceiling: read + write of a large buffer
    nbytes = (2 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(nbytes // 4, device=device, dtype=torch.float32).normal_()
    dst = torch.empty_like(src)
    copy_s = median_time(lambda: dst.copy_(src), device, warmup=2, repeats=10 if ctx.smoke else 20)
    gbs = 2 * nbytes / copy_s / 1e9
    print(f"bf16 matmul {n}^3: {tflops:.1f} TFLOP/s; copy {nbytes >> 20} MiB: {gbs:.0f} GB/s (read + write)")
    numbers = {"matmul_bf16_tflops": tflops, "copy_gbs": gbs, "device_name": info["device_name"]}
    return {"numbers": numbers, "details": {**info, "matmul_n": n, "copy_bytes": nbytes}}

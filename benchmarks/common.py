"""Timing helpers shared by the benchmarks: warm-up, then paired, interleaved repeats.

A candidate is always timed next to its baseline, in alternating order (A B, B A, A B, ...), and the
reported ratio is the median of the per-pair ratios: slow drift of the machine (other processes, clock
changes) hits both sides of a pair about equally, so ratios are far steadier than absolute times.
Thread count is left at torch's default; it is recorded with the results.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn


def add_device_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        default="cpu",
        type=parse_device,
        help="cpu (default), cuda, cuda:N, or auto (cuda when a GPU is visible, else cpu)",
    )


def parse_device(choice: str) -> torch.device:
    """``--device``: cpu, cuda, cuda:N or auto; asking for a GPU torch cannot see is an error, not a CPU run."""
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(choice)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{choice!r}: must be cpu, cuda, cuda:N or auto") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise argparse.ArgumentTypeError(f"{choice!r}: must be cpu, cuda, cuda:N or auto")
    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{choice!r}: torch.cuda.is_available() is False (torch {torch.__version__})")
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{choice!r}: this machine has {torch.cuda.device_count()} GPU(s)")
    return torch.device("cuda", index)


def proc_status_bytes(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (``VmRSS``, ``VmHWM``; Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def machine_info(device: torch.device | None = None) -> dict:
    """What the JSON needs to say where it was measured: versions, the CPU, and the device timed on."""
    device = torch.device("cpu") if device is None else device
    cuda = device.type == "cuda"
    info = {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,  # the CUDA version torch was built with (None: a CPU build)
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if cuda else platform.processor() or platform.machine(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    if cuda:
        props = torch.cuda.get_device_properties(device)
        info.update(
            device_memory_gib=round(props.total_memory / 2**30, 1),
            device_capability=f"{props.major}.{props.minor}",
            cudnn=torch.backends.cudnn.version(),
        )
    if hasattr(os, "getloadavg"):
        info["loadavg_1_5_15_at_start"] = [round(v, 2) for v in os.getloadavg()]
    return info


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def add_dtype_arg(parser: argparse.ArgumentParser) -> None:
    """``--dtype float32|bfloat16`` (``--bf16`` is ``--dtype bfloat16``): the compute dtype of the timed steps.
    bfloat16 runs the forward under ``torch.autocast(bfloat16)`` with float32 weights, gradients and routers,
    as ``Trainer(bf16=True)`` and ``mode train --bf16`` do. Use it on CUDA: the experts' grouped GEMM runs
    torch's fast kernel (CUTLASS, sm90/sm100) in bfloat16 only; in float32 it takes a looped fallback that
    reads the expert offsets on the host (a host sync per GEMM), which is not what a GPU run should time."""
    parser.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        default="float32",
        help="float32 (default) or bfloat16 (forward under torch.autocast(bfloat16), weights "
        "float32; on CUDA the experts' fast grouped GEMM is bfloat16 only)",
    )
    parser.add_argument(
        "--bf16", dest="dtype", action="store_const", const="bfloat16", help="the same as --dtype bfloat16"
    )


def dtype_choice(name: str) -> torch.dtype | None:
    """The autocast dtype of a ``--dtype`` choice: None for float32 (no autocast), torch.bfloat16 for bfloat16."""
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r}: must be one of {tuple(DTYPES)}")
    return None if DTYPES[name] == torch.float32 else DTYPES[name]


def autocast(device: torch.device, dtype: torch.dtype | None):
    """``torch.autocast(device.type, dtype)``, or a context that does nothing when ``dtype`` is None."""
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def add_malloc_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--malloc",
        choices=("retain", "glibc"),
        default="retain",
        help="retain: keep freed CPU memory in the process (mode.cpu_allocator, the default); "
        "glibc: the C library's defaults, which unmap every block above 32 MiB on free",
    )


def apply_malloc(choice: str) -> dict:
    """Apply ``--malloc`` once, before anything is timed; the returned dict goes into the JSON."""
    if choice == "glibc":
        return dict(malloc="glibc", applied=False, reason="glibc defaults")
    from mode.cpu_allocator import retain_freed_memory

    return dict(malloc="retain", **dataclasses.asdict(retain_freed_memory()))


def minor_faults() -> int:
    """Minor page faults of this process so far (0 where ``resource`` is unavailable)."""
    try:
        import resource
    except ImportError:  # not on Unix
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fwd_bwd_step(
    module: nn.Module, x: Tensor, grad_out: Tensor, autocast_dtype: torch.dtype | None = None
) -> Callable[[], None]:
    """One training-like step: forward, backward of ``<y, grad_out> + aux.total()``, grads dropped first.

    The module follows the library convention ``module(x) -> (y, Aux)``. ``autocast_dtype``: run the forward
    under ``torch.autocast(x.device.type, autocast_dtype)`` (the backward follows the forward's dtypes).
    """
    params = [p for p in module.parameters() if p.requires_grad]

    def step() -> None:
        for p in params:
            p.grad = None
        x.grad = None
        with autocast(x.device, autocast_dtype):
            y, aux = module(x)
        total = aux.total()
        outs, grads = [y], [grad_out]  # autograd casts a float32 grad_out to a bfloat16 y's dtype
        if total.requires_grad:  # the dense baseline has no aux loss
            outs.append(total)
            grads.append(None)
        torch.autograd.backward(outs, grads)

    return step


def _timed(fn: Callable[[], None], device: torch.device) -> tuple[float, float, int]:
    """One call of ``fn``: (wall seconds, process CPU seconds, minor page faults), the device synced around it."""
    sync(device)
    f0 = minor_faults()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    sync(device)
    return time.perf_counter() - t0, time.process_time() - c0, minor_faults() - f0


def apply_run_args(args: argparse.Namespace, preset: dict) -> dict:
    """The preset with ``--repeats``/``--warmup`` applied (repeats must be >= 1), after ``--threads``
    (must be >= 1) has set torch's thread count."""
    cfg = dict(preset)
    for key in ("repeats", "warmup"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    if cfg["repeats"] < 1:
        raise SystemExit(f"--repeats={cfg['repeats']}: must be >= 1")
    if args.threads is not None:
        if args.threads < 1:
            raise SystemExit(f"--threads={args.threads}: must be >= 1")
        torch.set_num_threads(args.threads)
    return cfg


def time_pair(
    candidate: Callable[[], None], baseline: Callable[[], None], *, warmup: int, repeats: int, device: torch.device
) -> dict:
    """Warm both up, then ``repeats`` interleaved pairs; returns wall-clock medians (seconds), the median
    of the per-pair wall-clock ratios, the same ratio in process CPU time, and the median minor page
    faults per call of each side."""

    for _ in range(warmup):
        candidate()
        baseline()
    cand, base = [], []
    for i in range(repeats):
        if i % 2 == 0:  # alternate the order so neither side always runs on a "warmer" machine
            cand.append(_timed(candidate, device))
            base.append(_timed(baseline, device))
        else:
            base.append(_timed(baseline, device))
            cand.append(_timed(candidate, device))
    cand_s, base_s = [w for w, _, _ in cand], [w for w, _, _ in base]
    ratios = [c / b for c, b in zip(cand_s, base_s)]
    # CPU time of this process (all its threads): less sensitive to being descheduled by other processes,
    # but it also counts threads spin-waiting, so it is a second view, not a replacement for wall time.
    cpu_ratios = [c / b for (_, c, _), (_, b, _) in zip(cand, base) if b > 0]
    return {
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "candidate_s_median": statistics.median(cand_s),
        "baseline_s_median": statistics.median(base_s),
        "candidate_s": cand_s,
        "baseline_s": base_s,
        "cpu_ratio_median": statistics.median(cpu_ratios) if cpu_ratios else None,
        "candidate_cpu_s": [c for _, c, _ in cand],
        "baseline_cpu_s": [c for _, c, _ in base],
        # page faults per call: fresh memory from the OS being touched (see mode/cpu_allocator.py)
        "candidate_faults_median": statistics.median(f for _, _, f in cand),
        "baseline_faults_median": statistics.median(f for _, _, f in base),
    }


def time_interleaved(
    fns: dict[str, Callable[[], None]], baseline: str, *, warmup: int, repeats: int, device: torch.device
) -> dict[str, dict]:
    """Several candidates and one baseline, timed in rounds: every round runs each once, in an order that
    rotates from round to round (so no candidate always follows the same one), and each candidate's
    ratio is the median over rounds of its time / the baseline's time in the same round. Returns, per
    name, the same keys as :func:`time_pair` (the baseline's own ratio is 1)."""
    if baseline not in fns:
        raise ValueError(f"baseline={baseline!r}: must be one of {sorted(fns)}")

    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    runs: dict[str, list[tuple[float, float, int]]] = {name: [] for name in names}
    for i in range(repeats):
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order if i % 2 == 0 else order[::-1]:
            runs[name].append(_timed(fns[name], device))
    base = runs[baseline]
    out = {}
    for name, r in runs.items():
        wall = [w for w, _, _ in r]
        ratios = [w / b for (w, _, _), (b, _, _) in zip(r, base)]
        cpu_ratios = [c / b for (_, c, _), (_, b, _) in zip(r, base) if b > 0]
        out[name] = {
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "s_median": statistics.median(wall),
            "s": wall,
            "cpu_ratio_median": statistics.median(cpu_ratios) if cpu_ratios else None,
            "cpu_s": [c for _, c, _ in r],
            "faults_median": statistics.median(f for _, _, f in r),
        }
    return out


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """``columns``: (key, header, format spec); a missing or None value prints as '-'."""
    cells = [[h for _, h, _ in columns]]
    for r in rows:
        cells.append(["-" if r.get(k) is None else format(r[k], f) for k, _, f in columns])
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    for j, row in enumerate(cells):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if j == 0:
            print("  ".join("-" * w for w in widths))


def write_json(path: str | Path, payload: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def save_figure(fig, path: Path) -> None:
    """Lay out, write (creating the folder) and close a matplotlib figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)

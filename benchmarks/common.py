"""Timing helpers shared by the benchmarks: warm-up, then paired, interleaved repeats.

A candidate is always timed next to its baseline, in alternating order (A B, B A, A B, ...), and the
reported ratio is the median of the per-pair ratios: slow drift of the machine (other processes, clock
changes) hits both sides of a pair about equally, so ratios are far steadier than absolute times.
Thread count is left at torch's default; it is recorded with the results.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor, nn


def machine_info() -> dict:
    info = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    if hasattr(os, "getloadavg"):
        info["loadavg_1_5_15_at_start"] = [round(v, 2) for v in os.getloadavg()]
    return info


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fwd_bwd_step(module: nn.Module, x: Tensor, grad_out: Tensor) -> Callable[[], None]:
    """One training-like step: forward, backward of ``<y, grad_out> + aux.total()``, grads dropped first.

    The module follows the library convention ``module(x) -> (y, Aux)``.
    """
    params = [p for p in module.parameters() if p.requires_grad]

    def step() -> None:
        for p in params:
            p.grad = None
        x.grad = None
        y, aux = module(x)
        total = aux.total()
        outs, grads = [y], [grad_out]
        if total.requires_grad:  # the dense baseline has no aux loss
            outs.append(total)
            grads.append(None)
        torch.autograd.backward(outs, grads)

    return step


def time_pair(candidate: Callable[[], None], baseline: Callable[[], None], *, warmup: int, repeats: int,
              device: torch.device) -> dict:
    """Warm both up, then ``repeats`` interleaved pairs; returns medians (seconds) and the median ratio."""

    def timed(fn: Callable[[], None]) -> float:
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        return time.perf_counter() - t0

    for _ in range(warmup):
        candidate()
        baseline()
    cand_s, base_s = [], []
    for i in range(repeats):
        if i % 2 == 0:  # alternate the order so neither side always runs on a "warmer" machine
            cand_s.append(timed(candidate))
            base_s.append(timed(baseline))
        else:
            base_s.append(timed(baseline))
            cand_s.append(timed(candidate))
    ratios = [c / b for c, b in zip(cand_s, base_s)]
    return {
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "candidate_s_median": statistics.median(cand_s),
        "baseline_s_median": statistics.median(base_s),
        "candidate_s": cand_s,
        "baseline_s": base_s,
    }


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

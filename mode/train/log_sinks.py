"""What a training log says about speed, and where it goes besides ``log.jsonl``: the peak rate that model
FLOPs utilisation (MFU) is measured against, and TensorBoard event files (optional: the ``tb`` extra).

MFU = the model's training FLOPs per second / the devices' peak dense bf16 rate. The model FLOPs are the
trainer's (``mode.measure.flops.train_flops_per_token`` with the realized routing, summed over the ranks),
so work that does not count as the model's -- the recompute of activation checkpointing, gradient
accumulation's counting pass -- lowers MFU, as it should. The peak is one device's, times the processes.
It is read from ``PEAK_BF16_TFLOPS`` by the CUDA device's name, or given (``TrainConfig.peak_tflops``,
``mode train --peak-tflops``); on a CPU, and on a GPU not in the table, MFU is left out unless given.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

# torch.cuda.get_device_name(...) pattern, the product, dense bf16 tensor-core TFLOP/s (NVIDIA's datasheets,
# which print the rate "with sparsity": half of it). First match wins: the PCIe and NVL parts before the SXM.
PEAK_BF16_TFLOPS: tuple[tuple[str, str, float], ...] = (
    (r"H100.*PCIe", "H100 PCIe", 756.0),
    (r"H100.*NVL", "H100 NVL", 835.0),
    (r"H100", "H100 SXM", 989.0),
    (r"H200.*NVL", "H200 NVL", 835.0),
    (r"H200", "H200 SXM", 989.0),
    (r"A100", "A100", 312.0),
    (r"\bL4\b", "L4", 121.0),
    (r"\bA10\b", "A10", 125.0),  # not the A10G (AWS G5), whose rate NVIDIA does not publish: --peak-tflops
    (r"RTX 4090", "GeForce RTX 4090", 165.2),
)


def known_peak_tflops(device_name: str) -> tuple[str, float] | None:
    """``(product, dense bf16 TFLOP/s)`` for a CUDA device name, or None when it is not in the table."""
    for pattern, product, tflops in PEAK_BF16_TFLOPS:
        if re.search(pattern, device_name):
            return product, tflops
    return None


def peak_flops(device: torch.device, peak_tflops: float | None = None) -> float | None:
    """One device's peak FLOP/s for MFU: ``peak_tflops`` when given, else the table's rate for a CUDA device,
    else None (a CPU, an unknown GPU: no MFU)."""
    if peak_tflops is not None:
        return peak_tflops * 1e12
    if device.type != "cuda":
        return None
    known = known_peak_tflops(torch.cuda.get_device_name(device))
    return None if known is None else known[1] * 1e12


MATMUL_PROBE_N = 8192  # the measured ceiling: a bf16 (n, n) @ (n, n) matmul, 2 n^3 FLOPs


def measure_matmul_flops(device: torch.device, n: int = MATMUL_PROBE_N, repeats: int = 20) -> float:
    """The bf16 matmul rate this device reaches, FLOP/s: the median of ``repeats`` timed ``(n, n) @ (n, n)``
    products after a warm-up, each timed with CUDA events. The ceiling a training step's matmuls can reach
    on this card, clocks and power limit included (an H200 measured 763-768 TFLOP/s against the datasheet's
    989: docs/results-gpu.md), for a second MFU beside the datasheet's. CUDA only (ValueError elsewhere);
    about a second, and 3 n^2 bf16 values of memory while it runs."""
    if device.type != "cuda":
        raise ValueError(f"device={device}: the matmul ceiling is measured on a CUDA device only")
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    out = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        torch.mm(a, b, out=out)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.mm(a, b, out=out)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del a, b, out
    times.sort()
    return 2 * n**3 / times[len(times) // 2]


def mfu(flops: float, seconds: float, peak_total: float | None) -> float | None:
    """Model FLOPs utilisation: ``flops`` done in ``seconds`` against ``peak_total`` FLOP/s (all devices)."""
    if peak_total is None or seconds <= 0:
        return None
    return flops / seconds / peak_total


# A training record's number -> its TensorBoard tag (validation: "val/loss"; routing: "routing/<overall key>").
SCALAR_TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tok_s": "train/tok_s",
    "mfu": "train/mfu",
    "mfu_measured": "train/mfu_measured",
    "flops": "train/flops",
}


def summary_writer_class():
    """``torch.utils.tensorboard.SummaryWriter``, or a ValueError naming the extra to install (every rank
    checks, so that no rank trains on while another has stopped)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:  # torch's module imports the tensorboard package itself
        raise ValueError(
            f"tensorboard=True: needs the tensorboard package, which does not import here ({e}); "
            "install the extra: pip install 'mode-torch[tb]'"
        ) from None
    return SummaryWriter


class TensorBoardLog:
    """TensorBoard event files in ``log_dir``: every record's numbers, at its step (rank 0 writes them)."""

    def __init__(self, log_dir: str | Path):
        self.log_dir = Path(log_dir)
        self.writer = summary_writer_class()(log_dir=str(self.log_dir))

    def write(self, record: dict) -> None:
        """A training record (loss, lr, ...), a validation record (its loss only: its other numbers repeat the
        training record of the same step) or a routing record (its overall numbers)."""
        step = record["step"]
        if "val_loss" in record:
            scalars = {"val/loss": record["val_loss"]}
        elif "routing" in record:
            scalars = {f"routing/{k}": v for k, v in record["routing"].get("overall", {}).items()}
        else:
            scalars = {tag: record.get(key) for key, tag in SCALAR_TAGS.items()}
        for tag, value in scalars.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(tag, value, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()

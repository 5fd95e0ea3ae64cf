"""Bucketed group sizes for expert GEMMs whose kernels are compiled per shape.

On the CPU, bfloat16 and float16 matmuls run through oneDNN, which JIT-compiles a kernel for every new
(M, K, N) and keeps the last ~1024 in a cache. An expert's row count M changes from step to step, so a
bfloat16 MoE layer would compile a fresh kernel for almost every expert GEMM of every step: measured here
(torch 2.13, AVX-512 bf16), a (M, 64) @ (64, 256) bfloat16 matmul takes 80 us with a cached kernel and
700-2800 us with a new M, and a training step of the ``mode compare --quick`` MoE ran 4x slower in bf16
than in float32. float32 goes to MKL, which compiles nothing, and CUDA kernels take M as an argument.

The cure is to let M take few values. Each expert's rows are padded with zero rows up to a size that keeps
``SIGNIFICANT_BITS`` significant bits (at least a multiple of ``MIN_ROWS``): a group of 37 rows becomes 40,
one of 1000 becomes 1024, one of 1100 becomes 1152. The padding adds at most 1/16 of the rows (about 3%
on average) plus fewer than ``MIN_ROWS`` per expert, and M takes about 16 values per octave, a few hundred
kernels in all, which the cache holds. Zero rows change no output and no weight gradient. Where experts get
few rows each (``needed``), their counts span few values anyway and the layout is not used.

Shape legend
    A rows in (grouped by expert, then padding; ``mode.experts.bank``)   E experts   D features
    R = padded_capacity(A, E) rows in the bucketed layout: each expert's rows at a bucketed offset, the
      gaps and the rows past the last expert zero (a static size: no host sync)
"""

from __future__ import annotations

import torch
from torch import Tensor

SIGNIFICANT_BITS = 5  # sizes rounded up to 5 significant bits: at most 1/16 more rows per expert
MIN_ROWS = 8  # and to a multiple of 8 rows
MIN_MEAN_ROWS = 256  # bucket only where experts average at least this many rows (``needed``)


def bucket_sizes(counts_E: Tensor) -> Tensor:
    """Each count rounded up to ``SIGNIFICANT_BITS`` significant bits and to a multiple of ``MIN_ROWS``
    (0 stays 0). Exact integer arithmetic on the device: ``frexp`` gives each count's binary exponent."""
    _, exp_E = torch.frexp(counts_E.to(torch.float64))  # counts = m * 2**exp, 0.5 <= m < 1 (exact)
    step_E = torch.pow(2, (exp_E.to(torch.int64) - SIGNIFICANT_BITS).clamp(min=0)).clamp(min=MIN_ROWS)
    counts = counts_E.to(torch.int64)
    return (counts + step_E - 1) // step_E * step_E


def padded_capacity(num_rows: int, num_experts: int) -> int:
    """A static bound on the bucketed layout's rows: a count c grows by less than max(MIN_ROWS, c / 16)."""
    return num_rows + num_rows // 2 ** (SIGNIFICANT_BITS - 1) + (MIN_ROWS - 1) * num_experts


def bucketed_layout(counts_E: Tensor, num_rows: int) -> tuple[Tensor, Tensor, int]:
    """Where each of the A rows goes in the bucketed layout.

    Returns ``(offsets_E, dest_A, R)``: the int32 end offset of each expert's bucketed group (for
    ``grouped_mm``), the destination row of every input row (real rows of expert e move by the padding
    of the experts before it; padding rows go past the last group, in order), and the layout's static
    size ``R``. No host sync."""
    device = counts_E.device
    counts = counts_E.to(torch.int64)
    sizes_E = bucket_sizes(counts)
    ends_E = torch.cumsum(counts, 0)
    bucket_ends_E = torch.cumsum(sizes_E, 0)
    R = padded_capacity(num_rows, counts_E.shape[0])
    row_A = torch.arange(num_rows, device=device)
    expert_A = torch.searchsorted(ends_E, row_A, right=True)  # E for padding rows
    shift_E1 = torch.cat([bucket_ends_E - sizes_E - (ends_E - counts), counts.new_full((1,), R - num_rows)])
    dest_A = row_A + shift_E1[expert_A]
    return bucket_ends_E.to(torch.int32), dest_A, R


def needed(device_type: str, dtype: torch.dtype, num_rows: int, num_experts: int) -> bool:
    """Whether to bucket: oneDNN's reduced-precision matmuls on the CPU (kernels compiled per shape), and
    at least ``MIN_MEAN_ROWS`` rows per expert on average. With fewer, the counts stay in a narrow range
    that the kernel cache holds after a warm-up, and the layout's extra copies cost more than they save
    (measured, D=512, 4096 tokens, top-2, fresh routing every step: 64 experts (128 rows each) 204 ms
    exact vs 232 ms bucketed once warm; 8 experts (1024 rows each) 1.44 vs 1.27 of the dense MLP)."""
    return device_type == "cpu" and dtype in (torch.bfloat16, torch.float16) and num_rows >= MIN_MEAN_ROWS * num_experts

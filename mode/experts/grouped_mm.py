"""Grouped matrix multiply over expert segments, the fast path of the expert bank.

Shape legend: A assignments grouped by expert, K in-features, N out-features, E experts.
``grouped_mm(x_AK, w_EKN, counts_E)[a] = x_AK[a] @ w_EKN[e(a)]`` where e(a) is the expert whose
segment (given by ``counts_E``) holds row a.
"""

from __future__ import annotations

import torch
from torch import Tensor


def grouped_mm_available() -> bool:
    return hasattr(torch, "_grouped_mm")


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: ``torch._grouped_mm``'s
    backward rejects expanded gradients (e.g. the one ``.sum()`` produces)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.contiguous()


def grouped_mm(x_AK: Tensor, w_EKN: Tensor, offsets_E: Tensor) -> Tensor:
    """``offsets_E`` is the int32 cumulative sum of the per-expert counts (end of each segment)."""
    return _ContiguousGrad.apply(torch._grouped_mm(x_AK, w_EKN, offs=offsets_E))

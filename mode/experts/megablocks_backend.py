"""Optional MegaBlocks grouped-GEMM backend (CUDA only; ``pip install mode-torch[megablocks]``).

MegaBlocks ships ``grouped_gemm`` (CUTLASS grouped GEMM) whose ``gmm(a, b, batch_sizes)`` multiplies
row segments of ``a`` by the matching matrix of ``b``; ``batch_sizes`` must be an int64 CPU tensor.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor


def _import_gmm():
    try:
        from grouped_gemm.ops import gmm  # installed with megablocks
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise ValueError(
            "backend='megablocks': grouped_gemm (a MegaBlocks dependency) is not importable "
            f"({e}); install the optional extra on a CUDA machine or use backend='grouped'"
        ) from e
    return gmm


def require() -> None:
    if not torch.cuda.is_available():
        raise ValueError("backend='megablocks': needs a CUDA GPU; none is available here. "
                         "Use backend='grouped' or 'reference'.")
    _import_gmm()


def expert_mlp(x_AD: Tensor, counts_E: Tensor, w_in_EDF: Tensor, w_out_EHD: Tensor,
               act: Callable[[Tensor], Tensor]) -> Tensor:  # pragma: no cover - GPU only
    gmm = _import_gmm()
    sizes = counts_E.cpu()  # grouped_gemm wants host-side sizes: one device->host copy per call
    h_AF = gmm(x_AD, w_in_EDF.to(x_AD.dtype), sizes)
    return gmm(act(h_AF), w_out_EHD.to(x_AD.dtype), sizes)

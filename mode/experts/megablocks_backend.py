"""Optional MegaBlocks grouped-GEMM backend (CUDA, bfloat16; ``pip install "mode-torch[megablocks]"``).

Shape legend: A rows (the first N = counts_E.sum() grouped by expert, then padding), D hidden,
F expert hidden (H or 2H), E experts.

The kernel is ``grouped_gemm.ops.gmm(a, b, batch_sizes)`` from the ``grouped_gemm`` package, which
MegaBlocks pulls in with its ``gg`` extra (``megablocks[gg]==0.10.0`` -> ``grouped_gemm==0.3.0``). It
multiplies row segments of ``a`` by the matching matrix of ``b``. What it accepts (read from
grouped_gemm 0.3.0's csrc/grouped_gemm.cu):
    * CUDA tensors, bfloat16 only (a, b and the output);
    * a, b contiguous; ``batch_sizes`` an int64 CPU tensor (one device->host copy per call, as in
      MegaBlocks itself), one size per expert;
    * no check that the sizes add up to a's rows: rows past the sum are neither read nor written.
MegaBlocks 0.10.0 pins ``torch>=2.7.0,<2.7.1``; that torch has no ``torch._grouped_mm``, so on that
stack this is the only fast expert path (see docs/backends.md for the environment).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

INSTALL = 'pip install "mode-torch[megablocks]" on a CUDA machine with torch 2.7.0 (see docs/backends.md)'


def _import_gmm():
    try:
        from grouped_gemm.ops import gmm  # pyright: ignore[reportMissingImports] - megablocks[gg] has it
    except (ImportError, OSError) as e:  # OSError: the CUDA extension was built against another torch
        raise ValueError(
            f"backend='megablocks': grouped_gemm (MegaBlocks' grouped GEMM kernel) is not importable ({e}); "
            f"{INSTALL}, or use backend='grouped' or 'reference'"
        ) from e
    return gmm


@functools.cache
def megablocks_available() -> bool:
    """grouped_gemm imports here (cached: the import is tried once per process)."""
    try:
        _import_gmm()
    except ValueError:
        return False
    return True


def require() -> None:
    """Construction-time check: a CUDA GPU and an importable kernel."""
    if not torch.cuda.is_available():
        raise ValueError(
            "backend='megablocks': needs a CUDA GPU; none is available here. Use backend='grouped' or 'reference'."
        )
    _import_gmm()


def unsupported_reason(device_type: str, dtype: torch.dtype) -> str | None:
    """Why the kernel cannot run on (device_type, dtype), or None when it can."""
    if device_type != "cuda":
        return f"device={device_type!r} is not supported by grouped_gemm (CUDA only)"
    if dtype != torch.bfloat16:
        return f"dtype={dtype} is not supported by grouped_gemm (bfloat16 only)"
    if not megablocks_available():
        return f"grouped_gemm is not importable; {INSTALL}"
    return None


def expert_mlp(
    x_AD: Tensor,
    counts_E: Tensor,
    w_in_EDF: Tensor,
    w_out_EHD: Tensor,
    dtype: torch.dtype,
    act: Callable[[Tensor], Tensor],
) -> Tensor:
    """``act(x @ W_in[e]) @ W_out[e]`` per row, computed in ``dtype``; padding rows give zeros."""
    gmm = _import_gmm()
    reason = unsupported_reason(x_AD.device.type, dtype)
    if reason is not None:
        raise ValueError(f"backend='megablocks': {reason}")
    sizes_E = counts_E.to("cpu", torch.int64)  # grouped_gemm wants host-side sizes: one sync per call
    counts = sizes_E.tolist()
    num_rows = x_AD.shape[0]
    if any(c < 0 for c in counts):
        raise ValueError(f"counts_E={counts}: must be >= 0")
    num_real = sum(counts)
    if num_real > num_rows:
        raise ValueError(
            f"counts_E.sum()={num_real}: must be <= x_AD.shape[0]={num_rows} (rows past counts_E.sum() are padding)"
        )
    w_in, w_out = w_in_EDF.to(dtype), w_out_EHD.to(dtype)
    for name, w in (("w_in_EDF", w_in), ("w_out_EHD", w_out)):
        if not w.is_contiguous():  # a copy per call would hide a layout mistake; the kernel needs contiguous
            raise ValueError(
                f"{name}.stride()={w.stride()}: grouped_gemm needs contiguous expert weights "
                f"(shape {tuple(w.shape)}); call .contiguous() on the parameter once"
            )
    x_ND = x_AD[:num_real].to(dtype).contiguous()  # padding rows are never read: no NaN gets in
    h_NF = gmm(x_ND, w_in, sizes_E)
    y_ND = gmm(act(h_NF).contiguous(), w_out, sizes_E)
    return torch.cat([y_ND, y_ND.new_zeros(num_rows - num_real, y_ND.shape[1])])

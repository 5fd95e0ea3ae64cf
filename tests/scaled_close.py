"""One float comparison for results that two implementations sum in different orders.

``assert_close_scaled(actual, expected, rel)``: ``max |actual - expected| <= rel * max |expected|``, computed in
float64, per tensor. An element-wise ``atol``/``rtol`` of a few float32 ulps holds on one CPU and fails on the next:
how far a reordered sum moves an element depends on the GEMM kernel (AVX2 or AVX-512 MKL, AMX, oneDNN) and the
thread count, and a small element next to large ones carries the large ones' rounding. Scaling the bound to the
tensor keeps it meaningful (a wrong formula moves the result by far more) on every machine. The comparison goes
through ``torch.testing.assert_close`` so that ``MODE_TOLERANCE_LOG`` (tests/tolerance_log.py) logs its ratio
(1.0 = the bound) like any other.
"""

from __future__ import annotations

import torch


def assert_close_scaled(actual: torch.Tensor, expected: torch.Tensor, rel: float, what: str = "") -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert torch.isfinite(a).equal(torch.isfinite(e)), f"{what}: non-finite values differ"
    a, e = a.nan_to_num(), e.nan_to_num()
    scale = e.abs().max().item() if e.numel() else 0.0
    err = (a - e).abs().max().item() if e.numel() else 0.0
    f64 = torch.float64
    torch.testing.assert_close(
        torch.tensor(err, dtype=f64),
        torch.tensor(0.0, dtype=f64),
        rtol=0,
        atol=rel * scale + 1e-30,
        msg=f"{what}: max |d| = {err:.3g} > {rel:g} * max |expected| = {rel * scale:.3g}",
    )

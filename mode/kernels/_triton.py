"""Triton, found without importing it and imported only when a kernel is launched.

mode.kernels works without triton (it is Linux-only): the ops register their CUDA kernel where
``available()`` (triton is installed), and the kernel modules (``*_triton.py``), which import it, are
imported on the first launch. (torch._dynamo, which torch's optimizers and torch.compile load, imports triton
where it exists.)

``jit(fn)`` compiles a kernel function once per interpreter setting: ``triton.jit`` decides at decoration
time, from ``TRITON_INTERPRET``, whether the kernel compiles for a GPU or runs in triton's interpreter on
tensors in host memory, so the kernels are decorated here, lazily, not in their modules. A test can then
set ``TRITON_INTERPRET=1`` (tests/kernels/conftest.py) and launch the very kernels the CUDA ops launch on
CPU tensors, in the same process as compiled ones.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any

_TRUE = ("1", "true", "on", "yes")


@functools.cache
def available() -> bool:
    """Whether triton is installed (the CUDA kernels are registered only then)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for triton's interpreter (read as triton reads it)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE


_JITTED: dict[tuple[object, bool], object] = {}


def jit(fn) -> Any:
    """``triton.jit(fn)``, compiled for the GPU or interpreted as ``TRITON_INTERPRET`` says now (cached per
    setting). Typed Any: a kernel's launch ``jit(fn)[grid](..., BLOCK=8)`` passes plain values for its
    ``tl.constexpr`` parameters, which only triton's DSL accepts."""
    key = (fn, interpreting())
    kernel = _JITTED.get(key)
    if kernel is None:
        import triton

        kernel = _JITTED[key] = triton.jit(fn)
    return kernel


def check_launchable(name: str, *tensors) -> None:
    """A kernel runs on CUDA tensors, or on CPU tensors in triton's interpreter; anything else would fail
    deep inside triton ("0 active drivers")."""
    if not available():
        raise RuntimeError(f"{name}: triton is not installed (pip install triton; Linux only)")
    for t in tensors:
        if t is None:
            continue
        if t.device.type == "cuda":
            continue
        if t.device.type == "cpu" and interpreting():
            continue
        raise ValueError(
            f"{name}: a tensor on {t.device}: the Triton kernel runs on CUDA tensors, or on CPU "
            "tensors with TRITON_INTERPRET=1 set (triton's interpreter, for tests)"
        )


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())

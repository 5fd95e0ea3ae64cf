"""Keep freed CPU memory in the process, so large tensors allocated every step stop page-faulting.

PyTorch has a caching allocator on CUDA but not on CPU: a CPU tensor is plain ``malloc``/``free``.
glibc serves every block above its mmap threshold (adaptive, at most 32 MiB by default) with a fresh
``mmap`` and returns it to the OS on ``free``. A training step that allocates the same large tensors
every time (an expert bank's weight gradients: 2 x 256 MiB for 64 experts of 512 x 2048) therefore
page-faults all of that memory in again on every step. Measured on the 2-core CPU machine (1 thread,
E=64 top-1 MoE layer forward+backward): 150 000 minor faults and 0.3-1.0 s of system time per step;
after :func:`retain_freed_memory`, 0 faults per step.

:func:`retain_freed_memory` tells glibc (through ``mallopt``) to serve large blocks from its heap and
to keep freed memory there, which is what the CUDA caching allocator does for GPU memory: the resident
size stays at the peak working set. It changes the whole process, so the library never calls it on
import; applications opt in (the benchmarks do, see ``--malloc``). Preloading tcmalloc
(``LD_PRELOAD=libtcmalloc_minimal.so.4``) has the same effect without code.
"""

from __future__ import annotations

import ctypes
import platform
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from mode import _checks

# mallopt parameter numbers from glibc's <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3

MIB = 1 << 20
GIB = 1 << 30
INT_MAX = (1 << 31) - 1  # mallopt takes a C int


@dataclass(frozen=True)
class MallocTuning:
    """What :func:`retain_freed_memory` did: ``applied`` is False (with the reason) where it cannot run."""

    applied: bool
    reason: str
    mmap_threshold: int
    trim_threshold: int
    top_pad: int


def retain_freed_memory(
    *, mmap_threshold: int = GIB, trim_threshold: int = INT_MAX, top_pad: int = 64 * MIB
) -> MallocTuning:
    """Serve blocks below ``mmap_threshold`` bytes from the heap and keep up to ``trim_threshold`` bytes
    of freed memory at its top; grow the heap ``top_pad`` bytes beyond each request.

    Returns a :class:`MallocTuning`; on a C library other than glibc nothing changes and ``applied`` is
    False. Raises ``ValueError`` if glibc rejects a value (older glibc caps ``mmap_threshold`` at 32 MiB).
    """
    values = dict(mmap_threshold=mmap_threshold, trim_threshold=trim_threshold, top_pad=top_pad)
    for name, value in values.items():
        _checks.check_int(name, value, min_value=0)
        if value > INT_MAX:
            raise ValueError(f"{name}={value}: must be <= {INT_MAX} (mallopt takes a C int)")
    libc_name = platform.libc_ver()[0]
    if platform.system() != "Linux" or libc_name != "glibc":
        return MallocTuning(
            False, f"needs Linux with glibc (found {platform.system()}, {libc_name or 'unknown C library'})", **values
        )
    libc = ctypes.CDLL(None)
    mallopt = libc.mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # setting either threshold also turns off glibc's own adjustment of them (its dynamic mmap threshold)
    for name, param, value in (
        ("mmap_threshold", _M_MMAP_THRESHOLD, mmap_threshold),
        ("trim_threshold", _M_TRIM_THRESHOLD, trim_threshold),
        ("top_pad", _M_TOP_PAD, top_pad),
    ):
        if mallopt(param, value) != 1:
            raise ValueError(
                f"{name}={value}: rejected by this glibc's mallopt "
                f"(glibc {platform.libc_ver()[1]}; older versions cap mmap_threshold at 32 MiB)"
            )
    return MallocTuning(True, "glibc mallopt applied", **values)


_malloc_trim: Callable[[int], int] | Literal[False] | None = None  # None: not looked up yet; False: no glibc


def release_free_memory() -> bool:
    """Hand the C heap's free pages back to the OS: glibc's ``malloc_trim(0)``, which also releases the free
    holes between live blocks, not only the heap's top. Returns False (and does nothing) without glibc.

    ``mode.model.deferred_init`` calls it after dropping each large tensor of a replay, which draws full
    tensors one at a time: after glibc's first frees its adaptive mmap threshold serves such blocks from the
    heap, small allocations made meanwhile sit above them, and the freed blocks could not be trimmed, so the
    resident size climbed by about the shard size again over a replay (the model of
    tests/parallel/test_meta_init.py's memory check on (2, 2): a rank resident +221 MiB after materializing
    its 102 MiB shard without it, +109 MiB with it). It undoes :func:`retain_freed_memory`'s retention only
    of what is free at that moment."""
    global _malloc_trim
    if _malloc_trim is None:
        if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
            _malloc_trim = False
        else:
            trim = ctypes.CDLL(None).malloc_trim
            trim.argtypes = [ctypes.c_size_t]
            trim.restype = ctypes.c_int
            _malloc_trim = trim
    if _malloc_trim is False:
        return False
    _malloc_trim(0)
    return True

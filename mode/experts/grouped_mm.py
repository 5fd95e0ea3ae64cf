"""Grouped matrix multiply over expert segments, the fast path of the expert bank.

Shape legend: A rows grouped by expert, K in-features, N out-features, E experts.
``grouped_mm(x_AK, w_EKN, offsets_E)[a] = x_AK[a] @ w_EKN[e(a)]`` where e(a) is the expert whose
segment holds row a; ``offsets_E`` is the int32 cumulative row count (the end of each segment).
Rows at or past ``offsets_E[-1]`` are not written: they hold whatever memory the output had (the
expert bank masks them, see bank.py).

What ``torch._grouped_mm`` accepts (torch 2.13; checked on CPU, the CUDA rules read from
aten/src/ATen/native/GroupedMMUtils.h and cuda/GroupedBlas.cpp, which share the input checks):
    dtypes    float32, bfloat16, float16 on CPU and CUDA; not float64. On CUDA only bfloat16 on
              sm90/sm100 runs the CUTLASS kernel without a host sync; everything else falls back to a
              loop of ``mm`` over the groups that reads the offsets on the host.
    strides   every row stride a multiple of 16 bytes (on CPU too): K and N multiples of
              16 / itemsize, i.e. 4 for float32 and 8 for bfloat16/float16.
    offsets   int32, one per expert (int64 is rejected).
    pointers  16-byte aligned data pointers (CUDA; CPU too before torch 2.11): the ops copy a view that
              starts elsewhere.
    versions  torch 2.8 has the op for bfloat16 on sm90 only; the CPU and the other dtypes and GPUs came
              with 2.9's fallback path, so "grouped" needs torch>=2.9 here.
    groups    on CUDA at most 1023 groups (experts on one process): the CUTLASS kernel (GroupMM.cu) and
              cuBLASLt's grouped GEMM refuse 1024 or more. ``unsupported_reason`` refuses more on CUDA in
              every dtype, so that the rule does not depend on which kernel a GPU would pick.
    dw layout the backward's 2-D x 2-D form (dw) gets ``x_AK.t()`` column-major and ``dy_AN`` row-major:
              the one layout for which the CUDA kernel admits empty groups and group sizes that are not
              multiples of 8 (a row-major first operand trips device-side asserts that end the process), so
              ``_grouped_mm_t`` makes ``x_AK`` contiguous before transposing it.
Its meta kernel (what ``torch.compile`` traces with) only admits bfloat16, so it is wrapped here in a
custom op with its own shape function, backward and autocast rule:
    dx_AK = grouped_mm(dy_AN, w_EKN^T)                     (the same segments)
    dw_EKN[e] = x_AK[segment e]^T @ dy_AN[segment e]      (torch._grouped_mm's 2-D x 2-D form)
Under ``torch.autocast`` both ops cast their float32/float16/bfloat16 inputs to the autocast dtype of
the device (float64 is left alone, as autocast does for its own ops) and compute in it.

Compiled, on the bfloat16 CUDA path, ``grouped_mm`` calls ``torch._grouped_mm`` itself instead of the custom
op (``NATIVE_WHEN_COMPILING``): the meta kernel admits bfloat16, torch's own autograd formula gives the
backward, and inductor sees an aten op it has a lowering for (and can fuse the casts and the activation
around), where the custom op is opaque to it. Eager keeps the custom op, whose backward handles what the
native one does not: expanded gradients (AOTAutograd makes a compiled graph's incoming gradients contiguous),
misaligned views, and the exact zero gradient of an empty expert on sm100 (pytorch/pytorch#172439; sm90, the
H100/H200, writes zeros there itself).

The argument checks run before every eager call; they depend on metadata only (dims, the in/out sizes, the
dtypes, the device, the autocast dtype), so each distinct combination is checked once and cached.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import Tensor

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DEVICE_TYPES = ("cpu", "cuda", "meta")  # meta: the ops' shape functions (no kernel runs)
_DTYPE_NAMES = "float32, bfloat16, float16"
MIN_TORCH = (2, 9)
MAX_CUDA_GROUPS = 1023  # torch._grouped_mm on CUDA: "Can't process more than 1024 groups" (group_count < 1024)


def grouped_mm_available() -> bool:
    """torch 2.8 has ``torch._grouped_mm`` for bfloat16 on sm90 GPUs only (no CPU kernel, no other
    dtype); 2.9 added the fallback that runs it on the CPU, on other GPUs and in float32/float16."""
    return _available(torch.__version__, hasattr(torch, "_grouped_mm"))


@functools.lru_cache(maxsize=8)  # runs before every grouped GEMM: the version string is parsed once, not per call
def _available(version: str, has_op: bool) -> bool:
    major, minor = (int(p) for p in version.split("+")[0].split(".")[:2])
    return has_op and (major, minor) >= MIN_TORCH


class SlowPathWarning(UserWarning):
    """The grouped GEMM will run on CUDA in a dtype whose kernel is torch's slow fallback (not bfloat16)."""


_warned_slow: set[torch.dtype] = set()  # dtypes already warned about in this process


def warn_if_slow(device_type: str, dtype: torch.dtype) -> None:
    """Warn once per process and dtype when grouped GEMMs are about to run on CUDA in a dtype other than
    bfloat16: torch's fast kernel is bfloat16 only, and its fallback reads the offsets on the host (a host
    sync per GEMM, 6 per MoE layer and training step) and loops over the experts. Silent while
    ``torch.compile`` traces (a warning there would break the graph)."""
    if device_type != "cuda" or dtype == torch.bfloat16 or dtype in _warned_slow or torch.compiler.is_compiling():
        return
    _warned_slow.add(dtype)
    warnings.warn(
        f"mode.experts: expert GEMMs run in {dtype} on CUDA. torch._grouped_mm's fast kernel (CUTLASS, "
        "sm90/sm100) is bfloat16 only; in other dtypes it copies the expert offsets to the host (a host sync per "
        "GEMM: 2 per MoE layer forward, 6 per training step) and runs one matmul per expert. Compute in bfloat16: "
        "torch.autocast('cuda', dtype=torch.bfloat16) (Trainer(bf16=True), mode train --bf16, "
        "generate(..., bf16=True), the benchmarks' --bf16) or a bfloat16 model. (Said once per process.)",
        SlowPathWarning,
        stacklevel=2,
    )


def row_alignment(dtype: torch.dtype) -> int:
    """Elements per 16 bytes: every row length handed to the kernel must be a multiple of it."""
    return 16 // dtype.itemsize


def unsupported_reason(
    device_type: str, dtype: torch.dtype, sizes: dict[str, int], num_experts: int | None = None
) -> str | None:
    """Why ``torch._grouped_mm`` cannot run a grouped GEMM here, or None when it can.

    ``sizes`` names every row length (in features and out features) the GEMMs will see, e.g.
    ``{"d_model": 64, "d_hidden": 256}``; each must be a multiple of ``row_alignment(dtype)``.
    ``num_experts``: the groups of one call (the experts on this process); on CUDA at most
    ``MAX_CUDA_GROUPS``. A pure function of its arguments, cached (it runs before every grouped GEMM)."""
    return _unsupported_reason(grouped_mm_available(), device_type, dtype, tuple(sizes.items()), num_experts)


@functools.lru_cache(maxsize=1024)
def _unsupported_reason(
    available: bool, device_type: str, dtype: torch.dtype, sizes: tuple[tuple[str, int], ...], num_experts: int | None
) -> str | None:
    if not available:
        return (
            f"torch {torch.__version__} has no torch._grouped_mm that runs on CPU and in float32 "
            f"(it needs torch>={MIN_TORCH[0]}.{MIN_TORCH[1]})"
        )
    if device_type not in DEVICE_TYPES:
        return f"device={device_type!r} is not supported by torch._grouped_mm (cpu and cuda only)"
    if dtype not in SUPPORTED_DTYPES:
        return (
            f"dtype={dtype} is not supported by torch._grouped_mm ({_DTYPE_NAMES} on CPU and CUDA; "
            "the fast CUDA kernel is bfloat16 only)"
        )
    align = row_alignment(dtype)
    for name, size in sizes:
        if size % align:
            return (
                f"{name}={size} is not a multiple of {align}: torch._grouped_mm needs 16-byte aligned rows, "
                f"so in {dtype} every row length must be a multiple of {align} (8 for bfloat16/float16, "
                "4 for float32)"
            )
    if device_type == "cuda" and num_experts is not None and num_experts > MAX_CUDA_GROUPS:
        return (
            f"num_experts={num_experts} experts on one process: torch._grouped_mm on CUDA runs at most "
            f"{MAX_CUDA_GROUPS} groups (its kernels refuse 1024 or more); shard the experts over more "
            "expert-parallel processes"
        )
    return None


def check_grouped_mm_args(x_AK: Tensor, w_EKN: Tensor, offsets_E: Tensor) -> None:
    """Metadata checks only (no host sync); raises ValueError/TypeError naming the argument. Cached per
    combination of the metadata they read (module doc); traced uncached (sizes may be symbolic there)."""
    key = (
        tuple(x_AK.shape[1:]),
        x_AK.dim(),
        tuple(w_EKN.shape),
        tuple(offsets_E.shape),
        x_AK.dtype,
        w_EKN.dtype,
        offsets_E.dtype,
        x_AK.device.type,
        autocast_dtype(x_AK),
    )
    if torch.compiler.is_compiling():
        _check_metadata(*key)
    else:
        _check_metadata_cached(*key)


def _check_metadata(
    x_rest: tuple,
    x_dim: int,
    w_shape: tuple,
    off_shape: tuple,
    x_dtype: torch.dtype,
    w_dtype: torch.dtype,
    off_dtype: torch.dtype,
    device_type: str,
    cast_to: torch.dtype | None,
) -> None:
    if x_dim != 2 or len(w_shape) != 3:
        raise ValueError(
            f"x_AK.shape=(A, {', '.join(map(str, x_rest))}), w_EKN.shape={w_shape}: "
            "grouped_mm multiplies a 2-D x by a 3-D stack of expert weights"
        )
    if x_rest[0] != w_shape[1]:
        raise ValueError(f"x_AK.shape[1]={x_rest[0]}: must equal w_EKN.shape[1]={w_shape[1]}")
    if off_dtype != torch.int32:
        raise TypeError(f"offsets_E.dtype={off_dtype}: torch._grouped_mm needs int32 offsets")
    if len(off_shape) != 1 or off_shape[0] != w_shape[0]:
        raise ValueError(f"offsets_E.shape={off_shape}: must be ({w_shape[0]},), one end offset per expert")
    if cast_to is None and w_dtype != x_dtype:  # under autocast both are cast to one dtype
        raise TypeError(f"w_EKN.dtype={w_dtype}: must equal x_AK.dtype={x_dtype}")
    reason = unsupported_reason(
        device_type,
        cast_to or x_dtype,
        {"x_AK.shape[1]": w_shape[1], "w_EKN.shape[2]": w_shape[2]},
        num_experts=w_shape[0],
    )
    if reason is not None:
        raise ValueError(f"grouped_mm: {reason}")


_check_metadata_cached = functools.lru_cache(maxsize=512)(_check_metadata)  # a raise is not cached: it repeats


def autocast_dtype(t: Tensor) -> torch.dtype | None:
    """The dtype autocast casts ``t`` to for a matmul, or None where it leaves ``t`` alone (autocast off
    for t's device, or a float64 tensor, which autocast never casts)."""
    device_type = t.device.type
    if device_type not in ("cpu", "cuda", "xpu", "mps", "hpu"):  # devices autocast does not know (meta)
        return None
    if t.dtype != torch.float64 and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def _kernel_ready(t: Tensor) -> Tensor:
    """Runs inside the ops, on real tensors only (never traced), so it may look at data pointers."""
    if t.numel() == 0:
        # an empty tensor may carry any strides (the gradient of .sum() over zero rows is expanded,
        # strides (0, 0)) and .contiguous() keeps them; the kernel's stride check rejects those
        return t.new_empty(t.shape)
    if t.data_ptr() % 16:
        return t.clone()  # base pointers must be 16-byte aligned (CUDA's TMA loads; CPU too before 2.11)
    return t


if grouped_mm_available():

    @torch.library.custom_op("mode::grouped_mm", mutates_args=())
    def _grouped_mm_op(x_AK: Tensor, w_EKN: Tensor, offsets_E: Tensor) -> Tensor:
        return torch._grouped_mm(_kernel_ready(x_AK), _kernel_ready(w_EKN), offs=offsets_E)

    @_grouped_mm_op.register_fake
    def _(x_AK: Tensor, w_EKN: Tensor, offsets_E: Tensor) -> Tensor:
        return x_AK.new_empty(x_AK.shape[0], w_EKN.shape[-1])

    def _setup(ctx, inputs, output) -> None:
        x_AK, w_EKN, offsets_E = inputs
        ctx.save_for_backward(x_AK, w_EKN, offsets_E)

    def _backward(ctx, dy_AN: Tensor):
        x_AK, w_EKN, offsets_E = ctx.saved_tensors
        dy_AN = dy_AN.contiguous()  # the kernel rejects expanded gradients (e.g. from .sum())
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = _grouped_mm_op(dy_AN, w_EKN.transpose(-2, -1), offsets_E)
        if ctx.needs_input_grad[1]:
            dw = _grouped_mm_t(x_AK, dy_AN, offsets_E)
        return dx, dw, None

    @torch.library.custom_op("mode::grouped_mm_t", mutates_args=())
    def _grouped_mm_t(x_AK: Tensor, dy_AN: Tensor, offsets_E: Tensor) -> Tensor:
        # x_AK.t() must be column-major (x_AK row-major): the only 2-D x 2-D layout in which the CUDA kernel
        # admits empty groups and group sizes that are not multiples of 8 (module docstring, "dw layout")
        x_AK = x_AK.contiguous()
        dw_EKN = torch._grouped_mm(_kernel_ready(x_AK).t(), _kernel_ready(dy_AN), offs=offsets_E)
        if dw_EKN.device.type == "cuda":
            # An expert with no rows must get an exactly-zero gradient; the sm100 kernel has been reported
            # to leave other values there (pytorch/pytorch#172439). One pass over (E, K, N), backward only.
            counts_E = torch.diff(offsets_E, prepend=offsets_E.new_zeros(1))
            dw_EKN = torch.where(counts_E[:, None, None] > 0, dw_EKN, 0)
        return dw_EKN

    @_grouped_mm_t.register_fake
    def _(x_AK: Tensor, dy_AN: Tensor, offsets_E: Tensor) -> Tensor:
        return x_AK.new_empty(offsets_E.shape[0], x_AK.shape[1], dy_AN.shape[1])

    _grouped_mm_op.register_autograd(_backward, setup_context=_setup)

    # Autocast rule. torch.library.register_autocast casts to one dtype fixed at registration; this one
    # reads the dtype of the autocast region in force (bfloat16 on CPU by default, float16 or bfloat16
    # on CUDA), as torch's own matmuls do.
    _LIB = torch.library.Library("mode", "FRAGMENT")

    _AUTOCAST_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}

    def _register_autocast(op, name: str, device_type: str) -> None:
        def kernel(*args: Tensor) -> Tensor:
            dtype = torch.get_autocast_dtype(device_type)
            cast = [a.to(dtype) if a.is_floating_point() and a.dtype != torch.float64 else a for a in args]
            with torch.autocast(device_type, enabled=False):  # below this key: autograd, then the kernel
                return op(*cast)

        _LIB.impl(name, kernel, _AUTOCAST_KEYS[device_type])

    for _device_type in _AUTOCAST_KEYS:
        _register_autocast(_grouped_mm_op, "grouped_mm", _device_type)
        _register_autocast(_grouped_mm_t, "grouped_mm_t", _device_type)


# Device types on which a compiled graph calls torch._grouped_mm itself, in bfloat16 (module doc). The CPU is left
# out: its bfloat16 kernel is the fallback loop, the custom op's path is tested there; the tests add "cpu" here
# to trace the native path on a CPU.
NATIVE_WHEN_COMPILING: set[str] = {"cuda"}


def grouped_mm(x_AK: Tensor, w_EKN: Tensor, offsets_E: Tensor) -> Tensor:
    check_grouped_mm_args(x_AK, w_EKN, offsets_E)
    if torch.compiler.is_compiling() and x_AK.device.type in NATIVE_WHEN_COMPILING:
        dtype = autocast_dtype(x_AK) or x_AK.dtype
        if dtype == torch.bfloat16:
            return native_grouped_mm(x_AK, w_EKN, offsets_E)
    return _grouped_mm_op(x_AK, w_EKN, offsets_E)


def native_grouped_mm(x_AK: Tensor, w_EKN: Tensor, offsets_E: Tensor) -> Tensor:
    """``torch._grouped_mm`` in bfloat16 with torch's own backward: what a compiled graph calls (the inputs
    cast as the custom op's autocast rule would, outside autocast's own handling of the op)."""
    return torch._grouped_mm(x_AK.to(torch.bfloat16), w_EKN.to(torch.bfloat16), offs=offsets_E)

"""Validation helpers shared by every component.

Every user mistake becomes a ``ValueError`` or ``TypeError`` whose message names the field,
the offending value and the rule, e.g. ``capacity=1.5: must be in (0, 1]``.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import Tensor


def check_int(name: str, value: object, *, min_value: int = 1) -> int:
    """An integer (bools excluded) that is at least ``min_value``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r}: must be an int")
    if value < min_value:
        raise ValueError(f"{name}={value}: must be >= {min_value}")
    return value


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r}: must be a bool")
    return value


def check_fraction(name: str, value: object) -> float:
    """A real number in the half-open interval (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}={value!r}: must be a float in (0, 1]")
    if not (0.0 < float(value) <= 1.0) or math.isnan(value):
        raise ValueError(f"{name}={value}: must be in (0, 1]")
    return float(value)


def check_positive(name: str, value: object) -> float:
    """A finite real number strictly greater than zero."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}={value!r}: must be a positive float")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}={value}: must be finite and > 0")
    return float(value)


def check_non_negative(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}={value!r}: must be a non-negative float")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name}={value}: must be finite and >= 0")
    return float(value)


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name}={value!r}: must be one of {', '.join(map(repr, choices))}")
    return value  # type: ignore[return-value]


def check_hidden(name: str, x: Tensor, d_model: int, *, rank: int = 3, device: torch.device | None = None) -> None:
    """``x`` is a floating tensor of rank ``rank`` whose last dimension is ``d_model`` (on ``device``)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if device is not None:
        check_device(name, x, device)
    if not x.is_floating_point():
        raise TypeError(f"{name}.dtype={x.dtype}: must be a floating dtype (float32, bfloat16, ...)")
    if x.dim() != rank:
        raise ValueError(
            f"{name}.shape={tuple(x.shape)}: must have rank {rank} ({'(B, S, D)' if rank == 3 else '(T, D)'})"
        )
    if x.shape[-1] != d_model:
        raise ValueError(f"{name}.shape[-1]={x.shape[-1]}: must equal d_model={d_model}")


def check_mask(name: str, mask: Tensor | None, shape: tuple[int, ...], device: torch.device | None = None) -> None:
    """An optional boolean mask (True = real token) of exactly ``shape`` (on ``device``)."""
    if mask is None:
        return
    if device is not None and isinstance(mask, Tensor):
        check_device(name, mask, device)
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        raise TypeError(
            f"{name}: must be a torch.bool tensor (True = real token), got "
            f"{getattr(mask, 'dtype', type(mask).__name__)}"
        )
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"{name}.shape={tuple(mask.shape)}: must equal {tuple(shape)}")


def check_finite_logits(name: str, logits: Tensor) -> None:
    """Raise on NaN/inf router logits without making the host wait for the device.

    ``torch._assert_async`` queues the check on the device. On the CPU it runs at once and its
    ``RuntimeError`` becomes this ``ValueError``; on a GPU a failure surfaces as a device-side assert at
    the next synchronisation and ends the process (CUDA cannot recover from it). Routers skip the
    check with ``check_finite=False``.
    """
    finite = torch.isfinite(logits)
    try:
        torch._assert_async(finite.all(), f"{name}: router logits are NaN or inf")
    except RuntimeError as err:  # raised at once on the CPU: counting the bad logits costs nothing now
        bad = int((~finite).sum())
        raise ValueError(
            f"{name}: {bad} router logits are NaN or inf; router logits must be finite "
            "(check the input hidden states x and the learning rate)"
        ) from err


def check_finite_via(name: str, logits: Tensor, total: Tensor | None = None) -> None:
    """``check_finite_logits`` in three operators on a scalar instead of a pass over the logits: ``total`` is a
    reduction over every logit that is NaN or infinite whenever one of them is (a router's loss the step forms
    anyway; None: ``logits.sum()``, one operator more), and ``total * 0 == 0`` holds exactly when it is finite.
    Queued on the device as ``check_finite_logits`` is; on a failure (raised at once on the CPU) the logits are
    checked one by one for the message. A reduction that overflows although every logit is finite (logits
    beyond ~1e19 overflow a logsumexp squared) is refused too, naming that."""
    if logits.numel() == 0 or logits.device.type == "meta":
        return
    if total is None:
        total = logits.sum()
    try:
        torch._assert_async(total * 0 == 0, f"{name}: router logits are NaN or inf")
    except RuntimeError:
        check_finite_logits(name, logits)  # raises, naming how many logits are bad
        raise ValueError(
            f"{name}: the router's loss overflowed to inf although every logit is finite; router "
            "logits must stay moderate (check the input hidden states x and the learning rate)"
        ) from None


def check_finite_flag(name: str, finite: Tensor, logits: Tensor) -> None:
    """``check_finite_logits`` from a 0-dim bool ``finite`` an op computed over ``logits`` on the way (one
    operator: the queued assert); on a failure (raised at once on the CPU) the logits are counted for the message."""
    if logits.numel() == 0 or logits.device.type == "meta":
        return
    try:
        torch._assert_async(finite, f"{name}: router logits are NaN or inf")
    except RuntimeError:
        check_finite_logits(name, logits)  # raises, naming how many logits are bad
        raise


def assert_on_device(condition: Tensor, message: str) -> None:
    """Raise ``ValueError(message)`` unless the 0-dim bool ``condition`` holds, without a host sync: on a GPU
    the check is queued (a failure is a device-side assert at the next sync); on the CPU it runs at once."""
    if condition.device.type == "meta":
        return  # no values to check
    try:
        torch._assert_async(condition, message)
    except RuntimeError as err:
        raise ValueError(message) from err


def check_device(name: str, t: Tensor | None, device: torch.device) -> None:
    """``t`` lives on ``device`` (the module's parameters' device)."""
    if t is not None and t.device != device:
        raise ValueError(
            f"{name}.device={t.device}: must be the module's device {device} (move the input or the module with .to())"
        )


MAX_NUMEL = 2**62


def check_numel(names: str, *dims: int) -> None:
    """A tensor with these dimensions can exist (its element count fits torch's int64 sizes)."""
    if math.prod(dims) >= MAX_NUMEL:
        raise ValueError(f"{names}={dims}: a weight of that shape would hold more than 2**62 elements")


_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")


def at_least_float32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32, or unchanged when it is float64. Math that must not run in a low precision (routing
    scores, rotary embeddings, the loss) keeps a float64 model's precision: exactness checks (a mesh against one
    process, ``Trainer(dtype=torch.float64)``) rely on it, as float32 rounding would flip near-tied routing."""
    return t if t.dtype == torch.float64 else t.float()


def float32_region(device: torch.device):
    """A context in which autocast is off, so router math stays in float32 (top-k on bf16 logits ties
    far too often). A no-op context on devices autocast does not know (meta), and where autocast is already
    off (entering ``torch.autocast`` costs more than a decode step's router matmul)."""
    if device.type in _AUTOCAST_DEVICES and torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()

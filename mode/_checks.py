"""Validation helpers shared by every component.

Every user mistake becomes a ``ValueError`` or ``TypeError`` whose message names the field,
the offending value and the rule, e.g. ``capacity=1.5: must be in (0, 1]``.
"""

from __future__ import annotations

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


def check_hidden(name: str, x: Tensor, d_model: int, *, rank: int = 3) -> None:
    """``x`` is a floating tensor of rank ``rank`` whose last dimension is ``d_model``."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name}.dtype={x.dtype}: must be a floating dtype (float32, bfloat16, ...)")
    if x.dim() != rank:
        raise ValueError(
            f"{name}.shape={tuple(x.shape)}: must have rank {rank} ({'(B, S, D)' if rank == 3 else '(T, D)'})"
        )
    if x.shape[-1] != d_model:
        raise ValueError(f"{name}.shape[-1]={x.shape[-1]}: must equal d_model={d_model}")


def check_mask(name: str, mask: Tensor | None, shape: tuple[int, ...]) -> None:
    """An optional boolean mask (True = real token) of exactly ``shape``."""
    if mask is None:
        return
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"{name}: must be a torch.bool tensor (True = real token), got "
                        f"{getattr(mask, 'dtype', type(mask).__name__)}")
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"{name}.shape={tuple(mask.shape)}: must equal {tuple(shape)}")


def check_finite_logits(name: str, logits: Tensor) -> None:
    """Raise on NaN/inf router logits. Costs one host-device sync; routers skip it when
    ``check_finite=False``."""
    if not bool(torch.isfinite(logits).all()):
        bad = int((~torch.isfinite(logits)).sum())
        raise ValueError(
            f"{name}: {bad} router logits are NaN or inf; router logits must be finite "
            "(check the input hidden states and the learning rate)"
        )

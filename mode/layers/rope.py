"""Rotary position embedding at explicit positions.

Shape legend: B batch, H heads, S tokens, K head dim. Positions are the tokens' *original* indices in the
sequence, so a routed subset of tokens is rotated exactly as it would be in the full sequence.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mode import _checks


def rope_angles(positions_BS: Tensor, head_dim: int, base: float) -> tuple[Tensor, Tensor]:
    """cos and sin of shape (B, 1, S, K/2) for ``positions_BS``."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, device=positions_BS.device, dtype=torch.float32) / head_dim)
    angles_BSk = positions_BS.float()[..., None] * inv_freq
    return angles_BSk.cos()[:, None], angles_BSk.sin()[:, None]


def apply_rope(x_BHSK: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = _checks.at_least_float32(x_BHSK).chunk(2, dim=-1)  # float64 stays float64
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x_BHSK.dtype)

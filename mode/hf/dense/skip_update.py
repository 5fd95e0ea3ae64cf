"""``SkipUpdate``: what a token that skips a MoD layer's part gets instead of nothing, a cheap estimate of the
update it skipped (``to_mod(skip_rank=r)``).

Shape legend: B batch, S sequence, D hidden, R rank.

A skipped token's residual stream gets ``x + bias + (x @ down) @ up``: a rank-``R`` affine map of the
router's input (``skip_rank=0``: the constant ``bias`` alone, MoE++'s constant expert). It costs
``2 * D * R`` multiply-adds per token (R = 64 on SmolLM2: 74k, against the 885k of its attention
projections). FlexiDepth (arXiv 2503.23798) gives its skipped tokens a small adapter the same way.

Initialised to the zero update (``up`` zero, ``down`` small random, as LoRA does), so a freshly converted
layer is the plain skip until ``mode.hf.router_fit`` fits it in closed form (ridge regression of the
original model's updates on the skipped tokens' inputs, truncated to rank R) or ``router_tune`` trains it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class SkipUpdate(nn.Module):
    def __init__(self, d_model: int, rank: int):
        super().__init__()
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank <= d_model:
            raise ValueError(f"skip_rank={rank!r}: must be an int in [0, d_model={d_model}] (None: no estimate)")
        self.rank = rank
        self.bias = nn.Parameter(torch.zeros(d_model))
        self.down = nn.Parameter(torch.randn(d_model, rank) * d_model**-0.5)
        self.up = nn.Parameter(torch.zeros(rank, d_model))

    def forward(self, x_BSD: Tensor) -> Tensor:
        """The estimated update ``(B, S, D)`` (add it to ``x``)."""
        bias_D = self.bias.to(x_BSD.dtype)
        if self.rank == 0:
            return bias_D.expand_as(x_BSD)
        return (x_BSD @ self.down.to(x_BSD.dtype)) @ self.up.to(x_BSD.dtype) + bias_D

    @torch.no_grad()
    def fit(self, x_ND: Tensor, update_ND: Tensor, ridge: float = 0.1) -> float:
        """Least squares (ridge ``ridge`` times the mean feature variance per token) of ``update`` on ``x``,
        truncated to rank R by SVD; returns the share of the update's energy the fit leaves (1.0: no better
        than the plain skip)."""
        x_ND, update_ND = x_ND.double(), update_ND.double()
        N, D = x_ND.shape
        mean_x_D, mean_u_D = x_ND.mean(0), update_ND.mean(0)
        xc_ND, uc_ND = x_ND - mean_x_D, update_ND - mean_u_D
        if self.rank > 0:
            gram_DD = xc_ND.T @ xc_ND
            reg = ridge * N * xc_ND.var(0).mean().clamp_min(1e-12)
            w_DD = torch.linalg.solve(
                gram_DD + reg * torch.eye(D, dtype=gram_DD.dtype, device=gram_DD.device), xc_ND.T @ uc_ND
            )
            u_DD, s_D, vh_DD = torch.linalg.svd(w_DD, full_matrices=False)
            down_DR = u_DD[:, : self.rank] * s_D[: self.rank]
            up_RD = vh_DD[: self.rank]
            bias_D = mean_u_D - mean_x_D @ down_DR @ up_RD
            self.down.copy_(down_DR.to(self.down.dtype))
            self.up.copy_(up_RD.to(self.up.dtype))
        else:
            bias_D = mean_u_D
        self.bias.copy_(bias_D.to(self.bias.dtype))
        left = (update_ND - self(x_ND.to(self.bias.dtype)[None])[0].double()).pow(2).sum()
        return float(left / update_ND.pow(2).sum().clamp_min(1e-30))

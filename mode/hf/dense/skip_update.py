"""``SkipUpdate``: what a token that skips a MoD layer's part gets instead of nothing, a cheap estimate of the
update it skipped (``to_mod(skip_rank=r)``).

Shape legend: B batch, S sequence, D hidden, R rank, N tokens.

A skipped token's residual stream gets ``x + bias + (x @ down) @ up``: a rank-``R`` affine map of the
router's input (``skip_rank=0``: the constant ``bias`` alone, MoE++'s constant expert). It costs
``2 * D * R`` multiply-adds per token (R = 64 on SmolLM2: 74k, against the 885k of its attention
projections). FlexiDepth (arXiv 2503.23798) gives its skipped tokens a small adapter the same way.

Initialised to the zero update (``up`` zero, ``down`` small random, as LoRA does), so a freshly converted
layer is the plain skip until ``mode.hf.router_fit`` fits it in closed form (ridge regression of the
original model's updates on the skipped tokens' inputs, truncated to rank R; ``fit_moments`` fits the same from
running sums, ``UpdateMoments``) or ``router_tune`` trains it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mode.hf.dense.update_moments import UpdateMoments


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
        than the plain skip). The reference of ``fit_moments``, which fits the same from running sums."""
        if len(x_ND) == 0:
            raise ValueError("SkipUpdate.fit: x_ND has no tokens; a fit needs at least one")
        x_ND, update_ND = x_ND.double(), update_ND.double()
        mean_x_D, mean_u_D = x_ND.mean(0), update_ND.mean(0)
        xc_ND, uc_ND = x_ND - mean_x_D, update_ND - mean_u_D
        self._fit_centred(len(x_ND), mean_x_D, mean_u_D, xc_ND.T @ xc_ND, xc_ND.T @ uc_ND, ridge)
        left = (update_ND - self(x_ND.to(self.bias.dtype)[None])[0].double()).pow(2).sum()
        return float(left / update_ND.pow(2).sum().clamp_min(1e-30))

    @torch.no_grad()
    def fit_moments(self, moments: UpdateMoments, ridge: float = 0.1) -> float:
        """``fit`` from the running sums of the tokens (``UpdateMoments``) instead of the tokens themselves:
        the same fit and the same returned share, holding ``(D, D)`` sums instead of ``(N, D)`` streams."""
        mean_x_D, mean_u_D, gram_DD, cross_DD, energy = moments.centred()
        self._fit_centred(moments.n, mean_x_D, mean_u_D, gram_DD, cross_DD, ridge)
        # The energy the fit leaves, Σ|u - x A - b|² with A = down @ up, from the sums: with xc and uc centred and
        # δ the residual's mean (zero but for the parameters' float32 rounding) it is Σ|uc - xc A|² + n|δ|²,
        # and Σ|uc - xc A|² = Σ|uc|² - 2 tr(Aᵀ xcᵀuc) + tr(Aᵀ xcᵀxc A).
        a_DD = self.down.double() @ self.up.double()  # (D, D); zero at rank 0
        delta_D = mean_u_D - mean_x_D @ a_DD - self.bias.double()
        left = energy - 2 * (a_DD * cross_DD).sum() + (a_DD * (gram_DD @ a_DD)).sum() + moments.n * delta_D.pow(2).sum()
        total = energy + moments.n * mean_u_D.pow(2).sum()
        return float(left.clamp_min(0) / total.clamp_min(1e-30))

    def _fit_centred(
        self, n: int, mean_x_D: Tensor, mean_u_D: Tensor, gram_DD: Tensor, cross_DD: Tensor, ridge: float
    ) -> None:
        """Set the parameters from the float64 means, centred Gram matrix ``xcᵀxc`` and cross-products
        ``xcᵀuc`` of ``n`` tokens (what ``fit`` and ``fit_moments`` both reduce their tokens to)."""
        D = gram_DD.shape[0]
        if self.rank > 0:
            variance = gram_DD.diagonal().sum() / (D * max(n - 1, 1))  # the features' mean (unbiased) variance
            reg = ridge * n * variance.clamp_min(1e-12)
            eye_DD = torch.eye(D, dtype=gram_DD.dtype, device=gram_DD.device)
            w_DD = torch.linalg.solve(gram_DD + reg * eye_DD, cross_DD)
            u_DD, s_D, vh_DD = torch.linalg.svd(w_DD, full_matrices=False)
            down_DR = u_DD[:, : self.rank] * s_D[: self.rank]
            up_RD = vh_DD[: self.rank]
            bias_D = mean_u_D - mean_x_D @ down_DR @ up_RD
            self.down.copy_(down_DR.to(self.down.dtype))
            self.up.copy_(up_RD.to(self.up.dtype))
        else:
            bias_D = mean_u_D
        self.bias.copy_(bias_D.to(self.bias.dtype))

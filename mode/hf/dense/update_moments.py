"""``UpdateMoments``: the running sums a ``SkipUpdate`` fit needs, so that fitting a layer's estimate on many
tokens holds two ``(D, D)`` matrices instead of every token's input and update.

Shape legend: N tokens, D hidden.

The ridge fit of ``SkipUpdate.fit`` reads its tokens only through their count, their means, the centred Gram
matrix of the inputs, the centred cross-products of inputs and updates, and the updates' centred energy. Those
are sums over tokens, added batch by batch (``add``) and read out once (``centred``); ``SkipUpdate.fit_moments``
fits from them. Sums are kept in float64 about a shift (the first batch's means), so the raw second moments do
not cancel when they are centred.
"""

from __future__ import annotations

import torch
from torch import Tensor


class UpdateMoments:
    def __init__(self) -> None:
        self.n = 0
        self._sums: dict[str, Tensor] = {}  # float64, about the shift; made by the first tokens added

    def add(self, x_ND: Tensor, update_ND: Tensor) -> None:
        """Add ``N`` tokens' inputs and the updates to fit from them (any float dtype; summed in float64)."""
        if x_ND.ndim != 2 or x_ND.shape != update_ND.shape:
            raise ValueError(
                f"x_ND {tuple(x_ND.shape)} and update_ND {tuple(update_ND.shape)}: must both be (tokens, d_model)"
            )
        if len(x_ND) == 0:
            return
        x_ND, update_ND = x_ND.double(), update_ND.double()
        if not self._sums:
            D = x_ND.shape[1]
            self._sums = {"shift_x": x_ND.mean(0), "shift_u": update_ND.mean(0), "x": x_ND.new_zeros(D)}
            self._sums.update(u=x_ND.new_zeros(D), xx=x_ND.new_zeros(D, D), xu=x_ND.new_zeros(D, D))
            self._sums["uu"] = x_ND.new_zeros(())
        elif x_ND.shape[1] != self.d_model:
            raise ValueError(f"x_ND has {x_ND.shape[1]} features; earlier batches had {self.d_model}")
        s = self._sums
        xs_ND, us_ND = x_ND - s["shift_x"], update_ND - s["shift_u"]
        self.n += len(x_ND)
        s["x"] += xs_ND.sum(0)
        s["u"] += us_ND.sum(0)
        s["xx"] += xs_ND.T @ xs_ND
        s["xu"] += xs_ND.T @ us_ND
        s["uu"] += us_ND.pow(2).sum()

    @property
    def d_model(self) -> int:
        """The tokens' width (known once tokens were added)."""
        if not self._sums:
            raise ValueError("UpdateMoments: no tokens were added; a fit needs at least one")
        return self._sums["x"].shape[0]

    def centred(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """``(mean_x_D, mean_u_D, gram_DD, cross_DD, energy)`` in float64: the means, ``xcᵀxc``, ``xcᵀuc`` and
        ``Σ|uc|²`` of the centred inputs ``xc`` and updates ``uc`` of every token added."""
        if not self._sums:
            raise ValueError("UpdateMoments: no tokens were added; a fit needs at least one")
        s, n = self._sums, self.n
        mx_D, mu_D = s["x"] / n, s["u"] / n  # the means about the shift
        gram_DD = s["xx"] - n * torch.outer(mx_D, mx_D)
        cross_DD = s["xu"] - n * torch.outer(mx_D, mu_D)
        energy = s["uu"] - n * mu_D.pow(2).sum()
        return mx_D + s["shift_x"], mu_D + s["shift_u"], gram_DD, cross_DD, energy

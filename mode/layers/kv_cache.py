"""Per-layer key/value cache for generation with routed layers.

Shape legend: B batch, H heads, L cache capacity, K head dim, n rows taking part in a call, C new tokens.

Each sequence (row) has its own length: at a routed layer a sequence only stores the tokens it routed
through that layer, so rows fill at different rates. Keys are stored already rotated (RoPE at the
token's true position), so no positions are kept. A ``RowView`` restricts a call to a subset of rows
(the sequences whose current token was routed) and writes through to the parent cache.
"""

from __future__ import annotations

import torch
from torch import Tensor


class KVCache:
    def __init__(self, batch: int, n_heads: int, capacity: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        self.k_BHLK = torch.zeros(batch, n_heads, capacity, head_dim, dtype=dtype, device=device)
        self.v_BHLK = torch.zeros_like(self.k_BHLK)
        self.len_B = torch.zeros(batch, dtype=torch.long, device=device)

    @property
    def capacity(self) -> int:
        return self.k_BHLK.shape[2]

    def rows(self, rows_n: Tensor) -> "RowView":
        return RowView(self, rows_n)

    def all_rows(self) -> "RowView":
        return RowView(self, torch.arange(self.len_B.numel(), device=self.len_B.device))


class RowView:
    def __init__(self, cache: KVCache, rows_n: Tensor):
        self.cache, self.rows_n = cache, rows_n

    def extend(self, k_nHCK: Tensor, v_nHCK: Tensor, valid_nC: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """Attend-then-store helper: returns (keys, values, key_mask) covering the cached tokens followed by
        the C new ones, and appends the valid new tokens (which come first in each row) to the cache.

        keys/values: (n, H, Lc + C, K); key_mask: (n, Lc + C) True where a key exists.
        """
        c = self.cache
        n, _, C, _ = k_nHCK.shape
        len_n = c.len_B[self.rows_n]
        Lc = int(len_n.max()) if n else 0  # host sync: the widest cached prefix among these rows
        if Lc + C > c.capacity:
            raise ValueError(f"KV cache capacity={c.capacity}: cannot hold {Lc + C} tokens; "
                             "raise max_new_tokens' budget (capacity = prompt length + max_new_tokens)")
        ar = torch.arange(Lc, device=len_n.device)
        cached_mask_nL = ar[None, :] < len_n[:, None]
        new_mask_nC = torch.ones(n, C, dtype=torch.bool, device=len_n.device) if valid_nC is None else valid_nC
        keys = torch.cat([c.k_BHLK[self.rows_n, :, :Lc], k_nHCK], dim=2)
        values = torch.cat([c.v_BHLK[self.rows_n, :, :Lc], v_nHCK], dim=2)
        key_mask = torch.cat([cached_mask_nL, new_mask_nC], dim=1)

        # Append: the valid new tokens of row i go to slots len_i, len_i + 1, ...
        row_i, col_j = new_mask_nC.nonzero(as_tuple=True)
        dest = len_n[row_i] + col_j
        c.k_BHLK[self.rows_n[row_i], :, dest] = k_nHCK[row_i, :, col_j].to(c.k_BHLK.dtype)
        c.v_BHLK[self.rows_n[row_i], :, dest] = v_nHCK[row_i, :, col_j].to(c.v_BHLK.dtype)
        c.len_B[self.rows_n] += new_mask_nC.sum(1)
        return keys, values, key_mask

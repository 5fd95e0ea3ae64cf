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
        return RowView(self, None)


class RowView:
    """Rows ``rows_n`` of a cache (``None``: every row, read through views instead of copies)."""

    def __init__(self, cache: KVCache, rows_n: Tensor | None):
        self.cache, self.rows_n = cache, rows_n

    def extend(self, k_nHCK: Tensor, v_nHCK: Tensor, valid_nC: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """Store the valid new tokens (which come first in each row) after each row's cached ones, then
        return what the new queries attend over: (keys, values, allowed), with keys/values (n, H, L', K)
        holding every row's cached-plus-new tokens in order and allowed (n, C, L') True where query c may
        see key j: the row's earlier tokens and itself. A padding query sees its row's tokens (its output
        is discarded; it only needs a non-empty softmax row).
        """
        c, rows = self.cache, self.rows_n
        n, _, C, _ = k_nHCK.shape
        dev = c.len_B.device
        len_n = c.len_B.clone() if rows is None else c.len_B[rows]  # lengths before this call
        new_mask_nC = torch.ones(n, C, dtype=torch.bool, device=dev) if valid_nC is None else valid_nC
        count_n = new_mask_nC.sum(1)
        width = int((len_n + count_n).max()) if n else 0  # host sync: the longest row after this call
        if width > c.capacity:
            raise ValueError(f"KV cache capacity={c.capacity}: cannot hold {width} tokens; "
                             "raise max_new_tokens' budget (capacity = prompt length + max_new_tokens)")

        # Append in place: row i's valid new tokens go to slots len_i, len_i + 1, ...
        row_i, col_j = new_mask_nC.nonzero(as_tuple=True)
        cache_row = row_i if rows is None else rows[row_i]
        dest = len_n[row_i] + col_j
        c.k_BHLK[cache_row, :, dest] = k_nHCK[row_i, :, col_j].to(c.k_BHLK.dtype)
        c.v_BHLK[cache_row, :, dest] = v_nHCK[row_i, :, col_j].to(c.v_BHLK.dtype)
        c.len_B.index_add_(0, torch.arange(n, device=dev) if rows is None else rows, count_n)

        if rows is None:  # every row: plain slices are views, nothing is copied
            keys, values = c.k_BHLK[:, :, :width], c.v_BHLK[:, :, :width]
        else:
            keys, values = c.k_BHLK[rows, :, :width], c.v_BHLK[rows, :, :width]
        j_L = torch.arange(width, device=dev)
        own_slot_nC = len_n[:, None] + torch.arange(C, device=dev)  # a valid query's own key index
        row_end_nC = (len_n + count_n)[:, None].expand(n, C)
        limit_nC = torch.where(new_mask_nC, own_slot_nC + 1, row_end_nC)
        allowed_nCL = j_L[None, None, :] < limit_nC[..., None]
        return keys, values, allowed_nCL

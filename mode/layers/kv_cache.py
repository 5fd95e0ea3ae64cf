"""Per-layer key/value cache for generation with routed layers.

Shape legend: B batch, H heads, L cache capacity, K head dim, n rows taking part in a call, C new tokens,
W attended width (W <= L).

Each sequence (row) has its own length ``len_B`` (on the device, always exact): at a routed layer a row
only stores the tokens it routed through that layer, so rows fill at different rates. Keys are stored
already rotated (RoPE at the token's true position), so no positions are kept. A ``RowView`` restricts a
call to a subset of rows and writes through to the parent cache; nothing ever copies a cache.

The host keeps two facts so that decoding needs no host sync to size its work:
    ``bound``     an int no row's length exceeds (prompt length + decode calls; exact when ``host_len`` is)
    ``host_len``  every row's length as a list of ints, or None when only the device knows them (static
                  caches after a decode step; dynamic ones after a step in which some rows stored nothing)

Decoding (one new token per row, ``C == 1``) takes one of three writes:
    * static caches, and dynamic ones whose rows' lengths differ: a scatter at each row's ``len_B`` (rows
      that do not store their token, i.e. a static-path MoD row that skipped, write to a scratch slot past
      the capacity that is never read), then attention over a width taken from ``bound`` (rounded up to
      ``width_bucket`` when static) with a per-row length mask built on the device. Within one bucket a
      static step issues the same kernels with the same shapes every time (capture-ready for CUDA graphs);
    * dynamic, every row, equal lengths known on the host (dense layers at batch 1, equal prompts): a slice
      copy into slot ``L`` of every row, then attention over ``[:L+1]`` with no mask (flash-eligible);
    * dynamic, a subset of rows named by a host list (the routed rows): per row, a slice copy and
      attention over that row's own ``[:len+1]`` view, no mask.
None of them reads the device, copies cached keys/values, or has a data-dependent shape. Prefill and
other multi-token calls take ``RowView.extend`` (general, with host syncs for the width; allowed there).
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor


class KVCache:
    """Keys/values of one layer for ``batch`` rows of up to ``capacity`` tokens.

    ``static=True`` makes every decode call sync-free and shape-stable: the attended width is ``bound``
    rounded up to a multiple of ``width_bucket`` (so a CUDA graph or a compiled step sees few shapes);
    MoD layers then decide routing on the device (see ``mode.layers.mod``). ``static=False`` (the dynamic
    path) attends over exactly the tokens there are and lets MoD layers skip work, reading each MoD
    layer's routing decision on the host.
    """

    def __init__(
        self,
        batch: int,
        n_heads: int,
        capacity: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
        static: bool = False,
        width_bucket: int = 64,
    ):
        # device None: torch's default device (the CPU unless torch.set_default_device named another), as for
        # torch.zeros; a cache left on the CPU under a CUDA default device would fail in its first decode step
        # one slot past the capacity: the scratch slot that static-path rows which store nothing write to
        self._k_BHLK = torch.zeros(batch, n_heads, capacity + 1, head_dim, dtype=dtype, device=device)
        self._v_BHLK = torch.zeros_like(self._k_BHLK)
        self.k_BHLK, self.v_BHLK = self._k_BHLK[:, :, :capacity], self._v_BHLK[:, :, :capacity]
        self.len_B = torch.zeros(batch, dtype=torch.long, device=device)
        self.static = static
        self.width_bucket = width_bucket if static else 1
        self.bound = 0
        self.host_len: list[int] | None = [0] * batch
        self._rows_B = torch.arange(batch, device=device)  # made once: the scatter's row index
        self._slot_L = torch.arange(capacity, device=device)  # made once: key slot numbers for the mask
        self._ones_B = torch.ones(batch, dtype=torch.long, device=device)

    @property
    def capacity(self) -> int:
        return self.k_BHLK.shape[2]

    def reorder_rows(self, index_B: Tensor) -> None:
        """Row ``b`` becomes what row ``index_B[b]`` was (beam search keeps the beams it chose): keys, values and
        lengths, copied once."""
        index_B = index_B.to(self.len_B.device)
        self._k_BHLK = self._k_BHLK.index_select(0, index_B)
        self._v_BHLK = self._v_BHLK.index_select(0, index_B)
        capacity = self.capacity
        self.k_BHLK, self.v_BHLK = self._k_BHLK[:, :, :capacity], self._v_BHLK[:, :, :capacity]
        self.len_B = self.len_B.index_select(0, index_B)
        if self.host_len is not None:
            self.host_len = [self.host_len[i] for i in index_B.tolist()]

    def rows(self, rows_n: Tensor | list[int]) -> RowView:
        return RowView(self, rows_n)

    def all_rows(self) -> RowView:
        return RowView(self, None)

    def attend(self, q_BHCK: Tensor, k_BHCK: Tensor, v_BHCK: Tensor, valid_BC: Tensor | None) -> Tensor:
        """``RowView.attend`` over every row."""
        return RowView(self, None).attend(q_BHCK, k_BHCK, v_BHCK, valid_BC)

    # -------------------------------------------------------------------------------- host bookkeeping

    def _check_room(self, need: int) -> None:
        if need > self.capacity:
            raise ValueError(
                f"KV cache capacity={self.capacity}: cannot hold {need} tokens; raise max_new_tokens' "
                "budget (capacity = prompt length + max_new_tokens)"
            )

    def _width(self, bound: int) -> int:
        """Attended width for a row-length bound: the bound itself, or rounded up to the bucket (static)."""
        b = self.width_bucket
        return min(self.capacity, -(-bound // b) * b)

    def host_lengths(self) -> list[int]:
        """Every row's length on the host (reads ``len_B`` when only the device knows them: a host sync,
        which only the dynamic path and the general path ever take)."""
        if self.host_len is None:
            self.host_len = self.len_B.tolist()
        return self.host_len

    # -------------------------------------------------------------------------------------- decoding

    def decode_all(self, q_BH1K: Tensor, k_BH1K: Tensor, v_BH1K: Tensor, store_B: Tensor | None) -> Tensor:
        """One new token per row for every row: store it (only where ``store_B``, if given) after the row's
        cached tokens and attend over the row's tokens and itself. Returns the attention output."""
        if self.static:  # the host half, then the device half: what a CUDA graph of the step replays
            return self._scatter_attend(q_BH1K, k_BH1K, v_BH1K, store_B, self.advance_static())
        need = self.bound + 1
        self._check_room(need)
        lens = self.host_len
        if store_B is None and lens is not None and min(lens) == max(lens):
            L = lens[0]  # every row holds L tokens: plain slices, no index, no mask
            self._k_BHLK[:, :, L : L + 1].copy_(k_BH1K)
            self._v_BHLK[:, :, L : L + 1].copy_(v_BH1K)
            self.len_B.add_(1)
            self.host_len, self.bound = [L + 1] * len(lens), L + 1
            return F.scaled_dot_product_attention(q_BH1K, self._k_BHLK[:, :, : L + 1], self._v_BHLK[:, :, : L + 1])
        if store_B is None and lens is not None:  # every row stores: the lengths stay known on the host
            self.host_len, self.bound = [n + 1 for n in lens], max(lens) + 1
        else:  # which rows stored is known on the device only
            self.host_len, self.bound = None, need
        return self._scatter_attend(q_BH1K, k_BH1K, v_BH1K, store_B, self._width(self.bound))

    def static_step_width(self) -> int:
        """The width the next static decode step attends (host arithmetic only): a captured step is valid for
        as long as this stays the same (``mode.model.decode_graphs`` keys its CUDA graphs by it)."""
        return self._width(self.bound + 1)

    def advance_static(self) -> int:
        """The host half of a static decode step: check there is room for one more token per row, count it in
        ``bound`` (the lengths are then known on the device only) and return the width to attend. A replayed
        CUDA graph of a decode step runs kernels only, so its caller runs this for every cache first."""
        if not self.static:
            raise ValueError(
                "advance_static: this cache is dynamic (static=False); only static caches decode without the host"
            )
        need = self.bound + 1
        self._check_room(need)
        self.host_len, self.bound = None, need
        return self._width(need)

    def _scatter_attend(self, q_BH1K: Tensor, k_BH1K: Tensor, v_BH1K: Tensor, store_B: Tensor | None, W: int) -> Tensor:
        """The device half of a decode step over every row: no host state is read or written, every shape is
        fixed by ``W`` (capture-safe). Rows that store nothing (``store_B`` False) write to the scratch slot
        (index capacity), which is never attended; the mask lets each query see its row's tokens and itself."""
        limit_B1 = (self.len_B + 1)[:, None]  # a query sees its row's earlier tokens and its own slot
        if store_B is None:
            dest_B = self.len_B
        else:
            dest_B = torch.where(store_B, self.len_B, self.capacity)
        self._k_BHLK[self._rows_B, :, dest_B] = k_BH1K[:, :, 0].to(self._k_BHLK.dtype)
        self._v_BHLK[self._rows_B, :, dest_B] = v_BH1K[:, :, 0].to(self._v_BHLK.dtype)
        self.len_B.add_(1 if store_B is None else store_B)
        allowed_B11W = (self._slot_L[:W] < limit_B1)[:, None, None]
        return F.scaled_dot_product_attention(
            q_BH1K, self._k_BHLK[:, :, :W], self._v_BHLK[:, :, :W], attn_mask=allowed_B11W
        )

    def decode_rows(self, rows: list[int], rows_n: Tensor, q_nH1K: Tensor, k_nH1K: Tensor, v_nH1K: Tensor) -> Tensor:
        """``decode_all`` for the rows ``rows`` (a host list; ``rows_n`` the same on the device), each through
        a view of its own row: nothing is gathered or copied but the new token's key and value."""
        lens = self.host_lengths()
        out = []
        for i, r in enumerate(rows):
            L = lens[r]
            self._check_room(L + 1)
            self._k_BHLK[r : r + 1, :, L : L + 1].copy_(k_nH1K[i : i + 1])
            self._v_BHLK[r : r + 1, :, L : L + 1].copy_(v_nH1K[i : i + 1])
            out.append(
                F.scaled_dot_product_attention(
                    q_nH1K[i : i + 1], self._k_BHLK[r : r + 1, :, : L + 1], self._v_BHLK[r : r + 1, :, : L + 1]
                )
            )
            lens[r] = L + 1
            self.bound = max(self.bound, L + 1)
        self.len_B.index_add_(0, rows_n, self._ones_B[: len(rows)])
        return out[0] if len(out) == 1 else torch.cat(out)


class RowView:
    """Rows ``rows_n`` of a cache (``None``: every row, read through views instead of copies; a host list:
    the dynamic decode path's routed rows, with ``rows_t`` the same indices on the device)."""

    def __init__(self, cache: KVCache, rows_n: Tensor | list[int] | None, rows_t: Tensor | None = None):
        self.cache, self.rows_n = cache, rows_n
        if isinstance(rows_n, list) and rows_t is None:
            rows_t = torch.tensor(rows_n, dtype=torch.long, device=cache.len_B.device)
        self.rows_t = rows_t

    def attend(self, q_nHCK: Tensor, k_nHCK: Tensor, v_nHCK: Tensor, valid_nC: Tensor | None) -> Tensor:
        """Store the new keys/values (the valid ones) and return the queries' attention output over each
        row's cached-plus-new tokens (causal: a query sees its row's earlier tokens and itself)."""
        c, rows = self.cache, self.rows_n
        if q_nHCK.shape[2] == 1:  # decoding: one token per row
            if rows is None:
                return c.decode_all(q_nHCK, k_nHCK, v_nHCK, None if valid_nC is None else valid_nC[:, 0])
            if isinstance(rows, list) and valid_nC is None:  # a host list: __init__ made rows_t from it
                return c.decode_rows(rows, cast(Tensor, self.rows_t), q_nHCK, k_nHCK, v_nHCK)
        keys, values, allowed_nCL = self.extend(k_nHCK, v_nHCK, valid_nC)
        return F.scaled_dot_product_attention(q_nHCK, keys, values, attn_mask=allowed_nCL[:, None])

    def extend(self, k_nHCK: Tensor, v_nHCK: Tensor, valid_nC: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """The general path (prefill, several tokens per row): store the valid new tokens (which come first
        in each row) after each row's cached ones, then return what the new queries attend over: (keys,
        values, allowed), with keys/values (n, H, L', K) holding every row's cached-plus-new tokens in order
        and allowed (n, C, L') True where query c may see key j: the row's earlier tokens and itself. A
        padding query sees its row's tokens (its output is discarded; it only needs a non-empty softmax row,
        so a row that holds nothing yet lets it see the empty slot 0).
        """
        c, rows = self.cache, self.rows_n
        if isinstance(rows, list):
            rows = self.rows_t
        n, _, C, _ = k_nHCK.shape
        dev = c.len_B.device
        len_n = c.len_B.clone() if rows is None else c.len_B[rows]  # lengths before this call
        new_mask_nC = torch.ones(n, C, dtype=torch.bool, device=dev) if valid_nC is None else valid_nC
        count_n = new_mask_nC.sum(1)
        width = int((len_n + count_n).max()) if n else 0  # host sync: the longest row after this call
        c._check_room(width)

        # Append in place: row i's valid new tokens go to slots len_i, len_i + 1, ...
        row_i, col_j = new_mask_nC.nonzero(as_tuple=True)
        cache_row = row_i if rows is None else rows[row_i]
        dest = len_n[row_i] + col_j
        c.k_BHLK[cache_row, :, dest] = k_nHCK[row_i, :, col_j].to(c.k_BHLK.dtype)
        c.v_BHLK[cache_row, :, dest] = v_nHCK[row_i, :, col_j].to(c.v_BHLK.dtype)
        c.len_B.index_add_(0, torch.arange(n, device=dev) if rows is None else rows, count_n)
        c.host_len = c.len_B.tolist()  # host sync (general path only): decoding then knows every length
        c.bound = max(c.host_len, default=0)

        width = max(width, 1)
        if rows is None:  # every row: plain slices are views, nothing is copied
            keys, values = c.k_BHLK[:, :, :width], c.v_BHLK[:, :, :width]
        else:
            keys, values = c.k_BHLK[rows, :, :width], c.v_BHLK[rows, :, :width]
        j_L = torch.arange(width, device=dev)
        own_slot_nC = len_n[:, None] + torch.arange(C, device=dev)  # a valid query's own key index
        row_end_nC = (len_n + count_n).clamp_min(1)[:, None].expand(n, C)
        limit_nC = torch.where(new_mask_nC, own_slot_nC + 1, row_end_nC)
        allowed_nCL = j_L[None, None, :] < limit_nC[..., None]
        return keys, values, allowed_nCL

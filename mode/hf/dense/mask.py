"""Restricting the model's own attention mask to the routed tokens of a MoD layer.

Shape legend
    B batch   S tokens of this call (the queries)   P tokens seen before this call (the dense cache length)
    K = P + S dense key columns   C routed slots per row   J key columns the routed queries attend over

The model builds one 4D mask for the whole sequence (``(B or 1, 1, S, K)``: bool for sdpa, additive float
0 / finfo.min for eager, or None for sdpa's plain causal case). A MoD layer keeps the rows of its routed
queries and the columns of the keys they attend over (its cached routed keys and the new routed ones), so
padding, causality and any other pattern the model put into the mask carry over unchanged. Columns are
dense positions in the cache's coordinates: the position a token has in the unrouted sequence, pads included.
"""

from __future__ import annotations

import torch
from torch import Tensor


def check_mask(mask: Tensor | None, B: int, S: int, P: int) -> None:
    """The mask is one the MoD layer can restrict: None or 4D with one head and K = P + S dense columns."""
    if mask is None:
        return
    if not isinstance(mask, Tensor):  # flex attention's BlockMask, or a per-layer-type dict that was not resolved
        raise ValueError(
            f"attention_mask={type(mask).__name__}: a MoD layer needs a 4D tensor mask or None "
            "(sdpa or eager attention)"
        )
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[0] not in (1, B) or mask.shape[2] != S:
        raise ValueError(
            f"attention_mask.shape={tuple(mask.shape)}: a MoD layer needs (B or 1, 1, S, K) with "
            f"B={B}, S={S} (sdpa or eager attention)"
        )
    if mask.shape[3] != P + S:
        raise ValueError(
            f"attention_mask covers {mask.shape[3]} keys but the layer has seen {P} + {S} tokens: "
            "a sliding window shorter than the sequence (the mask's columns then stop being dense "
            "positions), which MoD layers do not support with a cache; keep the sequence within "
            "the window or convert only full-attention layers"
        )


def allowed(values: Tensor) -> Tensor:
    """A mask's entries as bool (True = may attend): sdpa's bool as is, eager's additive float where 0."""
    return values if values.dtype == torch.bool else values > torch.finfo(values.dtype).min / 2


def real_tokens(mask: Tensor | None, B: int, S: int, P: int) -> Tensor | None:
    """``real_BS``: True where a query may attend to itself (pads may not), or None when there is no mask."""
    if mask is None:
        return None
    s_S = torch.arange(S, device=mask.device)
    diag_BS = mask[:, 0, s_S, P + s_S]
    return allowed(diag_BS).expand(B, S)


def restrict(
    mask: Tensor | None,
    rows_BC: Tensor,
    query_col_BC: Tensor,
    cols_BJ: Tensor,
    col_ok_BJ: Tensor,
    valid_BC: Tensor,
    own_col_BC: Tensor,
    fmt: torch.dtype,
) -> Tensor:
    """The ``(B, 1, C, J)`` mask of the routed queries (rows ``rows_BC`` of the call, dense key column
    ``query_col_BC``) over the keys ``cols_BJ`` (dense columns; ``col_ok_BJ`` False for padding columns).

    An invalid query slot (a row with fewer routed tokens than C) may attend only its own key column
    ``own_col_BC``: its output is discarded, it only needs a softmax row that is not empty.
    ``fmt``: torch.bool for sdpa, the hidden dtype for eager (0 where allowed, finfo.min elsewhere).
    """
    B, C = rows_BC.shape
    J = cols_BJ.shape[1]
    if mask is None:  # sdpa's plain causal case: key column j is visible from query column q iff j <= q
        ok_BCJ = cols_BJ[:, None, :] <= query_col_BC[:, :, None]
    else:
        K = mask.shape[-1]
        m_BSK = mask[:, 0].expand(B, -1, -1)
        m_BCK = m_BSK.gather(1, rows_BC[..., None].expand(B, C, K))
        ok_BCJ = allowed(m_BCK.gather(2, cols_BJ[:, None, :].expand(B, C, J)))
    ok_BCJ = ok_BCJ & col_ok_BJ[:, None, :]
    own_BCJ = torch.arange(J, device=cols_BJ.device) == own_col_BC[..., None]
    ok_BCJ = torch.where(valid_BC[..., None], ok_BCJ, own_BCJ)
    if fmt == torch.bool:
        return ok_BCJ[:, None]
    zero = torch.zeros((), dtype=fmt, device=ok_BCJ.device)
    return torch.where(ok_BCJ, zero, torch.finfo(fmt).min)[:, None]


def gather_rows(t_XS: Tensor, slot_BC: Tensor) -> Tensor:
    """``t`` at the routed slots along dim 1: ``(B or 1, S, ...) -> (B, C, ...)``."""
    B, C = slot_BC.shape
    t_BS = t_XS.expand(B, *t_XS.shape[1:])
    index = slot_BC.view(B, C, *([1] * (t_BS.dim() - 2))).expand(B, C, *t_BS.shape[2:])
    return t_BS.gather(1, index)

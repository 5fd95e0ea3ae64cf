"""Attention in which every token writes its key and value but only the routed tokens ask a query
(``to_mod(kv="all")``; FlexiDepth, arXiv 2503.23798, keeps K/V of skipped tokens the same way).

Shape legend: B batch, S tokens of this call, D hidden, C routed slots per row, N query heads, G key/value
heads, K head dim, P tokens seen before this call, T = P + S key columns (the model's dense cache).

A pretrained layer's attention was trained with every earlier token visible. When the tokens a router skips
also write no K/V (``kv="routed"``), the routed tokens of that layer lose the skipped tokens' context. Here
the skipped tokens pay only the input norm and the K/V projections (for SmolLM2-135M: 2 x 576 x 192 of the
layer's 3.5M multiply-adds per token); their queries, the attention itself and the output projection are
skipped. The cache is the model's own dense one (transformers' ``DynamicLayer``): ``generate()`` then
stores exactly what the original model stores for this layer.

The computation is the attention module's own forward (Llama, Qwen2, Mistral write it the same way) with the
query rows restricted to the routed slots: its projections, its ``rotate_half``, its attention function
(sdpa or eager, chosen by the config), its scaling, and the model's own mask restricted to the routed rows.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from mode.hf.dense import mask as hf_mask


def _rope(x_BNLK: Tensor, cos_BLK: Tensor, sin_BLK: Tensor, rotate_half) -> Tensor:
    """The family's rotary embedding (``apply_rotary_pos_emb`` for one tensor)."""
    cos, sin = cos_BLK.unsqueeze(1), sin_BLK.unsqueeze(1)
    return (x_BNLK * cos) + (rotate_half(x_BNLK) * sin)


def _rows(rows_R: Tensor):
    def pick(t: Tensor) -> Tensor:
        return t if t.shape[0] == 1 else t.index_select(0, rows_R)

    return pick


def routed_query_attention(
    attn,
    h_BSD: Tensor,
    slot_BC: Tensor,
    valid_BC: Tensor,
    position_embeddings: tuple[Tensor, Tensor],
    attention_mask: Tensor | None,
    past_key_values,
    P: int,
    window: int | None,
    rows_R: Tensor | None = None,
    **kwargs,
) -> Tensor:
    """``attn``'s output ``(B, C, D)`` for the routed slots ``slot_BC`` of the normed input ``h_BSD``, every
    one of the S tokens writing its rotated key and value to ``past_key_values`` (if given) first.

    Slots with ``valid_BC`` False (rows that routed fewer than C tokens, pads) attend only to their own key;
    their output is meant to be discarded by the caller. ``rows_R`` (R row indices, or None: every row): only
    these rows ask queries, and the output is ``(R, C, D)`` (a decode step at batch B computes the rows whose
    token the router took; every row still writes its K/V)."""
    B, S, _ = h_BSD.shape
    C = slot_BC.shape[1]
    K = attn.head_dim
    family = sys.modules[type(attn).__module__]
    cos_BSK, sin_BSK = (t.expand(B, -1, -1) for t in position_embeddings)

    key_BGSK = _rope(attn.k_proj(h_BSD).view(B, S, -1, K).transpose(1, 2), cos_BSK, sin_BSK, family.rotate_half)
    value_BGSK = attn.v_proj(h_BSD).view(B, S, -1, K).transpose(1, 2)
    if past_key_values is not None:
        key_BGTK, value_BGTK = past_key_values.update(key_BGSK, value_BGSK, attn.layer_idx)
    else:
        key_BGTK, value_BGTK = key_BGSK, value_BGSK
    T = key_BGTK.shape[2]
    if C == 0:  # no routed token in this call: the K/V are written, nothing asks
        return h_BSD.new_zeros(B, 0, attn.o_proj.out_features)
    if rows_R is not None:  # the rows that ask; a tensor with one row is broadcast over the batch: kept
        pick = _rows(rows_R)
        h_BSD, slot_BC, valid_BC, key_BGTK, value_BGTK = map(pick, (h_BSD, slot_BC, valid_BC, key_BGTK, value_BGTK))
        position_embeddings = (pick(position_embeddings[0]), pick(position_embeddings[1]))
        attention_mask = None if attention_mask is None else pick(attention_mask)
        B = rows_R.numel()

    h_BCD = hf_mask.gather_rows(h_BSD, slot_BC)
    cos_BCK, sin_BCK = (hf_mask.gather_rows(t, slot_BC) for t in position_embeddings)
    query_BNCK = _rope(attn.q_proj(h_BCD).view(B, C, -1, K).transpose(1, 2), cos_BCK, sin_BCK, family.rotate_half)

    query_col_BC = P + slot_BC
    cols_BT = torch.arange(T, device=h_BSD.device).expand(B, T)
    fmt = torch.bool if attn.config._attn_implementation == "sdpa" else h_BSD.dtype
    sub_mask = hf_mask.restrict(
        attention_mask,
        slot_BC,
        query_col_BC,
        cols_BT,
        torch.ones_like(cols_BT, dtype=torch.bool),
        valid_BC,
        query_col_BC,
        fmt,
    )
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, family.eager_attention_forward)
    if window is not None:
        kwargs["sliding_window"] = window
    out_BCNK, _ = interface(
        attn,
        query_BNCK,
        key_BGTK,
        value_BGTK,
        sub_mask,
        dropout=0.0 if not attn.training else attn.attention_dropout,
        scaling=attn.scaling,
        **kwargs,
    )
    return attn.o_proj(out_BCNK.reshape(B, C, -1).contiguous())

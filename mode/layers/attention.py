"""Causal self-attention with RoPE at explicit positions, optionally over a KV cache.

Shape legend: B batch, S tokens, D hidden, H heads, K head dim (D = H * K), L cached tokens.

Tokens come in increasing position order (every routed subset does), so causality is the usual
lower-triangular mask over the token index. ``mask_BS`` hides padding / unused slots as keys (they sit
after the real tokens of their row); every query still sees itself so no softmax row is empty. With a
cache, the new tokens are appended to their rows first and queries attend over the cache itself (see
``RowView.attend``: decoding writes in place and reads views, never a copy of the cache).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mode import _checks
from mode.layers.kv_cache import RowView
from mode.layers.rope import apply_rope, rope_angles


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with rotary position embeddings (RoPE) at the tokens' given positions,
    optionally over a KV cache.

    Shape legend: B batch, S tokens, D hidden, H heads, K head dim (D = H * K).

    ``y = out(softmax(q k^T / sqrt(K) + causal mask) v)`` with ``q, k, v = qkv(x)`` and RoPE on q and k; no
    biases. Tokens come in increasing position order, so causality is the lower triangle over the token index.

    Args:
        d_model: the hidden size D.
        n_heads: the heads H; D / H must be even (RoPE rotates pairs).
        rope_base: RoPE's base (the wavelengths' scale).
    """

    def __init__(self, d_model: int, n_heads: int, rope_base: float = 10000.0):
        super().__init__()
        _checks.check_int("d_model", d_model)
        _checks.check_int("n_heads", n_heads)
        _checks.check_numel("(d_model, 3 * d_model)", d_model, 3 * d_model)
        if d_model % n_heads or (d_model // n_heads) % 2:
            raise ValueError(f"n_heads={n_heads}: d_model={d_model} must split into heads of even size")
        self.n_heads, self.head_dim, self.rope_base = n_heads, d_model // n_heads, rope_base
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)

    def forward(
        self, x_BSD: Tensor, positions_BS: Tensor, mask_BS: Tensor | None = None, cache: RowView | None = None
    ) -> Tensor:
        """Attend causally among the tokens of each row (and, with a cache, to the cached ones first).

        Args:
            x_BSD: the (normalised) hidden states.
            positions_BS: each token's position, for RoPE.
            mask_BS: None, or False at padding: hidden as keys (every query still sees itself).
            cache: a ``RowView`` of a ``KVCache``: the new keys and values are appended to it, then the
                queries attend over it.

        Returns:
            ``y_BSD``, the attention output (no residual added).
        """
        B, S, D = x_BSD.shape
        qkv_3BHSK = self.qkv(x_BSD).view(B, S, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        cos, sin = rope_angles(positions_BS, self.head_dim, self.rope_base)
        q, k = apply_rope(qkv_3BHSK[:2], cos, sin)  # q and k rotated together: one set of elementwise ops
        v = qkv_3BHSK[2]
        if cache is not None:
            o_BHSK = cache.attend(q, k, v, mask_BS)
        elif mask_BS is None:
            o_BHSK = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            allowed_BSS = torch.tril(torch.ones(S, S, dtype=torch.bool, device=x_BSD.device)) & mask_BS[:, None, :]
            allowed_BSS |= torch.eye(S, dtype=torch.bool, device=x_BSD.device)
            o_BHSK = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed_BSS[:, None])
        return self.out(o_BHSK.transpose(1, 2).reshape(B, S, D))

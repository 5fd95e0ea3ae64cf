"""Pre-norm transformer block whose MLP is pluggable (dense ``MLP``, ``MoELayer``, ``IntegratedMoDE``).

Shape legend: B batch, S tokens, D hidden.

``forward(x_BSD, positions_BS=None, mask_BS=None) -> (y_BSD, Aux)`` with ``y = h + mlp(norm(h))`` and
``h = x + attn(norm(x))``. ``positions_BS`` are the tokens' original positions (RoPE); ``mask_BS`` marks
real tokens (False = padding: hidden as keys, ignored by routers). ``MoD`` wraps it, or any module whose
``forward`` takes the tokens first (``mode.layers.block_call`` says what else it passes).

Called by keyword, a block and a ``MoD`` layer take the same arguments (the LM calls every layer the same
way): ``layer(x_BSD, mask_BS=..., positions_BS=..., cache=..., causal=...)``. ``cache`` may be a
``KVCache`` (every row) or a ``RowView``; ``causal`` is accepted and has nothing to decide here (token-choice
routing without capacity is causal by construction).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mode import _checks
from mode.layers.attention import CausalSelfAttention
from mode.layers.kv_cache import KVCache, RowView
from mode.routing.plan import Aux


class TransformerBlock(nn.Module):
    """A pre-norm transformer block: ``h = x + attn(norm(x))``, ``y = h + mlp(norm(h))``, with RMSNorm, causal
    self-attention with RoPE, and a pluggable MLP (``MLP``, ``MoELayer``, ``IntegratedMoDE``).

    Shape legend: B batch, S tokens, D hidden.

    Args:
        d_model: the hidden size D.
        n_heads: the attention heads (D / n_heads must be even).
        mlp: the feed-forward layer, any module called ``mlp(x_BSD, mask_BS) -> (y_BSD, Aux)``.
        rope_base: RoPE's base.
        norm_eps: the RMSNorms' epsilon.
    """

    def __init__(self, d_model: int, n_heads: int, mlp: nn.Module, rope_base: float = 10000.0, norm_eps: float = 1e-6):
        super().__init__()
        _checks.check_int("d_model", d_model)
        _checks.check_int("n_heads", n_heads)
        if not isinstance(mlp, nn.Module):
            raise TypeError(f"mlp={type(mlp).__name__}: must be an nn.Module called as mlp(x_BSD, mask_BS)")
        self.d_model = d_model
        self.attn_norm = nn.RMSNorm(d_model, eps=norm_eps)
        self.attn = CausalSelfAttention(d_model, n_heads, rope_base)
        self.mlp_norm = nn.RMSNorm(d_model, eps=norm_eps)
        self.mlp = mlp  # (x_BSD, mask_BS) -> (y_BSD, Aux)

    def forward(
        self,
        x_BSD: Tensor,
        positions_BS: Tensor | None = None,
        mask_BS: Tensor | None = None,
        cache: KVCache | RowView | None = None,
        causal: bool = False,
    ) -> tuple[Tensor, Aux]:
        """Run attention and the MLP on every token.

        Args:
            x_BSD: the hidden states.
            positions_BS: the tokens' positions, for RoPE (default ``0 .. S-1``).
            mask_BS: None, or False at padding (hidden as keys, ignored by the MLP's router).
            cache: a ``KVCache`` (every row) or a ``RowView``: attend to and append to these rows' cache
                (generation).
            causal: accepted so that the LM calls every layer alike; nothing to decide here.

        Returns:
            ``(y_BSD, aux)``: the block's output (residuals included) and the MLP's ``Aux`` under "moe.".
        """
        dev = self.attn_norm.weight.device
        _checks.check_hidden("x", x_BSD, self.d_model, device=dev)
        _checks.check_mask("mask", mask_BS, x_BSD.shape[:2], device=dev)
        if isinstance(cache, KVCache):
            cache = cache.all_rows()
        if positions_BS is None:
            positions_BS = torch.arange(x_BSD.shape[1], device=x_BSD.device).expand(x_BSD.shape[0], -1)
        h_BSD = x_BSD + self.attn(self.attn_norm(x_BSD), positions_BS, mask_BS, cache)
        m_BSD, mlp_aux = self.mlp(self.mlp_norm(h_BSD), mask_BS)
        return h_BSD + m_BSD, Aux().merge(mlp_aux, "moe.")

"""Pre-norm transformer block whose MLP is pluggable (dense ``MLP``, ``MoELayer``, ``IntegratedMoDE``).

Shape legend: B batch, S tokens, D hidden.

``forward(x_BSD, positions_BS=None, mask_BS=None) -> (y_BSD, Aux)`` with ``y = h + mlp(norm(h))`` and
``h = x + attn(norm(x))``. ``positions_BS`` are the tokens' original positions (RoPE); ``mask_BS`` marks
real tokens (False = padding: hidden as keys, ignored by routers). This is the block protocol that
``MoD`` wraps; any user module with the same call works there too.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mode.layers.attention import CausalSelfAttention
from mode.layers.kv_cache import RowView
from mode.routing.plan import Aux


class TransformerBlock(nn.Module):
    def __init__(self, d_model: int, n_heads: int, mlp: nn.Module, rope_base: float = 10000.0,
                 norm_eps: float = 1e-6):
        super().__init__()
        self.attn_norm = nn.RMSNorm(d_model, eps=norm_eps)
        self.attn = CausalSelfAttention(d_model, n_heads, rope_base)
        self.mlp_norm = nn.RMSNorm(d_model, eps=norm_eps)
        self.mlp = mlp  # (x_BSD, mask_BS) -> (y_BSD, Aux)

    def forward(self, x_BSD: Tensor, positions_BS: Tensor | None = None, mask_BS: Tensor | None = None,
                cache: RowView | None = None) -> tuple[Tensor, Aux]:
        """``cache``: attend to and append to these rows' KV cache (generation)."""
        if positions_BS is None:
            positions_BS = torch.arange(x_BSD.shape[1], device=x_BSD.device).expand(x_BSD.shape[0], -1)
        h_BSD = x_BSD + self.attn(self.attn_norm(x_BSD), positions_BS, mask_BS, cache)
        m_BSD, mlp_aux = self.mlp(self.mlp_norm(h_BSD), mask_BS)
        return h_BSD + m_BSD, Aux().merge(mlp_aux, "moe.")

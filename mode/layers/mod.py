"""Mixture-of-Depths wrapper: run any block on the top-C tokens of each sequence, skip the rest.

Shape legend: B batch, S tokens, D hidden, C routed slots per sequence, n rows with a routed token.

For routed tokens ``x <- x + r * (block(x_routed) - x)``: the router weight scales the block's delta,
never the residual. The block sees only the routed tokens (so attention is among routed tokens, causal
in their original order) together with their original positions (so RoPE sees true positions). Skipped
tokens are copied through bit for bit.

Block protocol: ``block(x_BCD, positions_BC, mask_BC) -> y_BCD`` or ``(y_BCD, Aux)``, where ``mask_BC``
is None or marks slots holding real routed tokens (they come first in each row). For generation the
block also takes ``cache=`` (a ``RowView`` of a ``KVCache``), as ``TransformerBlock`` does. ``C`` may be
0 (an empty sequence, or causal routing that routed nothing): by default the block is then skipped,
but ``skip_empty=False`` calls it on the empty ``(B, 0, D)`` input, which a block holding collectives
needs (every rank must enter an expert-parallel all-to-all, whatever its routing).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mode import _checks
from mode.layers.block import TransformerBlock
from mode.layers.kv_cache import KVCache
from mode.layers.moe import MoELayer
from mode.routing.mod_topk import MoDRouter
from mode.routing.plan import Aux


class MoD(nn.Module):
    def __init__(self, block: nn.Module, router: MoDRouter, skip_empty: bool = True):
        super().__init__()
        if not isinstance(router, MoDRouter):
            raise TypeError(f"router={type(router).__name__}: must be a MoDRouter")
        if not isinstance(block, nn.Module):
            raise TypeError(f"block={type(block).__name__}: must be an nn.Module")
        self.block = block
        self.router = router
        self.scale_delta = router.cfg.gate != "one"  # gate "one": routed tokens take the block output as is
        # Skip the block when no token is routed (decoding: most steps), unless the block holds collectives;
        # mode.parallel turns this off for blocks it makes expert-parallel.
        self.skip_empty = _checks.check_bool("skip_empty", skip_empty)

    def forward(self, x_BSD: Tensor, mask_BS: Tensor | None = None, *, positions_BS: Tensor | None = None,
                cache: KVCache | None = None, causal: bool = False) -> tuple[Tensor, Aux]:
        """``causal=True`` routes by the causal decision (see ``MoDRouter``); ``cache`` appends the routed
        tokens' keys/values to this layer's cache (skipped tokens write nothing)."""
        plan = self.router(x_BSD, mask_BS, causal=causal)  # validates x
        aux = Aux().merge(plan.aux, "mod.")
        B, S, D = x_BSD.shape
        C = plan.seq_capacity
        if C == 0 and self.skip_empty:  # an empty sequence, or causal routing sent no token through the block
            return x_BSD, aux
        slot_BC = plan.token_idx_A.view(B, C) - torch.arange(B, device=x_BSD.device)[:, None] * S
        index_BCD = slot_BC[..., None].expand(B, C, D)
        x_BCD = x_BSD.gather(1, index_BCD)
        pos_BC = slot_BC if positions_BS is None else positions_BS.gather(1, slot_BC)
        valid_BC = None if plan.valid_A is None else plan.valid_A.view(B, C)

        if cache is None:
            out = self.block(x_BCD, pos_BC, valid_BC)
        else:
            out = self._block_on_routed_rows(x_BCD, pos_BC, valid_BC, cache)
        y_BCD, block_aux = out if isinstance(out, tuple) else (out, Aux())
        if self.scale_delta:
            y_BCD = x_BCD + plan.weight_A.view(B, C, 1).to(x_BCD.dtype) * (y_BCD - x_BCD)
        if valid_BC is not None:
            y_BCD = torch.where(valid_BC[..., None], y_BCD, x_BCD)  # unrouted / padding slots make no update
        return x_BSD.scatter(1, index_BCD, y_BCD), aux.merge(block_aux)

    def _block_on_routed_rows(self, x_BCD: Tensor, pos_BC: Tensor, valid_BC: Tensor | None,
                              cache: KVCache) -> tuple[Tensor, Aux]:
        """Run the block only for sequences with at least one routed token (decode: often few of them)."""
        if valid_BC is None:
            return self.block(x_BCD, pos_BC, None, cache=cache.all_rows())
        rows_n = valid_BC.any(1).nonzero().squeeze(1)
        out = self.block(x_BCD[rows_n], pos_BC[rows_n], valid_BC[rows_n], cache=cache.rows(rows_n))
        y_nCD, block_aux = out if isinstance(out, tuple) else (out, Aux())
        return x_BCD.index_copy(0, rows_n, y_nCD), block_aux


class StagedMoDE(MoD):
    """Staged MoDE (Raposo et al. 2024, sec. 5): MoD routing in front of a block whose MLP is an MoE.

    Skipped tokens skip attention *and* the experts; routed tokens then go through the MoE router.
    """

    def __init__(self, block: TransformerBlock, router: MoDRouter, skip_empty: bool = True):
        if not isinstance(getattr(block, "mlp", None), MoELayer):
            raise TypeError(f"block.mlp={type(getattr(block, 'mlp', None)).__name__}: staged MoDE needs a "
                            "TransformerBlock whose mlp is a MoELayer")
        super().__init__(block, router, skip_empty)

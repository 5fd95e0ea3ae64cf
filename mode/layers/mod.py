"""Mixture-of-Depths wrapper: run any block on the top-C tokens of each sequence, skip the rest.

Shape legend: B batch, S tokens, D hidden, C routed tokens per sequence.

For routed tokens ``x <- x + r * (block(x_routed) - x)``: the router weight scales the block's delta,
never the residual. The block sees only the routed tokens (so attention is among routed tokens, causal
in their original order) together with their original positions (so RoPE sees true positions). Skipped
tokens are copied through bit for bit.

Block protocol: ``block(x_BCD, positions_BC, mask_BC) -> y_BCD`` or ``(y_BCD, Aux)``, where ``mask_BC``
is None or marks slots holding real tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mode.layers.block import TransformerBlock
from mode.layers.moe import MoELayer
from mode.routing.mod_topk import MoDRouter
from mode.routing.plan import Aux


class MoD(nn.Module):
    def __init__(self, block: nn.Module, router: MoDRouter):
        super().__init__()
        self.block = block
        self.router = router
        self.scale_delta = router.cfg.gate != "one"  # gate "one": routed tokens take the block output as is

    def forward(self, x_BSD: Tensor, mask_BS: Tensor | None = None) -> tuple[Tensor, Aux]:
        plan = self.router(x_BSD, mask_BS)  # validates x
        B, S, D = x_BSD.shape
        C = plan.seq_capacity
        pos_BC = plan.token_idx_A.view(B, C) - torch.arange(B, device=x_BSD.device)[:, None] * S
        index_BCD = pos_BC[..., None].expand(B, C, D)
        x_BCD = x_BSD.gather(1, index_BCD)
        valid_BC = None if plan.valid_A is None else plan.valid_A.view(B, C)

        out = self.block(x_BCD, pos_BC, valid_BC)
        y_BCD, block_aux = out if isinstance(out, tuple) else (out, Aux())
        if self.scale_delta:
            y_BCD = x_BCD + plan.weight_A.view(B, C, 1).to(x_BCD.dtype) * (y_BCD - x_BCD)
        if valid_BC is not None:
            y_BCD = torch.where(valid_BC[..., None], y_BCD, x_BCD)  # padding slots make no update
        aux = Aux().merge(plan.aux, "mod.").merge(block_aux)
        return x_BSD.scatter(1, index_BCD, y_BCD), aux


class StagedMoDE(MoD):
    """Staged MoDE (Raposo et al. 2024, sec. 5): MoD routing in front of a block whose MLP is an MoE.

    Skipped tokens skip attention *and* the experts; routed tokens then go through the MoE router.
    """

    def __init__(self, block: TransformerBlock, router: MoDRouter):
        if not isinstance(getattr(block, "mlp", None), MoELayer):
            raise TypeError(f"block.mlp={type(getattr(block, 'mlp', None)).__name__}: staged MoDE needs a "
                            "TransformerBlock whose mlp is a MoELayer")
        super().__init__(block, router)

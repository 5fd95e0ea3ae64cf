"""Dense MLP (GELU or SwiGLU) with the same parameter layout as one expert of ``ExpertBank``.

Shape legend: B batch, S tokens, D hidden, H MLP hidden, F = H (gelu) or 2H (swiglu).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from mode import _checks
from mode.experts.bank import ACTIVATIONS, activate
from mode.routing.plan import Aux


class MLP(nn.Module):
    """The dense feed-forward layer: ``y = act(x @ w_in_DF) @ w_out_HD``, no biases; the same parameter
    layout as one expert of ``ExpertBank``, and the same call as ``MoELayer`` (so either is a block's MLP).

    Shape legend: B batch, S tokens, D hidden, H MLP hidden, F = H (gelu, relu2) or 2H (swiglu: gate and up).

    Args:
        d_model: the hidden size D.
        d_hidden: the MLP's hidden size H.
        activation: "gelu", "swiglu" (``silu(gate) * up``) or "relu2" (``relu(h)^2``).
    """

    def __init__(self, d_model: int, d_hidden: int, activation: str = "gelu"):
        super().__init__()
        _checks.check_int("d_model", d_model)
        _checks.check_int("d_hidden", d_hidden)
        self.activation = _checks.check_choice("activation", activation, ACTIVATIONS)
        width = 2 * d_hidden if activation == "swiglu" else d_hidden
        _checks.check_numel("(d_model, d_hidden)", d_model, width)
        self.d_model = d_model
        self.w_in_DF = nn.Parameter(torch.randn(d_model, width) / math.sqrt(d_model))
        self.w_out_HD = nn.Parameter(torch.randn(d_hidden, d_model) / math.sqrt(d_hidden))

    def forward(self, x_BSD: Tensor, mask_BS: Tensor | None = None) -> tuple[Tensor, Aux]:
        """Apply the MLP to every token.

        Args:
            x_BSD: the hidden states.
            mask_BS: accepted for ``MoELayer``'s call and unused (tokens are independent).

        Returns:
            ``(y_BSD, Aux())``: the MLP's output (no residual added) and an empty ``Aux``.
        """
        _checks.check_hidden("x", x_BSD, self.d_model, device=self.w_in_DF.device)
        return activate(x_BSD @ self.w_in_DF.to(x_BSD.dtype), self.activation) @ self.w_out_HD.to(x_BSD.dtype), Aux()

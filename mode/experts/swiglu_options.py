"""SwiGLU as the transformers MoE families vary it: where gate and up sit, clamping, the sigmoid's slope, an offset.

Shape legend: A rows, H expert hidden size, F = 2H (the fused gate + up projection).

    gate_AH, up_AH = h_AF[:, :H], h_AF[:, H:]          fused="concat" (mode's own, Llama, DeepSeek, Qwen)
                   = h_AF[:, 0::2], h_AF[:, 1::2]      fused="interleaved" (gpt-oss)
    gate_AH = clamp(gate_AH, max=L)                    limit L (DeepSeek-V4, gpt-oss); the up half to [-L, L]
    up_AH   = clamp(up_AH, -L, L)
    act_AH  = gate_AH * sigmoid(alpha * gate_AH) * (up_AH + offset)
    act_AH  = softcap_g(gate_AH) * sigmoid(gate_AH) * softcap_u(up_AH)   gate/up softcaps (Inkling-2), float32
    act_AH  = gelu_tanh(gate_AH) * up_AH                 act="gelu_tanh" (GeGLU: Gemma-4); any act of GLU_ACTS

``alpha=None`` is silu (alpha 1); gpt-oss has alpha 1.702, limit 7 and offset 1
(transformers 5.23 ``GptOssExperts._apply_gate``), DeepSeek-V4 limit 10, alpha None, offset 0
(``DeepseekV4Experts._apply_gate``). The ops run in that order and as those two write them, so the values agree
bit for bit. Plain autograd: the default options (``is_plain``) take the fused custom op of ``swiglu.py``
instead, which the expert bank chooses once at construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor

FUSED = ("concat", "interleaved")  # how gate and up share the F = 2H columns of the input projection


def _relu2(x: Tensor) -> Tensor:
    return F.relu(x).square()


def _quick_gelu(x: Tensor) -> Tensor:
    return x * torch.sigmoid(1.702 * x)


def _gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


# The gate's activation (``act``): silu is SwiGLU, the gelus GeGLU (Gemma-4: gelu_tanh), the rest the gated
# experts transformers builds for any other ``hidden_act`` (``ACT2FN[hidden_act](gate) * up``)
GLU_ACTS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": _gelu_tanh,
    "quick_gelu": _quick_gelu,
    "relu": F.relu,
    "relu2": _relu2,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "mish": F.mish,
}


@dataclass(frozen=True)
class SwiGLUOptions:
    """The bank's SwiGLU (validated by ``ExpertConfig``, whose fields these are: ``swiglu_limit``,
    ``swiglu_alpha``, ``swiglu_up_offset``, ``fused``)."""

    limit: float | None = None
    alpha: float | None = None
    up_offset: float = 0.0
    fused: str = "concat"
    gate_softcap: float | None = None
    up_softcap: float | None = None
    act: str = "silu"  # the gate's activation, a key of GLU_ACTS ("gelu_tanh": GeGLU, Gemma-4's experts)

    @property
    def is_plain(self) -> bool:
        """``silu(gate) * up`` on concatenated halves: ``swiglu.swiglu``'s function."""
        return self == SwiGLUOptions()

    def split(self, h_AF: Tensor) -> tuple[Tensor, Tensor]:
        if self.fused == "interleaved":
            return h_AF[..., 0::2], h_AF[..., 1::2]
        return cast(tuple[Tensor, Tensor], h_AF.chunk(2, dim=-1))  # two halves: F is even

    def __call__(self, h_AF: Tensor) -> Tensor:
        gate_AH, up_AH = self.split(h_AF)
        if self.gate_softcap is not None or self.up_softcap is not None:
            return self._softcapped(gate_AH, up_AH)
        if self.limit is not None:
            gate_AH = gate_AH.clamp(max=self.limit)
            up_AH = up_AH.clamp(min=-self.limit, max=self.limit)
        if self.act != "silu":
            glu_AH = GLU_ACTS[self.act](gate_AH)
        elif self.alpha is None:
            glu_AH = F.silu(gate_AH)
        else:
            glu_AH = gate_AH * torch.sigmoid(gate_AH * self.alpha)
        if self.up_offset:
            up_AH = up_AH + self.up_offset
        return up_AH * glu_AH

    def _softcapped(self, gate_AH: Tensor, up_AH: Tensor) -> Tensor:
        """Inkling-2: ``softcap(gate) * sigmoid(gate) * softcap(up)`` in float32 (the sigmoid sees the raw gate)."""
        dtype = gate_AH.dtype
        gate_AH, up_AH = gate_AH.float(), up_AH.float()
        lin_AH = gate_AH if self.gate_softcap is None else torch.tanh(gate_AH / self.gate_softcap) * self.gate_softcap
        if self.up_softcap is not None:
            up_AH = torch.tanh(up_AH / self.up_softcap) * self.up_softcap
        return (lin_AH * torch.sigmoid(gate_AH) * up_AH).to(dtype)

"""No-op experts: router slots that run no MLP (integrated MoDE, LongCat-Flash, MoE++).

Shape legend: B batch, S sequence, T = B * S tokens, D hidden, N no-op slots, C constant slots

A token-choice router with ``num_noop = N`` scores N slots beside its E real experts. A choice of a no-op
slot is never dispatched and never reaches the expert bank; what it adds to the token's output depends on
its kind (``MoEConfig.noop_kinds``, one per slot):

    "zero"      nothing: the token's residual passes unchanged (Raposo et al. 2024, integrated MoDE; MoE++'s
                zero expert). The gate it took is simply missing from the routed output.
    "copy"      the token's input times its gate, ``g * x`` (LongCat-Flash's zero-computation "identity"
                experts, MoE++'s copy expert).
    "constant"  ``g * (a1 * x + a2 * v)`` with a learned vector ``v`` (D,) per slot and
                ``[a1, a2] = softmax(W x)``, ``W`` (2, D) per slot (MoE++'s constant expert).

None of them runs an MLP: ``mode.measure`` counts 0 expert FLOPs for them (the constant kind's 2 x D mixing
weights, 4D multiply-adds a token, are not counted), they are computed on the token's own process under
expert parallelism (nothing is dispatched), and the routing stats count their choices as the no-op share.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mode import _checks

NOOP_KINDS = ("zero", "copy", "constant")


def noop_kinds(kinds: str | tuple[str, ...] | list[str], num_noop: int) -> tuple[str, ...]:
    """``kinds`` as one kind per no-op slot: a single kind names every slot's; a sequence has one per slot."""
    _checks.check_int("num_noop", num_noop, min_value=0)
    if isinstance(kinds, str):
        kinds = (kinds,) * num_noop
    if not isinstance(kinds, (tuple, list)):
        raise TypeError(f"noop_kinds={kinds!r}: must be a kind name or a tuple of them, one per no-op slot")
    kinds = tuple(kinds)
    for kind in kinds:
        _checks.check_choice("noop_kinds", kind, NOOP_KINDS)
    if len(kinds) != num_noop:
        raise ValueError(f"noop_kinds={kinds!r}: must name one kind per no-op slot, num_noop={num_noop}")
    return kinds


class NoopExperts(nn.Module):
    """What the no-op slots add to the routed output: ``forward(x_TD, noop_gate_TN) -> y_TD``.

    ``noop_gate_TN``: each token's gate on each no-op slot (0 where the slot was not chosen), as the router
    gives it in ``RoutingPlan.noop_gate_TN``. Parameters (constant slots only): ``const_v_CD`` (C, D), zero at
    init (the slot starts as a gated copy mixed with nothing), and ``const_w_C2D`` (C, 2, D)."""

    def __init__(self, kinds: tuple[str, ...], d_model: int):
        super().__init__()
        self.kinds = noop_kinds(kinds, len(kinds))
        _checks.check_int("d_model", d_model)
        self.copy_idx = [n for n, kind in enumerate(self.kinds) if kind == "copy"]
        self.const_idx = [n for n, kind in enumerate(self.kinds) if kind == "constant"]
        if self.const_idx:
            C = len(self.const_idx)
            self.const_v_CD = nn.Parameter(torch.zeros(C, d_model))
            self.const_w_C2D = nn.Parameter(torch.randn(C, 2, d_model) * d_model**-0.5)
        self.needs_gates = bool(self.copy_idx or self.const_idx)  # only zero slots: nothing to add

    def extra_repr(self) -> str:
        return f"kinds={self.kinds}"

    def forward(self, x_TD: Tensor, noop_gate_TN: Tensor) -> Tensor:
        y_TD = x_TD.new_zeros(x_TD.shape)
        if self.copy_idx:
            g_T = noop_gate_TN[:, self.copy_idx].sum(-1)
            y_TD = y_TD + (x_TD * g_T[:, None].to(x_TD.dtype))
        if self.const_idx:
            g_TC = noop_gate_TN[:, self.const_idx].to(x_TD.dtype)
            w_C2D, v_CD = self.const_w_C2D.to(x_TD.dtype), self.const_v_CD.to(x_TD.dtype)
            a_TC2 = _checks.at_least_float32(torch.einsum("td,ckd->tck", x_TD, w_C2D)).softmax(-1).to(x_TD.dtype)
            # sum over c of g * (a1 * x + a2 * v), without a (T, C, D) tensor
            y_TD = y_TD + (g_TC * a_TC2[..., 0]).sum(-1, keepdim=True) * x_TD + (g_TC * a_TC2[..., 1]) @ v_CD
        return y_TD

"""Router auxiliary losses.

Shape legend: T tokens, X expert slots (real + no-op), A assignments (T * k before capacity).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _masked_mean(v_T: Tensor, valid_T: Tensor | None) -> Tensor:
    """Mean over real tokens; 0 (not NaN) when there are none."""
    if valid_T is None:
        return v_T.sum() / max(1, v_T.shape[0])
    return (v_T * valid_T).sum() / valid_T.sum().clamp_min(1)


def load_balancing_loss(probs_TX: Tensor, chosen_TK: Tensor, valid_T: Tensor | None = None) -> Tensor:
    """Switch-Transformer balance loss ``X * sum_i f_i * P_i``.

    ``f_i`` is the fraction of the T*k choices (before capacity drops) that picked slot i and ``P_i``
    the mean router probability of slot i. Both equal ``1/X`` for perfectly uniform routing, where the
    loss is exactly 1.0 — its minimum whenever the choices follow the probabilities. Only ``P`` carries
    gradient (``f`` comes from a discrete top-k).
    """
    num_slots = probs_TX.shape[-1]
    onehot_TX = torch.zeros_like(probs_TX).scatter_(1, chosen_TK, 1.0)  # (T, X) 1 where chosen
    if valid_T is not None:
        onehot_TX = onehot_TX * valid_T[:, None]
        probs_TX = probs_TX * valid_T[:, None]
        n = valid_T.sum().clamp_min(1)
    else:
        n = max(1, probs_TX.shape[0])  # a Python number: no host-to-device copy
    f_X = onehot_TX.sum(0) / (n * chosen_TK.shape[1])
    p_X = probs_TX.sum(0) / n
    return num_slots * (f_X * p_X).sum()


def router_z_loss(logits_TX: Tensor, valid_T: Tensor | None = None) -> Tensor:
    """ST-MoE router z-loss: mean over tokens of ``logsumexp(logits)^2`` (keeps logits small)."""
    return _masked_mean(torch.logsumexp(logits_TX, dim=-1).square(), valid_T)

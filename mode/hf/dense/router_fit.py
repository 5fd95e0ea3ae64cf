"""``router_fit``: set each converted layer's router so that it routes the tokens the skipped part would
change most, learned from the original model's own forwards (no backward through the model).

Shape legend: B batch, S sequence, D hidden, N real tokens collected for one layer.

The label of a token is whether it is in its sequence's top ``capacity`` share by the norm of the update
the skipped part makes to it in the unconverted model (attention: the attention output; MLP: the MLP
output; the whole layer: output minus input). Routing by that label is an oracle (it needs the update it
wants to skip); the router is a linear score on the layer's input, so ``router_fit`` fits it by logistic
regression on standardised inputs and folds the standardisation into the router's weight (the mean and the
logistic bias become a constant, which top-C ignores and the steered threshold absorbs). Then the steered
thresholds are calibrated on the same batches (``calibrate``), so causal routing sends the target share.

Where the layer has a ``mod_skip`` (``to_mod(skip_rank=R)``), it is fitted next, on the training tokens the
fitted router skips: a ridge regression of their updates on their router inputs, truncated to rank R.

``label="residual"`` (layers with a ``mod_skip`` only) labels by what the estimate leaves instead: a skipped token
costs the part of its update the estimate misses, so the tokens to route are those with the largest
``|update - estimate(input)|``, not the largest ``|update|``. That is a pair of choices that depend on each
other (the estimate is fitted on the tokens that skip), made by alternating ``rounds`` times: fit the estimate
on the tokens the current label skips, relabel by the residual it leaves: an alternating minimisation of the
skipped tokens' residual energy (each step lowers it when the fit is exact least squares; the ridge and the
rank-R truncation make it approximate). The first label is the update's norm, as with ``label="update"``.

On SmolLM2-135M (docs/hf.md) the fitted router picks 76-86% of the oracle's tokens and routes 95-98% of the
update norm the oracle routes (random: 80-88%).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mode import _checks
from mode.hf.dense import mask as hf_mask
from mode.hf.dense.convert import mod_layers
from mode.hf.dense.routing import routing
from mode.hf.dense.skip_update import SkipUpdate
from mode.hf.dense.tune import _as_batch, _positions, calibrate
from mode.train.progress import Progress, phase


def _update(layer, x_BSD: Tensor, kwargs: dict) -> tuple[Tensor, Tensor]:
    """``(router input, update)`` of one MoD layer on its input, in the unconverted computation: the update
    the part a token skips would add to its residual stream."""
    attn_kwargs = {k: kwargs[k] for k in ("attention_mask", "position_embeddings") if k in kwargs}
    a_BSD = layer.self_attn(hidden_states=layer.input_layernorm(x_BSD), **attn_kwargs)[0]
    if layer.mod_part == "attention":
        return x_BSD, a_BSD
    h_BSD = x_BSD + a_BSD
    m_BSD = layer.mlp(layer.post_attention_layernorm(h_BSD))
    if layer.mod_part == "mlp":
        return h_BSD, m_BSD
    return x_BSD, a_BSD + m_BSD


LABELS = ("update", "residual")


def _top_share(y_BS: Tensor, real_BS: Tensor, capacity: float) -> Tensor:
    """Per row, True for the ``capacity`` share of real tokens with the largest ``y``."""
    k_B = (real_BS.sum(1) * capacity).floor().long().clamp_min(1)
    rank_BS = y_BS.masked_fill(~real_BS, float("-inf")).argsort(1, descending=True).argsort(1)
    return (rank_BS < k_B[:, None]) & real_BS


@torch.no_grad()
def _collect(
    model: nn.Module, batches: list, layers: dict, on_batch=lambda: None
) -> dict[int, tuple[Tensor, Tensor, Tensor, Tensor]]:
    """Per layer, for the real tokens: the router inputs (N, D), their labels (N,), the updates (N, D) (only
    where the layer has a ``mod_skip`` to fit; else an empty tensor) and the row (sequence) of each (N,)."""
    seen: dict[int, list[tuple[Tensor, Tensor, Tensor, Tensor]]] = {i: [] for i in layers}
    rows_seen = {i: 0 for i in layers}

    def hook(i, layer):
        def pre(module, args, kwargs):
            x_BSD = args[0] if args else kwargs["hidden_states"]
            B, S, _ = x_BSD.shape
            real_BS = hf_mask.real_tokens(kwargs.get("attention_mask"), B, S, 0)
            real_BS = torch.ones(B, S, dtype=torch.bool, device=x_BSD.device) if real_BS is None else real_BS
            f_BSD, u_BSD = _update(layer, x_BSD, kwargs)
            label_BS = _top_share(u_BSD.norm(dim=-1), real_BS, layer.mod_router.cfg.capacity)
            u_ND = u_BSD[real_BS].float() if layer.mod_skip is not None else u_BSD.new_zeros(0)
            row_BS = (rows_seen[i] + torch.arange(B, device=x_BSD.device))[:, None].expand(B, S)
            rows_seen[i] += B
            seen[i].append((f_BSD[real_BS].float(), label_BS[real_BS].float(), u_ND, row_BS[real_BS]))

        return pre

    handles = [layer.register_forward_pre_hook(hook(i, layer), with_kwargs=True) for i, layer in layers.items()]
    device = next(model.parameters()).device
    try:
        with routing(model, "dense"):
            for batch in batches:
                ids_BS, mask_BS = _as_batch(batch, device)
                model(ids_BS, attention_mask=mask_BS, position_ids=_positions(mask_BS), use_cache=False)
                on_batch()
    finally:
        for h in handles:
            h.remove()
    return {
        i: cast(tuple[Tensor, Tensor, Tensor, Tensor], tuple(torch.cat(p) for p in zip(*v))) for i, v in seen.items()
    }


def _top_share_rows(y_N: Tensor, row_N: Tensor, capacity: float) -> Tensor:
    """``_top_share`` on flattened tokens: per row (``row_N``), True for the ``capacity`` share with the largest
    ``y`` (at least one per row)."""
    order_N = torch.argsort(y_N, descending=True, stable=True)
    order_N = order_N[torch.argsort(row_N[order_N], stable=True)]  # by row, each row by y descending
    _, count_R = torch.unique_consecutive(row_N[order_N], return_counts=True)
    start_R = torch.cumsum(count_R, 0) - count_R
    rank_N = torch.arange(len(y_N), device=y_N.device) - start_R.repeat_interleave(count_R)
    k_N = (count_R * capacity).floor().long().clamp_min(1).repeat_interleave(count_R)
    pick_N = torch.zeros_like(y_N, dtype=torch.bool)
    pick_N[order_N] = rank_N < k_N
    return pick_N


def _residual_label(
    skip: SkipUpdate, f_ND: Tensor, u_ND: Tensor, label_N: Tensor, row_N: Tensor, capacity: float, rounds: int, ridge
) -> Tensor:
    """Alternate ``rounds`` times: fit ``skip`` on the tokens ``label`` skips, relabel by its residual norm."""
    for _ in range(rounds):
        if bool(label_N.bool().all()):
            break
        skip.fit(f_ND[~label_N.bool()], u_ND[~label_N.bool()], ridge)
        with torch.no_grad():
            left_N = (u_ND - skip(f_ND[None].to(skip.bias.dtype))[0].float()).norm(dim=-1)
        label_N = _top_share_rows(left_N, row_N, capacity).float()
    return label_N


def _logistic(f_ND: Tensor, label_N: Tensor, steps: int, lr: float) -> Tensor:
    """The router weight ``(D,)`` of a logistic regression of ``label`` on standardised ``f``."""
    mean_D = f_ND.mean(0)
    std_D = f_ND.std(0).clamp_min(1e-6)
    z_ND = (f_ND - mean_D) / std_D
    w_D = torch.zeros(f_ND.shape[1], device=f_ND.device, requires_grad=True)
    b = torch.zeros((), device=f_ND.device, requires_grad=True)
    opt = torch.optim.Adam([w_D, b], lr=lr)
    for _ in range(steps):
        loss = F.binary_cross_entropy_with_logits(z_ND @ w_D + b, label_N)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return w_D.detach() / std_D


def router_fit(
    model: nn.Module,
    batches: Iterable,
    steps: int = 300,
    lr: float = 1e-2,
    ridge: float = 0.1,
    label: str = "update",
    rounds: int = 3,
    calibration_batches: Iterable | None = None,
    progress: Progress | None = None,
) -> dict[int, float]:
    """Fit the router of every MoD layer of ``model`` (see the module doc), then its ``mod_skip`` estimate
    (``to_mod(skip_rank=...)``: ``SkipUpdate.fit`` on the training tokens the fitted router skips, ridge
    ``ridge``), then calibrate the steered thresholds on ``batches``. ``batches``: (B, S) token ids or dicts
    with ``input_ids`` and ``attention_mask``, as for ``router_tune``. Returns per layer the share of its
    training tokens whose label the fitted score's top-C reproduces (a training accuracy, 0.5 for a coin).
    Routers with a ``predictor`` (``causal="predictor"``) are refused: their decision is not the fitted
    score. ``label``: ``"update"`` (route the largest updates) or ``"residual"`` (route the largest updates the
    estimate misses, alternating ``rounds`` times; the module doc), which needs every layer to have a
    ``mod_skip``. ``calibration_batches``: what the steered thresholds are set on instead of ``batches`` (the
    same thresholds as ``calibrate(model, calibration_batches)`` afterwards, without a pass over ``batches``).
    ``progress``: lines for a person, per batch and per layer fitted (None: silent)."""
    _checks.check_int("steps", steps)
    _checks.check_positive("lr", lr)
    _checks.check_choice("label", label, LABELS)
    _checks.check_int("rounds", rounds)  # >= 1: the estimate's fits alternated with the labels
    if isinstance(ridge, bool) or not isinstance(ridge, (int, float)) or not ridge >= 0:
        raise ValueError(f"ridge={ridge!r}: must be a number >= 0")
    layers = mod_layers(model)
    if not layers:
        raise ValueError("router_fit: the model has no MoD layer (convert it with mode.hf.to_mod first)")
    for i, layer in layers.items():
        if layer.mod_router.predictor is not None:
            raise ValueError(
                f"layer {i}: causal='predictor' decides by its own MLP, not the router score "
                "router_fit sets; convert with causal='threshold' or 'aux_bce'"
            )
        if label == "residual" and layer.mod_skip is None:
            raise ValueError(
                f"layer {i}: label='residual' ranks tokens by what the estimate misses, and this layer has no "
                "estimate (convert with to_mod(skip_rank=R))"
            )
    batches = list(batches)
    if not batches:
        raise ValueError("batches: empty; router_fit needs at least one batch")
    cal_batches = batches if calibration_batches is None else list(calibration_batches)
    if not cal_batches:
        raise ValueError("calibration_batches: empty; pass None to calibrate on the fit batches")
    shown = phase(progress, f"router fit ({label})", len(batches) + len(layers), "batches + layers")
    was_training = model.training
    model.eval()
    try:
        data = _collect(model, batches, layers, shown.advance)
    finally:
        model.train(was_training)
    agreement = {}
    for i, layer in layers.items():
        f_ND, label_N, u_ND, row_N = data[i]
        if label == "residual":
            skip = cast(SkipUpdate, layer.mod_skip)  # checked above: every layer has one
            label_N = _residual_label(skip, f_ND, u_ND, label_N, row_N, layer.mod_router.cfg.capacity, rounds, ridge)
        with torch.enable_grad():
            w_D = _logistic(f_ND, label_N, steps, lr)
        layer.mod_router.weight.data.copy_(w_D.to(layer.mod_router.weight.dtype))
        r_N = f_ND @ w_D
        share = float(label_N.mean())
        cut = r_N.sort().values[min(int((1 - share) * len(r_N)), len(r_N) - 1)]
        pick_N = r_N >= cut if 0 < share < 1 else label_N.bool()
        agreement[i] = float((pick_N == label_N.bool()).float().mean())
        if layer.mod_skip is not None and bool((~pick_N).any()):
            layer.mod_skip.fit(f_ND[~pick_N], u_ND[~pick_N], ridge)
        shown.advance()
    shown.close()
    if any(layer.mod_router.steers for layer in layers.values()):
        calibrate(model, cal_batches, progress)
    return agreement

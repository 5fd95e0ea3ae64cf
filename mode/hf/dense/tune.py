"""Router tuning: train only the routers (and causal predictors) of a converted model, the base frozen.

Shape legend: B batch, S sequence, V vocabulary.

Objectives: ``"lm"``, next-token cross-entropy on the batches; ``"distill"``, the KL divergence from the
unconverted model's next-token distribution (``teacher``, or by default the same model with its MoD layers
run densely, ``routing(model, "dense")``: no copy needed). Either way the routers' own losses
(``collect_aux(model).total()``: the causal BCE, and load balance / z-loss of upcycled layers) are added.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mode import _checks
from mode.hf.dense.convert import mod_layers
from mode.hf.dense.routing import collect_aux, routing
from mode.hf.dense.upcycle import upcycled_mlps
from mode.routing.mod_topk import MoDRouter
from mode.train.progress import Progress, phase

OBJECTIVES = ("lm", "distill")


def router_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters ``mode.hf`` added for routing: ``...mod_router.*``, ``...mod_skip.*`` (the skipped
    tokens' estimated update), ``...prune_est.*`` (a deleted layer's estimate, ``prune_layers``) and
    ``...mlp.moe.router.*``."""
    keys = (".mod_router.", ".mod_skip.", ".prune_est.", ".mlp.moe.router.")
    return {name: p for name, p in model.named_parameters() if any(k in name for k in keys)}


def freeze_base(model: nn.Module) -> list[str]:
    """Freeze every parameter but the routers'; returns the names left trainable."""
    trainable = router_parameters(model)
    if not trainable:
        raise ValueError("freeze_base: the model has no router (convert it with mode.hf.to_mod or upcycle first)")
    for name, p in model.named_parameters():
        p.requires_grad_(name in trainable)
    return sorted(trainable)


def _as_batch(batch, device: torch.device) -> tuple[Tensor, Tensor | None]:
    if isinstance(batch, Tensor):
        return batch.to(device), None
    if isinstance(batch, dict) and "input_ids" in batch:
        mask = batch.get("attention_mask")
        return batch["input_ids"].to(device), None if mask is None else mask.to(device)
    raise TypeError(
        f"batch={type(batch).__name__}: must be a (B, S) tensor of token ids or a dict with "
        "input_ids (and optionally attention_mask)"
    )


def _positions(mask_BS: Tensor | None) -> Tensor | None:
    """Left padding: positions count real tokens only, as generate() numbers them."""
    return None if mask_BS is None else (mask_BS.long().cumsum(-1) - 1).clamp_min(0)


def lm_loss(logits_BSV: Tensor, ids_BS: Tensor, mask_BS: Tensor | None) -> Tensor:
    """Mean next-token cross-entropy over real target tokens."""
    target_BS = ids_BS[:, 1:]
    loss_BS = F.cross_entropy(logits_BSV[:, :-1].float().transpose(1, 2), target_BS, reduction="none")
    if mask_BS is None:
        return loss_BS.mean()
    w_BS = (mask_BS[:, 1:] * mask_BS[:, :-1]).float()
    return (loss_BS * w_BS).sum() / w_BS.sum().clamp_min(1)


def distill_loss(logits_BSV: Tensor, teacher_BSV: Tensor, mask_BS: Tensor | None) -> Tensor:
    """Mean KL(teacher || student) of the next-token distributions over real tokens."""
    log_p = teacher_BSV.float().log_softmax(-1)
    kl_BS = (log_p.exp() * (log_p - logits_BSV.float().log_softmax(-1))).sum(-1)
    if mask_BS is None:
        return kl_BS.mean()
    w_BS = mask_BS.float()
    return (kl_BS * w_BS).sum() / w_BS.sum().clamp_min(1)


def router_tune(
    model: nn.Module,
    batches: Iterable,
    steps: int,
    lr: float = 1e-3,
    objective: str = "lm",
    teacher: nn.Module | None = None,
    weight_decay: float = 0.0,
) -> list[dict[str, float]]:
    """Train the routers of ``model`` for ``steps`` steps on ``batches`` (cycled), the base frozen.

    Top-C routing in train mode, ``use_cache=False``. Returns one record per step: ``loss`` (the objective),
    ``aux`` (the routers' weighted losses) and ``routed`` (mean fraction of real tokens routed through the
    MoD layers). The model is left in the mode it was in, with its base still frozen.
    """
    _checks.check_int("steps", steps)
    _checks.check_positive("lr", lr)
    _checks.check_choice("objective", objective, OBJECTIVES)
    if objective == "distill" and teacher is None and upcycled_mlps(model):
        raise ValueError(
            "objective='distill' with upcycled MLPs: pass teacher= (the unconverted model); the "
            "dense MLP weights are no longer in the converted model"
        )
    names = freeze_base(model)
    params = [p for n, p in model.named_parameters() if n in names]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    device = params[0].device
    was_training = model.training
    model.train()
    history: list[dict[str, float]] = []
    source = iter(batches)
    cached: list = []
    try:
        for _ in range(steps):
            try:
                batch = next(source)
                cached.append(batch)
            except StopIteration:
                if not cached:
                    raise ValueError("batches: yielded nothing") from None
                source = iter(cached)  # cycle over what was seen (a one-shot iterator included)
                batch = next(source)
            ids_BS, mask_BS = _as_batch(batch, device)
            pos_BS = _positions(mask_BS)
            with routing(model, "topk") if mod_layers(model) else contextlib.nullcontext():
                logits_BSV = model(ids_BS, attention_mask=mask_BS, position_ids=pos_BS, use_cache=False).logits
            aux = collect_aux(model)
            if objective == "lm":
                loss = lm_loss(logits_BSV, ids_BS, mask_BS)
            else:
                with torch.no_grad():
                    teacher_BSV = _teacher_logits(model, teacher, ids_BS, mask_BS, pos_BS)
                loss = distill_loss(logits_BSV, teacher_BSV, mask_BS)
            aux_total = aux.total().to(loss.device)
            opt.zero_grad(set_to_none=True)
            (loss + aux_total).backward()
            opt.step()
            routed = [s.kept_E.sum() / s.tokens.clamp_min(1) for k, s in aux.stats.items() if ".mod." in k]
            history.append(
                {
                    "loss": float(loss.detach()),
                    "aux": float(aux_total.detach()),
                    "routed": float(torch.stack(routed).mean()) if routed else float("nan"),
                }
            )
    finally:
        model.train(was_training)
    return history


@torch.no_grad()
def calibrate(model: nn.Module, batches: Iterable, progress: Progress | None = None) -> dict[int, float]:
    """Set the steered routing thresholds of ``model``'s MoD layers (``causal="threshold"``, or
    ``steer_decision``) from top-C forwards in train mode over ``batches``, without gradients and without
    changing a weight: each threshold becomes the mean over the batches of each batch's quantile.
    Returns each steered layer's threshold. Thresholds set before are replaced. ``progress``: lines for a
    person, per batch (None: silent)."""
    steered = {
        i: cast(MoDRouter, layer.mod_router) for i, layer in mod_layers(model).items() if layer.mod_router.steers
    }
    if not steered:
        raise ValueError(
            "calibrate: the model has no MoD layer with a steered threshold (to_mod with "
            "causal='threshold', or 'aux_bce' / 'predictor' with steer_decision=True)"
        )
    batches = list(batches)
    shown = phase(progress, "calibration", len(batches), "batches")
    before = {i: router.threshold.clone() for i, router in steered.items()}
    sums = {i: torch.zeros_like(t) for i, t in before.items()}
    device = next(model.parameters()).device
    was_training = model.training
    model.train()
    seen = 0
    try:
        for batch in batches:
            ids_BS, mask_BS = _as_batch(batch, device)
            for router in steered.values():
                router.threshold.fill_(float("nan"))  # this forward sets it to this batch's quantile
            with routing(model, "topk"):
                model(ids_BS, attention_mask=mask_BS, position_ids=_positions(mask_BS), use_cache=False)
            for i, router in steered.items():
                sums[i] += router.threshold
            seen += 1
            shown.advance()
    finally:
        model.train(was_training)
        for i, router in steered.items():
            router.threshold.copy_(sums[i] / seen if seen else before[i])
    if seen == 0:
        raise ValueError("batches: yielded nothing")
    shown.close()
    return {i: float(router.threshold) for i, router in steered.items()}


def _teacher_logits(model, teacher, ids_BS, mask_BS, pos_BS) -> Tensor:
    if teacher is not None:
        return teacher(ids_BS, attention_mask=mask_BS, position_ids=pos_BS, use_cache=False).logits
    with routing(model, "dense"):
        return model(ids_BS, attention_mask=mask_BS, position_ids=pos_BS, use_cache=False).logits

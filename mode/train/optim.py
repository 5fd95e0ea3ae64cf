"""The optimizer and the learning-rate schedule every run uses: AdamW (matrices decay, norms and gains do
not) and linear warm-up followed by cosine decay."""

from __future__ import annotations

import math

import torch

from mode.train.config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``min_lr_ratio * lr`` at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, capturable: bool = False) -> torch.optim.AdamW:
    """AdamW over ``model``'s parameters. ``capturable``: the CUDA-graph form (``mode.train.graphs``): step
    counters on the device and the learning rate one 0-dim tensor on the parameters' device, shared by both
    groups (set it with ``fill_``), so that a step reads nothing from the host."""
    decay = [p for p in model.parameters() if p.dim() >= 2]  # matrices decay; norms and gains do not
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if not capturable:
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))
    lr_t = torch.tensor(cfg.lr, dtype=torch.float32, device=next(model.parameters()).device)
    opt = torch.optim.AdamW(groups, lr=lr_t, betas=(0.9, 0.95), capturable=True, foreach=True)
    for g in opt.param_groups:
        g["lr"] = lr_t  # one tensor for every group (the schedule sets one rate)
    return opt

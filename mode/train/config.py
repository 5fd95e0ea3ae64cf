"""``TrainConfig``: the optimisation and bookkeeping of one training run (steps, batch, schedule, AdamW,
clipping, evaluation, logging and checkpoint cadence, seed)."""

from __future__ import annotations

from dataclasses import dataclass

from mode import _checks


@dataclass
class TrainConfig:
    steps: int = 1000
    batch_size: int = 8
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_batches: int = 8
    log_every: int = 10
    ckpt_every: int = 0  # 0: checkpoint only at the end
    ckpt_every_s: float | None = None  # also checkpoint when this many seconds passed since the last one
    stats_every: int | None = None  # log a routing-statistics record every this many steps; None: eval_every
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "eval_batches", "log_every", "eval_every"):
            _checks.check_int(name, getattr(self, name))
        _checks.check_int("warmup_steps", self.warmup_steps, min_value=0)
        _checks.check_int("ckpt_every", self.ckpt_every, min_value=0)
        if self.stats_every is not None:
            _checks.check_int("stats_every", self.stats_every)
        if self.ckpt_every_s is not None:
            _checks.check_positive("ckpt_every_s", self.ckpt_every_s)
        _checks.check_positive("lr", self.lr)
        _checks.check_fraction("min_lr_ratio", self.min_lr_ratio)
        _checks.check_non_negative("weight_decay", self.weight_decay)
        _checks.check_positive("grad_clip", self.grad_clip)

"""``TrainConfig``: the optimisation and bookkeeping of one training run (steps, batch, schedule, AdamW,
clipping, gradient accumulation, activation checkpointing, evaluation, logging and checkpoint cadence, seed).
docs/training.md."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mode import _checks


@dataclass
class TrainConfig:
    """The optimisation and bookkeeping of one training run, for ``Trainer``: ``steps`` optimizer steps of
    ``batch_size`` sequences (split into ``grad_accum`` micro-batches), AdamW at peak ``lr`` with
    ``weight_decay``, ``warmup_steps`` of linear warm-up then a cosine decay to ``min_lr_ratio * lr``, gradients
    clipped to norm ``grad_clip``; ``activation_checkpointing`` recomputes each block in backward. Evaluation on
    ``eval_batches`` batches every ``eval_every`` steps, a log line every ``log_every``, routing statistics every
    ``stats_every`` (None: with evaluation), a checkpoint every ``ckpt_every`` steps (0: at the end) and/or
    every ``ckpt_every_s`` seconds; ``tensorboard`` also writes event files; ``peak_tflops`` is one device's peak
    for the logged MFU; ``seed`` seeds the run. Invalid values raise ``ValueError`` naming the field
    (docs/training.md).
    """

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
    grad_accum: int = 1  # micro-batches per optimizer step (mode.train.accumulate): the whole batch's loss
    activation_checkpointing: bool = False  # recompute each block in backward (mode.model.checkpointing)
    tensorboard: bool = False  # also write TensorBoard event files to out_dir/tb (the "tb" extra)
    peak_tflops: float | None = None  # one device's peak rate for the logged MFU (None: known GPUs only)

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
        _checks.check_int("grad_accum", self.grad_accum)
        if self.batch_size % self.grad_accum:
            raise ValueError(
                f"grad_accum={self.grad_accum}: must divide batch_size={self.batch_size} (each step "
                "splits the batch into grad_accum micro-batches of equal size)"
            )
        _checks.check_bool("activation_checkpointing", self.activation_checkpointing)
        _checks.check_bool("tensorboard", self.tensorboard)
        if self.peak_tflops is not None:
            _checks.check_positive("peak_tflops", self.peak_tflops)

    def identity(self) -> dict:
        """The fields that decide what a run computes, which ``mode compare`` and ``mode isoflop`` record to
        resume only the same run: all but ``NOT_COMPUTED``, and ``grad_accum`` only when it is not 1 (so that
        records written before it existed stay resumable)."""
        out = {k: v for k, v in asdict(self).items() if k not in NOT_COMPUTED}
        if out["grad_accum"] == 1:
            del out["grad_accum"]
        return out


# When to save, what to log, and recomputing activations change no number a run computes.
NOT_COMPUTED = ("ckpt_every_s", "activation_checkpointing", "tensorboard", "peak_tflops")

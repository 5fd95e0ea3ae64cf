"""Training loop: AdamW, warm-up + cosine schedule, gradient clipping, aux losses, periodic validation,
JSONL log, checkpoints that resume to the identical loss curve, and a progress bar.

Checkpoints (every ``ckpt_every`` steps, every ``ckpt_every_s`` seconds, and at the end) are written
atomically in the format of ``mode.checkpoint`` and read back without running code from the file;
docs/checkpoints.md.

Shape legend: B batch, S sequence.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from mode import _checks, checkpoint
from mode.checkpoint import load_model  # noqa: F401 - the public name mode.train.load_model
from mode.data import BatchSampler, Corpus, eval_batches
from mode.flops import train_flops_per_token
from mode.model import LM, LMConfig
from mode.stats import RoutingAccumulator


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


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``min_lr_ratio * lr`` at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]  # matrices decay; norms and gains do not
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))


@torch.no_grad()
def evaluate(model: LM, batches) -> float:
    was_training = model.training
    model.eval()
    losses = [float(model(x, y).loss) for x, y in batches]
    model.train(was_training)
    return sum(losses) / len(losses)


class TrainLoop:
    """The step / log / evaluate / checkpoint loop shared by ``Trainer`` and the expert-parallel trainer.

    A subclass provides ``train_step() -> (loss, lr)``, ``evaluate() -> float``, ``routing_record()`` (the
    summary to log, or None), ``save()``, ``_log(record)``, and the attributes ``cfg``, ``model_cfg``,
    ``name``, ``progress``, ``step``, ``flops``, ``tokens``, ``wall``, ``elapsed``, ``history``,
    ``log_path``, ``routing``.
    """

    writes_log = True  # whether this process owns log.jsonl (the expert-parallel trainer: rank 0 only)
    _last_save = 0.0  # time.monotonic() of the last checkpoint (or of the start of run())

    def checkpoint_due(self) -> bool:
        """Whether ``ckpt_every_s`` seconds have passed since the last checkpoint (the expert-parallel
        trainer overrides this with rank 0's answer, so every rank saves at the same step)."""
        every = self.cfg.ckpt_every_s
        return every is not None and time.monotonic() - self._last_save >= every

    def run(self, stop_step: int | None = None) -> list[dict]:
        """Train up to ``stop_step`` (default: the configured number of steps) and return the history."""
        stop = self.cfg.steps if stop_step is None else min(stop_step, self.cfg.steps)
        if self.writes_log and self.step == 0 and not self.history:
            self.log_path.write_text("")
        self._last_save = time.monotonic()
        saved_at = None
        bar = tqdm(total=stop, initial=self.step, desc=self.name, disable=not self.progress, leave=False,
                   dynamic_ncols=True)
        stats_every = self.cfg.stats_every or self.cfg.eval_every
        while self.step < stop:
            t0 = time.perf_counter()
            loss, lr = self.train_step()
            dt = time.perf_counter() - t0
            self.wall += dt
            tok_s = self.cfg.batch_size * self.model_cfg.seq_len / dt
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:,.0f}", flops=f"{self.flops:.2e}")
            if self.step % self.cfg.log_every == 0 or self.step == stop:
                self._log({"step": self.step, "loss": loss, "lr": lr, "tokens": self.tokens, "flops": self.flops,
                           "wall": self.wall, "tok_s": self.tokens / self.wall})
            if self.step % stats_every == 0 or self.step == self.cfg.steps:
                record = self.routing_record()
                if record is not None:
                    self._log({"step": self.step, "routing": record})  # see docs/reports.md
                self.routing.reset()
            if self.step % self.cfg.eval_every == 0 or self.step == self.cfg.steps:
                self._log({"step": self.step, "val_loss": self.evaluate(), "tokens": self.tokens,
                           "flops": self.flops, "wall": self.wall})
            self.elapsed += time.perf_counter() - t0  # before saving: the checkpoint counts this step
            if (self.cfg.ckpt_every and self.step % self.cfg.ckpt_every == 0) or self.checkpoint_due():
                self.save()
                self._last_save, saved_at = time.monotonic(), self.step
        bar.close()
        if saved_at != self.step:
            self.save()
        return self.history


class Trainer(TrainLoop):
    """Trains one model; ``out_dir`` receives ``log.jsonl`` and ``ckpt.pt``."""

    def __init__(self, model_cfg: LMConfig, train_cfg: TrainConfig, corpus: Corpus, out_dir: str | Path,
                 name: str = "model", progress: bool = True):
        self.model_cfg, self.cfg, self.name, self.progress = model_cfg, train_cfg, name, progress
        self.out_dir = checkpoint.prepare_dir(out_dir, "out_dir")  # a bad folder fails before any training
        self.log_path, self.ckpt_path = self.out_dir / "log.jsonl", self.out_dir / "ckpt.pt"
        torch.manual_seed(train_cfg.seed)
        self.model = LM(model_cfg)
        self.optimizer = build_optimizer(self.model, train_cfg)
        self.sampler = BatchSampler(corpus.train, train_cfg.batch_size, model_cfg.seq_len, train_cfg.seed)
        self.val_batches = eval_batches(corpus.val, train_cfg.batch_size, model_cfg.seq_len, train_cfg.eval_batches)
        self.step, self.flops, self.tokens, self.wall = 0, 0.0, 0, 0.0
        self.elapsed = 0.0  # seconds spent in run() (steps, evaluation, logging), over every resume
        self.history: list[dict] = []  # every logged record, also written to log.jsonl
        self.routing = RoutingAccumulator()  # training-batch routing stats since the last "routing" record

    # -- checkpoints -------------------------------------------------------------------------------
    def save(self, path: Path | None = None) -> Path:
        """Write the checkpoint atomically (the previous one stays whole until the new one is complete)."""
        return checkpoint.save_checkpoint(path or self.ckpt_path, {
            "model_cfg": asdict(self.model_cfg), "train_cfg": asdict(self.cfg), "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(), "step": self.step, "flops": self.flops,
            "tokens": self.tokens, "wall": self.wall, "elapsed_s": self.elapsed, "history": self.history,
            "sampler_rng": self.sampler.generator.get_state(), **checkpoint.rng_state(),
            "routing_acc": self.routing.state_dict(),
        })

    def load(self, path: Path | None = None) -> None:
        """Resume from a checkpoint of this model (written by this class or the expert-parallel trainer).
        Reads it without running code from it; a file that is not a valid checkpoint of this model raises
        ``mode.checkpoint.CheckpointError`` and leaves the trainer unchanged."""
        path = Path(path or self.ckpt_path)
        where = f"checkpoint {str(path)!r}"
        state = checkpoint.load_checkpoint(path, training=True)
        check_same_model(state["model_cfg"], self.model_cfg, where)
        checkpoint.check_model_state(self.model.state_dict(), state["model"], where)
        try:  # first: the one step that can still reject the file
            self.optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError, TypeError) as e:
            raise checkpoint.CheckpointError(f"{where}: its optimizer state does not fit this model: {e}") from None
        self.model.load_state_dict(state["model"])
        self.step, self.flops, self.tokens, self.wall = state["step"], state["flops"], state["tokens"], state["wall"]
        self.elapsed = state.get("elapsed_s", 0.0)
        self.history = state["history"]
        self.sampler.generator.set_state(state["sampler_rng"])
        checkpoint.set_rng_state(state)
        self.routing.load_state_dict(state.get("routing_acc", {}))
        rewrite_log(self.log_path, self.history)

    def _log(self, record: dict) -> None:
        self.history.append(record)
        with self.log_path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    # -- training ----------------------------------------------------------------------------------
    def train_step(self) -> tuple[float, float]:
        x_BS, y_BS = self.sampler.next()
        lr = lr_at(self.step, self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        out = self.model(x_BS, y_BS)
        self.routing.add_lm(self.model_cfg, out.aux, tuple(x_BS.shape))  # detached sums, no host sync
        (out.loss + out.aux.total()).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        n_tokens = x_BS.numel()
        self.flops += train_flops_per_token(self.model_cfg, aux=out.aux) * n_tokens  # realized routing
        self.tokens += n_tokens
        self.step += 1
        return float(out.loss.detach()), lr

    def evaluate(self) -> float:
        return evaluate(self.model, self.val_batches)

    def routing_record(self) -> dict | None:
        return self.routing.summary() if self.routing else None


def check_same_model(saved_cfg: dict, model_cfg: LMConfig, where: str) -> None:
    """Resuming needs the checkpoint's model config to be this run's: name the first field that differs."""
    now = asdict(model_cfg)
    saved = asdict(checkpoint.model_config_from_dict(saved_cfg, where))  # fields added since: their defaults
    for key in now:
        if saved[key] != now[key]:
            raise ValueError(f"{where}: its model has {key}={saved[key]!r}, this run's has {key}={now[key]!r}; "
                             "resume with the same model, or start a fresh run")


def rewrite_log(log_path: Path, history: list[dict]) -> None:
    """After a resume, log.jsonl holds exactly the restored history: records logged after the checkpoint by
    the interrupted run are dropped (they are logged again, identically, as the run repeats those steps)."""
    checkpoint.atomic_write_text(log_path, "".join(json.dumps(r) + "\n" for r in history))

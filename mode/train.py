"""Training loop: AdamW, warm-up + cosine schedule, gradient clipping, aux losses, periodic validation,
JSONL log, checkpoints that resume to the identical loss curve, and a progress bar. One loop, in one
process or on a ``(dp, ep)`` device mesh (docs/distributed.md).

The loop is the same everywhere; what depends on the setting is chosen once, in ``Trainer.__init__``, as
its runtime: ``OneProcess`` (below: no collectives, single-file checkpoints, no ``torch.distributed``) or
``mode.parallel.runtime.MeshRuntime`` (the model parallelized, this rank's rows, summed scalars, the global
gradient norm, routing statistics summed over ranks, sharded checkpoints).

Checkpoints (every ``ckpt_every`` steps, every ``ckpt_every_s`` seconds, and at the end) are written
atomically and read back without running code from them: one file in the format of ``mode.checkpoint``
in one process, a sharded folder on a mesh (``mode.parallel.checkpoint``); either resumes either kind of
run. docs/checkpoints.md.

Shape legend: B global batch, b = B / W rows per process (W processes; one process: b = B), S sequence.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
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
def evaluate(model: LM, batches, device: torch.device | None = None, autocast=contextlib.nullcontext) -> float:
    """Mean loss over ``batches`` (moved to ``device`` when given, under the ``autocast`` context)."""
    was_training = model.training
    model.eval()
    losses = []
    for x, y in batches:
        if device is not None:
            x, y = x.to(device), y.to(device)
        with autocast():
            losses.append(float(model(x, y).loss))
    model.train(was_training)
    return sum(losses) / len(losses)


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"``: the current CUDA GPU when there is one, else the CPU; ``"cpu"``, ``"cuda"``, ``"cuda:N"``."""
    if device == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={device!r}: must be 'auto', 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: must be 'auto', 'cpu', 'cuda' or 'cuda:N'")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r}: torch.cuda.is_available() is False here; use 'cpu' or 'auto'")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


class OneProcess:
    """The trainer's runtime in one process without a mesh (``mode compare``, ``mode isoflop``, notebooks):
    the interface of ``mode.parallel.runtime.MeshRuntime`` with nothing to communicate. It never imports
    ``torch.distributed``; checkpoints are single files."""

    world_size, rank = 1, 0

    def __init__(self, device: torch.device):
        self.device = device

    def describe(self) -> str:
        return f"one process on {self.device}"

    def guard(self, what: str):
        return contextlib.nullcontext()

    def prepare(self, model: nn.Module, compile: bool = False) -> nn.Module:
        if compile:
            from mode.parallel.blocks import compile_blocks  # no torch.distributed in there

            compile_blocks(model)
        return model

    def rows(self, t_BS: Tensor) -> Tensor:
        return t_BS.to(self.device)

    def sum_scalars(self, values: list) -> list[float]:
        return [float(v) for v in values]

    def clip_grad_norm_(self, params: list[nn.Parameter], max_norm: float) -> Tensor:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def reduce_routing(self, acc: RoutingAccumulator) -> RoutingAccumulator:
        return acc


class Trainer:
    """Trains one LM, in one process or on a device mesh; ``out_dir`` receives ``log.jsonl`` and the checkpoint.

    One process (``mesh=None``): the model as built, on ``device`` (``"cpu"``, the default, ``"cuda"``,
    ``"cuda:N"`` or ``"auto"``: CUDA when present); checkpoints are single files, ``out_dir/ckpt.pt``.

    A mesh (``mode.parallel.build_mesh``, after ``mode.distributed.init_distributed``; ``device``: None or
    ``"auto"``, or the mesh's device type): the LM is built with the same seed on every rank, then
    ``mode.parallel.parallelize``-d (experts sharded over ep, everything sharded by FSDP2); each rank trains
    on its rows of the global batch; checkpoints are sharded, ``out_dir/ckpt/`` (``mode.parallel.checkpoint``).
    Every rank constructs the trainer and calls the same methods in the same order; rank 0 writes the log.
    The losses, gradient norms and checkpoints are those of one process on the same batches, up to float
    rounding (tests/test_ep_training.py), as long as the routing is per sequence or its limits are off:
    token-choice capacity limits and the Switch load-balancing loss are computed over each rank's tokens
    (docs/distributed.md).

    ``bf16``: forward under ``torch.autocast(bfloat16)`` (weights, gradients and AdamW stay float32).
    ``compile``: ``torch.compile`` each block. ``timeout_s``: named in the ``CollectiveError`` raised when a
    collective fails (the process group's own timeout is set where it is initialised).
    """

    def __init__(self, model_cfg: LMConfig, train_cfg: TrainConfig, corpus: Corpus, out_dir: str | Path,
                 name: str = "model", progress: bool = True, *, mesh=None, device: str | torch.device | None = None,
                 bf16: bool = False, compile: bool = False, timeout_s: float | None = None):
        _checks.check_bool("bf16", bf16)
        _checks.check_bool("compile", compile)
        if mesh is None:
            self.runtime = OneProcess(resolve_device("cpu" if device is None else device))
        else:
            from mode.parallel.runtime import MeshRuntime  # torch.distributed only for a mesh

            self.runtime = MeshRuntime(mesh, timeout_s)
            if device not in ("auto", None) and resolve_device(device).type != self.runtime.device.type:
                raise ValueError(f"device={device!r}: the mesh is on {mesh.device_type!r}; pass device='auto' "
                                 f"or {mesh.device_type!r}")
        self.device = self.runtime.device
        self.rank, self.world_size = self.runtime.rank, self.runtime.world_size
        if train_cfg.batch_size % self.world_size:
            raise ValueError(f"batch_size={train_cfg.batch_size}: must be divisible by the number of processes "
                             f"{self.world_size} (each trains on batch_size / processes rows of every batch)")
        self.model_cfg, self.cfg, self.name = model_cfg, train_cfg, name
        self.progress = progress and self.rank == 0
        self.bf16, self.compile = bf16, compile
        self._autocast = ((lambda: torch.autocast(self.device.type, dtype=torch.bfloat16)) if bf16
                          else contextlib.nullcontext)  # chosen once
        self.out_dir = Path(out_dir)
        if self.rank == 0:
            checkpoint.prepare_dir(self.out_dir, "out_dir")  # a bad folder fails before any training
        self.log_path = self.out_dir / "log.jsonl"
        self.ckpt_path = self.out_dir / ("ckpt.pt" if mesh is None else "ckpt")
        torch.manual_seed(train_cfg.seed)  # the same full model in one process and on every rank
        self.model = self.runtime.prepare(LM(model_cfg).to(self.device), compile=compile)
        self.params = list(self.model.parameters())
        self.optimizer = build_optimizer(self.model, train_cfg)
        # Every rank draws the whole global batch from the same seeded sampler and keeps its rows.
        self.sampler = BatchSampler(corpus.train, train_cfg.batch_size, model_cfg.seq_len, train_cfg.seed)
        self.val_batches = eval_batches(corpus.val, train_cfg.batch_size, model_cfg.seq_len, train_cfg.eval_batches)
        self.local_batch = train_cfg.batch_size // self.world_size
        self.step, self.flops, self.tokens, self.wall = 0, 0.0, 0, 0.0
        self.elapsed = 0.0  # seconds spent in run() (steps, evaluation, logging), over every resume
        self.history: list[dict] = []  # every logged record (every rank keeps it), written to log.jsonl by rank 0
        self.routing = RoutingAccumulator()  # this rank's routing stats since the last "routing" record
        self.grad_norm: Tensor | None = None  # the last step's global gradient norm (before clipping)
        self._last_save = 0.0  # time.monotonic() of the last checkpoint (or of the start of run())
        self._save_due = False  # rank 0's ckpt_every_s decision, summed with the last step's scalars

    # -- the loop ----------------------------------------------------------------------------------
    def run(self, stop_step: int | None = None) -> list[dict]:
        """Train up to ``stop_step`` (default: the configured number of steps) and return the history."""
        stop = self.cfg.steps if stop_step is None else min(stop_step, self.cfg.steps)
        if self.rank == 0 and self.step == 0 and not self.history:
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
                self._log({"step": self.step, "loss": loss, "lr": lr, "grad_norm": float(self.grad_norm),
                           "tokens": self.tokens, "flops": self.flops, "wall": self.wall,
                           "tok_s": self.tokens / self.wall})
            if self.step % stats_every == 0 or self.step == self.cfg.steps:
                record = self.routing_record()
                if record is not None:
                    self._log({"step": self.step, "routing": record})  # see docs/reports.md
                self.routing.reset()
            if self.step % self.cfg.eval_every == 0 or self.step == self.cfg.steps:
                self._log({"step": self.step, "val_loss": self.evaluate(), "tokens": self.tokens,
                           "flops": self.flops, "wall": self.wall})
            self.elapsed += time.perf_counter() - t0  # before saving: the checkpoint counts this step
            if (self.cfg.ckpt_every and self.step % self.cfg.ckpt_every == 0) or self._save_due:
                self.save()
                self._last_save, saved_at = time.monotonic(), self.step
        bar.close()
        if saved_at != self.step:
            self.save()
        return self.history

    def _time_to_save(self) -> bool:
        every = self.cfg.ckpt_every_s
        return every is not None and time.monotonic() - self._last_save >= every

    # -- training ----------------------------------------------------------------------------------
    def train_step(self) -> tuple[float, float]:
        with self.runtime.guard(f"training step {self.step + 1}"):
            return self._train_step()

    def _train_step(self) -> tuple[float, float]:
        rt = self.runtime
        x_BS, y_BS = self.sampler.next()  # the global batch (the same on every rank)
        x_bS, y_bS = rt.rows(x_BS), rt.rows(y_BS)  # this rank's rows (one process: all of them)
        lr = lr_at(self.step, self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with self._autocast():
            out = self.model(x_bS, y_bS)
        self.routing.add_lm(self.model_cfg, out.aux, tuple(x_bS.shape))  # detached sums, no host sync
        # loss / W: FSDP sums the gradients over the ranks, giving the gradient of the global mean
        ((out.loss + out.aux.total()) / self.world_size).backward()
        self.grad_norm = rt.clip_grad_norm_(self.params, self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        flops = train_flops_per_token(self.model_cfg, aux=out.aux) * x_bS.numel()  # realized routing, this rank
        due = self.rank == 0 and self._time_to_save()  # clocks differ: rank 0 decides for every rank
        loss_sum, flops, due = rt.sum_scalars([out.loss.detach(), flops, float(due)])  # one all-reduce
        self._save_due = due > 0
        self.flops += flops
        self.tokens += x_BS.numel()
        self.step += 1
        return loss_sum / self.world_size, lr  # mean cross-entropy over the global batch

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation cross-entropy over the fixed validation batches (each split over the ranks):
        the number ``evaluate(model, batches)`` gives for the single-process model."""
        if self.world_size == 1 and isinstance(self.runtime, OneProcess):
            return evaluate(self.model, self.val_batches, self.device, self._autocast)
        with self.runtime.guard("evaluation"):
            was_training = self.model.training
            self.model.eval()
            losses = []
            for x, y in self.val_batches:
                with self._autocast():
                    losses.append(self.model(self.runtime.rows(x), self.runtime.rows(y)).loss.double())
            self.model.train(was_training)
            return float(self.runtime.mean_over_ranks(torch.stack(losses)).mean())

    def routing_record(self) -> dict | None:
        """The routing statistics since the last record, summed over every rank (a collective)."""
        acc = self.runtime.reduce_routing(self.routing)
        return acc.summary() if acc else None

    def _log(self, record: dict) -> None:
        self.history.append(record)
        if self.rank == 0:
            with self.log_path.open("a") as f:
                f.write(json.dumps(record) + "\n")

    # -- checkpoints -------------------------------------------------------------------------------
    def _progress_state(self) -> dict:
        return {"model_cfg": asdict(self.model_cfg), "train_cfg": asdict(self.cfg), "step": self.step,
                "flops": self.flops, "tokens": self.tokens, "wall": self.wall, "elapsed_s": self.elapsed,
                "history": self.history, "sampler_rng": self.sampler.generator.get_state(),
                **checkpoint.rng_state()}

    def save(self, path: Path | None = None) -> Path:
        """Write the checkpoint atomically (the previous one stays whole until the new one is complete).
        One process: a single file. A mesh: a sharded save (every rank must call it)."""
        path = Path(path or self.ckpt_path)
        if isinstance(self.runtime, OneProcess):
            return checkpoint.save_checkpoint(path, {
                **self._progress_state(), "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "routing_acc": self.routing.state_dict()})
        routing = self.runtime.reduce_routing(self.routing).state_dict()  # sums over ranks: what one process holds
        meta = {**self._progress_state(), "routing_acc": routing,
                "parallel": {"dp": self.runtime.dims.dp, "ep": self.runtime.dims.ep, "world_size": self.world_size}}
        return self.runtime.save(path, self.model, self.optimizer, meta)

    def _default_ckpt(self) -> Path:
        """This trainer's checkpoint, else the other kind in ``out_dir`` (resuming a sharded run in one
        process, or a single-process run on a mesh)."""
        other = self.out_dir / ("ckpt" if self.ckpt_path.name == "ckpt.pt" else "ckpt.pt")
        return self.ckpt_path if self.ckpt_path.exists() or not other.exists() else other

    def load(self, path: Path | str | None = None) -> None:
        """Resume from a checkpoint of this model: a single file or a sharded folder, written by one process
        or by any mesh (any world size, any (dp, ep)). Reads it without running code from it; a checkpoint
        that is not valid for this model raises ``mode.checkpoint.CheckpointError`` (a ValueError) before
        any tensor changes. Default: ``ckpt_path`` (else the other kind found in ``out_dir``)."""
        path = Path(path) if path is not None else self._default_ckpt()
        where = f"checkpoint {str(path)!r}"

        def check(state: dict) -> None:
            check_same_model(state["model_cfg"], self.model_cfg, where)

        if isinstance(self.runtime, OneProcess):
            state = checkpoint.load_checkpoint(path, training=True)  # a folder: read in full, here
            check(state)
            checkpoint.check_model_state(self.model.state_dict(), state["model"], where)
            try:  # first: the one step that can still reject the file
                self.optimizer.load_state_dict(state["optimizer"])
            except (ValueError, KeyError, TypeError) as e:
                raise checkpoint.CheckpointError(f"{where}: its optimizer state does not fit this model: {e}") \
                    from None
            self.model.load_state_dict(state["model"])
        else:
            state = self.runtime.load(path, self.model, self.optimizer, check)
        self.step, self.flops, self.tokens, self.wall = state["step"], state["flops"], state["tokens"], state["wall"]
        self.elapsed = state.get("elapsed_s", 0.0)
        self.history = state["history"]
        self.sampler.generator.set_state(state["sampler_rng"])
        checkpoint.set_rng_state(state)
        self.routing.reset()
        if self.rank == 0:  # the saved sums are over all ranks: one rank holds them, the next all-reduce adds
            self.routing.load_state_dict(state.get("routing_acc", {}))
            rewrite_log(self.log_path, self.history)


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

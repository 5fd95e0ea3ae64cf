"""Training loop: AdamW, warm-up + cosine schedule, gradient clipping, aux losses, periodic validation,
JSONL log, checkpoints that resume to the identical loss curve, and progress (a bar on a terminal, plain
lines in a log: ``mode.train.progress``). One loop, in one process or on a ``(dp, ep)`` device mesh
(docs/distributed.md).

The loop is the same everywhere; what depends on the setting is its runtime (``mode.train.runtime``),
fixed once in ``Trainer.__init__``: ``OneProcess`` (no collectives, single-file checkpoints, no
``torch.distributed``) or ``mode.parallel.runtime.MeshRuntime`` (the model parallelized, this rank's rows,
summed scalars, the global gradient norm, routing statistics summed over ranks, sharded checkpoints). The
caller chooses it: ``runtime=``, or ``mesh=`` (a runtime built by the factory ``mode.parallel`` registers).

Checkpoints (every ``ckpt_every`` steps, every ``ckpt_every_s`` seconds, and at the end) are written
atomically and read back without running code from them: one file in the format of ``mode.train.checkpoint``
in one process, a sharded folder on a mesh (``mode.parallel.checkpoint``); either resumes either kind of
run. docs/checkpoints.md.

Preemption: with ``trainer.preemption`` set (``mode.train.preempt.Preemption``, whose ``requested`` turns True on
SIGTERM), every rank reads the flag at the end of each step, the step's one all-reduce sums it, and ``run()``
stops after that same step on every rank, saves, and returns with ``trainer.preempted`` True.

Shape legend: B global batch, b = B / W rows per process (W processes; one process: b = B), S sequence.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor

from mode import _checks
from mode.measure.flops import train_flops_per_token
from mode.measure.stats import RoutingAccumulator
from mode.model import LM, LMConfig
from mode.model.checkpointing import checkpoint_blocks
from mode.model.deferred_init import build_on_meta
from mode.routing.bias_balance import bias_routers, update_expert_bias
from mode.train import checkpoint, faults, log_sinks
from mode.train.accumulate import GradAccumulation
from mode.train.config import TrainConfig
from mode.train.data import BatchSampler, Corpus, eval_batches
from mode.train.graphs import GraphedTrainStep
from mode.train.optim import build_optimizer, lr_at
from mode.train.progress import Progress
from mode.train.runtime import OneProcess, Runtime, mesh_runtime, resolve_device, to_device

if TYPE_CHECKING:
    from mode.train.preempt import Preemption


@torch.no_grad()
def evaluate(
    model: LM,
    batches,
    device: torch.device | None = None,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> float:
    """Mean loss over ``batches`` (moved to ``device``, by default the model's: ``eval_batches``' windows stay
    on the CPU, the model may be on a GPU; under the ``autocast`` context)."""
    if device is None:
        device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    losses = []
    for x, y in batches:
        x, y = to_device(x, device), to_device(y, device)
        with autocast():
            losses.append(float(model(x, y).loss))
    model.train(was_training)
    return sum(losses) / len(losses)


class Trainer:
    """Trains one LM, in one process or on a device mesh; ``out_dir`` receives ``log.jsonl`` and the checkpoint.

    The caller picks where it runs: ``runtime`` (a ``mode.train.runtime.Runtime``, e.g.
    ``mode.parallel.MeshRuntime(mesh)``), or ``mesh`` (its runtime comes from the factory that importing
    ``mode.parallel`` registers), or neither: one process.

    One process (``mesh=None``): the model as built, on ``device`` (``"cpu"``, the default, ``"cuda"``,
    ``"cuda:N"`` or ``"auto"``: CUDA when present); checkpoints are single files, ``out_dir/ckpt.pt``.

    A mesh (``mode.parallel.build_mesh``, after ``mode.parallel.process_group.init_distributed``; ``device``: None or
    ``"auto"``, or the mesh's device type): the LM is built with the same seed on every rank, then
    ``mode.parallel.parallelize``-d (experts sharded over ep, everything sharded by FSDP2); each rank trains
    on its rows of the global batch; checkpoints are sharded, ``out_dir/ckpt/`` (``mode.parallel.checkpoint``).
    Every rank constructs the trainer and calls the same methods in the same order; rank 0 writes the log.
    The losses, gradient norms and checkpoints are those of one process on the same batches, up to float
    rounding (tests/parallel/test_ep_training.py), as long as the routing is per sequence or its limits are off:
    token-choice capacity limits and the Switch load-balancing loss are computed over each rank's tokens
    (docs/distributed.md), unless the loss's scope is "global" (docs/routing.md). Routers that balance with a
    bias are updated after every optimizer step (``mode.routing.update_expert_bias``).

    Gradient accumulation (``train_cfg.grad_accum`` = N): each rank's rows in N micro-batches per optimizer
    step, with the whole batch's loss and gradient (``mode.train.accumulate``); on a mesh, FSDP reduces the
    gradients after the last micro-batch only. Activation checkpointing (``activation_checkpointing``): every
    block recomputed in backward (``mode.model.checkpointing``). The log: docs/training.md.

    ``progress``: True/False for a bar (on a terminal only) or none; plain progress lines print either way
    (``mode.train.progress``; a ``Progress`` sets their interval or turns them off). Rank 0 reports.
    ``bf16``: forward under ``torch.autocast(bfloat16)`` (weights, gradients and AdamW stay float32).
    ``dtype``: the weights', gradients' and AdamW's dtype, ``torch.float32`` or ``torch.float64``. float64 is for
    exactness checks: a run on a mesh against one process differs by sums taken in another order, ~1e-16 in
    float64, far below the gaps between routing scores at a top-k boundary, so no near-tie flips a decision
    (float32's ~1e-7 does: tests/parallel/test_ep_training.py). The model is built as in float32 (the same
    initial values), then converted.
    ``compile``: ``torch.compile`` each block. ``timeout_s``: named in the ``CollectiveError`` raised when a
    collective fails (the process group's own timeout is set where it is initialised). ``cuda_graphs``: after a
    few eager steps, capture the whole step (forward, backward, clipping, AdamW) in one CUDA graph and replay
    it (``mode.train.graphs``; one process on CUDA, ValueError elsewhere); AdamW is then ``capturable``.
    """

    def __init__(
        self,
        model_cfg: LMConfig,
        train_cfg: TrainConfig,
        corpus: Corpus,
        out_dir: str | Path,
        name: str = "model",
        progress: bool | Progress = True,
        *,
        mesh=None,
        runtime: Runtime | None = None,
        device: str | torch.device | None = None,
        bf16: bool = False,
        compile: bool = False,
        timeout_s: float | None = None,
        cuda_graphs: bool = False,
        dtype: torch.dtype = torch.float32,
    ):
        _checks.check_bool("bf16", bf16)
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"dtype={dtype!r}: must be torch.float32 or torch.float64 (bfloat16 training: bf16=True)")
        if bf16 and dtype == torch.float64:
            raise ValueError("bf16=True with dtype=torch.float64: choose one (float64 is for exactness checks)")
        _checks.check_bool("compile", compile)
        _checks.check_bool("cuda_graphs", cuda_graphs)
        if runtime is not None and mesh is not None:
            raise ValueError("mesh and runtime: give one of them (a runtime already knows its mesh)")
        if runtime is not None and not isinstance(runtime, Runtime):
            raise TypeError(f"runtime={type(runtime).__name__}: must implement mode.train.runtime.Runtime")
        if runtime is None:
            runtime = (
                OneProcess(resolve_device("cpu" if device is None else device))
                if mesh is None
                else mesh_runtime(mesh, timeout_s)
            )
        if device not in ("auto", None) and resolve_device(device).type != runtime.device.type:
            raise ValueError(
                f"device={device!r}: the mesh is on {runtime.device.type!r}; pass device='auto' "
                f"or {runtime.device.type!r}"
            )
        self.runtime = runtime
        self.device = self.runtime.device
        self.rank, self.world_size = self.runtime.rank, self.runtime.world_size
        if train_cfg.batch_size % self.world_size:
            raise ValueError(
                f"batch_size={train_cfg.batch_size}: must be divisible by the number of processes "
                f"{self.world_size} (each trains on batch_size / processes rows of every batch)"
            )
        if (train_cfg.batch_size // self.world_size) % train_cfg.grad_accum:
            raise ValueError(
                f"grad_accum={train_cfg.grad_accum}: must divide the rows each process trains on, "
                f"batch_size / processes = {train_cfg.batch_size} / {self.world_size} = "
                f"{train_cfg.batch_size // self.world_size} (micro-batches of equal size)"
            )
        if train_cfg.activation_checkpointing and compile:
            raise ValueError("activation_checkpointing=True with compile=True: not supported together yet; choose one")
        if model_cfg.vocab_size < corpus.vocab_size:  # an id past the embedding would fail mid-run
            raise ValueError(
                f"model_cfg.vocab_size={model_cfg.vocab_size}: the data's ids go up to "
                f"{corpus.vocab_size - 1} ({corpus.source}); must be >= {corpus.vocab_size}"
            )
        self.model_cfg, self.cfg, self.name = model_cfg, train_cfg, name
        self.data = corpus.record()  # kept in the checkpoint: mode sample decodes with it
        progress = Progress.of(progress)
        self.progress = progress if self.rank == 0 else Progress(bar=False, lines=False)  # rank 0 reports
        self.bf16, self.compile = bf16, compile
        self._autocast = (
            (lambda: torch.autocast(self.device.type, dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
        )  # chosen once
        self.out_dir = Path(out_dir)
        if self.rank == 0:
            checkpoint.prepare_dir(self.out_dir, "out_dir")  # a bad folder fails before any training
        self.log_path = self.out_dir / "log.jsonl"
        self.ckpt_path = self.out_dir / self.runtime.checkpoint_name
        torch.manual_seed(train_cfg.seed)  # the same full model in one process and on every rank
        # a runtime that shards builds on meta and materializes its shards only: the eager build's values.
        # The eager build draws on the CPU whatever the default device (under set_default_device("cuda") it
        # drew from the CUDA generator: another initialization for the same seed), then moves to the device.
        if getattr(self.runtime, "builds_on_meta", False):
            model = build_on_meta(lambda: LM(model_cfg))
        else:
            with torch.device("cpu"):
                model = LM(model_cfg)
            model = model.to(self.device)
        if dtype != torch.float32:
            model = model.to(dtype)  # on meta too: materialize copies the float32 draws into float64 storage
        self.dtype = dtype
        # prepared in place (compiled blocks, FSDP's subclass of the model's class): still the LM
        self.model = cast(LM, self.runtime.prepare(model, compile=compile))
        if train_cfg.activation_checkpointing:
            checkpoint_blocks(self.model)  # on the prepared model: FSDP's hooks stay outside the checkpoints
        self.params = list(self.model.parameters())
        self.accumulation = GradAccumulation(self.model, train_cfg.grad_accum, self._autocast, self.device)
        # FSDP: reduce the gradients after the last micro-batch only (runtimes without it: always in sync)
        self._gradient_sync = getattr(self.runtime, "set_gradient_sync", None) if train_cfg.grad_accum > 1 else None
        self.bias_routers = bias_routers(self.model)  # aux-loss-free balancing: updated after every step
        self.optimizer = build_optimizer(self.model, train_cfg)
        # cuda_graphs: the step captured and replayed (replaces self.optimizer by a capturable AdamW)
        self.graphed = GraphedTrainStep(self) if cuda_graphs else None
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
        # preemption: an object whose ``requested`` turns True on SIGTERM (mode.train.preempt.Preemption), read
        # by every rank at the end of each step and summed with the step's scalars: all ranks stop together
        self.preemption: Preemption | None = None
        self._stop = False  # some rank was asked to stop during the last step
        self.preempted = False  # run() returned early, at a step boundary, after saving (mode train: status 143)
        # MFU's denominator: every process's device at its peak (None: a CPU or an unknown GPU, no MFU)
        peak = log_sinks.peak_flops(self.device, train_cfg.peak_tflops)
        self.peak_flops = None if peak is None else peak * self.world_size
        # a second MFU against a ceiling measured on this device (mode train sets it: log_sinks.measure_matmul_flops)
        self.measured_peak_flops: float | None = None
        if train_cfg.tensorboard:
            log_sinks.summary_writer_class()  # fails on every rank alike when tensorboard is missing
        self.tensorboard = (
            log_sinks.TensorBoardLog(self.out_dir / "tb") if train_cfg.tensorboard and self.rank == 0 else None
        )  # rank 0 writes the logs

    # -- the loop ----------------------------------------------------------------------------------
    def run(self, stop_step: int | None = None) -> list[dict]:
        """Train up to ``stop_step`` (default: the configured number of steps) and return the history."""
        stop = self.cfg.steps if stop_step is None else min(stop_step, self.cfg.steps)
        if self.rank == 0 and self.step == 0 and not self.history:
            self.log_path.write_text("")
        self._last_save = time.monotonic()
        saved_at = None
        progress = self.progress.start(self.name, stop, self.step)
        stats_every = self.cfg.stats_every or self.cfg.eval_every
        while self.step < stop:
            t0, flops0 = time.perf_counter(), self.flops
            loss, lr = self.train_step()
            dt = time.perf_counter() - t0
            self.wall += dt
            step_mfu = log_sinks.mfu(self.flops - flops0, dt, self.peak_flops)
            bar_extra = {"flops": f"{self.flops:.2e}", **({} if step_mfu is None else {"mfu": f"{step_mfu:.1%}"})}
            progress.update(self.step, loss, self.tokens / self.wall, bar_extra)
            if self.step % self.cfg.log_every == 0 or self.step == stop:
                self._log(
                    {
                        "step": self.step,
                        "loss": loss,
                        "lr": lr,
                        "grad_norm": float(self.grad_norm),  # pyright: ignore[reportArgumentType] - set by this step
                        "tokens": self.tokens,
                        "flops": self.flops,
                        "wall": self.wall,
                        **self._speed(),
                    }
                )
            if self.step % stats_every == 0 or self.step == self.cfg.steps:
                record = self.routing_record()
                if record is not None:
                    self._log({"step": self.step, "routing": record})  # see docs/reports.md
                self.routing.reset()
            if self.step % self.cfg.eval_every == 0 or self.step == self.cfg.steps:
                self._log(
                    {
                        "step": self.step,
                        "val_loss": self.evaluate(),
                        "tokens": self.tokens,
                        "flops": self.flops,
                        "wall": self.wall,
                        **self._speed(),
                    }
                )
            self.elapsed += time.perf_counter() - t0  # before saving: the checkpoint counts this step
            faults.inject("step", self.rank, self.step)  # tests: this rank killed or preempted here (if planned)
            if (self.cfg.ckpt_every and self.step % self.cfg.ckpt_every == 0) or self._save_due:
                self.save()
                self._last_save, saved_at = time.monotonic(), self.step
            if self._stop:  # SIGTERM on some rank: the step is done, save (below) and return
                self.preempted = True
                break
        progress.close()
        if saved_at != self.step:
            self.save()
        wait_saves = getattr(self.runtime, "wait_saves", None)  # MeshRuntime(async_save=True) saves in the background
        if wait_saves is not None:
            wait_saves()  # run() returns with its last checkpoint complete
        if self.tensorboard is not None:
            self.tensorboard.flush()
        return self.history

    def _speed(self) -> dict:
        """Training tokens per second (all processes) and, with a known peak, the model FLOPs utilisation
        (mode.train.log_sinks), both averaged over the training steps so far (evaluation excluded)."""
        speed = {"tok_s": self.tokens / self.wall}
        mfu = log_sinks.mfu(self.flops, self.wall, self.peak_flops)
        if mfu is not None:
            speed["mfu"] = mfu
        measured = (
            None
            if self.measured_peak_flops is None
            else log_sinks.mfu(self.flops, self.wall, self.measured_peak_flops * self.world_size)
        )
        if measured is not None:
            speed["mfu_measured"] = measured
        return speed

    def _time_to_save(self) -> bool:
        every = self.cfg.ckpt_every_s
        return every is not None and time.monotonic() - self._last_save >= every

    # -- training ----------------------------------------------------------------------------------
    def train_step(self) -> tuple[float, float]:
        """One optimizer step on the next global batch (every rank together, inside the runtime's ``guard``): returns
        ``(loss, lr)``, the mean cross-entropy over the global batch and the learning rate the step used."""
        with self.runtime.guard(f"training step {self.step + 1}"):
            return self._train_step()

    def _train_step(self) -> tuple[float, float]:
        rt = self.runtime
        x_BS, y_BS = self.sampler.next()  # the global batch (the same on every rank)
        lr = lr_at(self.step, self.cfg)
        if self.graphed is not None:  # one process: its rows are the global batch
            ce, flops, self.grad_norm = self.graphed.step(x_BS, y_BS, lr)
        else:
            ce, flops = self._eager_step(rt.rows(x_BS), rt.rows(y_BS), lr)
        due = self.rank == 0 and self._time_to_save()  # clocks differ: rank 0 decides for every rank
        stop = self.preemption is not None and self.preemption.requested  # this rank's own signal
        loss_sum, flops, due, stop = rt.sum_scalars([ce, flops, float(due), float(stop)])  # one all-reduce
        self._save_due = due > 0
        self._stop = stop > 0
        self.flops += flops
        self.tokens += x_BS.numel()
        self.step += 1
        return loss_sum / self.world_size, lr  # mean cross-entropy over the global batch

    def _eager_step(self, x_bS: Tensor, y_bS: Tensor, lr: float) -> tuple[Tensor | float, Tensor | float]:
        """Forward and backward of this rank's rows, clipping, AdamW, the bias update; returns (this rank's mean
        cross-entropy, its realized training FLOPs), unread."""
        rt = self.runtime
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        n = self.cfg.grad_accum
        micro = self.accumulation.split(x_bS, y_bS)  # n micro-batches (n = 1: the rows themselves)
        ce_sum, flops = 0.0, 0.0
        with self.accumulation.whole_batch_routing(micro):  # "global" balance loss: the whole batch's counts
            for i, (x_mS, y_mS) in enumerate(micro):
                if self._gradient_sync is not None:
                    self._gradient_sync(self.model, i == n - 1)  # FSDP reduces once, after the last one
                with self._autocast():
                    out = self.model(x_mS, y_mS)
                self.routing.add_lm(self.model_cfg, out.aux, tuple(x_mS.shape))  # pyright: ignore[reportArgumentType] - (b, S)
                # loss / (W n): FSDP sums the gradients over the ranks, the micro-batches add up in .grad:
                # the gradient of the global mean
                ((out.loss + out.aux.total()) / (self.world_size * n)).backward()
                ce_sum = ce_sum + out.loss.detach()
                # realized routing, kept on the device (read=False): read with the step's other scalars below
                flops = flops + train_flops_per_token(self.model_cfg, aux=out.aux, read=False) * x_mS.numel()
        self.grad_norm = rt.clip_grad_norm_(self.params, self.cfg.grad_clip)
        # AdamW creates its step counters on the default device (torch.tensor(0.0)) and reads them with
        # .item() for every parameter: on the host as without set_default_device("cuda"), no sync each
        with torch.device("cpu"):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        update_expert_bias(self.model, self.bias_routers)  # the step's choice counts, summed over ranks
        return ce_sum / n, flops

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation cross-entropy over the fixed validation batches (each split over the ranks):
        the number ``evaluate(model, batches)`` gives for the single-process model."""
        if self.world_size == 1 and isinstance(self.runtime, OneProcess):
            # the prepared model is the LM itself in one process (OneProcess.prepare returns it)
            return evaluate(self.model, self.val_batches, self.device, self._autocast)  # pyright: ignore[reportArgumentType]
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
        if self.graphed is not None:
            self.graphed.drain()
        acc = self.runtime.reduce_routing(self.routing)
        return acc.summary() if acc else None

    def _log(self, record: dict) -> None:
        self.history.append(record)
        if self.rank == 0:
            with self.log_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            if self.tensorboard is not None:
                self.tensorboard.write(record)

    # -- checkpoints -------------------------------------------------------------------------------
    def _progress_state(self) -> dict:
        return {
            "model_cfg": asdict(self.model_cfg),
            "train_cfg": asdict(self.cfg),
            "data": self.data,
            "step": self.step,
            "flops": self.flops,
            "tokens": self.tokens,
            "wall": self.wall,
            "elapsed_s": self.elapsed,
            "history": self.history,
            "sampler_rng": self.sampler.generator.get_state(),
            **checkpoint.rng_state(),
        }

    def save(self, path: Path | None = None) -> Path:
        """Write the checkpoint atomically (the previous one stays whole until the new one is complete).
        One process: a single file. A mesh: a sharded save (every rank must call it)."""
        path = Path(path or self.ckpt_path)
        if self.graphed is not None:
            self.graphed.drain()
        routing = self.runtime.reduce_routing(self.routing).state_dict()  # sums over ranks: what one process holds
        return self.runtime.save(path, self.model, self.optimizer, {**self._progress_state(), "routing_acc": routing})

    def _default_ckpt(self) -> Path:
        """This trainer's checkpoint, else the other kind in ``out_dir`` (resuming a sharded run in one
        process, or a single-process run on a mesh)."""
        other = self.out_dir / (
            "ckpt" if self.ckpt_path.name == OneProcess.checkpoint_name else OneProcess.checkpoint_name
        )
        return self.ckpt_path if self.ckpt_path.exists() or not other.exists() else other

    def load(self, path: Path | str | None = None) -> None:
        """Resume from a checkpoint of this model: a single file or a sharded folder, written by one process
        or by any mesh (any world size, any (dp, ep)). Reads it without running code from it; a checkpoint
        that is not valid for this model raises ``mode.train.checkpoint.CheckpointError`` (a ValueError) before
        any tensor changes. Default: ``ckpt_path`` (else the other kind found in ``out_dir``)."""
        path = Path(path) if path is not None else self._default_ckpt()
        where = f"checkpoint {str(path)!r}"

        def check(state: dict) -> None:
            check_same_model(state["model_cfg"], self.model_cfg, where)

        state = self.runtime.load(path, self.model, self.optimizer, check)
        if self.graphed is not None:
            self.graphed.reset()  # the optimizer's state tensors are new: warm up and capture again
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
            raise ValueError(
                f"{where}: its model has {key}={saved[key]!r}, this run's has {key}={now[key]!r}; "
                "resume with the same model, or start a fresh run"
            )


def rewrite_log(log_path: Path, history: list[dict]) -> None:
    """After a resume, log.jsonl holds exactly the restored history: records logged after the checkpoint by
    the interrupted run are dropped (they are logged again, identically, as the run repeats those steps)."""
    checkpoint.atomic_write_text(log_path, "".join(json.dumps(r) + "\n" for r in history))

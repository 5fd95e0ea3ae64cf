"""One training run of a FLOP-matched sweep (`mode compare`, `mode isoflop`): its step count for a
training-FLOP budget, its training config, training with resume, and its held-out loss per window.

Shape legend: B batch (windows), S sequence.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F

from mode.experiments import run_record
from mode.measure.flops import train_flops_per_token
from mode.model import LM, LMConfig
from mode.train import TrainConfig, Trainer, sources
from mode.train.data import PACKAGES, Corpus, eval_batches
from mode.train.packages import PackagesInfo
from mode.train.progress import log_line


def load_corpus(data: str | None, seq_len: int, max_bytes: int | None = None, log=print) -> Corpus:
    """A sweep's data (``mode.train.sources.load_corpus``, byte-level: no token-shard folders): None the built-in
    corpus (its first ``max_bytes`` bytes), ``"packages"`` the installed packages' sources, else a UTF-8 text file."""
    return sources.load_corpus(data, seq_len, max_bytes, log=log, token_folders=False)


def data_identity(data: str | None) -> str | None:
    """What a run record keeps of ``data``: None, ``"packages"`` (its bytes are in the corpus fingerprint), or
    the file's absolute path."""
    return data if data in (None, PACKAGES) else str(Path(data).resolve())


def data_record(corpus: Corpus) -> dict:
    """The corpus as a results JSON records it: source, byte counts and, for the packages corpus, the file
    count, the list hash and what was left out (the exact corpus depends on the installed versions)."""
    out = {"source": corpus.source, **run_record.fingerprint(corpus)}
    if corpus.packages is not None:
        out["packages"] = cast(PackagesInfo, corpus.packages).to_dict()
    return out


def step_flops(cfg: LMConfig, batch_size: int) -> float:
    """Nominal training FLOPs of one step (balanced routing where routing is dynamic)."""
    return train_flops_per_token(cfg) * batch_size * cfg.seq_len


def steps_for_budget(cfg: LMConfig, budget: float, batch_size: int, what: str = "model") -> int:
    """The whole number of steps whose nominal training FLOPs are nearest to ``budget`` (within half a
    step). A budget below one step of ``cfg`` is an error: the run could not hit it."""
    cost = step_flops(cfg, batch_size)
    steps = round(budget / cost)
    if steps < 1:
        raise ValueError(
            f"budget={budget:.3g} FLOPs: less than one training step of {what} ({cost:.3g} FLOPs per "
            "step); raise the budget or drop the size"
        )
    return steps


def run_train_config(base: TrainConfig, steps: int, seed: int, ckpt_every_s: float | None) -> TrainConfig:
    """``base`` for a run of ``steps`` steps on seed ``seed``: warm-up at most a fifth of the run. The seed
    fixes the data order (``BatchSampler``), so runs with the same seed see the same batches."""
    return replace(
        base, steps=steps, seed=seed, warmup_steps=min(base.warmup_steps, steps // 5), ckpt_every_s=ckpt_every_s
    )


def validation_windows(corpus: Corpus, seq_len: int, windows: int, batch_size: int) -> list:
    """``windows`` fixed, evenly spaced windows of the validation split, in batches of ``batch_size``: the
    same for every model and every seed."""
    if windows % batch_size:
        raise ValueError(f"eval_windows={windows}: must be a multiple of eval_batch_size={batch_size}")
    return eval_batches(corpus.val, batch_size, seq_len, windows // batch_size)


@torch.no_grad()
def window_losses(model: LM, batches) -> list[float]:
    """Mean next-byte loss of each validation window (top-C routing, as in training), on the model's device."""
    was_training = model.training
    model.eval()
    device = model.embed.weight.device
    out = []
    for x_BS, y_BS in batches:
        x_BS, y_BS = x_BS.to(device), y_BS.to(device)
        logits_BSV = model(x_BS).logits_BSV.float()
        out += F.cross_entropy(logits_BSV.transpose(1, 2), y_BS, reduction="none").mean(1).tolist()
    model.train(was_training)
    return out


def train(
    cfg: LMConfig,
    tcfg: TrainConfig,
    corpus: Corpus,
    run_dir: Path,
    name: str,
    progress: bool,
    resume: bool,
    log=log_line,
    device: str | None = None,
    bf16: bool = False,
) -> Trainer:
    """Train one run into ``run_dir``; when ``resume``, continue from its checkpoint if there is one.
    ``device``/``bf16`` go to the trainer only when set (a GPU sweep); the CPU default needs neither."""
    extra: dict[str, Any] = {} if device is None else {"device": device}
    if bf16:
        extra["bf16"] = True
    trainer = Trainer(cfg, tcfg, corpus, run_dir, name=name, progress=progress, **extra)
    if resume and trainer.ckpt_path.is_file():
        try:
            trainer.load()  # the run's arguments matched: this checkpoint belongs to it
        except ValueError as e:
            raise ValueError(f"{e}; pass --fresh to start over") from None
        log(f"{name}: resuming at step {trainer.step} of {tcfg.steps} from {trainer.ckpt_path}")
    trainer.run()
    return trainer

"""Training one model: the loop, its data, its checkpoints, its optimizer and schedule.

    trainer     ``Trainer``: AdamW, schedule, clipping, aux losses, validation, JSONL log, exact resume
    graphs      ``GraphedTrainStep``: the whole step captured in one CUDA graph and replayed (``cuda_graphs=True``)
    runtime     ``Runtime``, the protocol the trainer runs on, and ``OneProcess``; ``mode.parallel`` brings a mesh
    config      ``TrainConfig``
    optim       ``build_optimizer`` (AdamW) and ``lr_at`` (warm-up + cosine)
    data        the byte corpora and the seeded, resumable batch sampler
    sources     ``load_corpus``: what --data names, as one corpus
    tokens      folders of pre-tokenized shards (nanoGPT's .bin / .npy), read lazily; their meta.json
    tokenize    ``mode tokenize``: text to such shards with a Hugging Face tokenizer.json
    checkpoint  the single-file checkpoint format and atomic writes
    preempt     SIGTERM: finish the step, save, exit 143 (``Preemption``, ``EXIT_PREEMPTED``)
    faults      fault injection for tests and benchmarks (``MODE_TEST_FAULT``)

This package imports the library core and ``mode.measure``, never ``mode.parallel`` (docs/architecture.md).
"""

from mode.train.checkpoint import load_model
from mode.train.config import TrainConfig
from mode.train.optim import build_optimizer, lr_at
from mode.train.runtime import OneProcess, Runtime, resolve_device
from mode.train.trainer import Trainer, evaluate

__all__ = [
    "OneProcess",
    "Runtime",
    "TrainConfig",
    "Trainer",
    "build_optimizer",
    "evaluate",
    "load_model",
    "lr_at",
    "resolve_device",
]

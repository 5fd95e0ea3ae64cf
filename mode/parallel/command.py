"""``mode train``: train the LM in one process or on a (dp, ep) mesh of processes started by torchrun.

    mode train --preset quick --out runs/one                                  # one process (CPU or GPU)
    torchrun --nproc-per-node 4 -m mode train --preset quick --dp 2 --ep 2 --out runs/mesh
    torchrun --nproc-per-node 8 -m mode train --preset base --ep 8 --device cuda --bf16 --out runs/gpu8

Without torchrun (no ``RANK``/``WORLD_SIZE`` in the environment) the run is one process with no process
group, and checkpoints are single files (``OUT/ckpt.pt``). Under torchrun every process joins the default
group (gloo on CPU, NCCL on CUDA; ``mode.parallel.process_group.init_distributed``), builds the ``(dp, ep)`` mesh
and trains its rows of every batch; checkpoints are sharded (``OUT/ckpt/``). ``--resume`` continues from
either kind found in OUT, ``--resume-from PATH`` from any checkpoint (a file or a sharded folder, any
layout). ``--resume auto`` continues from a complete checkpoint in OUT when there is one and starts a new run
when there is none, so that one command line both starts and continues a run (what a scheduler or torchelastic
reruns); without ``--resume``, a checkpoint already in OUT is an error, never overwritten. Resuming uses the
newest checkpoint that verifies (``mode.parallel.resume``; ``--keep K`` keeps K of them). SIGTERM ends the run
after the step in progress with a checkpoint and status 143 (``mode.train.preempt``); under ``torchrun
--max-restarts N`` a group whose rank died restarts and resumes (``mode.parallel.elastic``). docs/distributed.md.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mode.model import LMConfig
    from mode.train import TrainConfig

# Nothing here imports torch at import time (the package ``mode`` and ``mode.parallel`` do not either): ``mode
# --help`` and ``mode train --help`` build this parser without it. The configs load in the functions below.

PRESET_VALUES = {  # name -> (LMConfig fields, TrainConfig fields, max_corpus_bytes, doc); PRESETS builds them
    "quick": (
        dict(
            seq_len=64,
            d_model=64,
            n_heads=2,
            d_hidden=128,
            num_experts=8,
            num_noop=2,
            top_k=1,
            layers=("moe", "staged", "moe", "integrated"),
            causal="predictor",
        ),
        dict(steps=60, batch_size=8, lr=3e-3, warmup_steps=10, eval_every=30, eval_batches=4, log_every=10),
        2_000_000,
        "a smoke run: about a minute on 2 CPU cores with 4 processes",
    ),
    "small": (
        dict(
            seq_len=256,
            d_model=128,
            n_heads=4,
            d_hidden=512,
            num_experts=8,
            num_noop=4,
            top_k=1,
            layers=("moe", "staged", "moe", "integrated", "moe", "staged"),
            causal="predictor",
        ),
        dict(steps=1000, batch_size=16, lr=3e-3, warmup_steps=50, eval_every=100, eval_batches=8, log_every=10),
        None,
        "CPU-sized: 6 layers, d_model 128, 8 experts",
    ),
    "base": (
        dict(
            seq_len=512,
            d_model=512,
            n_heads=8,
            d_hidden=2048,
            num_experts=16,
            num_noop=8,
            top_k=2,
            layers=("moe", "staged") * 3 + ("integrated",) * 2,
            causal="predictor",
        ),
        dict(steps=5000, batch_size=64, lr=1e-3, warmup_steps=200, eval_every=250, eval_batches=8, log_every=10),
        None,
        "GPU-sized: 8 layers, d_model 512, 16 experts, top-2",
    ),
    "gpu": (
        dict(
            seq_len=2048,
            d_model=1024,
            n_heads=16,
            d_hidden=4096,
            num_experts=8,
            expert_hidden=2048,
            num_noop=0,
            top_k=2,
            activation="swiglu",
            layers=("moe", "staged") * 8,
            causal="predictor",
        ),
        dict(steps=5000, batch_size=32, lr=6e-4, warmup_steps=200, eval_every=500, eval_batches=4, log_every=10),
        None,
        "one H100/H200, device-bound: 16 layers (moe, staged), d_model 1024, 8 SwiGLU experts of 2048, "
        "top-2, seq 2048, batch 32: 873M parameters; with --bf16 about 60-70 GB (docs/gpu.md)",
    ),
}
# Defaults the help states that live in modules importing torch; tests/test_cli_conventions.py checks that they
# are those modules' values.
MODEL_DEFAULTS = {"router": "token_choice", "balance_coef": 0.01}  # LMConfig's
DEFAULT_GRACE_S, EXIT_PREEMPTED = 25.0, 143  # mode.train.preempt's
TIMEOUT_ENV, DEFAULT_TIMEOUT_S = "MODE_DIST_TIMEOUT_S", 300.0  # mode.parallel.process_group's


GPU_PRESET_PARAMS = 873_375_752  # parameters of the "gpu" preset (vocabulary 256), checked by the tests on meta


@dataclass(frozen=True)
class Preset:
    model: LMConfig
    train: TrainConfig
    max_corpus_bytes: int | None  # of the default corpus (the standard library's sources); None: all of it
    doc: str


@functools.cache
def presets() -> dict[str, Preset]:
    """``PRESET_VALUES`` as configs (``PRESETS``)."""
    from mode.model import LMConfig
    from mode.train import TrainConfig

    return {
        name: Preset(LMConfig(**m), TrainConfig(**t), max_bytes, doc)
        for name, (m, t, max_bytes, doc) in PRESET_VALUES.items()
    }


def __getattr__(name: str):
    if name == "PRESETS":  # the configs need torch: built on first use
        return presets()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _by_preset(part: int, key: str) -> str:
    """'the preset's: quick 60, small 1000, base 5000' for a field of PRESET_VALUES."""

    def text(v):
        return ",".join(v) if isinstance(v, tuple) else f"{v:g}" if isinstance(v, float) else str(v)

    return "the preset's: " + ", ".join(f"{name} {text(v[part][key])}" for name, v in PRESET_VALUES.items())


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The options of ``mode train`` (on ``parser``, or a new parser); imports no torch."""
    p = parser or argparse.ArgumentParser(prog="mode train")
    p.add_argument(
        "--preset",
        default="quick",
        choices=sorted(PRESET_VALUES),
        help="; ".join(f"{k}: {v[3]}" for k, v in PRESET_VALUES.items()) + " (default quick)",
    )
    p.add_argument("--dp", type=int, help="data-parallel degree (default: processes / ep)")
    p.add_argument(
        "--ep", type=int, help="expert-parallel degree (default: processes / dp; both unset: ep = processes)"
    )
    p.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="auto: CUDA (NCCL, one GPU per process) when present, else CPU (gloo) (default auto)",
    )
    p.add_argument("--bf16", action="store_true", help="forward under bfloat16 autocast (weights stay float32)")
    p.add_argument("--compile", action="store_true", help="torch.compile each block (slow first step on CPU)")
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="after 3 eager steps, capture the whole training step (forward, backward, clipping, capturable "
        "AdamW) in one CUDA graph and replay it (one process on CUDA; mode.train.graphs)",
    )
    p.add_argument(
        "--dedup-rows",
        action="store_true",
        help="expert parallelism sends one row per (token, destination rank) instead of one per "
        "assignment (top-k > 1, device-limited routing; docs/routing.md)",
    )
    p.add_argument(
        "--data",
        help="a UTF-8 text file, a folder of token shards (.bin/.npy and meta.json, e.g. "
        "from mode tokenize; the model takes its vocab_size; docs/data.md), or 'packages' "
        "(the installed packages' sources, docs/data.md) (default: the Python standard "
        "library's sources)",
    )
    p.add_argument(
        "--out",
        default="runs/train",
        help="folder for log.jsonl and the checkpoint (rank 0 logs); one that holds an earlier run's "
        "is refused unless --resume or --force (default runs/train)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="start a new run in an --out that holds an earlier run: its checkpoints, log.jsonl and "
        "tb/ are deleted first",
    )
    p.add_argument(
        "--layers",
        help="comma-separated layer kinds, e.g. moe,staged,moe,integrated (default: " + _by_preset(0, "layers") + ")",
    )
    p.add_argument("--router", help=f"MoE router: token_choice or expert_choice (default {MODEL_DEFAULTS['router']})")
    p.add_argument("--num-experts", type=int, help=f"experts per MoE layer (default: {_by_preset(0, 'num_experts')})")
    p.add_argument(
        "--num-noop",
        type=int,
        help="no-op experts of the integrated MoDE layers (default: " + _by_preset(0, "num_noop") + ")",
    )
    p.add_argument("--top-k", type=int, help=f"experts per token (default: {_by_preset(0, 'top_k')})")
    p.add_argument(
        "--activation",
        choices=("gelu", "swiglu", "relu2"),
        help="the MLPs' and experts' activation (default: the preset's: gpu swiglu, the others gelu)",
    )
    p.add_argument(
        "--renormalize",
        action="store_true",
        help="token choice: divide each token's top-k gates by their sum (Mixtral's router) (default: not)",
    )
    p.add_argument(
        "--num-shared",
        type=int,
        help="always-on shared experts of every MoE layer, as one MLP (DeepSeek-MoE, Qwen2-MoE) (default 0)",
    )
    p.add_argument(
        "--shared-gate",
        action="store_true",
        help="scale the shared experts' output per token by sigmoid(x . w) (Qwen2-MoE) (default: not)",
    )
    p.add_argument("--capacity-factor", type=float, help="token-choice capacity factor (default: dropless)")
    p.add_argument(
        "--balance-coef",
        type=float,
        help=f"weight of the load-balancing loss (default {MODEL_DEFAULTS['balance_coef']:g})",
    )
    p.add_argument("--steps", type=int, help=f"optimizer steps (default: {_by_preset(1, 'steps')})")
    p.add_argument(
        "--batch-size",
        type=int,
        help=f"global batch (sequences per step), split over the processes (default: {_by_preset(1, 'batch_size')})",
    )
    p.add_argument(
        "--grad-accum",
        type=int,
        metavar="N",
        help="gradient accumulation: each process's rows in N micro-batches per optimizer step, with "
        "the whole batch's loss and gradient (N must divide batch size / processes; "
        "docs/training.md) (default 1)",
    )
    p.add_argument(
        "--ac",
        action="store_true",
        help="activation checkpointing: every block keeps only its input and is recomputed in "
        "backward (less memory, about one more forward of compute; docs/training.md)",
    )
    p.add_argument("--lr", type=float, help=f"peak learning rate (default: {_by_preset(1, 'lr')})")
    p.add_argument(
        "--eval-every",
        type=int,
        help="evaluate the validation loss every this many steps (default: " + _by_preset(1, "eval_every") + ")",
    )
    p.add_argument(
        "--log-every",
        type=int,
        help="log the training loss every this many steps (default: " + _by_preset(1, "log_every") + ")",
    )
    p.add_argument("--ckpt-every", type=int, help="also checkpoint every this many steps (default: at the end only)")
    p.add_argument(
        "--ckpt-every-s",
        type=float,
        help="also checkpoint every this many seconds (rank 0's clock) (default: at the end only)",
    )
    p.add_argument(
        "--eager-init",
        action="store_true",
        help="on a mesh, every rank builds the full model before sharding it (default: built on the "
        "meta device, each rank materializes its shards only, with the same values; "
        "docs/distributed.md)",
    )
    p.add_argument(
        "--keep",
        type=int,
        default=1,
        metavar="K",
        help="keep the K newest complete checkpoints (default 1; one process: OUT/ckpt.pt and "
        "OUT/ckpt-step-N.pt); resuming skips a newest "
        "one that fails its checksums or was never completed, with a warning, and uses the one "
        "before (docs/distributed.md, 'When a rank dies')",
    )
    p.add_argument(
        "--grace-s",
        type=float,
        default=DEFAULT_GRACE_S,
        metavar="SECONDS",
        help=f"on SIGTERM every rank finishes its step, the group saves a checkpoint and the command "
        f"exits with status {EXIT_PREEMPTED}; a rank not done this many seconds after the "
        f"signal exits anyway (default {DEFAULT_GRACE_S:g}; keep it below the "
        f"scheduler's kill delay and torchrun's --shutdown-timeout)",
    )
    p.add_argument(
        "--async-save",
        action="store_true",
        help="on a mesh, write checkpoints in the background (dcp.async_save): the step that saves waits "
        "only for a CPU copy of the shards (docs/distributed.md)",
    )
    p.add_argument(
        "--tensorboard",
        action="store_true",
        help="also write TensorBoard event files to OUT/tb (needs the extra: pip install 'mode-torch[tb]')",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        help="one device's peak dense bf16 TFLOP/s, for the logged model FLOPs utilisation (default: "
        "known GPUs only, e.g. H100 SXM 989; none on a CPU)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the initialization and the data order (default 0)")
    p.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        type=resume_value,
        metavar="auto",
        help="continue from the checkpoint in OUT (either kind; there must be one). --resume auto: "
        "continue from it when OUT holds a complete one, else start a new run (one command line "
        "that starts and restarts a run, e.g. under a scheduler or torchelastic)",
    )
    p.add_argument(
        "--resume-from",
        help="continue from this checkpoint: a single file or a sharded folder, "
        "saved by any number of processes in any layout",
    )
    p.add_argument(
        "--collective-timeout",
        "--timeout",
        dest="timeout",
        type=float,
        metavar="SECONDS",
        help=f"seconds a collective, the process groups' store and the set-up wait for another rank before this "
        f"rank fails with a CollectiveError and exits (a dead machine, a cut link, a stuck rank; under torchrun "
        f"--max-restarts the group then restarts); every process group gets it (default ${TIMEOUT_ENV} or "
        f"{DEFAULT_TIMEOUT_S:g}; --timeout is the same option)",
    )
    p.add_argument("--threads", type=int, help="torch intra-op threads per process (default: torch's)")
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar; the plain progress lines (on stdout: every 20 s, and at the end) still "
        "print. Without a terminal on stderr there is never a bar, only the lines",
    )
    return p


RESUME_AUTO = "auto"


def resume_value(text: str) -> str:
    """``--resume VALUE``: only ``auto`` (``--resume`` alone needs no value)."""
    if text != RESUME_AUTO:
        raise argparse.ArgumentTypeError(
            f"{text!r}: the only value is {RESUME_AUTO!r} (--resume auto: continue "
            "from the checkpoint in OUT if there is one, else start a new run; "
            "--resume alone: there must be one)"
        )
    return text


def find_checkpoint(out: str | Path, prefer_sharded: bool = False) -> Path | None:
    """The complete checkpoint in ``out``, or None: ``out/ckpt.pt`` (written by an atomic rename, so a file
    there is whole) or ``out/ckpt/`` once its ``latest`` file exists (rank 0 writes it, atomically, after every
    shard of a save is written: a folder without it holds only a partial save, which does not count). Both
    kinds: the one this run writes (``prefer_sharded``: a mesh) first, as ``Trainer.load`` looks."""
    from mode.parallel.checkpoint import LATEST, is_complete, saves
    from mode.parallel.runtime import MeshRuntime
    from mode.train.runtime import OneProcess, kept_checkpoints

    single, sharded = Path(out) / OneProcess.checkpoint_name, Path(out) / MeshRuntime.checkpoint_name
    complete = sharded.is_dir() and ((sharded / LATEST).is_file() or any(map(is_complete, saves(sharded))))
    found = [
        path for path, ok in ((single, single.is_file() or bool(kept_checkpoints(single))), (sharded, complete)) if ok
    ]
    if prefer_sharded:
        found.reverse()
    return found[0] if found else None


def earlier_run(out: str | Path) -> list[Path]:
    """What an earlier run left in ``out`` that a new run would overwrite or mix with its own: checkpoints of
    both kinds (complete or not), ``log.jsonl``, ``tb/``."""
    from mode.parallel.runtime import MeshRuntime
    from mode.train.runtime import OneProcess, kept_checkpoints

    out = Path(out)
    single = out / OneProcess.checkpoint_name
    paths = [single, *kept_checkpoints(single), out / MeshRuntime.checkpoint_name, out / "log.jsonl", out / "tb"]
    return [p for p in paths if p.exists() or p.is_symlink()]


def _delete(paths: list[Path]) -> None:
    import shutil

    for path in paths:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def checkpoint_to_resume(args, ctx) -> Path | None:
    """What this run continues from: a path, or None (a new run, or ``--resume``/``--resume-from``, whose
    checkpoint ``Trainer.load`` finds). Rank 0 looks in OUT and broadcasts what it found, so that every rank
    takes the same decision. ``ValueError``: OUT holds what an earlier run left (a checkpoint, ``log.jsonl``,
    ``tb/``) and neither ``--resume``, ``--resume-from`` nor ``--force`` was given (a new run would overwrite it).
    ``--force``: rank 0 deletes those first and the run is a new one."""
    if args.resume_from:
        return None
    force = getattr(args, "force", False)
    if force and args.resume:
        raise ValueError(
            "--force and --resume: give one of them (--force starts a new run over the one in OUT, "
            "--resume continues it)"
        )
    found: list[str | None] = [None, None]  # the checkpoint to resume, what else an earlier run left
    if ctx is None or ctx.rank == 0:
        path = find_checkpoint(args.out, prefer_sharded=ctx is not None)
        found[0] = None if path is None else str(path)
        left = earlier_run(args.out)
        found[1] = str(left[0]) if left else None
        if force and left:
            _delete(left)
            found = [None, None]
    if ctx is not None and ctx.world_size > 1:
        import torch.distributed as dist

        from mode.parallel import process_group as mdist

        with mdist.collective_guard(
            "the --resume decision (rank 0's look for a checkpoint in OUT)",
            ctx.timeout_s,
            rank=ctx.rank,
            world_size=ctx.world_size,
        ):
            dist.broadcast_object_list(found, src=0)
    if found[0] is not None and not args.resume:
        from mode.parallel.elastic import attempt

        restarted = (
            (
                f" (torchrun restarted this group, attempt {attempt()}: start it with --resume auto so that a "
                "restart continues the run)"
            )
            if attempt()
            else ""
        )
        raise ValueError(
            f"{args.out!r} already holds a run's checkpoint ({found[0]!r}); a new run would overwrite "
            f"it. Continue it with --resume auto (or --resume), give a new or empty --out to "
            f"start another run, or pass --force to delete it and start a new run here{restarted}"
        )
    if found[1] is not None and not args.resume:
        raise ValueError(
            f"{args.out!r} already holds {found[1]!r} from an earlier run (and no complete checkpoint); "
            "a new run would overwrite it. Give a new or empty --out, or pass --force to delete it "
            "and start a new run here"
        )
    return None if found[0] is None else Path(found[0])


def configs(args) -> tuple[LMConfig, TrainConfig, int | None]:
    preset = presets()[args.preset]
    m = {
        k: v
        for k, v in dict(
            num_experts=args.num_experts,
            num_noop=args.num_noop,
            top_k=args.top_k,
            balance_coef=args.balance_coef,
            router=args.router,
            activation=args.activation,
            num_shared=args.num_shared,
        ).items()
        if v is not None
    }
    if args.shared_gate:
        m["shared_gate"] = True
    if args.renormalize:
        m["router_options"] = {**preset.model.router_options, "renormalize": True}
    if args.capacity_factor is not None:
        m["capacity_factor"] = args.capacity_factor
    if args.layers:
        m["layers"] = tuple(s.strip() for s in args.layers.split(",") if s.strip())
    t = dict(
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        eval_every=args.eval_every,
        log_every=args.log_every,
        ckpt_every=args.ckpt_every,
        ckpt_every_s=args.ckpt_every_s,
        grad_accum=args.grad_accum,
        peak_tflops=args.peak_tflops,
    )
    t = {k: v for k, v in t.items() if v is not None}
    if args.ac:
        t["activation_checkpointing"] = True
    if args.tensorboard:
        t["tensorboard"] = True
    return replace(preset.model, **m), replace(preset.train, seed=args.seed, **t), preset.max_corpus_bytes


def mfu_line(record: dict, trainer) -> str | None:
    """ "MFU x% of measured y TFLOP/s peak (z% of the nominal w)" from a logged training record, or None when
    neither peak is known (a CPU without --peak-tflops)."""
    parts = []
    if record.get("mfu_measured") is not None and trainer.measured_peak_flops:
        parts.append(
            f"MFU {record['mfu_measured']:.1%} of measured {trainer.measured_peak_flops / 1e12:.0f} TFLOP/s "
            "peak (bf16 matmul timed at start-up)"
        )
    if record.get("mfu") is not None and trainer.peak_flops:
        parts.append(f"{record['mfu']:.1%} of the nominal {trainer.peak_flops / trainer.world_size / 1e12:.0f} TFLOP/s")
    if not parts:
        return None
    return parts[0] + (f" ({parts[1]})" if len(parts) > 1 else "") + f"; {record['tok_s']:,.0f} tokens/s"


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run(args) -> int:
    """The command; returns the exit status (2: a user mistake, 1: a failed collective or write)."""
    from mode.parallel import process_group as mdist
    from mode.parallel.resume import load_newest
    from mode.train import Trainer, checkpoint
    from mode.train.preempt import EXIT_PREEMPTED, Preemption
    from mode.train.sources import load_corpus

    if args.threads is not None:
        if args.threads < 1:
            print(f"mode train: error: --threads={args.threads}: must be >= 1", file=sys.stderr)
            return 2
        import torch

        torch.set_num_threads(args.threads)
    ctx = None
    preemption = None
    try:
        model_cfg, train_cfg, max_bytes = configs(args)
        if args.resume and args.resume_from:
            raise ValueError("--resume and --resume-from: give one of them")
        if isinstance(args.keep, bool) or args.keep < 1:
            raise ValueError(f"--keep={args.keep}: must be >= 1 (how many complete checkpoints to keep)")
        preemption = Preemption(args.grace_s).install()  # before the group exists: a SIGTERM from now on counts
        mesh = None
        if under_torchrun():
            from mode.parallel.mesh import ParallelDims, build_mesh

            backend = {"auto": "auto", "cpu": "gloo", "cuda": "nccl"}[args.device]
            ctx = mdist.init_distributed(backend, args.timeout)
            dims = ParallelDims.for_world(ctx.world_size, args.dp, args.ep)
            mesh = build_mesh(dims, ctx.device.type, ctx.timeout_s)
            device = "auto"
        else:
            dims = None
            if (args.dp or 1) * (args.ep or 1) != 1:
                raise ValueError(
                    f"--dp={args.dp} --ep={args.ep}: more than one process; start the command with "
                    f"torchrun --nproc-per-node {(args.dp or 1) * (args.ep or 1)} -m mode train ..."
                )
            device = args.device
        resume_path = checkpoint_to_resume(args, ctx)
        if args.resume == RESUME_AUTO and resume_path is None and (ctx is None or ctx.rank == 0):
            print(f"mode train: no checkpoint in {args.out}: starting a new run", flush=True)
        corpus = load_corpus(args.data or None, model_cfg.seq_len, max_bytes)
        model_cfg = replace(model_cfg, vocab_size=corpus.vocab_size)  # bytes: 256; token shards: theirs
        runtime = None
        if mesh is not None:
            from mode.parallel.runtime import MeshRuntime

            assert ctx is not None, "a mesh is built with the distributed context"
            runtime = MeshRuntime(
                mesh,
                ctx.timeout_s,
                dedup=args.dedup_rows,
                async_save=args.async_save,
                meta_init=not args.eager_init,
                keep=args.keep,
            )
        else:
            from mode.train.runtime import OneProcess, resolve_device

            runtime = OneProcess(resolve_device(device), keep=args.keep)  # keep > 1: OUT/ckpt-step-*.pt too
        if args.cuda_graphs and mesh is not None:
            raise ValueError(
                "--cuda-graphs: one process only (not under torchrun); collectives inside a captured "
                "step are not supported"
            )
        trainer = Trainer(
            model_cfg,
            train_cfg,
            corpus,
            args.out,
            name="mode train",
            progress=not args.no_progress,
            runtime=runtime,
            device=device,
            bf16=args.bf16,
            compile=args.compile,
            timeout_s=None if ctx is None else ctx.timeout_s,
            cuda_graphs=args.cuda_graphs,
        )
        if trainer.device.type == "cuda":  # MFU against what this card reaches, beside the datasheet's
            from mode.train.log_sinks import measure_matmul_flops

            trainer.measured_peak_flops = measure_matmul_flops(trainer.device)
        if trainer.rank == 0:
            split = (
                f"{model_cfg.num_experts} experts -> {model_cfg.num_experts // dims.ep} per ep rank; "
                if dims is not None and model_cfg.uses_moe
                else ""
            )
            where = trainer.runtime.describe()  # one process: "one process on cpu" names the device already
            print(
                f"mode train: {where}"
                + ("" if str(trainer.device) in where else f", device {trainer.device}")
                + (f", backend {ctx.backend}, timeout {ctx.timeout_s:g} s" if ctx else "")
                + (", bf16 autocast" if args.bf16 else "")
                + (", compiled" if args.compile else "")
                + (", CUDA graphs" if args.cuda_graphs else "")
                + (", activation checkpointing" if train_cfg.activation_checkpointing else "")
                + f": {split}global batch {train_cfg.batch_size} = {trainer.world_size} x {trainer.local_batch} "
                f"sequences of {model_cfg.seq_len}"
                + (
                    f" ({train_cfg.grad_accum} micro-batches of {trainer.local_batch // train_cfg.grad_accum} per "
                    "process)"
                    if train_cfg.grad_accum > 1
                    else ""
                )
                + f"; layers {','.join(model_cfg.layers)}; corpus {corpus.source}",
                flush=True,
            )
        if args.resume_from:
            trainer.load(args.resume_from)
        elif args.resume is True or resume_path is not None:  # OUT's checkpoint: the newest that verifies
            load_newest(
                trainer, resume_path or trainer.ckpt_path, trainer.rank, fresh_if_none=args.resume == RESUME_AUTO
            )  # auto: nothing verifies -> a new run
        if trainer.step and trainer.rank == 0:
            print(f"mode train: resuming at step {trainer.step} of {train_cfg.steps}", flush=True)
        trainer.preemption = preemption
        history = trainer.run()
    except (ValueError, TypeError) as e:
        rank = "" if ctx is None else f"rank {ctx.rank}: "
        print(f"mode train: {rank}error: {e}", file=sys.stderr)
        return 2
    except checkpoint.WriteError as e:
        print(
            f"mode train: error: {e}; rerun with --resume (or --resume auto) to continue from the last checkpoint",
            file=sys.stderr,
        )
        return 1
    except mdist.CollectiveError as e:
        print(f"mode train: {e}", file=sys.stderr, flush=True)
        return 1  # no destroy(): the peers are gone or stuck, tearing the group down could wait on them
    finally:
        if preemption is not None:
            preemption.uninstall()  # the caller's SIGTERM handler again (main() may run inside another program)
    if trainer.preempted:
        if trainer.rank == 0:
            print(
                f"mode train: preempted (SIGTERM): stopped after step {trainer.step} of {trainer.cfg.steps} with a "
                f"checkpoint in {trainer.ckpt_path}; exiting with status {EXIT_PREEMPTED}. The same command with "
                "--resume auto continues it",
                file=sys.stderr,
                flush=True,
            )
        if ctx is not None:
            mdist.destroy()
        return EXIT_PREEMPTED
    if trainer.rank == 0:
        losses = [r for r in history if "loss" in r]
        vals = [r for r in history if "val_loss" in r]
        print(
            f"mode train: step {trainer.step}: train loss {losses[-1]['loss']:.4f}"
            + (f", val loss {vals[-1]['val_loss']:.4f}" if vals else "")
            + f"; checkpoint {trainer.ckpt_path} (mode sample / mode report read it)",
            flush=True,
        )
        line = mfu_line(losses[-1], trainer)
        if line:
            print(f"mode train: {line}", flush=True)
    if ctx is not None:
        mdist.destroy()
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

"""Expert-parallel + data-parallel training of the LM over the ranks of a process group.

    torchrun --nproc-per-node 4 -m mode.parallel.train_ep --quick          # 4 processes, one machine
    python -m mode.parallel.train_ep --quick                                # a group of one (smoke run)

Shape legend: B global batch (sequences per step), P ranks, b = B / P sequences per rank, S sequence.

What one step does, and why it equals the single-process ``mode.train.Trainer`` step on the same batch
    * Every rank draws the *same* global batch (same seeded sampler as the single-process trainer) and
      keeps rows ``[rank*b, (rank+1)*b)``. The LM is built with the same seed on every rank (identical
      weights, identical to the single-process model), then its MoE layers are sharded
      (``mode.parallel.ep_model.shard_model``): routers, attention, norms, embeddings are replicated;
      rank p holds experts ``[p*L, (p+1)*L)``.
    * Rank r computes its local loss ``l_r`` = mean cross-entropy over its ``b*S`` tokens + its aux losses
      and calls ``backward`` on ``l_r / P``. The global loss is ``l = sum_r l_r / P`` (every rank holds
      the same number of tokens, so the mean of the rank means is the global mean).
      - A replicated parameter on rank r only influences ``l_r`` (its own tokens), so its local gradient is
        ``d(l_r / P)``; **summing** it over ranks (one all-reduce of a flat bucket) gives ``dl``.
      - An expert parameter on rank r influences every rank's tokens; the backward all-to-all brings the
        gradient of every ``l_q / P`` home, so its local gradient already *is* ``dl`` (slice of the full
        expert gradient): no reduction, no scaling.
    * Gradient clipping uses the global norm: replicated gradients (identical after the all-reduce)
      counted once, plus the squared norms of the expert shards summed over ranks.
    * AdamW on the local parameters; replicated ones stay identical on every rank because their
      gradients and optimizer states are identical.

What is per rank (as everywhere in expert parallelism): the router's capacity limit and its aux losses
are computed over the rank's own ``b*S`` tokens. Cross-entropy and the z-loss are means over tokens,
so per-rank means average to exactly the global mean. The Switch load-balancing loss is a product of two
means, and capacity limits depend on the token count: with ``balance_coef > 0`` or a
``capacity_factor``, EP training over P ranks equals a single-process run that splits each global batch
into P micro-batches and averages their losses (gradient accumulation), not the plain single-process run
(the curves then agree closely but not bit for bit). MoD top-C is per sequence and unaffected. See
docs/expert_parallel.md ("Training").

Checkpoints have the single-process format of ``mode.train.Trainer.save`` (rank 0 gathers the expert
shards and their AdamW moments and writes one file atomically, ``mode.checkpoint``), so
``mode.train.load_model`` and ``Trainer.load`` read them, and ``ExpertParallelTrainer.load`` reads
single-process checkpoints (slicing the experts), for any P. A time-based checkpoint (``ckpt_every_s``)
is rank 0's decision, carried to every rank by the step's scalar all-reduce: all ranks save at the same step.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from torch import Tensor

from mode import _checks, checkpoint
from mode import distributed as mdist
from mode.data import BatchSampler, Corpus, eval_batches, file_corpus, min_file_bytes, stdlib_corpus
from mode.flops import train_flops_per_token
from mode.model import LM, LMConfig
from mode.parallel.ep_model import full_state_dict, shard_model, shard_state_dict, split_parameters
from mode.stats import RoutingAccumulator
from mode.train import TrainConfig, TrainLoop, build_optimizer, check_same_model, lr_at, rewrite_log


class ExpertParallelTrainer(TrainLoop):
    """Trains one LM with its experts sharded over ``group`` and the batch split over the same ranks.

    Every rank of ``group`` constructs one and calls the same methods in the same order (they run
    collectives). Rank 0 of the group writes ``out_dir/log.jsonl`` and ``out_dir/ckpt.pt``.
    """

    def __init__(self, model_cfg: LMConfig, train_cfg: TrainConfig, corpus: Corpus, out_dir: str | Path,
                 group=None, device: torch.device | str = "cpu", timeout_s: float | None = None,
                 name: str = "ep", progress: bool = True):
        if not mdist.is_initialized():
            raise ValueError("group: torch.distributed must be initialised first (mode.distributed.init_distributed "
                             "or init_process_group)")
        self.group = group if group is not None else mdist.world_group()
        self.rank, self.world_size = mdist.rank_and_size(self.group)
        if train_cfg.batch_size % self.world_size:
            raise ValueError(f"batch_size={train_cfg.batch_size}: must be divisible by the number of ranks "
                             f"{self.world_size} (each rank trains on batch_size / ranks sequences of every batch)")
        if not model_cfg.uses_moe:
            raise ValueError(f"layers={model_cfg.layers}: expert-parallel training needs at least one "
                             "'moe', 'staged' or 'integrated' layer")
        _checks.check_int("num_experts", model_cfg.num_experts)
        if model_cfg.num_experts % self.world_size:
            raise ValueError(f"num_experts={model_cfg.num_experts}: must be divisible by the expert-parallel "
                             f"group size {self.world_size} (each rank holds num_experts / group size experts)")
        self.model_cfg, self.cfg, self.name = model_cfg, train_cfg, name
        self.progress = progress and self.rank == 0
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.out_dir = Path(out_dir)
        if self.rank == 0:
            checkpoint.prepare_dir(self.out_dir, "out_dir")  # a bad folder fails before any training
        self.log_path, self.ckpt_path = self.out_dir / "log.jsonl", self.out_dir / "ckpt.pt"

        torch.manual_seed(train_cfg.seed)  # as mode.train.Trainer: the same full model on every rank
        self.model = shard_model(LM(model_cfg), self.group).to(self.device)
        self.replicated, self.sharded = split_parameters(self.model)
        self.optimizer = build_optimizer(self.model, train_cfg)
        # Same sampler and seed as the single-process trainer: every rank draws the whole global batch.
        self.sampler = BatchSampler(corpus.train, train_cfg.batch_size, model_cfg.seq_len, train_cfg.seed)
        self.val_batches = eval_batches(corpus.val, train_cfg.batch_size, model_cfg.seq_len, train_cfg.eval_batches)
        self.local_batch = train_cfg.batch_size // self.world_size
        self.step, self.flops, self.tokens, self.wall = 0, 0.0, 0, 0.0
        self.elapsed = 0.0
        self.history: list[dict] = []
        self.routing = RoutingAccumulator()  # this rank's routing stats since the last "routing" record
        self._save_due = False  # rank 0's ckpt_every_s decision, all-reduced with the last step's scalars

    # -- helpers -----------------------------------------------------------------------------------
    def _guard(self, what: str):
        return mdist.collective_guard(what, self.rank, self.world_size, self.timeout_s)

    def _my_rows(self, t_BS: Tensor) -> Tensor:
        lo = self.rank * self.local_batch
        return t_BS[lo:lo + self.local_batch].to(self.device)

    def _optimizer_index(self) -> dict[int, int]:
        """id(param) -> its index in the optimizer's state dict (the order of the param groups)."""
        ids = [id(p) for group in self.optimizer.param_groups for p in group["params"]]
        return {pid: i for i, pid in enumerate(ids)}

    # -- training ----------------------------------------------------------------------------------
    def train_step(self) -> tuple[float, float]:
        with self._guard(f"training step {self.step + 1}"):
            return self._train_step()

    def _train_step(self) -> tuple[float, float]:
        P = self.world_size
        x_BS, y_BS = self.sampler.next()  # the global batch, identical on every rank
        x_bS, y_bS = self._my_rows(x_BS), self._my_rows(y_BS)
        lr = lr_at(self.step, self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        out = self.model(x_bS, y_bS)
        self.routing.add_lm(self.model_cfg, out.aux, tuple(x_bS.shape))  # local sums; summed over ranks when logged
        # d(l_r / P): replicated grads sum to the global gradient; expert grads arrive already summed.
        ((out.loss + out.aux.total()) / P).backward()

        for p in self.sharded:  # an expert shard that got no rows: zero, as its slice is in one process
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        has_grad = [p.grad is not None for p in self.replicated]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in self.replicated])
        expert_sq = sum((p.grad.double().square().sum() for p in self.sharded), torch.zeros((), dtype=torch.float64,
                                                                                            device=self.device))
        flops = train_flops_per_token(self.model_cfg, aux=out.aux) * x_bS.numel()  # realized routing, this rank
        due = float(self.rank == 0 and TrainLoop.checkpoint_due(self))  # clocks differ: rank 0 decides for all
        scalars = torch.cat([torch.stack([expert_sq, out.loss.detach().double(),
                                          torch.tensor(flops, dtype=torch.float64, device=self.device),
                                          torch.tensor(due, dtype=torch.float64, device=self.device)]),
                             torch.tensor(has_grad, dtype=torch.float64, device=self.device)])
        mdist.all_reduce_sum_(flat, self.group)
        mdist.all_reduce_sum_(scalars, self.group)
        self._save_due = bool(scalars[3] > 0)

        offset = 0
        for p, anywhere in zip(self.replicated, scalars[4:].tolist()):
            n = p.numel()
            p.grad = flat[offset:offset + n].view_as(p) if anywhere else None  # None everywhere: as in one process
            offset += n
        # Global norm: replicated grads (identical on every rank) once + expert shards summed over ranks.
        rep_sq = sum((p.grad.double().square().sum() for p in self.replicated if p.grad is not None),
                     torch.zeros((), dtype=torch.float64, device=self.device))
        total_norm = (rep_sq + scalars[0]).sqrt().float()
        clip = (self.cfg.grad_clip / (total_norm + 1e-6)).clamp(max=1.0)  # as torch.nn.utils.clip_grad_norm_
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.mul_(clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

        self.flops += float(scalars[2])
        self.tokens += x_BS.numel()
        self.step += 1
        return float(scalars[1]) / P, lr  # mean cross-entropy over the global batch

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation cross-entropy over the fixed validation batches (each split over the ranks):
        the same number ``mode.train.evaluate`` gives for the single-process model."""
        with self._guard("evaluation"):
            was_training = self.model.training
            self.model.eval()
            losses = torch.stack([self.model(self._my_rows(x), self._my_rows(y)).loss.double()
                                  for x, y in self.val_batches])
            self.model.train(was_training)
            mdist.all_reduce_sum_(losses, self.group)
            return float((losses / self.world_size).mean())

    @property
    def writes_log(self) -> bool:
        return self.rank == 0

    def checkpoint_due(self) -> bool:
        return self._save_due

    def routing_record(self) -> dict:
        return self._global_routing().summary()  # a collective: every rank logs the same record

    def _global_routing(self) -> RoutingAccumulator:
        """A copy of the routing sums added over every rank (all ranks must call it)."""
        with self._guard("routing-stats all-reduce"):
            return RoutingAccumulator().merge(self.routing).all_reduce(self.group)

    def _log(self, record: dict) -> None:
        self.history.append(record)  # every rank keeps the history (it goes into the checkpoint)
        if self.rank == 0:
            with self.log_path.open("a") as f:
                f.write(json.dumps(record) + "\n")

    # -- checkpoints -------------------------------------------------------------------------------
    def _full_optimizer_state(self) -> dict | None:
        """The single-process AdamW state dict on rank 0 (expert moments gathered), None elsewhere."""
        sd = self.optimizer.state_dict()
        sd["state"] = {i: dict(entry) for i, entry in sd["state"].items()}  # state_dict() shares the live dicts
        index = self._optimizer_index()
        for p in self.sharded:  # same order on every rank: the gathers line up
            i = index[id(p)]
            entry = sd["state"].get(i)
            if entry is None:  # before the first step: no state anywhere
                continue
            full = dict(entry)
            for key in sorted(entry):
                v = entry[key]
                if isinstance(v, Tensor) and v.shape == p.shape:
                    full[key] = mdist.gather_cat(v, self.group)
            sd["state"][i] = full
        if self.rank != 0:
            return None
        for entry in sd["state"].values():
            for key, v in entry.items():
                if isinstance(v, Tensor):
                    entry[key] = v.detach().cpu().clone()
        return sd

    def save(self, path: Path | None = None) -> Path:
        """Write a single-process checkpoint (``mode.train.Trainer.save``'s format) from rank 0. Every rank
        must call it; it returns once the file is written."""
        path = Path(path or self.ckpt_path)
        with self._guard("checkpoint gathering"):
            model_state = full_state_dict(self.model, self.group)
            optim_state = self._full_optimizer_state()
        routing_state = self._global_routing().state_dict()  # sums over ranks: what one process would hold
        error = None
        if self.rank == 0:
            try:  # atomic: a crash while writing leaves the previous checkpoint whole
                checkpoint.save_checkpoint(path, {
                    "model_cfg": asdict(self.model_cfg), "train_cfg": asdict(self.cfg), "model": model_state,
                    "optimizer": optim_state, "step": self.step, "flops": self.flops, "tokens": self.tokens,
                    "wall": self.wall, "elapsed_s": self.elapsed, "history": self.history,
                    "sampler_rng": self.sampler.generator.get_state(), **checkpoint.rng_state(),
                    "routing_acc": routing_state,
                    "expert_parallel": {"world_size": self.world_size},  # informational; the format is single-process
                })
            except OSError as e:  # tell the other ranks first: they must not wait for the timeout
                error = e
        failed = torch.tensor([float(error is not None)], dtype=torch.float64, device=self.device)
        with self._guard("checkpoint barrier"):
            mdist.all_reduce_sum_(failed, self.group)  # a barrier that also carries rank 0's outcome
        if error is not None:
            raise error
        if float(failed) > 0:
            raise checkpoint.WriteError(f"rank 0 could not write the checkpoint {str(path)!r} (see its error)")
        return path

    def load(self, path: Path | None = None) -> None:
        """Resume from a checkpoint written by this class or by the single-process ``Trainer`` (any P). The
        file is read without running code from it (``mode.checkpoint``); every rank reads it."""
        path = Path(path or self.ckpt_path)
        where = f"checkpoint {str(path)!r}"
        state = checkpoint.load_checkpoint(path, training=True)
        check_same_model(state["model_cfg"], self.model_cfg, where)
        with torch.device("meta"):  # the full (unsharded) model's shapes
            checkpoint.check_model_state(LM(self.model_cfg).state_dict(), state["model"], where)
        self.model.load_state_dict(shard_state_dict(self.model, state["model"], self.group))
        sd = state["optimizer"]
        index = self._optimizer_index()
        for p in self.sharded:
            entry = sd["state"].get(index[id(p)])
            if entry is None:
                continue
            L = p.shape[0]
            for key, v in list(entry.items()):
                if isinstance(v, Tensor) and v.dim() == p.dim() and v.shape[1:] == p.shape[1:]:
                    entry[key] = v[self.rank * L:(self.rank + 1) * L]  # this rank's experts' moments
        self.optimizer.load_state_dict(sd)
        self.step, self.flops, self.tokens, self.wall = state["step"], state["flops"], state["tokens"], state["wall"]
        self.elapsed = state.get("elapsed_s", 0.0)
        self.history = state["history"]
        self.sampler.generator.set_state(state["sampler_rng"])
        checkpoint.set_rng_state(state)
        self.routing.reset()
        if self.rank == 0:  # the saved sums are over all ranks: one rank holds them, the next all-reduce adds
            self.routing.load_state_dict(state.get("routing_acc", {}))
            rewrite_log(self.log_path, self.history)


# ------------------------------------------------------------------------------------------------------
# command line: torchrun --nproc-per-node N -m mode.parallel.train_ep [--quick] ...


def presets(quick: bool) -> tuple[LMConfig, TrainConfig, int | None]:
    """(model, training, corpus byte limit). Both use 8 experts: P in {1, 2, 4, 8} divides them."""
    if quick:  # about a minute on 2 CPU cores with 4 ranks
        model = LMConfig(seq_len=64, d_model=64, n_heads=2, d_hidden=128, num_experts=8, num_noop=2,
                         layers=("moe", "staged", "moe", "integrated"))
        train = TrainConfig(steps=60, batch_size=8, warmup_steps=10, eval_every=30, eval_batches=4, log_every=10)
        return model, train, 2_000_000
    model = LMConfig(seq_len=256, d_model=128, n_heads=4, d_hidden=512, num_experts=8, num_noop=4,
                     layers=("moe", "staged", "moe", "integrated", "moe", "staged"))
    train = TrainConfig(steps=1000, batch_size=16, warmup_steps=50, eval_every=100, eval_batches=8, log_every=10)
    return model, train, None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m mode.parallel.train_ep",
        description="Expert-parallel (+ data-parallel) LM training; launch with torchrun --nproc-per-node N")
    p.add_argument("--quick", action="store_true", help="tiny model, 60 steps (smoke run on CPUs)")
    p.add_argument("--data", help="a UTF-8 text file (default: the Python standard library's sources)")
    p.add_argument("--out", default="runs/train_ep", help="folder for log.jsonl and ckpt.pt (rank 0 writes)")
    p.add_argument("--layers", help="comma-separated layer kinds, e.g. moe,staged,moe,integrated")
    p.add_argument("--num-experts", type=int)
    p.add_argument("--num-noop", type=int)
    p.add_argument("--top-k", type=int)
    p.add_argument("--capacity-factor", type=float, help="token-choice capacity factor (default: dropless)")
    p.add_argument("--balance-coef", type=float)
    p.add_argument("--steps", type=int)
    p.add_argument("--batch-size", type=int, help="global batch (sequences per step), split over the ranks")
    p.add_argument("--lr", type=float)
    p.add_argument("--eval-every", type=int)
    p.add_argument("--ckpt-every", type=int, help="also checkpoint every this many steps (default: at the end only)")
    p.add_argument("--ckpt-every-s", type=float, help="also checkpoint every this many seconds (rank 0's clock)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from OUT/ckpt.pt")
    p.add_argument("--backend", default="auto", choices=mdist.BACKENDS,
                   help="auto: nccl with CUDA (one GPU per process), gloo on CPU")
    p.add_argument("--timeout", type=float, help=f"collective timeout in seconds (default ${mdist.TIMEOUT_ENV} "
                                                 f"or {mdist.DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--no-progress", action="store_true")
    return p


def _configs(args) -> tuple[LMConfig, TrainConfig, int | None]:
    from dataclasses import replace

    model, train, max_bytes = presets(args.quick)
    m = {k: v for k, v in dict(num_experts=args.num_experts, num_noop=args.num_noop, top_k=args.top_k,
                                 balance_coef=args.balance_coef).items() if v is not None}
    if args.capacity_factor is not None:
        m["capacity_factor"] = args.capacity_factor
    if args.layers:
        m["layers"] = tuple(s.strip() for s in args.layers.split(",") if s.strip())
    t = dict(steps=args.steps, batch_size=args.batch_size, lr=args.lr, eval_every=args.eval_every,
             ckpt_every=args.ckpt_every, ckpt_every_s=args.ckpt_every_s)
    t = {k: v for k, v in t.items() if v is not None}
    return replace(model, **m), replace(train, seed=args.seed, **t), max_bytes


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        model_cfg, train_cfg, max_bytes = _configs(args)
        ctx = mdist.init_distributed(args.backend, args.timeout)
    except (ValueError, TypeError) as e:
        print(f"train_ep: error: {e}", file=sys.stderr)
        return 2
    try:
        corpus = (file_corpus(args.data, min_file_bytes(model_cfg.seq_len)) if args.data
                  else stdlib_corpus(max_bytes=max_bytes))
        trainer = ExpertParallelTrainer(model_cfg, train_cfg, corpus, args.out, device=ctx.device,
                                        timeout_s=ctx.timeout_s, progress=not args.no_progress)
        if ctx.rank == 0:
            L = model_cfg.num_experts // ctx.world_size
            print(f"expert-parallel training on {ctx.world_size} rank(s), backend {ctx.backend}, device "
                  f"{ctx.device}, timeout {ctx.timeout_s:g} s: {model_cfg.num_experts} experts -> {L} per rank; "
                  f"global batch {train_cfg.batch_size} = {ctx.world_size} x {trainer.local_batch} sequences "
                  f"of {model_cfg.seq_len}; layers {','.join(model_cfg.layers)}; corpus {corpus.source}", flush=True)
        if args.resume:
            trainer.load()
        history = trainer.run()
    except (ValueError, TypeError, checkpoint.WriteError) as e:
        print(f"train_ep: rank {mdist.rank_and_size()[0]}: error: {e}", file=sys.stderr)
        return 2
    except mdist.CollectiveError as e:
        print(f"train_ep: {e}", file=sys.stderr, flush=True)
        return 1  # no destroy(): the peers are gone or stuck, tearing the group down could wait on them
    if ctx.rank == 0:
        losses = [r for r in history if "loss" in r]
        vals = [r for r in history if "val_loss" in r]
        print(f"step {trainer.step}: train loss {losses[-1]['loss']:.4f}"
              + (f", val loss {vals[-1]['val_loss']:.4f}" if vals else "")
              + f"; checkpoint {trainer.ckpt_path} (loads with mode.train.load_model)", flush=True)
    mdist.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What bench_expert_parallel.py runs on each rank: the byte counter around the dispatch all-to-alls, the worker
that trains a few steps under expert parallelism (bytes per phase, step times), and the single-process
baselines it is compared with."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks.common import sync
from mode.model import LMConfig
from mode.train import TrainConfig, Trainer
from mode.train.data import stdlib_corpus

TRAIN = TrainConfig(steps=1000, batch_size=16, lr=1e-3, warmup_steps=10, eval_every=1000, seed=0)
CORPUS_BYTES = 2_000_000


class _ByteCounter:
    """Wraps torch.distributed.all_to_all_single; attributes each call's off-rank bytes to a phase."""

    def __init__(self, dist, group_rank: int):
        self.dist, self.rank, self.phase = dist, group_rank, "backward"
        self.sent = {"dispatch": 0, "combine": 0, "backward": 0, "counts": 0}
        self.esize: dict[str, int] = {}  # element size of the rows each forward phase sent (autocast: may differ)
        self.dispatch_calls: list[int] = []
        self._orig = dist.all_to_all_single

    def __enter__(self):
        def counting(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
            esize, n = input.element_size(), input.shape[0]
            if input_split_sizes is None:  # equal splits: the per-expert counts exchange
                world = self.dist.get_world_size(group)
                self.sent["counts"] += input.numel() * esize * (world - 1) // world
            else:
                row_bytes = input.numel() // max(n, 1) * esize if n else 0
                off_rank = (sum(input_split_sizes) - input_split_sizes[self.rank]) * row_bytes
                self.sent[self.phase] += off_rank
                if self.phase in ("dispatch", "combine") and input.dim() == 2:  # the (rows, D) payload
                    self.esize.setdefault(self.phase, esize)
                if self.phase == "dispatch":
                    self.dispatch_calls.append(off_rank)
            return self._orig(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

        self.dist.all_to_all_single = counting
        return self

    def __exit__(self, *exc):
        self.dist.all_to_all_single = self._orig


def _phase(counter: _ByteCounter, fn, phase: str):
    def wrapped(*args, **kwargs):
        counter.phase = phase
        try:
            return fn(*args, **kwargs)
        finally:
            counter.phase = "backward"  # anything outside dispatch/combine is the autograd backward

    return wrapped


def _worker(
    rank: int,
    world: int,
    port: int,
    out_dir: str,
    model_cfg: dict,
    cfg: dict,
    backend: str,
    dedup: bool = False,
    bf16: bool = False,
) -> None:
    import torch.distributed as dist

    from mode.parallel import ParallelDims, build_mesh, process_group as mdist
    from mode.parallel.ep_model import expert_parallel_layers

    torch.set_num_threads(1)
    # the environment torchrun would set, then the library's own set-up (NCCL: cuda:rank, device_id, NCCL env)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    ctx = mdist.init_distributed(backend, timeout_s=120)
    device = ctx.device
    mesh = build_mesh(ParallelDims(1, world), device.type, ctx.timeout_s)
    mcfg = LMConfig(**model_cfg)
    from mode.parallel.runtime import MeshRuntime

    trainer = Trainer(
        mcfg,
        TRAIN,
        stdlib_corpus(max_bytes=CORPUS_BYTES),
        Path(out_dir) / "run",
        progress=False,
        runtime=MeshRuntime(mesh, ctx.timeout_s, dedup=dedup),
        bf16=bf16,
    )
    layers = expert_parallel_layers(trainer.model)
    L = mcfg.num_experts // world
    D, esize = mcfg.d_model, trainer.model.embed.weight.element_size()

    # (a) bytes: the minimum from the routers' plans, the actual from the intercepted collectives.
    minimum = {"rows": 0, "noop": 0, "dropped": 0, "dispatch_calls": [], "max_ranks_per_token": 0}

    def plan_hook(module, inputs, plan):
        computed = int(plan.counts_E.sum())  # a plan may end in padding after its computed assignments
        remote = int((plan.expert_idx_A[:computed] // L != rank).sum())
        ranks_TP = torch.zeros(plan.num_tokens, world, dtype=torch.bool, device=plan.counts_E.device)
        ranks_TP[plan.token_idx_A[:computed], plan.expert_idx_A[:computed] // L] = True  # where its rows go
        minimum["max_ranks_per_token"] = max(minimum["max_ranks_per_token"], int(ranks_TP.sum(1).max()))
        minimum["rows"] += remote
        minimum["dispatch_calls"].append(remote)  # rows; bytes below, in the element size dispatch sent
        st = plan.aux.stats["router"]
        minimum["noop"] += int(st.noop)
        minimum["dropped"] += int(st.dropped)

    hooks = [layer.router.register_forward_hook(plan_hook) for layer in layers.values()]
    counter = _ByteCounter(dist, dist.get_rank())
    saved = {}
    for layer in layers.values():  # instance attributes shadow the methods while counting
        d = layer.dispatcher
        saved[id(d)] = d
        d.dispatch, d.combine = _phase(counter, d.dispatch, "dispatch"), _phase(counter, d.combine, "combine")
    with counter:
        for _ in range(cfg["byte_steps"]):
            trainer.train_step()
    for layer in layers.values():
        del layer.dispatcher.dispatch, layer.dispatcher.combine
    for h in hooks:
        h.remove()
    stats_sent = sum(layer.dispatcher.last_dispatch.sent_bytes for layer in layers.values())  # last step only
    row_esize = {phase: counter.esize.get(phase, esize) for phase in ("dispatch", "combine")}

    # (b) step time, rank 0's clock (the step ends with collectives, so ranks finish together).
    for _ in range(cfg["warmup"]):
        trainer.train_step()
    times = []
    for _ in range(cfg["timed"]):
        dist.barrier()
        sync(device)
        t0 = time.perf_counter()
        trainer.train_step()
        sync(device)  # a GPU step ends when its kernels do, not when they are queued
        times.append(time.perf_counter() - t0)
    result = {
        "sent": counter.sent,
        "dispatch_calls_actual": counter.dispatch_calls,
        "dispatch_calls_min": [r * D * row_esize["dispatch"] for r in minimum["dispatch_calls"]],
        "min_bytes": minimum["rows"] * D * row_esize["dispatch"],
        "min_bytes_combine": minimum["rows"] * D * row_esize["combine"],
        "row_esize": row_esize,
        "noop": minimum["noop"],
        "dropped": minimum["dropped"],
        "last_dispatch_stats_bytes": stats_sent,
        "max_ranks_per_token": minimum["max_ranks_per_token"],
        "times": times,
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def run_ep(
    world: int,
    model_cfg: LMConfig,
    cfg: dict,
    tmp: Path,
    backend: str = "gloo",
    dedup: bool = False,
    bf16: bool = False,
) -> list[dict]:
    import torch.multiprocessing as mp

    from mode.parallel.process_group import free_port

    out = tmp / f"ep{world}"
    out.mkdir()
    mp.start_processes(
        _worker,
        args=(world, free_port(), str(out), asdict(model_cfg), cfg, backend, dedup, bf16),
        nprocs=world,
        join=True,
        start_method="spawn",
    )
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def single_process_times(
    model_cfg: LMConfig, cfg: dict, tmp: Path, threads: int | None = None, bf16: bool = False
) -> list[float]:
    default = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _time_trainer(model_cfg, cfg, tmp, bf16)
    finally:
        torch.set_num_threads(default)


def _time_trainer(model_cfg: LMConfig, cfg: dict, tmp: Path, bf16: bool = False) -> list[float]:
    trainer = Trainer(model_cfg, TRAIN, stdlib_corpus(max_bytes=CORPUS_BYTES), tmp, progress=False, bf16=bf16)
    for _ in range(cfg["warmup"]):
        trainer.train_step()
    times = []
    for _ in range(cfg["timed"]):
        t0 = time.perf_counter()
        trainer.train_step()
        times.append(time.perf_counter() - t0)
    return times

"""Your own transformer, made expert-parallel and fully sharded from outside with ``mode.parallel.parallelize``.

    PYTHONPATH=. python examples/parallel_custom_model.py                                  # one process
    PYTHONPATH=. torchrun --nproc-per-node 4 examples/parallel_custom_model.py --dp 2 --ep 2
    PYTHONPATH=. torchrun --nproc-per-node 4 examples/parallel_custom_model.py --ep 4      # all experts spread

The model below is a plain ``nn.Module`` that knows nothing about processes: dense, MoE, staged-MoDE and
integrated-MoDE layers from ``mode`` in a ``ModuleDict``. Under torchrun the script builds a ``(dp, ep)``
device mesh and calls ``parallelize(model, mesh)``, which

    * gives every MoE layer an expert-parallel dispatcher on ``mesh["ep"]`` and makes its expert weights
      DTensors sharded over ep (rank e holds experts [e*E/ep, (e+1)*E/ep)), sharded again over dp by FSDP2;
    * shards every other weight (attention, norms, routers, embedding) over all dp*ep ranks with FSDP2,
      one unit per entry of ``model.layers`` plus the root.

The training loop is the usual one with three differences: each rank takes its rows of the global batch,
calls ``backward`` on ``loss / world_size`` (FSDP sums gradients; see ``mode.parallel.parallelize``), and
clips with ``mode.parallel.clip_grad_norm_`` (parameters live on two meshes). The losses and gradient norms
are those of one process on the same batches, up to float rounding (tests/parallel/test_ep_training.py checks it).

Shape legend: B global batch, b = B / world rows per rank, S sequence, D hidden, V vocabulary (256 bytes).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from mode import (  # noqa: E402
    MLP,
    Aux,
    IntegratedMoDE,
    MoD,
    MoDRouter,
    MoDRouterConfig,
    MoEConfig,
    MoELayer,
    StagedMoDE,
    TransformerBlock,
)
from mode.parallel import clip_grad_norm_  # noqa: E402  (no torch.distributed work at import)


class TinyMoDE(nn.Module):
    """Byte-level decoder: embedding -> [dense, MoD, MoE, staged MoDE, integrated MoDE] -> norm -> head.

    Routing that depends on how many tokens a process holds is off by default (dropless token choice,
    no load-balancing loss), so the result does not depend on the number of processes; see
    docs/distributed.md for what changes with a capacity factor or a balance loss."""

    def __init__(
        self, d: int = 32, n_heads: int = 2, experts: int = 8, router: str = "token_choice", capacity: float = 0.5
    ):
        super().__init__()
        self.embed = nn.Embedding(256, d)

        def moe(**kw) -> MoEConfig:
            base = dict(d_model=d, d_hidden=2 * d, num_experts=experts, router=router)
            if router == "token_choice":
                base.update(top_k=2, balance_coef=0.0)
            return MoEConfig(**base, **kw)

        self.layers = nn.ModuleDict(
            {
                "dense": TransformerBlock(d, n_heads, MLP(d, 4 * d)),
                "mod": MoD(TransformerBlock(d, n_heads, MLP(d, 4 * d)), MoDRouter(MoDRouterConfig(d, capacity))),
                "moe": TransformerBlock(d, n_heads, MoELayer.from_config(moe())),
                "staged": StagedMoDE(
                    TransformerBlock(d, n_heads, MoELayer.from_config(moe())), MoDRouter(MoDRouterConfig(d, capacity))
                ),
                "integrated": TransformerBlock(d, n_heads, IntegratedMoDE.from_config(moe(num_noop=2))),
            }
        )
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, 256, bias=False)

    def forward(self, tokens_BS: Tensor, targets_BS: Tensor) -> tuple[Tensor, Aux]:
        x_BSD = self.embed(tokens_BS)
        aux = Aux()
        for name, layer in self.layers.items():
            x_BSD, layer_aux = layer(x_BSD)
            aux.merge(layer_aux, f"{name}.")
        logits_BSV = self.head(self.norm(x_BSD))
        # the loss in float32 at least: a float64 model (exactness checks) keeps float64
        logits_TV = logits_BSV.flatten(0, 1).to(torch.promote_types(logits_BSV.dtype, torch.float32))
        return F.cross_entropy(logits_TV, targets_BS.flatten()), aux


def make_batches(steps: int, batch: int, seq: int, seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    """``steps`` global batches of windows from the stdlib ``json`` package's source (the same everywhere)."""
    files = sorted(Path(json.__file__).parent.glob("*.py"))
    data = torch.tensor(list(b"".join(f.read_bytes() for f in files)), dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        start = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
        window_BS = torch.stack([data[s : s + seq + 1] for s in start.tolist()])
        out.append((window_BS[:, :-1], window_BS[:, 1:]))
    return out


def train(
    model: nn.Module, batches, *, world_size: int = 1, row_rank: int = 0, lr: float = 1e-3, clip: float = 1.0, log=None
) -> list[tuple[float, float]]:
    """Train on ``batches`` (global batches); returns (global mean loss, gradient norm) per step. With
    ``world_size > 1`` every rank of the model's mesh calls it (``row_rank``: its flat rank)."""
    params = list(model.parameters())
    device = params[0].device
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.1)
    curve = []
    for step, (x_BS, y_BS) in enumerate(batches, 1):
        b = x_BS.shape[0] // world_size
        rows = slice(row_rank * b, (row_rank + 1) * b)
        x_bS, y_bS = x_BS[rows].to(device), y_BS[rows].to(device)
        loss, aux = model(x_bS, y_bS)
        ((loss + aux.total()) / world_size).backward()  # FSDP sums over the ranks: the global mean's gradient
        norm = clip_grad_norm_(params, clip)  # one norm per mesh, combined (also fine in one process)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = loss.detach().double()
        if world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(loss)
        curve.append((float(loss) / world_size, float(norm)))
        if log is not None:
            log(f"step {step:3d}  loss {curve[-1][0]:.4f}  grad norm {curve[-1][1]:.4f}")
    return curve


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dp", type=int)
    p.add_argument("--ep", type=int)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=8, help="global batch, split over the processes")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--router", default="token_choice", choices=("token_choice", "expert_choice"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)

    import os

    world, rank, mesh = 1, 0, None
    if "WORLD_SIZE" in os.environ:  # started by torchrun
        from mode.parallel import ParallelDims, build_mesh, parallelize, process_group as mdist

        ctx = mdist.init_distributed("auto")  # gloo on CPU, NCCL on GPUs; with a timeout
        world, rank = ctx.world_size, ctx.rank
        mesh = build_mesh(ParallelDims.for_world(world, args.dp, args.ep), ctx.device.type, ctx.timeout_s)
    torch.manual_seed(args.seed)  # the same full model on every rank, before it is sharded
    model = TinyMoDE(router=args.router)
    if mesh is not None:
        model = parallelize(model.to(ctx.device), mesh)
        if rank == 0:
            print(
                f"{world} processes, mesh dp={mesh.size(0)} x ep={mesh.size(1)}; "
                f"{sum(p.to_local().numel() for p in model.parameters()):,} of "
                f"{sum(p.numel() for p in model.parameters()):,} parameters on rank 0"
            )
    batches = make_batches(args.steps, args.batch, args.seq, args.seed)
    train(model, batches, world_size=world, row_rank=rank, log=print if rank == 0 else None)
    if mesh is not None:
        mdist.destroy()


if __name__ == "__main__":
    main()

"""Operators launched per training step by every layer kind, beside the dense baselines and the peers: the CPU
proxy for GPU kernel launches (a small layer is host-bound when queueing kernels takes longer than running them).

One step = one forward (under ``torch.autocast(bfloat16)`` with float32 weights for ``bfloat16``) + ``aux.total()``
+ one backward of ``<y, g> + aux.total()``, the gradients dropped first and every input made before the count
starts. Counted with ``mode.measure.op_count.OpCounter`` (views and bare allocations left out, a custom op
counted once), with ``mode.experts.row_buckets.needed`` forced False, so that the experts follow their CUDA path
on the CPU too (the bucketed CPU bf16 layout adds copies a GPU never runs). The would-be host syncs of the
same step (``mode.measure.host_sync.HostSyncCounter``) are counted with them.

Workloads (``--d-model`` 256, ``--experts`` 8 of hidden ``--hidden`` 512, top-2, ``--batch`` 2 x ``--seq`` 128 tokens):
    MoE token choice    ``MoELayer``: softmax, top-2 renormalised (as the peers), dropless, SwiGLU experts
    MoE expert choice   ``MoELayer`` with ``router="expert_choice"``, capacity factor 1
    integrated MoDE     ``IntegratedMoDE``: the same experts plus 8 no-op slots, top-2
    dense SwiGLU MLP    ``MLP(D, 2H, "swiglu")``: the same active FLOPs as a top-2 MoE
    MoD block           ``MoD`` at capacity 0.125 around a ``TransformerBlock`` with a SwiGLU MLP
    staged MoDE         ``StagedMoDE`` at capacity 0.125 around a block whose MLP is the token-choice MoE
    dense block         the same ``TransformerBlock`` on every token
    transformers        ``Qwen3MoeSparseMoeBlock`` (``experts_implementation="grouped_mm"``) with the MoE's weights
    torchtitan          ``torchtitan.models.common.moe.MoE`` as shipped, where it imports
The counts do not depend on the token count or the sizes (no operator here is a loop over data).

    PYTHONPATH=. python benchmarks/layers/count_ops.py --out benchmarks/results/count_ops.json
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere without installing
    sys.path.insert(0, str(ROOT))

from benchmarks.common import add_device_arg, machine_info, print_table, write_json  # noqa: E402
from mode import MLP, MoD, MoDRouter, MoDRouterConfig, MoEConfig, MoELayer, StagedMoDE, TransformerBlock  # noqa: E402
from mode.experts import row_buckets  # noqa: E402
from mode.layers.moe import IntegratedMoDE  # noqa: E402
from mode.measure.host_sync import HostSyncCounter  # noqa: E402
from mode.measure.op_count import OpCounter  # noqa: E402

DTYPES = ("float32", "bfloat16")
TOP_K = 2
HEADS = 4
CAPACITY = 0.125


def mode_layers(d: int, experts: int, hidden: int) -> dict[str, tuple[str, Callable[[], nn.Module]]]:
    """name -> (kind, builder): mode's layers and the dense baselines."""

    def moe(**kw) -> MoEConfig:
        base = dict(d_model=d, d_hidden=hidden, num_experts=experts, top_k=TOP_K, renormalize=True, activation="swiglu")
        return MoEConfig(**{**base, **kw})

    def block(mlp: nn.Module) -> TransformerBlock:
        return TransformerBlock(d, HEADS, mlp)

    def mod_router() -> MoDRouter:
        return MoDRouter(MoDRouterConfig(d_model=d, capacity=CAPACITY))

    return {
        "MoE token choice": ("moe", lambda: MoELayer.from_config(moe())),
        "MoE expert choice": ("moe", lambda: MoELayer.from_config(moe(router="expert_choice", capacity_factor=1.0))),
        "integrated MoDE": ("moe", lambda: IntegratedMoDE.from_config(moe(num_noop=experts))),
        "dense SwiGLU MLP": ("dense", lambda: MLP(d, TOP_K * hidden, "swiglu")),
        "MoD block": ("block", lambda: MoD(block(MLP(d, TOP_K * hidden, "swiglu")), mod_router())),
        "staged MoDE": ("block", lambda: StagedMoDE(block(MoELayer.from_config(moe())), mod_router())),
        "dense block": ("dense", lambda: block(MLP(d, TOP_K * hidden, "swiglu"))),
    }


def peer_layers(d: int, experts: int, hidden: int) -> tuple[dict, dict[str, str]]:
    """The peers that import here (name -> (kind, builder)) and, for the others, why not."""
    from benchmarks.layers.peers_impls import torchtitan_impls, transformers_impls

    built, missing = {}, {}
    for family, impls_of in (("transformers", transformers_impls), ("torchtitan", torchtitan_impls)):
        impls, why_not = impls_of()
        if why_not is not None:
            missing[family] = why_not
        for impl in impls:
            if "Mixtral" in impl.name or "kept in float32" in impl.name:
                continue  # one block per peer: Qwen3-MoE (grouped_mm experts), torchtitan as shipped

            def build(impl=impl):
                torch.manual_seed(0)
                src = MoELayer.from_config(
                    MoEConfig(
                        d_model=d,
                        d_hidden=hidden,
                        num_experts=experts,
                        top_k=TOP_K,
                        renormalize=True,
                        activation="swiglu",
                    )
                )
                return impl.build(src)

            built[impl.name] = ("peer", build)
    return built, missing


def count_step(module: nn.Module, x: torch.Tensor, g: torch.Tensor, bf16: bool) -> tuple[OpCounter, HostSyncCounter]:
    """The operators and would-be host syncs of one forward + ``aux.total()`` + backward (module docstring)."""
    for p in module.parameters():
        p.grad = None
    x = x.detach().requires_grad_(True)
    one = torch.ones((), device=x.device)
    amp = torch.autocast(x.device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with mock.patch.object(row_buckets, "needed", lambda *args: False), HostSyncCounter() as syncs, OpCounter() as ops:
        with amp:
            out = module(x)
            y, aux = out if isinstance(out, tuple) and not isinstance(out[1], torch.Tensor) else (out, None)
            if isinstance(y, tuple):  # a peer returning (hidden, router logits)
                y = y[0]
            total = aux.total() if aux is not None else None
        outs, grads = [y], [g.to(y.dtype) if g.dtype != y.dtype else g]
        if total is not None and total.requires_grad:
            outs.append(total)
            grads.append(one)
        torch.autograd.backward(outs, grads)
    return ops, syncs


def count_all(
    device: torch.device, d: int, experts: int, hidden: int, batch: int, seq: int, dtypes=DTYPES, peers: bool = True
) -> dict:
    """Counts of every layer in every dtype: ``{"rows": [...], "peers_missing": {family: why}}``."""
    layers = mode_layers(d, experts, hidden)
    missing = {}
    if peers:
        extra, missing = peer_layers(d, experts, hidden)
        layers.update(extra)
    rows = []
    for name, (kind, build) in layers.items():
        torch.manual_seed(0)
        module = build().to(device)
        torch.manual_seed(1)
        x = torch.randn(batch, seq, d, device=device)
        row = {"layer": name, "kind": kind}
        for dtype in dtypes:
            bf16 = dtype == "bfloat16"
            g = torch.randn(batch, seq, d, device=device, dtype=torch.bfloat16 if bf16 else torch.float32)
            count_step(module, x, g, bf16)  # a first step: lazy initialisations (caches, backends) stay out
            ops, syncs = count_step(module, x, g, bf16)
            row[f"ops_{dtype}"] = ops.count
            row[f"syncs_{dtype}"] = syncs.count
            row[f"by_op_{dtype}"] = dict(ops.by_name.most_common())
        rows.append(row)
    return {"rows": rows, "peers_missing": missing}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_arg(ap)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--no-peers", action="store_true", help="count mode's layers and the dense baselines only")
    ap.add_argument(
        "--out", type=Path, default=None, help="write the JSON here (e.g. benchmarks/results/count_ops.json)"
    )
    args = ap.parse_args()
    result = count_all(
        args.device, args.d_model, args.experts, args.hidden, args.batch, args.seq, peers=not args.no_peers
    )
    print_table(
        result["rows"],
        [
            ("layer", "layer", "s"),
            ("ops_float32", "ops fp32", "d"),
            ("ops_bfloat16", "ops bf16", "d"),
            ("syncs_float32", "syncs fp32", "d"),
            ("syncs_bfloat16", "syncs bf16", "d"),
        ],
    )
    for family, why in result["peers_missing"].items():
        print(f"{family}: not counted ({why})")
    if args.out:
        payload = {
            "config": dict(
                d_model=args.d_model,
                experts=args.experts,
                hidden=args.hidden,
                top_k=TOP_K,
                batch=args.batch,
                seq=args.seq,
                mod_capacity=CAPACITY,
                heads=HEADS,
            ),
            "device": str(args.device),
            "machine": machine_info(args.device),
            "counting": "OpCounter: one forward + aux.total() + backward; views and allocations not "
            "counted, a custom op once; row bucketing off (the CUDA path)",
            **result,
        }
        write_json(args.out, payload)


if __name__ == "__main__":
    main()

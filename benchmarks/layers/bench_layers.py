"""Layer benchmarks: routed layers against the dense layer they replace, as time ratios.

    PYTHONPATH=. python benchmarks/layers/bench_layers.py            # default run (a few minutes on 2 CPU cores)
    PYTHONPATH=. python benchmarks/layers/bench_layers.py --quick    # smoke run, small shapes, seconds
    PYTHONPATH=. python benchmarks/layers/bench_layers.py --device cuda --bf16   # on the GPU (cuda:N, auto also work)

``--dtype float32`` (the default) or ``bfloat16`` (``--bf16``): bfloat16 runs every forward, candidate and
baseline, under ``torch.autocast(bfloat16)`` with float32 weights (as ``mode train --bf16`` trains). On CUDA
time bfloat16: the experts' grouped GEMM has its fast kernel (CUTLASS, sm90/sm100) in bfloat16 only, and in
float32 takes torch's looped fallback with a host sync per GEMM. The JSON records the dtype.

(a) MoE layer vs a dense MLP with the same *active* FLOPs: top-k routing over experts of hidden H costs
    what a dense MLP of hidden k*H costs (plus the router). Token-choice router, dropless, in ``--dtype``,
    for each expert backend. Ratio > 1 is the overhead of routing, dispatch and grouped matmuls.
(b) MoD block (capacity 0.125) around a dense TransformerBlock vs the dense TransformerBlock, next to
    the analytic FLOP ratio.

Every number is forward + backward, candidate and baseline interleaved (see benchmarks/common.py);
the ratio column is the median of per-pair ratios. Results go to benchmarks/results/layers.json
(layers_quick.json with --quick) unless --out is given. Large CPU blocks are kept by malloc across steps
(``--malloc retain``, the default; ``--malloc glibc`` for the C library's defaults, see mode/cpu_allocator.py).

FLOP convention (forward; backward is 2x forward for every matmul, so the fwd+bwd ratio is the same):
a (m, k) @ (k, n) matmul costs 2mkn; attention scores and values count the full S x S product (no causal
saving, as torch's flop counter does); the MoD router costs 2D per token (one D-vector dot product);
element-wise work (norms, activations, softmax, RoPE, gathers) is not counted.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere without installing
    sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    add_device_arg,
    add_dtype_arg,
    add_malloc_arg,
    apply_malloc,
    apply_run_args,
    autocast,
    dtype_choice,
    fwd_bwd_step,
    machine_info,
    print_table,
    time_pair,
    write_json,
)
from mode import MLP, MoD, MoDRouter, MoDRouterConfig, MoEConfig, MoELayer, TransformerBlock  # noqa: E402

FULL = dict(tokens=4096, d_model=512, expert_hidden=2048, mod_batch=8, mod_seq=512, n_heads=8, warmup=3, repeats=5)
QUICK = dict(tokens=512, d_model=128, expert_hidden=512, mod_batch=2, mod_seq=256, n_heads=4, warmup=1, repeats=3)
TOP_KS = (1, 2)
NUM_EXPERTS = (8, 64)
BACKENDS = ("reference", "grouped")


def moe_flop_ratio(d: int, h: int, k: int, e: int) -> float:
    """(k experts of hidden h + router over e slots) / dense MLP of hidden k*h, per token."""
    return (4 * d * h * k + 2 * d * e) / (4 * d * (k * h))


def block_flops(n: int, d: int, h: int, causal_half: bool = False) -> float:
    """One sequence of ``n`` tokens through attention (projections + scores/values) and a GELU MLP."""
    scores_values = (2 if causal_half else 4) * n * n * d
    return 8 * n * d * d + scores_values + 4 * n * d * h


def bench_moe(cfg: dict, device: torch.device, seed: int, autocast_dtype: torch.dtype | None = None) -> list[dict]:
    """``autocast_dtype``: forward under ``torch.autocast`` in that dtype (None: float32, no autocast)."""
    d, h, T = cfg["d_model"], cfg["expert_hidden"], cfg["tokens"]
    rows = []
    for k in TOP_KS:
        for e in NUM_EXPERTS:
            torch.manual_seed(seed)
            x = torch.randn(1, T, d, device=device, requires_grad=True)
            g = torch.randn(1, T, d, device=device)
            dense = MLP(d, k * h).to(device)
            base_step = fwd_bwd_step(dense, x, g, autocast_dtype)
            for backend in BACKENDS:
                torch.manual_seed(seed + 1)  # same router weights, hence the same routing, for every backend
                moe = MoELayer.from_config(
                    MoEConfig(
                        d_model=d,
                        d_hidden=h,
                        num_experts=e,
                        router="token_choice",
                        top_k=k,
                        capacity_factor=None,
                        backend=backend,
                    )
                ).to(device)
                with torch.no_grad(), autocast(device, autocast_dtype):
                    kept_E = moe(x)[1].stats["router"].kept_E
                res = time_pair(
                    fwd_bwd_step(moe, x, g, autocast_dtype),
                    base_step,
                    warmup=cfg["warmup"],
                    repeats=cfg["repeats"],
                    device=device,
                )
                rows.append(
                    dict(
                        case=f"MoE top-{k} E={e} / MLP h={k * h}",
                        kind="moe",
                        backend=backend,
                        top_k=k,
                        num_experts=e,
                        tokens=T,
                        d_model=d,
                        expert_hidden=h,
                        dense_hidden=k * h,
                        flop_ratio=moe_flop_ratio(d, h, k, e),
                        load_max_over_mean=float(kept_E.max() / kept_E.mean()),
                        **res,
                    )
                )
                _report(rows[-1])
                del moe
                gc.collect()
            del dense, base_step, x, g
            gc.collect()
    return rows


def bench_mod(
    cfg: dict, device: torch.device, seed: int, capacity: float = 0.125, autocast_dtype: torch.dtype | None = None
) -> dict:
    d, heads, B, S = cfg["d_model"], cfg["n_heads"], cfg["mod_batch"], cfg["mod_seq"]
    h = 4 * d
    torch.manual_seed(seed)
    x = torch.randn(B, S, d, device=device, requires_grad=True)
    g = torch.randn(B, S, d, device=device)
    dense = TransformerBlock(d, heads, MLP(d, h)).to(device)
    router = MoDRouter(MoDRouterConfig(d_model=d, capacity=capacity))
    mod = MoD(TransformerBlock(d, heads, MLP(d, h)), router).to(device)
    C = router.seq_capacity(S)
    res = time_pair(
        fwd_bwd_step(mod, x, g, autocast_dtype),
        fwd_bwd_step(dense, x, g, autocast_dtype),
        warmup=cfg["warmup"],
        repeats=cfg["repeats"],
        device=device,
    )

    def ratio(causal_half: bool) -> float:
        return (block_flops(C, d, h, causal_half) + 2 * S * d) / block_flops(S, d, h, causal_half)

    row = dict(
        case=f"MoD c={capacity} / dense block",
        kind="mod",
        backend="-",
        batch=B,
        seq=S,
        routed_per_seq=C,
        d_model=d,
        n_heads=heads,
        mlp_hidden=h,
        flop_ratio=ratio(False),
        flop_ratio_causal_half=ratio(True),
        **res,
    )
    _report(row)
    return row


def _report(row: dict) -> None:
    print(f"  {row['case']:<32} {row['backend']:<9} ratio {row['ratio_median']:.3f}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small shapes and few repeats (smoke test)")
    p.add_argument(
        "--out",
        default=None,
        help="JSON path (default benchmarks/results/layers.json, or layers_quick.json with --quick)",
    )
    p.add_argument("--repeats", type=int, default=None, help="timed pairs per case (after warm-up)")
    p.add_argument("--warmup", type=int, default=None, help="untimed pairs per case")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads(N) before timing (default: leave torch's default)",
    )
    p.add_argument("--seed", type=int, default=0)
    add_device_arg(p)
    add_dtype_arg(p)
    add_malloc_arg(p)
    args = p.parse_args(argv)
    malloc = apply_malloc(args.malloc)

    cfg = apply_run_args(args, QUICK if args.quick else FULL)
    device = args.device
    compute = dtype_choice(args.dtype)
    out = args.out or str(ROOT / "benchmarks" / "results" / ("layers_quick.json" if args.quick else "layers.json"))

    info = machine_info(device)
    print(
        f"torch {info['torch']}, {info['torch_threads']} threads, {info['cpu_count']} CPUs, device {device} "
        f"({info['device_name']}), {args.dtype}",
        file=sys.stderr,
    )
    if device.type == "cuda" and compute is None:
        print(
            "note: float32 on CUDA times torch._grouped_mm's looped fallback (a host sync per GEMM), not its "
            "fast kernel, which is bfloat16 only; pass --dtype bfloat16 (--bf16) to time that",
            file=sys.stderr,
        )
    rows = bench_moe(cfg, device, args.seed, compute) + [bench_mod(cfg, device, args.seed, autocast_dtype=compute)]
    if hasattr(os, "getloadavg"):
        info["loadavg_1_5_15_at_end"] = [round(v, 2) for v in os.getloadavg()]

    for r in rows:
        r["candidate_ms"] = 1e3 * r["candidate_s_median"]
        r["baseline_ms"] = 1e3 * r["baseline_s_median"]
        r["spread"] = f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}"
    print()
    print_table(
        rows,
        [
            ("case", "case", ""),
            ("backend", "backend", ""),
            ("ratio_median", "ratio", ".3f"),
            ("spread", "min-max", ""),
            ("cpu_ratio_median", "CPU-time ratio", ".3f"),
            ("flop_ratio", "FLOP ratio", ".3f"),
            ("candidate_ms", "cand ms", ".1f"),
            ("baseline_ms", "base ms", ".1f"),
            ("load_max_over_mean", "load max/mean", ".2f"),
        ],
    )
    payload = dict(
        benchmark="bench_layers",
        command=" ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
        config=cfg,
        device=str(device),
        dtype=args.dtype,
        autocast=None if compute is None else f"torch.autocast({device.type!r}, {compute}); weights float32",
        machine=info,
        malloc=malloc,
        notes=(
            "ratio = candidate / baseline wall time of forward+backward, median of interleaved pairs; "
            "cpu_ratio_median: the same with process CPU time (all threads). "
            "MoE: token-choice, dropless; baseline MLP hidden = top_k * expert_hidden (same active FLOPs). "
            "FLOPs: 2mkn per matmul, full S^2 attention scores/values, router 2*D per token (MoD) or "
            "2*D*E (MoE); flop_ratio_causal_half counts S^2/2 instead."
        ),
        results=rows,
    )
    path = write_json(out, payload)
    print(f"\nwrote {path}", file=sys.stderr)
    return payload


if __name__ == "__main__":
    main()

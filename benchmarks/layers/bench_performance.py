"""All performance targets of the library in one run: ratios measured side by side, medians after warm-up.

    PYTHONPATH=. python benchmarks/layers/bench_performance.py [--quick] [--threads N] [--no-compile] [--malloc glibc]
    PYTHONPATH=. python benchmarks/layers/bench_performance.py --device cuda      # every section on the GPU, plus 5.

1. MoE layer fwd+bwd / dense MLP with the same active FLOPs (top-1/top-2, 8/64 experts, 4096 tokens,
   d=512, float32), both expert backends                          (target <= 1.10);
   and E=64 with expert-choice routing (every expert exactly tokens/64 rows: no load imbalance)
2. MoD block at capacity 0.125 / dense block                       (target <= FLOP ratio + 0.07)
3. MoD LM training step (12.5%, every other block) / dense LM step, same parameters, sequence 512
                                                                   (target <= 0.62; FLOP ratio ~0.56)
4. torch.compile (inductor) / eager for the MoD block and an MoE layer (what compile gains)
5. With --device cuda only: bfloat16 MoE (grouped_mm, and MegaBlocks where it imports) / dense MLP
   (target <= 1.15); the grouped and MegaBlocks layers get the same weights, hence the same routing

Sections 1-4 run on ``--device`` (cpu by default, cuda, or auto). Writes benchmarks/results/performance.json
(``--out``; the device, its name and the torch version are in ``machine``) and prints one table.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere without installing
    sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    add_device_arg,
    add_malloc_arg,
    apply_malloc,
    fwd_bwd_step,
    machine_info,
    print_table,
    time_pair,
    write_json,
)
from benchmarks.layers.bench_layers import FULL, QUICK, bench_mod, bench_moe, moe_flop_ratio  # noqa: E402
from mode import MLP, MoD, MoDRouter, MoDRouterConfig, MoEConfig, MoELayer, TransformerBlock  # noqa: E402
from mode.measure.flops import forward_flops_per_token  # noqa: E402
from mode.model import LM, LMConfig, alternate  # noqa: E402


def bench_moe_balanced(cfg: dict, device: torch.device, seed: int) -> dict:
    """E=64 with every expert taking exactly tokens/64 rows (expert-choice routing, capacity factor 1):
    the same active FLOPs as top-1, without the load imbalance of an untrained token-choice router."""
    d, h, T, e = cfg["d_model"], cfg["expert_hidden"], cfg["tokens"], 64
    torch.manual_seed(seed)
    x = torch.randn(1, T, d, device=device, requires_grad=True)
    g = torch.randn(1, T, d, device=device)
    dense = MLP(d, h).to(device)
    moe = MoELayer.from_config(
        MoEConfig(d_model=d, d_hidden=h, num_experts=e, router="expert_choice", capacity_factor=1.0, backend="grouped")
    ).to(device)
    res = time_pair(
        fwd_bwd_step(moe, x, g), fwd_bwd_step(dense, x, g), warmup=cfg["warmup"], repeats=cfg["repeats"], device=device
    )
    row = dict(
        case=f"MoE expert-choice E={e} ({T // e} rows each) / MLP h={h}",
        kind="moe",
        backend="grouped",
        top_k=None,
        num_experts=e,
        tokens=T,
        flop_ratio=moe_flop_ratio(d, h, 1, e),
        target=1.10,
        load_max_over_mean=1.0,
        **res,
    )
    print(f"  {row['case']:<40} ratio {res['ratio_median']:.3f}", file=sys.stderr, flush=True)
    return row


def bench_lm_step(
    quick: bool,
    device: torch.device,
    seed: int,
    warmup: int,
    repeats: int,
    shape: tuple[int, int, int, int] | None = None,
) -> dict:
    """Full training step (forward, backward, AdamW) of an MoD LM vs the dense LM of the same shape.

    ``shape``: (seq_len, batch, d_model, layers), default by ``quick``; the GPU suite passes a larger one."""
    S, B, d, layers = shape or ((256, 2, 128, 4) if quick else (512, 4, 256, 6))
    base = dict(seq_len=S, d_model=d, n_heads=max(2, d // 64), d_hidden=4 * d, vocab_size=256)
    cfg_dense = LMConfig(layers=("dense",) * layers, **base)
    cfg_mod = LMConfig(layers=alternate(layers, "dense", "mod"), capacity=0.125, **base)
    torch.manual_seed(seed)
    idx = torch.randint(0, 256, (B, S), device=device)

    def step_fn(cfg: LMConfig):
        torch.manual_seed(seed)
        model = LM(cfg).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step() -> None:
            out = model(idx, idx)
            (out.loss + out.aux.total()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    res = time_pair(step_fn(cfg_mod), step_fn(cfg_dense), warmup=warmup, repeats=repeats, device=device)
    flop_ratio = forward_flops_per_token(cfg_mod) / forward_flops_per_token(cfg_dense)
    return dict(
        case=f"MoD LM step / dense LM step (S={S}, d={d}, {layers} layers)",
        kind="lm",
        backend="-",
        seq=S,
        batch=B,
        d_model=d,
        layers=layers,
        flop_ratio=flop_ratio,
        target=0.62,
        **res,
    )


def bench_compile(quick: bool, device: torch.device, seed: int, warmup: int, repeats: int) -> list[dict]:
    """Compiled (inductor) vs eager forward+backward of the MoD block and a top-2 MoE layer."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / "mode-inductor"))
    d, S, B, T = (128, 256, 2, 512) if quick else (512, 512, 8, 4096)
    torch._dynamo.config.capture_dynamic_output_shape_ops = True
    torch._dynamo.config.capture_scalar_outputs = True
    rows = []
    torch.manual_seed(seed)
    mod = MoD(
        TransformerBlock(d, 8 if d >= 512 else 4, MLP(d, 4 * d)),
        MoDRouter(MoDRouterConfig(d, capacity=0.125, check_finite=False)),
    ).to(device)
    moe = MoELayer.from_config(MoEConfig(d_model=d, d_hidden=4 * d, num_experts=8, top_k=2, backend="grouped"))
    moe.router.cfg.check_finite = False
    for name, layer, shape in (("MoD block c=0.125", mod, (B, S, d)), ("MoE top-2 E=8", moe.to(device), (1, T, d))):
        x = torch.randn(*shape, device=device, requires_grad=True)
        g = torch.randn(*shape, device=device)
        compiled = torch.compile(layer)
        res = time_pair(
            fwd_bwd_step(compiled, x, g),
            fwd_bwd_step(layer, x, g),
            warmup=max(warmup, 2),
            repeats=repeats,
            device=device,
        )  # the first warm-up call compiles
        rows.append(dict(case=f"compiled / eager: {name}", kind="compile", backend="inductor", **res))
        print(f"  {rows[-1]['case']:<40} ratio {res['ratio_median']:.3f}", file=sys.stderr, flush=True)
    return rows


def bench_gpu(quick: bool, device: torch.device, seed: int, warmup: int, repeats: int) -> list[dict]:
    """bfloat16 MoE on CUDA: grouped_mm and (where it imports) MegaBlocks vs the dense-equivalent MLP."""
    d, h, T = (256, 1024, 2048) if quick else (1024, 4096, 16384)
    rows = []
    for k, e in ((1, 8), (2, 8), (1, 64), (2, 64)):
        torch.manual_seed(seed)
        x = torch.randn(1, T, d, device=device, dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn_like(x)
        dense = MLP(d, k * h).to(device, torch.bfloat16)
        for backend in ("grouped", "megablocks"):
            torch.manual_seed(seed + 1)  # same router weights, hence the same routing, for both backends
            try:
                moe = MoELayer.from_config(
                    MoEConfig(d_model=d, d_hidden=h, num_experts=e, top_k=k, backend=backend)
                ).to(device, torch.bfloat16)
            except ValueError as err:
                rows.append(dict(case=f"GPU bf16 MoE top-{k} E={e}", kind="gpu", backend=backend, skipped=str(err)))
                continue
            res = time_pair(
                fwd_bwd_step(moe, x, g), fwd_bwd_step(dense, x, g), warmup=warmup, repeats=repeats, device=device
            )
            rows.append(
                dict(
                    case=f"GPU bf16 MoE top-{k} E={e} / MLP h={k * h}",
                    kind="gpu",
                    backend=backend,
                    tokens=T,
                    d_model=d,
                    expert_hidden=h,
                    target=1.15,
                    **res,
                )
            )
            print(
                f"  {rows[-1]['case']:<40} {backend:<10} ratio {res['ratio_median']:.3f}", file=sys.stderr, flush=True
            )
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small shapes, few repeats (smoke test)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile section (~2 min)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/performance[_quick].json)")
    p.add_argument("--seed", type=int, default=0)
    add_device_arg(p)
    add_malloc_arg(p)
    args = p.parse_args(argv)
    malloc = apply_malloc(args.malloc)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = dict(QUICK if args.quick else FULL)
    device = args.device
    info = machine_info(device)
    print(
        f"torch {info['torch']}, {info['torch_threads']} threads, {info['cpu_count']} CPUs, device {device} "
        f"({info['device_name']})",
        file=sys.stderr,
    )

    rows = bench_moe(cfg, device, args.seed)
    for r in rows:
        r["target"] = 1.10
    rows.append(bench_moe_balanced(cfg, device, args.seed))
    mod_row = bench_mod(cfg, device, args.seed)
    mod_row["target"] = mod_row["flop_ratio"] + 0.07
    rows.append(mod_row)
    rows.append(bench_lm_step(args.quick, device, args.seed, cfg["warmup"], cfg["repeats"]))
    if not args.no_compile:
        rows += bench_compile(args.quick, device, args.seed, cfg["warmup"], cfg["repeats"])
    gpu_note = f"--device {device}: bfloat16 GPU section skipped (it runs with --device cuda)"
    if device.type == "cuda":
        rows += bench_gpu(args.quick, device, args.seed, cfg["warmup"], cfg["repeats"])
        gpu_note = info["device_name"]
    if hasattr(os, "getloadavg"):
        info["loadavg_1_5_15_at_end"] = [round(v, 2) for v in os.getloadavg()]
    for r in rows:
        if "ratio_median" in r:
            r["spread"] = f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}"
            r["meets_target"] = None if r.get("target") is None else bool(r["ratio_median"] <= r["target"])
    print()
    print_table(
        rows,
        [
            ("case", "case", ""),
            ("backend", "backend", ""),
            ("ratio_median", "ratio", ".3f"),
            ("spread", "min-max", ""),
            ("flop_ratio", "FLOP ratio", ".3f"),
            ("target", "target", ".3f"),
            ("meets_target", "met", ""),
            ("candidate_faults_median", "faults cand", ".0f"),
            ("baseline_faults_median", "faults base", ".0f"),
        ],
    )
    print(f"\nGPU: {gpu_note}", file=sys.stderr)
    out = args.out or str(
        ROOT / "benchmarks" / "results" / ("performance_quick.json" if args.quick else "performance.json")
    )
    payload = dict(
        benchmark="bench_performance",
        command=" ".join(["bench_performance.py"] + (argv if argv is not None else sys.argv[1:])),
        device=str(device),
        machine=info,
        malloc=malloc,
        gpu=gpu_note,
        config=cfg,
        results=rows,
    )
    print(f"wrote {write_json(out, payload)}", file=sys.stderr)
    return payload


if __name__ == "__main__":
    main()

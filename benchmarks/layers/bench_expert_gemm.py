"""How fast is one expert GEMM with few rows? Grouped GEMM over E experts vs one GEMM of all the rows.

    PYTHONPATH=. python benchmarks/layers/bench_expert_gemm.py --threads 1     # ~1 min on the 2-core CPU
    PYTHONPATH=. python benchmarks/layers/bench_expert_gemm.py --device cuda   # bfloat16 on the GPU (--dtype to change)

An MoE layer's expert GEMMs do the FLOPs of the dense MLP's GEMMs, split into E GEMMs of m = tokens/E
rows each (top-1, balanced). Each expert GEMM streams its own (d x h) weight for only m rows, so as m falls
the GEMM library spends more of its time packing and reading weights than multiplying. This benchmark
isolates that cost, for the three GEMMs of a forward+backward:

    forward / input grad   y_(E*m, h) = grouped_mm(x_(E*m, d), w_(E, d, h))   vs  x_(E*m, d) @ w_(d, h)
    weight grad            dw_(E, d, h) = x_e^T @ dy_e for each expert        vs  x^T @ dy  (one (d, h) output)

Both sides run the same FLOPs; ratio = grouped / single, median of interleaved pairs after warm-up.
Writes benchmarks/results/expert_gemm.json and expert_gemm.png.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere without installing
    sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    add_device_arg,
    add_malloc_arg,
    apply_malloc,
    machine_info,
    print_table,
    time_pair,
    write_json,
)
from mode.experts.grouped_mm import grouped_mm  # noqa: E402

ROWS_PER_EXPERT = (16, 32, 64, 128, 256, 512)


def bench_rows(
    m: int, num_experts: int, d: int, h: int, warmup: int, repeats: int, device: torch.device, dtype: torch.dtype
) -> list[dict]:
    tokens = m * num_experts
    new = dict(device=device, dtype=dtype)
    x_AD = torch.randn(tokens, d, **new)
    dy_AH = torch.randn(tokens, h, **new)
    w_DH = torch.randn(d, h, **new)
    w_EDH = torch.randn(num_experts, d, h, **new)
    offsets_E = torch.arange(1, num_experts + 1, dtype=torch.int32, device=device) * m
    dw_EDH = torch.empty(num_experts, d, h, **new)  # resident output: the comparison is the GEMMs, not the allocator
    x_e = x_AD.split(m)
    dy_e = dy_AH.split(m)

    def weight_grad() -> None:
        for e in range(num_experts):
            torch.mm(x_e[e].t(), dy_e[e], out=dw_EDH[e])

    dw_DH = torch.empty(d, h, **new)
    cases = (
        ("forward / input grad", lambda: grouped_mm(x_AD, w_EDH, offsets_E), lambda: x_AD @ w_DH),
        ("weight grad", weight_grad, lambda: torch.mm(x_AD.t(), dy_AH, out=dw_DH)),
    )
    rows = []
    for name, grouped, single in cases:
        res = time_pair(grouped, single, warmup=warmup, repeats=repeats, device=device)
        rows.append(
            dict(
                gemm=name,
                rows_per_expert=m,
                experts=num_experts,
                tokens=tokens,
                grouped_ms=1e3 * res["candidate_s_median"],
                single_ms=1e3 * res["baseline_s_median"],
                ratio=res["ratio_median"],
                spread=f"{res['ratio_min']:.2f}-{res['ratio_max']:.2f}",
            )
        )
        print(f"  m={m:<4} {name:<22} ratio {res['ratio_median']:.3f}", file=sys.stderr, flush=True)
    return rows


def plot(rows: list[dict], path: Path, where: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name in dict.fromkeys(r["gemm"] for r in rows):
        pts = [(r["rows_per_expert"], r["ratio"]) for r in rows if r["gemm"] == name]
        ax.plot(*zip(*pts), marker="o", label=name)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows per expert (tokens x top_k / experts)")
    ax.set_ylabel("time: E expert GEMMs / one GEMM")
    ax.set_title(f"Expert GEMM efficiency, E={rows[0]['experts']}, {where}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS_PER_EXPERT), help="rows per expert")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "expert_gemm.json"))
    p.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="auto: float32 on the CPU, bfloat16 on CUDA (torch._grouped_mm's CUDA kernel wants bfloat16)",
    )
    add_device_arg(p)
    add_malloc_arg(p)
    args = p.parse_args(argv)
    dtype_name = args.dtype if args.dtype != "auto" else ("bfloat16" if args.device.type == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    for name in ("experts", "d_model", "hidden", "warmup", "repeats"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            raise SystemExit(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    if any(m < 1 for m in args.rows):
        raise SystemExit(f"--rows={args.rows}: every value must be >= 1")
    malloc = apply_malloc(args.malloc)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    info = machine_info(args.device)
    rows = []
    for m in args.rows:
        rows += bench_rows(m, args.experts, args.d_model, args.hidden, args.warmup, args.repeats, args.device, dtype)
    print()
    print_table(
        rows,
        [
            ("gemm", "GEMM", ""),
            ("rows_per_expert", "rows/expert", "d"),
            ("tokens", "tokens", "d"),
            ("grouped_ms", "E GEMMs ms", ".1f"),
            ("single_ms", "one GEMM ms", ".1f"),
            ("ratio", "ratio", ".3f"),
            ("spread", "min-max", ""),
        ],
    )
    out = Path(args.out)
    payload = dict(
        benchmark="bench_expert_gemm",
        command=" ".join(["bench_expert_gemm.py"] + (argv if argv is not None else sys.argv[1:])),
        device=str(args.device),
        dtype=dtype_name,
        machine=info,
        malloc=malloc,
        d_model=args.d_model,
        hidden=args.hidden,
        results=rows,
    )
    write_json(out, payload)
    plot(rows, out.with_suffix(".png"), f"{dtype_name} {info['device_name'] if args.device.type == 'cuda' else 'CPU'}")
    print(f"wrote {out} and {out.with_suffix('.png')}", file=sys.stderr)
    return payload


if __name__ == "__main__":
    main()

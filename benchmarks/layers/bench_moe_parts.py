"""Where the time of one MoE layer goes: each part's forward + backward alone, as a fraction of the dense MLP.

    PYTHONPATH=. python benchmarks/layers/bench_moe_parts.py --threads 1                 # 64 experts of 256 (issue 14)
    PYTHONPATH=. python benchmarks/layers/bench_moe_parts.py --threads 1 --experts 8 --hidden 1024

The configuration of bench_peers.py (D=512, 4096 tokens, top-2 SwiGLU experts, softmax, renormalised,
float32). Every row runs once per round next to the dense SwiGLU MLP with the same active FLOPs
(``benchmarks/common.py: time_interleaved``); the ratio is the median over rounds of row / dense.
Rows:
    layer              the whole MoELayer (router, dispatch, experts, combine), as bench_peers.py times it
    router             the token-choice router: logits, softmax, top-k, aux losses, the plan, stats
    gather             dispatch: x[token_idx_A] (backward: index_add into x's gradient)
    experts            the expert bank on the dispatched rows, gates included (what the layer calls)
    combine            the scatter-add of the gated rows back to the tokens
    expert GEMMs       only the six grouped GEMMs of the bank (forward, input and weight gradients),
                       on the layer's real per-expert counts: the floor the other parts add to
    dense GEMMs        only the six GEMMs of the dense MLP
    router GEMMs       only the router's three GEMMs (logits, their input and weight gradients)
The parts overlap nothing, so layer ~ router + gather + experts + combine (+ autograd bookkeeping).
Writes benchmarks/results/moe_parts.json (``--out``).
"""

from __future__ import annotations

import argparse
import os
import statistics
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
    time_interleaved,
    write_json,
)
from mode import MLP, MoEConfig, MoELayer  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "moe_parts.json"))
    add_device_arg(p)
    add_malloc_arg(p)
    args = p.parse_args(argv)
    malloc = apply_malloc(args.malloc)
    if args.threads:
        torch.set_num_threads(args.threads)
    dev, E, H, T, D, K = args.device, args.experts, args.hidden, args.tokens, args.d_model, 2
    torch.manual_seed(0)
    x = torch.randn(1, T, D, device=dev, requires_grad=True)
    g = torch.randn(1, T, D, device=dev)
    dense = MLP(D, K * H, activation="swiglu").to(dev)
    torch.manual_seed(1)
    moe = MoELayer.from_config(
        MoEConfig(d_model=D, d_hidden=H, num_experts=E, top_k=K, renormalize=True, activation="swiglu")
    ).to(dev)
    with torch.no_grad():
        plan = moe.router(x)
        x_AD, counts_E, _ = moe.dispatcher.dispatch(x[0], plan)
    A = x_AD.shape[0]
    xa = x_AD.clone().requires_grad_()
    gate = plan.weight_A.clone().requires_grad_()
    ya = torch.randn(A, D, device=dev, requires_grad=True)
    ga, gw = torch.randn(A, D, device=dev), torch.randn(A, device=dev)

    def zero(*modules):
        for m in modules:
            for q in m.parameters():
                q.grad = None
        for t in (x, xa, gate, ya):
            t.grad = None

    def layer():
        zero(moe)
        y, aux = moe(x)
        torch.autograd.backward([y, aux.total()], [g, None])

    def dense_step():
        zero(dense)
        dense(x)[0].backward(g)

    def router():
        zero(moe)
        q = moe.router(x)
        torch.autograd.backward([q.weight_A, q.aux.total()], [gw, None])

    def gather():
        zero()
        x[0].index_select(0, plan.token_idx_A).backward(ga)

    def experts():
        zero(moe)
        moe.experts(xa, counts_E, padded=plan.padded, gate_A=gate).backward(ga)

    def combine():
        zero()
        moe.dispatcher.combine_gated(ya, plan, None).backward(g[0])

    # the bare GEMMs, with the layer's real per-expert counts
    offs = torch.cumsum(counts_E, 0, dtype=torch.int32)
    w1, w2 = moe.experts.w_in_EDF.detach(), moe.experts.w_out_EHD.detach()
    h, dh, dy = torch.randn(A, H, device=dev), torch.randn(A, 2 * H, device=dev), torch.randn(A, D, device=dev)
    xd, hd = torch.randn(T, D, device=dev), torch.randn(T, K * H, device=dev)
    v1, v2 = dense.w_in_DF.detach(), dense.w_out_HD.detach()
    dhd, dyd = torch.randn(T, 2 * K * H, device=dev), torch.randn(T, D, device=dev)
    wr, dl = moe.router.weight.detach(), torch.randn(T, E, device=dev)
    gm = torch._grouped_mm

    def expert_gemms():
        xc = x_AD
        gm(xc, w1, offs=offs), gm(h, w2, offs=offs), gm(dy, w2.transpose(1, 2), offs=offs)
        gm(h.t(), dy, offs=offs), gm(dh, w1.transpose(1, 2), offs=offs), gm(xc.t(), dh, offs=offs)

    def dense_gemms():
        xd @ v1, hd @ v2, dyd @ v2.t(), hd.t() @ dyd, dhd @ v1.t(), xd.t() @ dhd

    def router_gemms():
        xd @ wr.t(), dl @ wr, dl.t() @ xd

    fns = {
        "dense MLP": dense_step,
        "layer": layer,
        "router": router,
        "gather": gather,
        "experts": experts,
        "combine": combine,
        "expert GEMMs": expert_gemms,
        "dense GEMMs": dense_gemms,
        "router GEMMs": router_gemms,
    }
    info = machine_info(dev)
    res = time_interleaved(fns, "dense MLP", warmup=args.warmup, repeats=args.repeats, device=dev)
    if hasattr(os, "getloadavg"):
        info["loadavg_1_5_15_at_end"] = [round(v, 2) for v in os.getloadavg()]
    rows = [
        dict(part=k, ms=1e3 * r["s_median"], spread=f"{r['ratio_min']:.3f}-{r['ratio_max']:.3f}", **r)
        for k, r in res.items()
    ]
    parts = sum(res[k]["ratio_median"] for k in ("router", "gather", "experts", "combine"))
    print_table(
        rows,
        [
            ("part", "part", ""),
            ("ms", "ms", ".1f"),
            ("ratio_median", "/ dense MLP", ".3f"),
            ("spread", "min-max", ""),
            ("cpu_ratio_median", "CPU-time ratio", ".3f"),
        ],
    )
    gemm_ratio = statistics.median(e / d for e, d in zip(res["expert GEMMs"]["s"], res["dense GEMMs"]["s"]))
    print(
        f"\nrouter + gather + experts + combine = {parts:.3f} of the dense MLP; expert GEMMs / dense GEMMs "
        f"(median over rounds) = {gemm_ratio:.3f}",
        file=sys.stderr,
    )
    payload = dict(
        benchmark="bench_moe_parts",
        command=" ".join(["bench_moe_parts.py"] + (argv if argv is not None else sys.argv[1:])),
        config=dict(experts=E, hidden=H, tokens=T, d_model=D, top_k=K, repeats=args.repeats, warmup=args.warmup),
        load_max_over_mean=float(counts_E.max() / counts_E.float().mean()),
        parts_sum_ratio=parts,
        expert_over_dense_gemms=gemm_ratio,
        device=str(dev),
        machine=info,
        malloc=malloc,
        results=rows,
    )
    print(f"wrote {write_json(args.out, payload)}", file=sys.stderr)
    return payload


if __name__ == "__main__":
    main()

"""The layer stages: moe (bench_peers in bf16, beside the peers), mod (the MoD block and LM step / dense),
decode (bench_decode) and gdecode (decode with CUDA graphs vs the eager static path)."""

from __future__ import annotations

import statistics
import time

from benchmarks.gpu.stage_base import NO_CUDA, Ctx, compiling, sync

# bf16 shapes a GPU is not idle on: 16k tokens, d 1024; E=8 of hidden 2048 and E=64 of hidden 512, top-2
MOE_GPU_ARGS = [
    "--tokens",
    "16384",
    "--d-model",
    "1024",
    "--configs",
    "8:2048",
    "64:512",
    "--warmup",
    "3",
    "--repeats",
    "15",
]


PEER_FAMILIES = ("transformers", "torchtitan", "liger")


def compiled_ratio(candidate, baseline, x, g, device, warmup: int, repeats: int, compile_fn=None) -> dict:
    """``torch.compile``-d candidate / compiled baseline, forward + backward under bf16 autocast, interleaved
    pairs after a warm-up whose first call compiles: what eager's per-op launch cost hides (the host-bound
    share the profile stage shows)."""
    import torch

    from benchmarks.common import time_pair

    torch._dynamo.config.capture_dynamic_output_shape_ops = True
    torch._dynamo.config.capture_scalar_outputs = True
    steps = []
    for module in (candidate, baseline):
        compiled = (compile_fn or torch.compile)(module)
        params = [p for p in module.parameters() if p.requires_grad]

        def step(compiled=compiled, params=params) -> None:
            for p in params:
                p.grad = None
            x.grad = None
            with torch.autocast(device.type, dtype=torch.bfloat16):
                out = compiled(x)
            y, aux = out if isinstance(out, tuple) else (out, None)
            total = None if aux is None else aux.total()
            outs, grads = ([y, total], [g, None]) if total is not None and total.requires_grad else ([y], [g])
            torch.autograd.backward(outs, grads)

        steps.append(step)
    t0 = time.monotonic()
    steps[0]()
    steps[1]()
    sync(device)
    compile_s = time.monotonic() - t0
    res = time_pair(steps[0], steps[1], warmup=warmup, repeats=repeats, device=device)
    return {
        "ratio": res["ratio_median"],
        "candidate_ms": 1e3 * res["candidate_s_median"],
        "baseline_ms": 1e3 * res["baseline_s_median"],
        "compile_s": compile_s,
    }


def _size_key(num_experts: int, configs) -> str:
    """A configuration's key in the numbers: E8 for the fewest experts, E64 for the other (also in --quick, whose
    configurations have 4 and 16)."""
    return "E8" if num_experts == min(E for E, _ in configs) else "E64"


def stage_moe(ctx: Ctx) -> dict:
    from benchmarks.layers import bench_peers

    out = ctx.work / "peers_bf16.json"
    argv = ["--precision", "bf16", "--device", str(ctx.device), "--out", str(out)]
    argv += ["--quick", "--threads", "1"] if ctx.smoke else MOE_GPU_ARGS
    payload = bench_peers.main(argv)
    numbers: dict = {}
    for E in sorted({r["num_experts"] for r in payload["results"]}):
        rows = [r for r in payload["results"] if r["num_experts"] == E]
        ours = next(r for r in rows if r["implementation"] == "mode, auto")
        dense = next(r for r in rows if r["family"] == "dense" and "bf16" in r["implementation"])
        k, d, h, T = ours["top_k"], ours["d_model"], ours["expert_hidden"], ours["tokens"]
        flops = 3 * (2 * T * k * 3 * d * h)  # fwd + bwd of the active SwiGLU experts (3 matmuls, bwd 2x fwd)
        key = _size_key(E, payload["config"]["configs"])
        numbers[f"moe_ratio_{key}"] = ours["ratio_median"]
        numbers[f"moe_tflops_{key}"] = flops / ours["s_median"] / 1e12
        numbers[f"dense_tflops_{key}"] = flops / dense["s_median"] / 1e12
        numbers[f"moe_us_per_token_{key}"] = 1e6 * ours["s_median"] / T
        peers = {r["implementation"]: r["ratio_median"] for r in rows if r["family"] in PEER_FAMILIES}
        numbers[f"best_peer_ratio_{key}"] = min(peers.values()) if peers else None
        numbers[f"ahead_of_peers_{key}"] = all(ours["ratio_median"] < v for v in peers.values()) if peers else None
        numbers[f"num_experts_{key}"] = E
    # the same layer and dense MLP compiled (first configuration only in the smoke run: CPU compiles are slow)
    import torch

    from mode import MLP

    compiled = {}
    cfg = payload["config"]
    for E, H in (cfg["configs"][:1] if ctx.smoke else cfg["configs"]) if compiling(ctx) else ():
        key = _size_key(E, cfg["configs"])
        torch.manual_seed(0)
        x = torch.randn(1, cfg["tokens"], cfg["d_model"], device=ctx.device, requires_grad=True)
        g = torch.randn(1, cfg["tokens"], cfg["d_model"], device=ctx.device)
        layer = bench_peers.build_mode(cfg, E, H, "auto", seed=1).to(ctx.device)
        dense = MLP(cfg["d_model"], bench_peers.TOP_K * H, activation="swiglu").to(ctx.device)
        compiled[key] = compiled_ratio(layer, dense, x, g, ctx.device, warmup=2, repeats=5 if ctx.smoke else 15)
        numbers[f"moe_ratio_compiled_{key}"] = compiled[key]["ratio"]
        print(f"compiled E={E}: {compiled[key]}", flush=True)
    return {
        "numbers": numbers,
        "details": {
            "skipped": payload["skipped"],
            "config": payload["config"],
            "compiled": compiled,
            "results": payload["results"],
        },
    }


MOD_GPU_BLOCK = dict(d_model=1024, n_heads=16, mod_batch=8, mod_seq=2048, warmup=3, repeats=15)


MOD_GPU_BLOCK_LARGE = dict(MOD_GPU_BLOCK, mod_batch=32)  # 4x the tokens: does the gap close as work grows?


MOD_GPU_LM = (1024, 16, 1024, 8)  # seq_len, batch, d_model, layers


MOD_SMOKE_BLOCK = dict(d_model=64, n_heads=2, mod_batch=2, mod_seq=128, warmup=1, repeats=3)


MOD_SMOKE_LM = (128, 2, 64, 2)


def stage_mod(ctx: Ctx) -> dict:
    import torch

    from benchmarks.layers.bench_layers import bench_mod
    from benchmarks.layers.bench_performance import bench_lm_step

    device = ctx.device
    block_cfg, lm_shape = (MOD_SMOKE_BLOCK, MOD_SMOKE_LM) if ctx.smoke else (MOD_GPU_BLOCK, MOD_GPU_LM)
    # bf16 autocast for the whole measurement, as mode train --bf16 (weights, optimizer float32)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        block = bench_mod(block_cfg, device, seed=0)
        large = None if ctx.smoke else bench_mod(MOD_GPU_BLOCK_LARGE, device, seed=0)
        lm = bench_lm_step(
            False, device, seed=0, warmup=block_cfg["warmup"], repeats=block_cfg["repeats"], shape=lm_shape
        )
    from mode import MLP, MoD, MoDRouter, MoDRouterConfig, TransformerBlock

    d, heads, B, S = block_cfg["d_model"], block_cfg["n_heads"], block_cfg["mod_batch"], block_cfg["mod_seq"]
    torch.manual_seed(0)
    x = torch.randn(B, S, d, device=device, requires_grad=True)
    g = torch.randn(B, S, d, device=device)
    mod = MoD(
        TransformerBlock(d, heads, MLP(d, 4 * d)),
        MoDRouter(MoDRouterConfig(d_model=d, capacity=0.125, check_finite=False)),
    )
    compiled = None
    if compiling(ctx):
        compiled = compiled_ratio(
            mod.to(device),
            TransformerBlock(d, heads, MLP(d, 4 * d)).to(device),
            x,
            g,
            device,
            warmup=2,
            repeats=block_cfg["repeats"],
        )
        print(f"compiled MoD block / compiled dense block: {compiled}")
    print(
        f"MoD block {block['ratio_median']:.3f} (FLOP ratio {block['flop_ratio']:.3f}); "
        f"LM step {lm['ratio_median']:.3f} (FLOP ratio {lm['flop_ratio']:.3f})"
    )
    numbers = {
        "block_ratio": block["ratio_median"],
        "block_flop_ratio": block["flop_ratio"],
        "block_gap": block["ratio_median"] - block["flop_ratio"],
        "lm_ratio": lm["ratio_median"],
        "lm_flop_ratio": lm["flop_ratio"],
        "lm_gap": lm["ratio_median"] - lm["flop_ratio"],
        "block_dense_ms": 1e3 * block["baseline_s_median"],
        "lm_dense_ms": 1e3 * lm["baseline_s_median"],
        **(
            {}
            if compiled is None
            else {
                "block_ratio_compiled": compiled["ratio"],
                "block_gap_compiled": compiled["ratio"] - block["flop_ratio"],
            }
        ),
        **(
            {}
            if large is None
            else {
                "block_ratio_batch32": large["ratio_median"],
                "block_gap_batch32": large["ratio_median"] - large["flop_ratio"],
            }
        ),
    }
    return {
        "numbers": numbers,
        "details": {
            "dtype": "bf16 autocast",
            "block": block,
            "lm": lm,
            "block_batch32": large,
            "block_compiled": compiled,
        },
    }


def stage_decode(ctx: Ctx) -> dict:
    from benchmarks.layers import bench_decode

    out = ctx.work / "decode.json"
    argv = ["--device", str(ctx.device), "--out", str(out)]
    argv += ["--quick", "--repeats", "2"] if ctx.smoke else ["--sizes", "base", "--repeats", "5", "--threads", "0"]
    payload = bench_decode.main(argv)
    numbers: dict = {}
    for r in payload["results"]:
        numbers[f"speedup_{r['size']}_b{r['batch']}_{r['path']}"] = r["decode_speedup"]
        numbers[f"flop_bound_{r['size']}_b{r['batch']}"] = r["flop_bound"]
    first = payload["results"][0]["size"]
    for B in sorted({r["batch"] for r in payload["results"]}):
        best = [r["decode_speedup"] for r in payload["results"] if r["batch"] == B and r["size"] == first]
        numbers["speedup_b1" if B == 1 else f"speedup_b{B}"] = max(best)
    return {"numbers": numbers, "details": {"config": payload["config"], "results": payload["results"]}}


GDECODE_GPU = dict(size="base", prompt=128, new=192, batches=(1, 8), repeats=3)


GDECODE_SMOKE = dict(size="tiny", prompt=16, new=24, batches=(1, 2), repeats=1)


def stage_gdecode(ctx: Ctx) -> dict:
    """generate() on the static path, eager and with cuda_graphs=True: tokens/s, and the same tokens."""

    from benchmarks.layers import bench_decode
    from mode.model.generate import generate

    p = GDECODE_SMOKE if ctx.smoke else GDECODE_GPU
    size = bench_decode.SIZES[p["size"]]
    cfg = dict(size, seq_len=p["prompt"] + p["new"])
    numbers: dict = {}
    details: dict = {"config": {**p, **cfg}}
    for kind in ("mod", "dense"):
        model = bench_decode.build(cfg, kind == "mod", seed=0, device=ctx.device)
        for B in p["batches"]:
            prompts = bench_decode.text_windows(B, p["prompt"], seed=B).tolist()
            row: dict = {}
            variants = [("eager", False)] + ([("graphs", True)] if ctx.device.type == "cuda" else [])
            outs = {}
            for name, graphs in variants:
                generate(model, prompts, 8, temperature=0, static_cache=True, cuda_graphs=graphs)  # warm-up
                times = []
                for _ in range(p["repeats"]):
                    sync(ctx.device)
                    t0 = time.perf_counter()
                    outs[name] = generate(
                        model, prompts, p["new"], temperature=0, static_cache=True, cuda_graphs=graphs
                    )
                    sync(ctx.device)
                    times.append(time.perf_counter() - t0)
                row[f"tok_s_{name}"] = B * p["new"] / statistics.median(times)
            if "graphs" in outs:
                row["same_tokens"] = outs["graphs"] == outs["eager"]
                row["speedup"] = row["tok_s_graphs"] / row["tok_s_eager"]
                numbers[f"speedup_{kind}_b{B}"] = row["speedup"]
                numbers[f"same_tokens_{kind}_b{B}"] = row["same_tokens"]
            else:
                row["graphs"] = NO_CUDA
            numbers[f"tok_s_eager_{kind}_b{B}"] = row["tok_s_eager"]
            details[f"{kind}_b{B}"] = row
            print(f"decode {kind} batch {B}: {row}", flush=True)
        del model
    if ctx.device.type != "cuda":
        numbers["graphs"] = NO_CUDA
    return {"numbers": numbers, "details": details}

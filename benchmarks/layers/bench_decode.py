"""Decode benchmark: KV-cached sampling speed of an MoD LM against the dense LM of the same shape, on both
decode paths (dynamic and static, see ``mode.model.generate``), at two model sizes and two batch sizes.

    PYTHONPATH=. python benchmarks/layers/bench_decode.py            # both sizes (about 15 min on 2 shared CPU cores)
    PYTHONPATH=. python benchmarks/layers/bench_decode.py --sizes base    # today's size only (about 5 min)
    PYTHONPATH=. python benchmarks/layers/bench_decode.py --quick    # smoke run, small shapes, seconds
    PYTHONPATH=. python benchmarks/layers/bench_decode.py --device cuda   # on the GPU (cuda:N, auto also work)

Sizes (decoder-only byte LMs, MLP hidden 4 * d_model, seq_len 1024):
    base  d_model 512, 8 layers, 8 heads: the size this benchmark has always measured
    deep  d_model 768, 12 layers, 12 heads (GPT-2 small's body): a size where the matmuls dominate a step
The MoD LM routes every other block (layers 1, 3, ...) with capacity 0.125 and causal="predictor"; the
dense LM has the same weights' shapes and no routers. Both are untrained.

Routing regime. An untrained predictor sends ~all or ~no tokens through its block, which would measure
nothing useful. So each MoD layer's predictor output bias is set to the (1 - capacity) quantile of its
logits (layer by layer, with causal routing): first on text windows, then, for each batch size, on the
positions decoding actually feeds the model, i.e. the greedy continuation of that batch's prompts (three
rounds, since the continuation depends on the routing). The routing the timed decode sees is measured by
an instrumented replay (greedy decoding is deterministic) and reported, per layer in the JSON.

Timing. Prompts of 128 bytes of the Python standard library's sources, then ``new`` tokens, greedy
(temperature 0), at batch 1 and batch 8. One round = prefill + decode of the MoD and the dense model on each
path, in an order that rotates from round to round; after warm-up, speedup (dense time / MoD time, same
path) is the median of per-round ratios, in wall-clock time and in process CPU time (steadier on a shared
machine: time spent waiting for a core is not counted). "decode" counts the tokens fed by the ``new - 1``
``decode_step`` calls (the first new token comes from the prefill's logits); prefill is timed apart. Both
paths must give the same tokens (checked), and the timed loop the tokens ``generate()`` gives (checked).

Bounds, from the replay (each step, each layer, each row: routed or not, cache length):
    FLOP bound   dense decode FLOPs / MoD decode FLOPs: matmuls (2 x weights) + attention (4 x cache
                 length x d_model) per token and layer, the routers, the head; a skipped token costs its
                 router only. No implementation that computes these FLOPs can beat it when compute dominates.
    bytes bound  dense bytes read / MoD bytes read: each block's weights once per step in which any row runs
                 it (at batch 8 a MoD block runs whenever one of eight rows routes), plus every computing
                 row's cached keys and values. The limit when weight reads dominate (batch > 1 on a CPU).
The static path computes every block for every row (its MoD layers save cache writes, not compute), so
on a CPU it is slower than dense; it exists for GPUs (no host sync inside a step; see the module doc of
``mode.model.generate``).

Threads: one intra-op thread by default (``--threads 0`` keeps torch's default). Decoding at batch <= 8 is
a chain of small, latency-bound ops; on a small shared machine a second intra-op thread mostly spins and
waits for a core, which measures the machine's load, not the models.

KV-cache bytes: sum over layers of ``len_B.sum() * 2 (k and v) * d_model * element size`` after the run
(what the caches hold, not what they reserved).

Results go to benchmarks/results/decode.json (decode_quick.json with --quick) unless --out is given.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere without installing
    sys.path.insert(0, str(ROOT))

from benchmarks.common import add_device_arg, machine_info, print_table, sync, write_json  # noqa: E402
from mode.layers.mod import MoD  # noqa: E402
from mode.model import LM, LMConfig, alternate  # noqa: E402
from mode.model.generate import decode_step, generate, prefill  # noqa: E402
from mode.train.data import stdlib_corpus  # noqa: E402

SIZES = {
    "base": dict(d_model=512, n_layers=8, n_heads=8, new=128, repeats=7),
    "deep": dict(d_model=768, n_layers=12, n_heads=12, new=64, repeats=5),
    "tiny": dict(d_model=128, n_layers=4, n_heads=4, new=32, repeats=3),  # --quick
}
FULL = dict(sizes=("base", "deep"), seq_len=1024, prompt=128, batches=(1, 8), warmup=1)
QUICK = dict(sizes=("tiny",), seq_len=256, prompt=32, batches=(1, 4), warmup=1)
PATHS = ("dynamic", "static")
CAPACITY = 0.125


def build(cfg: dict, mod: bool, seed: int, device: torch.device) -> LM:
    torch.manual_seed(seed)
    kind = "mod" if mod else "dense"
    lcfg = LMConfig(
        vocab_size=256,
        seq_len=cfg["seq_len"],
        d_model=cfg["d_model"],
        n_heads=cfg["n_heads"],
        d_hidden=4 * cfg["d_model"],
        layers=alternate(cfg["n_layers"], "dense", kind),
        capacity=CAPACITY,
        causal="predictor" if mod else "none",
    )
    return LM(lcfg).eval().to(device)


def text_windows(n: int, length: int, seed: int) -> torch.Tensor:
    """``n`` windows of ``length`` bytes from the standard library's sources, at seeded random offsets."""
    data = torch.from_numpy(stdlib_corpus(max_bytes=2_000_000).train.astype("int64"))
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - length, (n,), generator=g)
    return data[starts[:, None] + torch.arange(length)]


@torch.no_grad()
def calibrate(model: LM, x_BS: torch.Tensor, fraction: float, start: int = 0, step: float = 1.0) -> None:
    """Set each predictor's output bias so that ``fraction`` of the tokens of ``x_BS`` at positions >= ``start``
    route under causal routing (layer by layer: a layer's input depends on the routing before it); ``step``
    < 1 moves the bias only that part of the way."""
    x_BS = x_BS.to(model.embed.weight.device)
    for layer in model.layers:
        if not isinstance(layer, MoD):
            continue
        seen = []
        hook = layer.register_forward_pre_hook(lambda m, args, kwargs: seen.append(args[0]), with_kwargs=True)  # noqa: B023 - called in this iteration
        model(x_BS, causal_routing=True)
        hook.remove()
        router = layer.router
        logits = router.decision_logits(seen[0], router.scores(seen[0]))[:, start:].flatten()
        router.predictor[-1].bias -= step * torch.quantile(logits.double(), 1 - fraction).float()


@torch.no_grad()
def calibrate_on_own_decode(model: LM, prompts: list[list[int]], new: int, fraction: float, rounds: int = 4) -> None:
    """Calibrate on the positions decoding will feed: the prompts' greedy continuation. The continuation
    depends on the routing and need not settle (the deep model flips between two continuations, routing 9%
    and 18%), so run a few rounds, the later ones moving the bias half way, and keep the round whose decode
    routed closest to ``fraction`` (the fraction seen is reported)."""
    biases = [layer.router.predictor[-1].bias for layer in model.layers if isinstance(layer, MoD)]
    best = None
    for r in range(rounds):
        cont = generate(model, prompts, new, temperature=0)
        calibrate(
            model,
            torch.tensor([p + c for p, c in zip(prompts, cont)]),
            fraction,
            start=len(prompts[0]),
            step=1.0 if r == 0 else 0.5,
        )
        layers = replay(model, prompts, new)["layers"].values()
        miss = abs(statistics.mean(v["decode_routed_fraction"] for v in layers) - fraction)
        if best is None or miss < best[0]:
            best = (miss, [b.clone() for b in biases])
    for b, keep in zip(biases, best[1]):
        b.copy_(keep)


@torch.no_grad()
def run_once(model: LM, prompts: list[list[int]], new: int, static: bool) -> dict:
    """Greedy prefill + decode exactly as ``generate(temperature=0, static_cache=static)`` does it, timed
    per phase (wall clock and process CPU time)."""
    device = model.embed.weight.device
    sync(device)  # on a GPU the clock must not start while earlier work is still queued
    t0 = time.perf_counter()
    logits_BV, caches, pos_B = prefill(model, prompts, max(map(len, prompts)) + new, static=static)
    sync(device)
    t1, c1 = time.perf_counter(), time.process_time()
    out = []
    for step in range(new):
        next_B = logits_BV.argmax(-1)
        out.append(next_B)
        if step == new - 1:
            break
        logits_BV = decode_step(model, next_B, pos_B, caches)
        pos_B = pos_B + 1
    sync(device)
    t2, c2 = time.perf_counter(), time.process_time()
    return dict(
        prefill_s=t1 - t0, decode_s=t2 - t1, decode_cpu_s=c2 - c1, tokens=torch.stack(out, 1).tolist(), caches=caches
    )


def cache_bytes(model: LM, caches) -> int:
    d, elem = model.cfg.d_model, model.embed.weight.element_size()
    return sum(int(c.len_B.sum()) * 2 * d * elem for c in caches)


def matmul_params(module: torch.nn.Module) -> int:
    """Weights a token multiplies by in ``module`` (its 2-D parameters: not norms or biases)."""
    return sum(p.numel() for p in module.parameters() if p.dim() == 2)


@torch.no_grad()
def replay(model: LM, prompts: list[list[int]], new: int) -> dict:
    """Replay the (deterministic) greedy decode, reading each step's routing and cache lengths: per MoD
    layer the routed fractions, and the model's decode FLOPs and bytes read (see the module doc)."""
    cfg = model.cfg
    d, elem = cfg.d_model, model.embed.weight.element_size()
    mod_ids = [i for i, layer in enumerate(model.layers) if isinstance(layer, MoD)]
    per_layer = {i: dict(routed=0, tokens=0, ran=0, steps=0) for i in mod_ids}
    flops = bytes_read = 0.0
    head = 2 * d * cfg.vocab_size
    logits_BV, caches, pos_B = prefill(model, prompts, max(map(len, prompts)) + new)
    prefill_frac = {i: caches[i].len_B.float().mean().item() / max(map(len, prompts)) for i in mod_ids}
    for _ in range(new - 1):
        out = model(logits_BV.argmax(-1)[:, None], positions_BS=pos_B[:, None], caches=caches, causal_routing=True)
        logits_BV, pos_B = out.logits_BSV[:, -1], pos_B + 1
        B = pos_B.shape[0]
        flops += B * head
        bytes_read += matmul_params(model.head) * elem
        for i, layer in enumerate(model.layers):
            lens = caches[i].len_B.tolist()  # lengths after this step: what each computing row attended over
            if i in per_layer:
                routed = out.aux.stats[f"layers.{i}.mod.router"].compute_T.bool().tolist()
                st = per_layer[i]
                st["routed"] += sum(routed)
                st["tokens"] += B
                st["ran"] += any(routed)
                st["steps"] += 1
                w = 2 * matmul_params(layer.block)
                flops += B * layer.router.cfg.router_flops(1)
                bytes_read += matmul_params(layer.router) * elem
            else:
                w, routed = 2 * matmul_params(layer), [True] * B
            flops += sum(w + 4 * n * d for n, r in zip(lens, routed) if r)
            if any(routed):
                bytes_read += (w // 2) * elem + sum(2 * n * d * elem for n, r in zip(lens, routed) if r)
    layers = {
        f"layers.{i}": dict(
            decode_routed_fraction=st["routed"] / st["tokens"],
            decode_steps_block_ran=st["ran"] / st["steps"],
            prefill_routed_fraction=prefill_frac[i],
        )
        for i, st in per_layer.items()
    }
    return dict(flops=flops, bytes=bytes_read, layers=layers)


def bench_batch(mod: LM, dense: LM, prompts: list[list[int]], cfg: dict, paths: tuple[str, ...]) -> list[dict]:
    new = cfg["new"]
    B = len(prompts)
    fns = {
        (name, path): (model, path == "static") for name, model in (("mod", mod), ("dense", dense)) for path in paths
    }
    keys = list(fns)
    for _ in range(cfg["warmup"]):
        for key in keys:
            model, static = fns[key]
            run_once(model, prompts, new, static)
    runs: dict[tuple, list[dict]] = {key: [] for key in keys}
    for r in range(cfg["repeats"]):  # rotate the order so that no run always follows the same one
        order = keys[r % len(keys) :] + keys[: r % len(keys)]
        for key in order if r % 2 == 0 else order[::-1]:
            model, static = fns[key]
            runs[key].append(run_once(model, prompts, new, static))
    seen = replay(mod, prompts, new)
    dense_seen = replay(dense, prompts, new)
    flop_bound = dense_seen["flops"] / seen["flops"]
    bytes_bound = dense_seen["bytes"] / seen["bytes"]
    greedy = generate(mod, prompts, new, temperature=0)
    rows = []
    decode_tokens = B * (new - 1)
    for path in paths:
        m, dn = runs[("mod", path)], runs[("dense", path)]
        # sanity: the timed loop gives what generate() gives, and both paths give the same tokens
        assert m[-1]["tokens"] == generate(mod, prompts, new, temperature=0, static_cache=path == "static") == greedy
        med = {
            name: {k: statistics.median(x[k] for x in rs) for k in ("prefill_s", "decode_s", "decode_cpu_s")}
            for name, rs in (("mod", m), ("dense", dn))
        }
        speedups = [d["decode_s"] / x["decode_s"] for x, d in zip(m, dn)]
        cpu_speedups = [d["decode_cpu_s"] / x["decode_cpu_s"] for x, d in zip(m, dn)]
        prefill_speedups = [d["prefill_s"] / x["prefill_s"] for x, d in zip(m, dn)]
        mod_bytes, dense_bytes = cache_bytes(mod, m[-1]["caches"]), cache_bytes(dense, dn[-1]["caches"])
        row = dict(
            size=cfg["size"],
            d_model=cfg["d_model"],
            n_layers=cfg["n_layers"],
            path=path,
            batch=B,
            prompt=cfg["prompt"],
            new_tokens=new,
            mod_decode_tok_s=decode_tokens / med["mod"]["decode_s"],
            dense_decode_tok_s=decode_tokens / med["dense"]["decode_s"],
            decode_speedup=statistics.median(speedups),
            decode_speedup_min=min(speedups),
            decode_speedup_max=max(speedups),
            decode_speedup_cpu=statistics.median(cpu_speedups),
            flop_bound=flop_bound,
            bytes_bound=bytes_bound,
            mod_decode_ms_per_step=1e3 * med["mod"]["decode_s"] / (new - 1),
            dense_decode_ms_per_step=1e3 * med["dense"]["decode_s"] / (new - 1),
            prefill_speedup=statistics.median(prefill_speedups),
            mod_kv_bytes=mod_bytes,
            dense_kv_bytes=dense_bytes,
            kv_bytes_ratio=mod_bytes / dense_bytes,
            routed_fraction_decode=statistics.mean(v["decode_routed_fraction"] for v in seen["layers"].values()),
            routed_fraction_prefill=statistics.mean(v["prefill_routed_fraction"] for v in seen["layers"].values()),
            block_ran_fraction_decode=statistics.mean(v["decode_steps_block_ran"] for v in seen["layers"].values()),
            per_layer=seen["layers"],
            mod_decode_flops=seen["flops"],
            dense_decode_flops=dense_seen["flops"],
            mod_decode_bytes=seen["bytes"],
            dense_decode_bytes=dense_seen["bytes"],
            mod_decode_s=[x["decode_s"] for x in m],
            dense_decode_s=[x["decode_s"] for x in dn],
            mod_decode_cpu_s=[x["decode_cpu_s"] for x in m],
            dense_decode_cpu_s=[x["decode_cpu_s"] for x in dn],
        )
        print(
            f"  {cfg['size']} batch {B} {path}: decode speedup {row['decode_speedup']:.2f}x (cpu "
            f"{row['decode_speedup_cpu']:.2f}x; FLOP bound {flop_bound:.2f}x, bytes bound {bytes_bound:.2f}x)  "
            f"routed {row['routed_fraction_decode']:.3f}",
            file=sys.stderr,
            flush=True,
        )
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small shapes and few repeats (smoke test)")
    p.add_argument("--sizes", default=None, help=f"comma-separated, of {', '.join(SIZES)} (default: base,deep)")
    p.add_argument("--paths", default=",".join(PATHS), help="comma-separated decode paths (default: dynamic,static)")
    p.add_argument(
        "--out",
        default=None,
        help="JSON path (default benchmarks/results/decode.json, or decode_quick.json with --quick)",
    )
    p.add_argument("--repeats", type=int, default=None, help="timed rounds per batch size (after warm-up)")
    p.add_argument("--warmup", type=int, default=None, help="untimed rounds per batch size")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads(N) before timing; 0 leaves torch's default (default: 1, see the module doc)",
    )
    p.add_argument("--seed", type=int, default=0)
    add_device_arg(p)
    args = p.parse_args(argv)

    base = dict(QUICK if args.quick else FULL)
    sizes = base["sizes"] if args.sizes is None else tuple(s.strip() for s in args.sizes.split(","))
    paths = tuple(s.strip() for s in args.paths.split(","))
    for s in sizes:
        if s not in SIZES:
            raise SystemExit(f"--sizes: {s!r} must be one of {', '.join(SIZES)}")
    for s in paths:
        if s not in PATHS:
            raise SystemExit(f"--paths: {s!r} must be one of {', '.join(PATHS)}")
    if args.repeats is not None and args.repeats < 1:
        raise SystemExit(f"--repeats={args.repeats}: must be >= 1")
    if args.threads < 0:
        raise SystemExit(f"--threads={args.threads}: must be >= 0 (0: torch's default)")
    if args.threads:
        torch.set_num_threads(args.threads)
    out = args.out or str(ROOT / "benchmarks" / "results" / ("decode_quick.json" if args.quick else "decode.json"))

    info = machine_info(args.device)
    print(
        f"torch {info['torch']}, {info['torch_threads']} threads, {info['cpu_count']} CPUs, device {args.device} "
        f"({info['device_name']})",
        file=sys.stderr,
    )
    rows, configs = [], {}
    t_start = time.perf_counter()
    for size in sizes:
        cfg = {**base, **SIZES[size], "size": size}
        for key in ("repeats", "warmup"):
            if getattr(args, key) is not None:
                cfg[key] = getattr(args, key)
        configs[size] = {k: v for k, v in cfg.items() if k != "sizes"}
        mod, dense = build(cfg, True, args.seed, args.device), build(cfg, False, args.seed, args.device)
        prompts_all = text_windows(max(cfg["batches"]), cfg["prompt"], args.seed).tolist()
        calibrate(mod, text_windows(8, cfg["prompt"] + cfg["new"], args.seed + 1), CAPACITY)  # a first guess
        for B in cfg["batches"]:
            calibrate_on_own_decode(mod, prompts_all[:B], cfg["new"], CAPACITY)
            rows += bench_batch(mod, dense, prompts_all[:B], cfg, paths)
    if hasattr(os, "getloadavg"):
        info["loadavg_1_5_15_at_end"] = [round(v, 2) for v in os.getloadavg()]
    print()
    print_table(
        rows,
        [
            ("size", "size", "s"),
            ("batch", "batch", "d"),
            ("path", "path", "s"),
            ("mod_decode_tok_s", "MoD tok/s", ".1f"),
            ("dense_decode_tok_s", "dense tok/s", ".1f"),
            ("decode_speedup", "speedup", ".2f"),
            ("decode_speedup_min", "min", ".2f"),
            ("decode_speedup_max", "max", ".2f"),
            ("decode_speedup_cpu", "cpu", ".2f"),
            ("flop_bound", "FLOP bnd", ".2f"),
            ("bytes_bound", "bytes bnd", ".2f"),
            ("kv_bytes_ratio", "KV bytes", ".3f"),
            ("routed_fraction_decode", "routed", ".3f"),
            ("block_ran_fraction_decode", "block ran", ".3f"),
        ],
    )
    payload = dict(
        benchmark="bench_decode",
        command=" ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
        config={
            "sizes": configs,
            "capacity": CAPACITY,
            "mod_layers": "every other block (1, 3, ...)",
            "causal": "predictor",
            "mlp_hidden": "4 * d_model",
            "vocab_size": 256,
            "paths": list(paths),
        },
        device=str(args.device),
        dtype="float32",
        machine=info,
        wall_s=round(time.perf_counter() - t_start, 1),
        notes=(
            "speedup = dense decode time / MoD decode time on the same path, median of rotating interleaved "
            "rounds (cpu: the same in process CPU time); tok/s = batch * (new_tokens - 1) decode-step tokens / "
            "median decode time. FLOP bound and bytes bound: dense / MoD decode FLOPs and bytes read, from a "
            "replay of the same greedy run (module doc). routed = fraction of decode tokens the MoD layers sent "
            "through their block (target: capacity), after calibrating the untrained predictors' bias; block "
            "ran = fraction of (layer, step) pairs where at least one row routed. KV bytes = MoD / dense bytes "
            "held in the caches after the run. The static path runs every block on every row (MoD saves cache "
            "writes, not compute): on a CPU its MoD model is slower than dense by design."
        ),
        results=rows,
    )
    path = write_json(out, payload)
    print(f"\nwrote {path}", file=sys.stderr)
    return payload


if __name__ == "__main__":
    main()

"""Decode benchmark: KV-cached sampling speed of an MoD LM against the dense LM of the same shape.

    PYTHONPATH=. python benchmarks/bench_decode.py            # default run (a few minutes on 2 CPU cores)
    PYTHONPATH=. python benchmarks/bench_decode.py --quick    # smoke run, small shapes, seconds
    PYTHONPATH=. python benchmarks/bench_decode.py --device cuda   # on the GPU (cuda:N, auto also work)

Models: decoder-only LMs with d_model 512, 8 layers, 8 heads, MLP hidden 4 * d_model, seq_len 1024,
byte vocabulary. The MoD LM routes every other block (layers 1, 3, 5, 7) with capacity 0.125 and
causal="predictor"; the dense LM has the same weights' shapes and no routers. Both are untrained.

Routing regime. An untrained predictor sends ~all or ~no tokens through its block, which would measure
nothing useful. So each MoD layer's predictor output bias is set to the (1 - capacity) quantile of its
logits (layer by layer, with causal routing): first on text windows, then, for each batch size, on the
positions decoding actually feeds the model, i.e. the greedy continuation of that batch's prompts (three
rounds, since the continuation depends on the routing). The routed fraction the timed decode actually sees
is measured (greedy decoding is deterministic, so an instrumented replay sees exactly the timed run's
routing) and reported, per layer in the JSON.

Timing. Prompts of 128 bytes of the Python standard library's sources, then 128 new tokens, greedy
(temperature 0), at batch 1 and batch 8. One repeat = prefill + decode for the MoD and the dense model,
in alternating order; after warm-up, the reported numbers are medians over repeats and the speedup is the
median of per-repeat ratios (dense time / MoD time). "decode" counts the tokens fed by the 127
``decode_step`` calls (the first new token comes from the prefill's logits); prefill is timed apart.

Threads: one intra-op thread by default (``--threads 0`` keeps torch's default). Decoding at batch <= 8
is a chain of small, latency-bound ops; on a small shared machine a second intra-op thread mostly spins
and waits for a core (on the 2 shared cores this was written on, the dense model fell from ~90 to ~7
tokens/s at batch 1 and repeat-to-repeat ratios ranged 1.4x-21x), which measures the machine's load,
not the models.

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

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere without installing
    sys.path.insert(0, str(ROOT))

from benchmarks.common import add_device_arg, machine_info, print_table, sync, write_json  # noqa: E402
from mode.data import stdlib_corpus  # noqa: E402
from mode.layers.mod import MoD  # noqa: E402
from mode.model import LM, LMConfig, alternate  # noqa: E402
from mode.model.generate import decode_step, generate, prefill  # noqa: E402

FULL = dict(d_model=512, n_layers=8, n_heads=8, seq_len=1024, prompt=128, new=128, batches=(1, 8),
            warmup=1, repeats=7)
QUICK = dict(d_model=128, n_layers=4, n_heads=4, seq_len=256, prompt=32, new=32, batches=(1, 4),
             warmup=1, repeats=3)
CAPACITY = 0.125


def build(cfg: dict, mod: bool, seed: int, device: torch.device) -> LM:
    torch.manual_seed(seed)
    kind = "mod" if mod else "dense"
    lcfg = LMConfig(vocab_size=256, seq_len=cfg["seq_len"], d_model=cfg["d_model"], n_heads=cfg["n_heads"],
                    d_hidden=4 * cfg["d_model"], layers=alternate(cfg["n_layers"], "dense", kind),
                    capacity=CAPACITY, causal="predictor" if mod else "none")
    return LM(lcfg).eval().to(device)


def text_windows(n: int, length: int, seed: int) -> torch.Tensor:
    """``n`` windows of ``length`` bytes from the standard library's sources, at seeded random offsets."""
    data = torch.from_numpy(stdlib_corpus(max_bytes=2_000_000).train.astype("int64"))
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - length, (n,), generator=g)
    return data[starts[:, None] + torch.arange(length)]


@torch.no_grad()
def calibrate(model: LM, x_BS: torch.Tensor, fraction: float, start: int = 0) -> None:
    """Set each predictor's output bias so that ``fraction`` of the tokens of ``x_BS`` at positions >= ``start``
    route under causal routing (layer by layer: a layer's input depends on the routing before it)."""
    x_BS = x_BS.to(model.embed.weight.device)
    for i, layer in enumerate(model.layers):
        if not isinstance(layer, MoD):
            continue
        seen = []
        hook = layer.register_forward_pre_hook(lambda m, args, kwargs: seen.append(args[0]), with_kwargs=True)
        model(x_BS, causal_routing=True)
        hook.remove()
        router = layer.router
        logits = router.decision_logits(seen[0], router.scores(seen[0]))[:, start:].flatten()
        router.predictor[-1].bias -= torch.quantile(logits.double(), 1 - fraction).float()


@torch.no_grad()
def calibrate_on_own_decode(model: LM, prompts: list[list[int]], new: int, fraction: float, rounds: int = 3) -> None:
    """Calibrate on the positions decoding will feed: the prompts' greedy continuation. The continuation
    depends on the routing, so repeat a few rounds (it settles quickly; the fraction seen is reported)."""
    for _ in range(rounds):
        cont = generate(model, prompts, new, temperature=0)
        calibrate(model, torch.tensor([p + c for p, c in zip(prompts, cont)]), fraction, start=len(prompts[0]))


@torch.no_grad()
def run_once(model: LM, prompts: list[list[int]], new: int) -> dict:
    """Greedy prefill + decode exactly as ``generate(temperature=0)`` does it, timed per phase."""
    device = model.embed.weight.device
    sync(device)  # on a GPU the clock must not start while earlier work is still queued
    t0 = time.perf_counter()
    logits_BV, caches, pos_B = prefill(model, prompts, max(map(len, prompts)) + new)
    sync(device)
    t1 = time.perf_counter()
    out = []
    for step in range(new):
        next_B = logits_BV.argmax(-1)
        out.append(next_B)
        if step == new - 1:
            break
        logits_BV = decode_step(model, next_B, pos_B, caches)
        pos_B = pos_B + 1
    sync(device)
    t2 = time.perf_counter()
    return dict(prefill_s=t1 - t0, decode_s=t2 - t1, tokens=torch.stack(out, 1).tolist(), caches=caches)


def cache_bytes(model: LM, caches) -> int:
    d, elem = model.cfg.d_model, model.embed.weight.element_size()
    return sum(int(c.len_B.sum()) * 2 * d * elem for c in caches)


@torch.no_grad()
def routed_fraction_seen(model: LM, prompts: list[list[int]], new: int) -> dict:
    """Replay the (deterministic) greedy run with hooks: per MoD layer, the fraction of decode-step
    tokens routed, and the fraction of decode steps in which the block ran for at least one row."""
    # per MoD layer: [routed tokens, tokens, steps the block ran, router calls]
    counts = {i: [0, 0, 0, 0] for i, layer in enumerate(model.layers) if isinstance(layer, MoD)}
    phase = {"decode": False}

    def router_hook(i):
        def hook(mod, args, plan):
            if phase["decode"]:
                st = plan.aux.stats["router"]
                counts[i][0] += int(st.kept_E.sum())
                counts[i][1] += int(st.tokens)
                counts[i][3] += 1
        return hook

    def block_hook(i):
        def hook(mod, args, out):
            if phase["decode"]:
                counts[i][2] += 1
        return hook

    hooks = [model.layers[i].router.register_forward_hook(router_hook(i)) for i in counts]
    hooks += [model.layers[i].block.register_forward_hook(block_hook(i)) for i in counts]
    try:
        logits_BV, caches, pos_B = prefill(model, prompts, max(map(len, prompts)) + new)
        prefill_lens = {i: caches[i].len_B.float().mean().item() / max(map(len, prompts)) for i in counts}
        phase["decode"] = True
        for _ in range(new - 1):
            next_B = logits_BV.argmax(-1)
            logits_BV = decode_step(model, next_B, pos_B, caches)
            pos_B = pos_B + 1
    finally:
        for h in hooks:
            h.remove()
    return {f"layers.{i}": dict(decode_routed_fraction=c[0] / c[1], decode_steps_block_ran=c[2] / c[3],
                                prefill_routed_fraction=prefill_lens[i]) for i, c in counts.items()}


def bench_batch(mod: LM, dense: LM, prompts: list[list[int]], cfg: dict) -> dict:
    new = cfg["new"]
    B = len(prompts)
    for _ in range(cfg["warmup"]):
        run_once(mod, prompts, new)
        run_once(dense, prompts, new)
    runs: dict[str, list[dict]] = {"mod": [], "dense": []}
    for r in range(cfg["repeats"]):
        order = ("mod", "dense") if r % 2 == 0 else ("dense", "mod")  # alternate: neither side always goes first
        for name in order:
            res = run_once(mod if name == "mod" else dense, prompts, new)
            runs[name].append(res)
    decode_tokens = B * (new - 1)
    med = {name: {k: statistics.median(x[k] for x in rs) for k in ("prefill_s", "decode_s")}
           for name, rs in runs.items()}
    speedups = [d["decode_s"] / m["decode_s"] for m, d in zip(runs["mod"], runs["dense"])]
    prefill_speedups = [d["prefill_s"] / m["prefill_s"] for m, d in zip(runs["mod"], runs["dense"])]
    mod_bytes = cache_bytes(mod, runs["mod"][-1]["caches"])
    dense_bytes = cache_bytes(dense, runs["dense"][-1]["caches"])
    # sanity: the timed loop produces what the public generate() produces
    assert runs["mod"][-1]["tokens"] == generate(mod, prompts, new, temperature=0)
    seen = routed_fraction_seen(mod, prompts, new)
    row = dict(
        batch=B, prompt=cfg["prompt"], new_tokens=new,
        mod_decode_tok_s=decode_tokens / med["mod"]["decode_s"],
        dense_decode_tok_s=decode_tokens / med["dense"]["decode_s"],
        decode_speedup=statistics.median(speedups), decode_speedup_min=min(speedups),
        decode_speedup_max=max(speedups),
        mod_decode_ms_per_step=1e3 * med["mod"]["decode_s"] / (new - 1),
        dense_decode_ms_per_step=1e3 * med["dense"]["decode_s"] / (new - 1),
        prefill_speedup=statistics.median(prefill_speedups),
        mod_kv_bytes=mod_bytes, dense_kv_bytes=dense_bytes, kv_bytes_ratio=mod_bytes / dense_bytes,
        routed_fraction_decode=statistics.mean(v["decode_routed_fraction"] for v in seen.values()),
        routed_fraction_prefill=statistics.mean(v["prefill_routed_fraction"] for v in seen.values()),
        block_ran_fraction_decode=statistics.mean(v["decode_steps_block_ran"] for v in seen.values()),
        per_layer=seen,
        mod_decode_s=[x["decode_s"] for x in runs["mod"]], dense_decode_s=[x["decode_s"] for x in runs["dense"]],
    )
    print(f"  batch {B}: decode speedup {row['decode_speedup']:.2f}x  routed {row['routed_fraction_decode']:.3f}",
          file=sys.stderr, flush=True)
    return row


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small shapes and few repeats (smoke test)")
    p.add_argument("--out", default=None,
                   help="JSON path (default benchmarks/results/decode.json, or decode_quick.json with --quick)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per batch size (after warm-up)")
    p.add_argument("--warmup", type=int, default=None, help="untimed repeats per batch size")
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads(N) before timing; 0 leaves torch's default (default: 1, see the "
                        "module doc)")
    p.add_argument("--seed", type=int, default=0)
    add_device_arg(p)
    args = p.parse_args(argv)

    cfg = dict(QUICK if args.quick else FULL)
    for key in ("repeats", "warmup"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    if cfg["repeats"] < 1:
        raise SystemExit(f"--repeats={cfg['repeats']}: must be >= 1")
    if args.threads < 0:
        raise SystemExit(f"--threads={args.threads}: must be >= 0 (0: torch's default)")
    if args.threads:
        torch.set_num_threads(args.threads)
    out = args.out or str(ROOT / "benchmarks" / "results" / ("decode_quick.json" if args.quick else "decode.json"))

    info = machine_info(args.device)
    print(f"torch {info['torch']}, {info['torch_threads']} threads, {info['cpu_count']} CPUs, device {args.device} "
          f"({info['device_name']})", file=sys.stderr)
    mod, dense = build(cfg, True, args.seed, args.device), build(cfg, False, args.seed, args.device)
    prompts_all = text_windows(max(cfg["batches"]), cfg["prompt"], args.seed).tolist()
    calibrate(mod, text_windows(8, cfg["prompt"] + cfg["new"], args.seed + 1), CAPACITY)  # a first guess
    rows = []
    for B in cfg["batches"]:
        calibrate_on_own_decode(mod, prompts_all[:B], cfg["new"], CAPACITY)
        rows.append(bench_batch(mod, dense, prompts_all[:B], cfg))
    if hasattr(os, "getloadavg"):
        info["loadavg_1_5_15_at_end"] = [round(v, 2) for v in os.getloadavg()]
    print()
    print_table(rows, [("batch", "batch", "d"), ("mod_decode_tok_s", "MoD tok/s", ".1f"),
                       ("dense_decode_tok_s", "dense tok/s", ".1f"), ("decode_speedup", "speedup", ".2f"),
                       ("decode_speedup_min", "min", ".2f"), ("decode_speedup_max", "max", ".2f"),
                       ("prefill_speedup", "prefill x", ".2f"), ("kv_bytes_ratio", "KV bytes", ".3f"),
                       ("routed_fraction_decode", "routed", ".3f"),
                       ("block_ran_fraction_decode", "block ran", ".3f")])
    payload = dict(
        benchmark="bench_decode",
        command=" ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
        config={**cfg, "capacity": CAPACITY, "mod_layers": "every other block (1, 3, ...)", "causal": "predictor",
                "mlp_hidden": 4 * cfg["d_model"], "vocab_size": 256},
        device=str(args.device), dtype="float32", machine=info,
        notes=("speedup = dense decode time / MoD decode time, median of interleaved repeats; tok/s = "
               "batch * (new_tokens - 1) decode-step tokens / median decode time. routed = fraction of decode "
               "tokens the MoD layers sent through their block (target: capacity), after calibrating the "
               "untrained predictors' bias; block ran = fraction of (layer, step) pairs where at least one row "
               "routed. KV bytes = MoD / dense bytes held in the caches after the run."),
        results=rows)
    path = write_json(out, payload)
    print(f"\nwrote {path}", file=sys.stderr)
    return payload


if __name__ == "__main__":
    main()

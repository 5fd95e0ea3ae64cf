"""MoD conversions of a pretrained transformers model, measured honestly: which part to skip, top-k against
threshold routing, router tuning alone against router tuning plus a short full fine-tune, and MoDE
(upcycling plus MoD). Prints a table, writes JSON (one row at a time, atomically: a killed run resumes
where it stopped) and Markdown.

    PYTHONPATH=. python examples/hf_pretrain.py --out runs/llama_bytes --threads 2
    PYTHONPATH=. python benchmarks/hf/hf_mod_pretrained.py --model runs/llama_bytes --threads 2

For each capacity (0.75 / 0.5 / 0.25), each part the router skips (``layer`` / ``attention`` / ``mlp``) and
each causal method (``topk``: the aux-BCE decision trained to predict top-C, its threshold steered to the
target share; ``threshold``: MoDification's steered threshold on the router score; ``random``: the
baseline, each sequence's top-C drawn at random, untuned, routed in train mode: no decode), a fresh copy of the
model is converted (gate "ste") on the layers of each ``--layer-sets`` entry (default: every other layer;
``cheapest:K``: the K layers whose part costs the least loss when every token skips it, ``mh.skip_costs`` on
training text, printed and stored first), router-tuned for ``--steps`` steps (distillation from
the original, the base frozen: the ``router`` row), then fine-tuned whole for ``--steps`` more steps (LM
loss, AdamW and schedule of ``mode.train``: the ``+fine-tune`` row). Each row is measured on held-out
files of the corpus (``mode.train.data``'s validation split), in eval mode, i.e. with the causal decision
that ``generate()`` uses, its thresholds calibrated first on 8 training batches (``mh.calibrate``). Every
conversion here keeps ``kv="routed"`` (the sparse cache; the results files were measured so), not the
default ``"all"`` that benchmarks/hf/hf_mod_smollm2.py found better on a real model:

    loss, d loss      mean next-byte loss (nats/byte) and its change against the original (nats, %)
    share             the fraction of real tokens the converted layers route (target: the capacity)
    KV ÷ orig         K/V bytes the converted layers' caches store after ``generate()``, ÷ the original's
    tok/s ÷ orig      greedy decode speed ÷ the original's, timed alternately in the same run (median)

``--mode`` rows: staged MoDE (the MLPs of the converted layers upcycled to a top-1 MoE of copies, then MoD
around the layer) and integrated MoDE (upcycled experts plus no-op experts: a token routed to a no-op
skips the MLP), fine-tuned whole for ``2 * --steps`` steps like the ``+fine-tune`` rows.

Shape legend: B batch, S sequence.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere without installing
    sys.path.insert(0, str(ROOT))

import mode.hf as mh  # noqa: E402
from mode.hf.dense.convert import resolve_layers  # noqa: E402
from mode.hf.dense.tune import lm_loss  # noqa: E402
from mode.train.checkpoint import atomic_write_text  # noqa: E402
from mode.train.config import TrainConfig  # noqa: E402
from mode.train.data import BatchSampler, eval_batches, stdlib_corpus  # noqa: E402
from mode.train.optim import build_optimizer, lr_at  # noqa: E402

PARTS = ("layer", "attention", "mlp")
METHODS = {"topk": "aux_bce", "threshold": "threshold", "random": None}  # causal method; random: no router


def held_out_loss(model, batches) -> tuple[float, float]:
    """Mean loss over ``batches`` in eval mode (causal routing) and the converted layers' routed share."""
    model.eval()
    losses, routed, tokens = [], 0.0, 0.0
    has_mod = bool(mh.mod_layers(model))
    with torch.no_grad():
        for x_BS in batches:
            losses.append(float(lm_loss(model(x_BS, use_cache=False).logits, x_BS, None)))
            for key, stats in mh.collect_aux(model).stats.items():
                if key.endswith(".mod.router"):  # MoD: tokens through the layer
                    routed += float(stats.kept_E.sum())
                    tokens += float(stats.tokens)
                elif key.endswith(".moe.router") and not has_mod:  # integrated: to a real expert
                    routed += float(stats.tokens - stats.noop)
                    tokens += float(stats.tokens)
    return sum(losses) / len(losses), (routed / tokens if tokens else 1.0)


def kv_bytes(cache, layers: list[int]) -> int:
    """K/V bytes stored by ``layers`` of a cache after ``generate()``: a MoD layer's stored rows (``len_B``),
    a dense layer's every row (its padding to the widest row is not counted for either)."""
    total = 0
    for i in layers:
        layer = cache.layers[i]
        per_token = (
            layer.keys.shape[1] * layer.keys.shape[3] + layer.values.shape[1] * layer.values.shape[3]
        ) * layer.keys.element_size()
        stored = (
            int(layer.len_B.sum()) if isinstance(layer, mh.MoDCacheLayer) else layer.keys.shape[0] * layer.keys.shape[2]
        )
        total += stored * per_token
    return total


def decode(model, prompt_BS, new: int):
    model.eval()
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


def decode_ratio(model, original, prompt_BS, new: int, repeats: int) -> float:
    """Greedy decode tokens/s of ``model`` ÷ ``original``'s, timed alternately (median of ``repeats``)."""
    times: dict[str, list[float]] = {"model": [], "original": []}
    for m in (model, original):  # warm-up
        decode(m, prompt_BS, 4)
    for _ in range(repeats):
        for name, m in (("original", original), ("model", model)):
            start = time.perf_counter()
            decode(m, prompt_BS, new)
            times[name].append(time.perf_counter() - start)
    return statistics.median(times["original"]) / statistics.median(times["model"])


def fine_tune(model, sampler: BatchSampler, steps: int, lr: float, routers_only: bool, teacher=None) -> list[float]:
    """``steps`` steps of the LM loss plus the routers' own losses: the routers only (the base frozen; the
    objective is then distillation from the unconverted model, ``mh.router_tune``), or the whole model
    (``mode.train``'s AdamW, warm-up and cosine decay)."""
    if routers_only:
        batches = (sampler.next()[0] for _ in range(steps))
        return [
            h["loss"] for h in mh.router_tune(model, batches, steps=steps, lr=lr, objective="distill", teacher=teacher)
        ]
    for p in model.parameters():
        p.requires_grad_(True)
    cfg = TrainConfig(steps=steps, batch_size=sampler.batch_size, lr=lr, warmup_steps=max(1, steps // 10))
    opt = build_optimizer(model, cfg)
    model.train()
    losses = []
    for step in range(steps):
        x_BS, _ = sampler.next()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss = lm_loss(model(x_BS, use_cache=False).logits, x_BS, None)
        total = loss + mh.collect_aux(model).total()
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def measure(
    name: str,
    model,
    original,
    base: dict,
    val,
    prompt_BS,
    args,
    layers: list[int],
    orig_kv: int,
    extra: dict,
    calibration: list,
) -> dict:
    if any(layer.mod_router.steers for layer in mh.mod_layers(model).values()):
        mh.calibrate(model, calibration)  # thresholds from training text: the EMA lags a router still moving
    loss, share = held_out_loss(model, val)
    out = decode(model, prompt_BS, args.new_tokens)
    row = loss_row(name, extra, base, loss, share)
    row["kv_ratio"] = kv_bytes(out.past_key_values, layers) / orig_kv
    row["tok_s_ratio"] = decode_ratio(model, original, prompt_BS, args.new_tokens, args.repeats)
    print(f"KV {row['kv_ratio']:.3f} tok/s {row['tok_s_ratio']:.2f}x", flush=True)
    return row


def loss_row(name: str, extra: dict, base: dict, loss: float, share: float) -> dict:
    """A row's loss, its change against the original and the routed share (printed, the line left open)."""
    row = {
        "name": name,
        **extra,
        "loss": loss,
        "d_loss": loss - base["loss"],
        "d_loss_pct": 100 * (loss - base["loss"]) / base["loss"],
        "share": share,
        "kv_ratio": None,
        "tok_s_ratio": None,
    }
    print(
        f"{name:<44} loss {loss:.4f} ({row['d_loss']:+.4f}, {row['d_loss_pct']:+.1f}%) share {share:.3f} ",
        end="",
        flush=True,
    )
    return row


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a local transformers checkpoint (examples/hf_pretrain.py)")
    p.add_argument("--capacities", type=float, nargs="+", default=[0.75, 0.5, 0.25])
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument(
        "--layer-sets",
        nargs="+",
        default=["every_other"],
        help="which layers to convert: every_other (1, 3, 5, ...), cheapest:K (the K layers whose part "
        "costs least when skipped by every token, mh.skip_costs on training text) or 1,3,5",
    )
    p.add_argument("--steps", type=int, default=40, help="router-tuning steps, and as many fine-tuning steps")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--router-lr", type=float, default=3e-3)
    p.add_argument("--ft-lr", type=float, default=3e-4)
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--mode", action="store_true", help="also staged and integrated MoDE (upcycling + MoD)")
    p.add_argument("--mode-capacity", type=float, default=0.5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="benchmarks/results/hf_mod_pretrained.json")
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    original = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True).eval()
    for p_ in original.parameters():
        p_.requires_grad_(False)
    n_layers = original.config.num_hidden_layers
    every_other = resolve_layers("every_other", n_layers)  # 1, 3, 5, ...: the first layer dense
    corpus = stdlib_corpus()
    val = [x_BS for x_BS, _ in eval_batches(corpus.val, args.batch, args.seq_len, args.val_batches)]
    prompt_BS = val[0][:4, :128]
    calibration = [BatchSampler(corpus.train, args.batch, args.seq_len, seed=2).next()[0] for _ in range(8)]

    out_path = Path(args.out)
    done = json.loads(out_path.read_text()) if out_path.is_file() else {"rows": []}
    # what a row's numbers depend on (the grid's selection does not: rows of another selection are kept)
    settings = {
        k: v
        for k, v in vars(args).items()
        if k not in ("out", "threads", "capacities", "parts", "methods", "layer_sets", "mode", "mode_capacity")
    }
    settings["model"] = Path(args.model).name  # the checkpoint folder's name: a results file resumes from any path
    stored = done.get("settings", settings)
    stored = {**stored, "model": Path(stored["model"]).name}
    if {k: stored.get(k) for k in settings} != settings:
        raise ValueError(f"{out_path} holds rows measured with other settings ({stored}); pass another --out")
    rows = {r["name"]: {**r, "layers": r.get("layers", every_other)} for r in done["rows"]}

    def save() -> None:
        doc = {
            "settings": settings,
            "device": "cpu",
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "base": base,
            "skip_costs": costs,
            "rows": list(rows.values()),
        }
        atomic_write_text(out_path, json.dumps(doc, indent=2) + "\n")

    base_loss, _ = held_out_loss(original, val)
    orig_cache = decode(original, prompt_BS, args.new_tokens).past_key_values
    base = {"loss": base_loss, "kv": kv_bytes(orig_cache, every_other)}
    print(f"original: held-out loss {base_loss:.4f} nats/byte", flush=True)
    # what each layer's part costs when every token skips it (training text: the layers are chosen on it)
    costs = done.get("skip_costs") or {
        part: {str(i): c for i, c in mh.skip_costs(original, calibration, part).items()} for part in PARTS
    }
    print("skip cost (nats/byte) per layer, every token skipping it:", flush=True)
    for part, by_layer in costs.items():
        print(f"  {part:<9} " + " ".join(f"{i}:{c:+.3f}" for i, c in by_layer.items()), flush=True)

    def layer_set(spec: str, part: str) -> tuple[list[int], str]:
        """The converted layers of ``spec`` and the suffix it adds to a row's name ('' for every_other)."""
        if spec == "every_other":
            return every_other, ""
        if spec.startswith("cheapest:"):
            chosen = mh.cheapest({int(i): c for i, c in costs[part].items()}, int(spec.split(":")[1]))
        else:
            chosen = resolve_layers([int(i) for i in spec.split(",")], n_layers)
        return chosen, f" layers={spec}"

    def run_random(name: str, capacity: float, part: str, extra: dict, layers: list[int]) -> None:
        """The baseline a router must beat: each sequence's top-C drawn uniformly at random, no tuning (train-
        mode routing, which picks exactly C per sequence; a random choice needs no causal decision)."""
        if name in rows:
            return
        torch.manual_seed(0)
        model = mh.to_mod(
            copy.deepcopy(original),
            layers=layers,
            capacity=capacity,
            gate="ste",
            causal="threshold",
            part=part,
            kv="routed",
        )
        for layer in mh.mod_layers(model).values():
            layer.mod_router.cfg = dataclasses.replace(layer.mod_router.cfg, selection="random")
        with mh.routing(model, "topk"):
            loss, share = held_out_loss(model, val)
        rows[name] = loss_row(name, {**extra, "layers": layers, "tuning": "none"}, base, loss, share)
        print(flush=True)
        save()

    def run(name: str, build, extra: dict, tune_steps: int, layers: list[int]) -> None:
        names = [f"{name} router", f"{name} +fine-tune"] if tune_steps else [f"{name} +fine-tune"]
        if all(n in rows for n in names):
            return
        orig_kv, extra = kv_bytes(orig_cache, layers), {**extra, "layers": layers}
        torch.manual_seed(0)
        model = build(copy.deepcopy(original))
        sampler = BatchSampler(corpus.train, args.batch, args.seq_len, seed=1)
        if tune_steps:
            fine_tune(model, sampler, tune_steps, args.router_lr, routers_only=True, teacher=original)
            rows[names[0]] = measure(
                names[0],
                model,
                original,
                base,
                val,
                prompt_BS,
                args,
                layers,
                orig_kv,
                {**extra, "tuning": "router"},
                calibration,
            )
            save()
            fine_tune(model, sampler, args.steps, args.ft_lr, routers_only=False)
        else:
            fine_tune(model, sampler, 2 * args.steps, args.ft_lr, routers_only=False)
        rows[names[-1]] = measure(
            names[-1],
            model,
            original,
            base,
            val,
            prompt_BS,
            args,
            layers,
            orig_kv,
            {**extra, "tuning": "router+fine-tune"},
            calibration,
        )
        save()

    if args.mode:  # MoDE rows first: the grid below is the longer part
        c = args.mode_capacity
        run(
            f"staged MoDE c={c} (4 experts top-1)",
            lambda m: mh.to_mod(
                mh.upcycle(m, layers=every_other, num_experts=4, top_k=1),
                layers=every_other,
                capacity=c,
                gate="ste",
                causal="aux_bce",
                kv="routed",
            ),
            {"kind": "staged", "capacity": c},
            args.steps,
            every_other,
        )
        # integrated: 4 copies + 4 no-ops, top-1: a token picks a real expert or skips the MLP (attention runs)
        run(
            "integrated MoDE (4 experts + 4 no-op, top-1)",
            lambda m: mh.upcycle(m, layers=every_other, num_experts=4, top_k=1, num_noop=4),
            {"kind": "integrated", "capacity": None},
            0,
            every_other,
        )
    for spec in args.layer_sets:
        for capacity in args.capacities:
            for part in args.parts:
                layers, suffix = layer_set(spec, part)
                for method in args.methods:
                    extra = {"kind": "mod", "capacity": capacity, "part": part, "method": method}
                    if method == "random":
                        run_random(f"MoD c={capacity} part={part} random{suffix}", capacity, part, extra, layers)
                        continue
                    run(
                        f"MoD c={capacity} part={part} {method}{suffix}",
                        lambda m, c=capacity, pt=part, me=method, ls=layers: mh.to_mod(
                            m,
                            layers=ls,
                            capacity=c,
                            gate="ste",
                            causal=METHODS[me],
                            part=pt,
                            kv="routed" if pt != "mlp" else None,
                        ),
                        extra,
                        args.steps,
                        layers,
                    )
    save()
    table = table_markdown(base, list(rows.values()))
    print(table)
    md = out_path.with_suffix(".md")
    atomic_write_text(md, table)
    print(f"wrote {out_path} and {md}")
    return {"base": base, "rows": list(rows.values())}


def _num(value: float | None, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def table_markdown(base: dict, rows: list[dict]) -> str:
    lines = [
        f"original held-out loss {base['loss']:.4f} nats/byte",
        "",
        "| conversion | tuning | loss | Δ loss (nats, %) | share | KV ÷ orig | tok/s ÷ orig |",
        "|---|---|---|---|---|---|---|",
    ]
    kinds = {"mod": 0, "staged": 1, "integrated": 2}
    rows = sorted(
        rows,
        key=lambda r: (
            kinds[r["kind"]],
            len(r.get("layers", [])),
            str(r.get("layers")),
            -(r["capacity"] or 0),
            PARTS.index(r.get("part", "layer")),
            r.get("method", ""),
            ("none", "router").index(r["tuning"]) if r["tuning"] in ("none", "router") else 2,
        ),
    )
    for r in rows:
        lines.append(
            f"| {r['name'].rsplit(' ', 1)[0] if r['name'].endswith(('router', '+fine-tune')) else r['name']}"
            f" | {r['tuning']} | {r['loss']:.4f} | {r['d_loss']:+.4f} ({r['d_loss_pct']:+.1f}%) | "
            f"{r['share']:.3f} | {_num(r['kv_ratio'], '.3f')} | {_num(r['tok_s_ratio'], '.2f')} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

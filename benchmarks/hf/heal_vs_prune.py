"""MoD against layer pruning at equal compute, both healed with the same budget: the Pareto curve of issue 49.

    python scripts/fetch_smollm2.py                      # once: 98 MB into ~/.cache/mode/smollm2
    python benchmarks/hf/heal_vs_prune.py --threads 2    # SmolLM2-135M; long (see docs/results/heal_vs_prune.md)
    python benchmarks/hf/heal_vs_prune.py --smoke        # a tiny random Llama, 2 points, 1 seed: seconds

Model: SmolLM2-135M-Instruct (``mh.load_gguf(mh.fetch_smollm2())``, as ``hf_mod_smollm2.py``), or with
``--smoke`` a tiny random Llama (8 layers, hidden 64) reading bytes. Text: ``pydoc_data.topics``, every 4th
topic held out (``english_windows``). The conversion steps (block influence, the estimates' fit,
``skip_costs``, ``router_fit``, ``calibrate``) see the first ``--fit-windows`` training windows; healing reads
training windows in an order drawn by the seed (``heal_batches_of``), cycled when the budget is larger than the
375 of them (256 tokens); with ``--heal-text topics+docstrings`` every training window once and the rest of the
budget from the standard library's docstrings (``docstring_windows``: parsed, not run; no 13-gram of the
held-out windows occurs in them). Every loss is measured on ``--val-windows`` held-out windows that no
conversion step and no healing saw, in eval mode (the causal routing ``generate()`` uses).

Points: MACs per token ÷ the original's (``mode/hf/dense/macs.py``) in ``--macs``. At each point the pruned
model deletes the whole-layer count whose MACs come nearest the point, and every MoD conversion is planned
(``plan_to_macs``) to exactly the MACs that pruning reaches, so a MoD row and its pruning partner cost the
same compute. Methods (``--methods``):
    prune-bi         ``prune_layers(by="block_influence")`` (ShortGPT)
    prune-bi-est     the same layers, each replaced by a rank-``--est-rank`` fitted estimate (``estimate_rank``)
    prune-bi-est-all the same, healed with LoRA on every kept layer instead of the kept layer after each deleted
                     block: at least as many trainable parameters as a MoD row's adapters on its converted layers
                     (heal's default puts the pruned model's on 3 layers, a MoD model's on 13-14, on SmolLM2)
    prune-sc-est-all the layers whose deletion costs the least with their estimates standing in
                     (``prune_layers(by="skip_cost", estimate_rank=...)``), healed as prune-bi-est-all
    mod-layer-thr    ``to_mod(part="layer", causal="threshold")``: the router's logit against a threshold
                     steered to the capacity's share (MoDification)
    mod-layer-thr-est  the same with a rank-``--est-rank`` estimate of the skipped tokens' update
                     (``to_mod(skip_rank=...)``, fitted by ``router_fit``): MoD's counterpart of prune-bi-est
    mod-layer-thr-est-c0.4, mod-layer-thr-est-c0.3  the same at ``min_capacity`` 0.4 (0.3) whatever
                     ``--min-capacity`` says: fewer converted layers at a lower capacity for the same MACs
    mod-layer-thr-est-c0.4-all  the floor-0.4 plan healed with LoRA on every layer, not only the converted ones:
                     the counterpart of prune-bi-est-all
    mod-layer-thr-est-c0.4-all-sc  the same, with the layers ordered by their skip cost with the estimate
                     standing in (``skip_costs(estimate_rank=...)``): prune-sc-est-all's counterpart
    mod-layer-thr-est-c0.4-all-sc-res  and with the routers fitted to the tokens the estimate misses most
                     (``router_fit(label="residual")``)
    mod-layer-thr-est-c0.4-all-sc-res-cd  and with the causal thresholds calibrated on stdlib docstring windows
                     instead of the fit windows (text unlike the fit text: the residual router routes more there)
    mod-layer-bce    ``to_mod(part="layer", causal="aux_bce")``: the paper's top-C router whose causal decision
                     is learned by the auxiliary BCE loss
    mod-attn-thr     ``part="attention"`` (``kv="all"``), threshold router
    mod-mlp-thr      ``part="mlp"``, threshold router
    mod-mix-thr      ``part="mixed"``: attention halves in some layers, MLP halves in others, taken by loss per
                     multiply-add saved (``mixed_order`` of both halves' ``skip_costs``), threshold routers
    mod-mix-thr-est  the same with a rank-``--est-rank`` estimate per skipped half
    mod-mix-thr-est-c0.4-all-res-cd  the halves mixed with the best whole-layer row's other choices: floor 0.4,
                     LoRA on every layer, the residual label, thresholds calibrated on docstrings
    mod-mix-thr-est-c0.4-all-sc-res-cd  the same with each half ranked by its skip cost with its estimate
                     standing in (``skip_costs(part, estimate_rank=...)``), as the whole layers of the best row
Every MoD row also reports the held-out loss under top-C routing (``routing(model, "topk")``: what healing
trains with; it looks at the whole window, so it cannot decode): the top-k vs threshold comparison of the same
healed model. MoD layers: ``plan_to_macs(order=...)`` takes layers cheapest first by ``skip_costs`` of the part,
at one capacity of at least ``--min-capacity`` (the mixed rows: (layer, half) units in ``mixed_order``, a layer
whose two halves are both taken skipping as a whole). A point a part cannot reach at ``--min-capacity`` gets a
row saying so.

Healing: ``heal(HealConfig(steps=--heal-steps, lr=--heal-lr, rank=--lora-rank, objective="distill"))`` with
``--heal-tokens`` tokens per step (whole windows): LoRA on the healed layers plus the estimates; the MoD routers
stay as fitted (``--router-lr 0``, the default: AdamW's ~lr steps would rewrite a fitted router's small weights;
a positive value trains them at that rate); the teacher is the original. Per seed every method reads the
same batches in the same order, and each MoD row asserts ``report.same_budget(partner)`` against the pruning
rows of its point and seed (steps, real tokens, batch digest, objective, kind of trainable); both trainable
counts are recorded, not forced equal.
Then ``merge_lora`` (exact; the adapters' hooks would slow decoding) and the thresholds recalibrated on the
fit windows.

Default budget: 100 steps of 1024 tokens (4 windows of 256) per heal. An **estimate**, not a measurement:
the smoke model's timings are overhead-bound and do not scale to 135M parameters, so the estimate comes from
the nearest SmolLM2 timing there is, ``router_tune(objective="distill")`` in docs/results/mod_smollm2.md: 24
steps of 1024 tokens in 2.5 minutes on 2 cores, at most ~12.5 CPU-seconds a step (a forward of the teacher, a
forward and a backward through the whole model). Rank-8 LoRA on the 7 projections of a layer adds ~2% of that layer's
multiply-adds, and at the 0.85 point the healed model does 15% fewer, so a step is taken as 12.5-15
CPU-seconds and 100 steps as ~21-25 CPU-minutes, under the issue's 30. Each row records the ``cpu_seconds``
its heal spent: check the first rows of a real run and adjust ``--heal-steps``.

Columns: Δ loss (% of the original's held-out loss) before and after healing, mean ± std over seeds (paired:
seed s gives every method the same healing batches and LoRA initialisation); MACs ÷ orig (planned, and at the
share causal routing measured on the held-out windows); decode (and prefill) tokens/s ÷ the original's at
batch 1 and 8 on one thread, ``--prompt`` tokens then ``--new`` new ones, timed alternately with the original
in the same run, median of ``--repeats`` (``speed_ratios`` of ``hf_mod_smollm2.py``), on the first
``--speed-seeds`` seeds (default 1: the speed hardly depends on the seed, and a row's timing takes minutes
on SmolLM2). The interval of MoD − pruning at a point: a paired bootstrap over the held-out windows of the
seed-averaged per-window difference (``bootstrap_ci``, as ``hf_mod_smollm2.py``), in points of %; with 2 or
more seeds also a paired t interval over the seeds' Δ loss differences (t with n−1 degrees of freedom), which
carries the seed-to-seed spread the bootstrap does not.

One JSON row per (method, point, seed), written atomically as soon as it is measured; a rerun skips the rows
present (a killed run resumes), ``--fresh`` starts over; ``--costs-from R`` takes the skip costs of the result
``R`` (same settings) instead of measuring them. Writes ``--out`` (default ``benchmarks/results/
heal_vs_prune.json``; ``--smoke``: ``heal_vs_prune_smoke.json``) and a PNG beside it: Δ loss vs MACs, one line
per method, and MoD − pruning with its intervals; prints a table.

Shape legend: W windows, S sequence, B batch.
"""

from __future__ import annotations

import argparse
import copy
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
from benchmarks.common import machine_info  # noqa: E402
from benchmarks.hf.heal_vs_prune_models import (  # noqa: E402,F401
    ByteTokenizer,
    fill_defaults,
    load_original,
    tiny_llama,
)
from benchmarks.hf.heal_vs_prune_ood import unseen_baselines  # noqa: E402
from benchmarks.hf.heal_vs_prune_report import (  # noqa: E402
    BUDGET_KEYS,
    METHODS,
    MOD,
    PRUNE,
    model_title,
    plot,
    settings_of,
    summarize,
    table,
)
from benchmarks.hf.smollm2_measure import (  # noqa: E402
    _num,
    _threads,
    english_windows,
    speed_ratios,
    window_losses,
)
from mode.hf._compat import decoder_layers  # noqa: E402
from mode.hf.dense.budget import layers_to_delete, pruned_macs  # noqa: E402
from mode.hf.dense.macs import HALVES, _parts, macs_per_token  # noqa: E402
from mode.hf.dense.windows import (  # noqa: E402
    batches_of,
    calibration_docstring_windows,
    docstring_windows,
    heal_batches_of,
)
from mode.train.checkpoint import atomic_write_text  # noqa: E402
from mode.train.progress import Progress  # noqa: E402

HEAL_TEXTS = ("topics", "topics+docstrings")
REPORT_KEYS = (*BUDGET_KEYS, "cpu_seconds", "trainable", "lora_params", "other_params", "lora_layers")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="a tiny random Llama, 2 points, 1 seed, 3 heal steps")
    p.add_argument("--macs", type=float, nargs="+", default=None, help="points, MACs ÷ original")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--seeds", type=int, default=None, help="how many seeds: --first-seed, --first-seed + 1, ...")
    p.add_argument("--first-seed", type=int, default=0, help="the first seed (split the seeds over processes)")
    p.add_argument("--heal-steps", type=int, default=None, help="optimizer steps per heal (the budget)")
    p.add_argument("--heal-tokens", type=int, default=None, help="tokens per step, rounded down to whole windows")
    p.add_argument(
        "--heal-text",
        default="topics",
        choices=HEAL_TEXTS,
        help="topics: the training topics, cycled; topics+docstrings: every training topic window once, the rest "
        "of the budget from stdlib docstrings",
    )
    p.add_argument("--heal-lr", type=float, default=1e-3)
    p.add_argument("--router-lr", type=float, default=0.0, help="HealConfig.router_lr (0: the routers stay as fitted)")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--est-rank", type=int, default=None, help="estimate_rank of prune-bi-est (64; smoke 8)")
    p.add_argument("--min-capacity", type=float, default=0.5, help="plan_to_macs's min_capacity")
    p.add_argument("--fit-windows", type=int, default=None)
    p.add_argument("--cost-windows", type=int, default=None)
    p.add_argument("--val-windows", type=int, default=None)
    p.add_argument(
        "--unseen-windows",
        type=int,
        default=None,
        help="windows of each out-of-domain set (mode.hf.dense.unseen: prose, dialogue, code; 64, smoke 8; 0: none)",
    )
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--prompt", type=int, default=None)
    p.add_argument("--new", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--no-speed", action="store_true", help="skip the tokens/s columns")
    p.add_argument("--speed-seeds", type=int, default=1, help="time decode on the first N seeds only")
    p.add_argument("--threads", type=int, default=None, help="threads for healing and losses (speed: one thread)")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--fresh", action="store_true", help="discard the rows of --out and start over")
    p.add_argument("--costs-from", help="a result of the same settings (a merged one): its skip costs, not measured")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.first_seed < 0:
        p.error(f"--first-seed {args.first_seed}: a seed is >= 0")
    real = dict(
        macs=[0.95, 0.9, 0.85, 0.8, 0.75], seeds=3, heal_steps=100, heal_tokens=1024, fit_windows=64, est_rank=64
    )
    real.update(cost_windows=8, val_windows=32, seq_len=256, prompt=64, new=48, repeats=3, unseen_windows=64)
    smoke = dict(macs=[0.9, 0.8], seeds=1, heal_steps=3, heal_tokens=256, fit_windows=8, est_rank=8)
    smoke.update(cost_windows=4, val_windows=8, seq_len=64, prompt=16, new=8, repeats=1, unseen_windows=8)
    fill_defaults(args, smoke if args.smoke else real)
    if args.out is None:
        args.out = f"benchmarks/results/heal_vs_prune{'_smoke' if args.smoke else ''}.json"
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    wall0 = time.perf_counter()

    original, tokenizer, name = load_original(args.smoke, args.cache_dir)
    config = original.config
    S = args.seq_len
    train_WS, held_WS = english_windows(tokenizer, S)
    val_WS = held_WS[torch.linspace(0, len(held_WS) - 1, args.val_windows).long()]
    fit_WS = train_WS[: args.fit_windows]
    fit_batches = batches_of(fit_WS, 8)
    per_step = max(1, args.heal_tokens // S)
    extra_WS = docstring_windows(tokenizer, S) if args.heal_text == "topics+docstrings" else None
    cal_batches: dict[str, list[torch.Tensor]] = {"fit": fit_batches}

    def calibration(text: str) -> list[torch.Tensor]:
        """The batches a MoD method's thresholds are calibrated on: the fit windows, or as many stdlib docstring
        windows (evenly spaced)."""
        if text not in cal_batches:
            doc_WS = calibration_docstring_windows(tokenizer, S, len(fit_WS))
            cal_batches[text] = batches_of(doc_WS, 8)
        return cal_batches[text]

    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    keep = ("out", "threads", "cache_dir", "no_speed", "speed_seeds", "methods", "macs", "seeds", "first_seed", "fresh")
    keep += ("costs_from", "unseen_windows")  # the out-of-domain sets are checked by their text's digest
    settings = {k: v for k, v in vars(args).items() if k not in keep}
    done = {} if args.fresh or not out_path.is_file() else json.loads(out_path.read_text())
    if done and settings_of(done) != settings:
        raise ValueError(
            f"{out_path} holds rows measured with other settings ({done.get('settings')}); pass --out or --fresh"
        )
    rows: dict[str, dict] = {r["key"]: r for r in done.get("rows", [])}
    costs: dict[str, dict[str, float]] = done.get("skip_costs", {})
    if args.costs_from:  # costs measured by another run (~12 CPU-minutes for both halves with estimates)
        other = json.loads(Path(args.costs_from).read_text())
        if settings_of(other) != settings:
            raise ValueError(f"--costs-from {args.costs_from}: measured with other settings ({other.get('settings')})")
        costs = {**other.get("skip_costs", {}), **costs}
    base_W = window_losses(original, val_WS)
    base = float(base_W.mean())
    print(f"{name}: held-out {len(val_WS)} windows x {S} tokens, loss {base:.4f} (threads {threads})", flush=True)
    unseen, unseen_info = unseen_baselines(original, tokenizer, S, args.unseen_windows, args.smoke, done, out_path)
    unseen_base = {k: v["original_loss"] for k, v in unseen_info.items()}
    prompts = {b: held_WS[:b, : args.prompt] for b in (1, 8)}

    def save(extra: dict | None = None) -> None:
        doc = {
            "settings": settings,
            "model": name,
            "machine": machine_info(),
            "threads": threads,
            "base_loss": base,
            "skip_costs": costs,
            "unseen": unseen_info,
            "rows": list(rows.values()),
            **(extra or {}),
        }
        atomic_write_text(out_path, json.dumps(doc, indent=2) + "\n")

    def heal_batches(seed: int) -> list[torch.Tensor]:
        return heal_batches_of(train_WS, args.heal_steps, per_step, seed, extra_WS)

    def part_costs(part: str, rank: int | None) -> dict[int, float]:
        """Each layer's skip cost of ``part``, with its rank-``rank`` estimate standing in (fitted on the fit
        windows) or none, measured on the cost windows, cached in the result: what orders the MoD layers (or
        halves) and a ``prune-sc-*`` deletion."""
        key = part if rank is None else f"{part}+estimate{rank}"
        if key not in costs:
            got = mh.skip_costs(
                original, [train_WS[: args.cost_windows]], part, estimate_rank=rank, fit_batches=fit_batches
            )
            costs[key] = {str(i): c for i, c in got.items()}
        return {int(i): c for i, c in costs[key].items()}

    def pct(loss_W: torch.Tensor) -> float:
        return 100 * (float(loss_W.mean()) / base - 1)

    def macs_at(model, shares: dict[int, float]) -> float:
        """The MACs ÷ the original's with each MoD layer at the share its router took (``shares``)."""
        parts, n_layers = _parts(model)
        for i, s in shares.items():
            parts[i]["share"] = s
        return macs_per_token(config, S, parts, n_layers) / macs_per_token(config, S, {}, n_layers)

    def unseen_losses(model, healed: bool) -> dict:
        """Each out-of-domain set's Δ loss % against the original's; healed: with its windows and MACs on it."""
        got: dict = {}
        for k, u in unseen.items():
            shares: dict[int, float] = {}
            loss_W = window_losses(model, u.windows_WS, shares=shares if mh.mod_layers(model) else None)
            d = 100 * (float(loss_W.mean()) / unseen_base[k] - 1)
            got[k] = d if not healed else {"d_loss_pct": d, "window_losses": loss_W.tolist()}
            if healed:
                got[k]["macs_ratio_measured"] = macs_at(model, shares)
        return got

    def measure(model, row: dict) -> None:
        shares: dict[int, float] = {}
        loss_W = window_losses(model, val_WS, shares=shares if mh.mod_layers(model) else None)
        row["d_loss_pct"], row["window_losses"] = pct(loss_W), loss_W.tolist()
        if shares:
            row["share"] = statistics.mean(shares.values())
            with mh.routing(model, "topk"):  # top-C, what healing trained with (non-causal; eval mode)
                row["d_loss_pct_topc"] = pct(window_losses(model, val_WS))
        row["macs_ratio_measured"] = macs_at(model, shares)
        if unseen:
            row["unseen"] = unseen_losses(model, healed=True)
        if not args.no_speed and row["seed"] < args.speed_seeds:
            with _threads(1):
                for b, prompt in prompts.items():
                    r = speed_ratios(model, original, prompt, args.new, args.repeats)
                    row[f"prefill_b{b}"], row[f"decode_b{b}"] = r["prefill"], r["decode"]

    for point in args.macs:
        n_del = layers_to_delete(original, S, point)
        target = pruned_macs(original, S, n_del)
        print(f"point {point}: delete {n_del} layers -> MACs {target:.4f}; MoD planned to the same", flush=True)
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            for method in sorted(args.methods, key=METHODS.index):  # pruning first: the MoD rows check against it
                key = f"{method}@{point}#s{seed}"
                if key in rows:
                    continue
                t0 = time.perf_counter()
                row = {"key": key, "method": method, "point": point, "seed": seed, "target_macs": target}
                model = copy.deepcopy(original)
                lora_layers: str | list[int] = "auto"  # heal's default: the converted layers, or after each deleted
                if method in PRUNE:
                    pm = PRUNE[method]
                    est = args.est_rank if pm.est else None
                    scores = None
                    if pm.by == "skip_cost":  # the costs that order the MoD layers (the same windows): measured once
                        scores = part_costs("layer", est)
                    row["layers"] = mh.prune_layers(model, n_del, pm.by, fit_batches, estimate_rank=est, scores=scores)
                    row["estimate_rank"], row["by"] = est, pm.by
                    if pm.every_layer:
                        lora_layers = list(range(len(decoder_layers(model))))  # every kept layer
                else:
                    mm = MOD[method]
                    part, causal, every_layer = mm.part, mm.causal, mm.every_layer
                    min_capacity = args.min_capacity if mm.min_capacity is None else mm.min_capacity
                    rank = args.est_rank if mm.est else None
                    with_est = rank if mm.order == "skip_cost_est" else None  # the costs with the estimates in
                    if part == "mixed":  # the halves by loss per multiply-add saved
                        by_half = {h: part_costs(h, with_est) for h in HALVES}
                        order = mh.mixed_order(original, by_half, S, skip_rank=rank)
                    else:
                        layer_costs = part_costs(part, with_est)
                        order = sorted(range(config.num_hidden_layers), key=lambda i: layer_costs[i])
                    try:
                        plan = mh.plan_to_macs(
                            original, target, S, part=part, skip_rank=rank, order=order, min_capacity=min_capacity
                        )
                    except ValueError as e:  # out of reach for this part: say so, once per seed
                        rows[key] = {**row, "skipped": str(e)}
                        print(f"{key:<28} skipped: {e}", flush=True)
                        save()
                        continue
                    groups = plan.groups()  # the to_mod calls: heal_vs_prune_speed rebuilds from them
                    for group in groups:
                        mh.to_mod(model, **group, causal=causal)
                    # the router, then the estimate, then the thresholds (on the fit windows or the docstrings)
                    mh.router_fit(model, fit_batches, label=mm.label, calibration_batches=calibration(mm.calibrate))
                    row.update(layers=plan.layers, capacity=plan.capacity, part=part, kv=plan.kv, causal=causal)
                    row["min_capacity"], row["order"], row["label"] = min_capacity, mm.order, mm.label
                    row["calibrate"] = mm.calibrate
                    row["groups"] = groups
                    row["estimate_rank"] = rank
                    if every_layer:
                        lora_layers = list(range(config.num_hidden_layers))
                row["macs_ratio"] = mh.conversion_macs(model, S)
                row["d_loss_pct_before"] = pct(window_losses(model, val_WS))
                if unseen:
                    row["unseen_before"] = unseen_losses(model, healed=False)
                torch.manual_seed(seed)  # the LoRA initialisation: paired across methods
                cfg = mh.HealConfig(
                    steps=args.heal_steps,
                    lr=args.heal_lr,
                    router_lr=args.router_lr,
                    rank=args.lora_rank,
                    objective="distill",
                    layers=lora_layers,
                )
                print(f"{key}: Δ loss before healing {row['d_loss_pct_before']:+.2f}%; healing", flush=True)
                report = mh.heal(model, original, heal_batches(seed), cfg, Progress(bar=False, every_s=60))
                row.update({k: getattr(report, k) for k in REPORT_KEYS})
                row["heal_loss_first_last"] = [report.losses[0], report.losses[-1]]
                partners = [
                    rows[f"{m}@{point}#s{seed}"]
                    for m in PRUNE
                    if f"{m}@{point}#s{seed}" in rows and "steps" in rows[f"{m}@{point}#s{seed}"]
                ]
                for partner in partners:
                    other = mh.HealReport(**{k: partner[k] for k in REPORT_KEYS}, losses=[])
                    assert report.same_budget(other), f"{key}: healed with another budget than {partner['key']}"
                row["same_budget_as"] = [r["key"] for r in partners]
                mh.merge_lora(model)
                if any(layer.mod_router.steers for layer in mh.mod_layers(model).values()):
                    mh.calibrate(model, calibration(MOD[method].calibrate))  # healing moved the routers
                measure(model.eval(), row)
                row["wall_seconds"] = time.perf_counter() - t0
                rows[key] = row
                print(
                    f"{key:<28} MACs {row['macs_ratio']:.3f}  Δ {row['d_loss_pct_before']:+7.2f}% -> "
                    f"{row['d_loss_pct']:+7.2f}%  decode b1 {_num(row.get('decode_b1'), '.2f')}x "
                    f"b8 {_num(row.get('decode_b8'), '.2f')}x  heal {row['cpu_seconds']:.1f} CPU-s",
                    flush=True,
                )
                for k, u in row.get("unseen", {}).items():
                    print(f"{'':<28} unseen {k}: Δ {row['unseen_before'][k]:+7.2f}% -> {u['d_loss_pct']:+7.2f}%")
                save()
    summary, intervals = summarize(rows, base, unseen_base)
    save({"summary": summary, "intervals": intervals})
    text = table(summary, intervals, base, unseen_base)
    print(text)
    png = out_path.with_suffix(".png")
    plot(summary, intervals, png, model_title(args.smoke))
    print(f"wrote {out_path} and {png} ({time.perf_counter() - wall0:.1f} s)")
    return {
        "base_loss": base,
        "unseen": unseen_info,
        "rows": list(rows.values()),
        "summary": summary,
        "intervals": intervals,
    }


if __name__ == "__main__":
    main()

"""Decode and prefill tokens/s ÷ the original of the conversions in a ``heal_vs_prune.py`` result, timed alone.

    python benchmarks/hf/heal_vs_prune_speed.py                    # SmolLM2, benchmarks/results/heal_vs_prune.json
    python benchmarks/hf/heal_vs_prune_speed.py --smoke --rows R   # the tiny random Llama of heal_vs_prune --smoke

``heal_vs_prune.py`` times each row right after its heal, so its speed columns share the machine with whatever
else runs then. This script rebuilds each conversion of the first seed's rows (the same deleted layers with or
without their estimate, the same MoD layers, capacity, kv and estimate rank), with the MoD thresholds
calibrated on ``--fit-windows`` training windows instead of fitted and healed: the speed depends on the shapes
and on the share of tokens routed (which calibration sets to the capacity), not on the trained weights. Then
``paired_times`` (as ``speed_ratios`` of ``hf_mod_smollm2.py``) at batch 1 and 8 (``--batches``), one
thread, ``--prompt`` tokens then ``--new`` new ones, alternated with the original: the ratio of the medians of
``--repeats``, and each repeat's paired ratio (``..._each``) with a 95% t interval of their geometric mean
(``..._ci``: the machine's noise, which moves single ratios by 10-20% here). Run it on an idle machine.
``--methods`` and ``--points`` time a subset of the rows. Writes ``--out`` (default: ``..._speed.json`` beside
``--rows``) and prints a table.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere without installing
    sys.path.insert(0, str(ROOT))

import mode.hf as mh  # noqa: E402
from benchmarks.common import machine_info  # noqa: E402
from benchmarks.hf.heal_vs_prune_models import load_original  # noqa: E402
from benchmarks.hf.heal_vs_prune_report import t_interval  # noqa: E402
from benchmarks.hf.smollm2_measure import _threads, english_windows, median_ratios, paired_times  # noqa: E402
from mode.hf.dense.windows import batches_of  # noqa: E402
from mode.train.checkpoint import atomic_write_text  # noqa: E402


def rebuild(original, row: dict, fit_batches: list[torch.Tensor], skip_costs: dict | None = None):
    """The conversion of ``row`` on a copy of ``original``: the same layers deleted (with the row's estimate
    rank, fitted; deleted by skip cost: ranked by the result's ``skip_costs``, as the run did) or converted to MoD
    (thresholds calibrated), in eval mode."""
    model = copy.deepcopy(original)
    if row["method"].startswith("prune"):
        by = row.get("by", "block_influence")  # rows from before "by": block influence
        scores = None
        if by == "skip_cost":
            key = "layer" if row["estimate_rank"] is None else f"layer+estimate{row['estimate_rank']}"
            scores = {int(i): c for i, c in (skip_costs or {})[key].items()}
        deleted = mh.prune_layers(model, len(row["layers"]), by, fit_batches, row["estimate_rank"], scores=scores)
        if sorted(deleted) != sorted(row["layers"]):
            raise ValueError(f"{row['key']}: {by} now deletes {deleted}, the row deleted {row['layers']}")
    else:
        one = {k: row[k] for k in ("layers", "capacity", "part", "kv")} | {"skip_rank": row["estimate_rank"]}
        for group in row.get("groups") or [one]:  # rows from before "groups": one part
            mh.to_mod(model, **group, causal=row["causal"])
        mh.calibrate(model, fit_batches)
    return model.eval()


def ratio_interval(ratios: list[float]) -> list[float] | None:
    """95% t interval of the geometric mean of paired speed ratios (one per repeat: ``t_interval`` of their
    logarithms, mapped back); None below 2 repeats."""
    logs = t_interval([math.log(r) for r in ratios])
    return None if logs is None else [math.exp(v) for v in logs]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="benchmarks/results/heal_vs_prune.json", help="a heal_vs_prune.py result")
    p.add_argument("--smoke", action="store_true", help="the tiny random Llama heal_vs_prune --smoke used")
    p.add_argument("--methods", nargs="+", default=None, help="time these methods' rows only (default: all)")
    p.add_argument("--points", type=float, nargs="+", default=None, help="time these points' rows only")
    p.add_argument("--fit-windows", type=int, default=None, help="training windows for the fits (64; smoke 8)")
    p.add_argument("--prompt", type=int, default=None)
    p.add_argument("--new", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="batch sizes to time (default 1 8)")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    defaults = dict(fit_windows=8, prompt=16, new=8, repeats=1) if args.smoke else {}
    defaults = {**dict(fit_windows=64, prompt=64, new=48, repeats=3), **defaults}
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    src = Path(args.rows)
    doc = json.loads(src.read_text())
    S = doc["settings"]["seq_len"]
    original, tokenizer, name = load_original(args.smoke, args.cache_dir)
    train_WS, held_WS = english_windows(tokenizer, S)
    fit_WS = train_WS[: args.fit_windows]
    fit_batches = batches_of(fit_WS, 8)
    rows = [r for r in doc["rows"] if r.get("seed") == 0 and "layers" in r and "skipped" not in r]
    if args.methods is not None:
        unknown = sorted(set(args.methods) - {r["method"] for r in rows})
        if unknown:
            raise SystemExit(f"--methods {unknown}: no seed-0 row of {src} has that method")
        rows = [r for r in rows if r["method"] in args.methods]
    if args.points is not None:
        rows = [r for r in rows if r["point"] in args.points]
        if not rows:
            raise SystemExit(f"--points {args.points}: no seed-0 row of {src} (of --methods) is at those points")
    results = []
    for row in rows:
        model = rebuild(original, row, fit_batches, doc.get("skip_costs"))
        out = {k: row[k] for k in ("key", "method", "point", "layers", "capacity", "estimate_rank") if k in row}
        with _threads(1):
            for b in args.batches:
                t = paired_times(model, original, held_WS[:b, : args.prompt], args.new, args.repeats)
                for k, ratio in median_ratios(t).items():
                    each = [o / m for o, m in zip(t["original"][k], t["model"][k])]
                    out[f"{k}_b{b}"] = ratio
                    out[f"{k}_b{b}_each"] = each  # the paired ratio of each repeat
                    out[f"{k}_b{b}_ci"] = ratio_interval(each)
        results.append(out)
        cells = []
        for b in args.batches:
            ci = out[f"decode_b{b}_ci"]
            within = "" if ci is None else f" (95% [{ci[0]:.3f}, {ci[1]:.3f}])"
            cells.append(f"decode b{b} {out[f'decode_b{b}']:.3f}x{within} prefill {out[f'prefill_b{b}']:.3f}x")
        print(f"{row['key']:<28} " + "  ".join(cells), flush=True)
    dest = Path(args.out) if args.out else src.with_name(src.stem + "_speed.json")
    payload = {
        "model": name,
        "rows_from": str(src),
        "machine": machine_info(),
        "threads": 1,
        "settings": {
            k: getattr(args, k) for k in ("fit_windows", "prompt", "new", "repeats", "methods", "points", "batches")
        },
        "results": results,
    }
    atomic_write_text(dest, json.dumps(payload, indent=2) + "\n")
    print(f"wrote {dest}")
    return payload


if __name__ == "__main__":
    main()

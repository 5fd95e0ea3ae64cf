"""How the in-domain and out-of-domain losses move along a heal: ``mode convert --heal-probe-every N`` folders,
one line per recipe (method, fit and heal texts, ``unseen_curve.recipe``) and text, mean ± std over the seeds
at each step where every seed of the recipe was probed (issue 68: fewer or more healing steps).

    mode convert smollm2 --macs 0.8408 --out runs/mod_long --skip-rank 64 --min-capacity 0.4 \\
        --router-label residual --heal-layers all --calibrate docstrings --heal-text mix --heal-steps 300 \\
        --heal-probe-every 50 --threads 1 --seed 0
    python benchmarks/hf/heal_curve.py --folders runs/mod_long --out benchmarks/results/heal_steps_curve.json

Step 0 is the conversion before healing; the last step is the conversion's own result. A run stopped while it
healed counts with the probes it wrote (``heal_curve.partial.json``; ``partial`` in the JSON). The JSON keeps every
folder's curve; the PNG beside it has one panel per text, Δ loss % against the heal tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere without installing
    sys.path.insert(0, str(ROOT))

from benchmarks.common import machine_info  # noqa: E402
from benchmarks.hf.unseen_curve import plot_panels, recipe  # noqa: E402
from mode.hf.convert_command import PARTIAL_CURVE_FILE, REPORT_FILE  # noqa: E402
from mode.train.checkpoint import atomic_write_text  # noqa: E402


def read_curve(folder: Path) -> dict:
    """A folder's recipe, seed, tokens per heal step and heal curve: from its report, or, for a run stopped
    while it healed, from the probes it wrote so far (``partial``: True); a ``ValueError`` naming the folder if
    it has neither."""
    if (folder / REPORT_FILE).is_file():
        report = json.loads((folder / REPORT_FILE).read_text())
        if "heal_curve" not in report:
            raise ValueError(f"{folder}: its {REPORT_FILE} has no heal_curve (convert with --heal-probe-every N)")
        heal = report["result"]["heal"]
        per_step, partial = heal["tokens"] / heal["steps"], False
    elif (folder / PARTIAL_CURVE_FILE).is_file():
        report = json.loads((folder / PARTIAL_CURVE_FILE).read_text())
        st = report["settings"]
        per_step, partial = (st["heal_tokens"] // st["seq_len"]) * st["seq_len"], True
    else:
        raise ValueError(f"{folder}: holds neither {REPORT_FILE} nor {PARTIAL_CURVE_FILE}")
    return {
        "folder": str(folder),
        "recipe": recipe(report),
        "macs": report["settings"]["macs"],
        "seed": report["settings"]["seed"],
        "partial": partial,
        "tokens_per_step": per_step,
        "curve": report["heal_curve"],
    }


def summarise(runs: list[dict]) -> dict:
    """``{recipe @ macs: {"seeds", "steps", "tokens", "texts": {text: {"mean": [...], "std": [...]}}}}``, at the
    steps every seed of the recipe has."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in runs:
        groups[f"{r['recipe']} @ {r['macs']}"].append(r)
    out = {}
    for name, group in sorted(groups.items()):
        seeds = [r["seed"] for r in group]
        if len(set(seeds)) != len(seeds):
            raise ValueError(f"{name}: seed repeated in {seeds}")
        steps = sorted(set.intersection(*({p["step"] for p in r["curve"]} for r in group)))
        texts = [k for k in group[0]["curve"][0] if k != "step"]
        at = [{p["step"]: p for p in r["curve"]} for r in group]
        cells = {}
        for text in texts:
            values = [[a[s][text] for a in at] for s in steps]
            cells[text] = {
                "mean": [statistics.mean(v) for v in values],
                "std": [statistics.stdev(v) if len(v) > 1 else None for v in values],
            }
        out[name] = {
            "seeds": seeds,
            "steps": steps,
            "tokens": [s * group[0]["tokens_per_step"] for s in steps],
            "texts": cells,
        }
    return out


def plot(result: dict, png: Path) -> None:
    texts = list(dict.fromkeys(t for c in result["curves"].values() for t in c["texts"]))
    panels = {
        text: [
            (name, c["tokens"], c["texts"][text]["mean"], c["texts"][text]["std"])
            for name, c in result["curves"].items()
            if text in c["texts"]
        ]
        for text in texts
    }
    plot_panels(png, result["title"], "heal tokens", panels)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--folders", nargs="+", required=True, help="mode convert folders made with --heal-probe-every")
    p.add_argument("--out", required=True, help="the result JSON (the PNG beside it)")
    args = p.parse_args(argv)
    runs = [read_curve(Path(f)) for f in args.folders]
    result = {
        "title": "Δ loss along the heal (step 0: not healed; the last: the conversion's result)",
        "folders": args.folders,
        "machine": machine_info(),
        "runs": runs,
        "curves": summarise(runs),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(result, indent=2) + "\n")
    plot(result, out.with_suffix(".png"))
    for name, c in result["curves"].items():
        print(f"{name}  seeds {c['seeds']}")
        for i, step in enumerate(c["steps"]):
            cells = "  ".join(f"{t} {v['mean'][i]:+.2f}%" for t, v in c["texts"].items())
            print(f"  step {step:>4} ({c['tokens'][i]:>8.0f} tokens): {cells}")
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return result


if __name__ == "__main__":
    main()

"""Two ``mode convert`` recipes compared on the training text's held-out windows and on text no conversion step
saw (``mode.hf.dense.unseen``: prose, dialogue, code), paired by seed: issue 68's measurement.

    mode convert smollm2 --macs 0.8408 --out runs/mod_s0 --skip-rank 64 --min-capacity 0.4 \\
        --router-label residual --heal-layers all --calibrate docstrings --threads 1 --seed 0
    mode convert smollm2 --macs 0.8408 --out runs/prune_s0 --method prune --prune-by skip_cost --skip-rank 64 \\
        --heal-layers all --threads 1 --seed 0
    python benchmarks/hf/heal_vs_prune_unseen.py --a runs/mod_s0 runs/mod_s1 --b runs/prune_s0 runs/prune_s1 \\
        --out benchmarks/results/heal_vs_prune_unseen.json

Each folder's ``convert_report.json`` gives the per-window losses of the conversion and the original (``mode
convert`` writes them; a folder written before the out-of-domain sets existed is loaded onto the original with
``load_conversion`` and measured here, on the same windows, and its losses are kept in ``--cache``). The i-th
folder of ``--a`` and of ``--b`` must share a seed. Per text: each recipe's Δ loss % against the original (mean ±
std over seeds), and a − b with a paired bootstrap over windows (the seed-averaged per-window difference,
``bootstrap_ci``) and, with ≥ 2 seeds, a paired t interval over seeds. Also the MACs each spent on each text
(MoD routers route what the text makes them route). Needs the sets installed (``apt-get install fortunes``,
``pip install --no-deps chatterbot-corpus==1.3.3``).

Shape legend: W windows, S sequence.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere without installing
    sys.path.insert(0, str(ROOT))

from benchmarks.common import machine_info  # noqa: E402
from benchmarks.hf.heal_vs_prune_ood import t_interval  # noqa: E402
from benchmarks.hf.smollm2_measure import bootstrap_ci  # noqa: E402
from mode.train.checkpoint import atomic_write_text  # noqa: E402

IN_DOMAIN = "in-domain"


def measure_folder(folder: Path, cache: dict) -> dict:
    """``{text: {"loss_W", "original_W", "macs", ...}}`` of one ``mode convert`` folder: from its report, or
    (a report without ``"unseen"``) measured on the conversion loaded onto the original; cached by folder."""
    report = json.loads((folder / "convert_report.json").read_text())
    key = str(folder.resolve())
    if "unseen" in report and "window_losses" in report["held_out"]:
        held = report["held_out"]
        got = {IN_DOMAIN: {"loss_W": held["window_losses"], "original_loss": held["original_loss"]}}
        got[IN_DOMAIN]["macs"] = held["macs_measured"]
        for k, u in report["unseen"].items():
            got[k] = {
                "loss_W": u["window_losses"],
                "original_W": u["original_window_losses"],
                "macs": u["macs_measured"],
            }
            got[k]["text_sha256"] = u["text_sha256"]
        return {"report": report, "texts": got}
    if key not in cache:
        cache[key] = _measure_loaded(folder, report)
    return {"report": report, "texts": cache[key]}


def _measure_loaded(folder: Path, report: dict) -> dict:
    """The folder's conversion loaded onto the original: the held-out windows ``mode convert`` used and every
    out-of-domain set, each window's loss, the original's too, and the MACs on each."""
    import mode.hf as mh
    from mode.hf.convert_command import load_model
    from mode.hf.dense.unseen import unseen_sets, window_losses
    from mode.hf.dense.windows import english_windows, file_windows

    st = report["settings"]
    if st.get("threads"):
        torch.set_num_threads(st["threads"])
    original, tokenizer, _ = load_model(report["source"])
    S = st["seq_len"]
    _, held_WS = file_windows(tokenizer, st["data"], S) if st.get("data") else english_windows(tokenizer, S)
    val_WS = held_WS[torch.linspace(0, len(held_WS) - 1, min(st["val_windows"], len(held_WS))).long()]
    sets, _ = unseen_sets(tokenizer, S, 64, data=st.get("data"))
    texts = {IN_DOMAIN: val_WS, **{k: u.windows_WS for k, u in sets.items()}}
    base = {k: window_losses(original, x_WS)[0].tolist() for k, x_WS in texts.items()}
    model = mh.load_conversion(load_model(report["source"])[0], folder)
    got = {}
    for k, x_WS in texts.items():
        loss_W, macs = window_losses(model, x_WS)
        got[k] = {"loss_W": loss_W.tolist(), "original_W": base[k], "macs": macs}
        if k in sets:
            got[k]["text_sha256"] = sets[k].text_sha256
        print(f"{folder}: {k} loss {float(loss_W.mean()):.4f} (original {statistics.mean(base[k]):.4f})", flush=True)
    return got


def _orig(t: dict) -> float:
    return t["original_loss"] if "original_loss" in t else statistics.mean(t["original_W"])


def compare(a: list[dict], b: list[dict]) -> dict:
    """Per text: a's and b's Δ loss % (per seed, mean ± std) and a − b with its paired intervals."""
    out: dict = {}
    for text in a[0]["texts"]:
        if not all(text in r["texts"] for r in a + b):
            continue
        shas = {r["texts"][text].get("text_sha256") for r in a + b}
        if len(shas) > 1:
            raise ValueError(f"{text}: the folders measured other text (sha256 {sorted(map(str, shas))})")
        base = _orig(a[0]["texts"][text])

        def pct(r: dict, text=text, base=base) -> float:
            return 100 * (statistics.mean(r["texts"][text]["loss_W"]) / base - 1)

        pa, pb = [pct(r) for r in a], [pct(r) for r in b]
        diff_W = torch.stack(
            [torch.tensor(x["texts"][text]["loss_W"]) - torch.tensor(y["texts"][text]["loss_W"]) for x, y in zip(a, b)]
        ).mean(0)
        diffs = [x - y for x, y in zip(pa, pb)]
        out[text] = {
            "original_loss": base,
            "windows": len(a[0]["texts"][text]["loss_W"]),
            "text_sha256": next(iter(shas)),
            "a_d_loss_pct": pa,
            "b_d_loss_pct": pb,
            "a_mean": statistics.mean(pa),
            "a_std": statistics.stdev(pa) if len(pa) > 1 else None,
            "b_mean": statistics.mean(pb),
            "b_std": statistics.stdev(pb) if len(pb) > 1 else None,
            "a_macs": statistics.mean(r["texts"][text]["macs"] for r in a),
            "b_macs": statistics.mean(r["texts"][text]["macs"] for r in b),
            "diff_pct": statistics.mean(diffs),
            "bootstrap_ci_pct": list(bootstrap_ci(100 * diff_W / base)),
            "t_ci_pct": t_interval(diffs),
        }
    return out


def _pm(mean: float, std: float | None) -> str:
    return f"{mean:+.2f}%" + ("" if std is None else f" ± {std:.2f}")


def table(result: dict) -> str:
    lines = [
        "| text | original loss | a: Δ loss (MACs) | b: Δ loss (MACs) | a − b | 95% bootstrap (windows) "
        "| 95% t (seeds) |",
        "|---|---|---|---|---|---|---|",
    ]
    for text, r in result["texts"].items():
        t = r["t_ci_pct"]
        lines.append(
            f"| {text} | {r['original_loss']:.4f} | {_pm(r['a_mean'], r['a_std'])} ({r['a_macs']:.3f}) | "
            f"{_pm(r['b_mean'], r['b_std'])} ({r['b_macs']:.3f}) | {r['diff_pct']:+.2f} | "
            f"[{r['bootstrap_ci_pct'][0]:+.2f}, {r['bootstrap_ci_pct'][1]:+.2f}] | "
            f"{'—' if t is None else f'[{t[0]:+.2f}, {t[1]:+.2f}]'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--a", nargs="+", required=True, help="mode convert folders of recipe a, one per seed")
    p.add_argument("--b", nargs="+", required=True, help="mode convert folders of recipe b, the same seeds in order")
    p.add_argument("--out", required=True, help="the result JSON")
    p.add_argument("--cache", default=None, help="losses measured here for reports without them (default: --out's)")
    args = p.parse_args(argv)
    if len(args.a) != len(args.b):
        p.error(f"--a has {len(args.a)} folders, --b {len(args.b)}: one per seed each")
    cache_path = Path(args.cache or Path(args.out).with_suffix(".cache.json"))
    cache = json.loads(cache_path.read_text()) if cache_path.is_file() else {}
    a, b = [], []
    for fa, fb in zip(args.a, args.b):
        for folder, into in ((Path(fa), a), (Path(fb), b)):
            into.append(measure_folder(folder, cache))
            atomic_write_text(cache_path, json.dumps(cache) + "\n")  # a killed run keeps what it measured
        sa, sb = a[-1]["report"]["settings"]["seed"], b[-1]["report"]["settings"]["seed"]
        if sa != sb:
            p.error(f"{fa} has seed {sa}, {fb} seed {sb}: pair the folders by seed")
    result = {
        "a": {
            "folders": args.a,
            "settings": a[0]["report"]["settings"],
            "macs": [r["report"]["result"]["macs"] for r in a],
        },
        "b": {
            "folders": args.b,
            "settings": b[0]["report"]["settings"],
            "macs": [r["report"]["result"]["macs"] for r in b],
        },
        "seeds": [r["report"]["settings"]["seed"] for r in a],
        "machine": machine_info(),
        "texts": compare(a, b),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(result, indent=2) + "\n")
    print(table(result))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()

"""The out-of-domain side of ``heal_vs_prune.py`` (``mode.hf.dense.unseen``): each set's baseline (the
original's loss on it), the per-set summary of the rows and the MoD − pruning intervals on each set, and the
paired t interval the report and ``heal_vs_prune_unseen.py`` share."""

from __future__ import annotations

import statistics
from pathlib import Path

import torch

from benchmarks.hf.smollm2_measure import bootstrap_ci, window_losses
from mode.experiments.stats_ci import t_quantile
from mode.hf.dense.unseen import unseen_sets


def unseen_baselines(original, tokenizer, seq_len: int, windows: int, smoke: bool, done: dict, out_path: Path):
    """``(sets, info)``: the out-of-domain sets (none when ``windows`` is 0; the smoke run takes what is
    installed, a real run raises for a missing one) and, per set, its description with the original's loss and
    per-window losses, merged with what ``done`` (the result being resumed) holds; a set whose text changed since
    (another package version) is a ``ValueError``."""
    unseen, missing = {}, {}
    if windows:  # text no step of any conversion reads
        unseen, missing = unseen_sets(tokenizer, seq_len, windows, missing="skip" if smoke else "raise")
    for why in missing.values():
        print(f"note: {why}; not measured", flush=True)
    info = {}
    for k, u in unseen.items():  # the original's loss on each: its baseline
        loss_W = window_losses(original, u.windows_WS)
        info[k] = {**u.info(), "original_loss": float(loss_W.mean()), "original_window_losses": loss_W.tolist()}
        print(f"unseen {k}: {len(loss_W)} windows, loss {info[k]['original_loss']:.4f}", flush=True)
    for k, had in done.get("unseen", {}).items():
        if k in info and had["text_sha256"] != info[k]["text_sha256"]:
            raise ValueError(
                f"{out_path}: its unseen set {k!r} is other text (sha256 {had['text_sha256'][:12]}, now "
                f"{info[k]['text_sha256'][:12]}: other package versions?); pass --out or --unseen-windows 0"
            )
    return unseen, {**done.get("unseen", {}), **info}


def t_interval(diffs: list[float]) -> list[float] | None:
    """Paired 95% t interval of the mean of ``diffs`` (one per seed); None below 2 seeds."""
    if len(diffs) < 2:
        return None
    half = t_quantile(0.975, len(diffs) - 1) * statistics.stdev(diffs) / len(diffs) ** 0.5
    mean = statistics.mean(diffs)
    return [mean - half, mean + half]


def unseen_summary(rs: list[dict], names: list[str]) -> dict:
    """Per out-of-domain set: Δ loss % healed (mean ± std over the seeds measured on it), before healing, and the
    MACs on it; ``"mean"``: the mean over the sets (only where every set is measured)."""
    got: dict = {}
    for k in names:
        pct = [r["unseen"][k]["d_loss_pct"] for r in rs if k in r.get("unseen", {})]
        if not pct:
            continue
        before = [r["unseen_before"][k] for r in rs if k in r.get("unseen_before", {})]
        got[k] = {
            "seeds": len(pct),
            "d_loss_pct": statistics.mean(pct),
            "d_loss_pct_std": statistics.stdev(pct) if len(pct) > 1 else None,
            "d_loss_pct_before": statistics.mean(before) if before else None,
            "macs_ratio_measured": statistics.mean(
                r["unseen"][k]["macs_ratio_measured"] for r in rs if k in r["unseen"]
            ),
        }
    if names and all(k in got for k in names):
        befores = [got[k]["d_loss_pct_before"] for k in names]
        got["mean"] = {
            "d_loss_pct": statistics.mean(got[k]["d_loss_pct"] for k in names),
            "d_loss_pct_before": None if None in befores else statistics.mean(befores),  # type: ignore[arg-type]
        }
    return got


def unseen_intervals(pairs: list[tuple[dict, dict]], unseen_base: dict[str, float]) -> dict:
    """MoD − pruning on each out-of-domain set (and ``"mean"``, the sets' windows together, each in % of its own
    set's original loss) over the seeds both measured on it: the paired bootstrap over windows and t over seeds."""
    got: dict = {}
    per_window: list[torch.Tensor] = []
    seed_diffs: list[list[float]] = []
    for k, b in unseen_base.items():
        both = [
            (a["unseen"][k], p["unseen"][k]) for a, p in pairs if k in a.get("unseen", {}) and k in p.get("unseen", {})
        ]
        if not both:
            continue
        diffs = [a["d_loss_pct"] - p["d_loss_pct"] for a, p in both]
        diff_W = (
            100
            * torch.stack([torch.tensor(a["window_losses"]) - torch.tensor(p["window_losses"]) for a, p in both]).mean(
                0
            )
            / b
        )
        got[k] = {
            "seeds": len(both),
            "diff_pct": statistics.mean(diffs),
            "bootstrap_ci_pct": list(bootstrap_ci(diff_W)),
            "t_ci_pct": t_interval(diffs),
        }
        per_window.append(diff_W)
        seed_diffs.append(diffs)
    if unseen_base and len(got) == len(unseen_base) and len({len(d) for d in seed_diffs}) == 1:
        means = [statistics.mean(col) for col in zip(*seed_diffs)]  # per seed: the mean over the sets
        got["mean"] = {
            "diff_pct": statistics.mean(means),
            "bootstrap_ci_pct": list(bootstrap_ci(torch.cat(per_window))),
            "t_ci_pct": t_interval(means),
        }
    return got

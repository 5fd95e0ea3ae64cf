"""`mode report`: what a trained model's routers learned, as a table, JSON and pictures.

Shape legend: N sequences evaluated, S sequence length, L layers, E experts, X expert slots.

Runs the model (top-C routing, or causal routing with ``causal_routing=True``) over fixed evaluation
windows and writes, into ``out``:
    report.json          every number below (definitions: docs/reports.md)
    compute_hist.png     distribution of per-token compute: blocks traversed, MLP assignments, FLOPs
    routing_heatmap.png  position bucket x layer: fraction of tokens that took the layer's routed path
    expert_load.png      one bar chart per router: per-slot load (kept, dropped, no-op)
and prints the per-layer load-balance table and the bytes and words with the most and least compute.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import torch
from torch import Tensor

from mode.measure.stats import RoutingAccumulator
from mode.model.lm import LM
from mode.routing.keys import PARTS, router_key

WORD_BYTES = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_") | frozenset(range(128, 256))


@dataclass
class TokenTable:
    """Per-token compute of every evaluated token, row = one evaluation window."""

    ids_NS: Tensor
    blocks_NS: Tensor
    mlp_NS: Tensor
    flops_NS: Tensor
    dense_flops_per_token: float


@torch.no_grad()
def collect(model: LM, batches, causal_routing: bool = False) -> tuple[RoutingAccumulator, TokenTable]:
    """Run ``model`` over ``batches`` (``(x_BS, ...)`` tuples) and accumulate its routing statistics."""
    was_training = model.training
    model.eval()
    acc = RoutingAccumulator()
    ids, blocks, mlp, flops = [], [], [], []
    dense = 0.0
    device = model.embed.weight.device
    try:
        for batch in batches:
            x_BS = batch[0] if isinstance(batch, (tuple, list)) else batch
            x_BS = x_BS.to(device)  # eval_batches' windows stay on the CPU; the model may be on a GPU
            out = model(x_BS, causal_routing=causal_routing)
            tc = acc.add_lm(model.cfg, out.aux, tuple(x_BS.shape))
            ids.append(x_BS.cpu())
            blocks.append(tc.blocks_BS.cpu())
            mlp.append(tc.mlp_BS.cpu())
            flops.append(tc.flops_BS.cpu())
            dense = tc.dense_flops_per_token
    finally:
        model.train(was_training)
    if not ids:
        raise ValueError("batches: must hold at least one batch")
    table = TokenTable(torch.cat(ids), torch.cat(blocks), torch.cat(mlp), torch.cat(flops), dense)
    return acc, table


# ------------------------------------------------------------------------------------------- the numbers


def byte_label(b: int) -> str:
    ch = chr(b)
    if b < 128 and ch.isprintable() and ch != " ":
        return ch
    return {32: "' '", 10: "\\n", 9: "\\t"}.get(b, f"\\x{b:02x}")


def top_bytes(t: TokenTable, top: int = 10, min_count: int = 5) -> dict:
    """Bytes ranked by mean FLOPs per occurrence (bytes seen fewer than ``min_count`` times are left out)."""
    ids = t.ids_NS.reshape(-1)
    count = torch.bincount(ids, minlength=256).double()
    sums = {
        name: torch.bincount(ids, weights=v.reshape(-1).double(), minlength=256)
        for name, v in (("flops", t.flops_NS), ("blocks", t.blocks_NS), ("mlp", t.mlp_NS))
    }
    rows = []
    for b in range(256):
        n = float(count[b])
        if n >= min_count:
            rows.append(
                {
                    "byte": b,
                    "text": byte_label(b),
                    "count": int(n),
                    "mean_flops": float(sums["flops"][b]) / n,
                    "mean_blocks": float(sums["blocks"][b]) / n,
                    "mean_mlp": float(sums["mlp"][b]) / n,
                }
            )
    return _most_least(rows, top, min_count)


def top_tokens(t: TokenTable, vocab_size: int, label, top: int = 10, min_count: int = 5) -> dict:
    """Token ids of a vocabulary of ``vocab_size`` (a model trained on token shards), named by ``label(id)``,
    ranked by mean FLOPs per occurrence (ids seen fewer than ``min_count`` times are left out)."""
    ids = t.ids_NS.reshape(-1)
    count = torch.bincount(ids, minlength=vocab_size).double()
    sums = {
        name: torch.bincount(ids, weights=v.reshape(-1).double(), minlength=vocab_size).tolist()
        for name, v in (("flops", t.flops_NS), ("blocks", t.blocks_NS), ("mlp", t.mlp_NS))
    }
    rows = []
    for i in (count >= min_count).nonzero().flatten().tolist():  # only the ids seen often enough
        n = float(count[i])
        rows.append(
            {
                "token": i,
                "text": label(i),
                "count": int(n),
                "mean_flops": sums["flops"][i] / n,
                "mean_blocks": sums["blocks"][i] / n,
                "mean_mlp": sums["mlp"][i] / n,
            }
        )
    return _most_least(rows, top, min_count)


def top_words(t: TokenTable, top: int = 10, min_count: int = 3) -> dict:
    """Whole words (maximal runs of letters, digits, '_' and non-ASCII bytes, not cut by a window edge),
    ranked by the mean over occurrences of the word's mean per-byte FLOPs."""
    agg: dict[bytes, list[float]] = {}
    for ids, flops, blocks in zip(t.ids_NS.tolist(), t.flops_NS.tolist(), t.blocks_NS.tolist()):
        S, s = len(ids), 0
        while s < S:
            if ids[s] not in WORD_BYTES:
                s += 1
                continue
            e = s
            while e < S and ids[e] in WORD_BYTES:
                e += 1
            if s > 0 and e < S:  # a word touching the window edge may be cut
                n = e - s
                a = agg.setdefault(bytes(ids[s:e]), [0.0, 0.0, 0.0])
                a[0] += 1
                a[1] += sum(flops[s:e]) / n
                a[2] += sum(blocks[s:e]) / n
            s = e
    rows = [
        {"word": w.decode("utf-8", errors="replace"), "count": int(n), "mean_flops": f / n, "mean_blocks": b / n}
        for w, (n, f, b) in agg.items()
        if n >= min_count
    ]
    return _most_least(rows, top, min_count)


def _most_least(rows: list[dict], top: int, min_count: int) -> dict:
    most = sorted(rows, key=lambda r: (-r["mean_flops"], -r["count"]))[:top]
    least = sorted(rows, key=lambda r: (r["mean_flops"], -r["count"]))[:top]
    return {"min_count": min_count, "most": most, "least": least}


def flops_histogram(t: TokenTable, bins: int = 40) -> dict:
    f = t.flops_NS.reshape(-1).double().numpy()
    lo, hi = float(f.min()), float(f.max())
    if hi - lo < 1e-9 * max(1.0, abs(hi)):
        lo, hi = lo - 0.5, hi + 0.5
    counts, edges = np.histogram(f, bins=bins, range=(lo, hi))
    q = np.percentile(f, [0, 10, 50, 90, 100])
    return {
        "edges": edges.tolist(),
        "frac": (counts / f.size).tolist(),
        "percentiles": dict(zip(("p0", "p10", "p50", "p90", "p100"), q.tolist())),
    }


def build_report(
    model: LM,
    batches,
    *,
    causal_routing: bool = False,
    buckets: int = 32,
    top: int = 10,
    min_byte_count: int = 5,
    min_word_count: int = 3,
    token_label=None,
) -> tuple[dict, TokenTable]:
    """Everything ``mode report`` writes, as a JSON-ready dict (plus the per-token table). ``token_label``:
    the ids are tokens of a tokenizer (``label(id)`` names one): ``top_tokens`` replaces the byte and word
    tables."""
    acc, table = collect(model, batches, causal_routing)
    cfg = model.cfg
    S = table.ids_NS.shape[1]
    nb = min(buckets, S)
    edges = [(b * S // nb, (b + 1) * S // nb) for b in range(nb)]  # [start, end) of each position bucket
    layers = []
    for i in range(len(cfg.layers)):
        ls = acc.layer_summary(i, buckets=nb, positions=True)
        routers = {}
        for part in PARTS:
            name = router_key(i, part)
            if name in acc.router_names():
                routers[part] = acc.router_summary(name, buckets=nb)
        layers.append({"layer": i, **ls, "routers": routers})
    tokens = acc.token_summary(buckets=nb, positions=True)
    tokens["flops_hist"] = flops_histogram(table)
    tokens["dense_flops_per_token"] = table.dense_flops_per_token
    report = {
        "model": {
            "layers": list(cfg.layers),
            "vocab_size": cfg.vocab_size,
            "seq_len": cfg.seq_len,
            "d_model": cfg.d_model,
            "capacity": cfg.capacity,
            "num_experts": cfg.num_experts,
            "top_k": cfg.top_k,
            "num_noop": cfg.num_noop,
            "router": cfg.router,
            "capacity_factor": cfg.capacity_factor,
        },
        "data": {
            "sequences": int(table.ids_NS.shape[0]),
            "seq_len": int(S),
            "tokens": int(table.ids_NS.numel()),
            "causal_routing": causal_routing,
        },
        "overall": acc.summary()["overall"],
        "layers": layers,
        "heatmap": {
            "position_buckets": edges,
            "layers": [f"{i}: {k}" for i, k in enumerate(cfg.layers)],
            "routed_frac": [layer["routed_by_position"] for layer in layers],
        },
        "token_compute": tokens,
    }
    if token_label is None:
        report["top_bytes"] = top_bytes(table, top, min_byte_count)
        report["top_words"] = top_words(table, top, min_word_count)
    else:
        report["top_tokens"] = top_tokens(table, cfg.vocab_size, token_label, top, min_byte_count)
    return cast(dict, _json_safe(report)), table  # a dict stays a dict


def _json_safe(x):
    """NaN/inf become null so the file is strict JSON."""
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


# ------------------------------------------------------------------------------------------------- text


def _pct(v) -> str:
    return "-" if v is None else f"{v:.1%}"


def _num(v, fmt=".2f") -> str:
    return "-" if v is None else format(v, fmt)


def format_report(report: dict) -> str:
    head = (
        f"{'layer':<6}{'kind':<12}{'routed':>8}{'MLP/tok':>8}{'experts':>8}{'max/mean':>9}{'CV':>7}"
        f"{'dropped':>8}{'no-op':>7}{'entropy':>11}{'causal':>8}"
    )
    lines = ["Load balance per layer (evaluation batches)", head, "-" * len(head)]
    for layer in report["layers"]:
        moe = layer["routers"].get("moe", {})
        ent = moe.get("entropy")
        ent_cell = "-" if ent is None else f"{ent:.2f}/{moe['max_entropy']:.2f}"
        lines.append(
            f"{layer['layer']:<6}{layer['kind']:<12}{_pct(layer.get('routed_frac')):>8}"
            f"{_num(layer.get('mlp_per_token')):>8}{moe.get('num_experts', '-'):>8}{_num(moe.get('max_mean')):>9}"
            f"{_num(moe.get('cv')):>7}{_pct(moe.get('dropped_frac') if moe else None):>8}"
            f"{_pct(moe.get('noop_share') if moe else None):>7}"
            f"{ent_cell:>11}"
            f"{_pct(layer.get('causal_accuracy')):>8}"
        )
    t = report["token_compute"]
    p = t["flops_hist"]["percentiles"]
    lines += [
        "",
        "Per-token compute",
        f"  blocks traversed per token {t['blocks_per_token']:.3f}   MLP assignments per token "
        f"{t['mlp_per_token']:.3f}",
        f"  forward FLOPs per token {t['flops_per_token']:.4g} ({t['flops_vs_dense']:.1%} of dense "
        f"{t['dense_flops_per_token']:.4g}); p10 {p['p10']:.4g}  median {p['p50']:.4g}  p90 {p['p90']:.4g}",
        "  share of tokens by blocks traversed: "
        + "  ".join(f"{k}: {v:.1%}" for k, v in enumerate(t["blocks_hist"]) if v > 0),
    ]
    dense = t["dense_flops_per_token"]
    for what, key, label in (
        ("Bytes", "top_bytes", "text"),
        ("Words", "top_words", "word"),
        ("Tokens", "top_tokens", "text"),
    ):
        if key not in report:  # bytes and words, or tokens
            continue
        block = report[key]
        for side in ("most", "least"):
            lines += [
                "",
                f"{what} with the {side} compute (mean per occurrence, seen >= {block['min_count']} times)",
                f"  {what[:-1].lower():<16}{'FLOPs/token':>12}{'vs dense':>9}{'blocks':>8}{'n':>7}",
            ]
            lines += [
                f"  {str(r[label])[:16]:<16}{r['mean_flops']:>12.4g}{r['mean_flops'] / dense:>9.1%}"
                f"{r['mean_blocks']:>8.2f}{r['count']:>7}"
                for r in block[side]
            ] or ["  none"]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- plots


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_compute_hist(report: dict, path: Path) -> None:
    plt = _plt()
    t = report["token_compute"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key, label in (
        (axes[0], "blocks_hist", "blocks traversed (attention)"),
        (axes[1], "mlp_hist", "MLP / expert assignments"),
    ):
        frac = t[key]
        ax.bar(range(len(frac)), frac, color="tab:blue")
        ax.set_xlabel(label)
        ax.set_ylabel("share of tokens")
        ax.grid(alpha=0.3, axis="y")
    h = t["flops_hist"]
    edges = np.array(h["edges"]) / t["dense_flops_per_token"]
    axes[2].bar(edges[:-1], h["frac"], width=np.diff(edges), align="edge", color="tab:orange")
    axes[2].axvline(t["flops_vs_dense"], color="k", ls="--", lw=1, label=f"mean {t['flops_vs_dense']:.2f}")
    axes[2].set_xlabel("forward FLOPs per token / dense")
    axes[2].legend()
    axes[2].grid(alpha=0.3, axis="y")
    fig.suptitle(f"Per-token compute over {report['data']['tokens']:,} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_heatmap(report: dict, path: Path) -> None:
    plt = _plt()
    hm = report["heatmap"]
    data = np.array([[np.nan if v is None else v for v in row] for row in hm["routed_frac"]], dtype=float)
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(data) + 1.8))
    im = ax.imshow(data, aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
    ax.set_yticks(range(len(data)), hm["layers"])
    buckets = hm["position_buckets"]
    step = max(1, len(buckets) // 8)
    ax.set_xticks(range(0, len(buckets), step), [str(buckets[b][0]) for b in range(0, len(buckets), step)])
    ax.set_xlabel("position in sequence (bucket start)")
    ax.set_ylabel("layer")
    ax.set_title("Fraction of tokens taking each layer's routed path")
    fig.colorbar(im, ax=ax, label="routed fraction")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_expert_load(report: dict, path: Path) -> None:
    """One bar chart per router, with headroom above the tallest bar; one legend for all of them, above the
    panels (inside a panel it covered bars)."""
    plt = _plt()
    panels = [(layer, part, r) for layer in report["layers"] for part, r in layer["routers"].items()]
    n = max(1, len(panels))
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    if not panels:
        axes[0][0].text(0.5, 0.5, "no routed layers", ha="center", va="center")
    legend: dict = {}  # label -> handle, in the order first drawn
    for ax, (layer, part, r) in zip(axes.flat, panels):
        tokens = max(r["tokens"], 1.0)
        E, X = r["num_experts"], len(r["requested"])
        kept = np.array(r["kept"]) / tokens
        req = np.array(r["requested"]) / tokens
        tallest = float(req.max()) if req.size else 0.0
        if r["mod"]:  # requested = [routed, skipped]
            ax.bar([0, 1], req, color=["tab:blue", "tab:gray"])
            ax.set_xticks([0, 1], ["block", "skip"])
        else:
            drawn = [
                ax.bar(range(E), kept, color="tab:blue", label="computed"),
                ax.bar(range(E), req[:E] - kept, bottom=kept, color="tab:red", label="dropped"),
            ]
            if X > E:
                drawn.append(ax.bar(range(E, X), req[E:], color="tab:gray", label="no-op"))
            uniform = req.sum() / X
            drawn.append(ax.axhline(uniform, color="k", ls="--", lw=1, label="uniform"))
            tallest = max(tallest, uniform)
            for h in drawn:
                legend.setdefault(h.get_label(), h)
            ax.set_xticks(range(X), [str(e) for e in range(E)] + [f"n{j}" for j in range(X - E)])
        ax.set_ylim(0, 1.15 * tallest if tallest > 0 else 1.0)  # headroom: no bar touches the frame
        ax.set_title(f"layer {layer['layer']} {layer['kind']} ({part})", fontsize=9)
        ax.set_ylabel("assignments per token")
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    if legend:
        fig.legend(
            legend.values(),
            legend.keys(),
            loc="lower center",
            bbox_to_anchor=(0.5, 1.0),
            ncol=len(legend),
            fontsize=8,
            frameon=False,
        )
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- command


def run_report(
    checkpoint: str | Path,
    data: str | None = None,
    out: str | Path | None = None,
    batches: int = 8,
    batch_size: int | None = None,
    causal_routing: bool = False,
    top: int = 10,
    quiet: bool = False,
    force: bool = False,
) -> dict:
    """Load ``checkpoint`` (written by ``mode.train.Trainer``: a file or a sharded folder; read without running
    code from it, see ``mode.train.checkpoint``), evaluate it on the validation split of ``data`` (a text file or
    a folder of token shards; default: the token folder the checkpoint was trained on, else the built-in corpus)
    and write the report into ``out`` (default: ``<ckpt dir>/report``), whose report files must not exist yet
    unless ``force`` (``OutputExistsError``, a ValueError: checked before the checkpoint is read)."""
    from mode import _checks
    from mode.train.checkpoint import atomic_write_text, load_model, prepare_dir, refuse_existing
    from mode.train.data import eval_batches
    from mode.train.sources import load_corpus

    _checks.check_int("batches", batches)
    if batch_size is not None:
        _checks.check_int("batch_size", batch_size)
    ckpt = Path(checkpoint)
    if not ckpt.exists():
        raise ValueError(f"checkpoint={str(checkpoint)!r}: no such file or folder")
    out_dir = Path(out) if out is not None else ckpt.parent / "report"
    files = {
        "json": out_dir / "report.json",
        "compute_hist": out_dir / "compute_hist.png",
        "heatmap": out_dir / "routing_heatmap.png",
        "expert_load": out_dir / "expert_load.png",
    }
    if os.path.lexists(out_dir) and not out_dir.is_dir():
        raise ValueError(f"out={str(out_dir)!r}: is a file, not a folder")
    if not force:
        refuse_existing(files.values())
    model, state = load_model(ckpt)
    cfg = model.cfg
    bs = batch_size or _checks.check_int(
        f"checkpoint {str(ckpt)!r}: train_cfg.batch_size", state.get("train_cfg", {}).get("batch_size", 8)
    )
    record = state.get("data") or {}
    if not data and record.get("kind") == "tokens":  # a model of token ids is evaluated on its own shards
        data = cast(str, record["path"])  # a tokens record names its folder
        if not Path(data).is_dir():
            raise ValueError(
                f"checkpoint {str(ckpt)!r}: trained on the token shards in {data!r}, which are "
                "missing; pass --data FOLDER (shards of the same tokenizer)"
            )
    corpus = load_corpus(data or None, cfg.seq_len)
    if corpus.vocab_size > cfg.vocab_size:
        raise ValueError(
            f"data={str(data)!r}: ids up to {corpus.vocab_size - 1} ({corpus.source}), the checkpoint's "
            f"model has vocab_size={cfg.vocab_size}; evaluate it on the data it was trained on"
        )
    windows = eval_batches(corpus.val, bs, cfg.seq_len, batches)
    label = None
    if corpus.path is not None:  # token ids: named by the shards' tokenizer (by number when they have none)
        from mode.train.tokens import load_tokenizer

        tok = None if corpus.tokenizer is None else load_tokenizer(corpus.tokenizer.path)
        label = (
            (lambda i: f"#{i}") if tok is None else (lambda i: repr(tok.decode([i], skip_special_tokens=False)))
        )  # quoted: spaces and \n show
    report, _ = build_report(model, windows, causal_routing=causal_routing, top=top, token_label=label)
    report["checkpoint"] = {"path": str(ckpt), "step": state.get("step")}
    report["data"]["source"] = corpus.source
    prepare_dir(out_dir, "out")
    report["files"] = {k: str(v) for k, v in files.items()}
    atomic_write_text(files["json"], json.dumps(report, indent=2))
    plot_compute_hist(report, files["compute_hist"])
    plot_heatmap(report, files["heatmap"])
    plot_expert_load(report, files["expert_load"])
    if not quiet:
        print(format_report(report))
        print("\nwrote " + ", ".join(str(p) for p in files.values()))
    return report

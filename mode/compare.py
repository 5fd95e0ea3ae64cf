"""`mode compare`: dense, MoD, random-routing MoD, MoE, staged and integrated MoDE trained to the same
training-FLOP budget on the same data, then compared on held-out loss.

The budget is ``dense_steps`` steps of the dense model; every other variant gets
``round(budget / its nominal training FLOPs per step)`` steps, so cheaper variants train on more tokens.
FLOPs actually spent (from the realized routing) are logged too.

A run survives being killed (docs/checkpoints.md): ``OUT/compare_run.json`` records the arguments, each
variant checkpoints every ``ckpt_every_s`` seconds and writes ``OUT/<variant>/result.json`` when done. A
rerun with the same arguments skips the finished variants, resumes the interrupted one from its last
checkpoint and ends with the same numbers as an uninterrupted run; other arguments are refused (name the
difference) unless ``fresh``.
"""

from __future__ import annotations

import io
import json
import platform
import zlib
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from mode import _checks, checkpoint
from mode.data import Corpus, file_corpus, min_file_bytes, stdlib_corpus
from mode.flops import forward_flops_per_token, train_flops_per_token
from mode.model import LMConfig, alternate
from mode.model.causal_eval import causal_eval
from mode.train import Trainer, TrainConfig


@dataclass
class ComparePreset:
    model: LMConfig
    train: TrainConfig
    dense_steps: int
    max_corpus_bytes: int | None


def preset(quick: bool) -> ComparePreset:
    if quick:  # a few minutes on 2 CPU cores
        model = LMConfig(seq_len=128, d_model=64, n_heads=2, d_hidden=256, layers=("dense",) * 4, num_experts=4)
        train = TrainConfig(batch_size=8, lr=3e-3, warmup_steps=20, eval_every=50, eval_batches=4, log_every=10)
        return ComparePreset(model, train, dense_steps=150, max_corpus_bytes=3_000_000)
    model = LMConfig(seq_len=256, d_model=128, n_heads=4, d_hidden=512, layers=("dense",) * 6, num_experts=8)
    train = TrainConfig(batch_size=8, lr=3e-3, warmup_steps=50, eval_every=100, eval_batches=16, log_every=10)
    return ComparePreset(model, train, dense_steps=1200, max_corpus_bytes=None)


def variants(base: LMConfig, causal: str = "predictor") -> dict[str, LMConfig]:
    """The six models, all of the same width and depth. Learned MoD routers also train the causal
    method ``causal`` so they can sample (random routing has nothing to predict)."""
    n = base.n_layers
    return {
        "dense": replace(base, layers=("dense",) * n),
        "mod": replace(base, layers=alternate(n, "dense", "mod"), causal=causal),
        "mod_random": replace(base, layers=alternate(n, "dense", "mod_random"), causal="none"),
        "moe": replace(base, layers=("moe",) * n),
        "staged_mode": replace(base, layers=alternate(n, "moe", "staged"), causal=causal),
        "integrated_mode": replace(base, layers=("integrated",) * n, num_noop=base.num_experts),
    }


def extra_variants(base: LMConfig, causal: str = "predictor") -> dict[str, LMConfig]:
    """Variants trained only when named in ``only`` (not part of the default six): staged and integrated
    MoDE paired at matching per-token FLOPs, each pair sending the same nominal share of tokens to work.

    ``integrated_mode_matched``: integrated MoDE with 7 no-op experts per real expert, so that under
    balanced routing 1/8 of the tokens reach an MLP expert, as 1/8 of the tokens pass staged MoDE's
    capacity (per-token FLOPs 0.60 of dense at the default preset, staged MoDE's are 0.58).
    ``staged_mode_matched``: staged MoDE at capacity 0.5, the share of tokens that the default integrated
    MoDE (as many no-ops as experts) sends to a real expert (0.74 of dense per token; integrated 0.76).
    """
    n = base.n_layers
    return {
        "integrated_mode_matched": replace(base, layers=("integrated",) * n, num_noop=7 * base.num_experts),
        "staged_mode_matched": replace(base, layers=alternate(n, "moe", "staged"), capacity=0.5, causal=causal),
    }


def _routing_summary(history: list[dict]) -> dict:
    last = [r for r in history if "routing" in r]
    return last[-1]["routing"] if last else {}


RUN_FILE = "compare_run.json"  # the arguments of the run in OUT: a rerun resumes only with the same ones
RESULT_FILE = "result.json"  # OUT/<variant>/result.json: written when the variant is done
DEFAULT_CKPT_EVERY_S = 300.0
_OUTPUTS = ("compare.json", "compare.md", "val_loss_vs_flops.png")


def run_compare(out_dir: str | Path, quick: bool = False, data: str | None = None, seed: int = 0,
                dense_steps: int | None = None, only: list[str] | None = None, progress: bool = True,
                causal: str = "predictor", ckpt_every_s: float = DEFAULT_CKPT_EVERY_S, fresh: bool = False) -> dict:
    """Train the variants at equal training FLOPs into ``out_dir`` and return the report (also written as
    ``compare.json``). Checkpoints every ``ckpt_every_s`` seconds (0: only when a variant ends); resumes a
    killed run of the same arguments found in ``out_dir``, or starts over when ``fresh``."""
    p = preset(quick)
    base = p.model
    models = variants(base, causal)
    extras = extra_variants(base, causal)
    if dense_steps is not None:
        _checks.check_int("dense_steps", dense_steps)
    if ckpt_every_s != 0:
        _checks.check_positive("ckpt_every_s", ckpt_every_s)
    unknown = [name for name in only or () if name not in models and name not in extras]
    if unknown:  # a typo must not silently train nothing
        raise ValueError(f"only={only!r}: unknown variant {unknown[0]!r}; must be among "
                         f"{', '.join([*models, *extras])}")
    all_names = [*models, *extras]
    models.update({name: cfg for name, cfg in extras.items() if name in (only or ())})
    selected = {name: cfg for name, cfg in models.items() if not only or name in only}
    steps_dense = p.dense_steps if dense_steps is None else dense_steps  # 0 is an error, not "the default"
    out = checkpoint.prepare_dir(out_dir, "out")  # bad output folders fail before any training
    for name in selected:
        checkpoint.prepare_dir(out / name, "out")
    corpus: Corpus = (file_corpus(data, min_file_bytes(base.seq_len)) if data
                      else stdlib_corpus(max_bytes=p.max_corpus_bytes))
    identity = {"quick": quick, "data": None if data is None else str(Path(data).resolve()), "seed": seed,
                "dense_steps": steps_dense, "only": sorted(only) if only else None, "causal": causal,
                "corpus": _fingerprint(corpus), "model": asdict(base),
                "train": {k: v for k, v in asdict(p.train).items() if k != "ckpt_every_s"}}
    resume = _start_or_resume(out, identity, fresh, all_names)
    tokens_per_step = p.train.batch_size * base.seq_len
    budget = steps_dense * train_flops_per_token(models["dense"]) * tokens_per_step
    dense_fwd = forward_flops_per_token(models["dense"])
    results = {}
    for name, cfg in selected.items():
        result_path = out / name / RESULT_FILE
        if resume and result_path.is_file():
            results[name] = _read_result(result_path)
            print(f"{name}: done in an earlier run, results from {result_path}", flush=True)
            continue
        steps = max(1, round(budget / (train_flops_per_token(cfg) * tokens_per_step)))
        tcfg = replace(p.train, steps=steps, seed=seed, warmup_steps=min(p.train.warmup_steps, steps // 5),
                       ckpt_every_s=ckpt_every_s or None)
        trainer = Trainer(cfg, tcfg, corpus, out / name, name=name, progress=progress)
        if resume and trainer.ckpt_path.is_file():
            try:
                trainer.load()  # the arguments matched: this checkpoint belongs to this run
            except ValueError as e:
                raise ValueError(f"{e}; pass --fresh to start over") from None
            print(f"{name}: resuming at step {trainer.step} of {steps} from {trainer.ckpt_path}", flush=True)
        history = trainer.run()
        vals = [r for r in history if "val_loss" in r]
        results[name] = {
            "layers": list(cfg.layers), "steps": steps, "params": trainer.model.num_params(),
            "val_loss": vals[-1]["val_loss"], "train_flops": trainer.flops, "tokens": trainer.tokens,
            "fwd_flops_per_token": forward_flops_per_token(cfg), "wall_s": trainer.elapsed,
            "tok_s": trainer.tokens / trainer.wall, "curve": [(r["flops"], r["val_loss"]) for r in vals],
            "routing": _routing_summary(history),
            "causal": causal_eval(trainer.model, trainer.val_batches) if cfg.causal != "none" else None,
        }
        checkpoint.atomic_write_text(result_path, json.dumps(results[name], indent=2))
    for r in results.values():
        if "dense" in results:
            r["loss_ratio"] = r["val_loss"] / results["dense"]["val_loss"]
        r["flop_ratio"] = r["fwd_flops_per_token"] / dense_fwd
    report = {"config": {"quick": quick, "seed": seed, "dense_steps": steps_dense, "budget_flops": budget,
                         "corpus": corpus.source, "model": asdict(base), "train": asdict(p.train)},
              "machine": {"torch": torch.__version__, "threads": torch.get_num_threads(),
                          "platform": platform.platform()},
              "results": results}
    # each file appears whole or not at all: a crash here never leaves a half report that looks complete
    checkpoint.atomic_write_text(out / "compare.json", json.dumps(report, indent=2))
    checkpoint.atomic_write_text(out / "compare.md", markdown_table(results) + "\n")
    print(format_table(results))
    plot_curves(results, out / "val_loss_vs_flops.png")
    print(f"\nwrote {out / 'compare.json'} and {out / 'val_loss_vs_flops.png'}")
    return report


def _fingerprint(corpus: Corpus) -> dict:
    """Sizes and CRC32 of the training and validation bytes: a rerun must train on the same text."""
    return {"train_bytes": len(corpus.train), "val_bytes": len(corpus.val),
            "crc32": zlib.crc32(corpus.val.tobytes(), zlib.crc32(corpus.train.tobytes()))}


def _differences(saved, now, prefix: str = "") -> list[tuple[str, object, object]]:
    """(dotted key, saved value, new value) for every leaf that differs."""
    if isinstance(saved, dict) and isinstance(now, dict):
        out = []
        for key in [*saved, *(k for k in now if k not in saved)]:
            out += _differences(saved.get(key), now.get(key), f"{prefix}{key}.")
        return out
    return [] if saved == now else [(prefix[:-1], saved, now)]


def _start_or_resume(out: Path, identity: dict, fresh: bool, names: list[str]) -> bool:
    """True: resume the run recorded in ``out`` (same arguments). False: start over, after removing what an
    earlier run left there, so that nothing stale is resumed or shown as this run's result."""
    run_file = out / RUN_FILE
    identity = json.loads(json.dumps(identity))  # as stored: tuples are lists
    if run_file.is_file() and not fresh:
        try:
            saved = json.loads(run_file.read_text())
            saved_args = saved["args"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{run_file}: not a readable record of a compare run ({type(e).__name__}: {e}); "
                             "pass --fresh to start over") from None
        diffs = _differences(saved_args, identity)
        if diffs:
            key, was, now = diffs[0]
            more = f" (and {len(diffs) - 1} more)" if len(diffs) > 1 else ""
            raise ValueError(f"out={str(out)!r} holds a run with other arguments: {key}={was!r} there, "
                             f"{key}={now!r} now{more} (recorded in {run_file}). Rerun with the same arguments "
                             "to resume it, pass --fresh to discard it and start over, or choose another --out")
        return True
    for path in [run_file, *(out / f for f in _OUTPUTS),
                 *(out / name / f for name in names for f in ("ckpt.pt", RESULT_FILE))]:
        path.unlink(missing_ok=True)
    checkpoint.atomic_write_text(run_file, json.dumps({"format": "mode-compare-run", "version": 1,
                                                       "args": identity}, indent=2))
    return False


def _read_result(path: Path) -> dict:
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: unreadable result of a finished variant ({e}); pass --fresh to start over") \
            from None
    if not isinstance(result, dict) or "val_loss" not in result or "curve" not in result:
        raise ValueError(f"{path}: not the result of a finished variant; pass --fresh to start over")
    return result


# One spec for both tables: (key, where it lives, text header, text width, format, Markdown header).
# A None width leaves the column out of the terminal table, a None Markdown header out of compare.md.
_COLUMNS = (
    ("val_loss", "result", "val loss", 9, ".4f", "val loss"),
    ("loss_ratio", "result", "vs dense", 9, ".4f", "vs dense"),
    ("fwd_flops_per_token", "result", "fwd FLOP/tok", 14, ".3e", "fwd FLOP/token"),
    ("flop_ratio", "result", "vs dense", 9, ".3f", "vs dense"),
    ("params", "result", "params", 10, ",", "params"),
    ("steps", "result", "steps", 7, "", "steps"),
    ("tokens", "result", None, None, ",", "tokens"),
    ("wall_s", "result", "wall s", 8, ".1f", None),
    ("tok_s", "result", "tok/s", 8, ",.0f", None),
    ("causal_accuracy", "causal", "causal acc", 11, ".1%", "causal acc"),
    ("routed_fraction", "causal", "routed", 8, ".1%", "routed"),
    ("ar_gap", "causal", "AR gap", 8, "+.2%", "AR gap"),
    # load balance and compute from the last logged "routing" record (training batches; docs/reports.md)
    ("max_mean", "routing", "max/mean", 9, ".2f", "max/mean load"),
    ("dropped_frac", "routing", "dropped", 8, ".1%", "dropped"),
    ("noop_share", "routing", "no-op", 7, ".1%", "no-op"),
    ("blocks_per_token", "routing", "blocks/tok", 11, ".2f", "blocks/token"),
)


def _cell(r: dict, key: str, where: str, fmt: str, missing: str) -> str:
    source = {"result": r, "causal": r.get("causal") or {},
              "routing": (r.get("routing") or {}).get("overall", {})}[where]
    v = source.get(key)
    return missing if v is None else format(v, fmt)


def format_table(results: dict) -> str:
    """The comparison as the fixed-width table `mode compare` prints."""
    cols = [c for c in _COLUMNS if c[3] is not None]
    first = max([16, *(len(name) + 1 for name in results)])
    head = f"{'variant':<{first}}" + "".join(f"{c[2]:>{c[3]}}" for c in cols)
    lines = [head, "-" * len(head)]
    for name, r in results.items():
        lines.append(f"{name:<{first}}" + "".join(_cell(r, key, where, fmt, "-").rjust(width)
                                               for key, where, _, width, fmt, _ in cols))
    return "\n".join(lines)


def markdown_table(results: dict) -> str:
    """The comparison as a Markdown table (written as compare.md, pasted into docs)."""
    cols = [c for c in _COLUMNS if c[5] is not None]
    lines = ["| variant | " + " | ".join(c[5] for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, r in results.items():
        cells = [_cell(r, key, where, fmt, "–") for key, where, _, _, fmt, _ in cols]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_curves(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in results.items():
        xs, ys = zip(*r["curve"])
        ax.plot(xs, ys, marker="o", ms=3, label=name)
    ax.set_xlabel("training FLOPs")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_title("Validation loss at equal training FLOPs")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    checkpoint.atomic_write(path, buf.getvalue())

"""Memory of fitting every layer's skip estimate at once: from running sums against from the tokens themselves.

    python benchmarks/hf/estimate_memory.py           # SmolLM2-135M-Instruct, 64 fit windows of 256, all 30 layers
    python benchmarks/hf/estimate_memory.py --smoke   # the tiny random Llama of heal_vs_prune --smoke

``skip_costs(estimate_rank=R)`` and ``prune_layers(estimate_rank=R)`` fit a ``SkipUpdate`` for every chosen
layer from one forward per batch (``layer_io.layer_estimates``). Three ways, each in a fresh process (one
thread): ``moments``, each layer keeps the running sums of its tokens (``UpdateMoments``) and
``SkipUpdate.fit_moments`` fits from them (what the library does); ``tokens``, each layer keeps every real
token's input and update and ``SkipUpdate.fit`` (the reference) fits on their concatenation (what it did
before); ``forward``, the same forwards and hooks with nothing kept (the floor). Each reports the growth of the
resident set from just before to the peak (Linux ``VmHWM``, reset first) and the seconds; the memory ratio is
of the growth above the floor. Then the two fits are compared: the largest difference of the map each layer's
estimate applies (``down @ up``, ``bias``) relative to its size. Writes ``--out`` (default
``benchmarks/results/estimate_memory.json``) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere without installing
    sys.path.insert(0, str(ROOT))

from benchmarks.common import machine_info, proc_status_bytes  # noqa: E402
from benchmarks.hf.heal_vs_prune_models import load_original  # noqa: E402
from mode.hf.dense.layer_io import layer_estimates, part_io  # noqa: E402
from mode.hf.dense.skip_update import SkipUpdate  # noqa: E402
from mode.hf.dense.windows import batches_of, english_windows  # noqa: E402
from mode.train.checkpoint import atomic_write_text  # noqa: E402

WAYS = ("forward", "tokens", "moments")


def fit_by_tokens(model, batches, chosen, rank) -> dict[int, SkipUpdate]:
    """The reference: every chosen layer's inputs and updates held, each fitted on their concatenation."""
    data: dict[int, list] = {i: [] for i in chosen}
    part_io(model, batches, chosen, "layer", lambda i, x_ND, u_ND: data[i].append((x_ND, u_ND)))
    out = {}
    for i in chosen:
        x_ND, u_ND = (torch.cat(t) for t in zip(*data[i]))
        out[i] = SkipUpdate(model.config.hidden_size, rank)
        out[i].fit(x_ND, u_ND)
    return out


def forward_only(model, batches, chosen, rank) -> dict[int, SkipUpdate]:
    """The floor: the same forwards and hooks, nothing kept, nothing fitted."""
    part_io(model, batches, chosen, "layer", lambda i, x_ND, u_ND: None)
    return {}


def child(args) -> None:
    """One way, in this (fresh) process: write the estimates' maps (safetensors) and a JSON of the memory."""
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    model, tokenizer, _ = load_original(args.smoke)
    train_WS, _ = english_windows(tokenizer, args.seq_len)
    batches = batches_of(train_WS[: args.fit_windows], 8)
    chosen = list(range(model.config.num_hidden_layers))
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM, the peak resident set, to the current one
        reset = True
    except OSError:  # not allowed here: the peak may be an earlier one (loading), the growth a lower bound
        reset = False
    before = proc_status_bytes("VmRSS")
    t0 = time.perf_counter()
    fit = {"forward": forward_only, "tokens": fit_by_tokens, "moments": layer_estimates}[args.way]
    with torch.no_grad():
        est = fit(model, batches, chosen, args.rank)
    seconds = time.perf_counter() - t0
    peak = proc_status_bytes("VmHWM")
    maps = {f"{i}.a": (e.down @ e.up).detach().contiguous() for i, e in est.items()}
    maps.update({f"{i}.bias": e.bias.detach().contiguous() for i, e in est.items()})
    if maps:
        save_file(maps, f"{args.child_out}.safetensors")
    tokens = sum(int(b.numel()) for b in batches)
    doc = {"way": args.way, "growth_mib": (peak - before) / 2**20, "seconds": seconds, "layers": len(chosen)}
    doc.update(tokens=tokens, hidden=model.config.hidden_size, peak_reset=reset)
    Path(f"{args.child_out}.json").write_text(json.dumps(doc))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="the tiny random Llama, 8 fit windows of 64")
    p.add_argument("--fit-windows", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--rank", type=int, default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)  # internal: run one way in this process
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    defaults = dict(fit_windows=8, seq_len=64, rank=8) if args.smoke else dict(fit_windows=64, seq_len=256, rank=64)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.way:
        child(args)
        return {}
    from safetensors.torch import load_file

    rows, maps = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for way in WAYS:
            cmd = [sys.executable, __file__, "--way", way, "--child-out", f"{tmp}/{way}"]
            cmd += ["--fit-windows", str(args.fit_windows), "--seq-len", str(args.seq_len), "--rank", str(args.rank)]
            subprocess.run(cmd + (["--smoke"] if args.smoke else []), check=True, timeout=3600)
            rows[way] = json.loads(Path(f"{tmp}/{way}.json").read_text())
            maps[way] = load_file(f"{tmp}/{way}.safetensors") if way != "forward" else {}
    rel = max(
        float((maps["moments"][k] - maps["tokens"][k]).abs().max() / maps["tokens"][k].abs().max().clamp_min(1e-30))
        for k in maps["tokens"]
    )
    floor = rows["forward"]["growth_mib"]
    ratio = (rows["tokens"]["growth_mib"] - floor) / max(rows["moments"]["growth_mib"] - floor, 1e-9)
    t = rows["tokens"]
    print(f"{t['layers']} layers, {t['tokens']} fit tokens, hidden {t['hidden']}, rank {args.rank}")
    print(f"{'way':<8} {'peak growth MiB':>16} {'seconds':>8}")
    for way, r in rows.items():
        print(f"{way:<8} {r['growth_mib']:>16.1f} {r['seconds']:>8.1f}")
    print(f"memory above the forward's, tokens ÷ moments: {ratio:.1f}x")
    print(f"largest relative difference of the maps: {rel:.2e}")
    doc = {"settings": {k: v for k, v in vars(args).items() if k not in ("out", "way", "child_out")}}
    doc.update(machine=machine_info(), rows=list(rows.values()), memory_ratio=ratio, max_rel_map_diff=rel)
    out = args.out or f"benchmarks/results/estimate_memory{'_smoke' if args.smoke else ''}.json"
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(doc, indent=2) + "\n")
    return doc


if __name__ == "__main__":
    main()

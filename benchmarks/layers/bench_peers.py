"""Peer benchmark: mode's MoE layer against the MoE blocks people already use, side by side in one process.

    PYTHONPATH=. python benchmarks/layers/bench_peers.py --threads 1    # the table in docs/performance.md (~5 min)
    PYTHONPATH=. python benchmarks/layers/bench_peers.py --quick        # tiny sizes, seconds (the smoke test)
    PYTHONPATH=. python benchmarks/layers/bench_peers.py --device cuda  # the same on a GPU (cuda:N, auto also work)
    PYTHONPATH=. python benchmarks/layers/bench_peers.py --threads 1 --precision bf16  # mixed precision (peers_bf16)
    PYTHONPATH=. python benchmarks/layers/bench_peers.py --threads 1 --families  # transformers' blocks vs ours
    PYTHONPATH=. python benchmarks/layers/bench_peers.py --threads 1 --families --precision bf16

``--families``: one transformers block per router kind (Qwen3-MoE, Qwen2-MoE, DeepSeek-V3, DeepSeek-V2,
ERNIE-4.5, LFM2-MoE, Granite-MoE, gpt-oss, Llama-4, LongCat-Flash; ``experts_implementation="grouped_mm"``
where the family has it, random weights) against mode's layer configured as each
(``mode.hf.moe.blocks.from_block``: the same function, checked before timing); ratio = mode's time / the
block's in the same round, float32 or both under bfloat16 autocast. Writes peers_families[_bf16].json.

Implementations (D=512, 4096 tokens, top-2 SwiGLU experts, float32; 8 experts of hidden 1024 and 64 of 256):
    mode            ``MoELayer`` (token choice, softmax, top-2, renormalised), backend "auto" and "reference",
                    as shipped: its load-balancing and z-loss are computed and back-propagated
    transformers    ``MixtralSparseMoeBlock`` and ``Qwen3MoeSparseMoeBlock`` built from small configs with
                    random weights (nothing is downloaded), ``experts_implementation="grouped_mm"``
    torchtitan      ``torchtitan.models.common.moe.MoE`` (softmax scores, ``route_norm``, top-2) as shipped,
                    whose grouped experts cast to bfloat16, and the same with its expert matmuls kept in
                    float32 (its ``.bfloat16()`` casts turned into no-ops while its experts run)
    liger           liger-kernel's fused MoE (``liger_kernel.ops.fused_moe.LigerFusedMoEFunction``, Triton: CUDA
                    only) behind the same softmax top-2 routing, in the autocast dtype (bfloat16) or the
                    input's; its TF32/bfloat16 dots are reported against mode's output, not judged in float32
    dense           ``mode.MLP(D, 2H, "swiglu")``: the dense MLP with the same active FLOPs, the baseline
    mode + recipes  the same layer with the DeepSeek-V3 routing options that add no FLOPs switched on: bias
                    balancing (a zero bias: the same choices) and the sequence-wise balance loss; and with 4
                    expert groups of which each token keeps 2 (other choices: its agreement is not judged)
Every implementation gets the same weights, copied from mode's layer into each peer's layout, so every
one routes alike (softmax over the experts, top-2, the two gates renormalised to sum to 1: Mixtral's
convention). Before anything is timed, each output and input gradient (of ``<y, g>``) is compared with
mode's; the max absolute differences go into the table and the JSON.

Timing: forward + backward, every implementation and the dense MLP run once per round in a rotating order
(``benchmarks/common.py: time_interleaved``), ratio = time / the dense MLP's time in the same round, median
over the rounds after a warm-up. Writes benchmarks/results/peers.json and peers.png (``--out``).

``--precision bf16``: every implementation and the dense baseline run under ``torch.autocast(bfloat16)``
with float32 weights (mode's trainer with ``--bf16``; torchtitan as shipped casts its experts to bfloat16
itself, its float32 variant is left out; transformers' blocks also run with bfloat16 weights, as a model
loaded in bfloat16 does, since autocast leaves their ``torch._grouped_mm`` in float32), beside mode's layer
and the dense MLP in float32 (no autocast).
Agreement is then measured against mode's float32 output, relative to its largest value, and each row also
gets its time / mode's float32 time in the same round.

Peers are optional (``pip install "mode-torch[peers]"``); one that does not import is skipped, and the
table and the JSON say why. torchtitan 0.3 imports triton when it loads; CUDA builds of torch bring it,
CPU builds do not (``pip install triton`` then).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere without installing
    sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    add_device_arg,
    add_malloc_arg,
    apply_malloc,
    apply_run_args,
    machine_info,
    print_table,
    save_figure,
    time_interleaved,
    write_json,
)
from benchmarks.layers.peers_families import main_families  # noqa: E402
from benchmarks.layers.peers_impls import (  # noqa: E402
    FLOAT32_TOL,
    TOP_K,
    Impl,
    _rebuild_mode,
    _version,
    bf16_weights,
    build_mode,
    liger_impls,
    make_step,
    max_abs_diff,
    torchtitan_impls,
    transformers_impls,
)
from mode import MLP  # noqa: E402

FULL = dict(tokens=4096, d_model=512, configs=((8, 1024), (64, 256)), warmup=3, repeats=9)


QUICK = dict(tokens=256, d_model=64, configs=((4, 64), (16, 16)), warmup=1, repeats=3)


# bf16 implementations must agree with mode's float32 output to this, relative to its largest value (bf16 has
# 8 significant bits: ~4e-3 per rounding, a few roundings deep)
BF16_REL_TOL = 5e-2


MODE_FP32 = "mode, auto, float32 (no autocast)"


# the routing recipes of DeepSeek-V3 (docs/routing.md) that add no FLOPs: the balancing bias (zero here, so the
# same choices) and its load counting, the sequence-wise balance loss; then also 4 expert groups of which each
# token keeps 2 (which changes the choices, so its output is reported, not judged)
RECIPE_OPTIONS = dict(bias_balance=True, balance_scope="sequence")


GROUPS = dict(n_group=4, topk_group=2)


RECIPES_SAME = "mode, auto, + bias balancing, sequence loss"


RECIPES_GROUPS = "mode, auto, + bias, sequence loss, 4 groups keep 2"


DENSE_FP32 = "dense SwiGLU MLP, float32 (no autocast)"


def bench_config(
    cfg: dict, num_experts: int, hidden: int, impls: list[Impl], device: torch.device, seed: int, bf16: bool = False
) -> list[dict]:
    d, T = cfg["d_model"], cfg["tokens"]
    tag = f"E={num_experts}, H={hidden}"
    torch.manual_seed(seed)
    x = torch.randn(1, T, d, device=device, requires_grad=True)
    g = torch.randn(1, T, d, device=device)
    torch.manual_seed(seed + 2)
    dense = MLP(d, TOP_K * hidden, activation="swiglu").to(device)
    src = build_mode(cfg, num_experts, hidden, "auto", seed + 1)

    modules: dict[str, tuple[Impl, nn.Module]] = {}
    rows: list[dict] = []
    for impl in impls:
        module = src if impl.name == "mode, auto" else impl.build(src)
        modules[impl.name] = (impl, module.to(device))

    # Agreement first: y and x.grad of <y, g> (no aux loss: the peers' blocks have none) against mode's
    # (its float32 output in bf16 mode, the differences then relative to that output's largest value)
    ref_y, ref_dx = (t.clone() for t in make_step(src, x, g, True, with_aux=False)())
    scale_y, scale_dx = (float(t.abs().max()) or 1.0 for t in (ref_y, ref_dx)) if bf16 else (1.0, 1.0)
    agreement = {}
    for name, (impl, module) in modules.items():
        y, dx = make_step(module, x, g, impl.returns_aux, with_aux=False, bf16=bf16)()
        agreement[name] = (max_abs_diff(y, ref_y) / scale_y, max_abs_diff(dx, ref_dx) / scale_dx)

    steps = {name: make_step(module, x, g, impl.returns_aux, bf16=bf16) for name, (impl, module) in modules.items()}
    steps["dense"] = make_step(dense, x, g, True, bf16=bf16)
    if bf16:  # the float32 layer and baseline, timed in the same rounds
        steps[MODE_FP32] = make_step(src, x, g, True)
        steps[DENSE_FP32] = make_step(dense, x, g, True)
        agreement[MODE_FP32] = (0.0, 0.0)
    timing = time_interleaved(steps, "dense", warmup=cfg["warmup"], repeats=cfg["repeats"], device=device)

    compute_dtype = torch.bfloat16 if bf16 else torch.float32
    backends = {"mode, auto": src.experts.backend_for(x.device, compute_dtype), MODE_FP32: src.experts.backend}
    for name, (impl, module) in modules.items():
        if impl.family == "mode":
            backends[name] = module.experts.backend_for(x.device, compute_dtype)
    kept_E = src(x)[1].stats["router"].kept_E
    fp32_s = timing[MODE_FP32]["s"] if bf16 else None
    for name, res in timing.items():
        impl = modules[name][0] if name in modules else None
        dy, ddx = agreement.get(name, (None, None))
        if name in (MODE_FP32, DENSE_FP32) or (not bf16 and (impl is None or impl.float32)):
            computes_in = "float32"
        else:
            computes_in = "bfloat16 autocast" if bf16 else "bfloat16 experts"
        if dy is None or (impl is not None and not impl.same_function):
            agrees = None  # the baselines, or a layer that routes differently by design: nothing judged
        elif computes_in == "float32":
            agrees = bool(dy <= FLOAT32_TOL and ddx <= FLOAT32_TOL)
        elif bf16:  # relative differences to mode's float32 output
            agrees = bool(dy <= BF16_REL_TOL and ddx <= BF16_REL_TOL)
        else:
            agrees = None  # torchtitan's bf16 experts in a float32 run: reported, not judged
        rows.append(
            dict(
                config=tag,
                num_experts=num_experts,
                expert_hidden=hidden,
                dense_hidden=TOP_K * hidden,
                tokens=T,
                d_model=d,
                top_k=TOP_K,
                implementation=(
                    f"dense SwiGLU MLP, hidden 2H{', bf16 autocast' if bf16 else ''} (the baseline)"
                    if name == "dense"
                    else name
                ),
                family=impl.family if impl else ("mode" if name == MODE_FP32 else "dense"),
                backend=backends.get(name),
                computes_in=computes_in,
                max_abs_diff_y=dy,
                max_abs_diff_dx=ddx,
                same_function=impl.same_function if impl else None,
                diff_is_relative=bf16 if dy is not None else None,
                agrees=agrees,
                load_max_over_mean=float(kept_E.max() / kept_E.mean()),
                ms=1e3 * res["s_median"],
                **res,
            )
        )
        if fp32_s is not None:
            rows[-1]["ratio_to_mode_float32"] = statistics.median(a / b for a, b in zip(res["s"], fp32_s))
        print(
            f"  {tag:<14} {rows[-1]['implementation']:<62} ratio {res['ratio_median']:.3f}  "
            f"|dy| {dy if dy is not None else '-'}  |dx| {ddx if ddx is not None else '-'}",
            file=sys.stderr,
            flush=True,
        )
    del modules, steps, src, dense
    gc.collect()
    return rows


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys(r["config"] for r in rows))
    names = [n for n in dict.fromkeys(r["implementation"] for r in rows) if not n.startswith("dense")]
    ratio = {(r["config"], r["implementation"]): r["ratio_median"] for r in rows}
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(names) * len(configs) + 1.6))
    height = 0.8 / len(configs)
    for j, config in enumerate(configs):
        ys = [i + j * height for i in range(len(names))]
        vals = [ratio.get((config, n), float("nan")) for n in names]
        bars = ax.barh(ys, vals, height=height, label=config)
        for y, v in zip(ys, vals):
            if v == v:
                ax.text(v, y, f" {v:.2f}", va="center", fontsize=8)
        del bars
    ax.axvline(1.0, color="k", lw=0.8, ls="--")
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(names))])
    ax.set_yticklabels(names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("fwd+bwd time / dense SwiGLU MLP of the same active FLOPs (lower is better)", fontsize=9)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes, few repeats (smoke test)")
    p.add_argument(
        "--out",
        default=None,
        help="JSON path (default benchmarks/results/peers.json, peers_quick.json with --quick); "
        "the PNG goes next to it",
    )
    p.add_argument("--repeats", type=int, default=None, help="timed rounds per configuration (after warm-up)")
    p.add_argument("--warmup", type=int, default=None, help="untimed rounds per configuration")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads(N) (default: torch's)")
    p.add_argument(
        "--experts",
        type=int,
        nargs="*",
        default=None,
        help="run only the configurations with these expert counts (e.g. --experts 64)",
    )
    p.add_argument("--tokens", type=int, default=None, help="tokens per call (default: the preset's)")
    p.add_argument("--d-model", type=int, default=None, help="model width D (default: the preset's)")
    p.add_argument(
        "--configs",
        nargs="+",
        default=None,
        metavar="E:H",
        help="expert count and expert hidden per configuration, e.g. 8:2048 64:512 (default: the "
        "preset's); the GPU suite uses sizes a GPU is not idle on",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--precision",
        choices=("float32", "bf16"),
        default="float32",
        help="bf16: everything under bfloat16 autocast, beside mode and the dense MLP in float32",
    )
    p.add_argument(
        "--families",
        action="store_true",
        help="one transformers MoE block per router kind against mode configured as each (float32, or "
        "--precision bf16)",
    )
    add_device_arg(p)
    add_malloc_arg(p)
    args = p.parse_args(argv)
    bf16 = args.precision == "bf16"
    malloc = apply_malloc(args.malloc)
    if args.families:
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        return main_families(args, args.device)
    cfg = apply_run_args(args, QUICK if args.quick else FULL)
    cfg.update(shape_overrides(args))
    configs = [c for c in cfg["configs"] if args.experts is None or c[0] in args.experts]
    if not configs:
        raise SystemExit(
            f"--experts {args.experts}: no configuration has that many experts "
            f"(configurations: {[c[0] for c in cfg['configs']]})"
        )
    device = args.device
    stem = "peers" + ("_bf16" if bf16 else "") + ("_quick" if args.quick else "")
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"{stem}.json")

    impls = [
        Impl("mode, auto", "mode", lambda src: src, returns_aux=True),
        Impl("mode, reference", "mode", lambda src: _rebuild_mode(src, "reference"), returns_aux=True),
        Impl(RECIPES_SAME, "mode", lambda src: _rebuild_mode(src, "auto", RECIPE_OPTIONS), returns_aux=True),
        Impl(
            RECIPES_GROUPS,
            "mode",
            lambda src: _rebuild_mode(src, "auto", {**RECIPE_OPTIONS, **GROUPS}),
            returns_aux=True,
            same_function=False,
        ),
    ]
    skipped = {}
    for family, loader in (
        ("transformers", transformers_impls),
        ("torchtitan", torchtitan_impls),
        ("liger", lambda: liger_impls(device)),
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # import-time deprecation chatter of the peers
            found, reason = loader()
        impls += [impl for impl in found if not (bf16 and impl.family == "torchtitan" and impl.float32)]
        if bf16 and family == "transformers":
            impls += [bf16_weights(impl) for impl in found]
        if reason is not None:
            skipped[family] = reason
            print(f"skipping {family}: {reason}", file=sys.stderr)

    info = machine_info(device)
    info["versions"] = {
        dist: _version(dist) for dist in ("mode-torch", "transformers", "torchtitan", "triton", "liger-kernel")
    }
    print(
        f"torch {info['torch']}, {info['torch_threads']} threads, {info['cpu_count']} CPUs, device {device} "
        f"({info['device_name']})",
        file=sys.stderr,
    )
    rows = []
    with warnings.catch_warnings():
        # torchtitan's router enters torch.autocast(dtype=float32), which CPU autocast rejects with a warning
        warnings.filterwarnings("ignore", message=".*autocast.*")
        for num_experts, hidden in configs:
            rows += bench_config(cfg, num_experts, hidden, impls, device, args.seed, bf16)
    if hasattr(os, "getloadavg"):
        info["loadavg_1_5_15_at_end"] = [round(v, 2) for v in os.getloadavg()]

    # the table: one row per implementation, the ratio of each configuration side by side
    tags = list(dict.fromkeys(r["config"] for r in rows))
    wide: dict[str, dict] = {}
    for r in rows:
        w = wide.setdefault(r["implementation"], {"implementation": r["implementation"]})
        w[r["config"]] = r["ratio_median"]
        if "ratio_to_mode_float32" in r:
            w[r["config"] + " vs fp32"] = r["ratio_to_mode_float32"]
        w[r["config"] + " spread"] = f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}"
        if r["max_abs_diff_y"] is not None:
            w[r["config"] + " |dy|,|dx|"] = f"{r['max_abs_diff_y']:.1e}, {r['max_abs_diff_dx']:.1e}"
    columns = [("implementation", "implementation", "")]
    for t in tags:
        columns += [(t, f"{t}: ratio", ".3f"), (t + " spread", "min-max", "")]
        if bf16:
            columns += [(t + " vs fp32", "time / mode fp32", ".3f")]
        columns += [
            (t + " |dy|,|dx|", "max |dy|, |dx| vs mode fp32, relative" if bf16 else "max |dy|, |dx| vs mode", "")
        ]
    print()
    print_table(list(wide.values()), columns)
    for family, reason in skipped.items():
        print(f"skipped {family}: {reason}")

    payload = dict(
        benchmark="bench_peers",
        command=" ".join(["bench_peers.py"] + (argv if argv is not None else sys.argv[1:])),
        config={k: (list(map(list, v)) if k == "configs" else v) for k, v in cfg.items()},
        device=str(device),
        dtype=args.precision,
        machine=info,
        malloc=malloc,
        skipped=skipped,
        notes=(
            "ratio = forward+backward wall time / the dense SwiGLU MLP's (hidden top_k * H, the same active "
            "FLOPs) in the same round, median over rounds; cpu_ratio_median: the same in process CPU time. "
            "Same weights everywhere (copied from mode's layer), so the same routing: softmax, top-2, "
            "renormalised. max_abs_diff_*: output and input gradient of <y, g> against 'mode, auto', measured "
            "before timing, without aux losses. mode is timed as shipped (its balance and z-loss included); "
            "the peers' blocks compute no aux loss."
            + (
                " bf16: the ratio's baseline is the dense MLP under bf16 autocast; ratio_to_mode_float32 = time / "
                "mode's float32 layer's in the same round; max_abs_diff_* are relative to the largest value of "
                "mode's float32 y and x.grad."
                if bf16
                else ""
            )
        ),
        results=rows,
    )
    path = write_json(out, payload)
    png = path.with_suffix(".png")
    plot(
        rows,
        png,
        f"{device} ({info['device_name']}), {info['torch_threads']} thread(s), {args.precision}, "
        f"{cfg['tokens']} tokens, d={cfg['d_model']}, top-2 SwiGLU",
    )
    print(f"\nwrote {path} and {png}", file=sys.stderr)
    return payload


def shape_overrides(args: argparse.Namespace) -> dict:
    """``--tokens``, ``--d-model`` and ``--configs E:H ...`` as preset keys; each value checked."""
    out: dict = {}
    for key in ("tokens", "d_model"):
        value = getattr(args, key)
        if value is not None:
            if value < 1:
                raise SystemExit(f"--{key.replace('_', '-')}={value}: must be >= 1")
            out[key] = value
    if args.configs is not None:
        configs = []
        for text in args.configs:
            parts = text.split(":")
            if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
                raise SystemExit(f"--configs {text!r}: must be E:H with two positive integers, e.g. 8:2048")
            configs.append((int(parts[0]), int(parts[1])))
        out["configs"] = tuple(configs)
    return out


if __name__ == "__main__":
    main()

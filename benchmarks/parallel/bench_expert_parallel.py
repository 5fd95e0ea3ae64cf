"""Expert-parallel training: bytes on the wire per all-to-all, and step time against one process.

    PYTHONPATH=. python benchmarks/parallel/bench_expert_parallel.py          # default run (a few minutes, 2 CPU cores)
    PYTHONPATH=. python benchmarks/parallel/bench_expert_parallel.py --quick  # smoke run
    PYTHONPATH=. python benchmarks/parallel/bench_expert_parallel.py --device cuda --bf16  # NCCL, one GPU per rank

``--dtype float32`` (the default) or ``bfloat16`` (``--bf16``): the trainers run with ``bf16=True``, i.e. the
forward under ``torch.autocast(bfloat16)`` with float32 weights and AdamW, as ``mode train --bf16``. Use it
on CUDA: the experts' grouped GEMM has its fast kernel in bfloat16 only (float32 takes torch's looped
fallback with a host sync per GEMM). Under autocast the forward dispatch sends the rows in the dtype they
reach the MoE layer with and the combine sends the experts' bfloat16 outputs, so each phase's minimum is
counted in the element size that phase actually sent (``row_esize`` in the JSON).

(a) Bytes. For EP = 2 and 4 ranks (gloo, CPU), a few training steps of a small LM with MoE layers,
    integrated-MoDE layers (no-op experts) and a capacity limit (dropped tokens). Every call of
    ``torch.distributed.all_to_all_single`` is intercepted and the bytes of the rows it sends to *other*
    ranks are counted (rows kept on the sending rank are copied locally and are not counted), per phase:
    forward dispatch, forward combine, backward. The minimum is computed independently, from each
    router's plan: computed (token, expert) assignments whose expert lives on another rank x D x element
    size — no-op and dropped tokens are not in the plan. Every row must cross once per direction, so
        dispatch / min = 1.00,  combine / min = 1.00,  backward / (2 x min) = 1.00
    (the backward's minimum is the dispatch's plus the combine's, 2 x min where both send one dtype)
    (the per-call dispatch ratio is checked too). The per-expert counts exchange (E int64 per rank and
    layer call) is reported separately.
(b) Step time. One training step (forward, backward, gradient all-reduce, clipping, AdamW) of the same
    LM on the same global batch: ``mode.train.Trainer`` in one process against the same ``Trainer`` on a
    (dp=1, ep=P) mesh (``mode.parallel``: experts split over the ranks, every weight also sharded by FSDP2,
    so a step also all-gathers and reduce-scatters the weights) on EP = 2 and 4 processes with 1 thread each (as
    torchrun sets by default); medians after warm-up,
    EP time is rank 0's. The single process is timed with 1 thread (the main baseline: same per-process
    threads as a rank) and with torch's default thread count, each before and after the EP runs (the
    median of both runs is the baseline). All EP ranks share this machine's cores, so on a 2-core machine
    EP=4 oversubscribes it: the ratios show the cost of sharding and exchanging on one machine, not a
    multi-GPU speed-up.

(c) ``--groups``: device-limited routing (DeepSeek-V3's ``n_group`` / ``topk_group``). An LM of MoE layers with
    16 experts, top-4, sigmoid gates, on 4 gloo ranks (4 experts each); the experts form 4 groups, one per
    rank, and each token keeps its best M of them, M = 4 (no limit), 2, 1. Reported: the dispatch bytes the
    ranks actually sent (intercepted, as in (a)), their ratio to the unlimited run's, and the most ranks any
    token's rows went to (counted from the plans; at most M). Writes expert_parallel_groups.json.

With ``--device cuda`` the ranks are NCCL processes, one GPU each (set up by
``mode.parallel.process_group.init_distributed``,
as ``torchrun`` would), for EP = 1, 2 and 4 as far as the machine has GPUs; the baseline is EP = 1 (the same
trainer on a mesh of one GPU).

Results go to benchmarks/results/expert_parallel.json (expert_parallel_quick.json with --quick).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere without installing
    sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    add_device_arg,
    add_dtype_arg,
    dtype_choice,
    machine_info,
    print_table,
    write_json,
)
from benchmarks.parallel.ep_ranks import TRAIN, run_ep, single_process_times  # noqa: E402
from mode.model import LMConfig  # noqa: E402

MODEL = LMConfig(
    seq_len=128,
    d_model=128,
    n_heads=4,
    d_hidden=512,
    num_experts=8,
    num_noop=2,
    top_k=2,
    capacity_factor=1.25,
    layers=("moe", "integrated", "moe", "integrated"),
)


FULL = dict(byte_steps=3, warmup=3, timed=10)


QUICK = dict(byte_steps=2, warmup=1, timed=3)


QUICK_MODEL = replace(MODEL, seq_len=32, d_model=32, d_hidden=64)


WORLDS = (2, 4)


GROUPS_MODEL = LMConfig(
    seq_len=128,
    d_model=128,
    n_heads=4,
    d_hidden=512,
    expert_hidden=128,
    num_experts=16,
    top_k=4,
    layers=("moe",) * 4,
    balance_coef=0.0,
    router_options=dict(gate="sigmoid", renormalize=True, n_group=4, bias_balance=True),
)


GROUPS_KEEP = (4, 2, 1)


# ------------------------------------------------------------------------------------------------------
# worker side


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None  # EP = 1 sends nothing: no ratio


def main_groups(args) -> dict:
    """(c): one EP = 4 gloo run per M (tokens keep their best M of 4 groups, one group per rank)."""
    cfg = dict(byte_steps=2, warmup=0, timed=1) if args.quick else dict(byte_steps=3, warmup=0, timed=1)
    base = replace(GROUPS_MODEL, seq_len=32, d_model=32, d_hidden=64, expert_hidden=32) if args.quick else GROUPS_MODEL
    rows = []
    with tempfile.TemporaryDirectory() as tmp_s:
        for dedup in (False, True):
            for keep in GROUPS_KEEP:
                model_cfg = replace(base, router_options={**base.router_options, "topk_group": keep})
                where = Path(tmp_s) / f"keep{keep}_dedup{int(dedup)}"
                where.mkdir()
                res = run_ep(4, model_cfg, cfg, where, dedup=dedup, bf16=args.dtype == "bfloat16")
                rows.append(
                    {
                        "keep_groups": keep,
                        "dedup": dedup,
                        "dispatch_bytes": sum(r["sent"]["dispatch"] for r in res),
                        "max_ranks_per_token": max(r["max_ranks_per_token"] for r in res),
                    }
                )
    for r in rows:
        r["vs_unlimited_per_assignment"] = r["dispatch_bytes"] / rows[0]["dispatch_bytes"]
    info = machine_info(torch.device("cpu"))
    print(
        f"\nDevice-limited routing on 4 gloo ranks: E={base.num_experts} in 4 groups (one per rank), top-"
        f"{base.top_k}, {len(base.layers)} MoE layers, global batch {TRAIN.batch_size} x {base.seq_len}, "
        f"{cfg['byte_steps']} training steps\n"
    )
    print_table(
        rows,
        [
            ("keep_groups", "groups kept (M)", "d"),
            ("dedup", "one row per (token, rank)", ""),
            ("dispatch_bytes", "dispatch bytes sent", ",d"),
            ("vs_unlimited_per_assignment", "/ unlimited, one row per assignment", ".3f"),
            ("max_ranks_per_token", "max ranks per token", "d"),
        ],
    )
    payload = dict(
        benchmark="expert_parallel --groups",
        machine=info,
        quick=args.quick,
        model=asdict(base),
        dtype=args.dtype,
        steps=cfg,
        notes="dispatch bytes: everything the forward dispatch all-to-alls sent to other "
        "ranks (rows; with dedup also the int64 row index and float32 gate of each "
        "assignment), intercepted, summed over ranks and byte steps; combine and "
        "backward move the same rows back",
        results=rows,
    )
    out = args.out or str(
        ROOT
        / "benchmarks"
        / "results"
        / ("expert_parallel_groups_quick.json" if args.quick else "expert_parallel_groups.json")
    )
    path = write_json(out, payload)
    print(f"\nwrote {path}")
    return payload


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model, few steps (smoke run)")
    p.add_argument("--out", help="JSON path (default benchmarks/results/expert_parallel[_quick].json)")
    p.add_argument("--groups", action="store_true", help="(c): the bytes device-limited routing saves, 4 ranks")
    add_device_arg(p)
    add_dtype_arg(p)
    args = p.parse_args(argv)
    bf16 = dtype_choice(args.dtype) == torch.bfloat16
    if args.groups:
        return main_groups(args)
    cfg = QUICK if args.quick else FULL
    model_cfg = QUICK_MODEL if args.quick else MODEL
    device = args.device
    cuda = device.type == "cuda"
    info = machine_info(device)
    rows = []
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        if cuda:  # one GPU per rank; EP = 1 (one GPU) is the baseline
            worlds = tuple(w for w in (1, *WORLDS) if w <= torch.cuda.device_count())
            ep = {w: run_ep(w, model_cfg, cfg, tmp, "nccl", bf16=bf16) for w in worlds}
            base_before = base_after = one_before = one_after = ep[1][0]["times"]
        else:
            base_before = single_process_times(model_cfg, cfg, tmp / "sp_before", bf16=bf16)
            one_before = single_process_times(model_cfg, cfg, tmp / "sp1_before", threads=1, bf16=bf16)
            ep = {w: run_ep(w, model_cfg, cfg, tmp, bf16=bf16) for w in WORLDS}
            base_after = single_process_times(model_cfg, cfg, tmp / "sp_after", bf16=bf16)
            one_after = single_process_times(model_cfg, cfg, tmp / "sp1_after", threads=1, bf16=bf16)
    base = statistics.median(base_before + base_after)
    one = statistics.median(one_before + one_after)
    if not cuda:
        rows.append(
            {
                "ranks": 1,
                "threads": info["torch_threads"],
                "step_ms": base * 1e3,
                "vs_single": 1.0,
                "vs_single_1t": base / one,
            }
        )
        rows.append({"ranks": 1, "threads": 1, "step_ms": one * 1e3, "vs_single": one / base, "vs_single_1t": 1.0})
    for w, res in ep.items():
        min_bytes = sum(r["min_bytes"] for r in res)  # dispatch's element size
        min_combine = sum(r["min_bytes_combine"] for r in res)  # combine's (bfloat16 outputs under autocast)
        sent = {k: sum(r["sent"][k] for r in res) for k in ("dispatch", "combine", "backward", "counts")}
        per_call = [a / m for r in res for a, m in zip(r["dispatch_calls_actual"], r["dispatch_calls_min"]) if m]
        calls_match = all(
            len(r["dispatch_calls_actual"]) == len(r["dispatch_calls_min"])
            and r["dispatch_calls_actual"] == r["dispatch_calls_min"]
            for r in res
        )
        step = statistics.median(res[0]["times"])
        rows.append(
            {
                "ranks": w,
                "threads": 1,
                "step_ms": step * 1e3,
                "vs_single": step / base,
                "vs_single_1t": step / one,
                "dispatch_ratio": _ratio(sent["dispatch"], min_bytes),
                "combine_ratio": _ratio(sent["combine"], min_combine),
                "backward_ratio": _ratio(sent["backward"], min_bytes + min_combine),
                "per_call_ratio_min": min(per_call, default=None),
                "per_call_ratio_max": max(per_call, default=None),
                "every_call_exact": calls_match,
                "min_bytes": min_bytes,
                "min_bytes_combine": min_combine,
                "row_esize": res[0]["row_esize"],
                "dispatch_bytes": sent["dispatch"],
                "combine_bytes": sent["combine"],
                "backward_bytes": sent["backward"],
                "counts_bytes": sent["counts"],
                "noop_assignments": sum(r["noop"] for r in res),
                "dropped_assignments": sum(r["dropped"] for r in res),
                "dispatch_calls": sum(len(r["dispatch_calls_actual"]) for r in res),
                "step_s_rank0": res[0]["times"],
            }
        )
    where = f"NCCL, one {info['device_name']} per rank" if cuda else f"gloo, CPU; {info['cpu_count']} cores"
    print(f"\nExpert-parallel bytes and step time ({where}; torch {info['torch']}; {args.dtype})")
    if cuda and not bf16:
        print(
            "note: float32 on CUDA times torch._grouped_mm's looped fallback (a host sync per GEMM); "
            "--dtype bfloat16 (--bf16) times its fast kernel"
        )
    print(
        f"model: layers {','.join(model_cfg.layers)}, d_model {model_cfg.d_model}, E={model_cfg.num_experts} "
        f"(+{model_cfg.num_noop} no-op), top-{model_cfg.top_k}, capacity factor {model_cfg.capacity_factor}; "
        f"global batch {TRAIN.batch_size} x {model_cfg.seq_len}\n"
    )
    times = (
        [("vs_single", "step / EP=1", ".2f")]
        if cuda
        else [
            ("vs_single_1t", "step / single (1 thread)", ".2f"),
            ("vs_single", f"step / single ({info['torch_threads']} threads)", ".2f"),
        ]
    )
    print_table(
        rows,
        [
            ("ranks", "ranks", "d"),
            ("threads", "threads/rank", "d"),
            ("dispatch_ratio", "dispatch/min", ".2f"),
            ("combine_ratio", "combine/min", ".2f"),
            ("backward_ratio", "backward/(2 min)", ".2f"),
            ("noop_assignments", "no-op rows (not sent)", "d"),
            ("dropped_assignments", "dropped rows (not sent)", "d"),
            ("step_ms", "step ms (median)", ".1f"),
            *times,
        ],
    )
    baseline = (
        "EP = 1: Trainer on a mesh of one GPU"
        if cuda
        else f"single process with torch's default threads ({info['torch_threads']}) vs EP ranks with 1 thread "
        "each on the same machine"
    )
    payload = dict(
        benchmark="expert_parallel",
        machine=info,
        quick=args.quick,
        model=asdict(model_cfg),
        train=dict(batch_size=TRAIN.batch_size, lr=TRAIN.lr, bf16=bf16),
        steps=cfg,
        device=str(device),
        dtype=args.dtype,
        notes=(
            "bytes: rows sent to other ranks by every all_to_all_single, intercepted, over the byte steps, "
            "summed over ranks; min = plan assignments whose expert is on another rank x D x element size "
            f"(no-op and dropped tokens are not in the plan). Step time baseline: {baseline}."
        ),
        single_process_s=None if cuda else dict(before=base_before, after=base_after, median=base),
        single_process_1thread_s=None if cuda else dict(before=one_before, after=one_after, median=one),
        loadavg_at_end=[round(v, 2) for v in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        results=rows,
    )
    out = args.out or str(
        ROOT / "benchmarks" / "results" / ("expert_parallel_quick.json" if args.quick else "expert_parallel.json")
    )
    path = write_json(out, payload)
    if hasattr(os, "getloadavg"):
        print(
            f"load average (1, 5, 15 min) at start {info.get('loadavg_1_5_15_at_start')}, at end "
            f"{[round(v, 2) for v in os.getloadavg()]}: other processes share these cores"
        )
    print(f"\nwrote {path}")
    return payload


if __name__ == "__main__":
    main()

"""The goals of a GPU run and the short table gpu_suite.py prints at the end (only the last lines of a GPU run's
output come back)."""

from __future__ import annotations

# The goals of the first GPU run (docs/gpu.md): (key in the stage's numbers, rule, threshold, what it says)
GOALS = (
    ("moe", "moe_ratio_E8", "<=", 1.15, "MoE layer (E=8) <= 1.15 x dense MLP of the same active FLOPs, bf16"),
    ("moe", "moe_ratio_E64", "<=", 1.15, "MoE layer (E=64) <= 1.15 x dense MLP of the same active FLOPs, bf16"),
    ("moe", "ahead_of_peers_E8", "==", True, "MoE layer ahead of every transformers/torchtitan block at E=8"),
    ("moe", "ahead_of_peers_E64", "==", True, "MoE layer ahead of every transformers/torchtitan block at E=64"),
    ("mod", "block_gap", "<=", 0.05, "MoD block ratio within +0.05 of its FLOP ratio"),
    ("mod", "lm_gap", "<=", 0.05, "MoD LM step ratio within +0.05 of its FLOP ratio"),
    ("decode", "speedup_b1", ">=", 1.7, "MoD decode >= 1.7 x dense at batch 1 (best path)"),
    ("train", "mfu_eager", ">=", 0.40, "mode train --preset base --bf16 MFU >= 40% (eager)"),
    ("train", "mfu_compile", ">=", 0.40, "mode train --preset base --bf16 MFU >= 40% (--compile)"),
    ("gpumfu", "mfu_graphs", ">=", 0.40, "mode train --preset gpu --bf16 --cuda-graphs MFU >= 40% (datasheet peak)"),
)


def evaluate_goals(stages: dict, smoke: bool = False) -> list[dict]:
    """Each goal against its stage's number: met, missed, not measured, or (a smoke run's toy shapes on the
    CPU) not judged."""
    out = []
    for stage, key, rule, threshold, text in GOALS:
        numbers = stages.get(stage, {}).get("numbers", {})
        value = numbers.get(key)
        if value is None:
            verdict = "not measured"
        elif smoke:
            verdict = "not judged"
        elif rule == "<=":
            verdict = "met" if value <= threshold else "missed"
        elif rule == ">=":
            verdict = "met" if value >= threshold else "missed"
        else:
            verdict = "met" if value == threshold else "missed"
        out.append(
            {
                "goal": text,
                "stage": stage,
                "key": key,
                "value": value,
                "rule": f"{rule} {threshold}",
                "verdict": verdict,
            }
        )
    return out


def _fmt(value) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


HEADLINE = {
    "env": ("device_name", "matmul_bf16_tflops", "copy_gbs"),
    "tests": ("passed", "failed", "skipped", "cut_off"),
    "gtests": ("passed", "failed", "skipped", "cut_off"),
    "graphs": ("step_ms_eager", "step_ms_graphs", "graph_speedup", "loss_rel_diff_max", "graphs"),
    "gdecode": ("speedup_mod_b1", "speedup_mod_b8", "speedup_dense_b1", "same_tokens_mod_b1", "graphs"),
    "gpumfu": ("params", "batch_size", "mfu_graphs", "mfu_measured_graphs", "mfu_eager", "graph_speedup", "gpu_preset"),
    "moe": (
        "moe_ratio_E8",
        "best_peer_ratio_E8",
        "moe_ratio_E64",
        "best_peer_ratio_E64",
        "moe_ratio_compiled_E8",
        "moe_ratio_compiled_E64",
    ),
    "mod": ("block_ratio", "block_ratio_compiled", "block_flop_ratio", "lm_ratio", "lm_flop_ratio"),
    "decode": ("speedup_b1", "speedup_b8"),
    "train": ("tok_s_eager", "mfu_eager", "tok_s_compile", "mfu_compile", "mfu_vs_measured_eager"),
    "nccl": ("backend", "last_step", "final_loss"),
    "profile": (),
    "isoflop": (
        "complete",
        "runs_done",
        "runs_total",
        "measured_over_estimated",
        "dense_best",
        "mod_minus_dense",
        "mod_minus_dense_significant",
        "learned_minus_random",
        "staged_minus_integrated",
        "moe_minus_dense",
    ),
}


def print_summary(payload: dict) -> None:
    print(
        f"\ngpu_suite: {payload.get('device', '?')}, torch {payload.get('versions', {}).get('torch', '?')}, "
        f"{payload.get('seconds', '?')} s"
        + ("" if payload["budget_s"] is None else f" of {payload['budget_s']:.0f}")
        + (" (smoke)" if payload["smoke"] else "")
    )
    for name, rec in payload["stages"].items():
        if rec["status"] == "ok":
            nums = rec["numbers"]
            what = ", ".join(f"{k}={_fmt(nums[k])}" for k in HEADLINE.get(name, ()) if k in nums)
            if name == "profile":
                busy = [f"{k.split(':')[0]} {v:.0%}" for k, v in nums.items() if k.endswith("busy_fraction")]
                what = (
                    ("device busy: " + ", ".join(busy))
                    if busy
                    else "wall ms per step: " + ", ".join(f"{k.split(':')[0]} {v:.1f}" for k, v in nums.items())
                )
        else:
            what = rec.get("error") or rec.get("reason", "")
        if rec.get("slow"):
            what = f"slow: {rec['slow']}; {what}"
        print(f"  {name:<8}{rec['status']:<8}{rec.get('seconds', 0):>6.1f}s  {what}"[:300])
    for g in payload.get("goals", []):
        print(f"  goal {g['verdict']:<12} {g['goal']}: {_fmt(g['value'])}")

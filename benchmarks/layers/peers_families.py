"""``bench_peers.py --families``: one transformers block per router kind (Qwen3-MoE, Qwen2-MoE, DeepSeek-V3,
DeepSeek-V2, ...) against mode's layer configured to the same routing, timed in the same rounds."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import Tensor, nn

from benchmarks.common import machine_info, print_table, time_interleaved, write_json
from benchmarks.layers.peers_impls import BF16_TOL, FLOAT32_TOL, _version, make_step, max_abs_diff

ROOT = Path(__file__).resolve().parents[2]  # results go to ROOT/benchmarks/results
FAMILY_SHAPES = {
    "full": dict(
        tokens=4096, d_model=512, experts=64, hidden=256, top_k=4, n_group=8, topk_group=4, warmup=3, repeats=9
    ),
    "quick": dict(tokens=128, d_model=32, experts=8, hidden=16, top_k=2, n_group=4, topk_group=2, warmup=1, repeats=3),
}


class FirstOutput(nn.Module):
    """A block whose forward returns a pair (gpt-oss, Llama-4: (output, router scores or logits)), as a tensor."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: Tensor) -> Tensor:
        return self.block(x)[0].view(x.shape)  # Llama-4 returns (T, D)


def family_blocks(shape: dict) -> dict[str, tuple[nn.Module, object]]:
    """One transformers block per router kind at ``shape`` (random weights), with its config."""
    import importlib

    from transformers import AutoConfig

    d, e, h, k = shape["d_model"], shape["experts"], shape["hidden"], shape["top_k"]
    groups = dict(n_group=shape["n_group"], topk_group=shape["topk_group"])
    common = dict(hidden_size=d, moe_intermediate_size=h, num_experts_per_tok=k, experts_implementation="grouped_mm")
    # name -> (model type, module, block class, config fields): the router kinds of mode.hf.moe.families
    kinds = {
        "Qwen3-MoE": ("qwen3_moe", "qwen3_moe", "Qwen3MoeSparseMoeBlock", dict(num_experts=e, norm_topk_prob=True)),
        "Qwen2-MoE": (
            "qwen2_moe",
            "qwen2_moe",
            "Qwen2MoeSparseMoeBlock",
            dict(num_experts=e, shared_expert_intermediate_size=4 * h, norm_topk_prob=False),
        ),
        "DeepSeek-V3": (
            "deepseek_v3",
            "deepseek_v3",
            "DeepseekV3MoE",
            dict(n_routed_experts=e, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, **groups),
        ),
        "DeepSeek-V2": (
            "deepseek_v2",
            "deepseek_v2",
            "DeepseekV2Moe",
            dict(
                n_routed_experts=e,
                n_shared_experts=1,
                routed_scaling_factor=2.5,
                topk_method="group_limited_greedy",
                **groups,
            ),
        ),
        "ERNIE-4.5": (
            "ernie4_5_moe",
            "ernie4_5_moe",
            "Ernie4_5_MoeSparseMoeBlock",
            dict(moe_num_experts=e, moe_k=k, moe_num_shared_experts=0),
        ),
        "LFM2-MoE": (
            "lfm2_moe",
            "lfm2_moe",
            "Lfm2MoeSparseMoeBlock",
            dict(num_experts=e, use_expert_bias=True, norm_topk_prob=True, routed_scaling_factor=1.0),
        ),
        "Granite-MoE": ("granitemoe", "granitemoe", "GraniteMoeMoE", dict(num_local_experts=e, intermediate_size=h)),
        "gpt-oss": ("gpt_oss", "gpt_oss", "GptOssMLP", dict(num_local_experts=e, intermediate_size=h)),
        "Llama-4": ("llama4_text", "llama4", "Llama4TextMoe", dict(num_local_experts=e, intermediate_size=h)),
        "LongCat-Flash": (
            "longcat_flash",
            "longcat_flash",
            "LongcatFlashMoE",
            dict(n_routed_experts=e, zero_expert_num=e // 2, expert_ffn_hidden_size=h, routed_scaling_factor=6.0),
        ),
    }
    out = {}
    g = torch.Generator().manual_seed(0)
    for name, (model_type, module, block_name, fields) in kinds.items():
        config = AutoConfig.for_model(model_type, **common, **fields)
        config = config.get_text_config(decoder=True)
        cls = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), block_name)
        block = cls(config)
        with torch.no_grad():  # transformers initialises some weights to zero: random ones exercise every path
            for pname, t in [*block.named_parameters(), *block.named_buffers()]:
                if t.is_floating_point():
                    t.copy_(torch.randn(t.shape, generator=g) * (0.05 if "bias" in pname else t.shape[-1] ** -0.5))
        out[name] = (block, config)
    return out


def bench_families(shape: dict, device: torch.device, seed: int, bf16: bool = False) -> list[dict]:
    """Each transformers block against mode's layer configured as it: agreement, then interleaved timing,
    in float32 or under bfloat16 autocast (both sides alike)."""
    from mode.hf.moe.blocks import from_block

    torch.manual_seed(seed)
    x = torch.randn(1, shape["tokens"], shape["d_model"], device=device, requires_grad=True)
    g = torch.randn_like(x)
    tol = BF16_TOL if bf16 else FLOAT32_TOL
    rows = []
    for name, (block, config) in family_blocks(shape).items():
        block = block.to(device)
        ours = from_block(block, config)
        theirs = FirstOutput(block) if type(block).__name__ in ("GptOssMLP", "Llama4TextMoe") else block
        y_b, dx_b = (t.clone() for t in make_step(theirs, x, g, False, bf16=bf16)())
        y_m, dx_m = make_step(ours, x, g, True, with_aux=False, bf16=bf16)()
        dy, ddx = max_abs_diff(y_m, y_b), max_abs_diff(dx_m, dx_b)
        scale = max(float(y_b.float().abs().max()), float(dx_b.float().abs().max()), 1e-6)
        # bf16: transformers' routers (ERNIE's excepted) take the top-k of bf16 logits, ours of float32 ones, so
        # a few tokens route differently and their outputs differ by O(|y|); the rest agree to bf16 precision
        dy_T = (y_m.float() - y_b.float()).abs().amax(-1).reshape(-1)
        off_T = dy_T > BF16_TOL * float(y_b.float().abs().max())
        tokens_off = float(off_T.float().mean())
        dy_alike = float(dy_T[~off_T].max()) if (~off_T).any() else float("nan")
        timing = time_interleaved(
            {
                "mode": make_step(ours, x, g, True, with_aux=False, bf16=bf16),
                "transformers": make_step(theirs, x, g, False, bf16=bf16),
            },
            "transformers",
            warmup=shape["warmup"],
            repeats=shape["repeats"],
            device=device,
        )
        rows.append(
            dict(
                family=name,
                precision="bf16" if bf16 else "float32",
                tokens=shape["tokens"],
                d_model=shape["d_model"],
                experts=shape["experts"],
                hidden=shape["hidden"],
                top_k=shape["top_k"],
                max_abs_diff_y=dy,
                max_abs_diff_dx=ddx,
                tokens_routed_off=tokens_off,
                max_abs_diff_y_alike=dy_alike,
                agrees=bool(tokens_off <= 0.1 and dy_alike <= tol * scale) if bf16 else bool(max(dy, ddx) <= tol),
                mode_over_transformers=timing["mode"]["ratio_median"],
                spread=f"{timing['mode']['ratio_min']:.2f}-{timing['mode']['ratio_max']:.2f}",
                mode_ms=1e3 * timing["mode"]["s_median"],
                transformers_ms=1e3 * timing["transformers"]["s_median"],
            )
        )
        print(
            f"  {name:<14} mode / transformers {rows[-1]['mode_over_transformers']:.3f}  |dy| {dy:.1e}  |dx| {ddx:.1e}",
            file=sys.stderr,
            flush=True,
        )
    return rows


def main_families(args, device: torch.device) -> dict:
    shape = FAMILY_SHAPES["quick" if args.quick else "full"]
    if args.repeats is not None:
        shape = {**shape, "repeats": args.repeats}
    info = machine_info(device)
    info["versions"] = {dist: _version(dist) for dist in ("mode-torch", "transformers")}
    bf16 = args.precision == "bf16"
    rows = bench_families(shape, device, args.seed, bf16=bf16)
    print()
    extra = (
        [("tokens_routed_off", "tokens off", ".3f"), ("max_abs_diff_y_alike", "max |dy| rest", ".1e")] if bf16 else []
    )
    print_table(
        rows,
        [
            ("family", "transformers block", ""),
            ("agrees", "agrees", ""),
            *extra,
            ("mode_over_transformers", "mode / block", ".3f"),
            ("spread", "min-max", ""),
            ("mode_ms", "mode ms", ".1f"),
            ("transformers_ms", "block ms", ".1f"),
            ("max_abs_diff_y", "max |dy|", ".1e"),
            ("max_abs_diff_dx", "max |dx|", ".1e"),
        ],
    )
    payload = dict(
        benchmark="bench_peers --families",
        command=" ".join(["bench_peers.py"] + sys.argv[1:]),
        shape=shape,
        device=str(device),
        machine=info,
        notes="forward + backward of <y, g>, no aux losses; ratio = mode's wall time / "
        "the transformers block's in the same round, median over rounds; bf16: "
        "both under bfloat16 autocast; tokens_routed_off: the share of tokens whose "
        "output differs by more than 5e-2 of the largest |y| (their top-k of bf16 "
        "logits differs from ours of float32 logits); agrees: <= 10% of them and "
        "the rest within 5e-2 of the largest value",
        results=rows,
    )
    stem = "peers_families" + ("_bf16" if bf16 else "") + ("_quick" if args.quick else "")
    path = write_json(Path(args.out or ROOT / "benchmarks" / "results" / f"{stem}.json"), payload)
    print(f"\nwrote {path}", file=sys.stderr)
    return payload

"""Mixture-of-Depths, MoE and MoDE for the transformers decoders users already have (``pip install
'mode-torch[hf]'``, transformers 5.x): MoD for Llama, Qwen2 and Mistral with sdpa or eager attention; the MoE
models (Mixtral, OLMoE, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3) on mode's MoE layers, expert-parallel.

    import mode.hf as mh
    mh.to_mod(model, layers="every_other", capacity=0.125, gate="ste", causal="aux_bce")   # in place
    mh.to_mod(model, capacity=0.5, part="attention")   # skip only attention (skipped tokens still write K/V)
    mh.to_mod(model, capacity=0.5, part="attention", kv="routed")  # ... or not (a sparse cache)
    mh.to_mod(model, capacity=0.5, part="attention", skip_rank=64) # skipped tokens get a fitted estimate
    mh.router_fit(model, batches)             # route the tokens the skipped part would change most
    mh.calibrate(model, batches)              # steer the causal thresholds to the capacity's share
    costs = mh.skip_costs(model, batches, part="attention")  # loss per layer if every token skipped it
    mh.to_mod(model, layers=mh.cheapest(costs, 4), part="attention")   # convert the cheapest layers
    model.generate(...)                       # eval mode routes causally (kv="routed": sparse KV caches)
    with mh.routing(model, "topk"): ...       # pick the routing explicitly
    aux = mh.collect_aux(model)               # layers.{i}.mod.* / layers.{i}.moe.* losses and stats
    mh.upcycle(model, num_experts=8, top_k=2) # MLPs -> MoE of copies (starts equal to the dense model)
    mh.router_tune(model, batches, steps=100) # base frozen, routers trained (lm or distill)
    mh.save_conversion(model, "dir"); mh.load_conversion(original_model, "dir")
    plan = mh.plan_to_macs(model, 0.85, seq_len=512)  # MoD layers and capacity at 85% of the MACs per token
    res = mh.convert_to_macs(model, mh.BudgetConfig(0.85, heal=mh.HealConfig(100)), data)  # plan+fit+heal in one
    mh.prune_layers(pruned, 2, by="block_influence", batches=data)  # the baseline: whole layers deleted
    report = mh.heal(model, original, data, mh.HealConfig(steps=200))  # LoRA + routers, distilled
    mh.merge_lora(model)                      # adapters folded into the weights (then save_conversion)
    mh.to_mode_moe(moe_model)                 # Mixtral/OLMoE/Qwen2-MoE/Qwen3-MoE/DeepSeek-V3 blocks -> mode layers
    mh.save_transformers(moe_model, "dir")    # ... and back to a plain transformers checkpoint
    acc, summary = mh.moe_report(moe_model, ids)  # per-layer expert load, drops, experts and FLOPs per token
    model, tok = mh.load_gguf(mh.fetch_smollm2())  # SmolLM2-135M-Instruct, the real pretrained test bed
    mh.export_transformers("runs/train/ckpt.pt", "out")  # a mode-trained model as a transformers folder

Where the code lives (every name above is re-exported here; import them from ``mode.hf``):
    mode/hf/dense/   a dense decoder converted in place: MoD layers, upcycling, fitting, tuning, saving
    mode/hf/moe/     a transformers MoE model's blocks adopted as mode layers, and written back
    mode/hf/export/  a model mode trained, out to transformers: a standard family where exact, else ModeForCausalLM
    mode/hf/_compat.py, pretrained.py   the transformers version and model checks; SmolLM2's GGUF

See docs/hf.md for what is supported, what is refused and why.
"""

from mode.hf._compat import ATTENTIONS, MODEL_TYPES, TESTED_VERSION  # noqa: F401  (checks transformers first)
from mode.hf.dense.budget import BudgetConfig, BudgetResult, convert_to_macs
from mode.hf.dense.cache import MoDCacheLayer
from mode.hf.dense.conversion_io import load_conversion, save_conversion
from mode.hf.dense.convert import mod_layers, to_mod
from mode.hf.dense.heal import HealConfig, HealReport, heal
from mode.hf.dense.lora import merge_lora
from mode.hf.dense.macs import MacsPlan, conversion_macs, mixed_order, plan_to_macs
from mode.hf.dense.mod_layer import MoDLayerMixin
from mode.hf.dense.prune import block_influence, prune_layers
from mode.hf.dense.router_fit import router_fit
from mode.hf.dense.routing import collect_aux, routing
from mode.hf.dense.skip_cost import cheapest, skip_costs
from mode.hf.dense.tune import calibrate, freeze_base, router_parameters, router_tune
from mode.hf.dense.upcycle import UpcycledMLP, upcycle, upcycled_mlps
from mode.hf.export import ExportResult, ModeConfig, ModeForCausalLM, export_transformers
from mode.hf.moe.convert import ConvertedMoE, converted_moe, moe_report, save_transformers, to_mode_moe
from mode.hf.pretrained import SMOLLM2, FetchError, fetch_smollm2, load_gguf, smollm2_path

__all__ = [
    "block_influence",
    "BudgetConfig",
    "BudgetResult",
    "calibrate",
    "cheapest",
    "collect_aux",
    "conversion_macs",
    "convert_to_macs",
    "converted_moe",
    "export_transformers",
    "ExportResult",
    "ConvertedMoE",
    "freeze_base",
    "heal",
    "HealConfig",
    "HealReport",
    "load_conversion",
    "MacsPlan",
    "merge_lora",
    "mod_layers",
    "MoDCacheLayer",
    "MoDLayerMixin",
    "ModeConfig",
    "ModeForCausalLM",
    "moe_report",
    "plan_to_macs",
    "mixed_order",
    "prune_layers",
    "router_fit",
    "router_parameters",
    "router_tune",
    "routing",
    "save_conversion",
    "save_transformers",
    "skip_costs",
    "to_mod",
    "to_mode_moe",
    "upcycle",
    "upcycled_mlps",
    "UpcycledMLP",
    "SMOLLM2",
    "FetchError",
    "fetch_smollm2",
    "load_gguf",
    "smollm2_path",
]

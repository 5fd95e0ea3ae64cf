"""transformers 5.x MoE blocks as ``mode`` layers: the configuration of each family, and its weights.

    layer = from_block(block)          # Qwen2MoeSparseMoeBlock, Qwen3MoeSparseMoeBlock or DeepseekV3MoE
    y, aux = layer(x_BSD)              # the block's output (float32: to 1e-5), plus routing stats and losses

What each family is in ``MoEConfig`` terms (docs/routing.md has the table):
    Qwen3-MoE     softmax top-k over the experts, renormalised when ``norm_topk_prob``; SwiGLU experts
    Qwen2-MoE     the same, plus one shared expert of ``shared_expert_intermediate_size`` whose output is
                  scaled per token by ``sigmoid(shared_expert_gate(x))``
    DeepSeek-V3   sigmoid scores; the choice adds ``e_score_correction_bias`` (our ``bias_X``, with bias
                  balancing on) and keeps each token's ``topk_group`` best of ``n_group`` groups; gates are
                  the unbiased scores, renormalised when ``norm_topk_prob``, times ``routed_scaling_factor``;
                  ``n_shared_experts`` shared experts as one MLP of ``n_shared_experts * moe_intermediate_size``

transformers keeps the experts as ``gate_up_proj (E, 2H, D)`` and ``down_proj (E, D, H)``; ``ExpertBank``
multiplies ``x @ w`` with ``w_in_EDF (E, D, 2H)`` and ``w_out_EHD (E, H, D)``, so the copy transposes them
(the gate and up halves keep their order). The block's auxiliary losses are not part of its forward; ours
come back in ``Aux`` with the coefficients given (0 by default here).
"""

from __future__ import annotations

import torch
from torch import nn

from mode.layers.moe import MoEConfig, MoELayer

FAMILIES = {"Qwen2MoeSparseMoeBlock": "qwen2_moe", "Qwen3MoeSparseMoeBlock": "qwen3_moe",
            "DeepseekV3MoE": "deepseek_v3"}


def family_of(block: nn.Module) -> str:
    name = type(block).__name__
    if name not in FAMILIES:
        raise ValueError(f"block={name}: not a supported transformers MoE block (supported: "
                         f"{', '.join(sorted(FAMILIES))})")
    return FAMILIES[name]


def moe_config(config, family: str, *, backend: str = "auto", balance_coef: float = 0.0,
               z_coef: float = 0.0) -> MoEConfig:
    """The ``MoEConfig`` of a transformers config's sparse block (``family``: a value of ``FAMILIES``)."""
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={config.hidden_act!r}: mode's SwiGLU experts use silu")
    common = dict(d_model=config.hidden_size, d_hidden=config.moe_intermediate_size, top_k=config.num_experts_per_tok,
                  renormalize=bool(config.norm_topk_prob), activation="swiglu", backend=backend,
                  balance_coef=balance_coef, z_coef=z_coef)
    if family == "qwen3_moe":
        return MoEConfig(num_experts=config.num_experts, gate="softmax", **common)
    if family == "qwen2_moe":
        return MoEConfig(num_experts=config.num_experts, gate="softmax", num_shared=1,
                         shared_hidden=config.shared_expert_intermediate_size, shared_gate=True, **common)
    if family == "deepseek_v3":
        return MoEConfig(num_experts=config.n_routed_experts, gate="sigmoid", num_shared=config.n_shared_experts,
                         router_options=dict(n_group=config.n_group, topk_group=config.topk_group,
                                             scale=float(config.routed_scaling_factor), bias_balance=True),
                         **common)
    raise ValueError(f"family={family!r}: must be one of {sorted(FAMILIES.values())}")


def _mlp_weights(mlp: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """A transformers SwiGLU MLP (gate_proj, up_proj, down_proj) as ``mode.MLP``'s (w_in_DF, w_out_HD)."""
    w_in = torch.cat([mlp.gate_proj.weight.t(), mlp.up_proj.weight.t()], dim=1)
    return w_in, mlp.down_proj.weight.t()


@torch.no_grad()
def load_block(layer: MoELayer, block: nn.Module) -> MoELayer:
    """Copy ``block``'s weights into ``layer`` (built from ``moe_config`` of the same config); returns it."""
    family = family_of(block)
    layer.router.weight.copy_(block.gate.weight)
    layer.experts.w_in_EDF.copy_(block.experts.gate_up_proj.transpose(1, 2))
    layer.experts.w_out_EHD.copy_(block.experts.down_proj.transpose(1, 2))
    if family == "qwen2_moe":
        w_in, w_out = _mlp_weights(block.shared_expert)
        layer.shared_gate.weight.copy_(block.shared_expert_gate.weight)
    elif family == "deepseek_v3":
        w_in, w_out = _mlp_weights(block.shared_experts)
        layer.router.bias_X.copy_(block.gate.e_score_correction_bias)
    if layer.shared_experts is not None:
        layer.shared_experts.w_in_DF.copy_(w_in)
        layer.shared_experts.w_out_HD.copy_(w_out)
    return layer


def from_block(block: nn.Module, config=None, **kw) -> MoELayer:
    """A ``MoELayer`` computing what ``block`` computes (its config: ``config``, or the block's own)."""
    family = family_of(block)
    config = config if config is not None else getattr(block, "config", None)
    if config is None:
        raise ValueError(f"config=None: {type(block).__name__} keeps no config; pass the model's config")
    layer = MoELayer.from_config(moe_config(config, family, **kw))
    ref = block.gate.weight
    return load_block(layer.to(device=ref.device, dtype=ref.dtype), block)

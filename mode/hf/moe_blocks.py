"""transformers 5.x MoE blocks as ``mode`` layers: the configuration of each family, and its weights.

    layer = adopt_block(block, config)  # a MoELayer on the block's own tensors (no copy): they are shared
    layer = from_block(block)           # the same on a copy of the block
    y, aux = layer(x_BSD)               # the block's output (float32: to 1e-5), plus routing stats and losses

What each family is in ``MoEConfig`` terms (docs/routing.md has the table):
    Mixtral       softmax top-k over the experts, always renormalised; SwiGLU experts
    OLMoE         softmax top-k, renormalised when ``norm_topk_prob``
    Qwen3-MoE     the same as OLMoE
    Qwen2-MoE     the same, plus one shared expert of ``shared_expert_intermediate_size`` whose output is
                  scaled per token by ``sigmoid(shared_expert_gate(x))``
    DeepSeek-V3   sigmoid scores; the choice adds ``e_score_correction_bias`` (our ``bias_X``, with bias
                  balancing on) and keeps each token's ``topk_group`` best of ``n_group`` groups; gates are
                  the unbiased scores, renormalised when ``norm_topk_prob``, times ``routed_scaling_factor``;
                  ``n_shared_experts`` shared experts as one MLP of ``n_shared_experts * moe_intermediate_size``

The tensors. transformers keeps the experts as ``gate_up_proj (E, 2H, D)`` and ``down_proj (E, D, H)``:
that is ``ExpertBank``'s "EFD" layout (``w_in_EFD``, ``w_out_EDH``), so the bank takes the very Parameter
objects. The router takes ``gate.weight`` (and DeepSeek-V3's ``e_score_correction_bias`` as ``bias_X``);
shared experts stay transformers' own MLP module (``SharedMLP`` gives it the MoE layer's call) and Qwen2's
``shared_expert_gate`` is the layer's ``shared_gate`` as it is. ``hf_names(layer, block)`` maps each of the
layer's state-dict names to the block's, found by tensor identity, which is how a converted model is written
back as a transformers checkpoint (``mode.hf.moe_convert``).

The block's auxiliary losses are not part of its forward; ours come back in ``Aux`` with the coefficients
given (0 by default here).
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from mode.experts.bank import ExpertBank
from mode.layers.moe import MoEConfig, MoELayer, build_router
from mode.routing.plan import Aux

# block class name -> family
FAMILIES = {"MixtralSparseMoeBlock": "mixtral", "OlmoeSparseMoeBlock": "olmoe",
            "Qwen2MoeSparseMoeBlock": "qwen2_moe", "Qwen3MoeSparseMoeBlock": "qwen3_moe",
            "DeepseekV3MoE": "deepseek_v3"}
# family -> (config field of the expert count, of the expert hidden size); Mixtral always renormalises
_SIZES = {"mixtral": ("num_local_experts", "intermediate_size"), "olmoe": ("num_experts", "intermediate_size"),
          "qwen2_moe": ("num_experts", "moe_intermediate_size"), "qwen3_moe": ("num_experts", "moe_intermediate_size"),
          "deepseek_v3": ("n_routed_experts", "moe_intermediate_size")}
# what a family's shared experts and their gate are called in the block
_SHARED = {"qwen2_moe": ("shared_expert", "shared_expert_gate"), "deepseek_v3": ("shared_experts", None)}


def family_of(block: nn.Module) -> str:
    name = type(block).__name__
    if name not in FAMILIES:
        raise ValueError(f"block={name}: not a supported transformers MoE block (supported: "
                         f"{', '.join(sorted(FAMILIES))})")
    return FAMILIES[name]


def check_config(config) -> None:
    """The options of a family's config that mode's layer does not compute refuse here, by name."""
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={config.hidden_act!r}: mode's SwiGLU experts use silu")
    jitter = getattr(config, "router_jitter_noise", 0.0) or 0.0
    if jitter > 0:
        raise ValueError(f"router_jitter_noise={jitter}: mode's routers add no jitter (it scales the block's input "
                         "by uniform noise in training); set config.router_jitter_noise = 0.0 before converting")


def moe_config(config, family: str, *, backend: str = "auto", balance_coef: float = 0.0,
               z_coef: float = 0.0, layout: str = "EDF") -> MoEConfig:
    """The ``MoEConfig`` of a transformers config's sparse block (``family``: a value of ``FAMILIES``)."""
    if family not in _SIZES:
        raise ValueError(f"family={family!r}: must be one of {sorted(_SIZES)}")
    check_config(config)
    experts_field, hidden_field = _SIZES[family]
    renormalize = True if family == "mixtral" else bool(config.norm_topk_prob)
    common = dict(d_model=config.hidden_size, d_hidden=getattr(config, hidden_field),
                  num_experts=getattr(config, experts_field), top_k=config.num_experts_per_tok,
                  renormalize=renormalize, activation="swiglu", backend=backend, balance_coef=balance_coef,
                  z_coef=z_coef, expert_layout=layout)
    if family == "qwen2_moe":
        return MoEConfig(gate="softmax", num_shared=1, shared_hidden=config.shared_expert_intermediate_size,
                         shared_gate=True, **common)
    if family == "deepseek_v3":
        return MoEConfig(gate="sigmoid", num_shared=config.n_shared_experts,
                         router_options=dict(n_group=config.n_group, topk_group=config.topk_group,
                                             scale=float(config.routed_scaling_factor), bias_balance=True),
                         **common)
    return MoEConfig(gate="softmax", **common)


class SharedMLP(nn.Module):
    """transformers' own shared-expert MLP with the call ``MoELayer`` makes: ``(y, Aux())``."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.mlp = mlp

    def forward(self, x_BSD: Tensor) -> tuple[Tensor, Aux]:
        return self.mlp(x_BSD), Aux()


def _check_experts(block: nn.Module) -> None:
    names = sorted(name for name, _ in block.experts.named_parameters())
    if names != ["down_proj", "gate_up_proj"]:
        raise ValueError(f"{type(block).__name__}.experts holds {names}: mode's experts take exactly "
                         "gate_up_proj and down_proj (no biases)")


def adopt_block(block: nn.Module, config=None, **kw) -> MoELayer:
    """A ``MoELayer`` computing what ``block`` computes on the block's own tensors (no copy: a change to
    one is a change to the other). ``config``: the model's config (default: the block's own); ``kw`` go
    to ``moe_config``."""
    family = family_of(block)
    config = config if config is not None else getattr(block, "config", None)
    if config is None:
        raise ValueError(f"config=None: {type(block).__name__} keeps no config; pass the model's config")
    _check_experts(block)
    cfg = moe_config(config, family, layout="EFD", **kw)
    gate_w, experts = block.gate.weight, block.experts
    router = build_router(cfg).to(gate_w.device)  # (E, D): small; its float32 buffers stay float32
    router.weight = gate_w
    if family == "deepseek_v3":
        router.bias_X = block.gate.e_score_correction_bias
    with torch.device("meta"):  # the experts' own tensors replace these: nothing is allocated
        bank = ExpertBank(cfg.expert_config())
    bank.w_in_EFD, bank.w_out_EDH = experts.gate_up_proj, experts.down_proj
    shared = shared_gate = None
    if family in _SHARED:
        shared_name, gate_name = _SHARED[family]
        shared = SharedMLP(getattr(block, shared_name))
        shared_gate = getattr(block, gate_name) if gate_name else None
    return MoELayer(router, bank, None, shared, shared_gate)


def hf_names(layer: MoELayer, block: nn.Module) -> dict[str, str]:
    """The layer's state-dict name -> the block's, for a layer made by ``adopt_block(block)``: the tensors
    are the same objects. Every tensor of either must have its partner (else ValueError)."""
    ours = {id(t): name for name, t in layer.state_dict(keep_vars=True).items()}
    theirs = {id(t): name for name, t in block.state_dict(keep_vars=True).items()}
    if set(ours) != set(theirs):
        only_ours = sorted(ours[i] for i in set(ours) - set(theirs))
        only_theirs = sorted(theirs[i] for i in set(theirs) - set(ours))
        raise ValueError(f"{type(block).__name__}: the converted layer does not hold exactly the block's tensors "
                         f"(only in the layer: {only_ours}; only in the block: {only_theirs})")
    return {ours[i]: theirs[i] for i in ours}


def from_block(block: nn.Module, config=None, **kw) -> MoELayer:
    """A ``MoELayer`` computing what ``block`` computes, on a copy of its tensors (``adopt_block`` shares them)."""
    return adopt_block(copy.deepcopy(block), config, **kw)

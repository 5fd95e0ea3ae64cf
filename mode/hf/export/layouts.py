"""Where a mode LM goes in transformers: the standard families that compute exactly what it computes, as data.

Shape legend: D hidden, H MLP hidden, E experts, V vocabulary.

Each ``Layout`` says which LMs it takes (``why_not`` returns the first feature it cannot express, or None),
the family's config for an LM, and the LM's tensors under the family's module names (what the family's
``state_dict`` holds in memory: transformers writes its own on-disk names on save). A family is listed only
where its forward is mode's, operation for operation, up to float rounding:

    llama      dense layers, SwiGLU MLP                 Llama's attention, RMSNorm and RoPE (rotate-half) are mode's
    arcee      dense layers, GELU or relu^2 MLP         Llama with a non-gated MLP (``up -> act -> down``)
    mixtral    every layer token-choice MoE, SwiGLU experts, softmax gates renormalised over the top k
    qwen2_moe  token-choice MoE and dense SwiGLU layers (``mlp_only_layers``), softmax gates with or without
               renormalisation (``norm_topk_prob``), shared experts behind Qwen2-MoE's sigmoid gate; without
               shared experts, a shared expert of width 0 (its output is exactly 0)
    glm4_moe   DeepSeek-V3's router on Llama's attention: sigmoid gates, the balancing bias for choosing
               (``e_score_correction_bias``), group-limited choice, renormalisation, ``routed_scaling_factor``,
               ungated shared experts (or a width-0 one), dense SwiGLU layers first (``first_k_dense_replace``)

Not listed, because they compute something else: Qwen3-MoE and OLMoE (RMSNorm on queries and keys),
DeepSeek-V3 (multi-head latent attention), LongCat-Flash (latent attention, two attentions per layer; its
zero-computation experts alone would fit integrated MoDE's zero no-op experts). Every LM the families do not
take is written as mode's own transformers class (``mode.hf.export.modeling``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from mode.model.config import LMConfig

# The router options that leave a token-choice router's forward as plain top-k of the softmax (the losses'
# settings only); any other option is a feature a standard family lacks.
LOSS_ONLY_OPTIONS = frozenset({"balance_scope", "fused_kernels", "check_finite", "bias_rate"})


@dataclass(frozen=True)
class Layout:
    name: str  # the family's model_type
    architecture: str  # its causal-LM class in transformers
    why_not: Callable[[LMConfig], str | None]
    config: Callable[[LMConfig], dict]  # the family config's fields
    tensors: Callable[[LMConfig, dict[str, Tensor]], dict[str, Tensor]]  # LM state -> family state (in memory)
    doc: str = ""


# ---------------------------------------------------------------------------------------------- rules


def _not_plain(cfg: LMConfig) -> str | None:
    """Layers every standard family lacks: MoD routing (mod, mod_random, staged), no-op experts (integrated)."""
    for i, kind in enumerate(cfg.kinds):
        if kind.name not in ("dense", "moe"):
            return f"layers[{i}]={kind.name!r} (MoD routing or no-op experts: no standard family skips tokens)"
    return None


def _dense_only(activation: tuple[str, ...]) -> Callable[[LMConfig], str | None]:
    def why_not(cfg: LMConfig) -> str | None:
        if (reason := _not_plain(cfg)) is not None:
            return reason
        if cfg.uses_moe:
            return "MoE layers (a dense family)"
        if cfg.activation not in activation:
            return f"activation={cfg.activation!r} (this family's MLP is {' or '.join(activation)})"
        return None

    return why_not


def _dropless_swiglu_moe(cfg: LMConfig) -> str | None:
    """What every MoE family here needs: no MoD or no-op layers, MoE layers with a dropless token-choice router
    and SwiGLU experts."""
    if (reason := _not_plain(cfg)) is not None:
        return reason
    if not cfg.uses_moe:
        return "no MoE layer (a MoE family)"
    if cfg.router != "token_choice":
        return f"router={cfg.router!r} (this family's router is token choice)"
    if cfg.activation != "swiglu":
        return f"activation={cfg.activation!r} (this family's experts are SwiGLU)"
    if cfg.capacity_factor is not None:
        return f"capacity_factor={cfg.capacity_factor} (this family is dropless)"
    return None


def _token_choice(cfg: LMConfig, renormalize: bool | None) -> str | None:
    """A plain token-choice router with SwiGLU experts: softmax gates, dropless, no bias, no groups."""
    if (reason := _dropless_swiglu_moe(cfg)) is not None:
        return reason
    rc = cfg.router_config(cfg.kinds[_leading_dense(cfg)])
    if rc.gate != "softmax":
        return f"router gate={rc.gate!r} (this family's gates are a softmax)"
    extra = sorted(k for k in cfg.router_options if k not in LOSS_ONLY_OPTIONS | {"renormalize", "gate"})
    if extra:
        return f"router_options {extra} (this family's router has no such setting)"
    if renormalize is not None and rc.renormalize != renormalize:
        return f"renormalize={rc.renormalize} (this family {'always' if renormalize else 'never'} renormalises)"
    return None


def _mixtral_why_not(cfg: LMConfig) -> str | None:
    if (reason := _token_choice(cfg, renormalize=True)) is not None:
        return reason
    if not all(k.experts for k in cfg.kinds):
        return "dense layers among MoE layers (every Mixtral layer is MoE)"
    if cfg.num_shared:
        return f"num_shared={cfg.num_shared} (Mixtral has no shared experts)"
    return None


def _qwen2_moe_why_not(cfg: LMConfig) -> str | None:
    if (reason := _token_choice(cfg, renormalize=None)) is not None:
        return reason
    if cfg.num_shared and not cfg.shared_gate:
        return "shared experts without a gate (Qwen2-MoE gates its shared expert: shared_gate=True)"
    return None


# Glm4-MoE's router, in TokenChoiceConfig's fields: what an LM may set and still be computed exactly by it
GLM4_ROUTER_OPTIONS = frozenset(
    {"gate", "renormalize", "renorm_eps", "scale", "n_group", "topk_group", "bias_balance", "group_score"}
)


def _leading_dense(cfg: LMConfig) -> int:
    return next(i for i, k in enumerate(cfg.kinds) if k.experts)


def _glm4_moe_why_not(cfg: LMConfig) -> str | None:
    if (reason := _dropless_swiglu_moe(cfg)) is not None:
        return reason
    k = _leading_dense(cfg)
    if not all(kind.experts for kind in cfg.kinds[k:]):
        return "a dense layer after an MoE layer (Glm4-MoE's dense layers come first: first_k_dense_replace)"
    rc = cfg.router_config(cfg.kinds[k])
    if rc.gate != "sigmoid":
        return f"router gate={rc.gate!r} (this family's gates are sigmoids)"
    extra = sorted(key for key in cfg.router_options if key not in LOSS_ONLY_OPTIONS | GLM4_ROUTER_OPTIONS)
    if extra:
        return f"router_options {extra} (this family's router has no such setting)"
    if rc.group_score != "top2":
        return f"group_score={rc.group_score!r} (this family scores a group by its two best experts)"
    if rc.renorm_eps not in (0.0, 1e-20):
        return f"renorm_eps={rc.renorm_eps} (this family adds 1e-20)"
    if cfg.num_shared and cfg.shared_gate:
        return "gated shared experts (this family's shared experts are not gated)"
    if cfg.shared_hidden is not None and cfg.shared_hidden != cfg.num_shared * _expert_hidden(cfg):
        return f"shared_hidden={cfg.shared_hidden} (this family's is n_shared_experts x the experts' hidden size)"
    return None


# ------------------------------------------------------------------------------------------- configs


def _common_config(cfg: LMConfig) -> dict:
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_heads,
        head_dim=cfg.d_model // cfg.n_heads,
        max_position_embeddings=cfg.seq_len,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rope_base)},
        tie_word_embeddings=cfg.tie_embeddings,
        attention_dropout=0.0,
        use_cache=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def _llama_config(cfg: LMConfig) -> dict:
    return dict(
        _common_config(cfg), intermediate_size=cfg.d_hidden, hidden_act="silu", attention_bias=False, mlp_bias=False
    )


def _arcee_config(cfg: LMConfig) -> dict:
    act = {"gelu": "gelu", "relu2": "relu2"}[cfg.activation]
    return dict(
        _common_config(cfg), intermediate_size=cfg.d_hidden, hidden_act=act, attention_bias=False, mlp_bias=False
    )


def _expert_hidden(cfg: LMConfig) -> int:
    return cfg.expert_hidden or cfg.d_hidden


def _mixtral_config(cfg: LMConfig) -> dict:
    return dict(
        _common_config(cfg),
        intermediate_size=_expert_hidden(cfg),
        hidden_act="silu",
        num_local_experts=cfg.num_experts,
        num_experts_per_tok=cfg.top_k,
        router_jitter_noise=0.0,
        sliding_window=None,
        output_router_logits=False,
        router_aux_loss_coef=cfg.balance_coef,
    )


def _qwen2_moe_config(cfg: LMConfig) -> dict:
    rc = cfg.router_config(next(k for k in cfg.kinds if k.experts))
    shared = (cfg.shared_hidden or cfg.num_shared * _expert_hidden(cfg)) if cfg.num_shared else 0
    return dict(
        _common_config(cfg),
        intermediate_size=cfg.d_hidden,
        moe_intermediate_size=_expert_hidden(cfg),
        shared_expert_intermediate_size=shared,
        hidden_act="silu",
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.top_k,
        norm_topk_prob=bool(rc.renormalize),
        decoder_sparse_step=1,
        mlp_only_layers=[i for i, k in enumerate(cfg.kinds) if not k.experts],
        qkv_bias=False,
        use_sliding_window=False,
        sliding_window=None,
        output_router_logits=False,
        router_aux_loss_coef=cfg.balance_coef,
    )


def _glm4_moe_config(cfg: LMConfig) -> dict:
    k = _leading_dense(cfg)
    rc = cfg.router_config(cfg.kinds[k])
    common = _common_config(cfg)
    common["rope_parameters"] = {**common["rope_parameters"], "partial_rotary_factor": 1.0}
    return dict(
        common,
        partial_rotary_factor=1.0,
        intermediate_size=cfg.d_hidden,
        moe_intermediate_size=_expert_hidden(cfg),
        hidden_act="silu",
        n_routed_experts=cfg.num_experts,
        num_experts_per_tok=cfg.top_k,
        n_shared_experts=cfg.num_shared,
        routed_scaling_factor=float(rc.scale),
        n_group=rc.n_group,
        topk_group=rc.topk_group,
        norm_topk_prob=bool(rc.renormalize),
        first_k_dense_replace=k,
        use_qk_norm=False,
        attention_bias=False,
        output_router_logits=False,
        router_aux_loss_coef=cfg.balance_coef,
    )


# ------------------------------------------------------------------------------------------- tensors


def _attention_and_norms(cfg: LMConfig, sd: dict[str, Tensor]) -> dict[str, Tensor]:
    D = cfg.d_model
    out = {"model.embed_tokens.weight": sd["embed.weight"], "model.norm.weight": sd["norm.weight"]}
    out["lm_head.weight"] = sd["head.weight"]
    for i in range(cfg.n_layers):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        qkv = sd[p + "attn.qkv.weight"]  # (3D, D): queries, keys, values
        out[q + "self_attn.q_proj.weight"] = qkv[:D]
        out[q + "self_attn.k_proj.weight"] = qkv[D : 2 * D]
        out[q + "self_attn.v_proj.weight"] = qkv[2 * D :]
        out[q + "self_attn.o_proj.weight"] = sd[p + "attn.out.weight"]
        out[q + "input_layernorm.weight"] = sd[p + "attn_norm.weight"]
        out[q + "post_attention_layernorm.weight"] = sd[p + "mlp_norm.weight"]
    return out


def _gated_mlp(w_in_DF: Tensor, w_out_HD: Tensor, q: str) -> dict[str, Tensor]:
    """A SwiGLU MLP (D, 2H) / (H, D): the first H columns are the gate's (``mode.experts.bank.activate``)."""
    H = w_out_HD.shape[0]
    return {
        q + "gate_proj.weight": w_in_DF[:, :H].T,
        q + "up_proj.weight": w_in_DF[:, H:].T,
        q + "down_proj.weight": w_out_HD.T,
    }


def _dense_tensors(cfg: LMConfig, sd: dict[str, Tensor]) -> dict[str, Tensor]:
    out = _attention_and_norms(cfg, sd)
    for i in range(cfg.n_layers):
        w_in, w_out = sd[f"layers.{i}.mlp.w_in_DF"], sd[f"layers.{i}.mlp.w_out_HD"]
        if cfg.activation == "swiglu":
            out.update(_gated_mlp(w_in, w_out, f"model.layers.{i}.mlp."))
        else:
            out[f"model.layers.{i}.mlp.up_proj.weight"] = w_in.T
            out[f"model.layers.{i}.mlp.down_proj.weight"] = w_out.T
    return out


def _experts(sd: dict[str, Tensor], p: str, q: str) -> dict[str, Tensor]:
    """mode's (E, D, 2H) / (E, H, D) experts as transformers' (E, 2H, D) / (E, D, H) (gate, then up)."""
    return {
        q + "experts.gate_up_proj": sd[p + "experts.w_in_EDF"].transpose(1, 2),
        q + "experts.down_proj": sd[p + "experts.w_out_EHD"].transpose(1, 2),
        q + "gate.weight": sd[p + "router.weight"],
    }


def _mixtral_tensors(cfg: LMConfig, sd: dict[str, Tensor]) -> dict[str, Tensor]:
    out = _attention_and_norms(cfg, sd)
    for i in range(cfg.n_layers):
        out.update(_experts(sd, f"layers.{i}.mlp.", f"model.layers.{i}.mlp."))
    return out


def _qwen2_moe_tensors(cfg: LMConfig, sd: dict[str, Tensor]) -> dict[str, Tensor]:
    out = _attention_and_norms(cfg, sd)
    D = cfg.d_model
    for i, kind in enumerate(cfg.kinds):
        p, q = f"layers.{i}.mlp.", f"model.layers.{i}.mlp."
        if not kind.experts:
            out.update(_gated_mlp(sd[p + "w_in_DF"], sd[p + "w_out_HD"], q))
            continue
        out.update(_experts(sd, p, q))
        if cfg.num_shared:
            w_in, w_out = sd[p + "shared_experts.w_in_DF"], sd[p + "shared_experts.w_out_HD"]
            out.update(_gated_mlp(w_in, w_out, q + "shared_expert."))
            out[q + "shared_expert_gate.weight"] = sd[p + "shared_gate.weight"]
        else:  # a shared expert of width 0 adds exactly 0
            w = sd[p + "router.weight"]
            out.update(_gated_mlp(w.new_zeros(D, 0), w.new_zeros(0, D), q + "shared_expert."))
            out[q + "shared_expert_gate.weight"] = w.new_zeros(1, D)
    return out


def _glm4_moe_tensors(cfg: LMConfig, sd: dict[str, Tensor]) -> dict[str, Tensor]:
    out = _attention_and_norms(cfg, sd)
    D, E = cfg.d_model, cfg.num_experts
    for i, kind in enumerate(cfg.kinds):
        p, q = f"layers.{i}.mlp.", f"model.layers.{i}.mlp."
        if not kind.experts:
            out.update(_gated_mlp(sd[p + "w_in_DF"], sd[p + "w_out_HD"], q))
            continue
        out.update(_experts(sd, p, q))
        w = sd[p + "router.weight"]
        out[q + "gate.e_score_correction_bias"] = sd.get(p + "router.bias_X", w.new_zeros(E))
        if cfg.num_shared:
            w_in, w_out = sd[p + "shared_experts.w_in_DF"], sd[p + "shared_experts.w_out_HD"]
            out.update(_gated_mlp(w_in, w_out, q + "shared_experts."))
        else:  # a shared expert of width 0 adds exactly 0
            out.update(_gated_mlp(w.new_zeros(D, 0), w.new_zeros(0, D), q + "shared_experts."))
    return out


LAYOUTS: dict[str, Layout] = {
    layout.name: layout
    for layout in (
        Layout("llama", "LlamaForCausalLM", _dense_only(("swiglu",)), _llama_config, _dense_tensors, "dense, SwiGLU"),
        Layout("arcee", "ArceeForCausalLM", _dense_only(("gelu", "relu2")), _arcee_config, _dense_tensors, "GELU"),
        Layout("mixtral", "MixtralForCausalLM", _mixtral_why_not, _mixtral_config, _mixtral_tensors, "MoE"),
        Layout(
            "qwen2_moe",
            "Qwen2MoeForCausalLM",
            _qwen2_moe_why_not,
            _qwen2_moe_config,
            _qwen2_moe_tensors,
            "MoE and dense layers, shared experts gated",
        ),
        Layout(
            "glm4_moe",
            "Glm4MoeForCausalLM",
            _glm4_moe_why_not,
            _glm4_moe_config,
            _glm4_moe_tensors,
            "DeepSeek-V3's router: sigmoid, bias, groups, shared experts",
        ),
    )
}

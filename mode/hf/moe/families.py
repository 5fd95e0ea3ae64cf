"""Every transformers 5.23 decoder MoE family as data: one ``Family`` entry per model type drives
``mode.hf.moe.blocks`` (the block -> ``MoELayer`` adoption) and ``mode.hf.moe.convert``.

    FAMILIES["glm4_moe"]    # Family(block="Glm4MoeMoE", score="sigmoid", groups=..., choice_bias=...)
    REFUSED["dbrx"]         # why a family does not convert (the refusal's text)

A family's router is one rule of ``TokenChoiceRouter`` (docs/routing.md):
    score        "softmax" | "sigmoid" | "sqrtsoftplus" over the slots (real experts, then LongCat's zero
                 experts); choosing by the score or by the raw logits is the same choice, and a softmax over
                 the k chosen logits (gpt-oss, Granite, Cohere2) is the renormalised softmax
    renormalize  the k gates divided by their sum (+ ``renorm_eps``, at least ``renorm_min``)
    scale        multiplies the gates after renormalisation (``routed_scaling_factor``)
    groups       (n_group, topk_group): group-limited choice, a group scoring its two best ("top2") or its best
                 ("max", DeepSeek-V2) experts
    choice_bias  the selection-only correction bias: where it lives in the block (it becomes the router's
                 ``bias_X``, moved by ``mode.routing.update_expert_bias``)
    router_bias  a logit bias inside the router (gpt-oss)
The experts are transformers' 3D tensors, adopted as they are (``experts``: the names of the input and output
tensors, ``layout``: "EFD" (E, 2H, D) / (E, D, H) or "EDF" (E, D, 2H) / (E, H, D), ``expert_options``: the
``ExpertConfig`` extras: biases, gpt-oss's clamped and interleaved SwiGLU, Llama-4's input-scaled experts).
Shared experts stay the family's own MLP module (``shared``), gated per token (``shared_gate``) or averaged
with the routed output (Cohere2's "average").

Which layers are sparse needs no entry: the converter replaces every module of class ``block``, wherever the
family's own rule (``first_k_dense_replace``, ``decoder_sparse_step``, ``mlp_layer_types``, ...) put one.

Values that depend on the checkpoint are read when the block is converted: ``At("gate.norm_topk_prob")`` is
an attribute of the block (a dotted path), ``Cfg("router_jitter_noise", 0.0)`` a field of the text config.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


def get_path(obj, path: str) -> Any:
    """The attribute of ``obj`` at a dotted ``path`` ("" is ``obj`` itself), or None where a step is missing."""
    if not path:
        return obj
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


@dataclass(frozen=True)
class At:
    """An attribute of the block, by dotted path (``default`` where a step is missing or None)."""

    path: str
    default: Any = None

    def read(self, block, config) -> Any:
        value = get_path(block, self.path)
        return self.default if value is None else value


@dataclass(frozen=True)
class Cfg:
    """A field of the model's text config (``default`` where it is missing or None)."""

    name: str
    default: Any = None

    def read(self, block, config) -> Any:
        value = getattr(config, self.name, None)
        return self.default if value is None else value


def read(value, block, config) -> Any:
    """A spec value: a literal, an ``At`` / ``Cfg``, or a function of (block, config)."""
    if isinstance(value, (At, Cfg)):
        return value.read(block, config)
    if callable(value):
        return value(block, config)
    return value


@dataclass(frozen=True)
class Family:
    block: str  # the sparse block's class name
    router: str | None = "gate"  # the router module, in the block (None: elsewhere, transformers' own: Gemma-4)
    router_weight: str = "weight"  # its (X, D) weight, in the router
    router_bias: str | None = None  # a logit bias, in the router (gpt-oss)
    top_k: Any = None  # None: the router module's ``top_k``
    score: Any = "softmax"
    renormalize: Any = True
    renorm_eps: float = 0.0
    renorm_min: Any = 0.0
    renorm_p: Any = 1.0  # DBRX divides by the p-norm of the k gates (1: their sum)
    scale: Any = 1.0
    # (n_group, topk_group) as spec values, or a function (block, config) -> that pair or None; None: no group limit
    groups: tuple | Callable[[Any, Any], tuple | None] | None = None
    group_score: str = "top2"
    dropped_groups: str = "ninf"  # "zero": AXK2 zero-fills the experts of dropped groups
    bias_on: str = "scores"  # "logits": Kolibri-1 adds its correction bias to the raw logits
    mixer_eps: Any = 0.0  # score="sparsemixer" (PhiMoE): the relative logit gap of each slot's softmax
    logit_softcap: Any = 0.0  # tanh softcap of the router logits (Laguna)
    hash_table: str | None = None  # hash routing's (vocab, k) token-id -> experts table, in the block, where present
    choice_bias: str | None = None  # the selection-only bias, in the block
    experts: str = "experts"  # the experts module, in the block ("": the block itself)
    weights: tuple[str, str] = ("gate_up_proj", "down_proj")  # its input and output tensors
    biases: tuple[str, str] | None = None  # its input and output biases (gpt-oss)
    other_weights: tuple[str, ...] = ()  # further expert tensors a ``tensors`` rule reads (DBRX's v1)
    tensors: str | None = None  # a reshaping rule of mode.hf.moe.blocks.TENSOR_RULES (DBRX's fused 2D weights)
    layout: str = "EFD"
    expert_options: dict = field(default_factory=dict)  # ExpertConfig extras
    activation_field: str | None = "hidden_act"  # config field naming the experts' activation (None: fixed)
    activation: str = "swiglu"  # ExpertConfig.activation: "swiglu" or "relu2"
    # what the activation field must say (None: any of GLU_ACTS for swiglu, which becomes the experts' glu_act;
    # else the activation itself)
    activation_name: str | None = None
    check: Any = None  # a function (block, config) -> why this checkpoint does not convert, or None
    shared: str | None = None  # the shared experts' MLP, in the block (absent or None: none)
    shared_gate: str | None = None  # its per-token sigmoid gate Linear(D, 1), in the block
    shared_average: Any = False  # Cohere2's "average": (routed + shared) / 2
    output_bias: str | None = None  # a bias added after the combine, in the block (JetMoE)
    post_norm: str | None = None  # a norm module the block applies to its output (AXK1's post_mlp_layernorm)
    num_zero: Any = 0  # LongCat-Flash's zero-computation experts: "copy" no-op slots after the real ones
    jitter: tuple = ()  # spec values of training-time noise: converted, but a training forward with it on refuses
    train_refusal: str | None = None  # why a training forward of the converted model refuses (eval is exact)
    returns_tuple: bool = False  # the decoder layer unpacks (output, something): gpt-oss, Llama-4
    unused: tuple[str, ...] = ()  # tensors of the block its forward never reads (kept for the way back)


def _dsr(block: str, **kw) -> Family:
    """DeepSeek-V3's router (sigmoid, correction bias, groups scored by their top 2, renormalised + 1e-20,
    times ``routed_scaling_factor``) with an ungated ``shared_experts`` MLP: 17 families start from it."""
    spec: dict[str, Any] = dict(
        block=block,
        score="sigmoid",
        renormalize=At("gate.norm_topk_prob"),
        renorm_eps=1e-20,
        scale=At("gate.routed_scaling_factor", 1.0),
        groups=(At("gate.num_group"), At("gate.topk_group")),
        choice_bias="gate.e_score_correction_bias",
        shared="shared_experts",
    )
    spec.update(kw)
    return Family(**spec)


def _nemotron_latent(block, config) -> str | None:
    if getattr(config, "moe_latent_size", None) is None:
        return None
    return (
        f"moe_latent_size={config.moe_latent_size}: Nemotron-H's experts then run in a latent space between "
        "two projections, which the converter does not adopt"
    )


def _step3p7_clamp(block, config) -> str | None:
    limit = getattr(getattr(block, "experts", None), "limit", None)
    if limit is None or not math.isfinite(limit):
        return None
    return (
        f"experts.limit={limit}: Step-3.7 clamps its experts' activation after the SiLU (act(gate).clamp(max=L)), "
        "mode's swiglu_limit clamps the gate before it"
    )


def _cohere2_renorm(block, config) -> bool:
    return config.expert_selection_fn == "softmax" or bool(config.norm_topk_prob)


def _deepseek_v2_groups(block, config):
    if getattr(config, "topk_method", "greedy") != "group_limited_greedy":
        return None
    return (Cfg("n_group"), Cfg("topk_group"))


def _aria_expert_weights() -> tuple[str, str]:
    """AriaExperts' input and output tensors, (E, D, 2H) and (E, H, D) on either release: transformers 5.23 holds
    them as ``gate_up_proj`` / ``down_proj``; 5.17 in two grouped-GEMM modules (AriaGroupedExpertsGemm), as
    ``fc1.weight`` / ``fc2.weight`` (the checkpoint's names, which 5.23 renames on loading)."""
    try:
        from transformers.models.aria import modeling_aria
    except ImportError:  # no transformers: the table as data, in 5.23's names
        return ("gate_up_proj", "down_proj")
    if hasattr(modeling_aria, "AriaGroupedExpertsGemm"):
        return ("fc1.weight", "fc2.weight")
    return ("gate_up_proj", "down_proj")


FAMILIES: dict[str, Family] = {
    # softmax top-k
    "mixtral": Family("MixtralSparseMoeBlock", jitter=(Cfg("router_jitter_noise", 0.0),)),
    "olmoe": Family("OlmoeSparseMoeBlock", renormalize=At("gate.norm_topk_prob")),
    "flex_olmo": Family("FlexOlmoSparseMoeBlock", renormalize=At("gate.norm_topk_prob")),
    "qwen2_moe": Family(
        "Qwen2MoeSparseMoeBlock",
        renormalize=At("gate.norm_topk_prob"),
        shared="shared_expert",
        shared_gate="shared_expert_gate",
    ),
    "qwen3_moe": Family("Qwen3MoeSparseMoeBlock", renormalize=At("gate.norm_topk_prob")),
    "qwen3_next": Family(
        "Qwen3NextSparseMoeBlock",
        renormalize=At("gate.norm_topk_prob"),
        shared="shared_expert",
        shared_gate="shared_expert_gate",
    ),
    "qwen3_5_moe_text": Family("Qwen3_5MoeSparseMoeBlock", shared="shared_expert", shared_gate="shared_expert_gate"),
    "minimax": Family("MiniMaxSparseMoeBlock", jitter=(At("jitter_noise", 0.0),)),
    # the block's top_k: 5.23's router (JambaTopKRouter) has one too, 5.17's (a plain nn.Linear) does not
    "jamba": Family("JambaSparseMoeBlock", router="router", top_k=At("top_k"), renormalize=False),
    # DBRX: softmax top-k divided by the p-norm of the k; experts as 2D (E * H, D) w1, v1, w2 (copied once)
    "dbrx": Family(
        "DbrxFFN",
        router="router",
        router_weight="layer.weight",
        top_k=At("top_k"),
        renormalize=lambda b, c: b.moe_normalize_expert_weights is not None,
        renorm_p=At("moe_normalize_expert_weights", 1.0),
        experts="experts.mlp",
        weights=("w1", "w2"),
        other_weights=("v1",),
        tensors="dbrx",
        layout="EDF",
        activation_field=None,
        jitter=(At("router.moe_jitter_eps", 0.0),),
    ),
    # PhiMoE's sparsemixer: each slot's softmax over the logits near it; evaluation exact, training refused
    "phimoe": Family(
        "PhimoeSparseMoeBlock",
        router="router",
        score="sparsemixer",
        renormalize=False,
        mixer_eps=At("router.router_jitter_noise", 0.0),
        jitter=(At("input_jitter_noise", 0.0),),
        train_refusal="PhiMoE trains its router by Gumbel sampling with a Heun-style gradient "
        "estimate (transformers' PhimoeMultiplier), which mode's deterministic "
        "sparsemixer gates do not reproduce",
    ),
    "hunyuan_v1_moe": Family("HunYuanMoEV1Moe", router_weight="wg.weight", shared="shared_mlp"),
    "ernie4_5_moe": Family(
        "Ernie4_5_MoeSparseMoeBlock",
        renorm_min=At("gate.norm_min", 0.0),
        choice_bias="gate.moe_statics.e_score_correction_bias",
        shared="shared_experts",
    ),
    "longcat_flash": Family(
        "LongcatFlashMoE",
        router="router",
        router_weight="classifier.weight",
        renormalize=False,
        scale=At("router.routed_scaling_factor", 1.0),
        choice_bias="router.e_score_correction_bias",
        num_zero=At("experts.zero_expert_num", 0),
        unused=("router.classifier.bias",),
    ),
    # top-k of the logits, softmax over the k chosen (= the renormalised softmax)
    "granitemoe": Family("GraniteMoeMoE", router="router"),
    "granitemoeshared": Family("GraniteMoeSharedMoE", router="router"),
    "granitemoehybrid": Family("GraniteMoeHybridMoE", router="router"),
    # JetMoE's MLP (its mixture of attention heads stays transformers' own); a bias after the combine
    "jetmoe": Family(
        "JetMoeMoE",
        router="router",
        router_weight="layer.weight",
        experts="",
        weights=("input_linear.weight", "output_linear.weight"),
        output_bias="bias",
        activation_field="activation_function",
    ),
    "gpt_oss": Family(
        "GptOssMLP",
        router="router",
        router_bias="bias",
        layout="EDF",
        biases=("gate_up_proj_bias", "down_proj_bias"),
        activation_field=None,
        returns_tuple=True,
        expert_options=dict(
            bias=True,
            fused="interleaved",
            swiglu_alpha=At("experts.alpha"),
            swiglu_limit=At("experts.limit"),
            swiglu_up_offset=1.0,
        ),
    ),
    "cohere2_moe": Family(
        "Cohere2MoeSparseMoeBlock",
        score=Cfg("expert_selection_fn"),
        renormalize=_cohere2_renorm,
        shared="shared_experts",
        shared_average=lambda b, c: c.shared_expert_combination_strategy == "average",
    ),
    # top-k of the logits, sigmoid of the k chosen, input scaled by it before the experts
    "llama4_text": Family(
        "Llama4TextMoe",
        router="router",
        score="sigmoid",
        renormalize=False,
        layout="EDF",
        shared="shared_expert",
        returns_tuple=True,
        expert_options=dict(gate_on_input=True),
    ),
    # sigmoid with a selection-only bias
    "minimax_m2": Family(
        "MiniMaxM2SparseMoeBlock",
        score="sigmoid",
        choice_bias="e_score_correction_bias",
        jitter=(At("jitter_noise", 0.0),),
    ),
    "lfm2_moe": Family(
        "Lfm2MoeSparseMoeBlock",
        score="sigmoid",
        renormalize=At("gate.norm_topk_prob"),
        renorm_eps=1e-6,
        scale=At("gate.routed_scaling_factor", 1.0),
        choice_bias="expert_bias",
        activation_field=None,
    ),
    "afmoe": Family(
        "AfmoeSparseMoeBlock",
        router="router",
        router_weight="gate.weight",
        score="sigmoid",
        renorm_eps=1e-20,
        scale=At("router.route_scale", 1.0),
        choice_bias="expert_bias",
        shared="shared_experts",
    ),
    # DeepSeek-V4: sqrt(softplus) scores, correction bias or (first layers) hash routing by token id; clamped SwiGLU
    "deepseek_v4": Family(
        "DeepseekV4SparseMoeBlock",
        score="sqrtsoftplus",
        renorm_eps=1e-20,
        scale=At("gate.routed_scaling_factor", 1.0),
        choice_bias="gate.e_score_correction_bias",
        hash_table="gate.tid2eid",
        shared="shared_experts",
        expert_options=dict(swiglu_limit=At("experts.limit")),
    ),
    # DeepSeek-V2: softmax, groups scored by their best expert, no renormalisation
    "deepseek_v2": Family(
        "DeepseekV2Moe",
        renormalize=False,
        scale=At("gate.routed_scaling_factor", 1.0),
        groups=_deepseek_v2_groups,
        group_score="max",
        shared="shared_experts",
    ),
    # DeepSeek-V3's router
    "deepseek_v3": _dsr("DeepseekV3MoE"),
    "deepseek_v32": _dsr("DeepseekV32MoE"),
    "glm4_moe": _dsr("Glm4MoeMoE"),
    "glm4_moe_lite": _dsr("Glm4MoeLiteMoE"),
    "glm_moe_dsa": _dsr("GlmMoeDsaMoE"),
    "dots1": _dsr("Dots1MoE"),
    "exaone_moe": _dsr("ExaoneMoeSparseMoEBlock"),
    "kimi_linear": _dsr("KimiLinearMoE"),
    "bailing_hybrid": _dsr("BailingHybridMoE"),
    "mimo_v2_flash": _dsr("MiMoV2FlashMoE", shared=None),
    "axk1": _dsr("AXK1MoE", post_norm="post_mlp_layernorm"),
    "axk2": _dsr("AXK2MoE", dropped_groups="zero"),
    # Nemotron-H: DeepSeek-V3's router, ungated relu^2 experts (up, down), relu^2 shared experts
    "nemotron_h": _dsr(
        "NemotronHMoE",
        weights=("up_proj", "down_proj"),
        activation="relu2",
        activation_field="mlp_hidden_act",
        check=_nemotron_latent,
    ),
    "kolibri1": Family(
        "Kolibri1SparseMoeBlock",
        score="sigmoid",
        renormalize=At("gate.norm_topk_prob"),
        choice_bias="gate.e_score_correction_bias",
        bias_on="logits",
        shared="shared_experts",
    ),
    "dots3_note_text": _dsr("Dots3NoteTextMoE"),
    "solar_open": _dsr("SolarOpenMoE"),
    "hy_v4": _dsr(
        "HYV4MoE", expert_options=dict(swiglu_limit=At("experts.swiglu_limit")), activation_field=None
    ),  # its experts' clamped SwiGLU is silu whatever hidden_act says
    # the scale multiplies the routed output on the block (the same as the gates, up to rounding)
    "beam": _dsr("BeamMoE", scale=At("routed_scaling_factor", 1.0), shared=None),
    # more softmax and top-k-of-logits routers
    "mellum": Family("MellumSparseMoeBlock", renormalize=At("gate.norm_topk_prob")),
    "qwen4_exp_text": Family(
        "Qwen4ExpTextSparseMoeBlock",
        renormalize=At("gate.norm_topk_prob"),
        shared="shared_expert",
        shared_gate="shared_expert_gate",
    ),
    # Aria: routed experts always SiLU-gated (its shared experts, transformers' own module, follow hidden_act);
    # top_k from the config: 5.17's router is a plain nn.Linear (5.23's AriaTextTopKRouter has top_k)
    "aria_text": Family(
        "AriaTextMoELayer",
        router="router",
        top_k=Cfg("moe_topk"),
        layout="EDF",
        weights=_aria_expert_weights(),
        shared="shared_experts",
        activation_field=None,
    ),
    "granitemoe_swa": Family("GraniteMoeSWAMoE", router="router"),
    # sigmoid scores: without a bias (Flint), with a bias on the block or the router and no groups
    "flint": Family(
        "FlintSparseMoeBlock", score="sigmoid", renormalize=At("gate.norm_topk_prob"), shared="shared_expert"
    ),
    "hy_v3": Family(
        "HYV3MoE",
        score="sigmoid",
        renorm_eps=1e-20,
        scale=At("gate.router_scaling_factor", 1.0),
        choice_bias="e_score_correction_bias",
        shared="shared_experts",
    ),
    "laguna": Family(
        "LagunaSparseMoeBlock",
        score="sigmoid",
        scale=At("routed_scaling_factor", 1.0),
        logit_softcap=At("gate.router_logit_softcapping", 0.0),
        choice_bias="gate.e_score_correction_bias",
        shared="shared_experts",
    ),
    "inkling2_text": Family(
        "Inkling2SparseMoeBlock",
        score="sigmoid",
        renorm_eps=1e-20,
        scale=At("gate.routed_scaling_factor", 1.0),
        choice_bias="gate.e_score_correction_bias",
        activation_field=None,
        expert_options=dict(
            swiglu_gate_softcap=At("experts.act_fn.gate_softcap.softcap"),
            swiglu_up_softcap=At("experts.act_fn.up_softcap.softcap"),
        ),
    ),
    # Gemma-4: the decoder layer calls its own router (on the residual) and then the experts (on a normed copy):
    # the experts become mode's (dispatch, expert parallelism), the router stays transformers'
    "gemma4_text": Family(
        "Gemma4TextExperts",
        router=None,
        experts="",
        top_k=Cfg("top_k_experts"),
        activation_field="hidden_activation",
        activation_name="gelu_pytorch_tanh",
        expert_options=dict(glu_act="gelu_tanh"),
    ),
    # MoE text decoders that live inside multimodal models (the converter finds their blocks there too)
    "qwen3_vl_moe_text": Family("Qwen3VLMoeTextSparseMoeBlock"),
    "qwen3_omni_moe_text": Family("Qwen3OmniMoeThinkerTextSparseMoeBlock", renormalize=At("gate.norm_topk_prob")),
    "glm4v_moe_text": _dsr("Glm4vMoeTextMoE"),
    # GLM-5-Next's experts: silu whatever hidden_act says, gate and up clamped at swiglu_limit (10)
    "glm5_next_text": _dsr(
        "Glm5NextTextMoE", activation_field=None, expert_options=dict(swiglu_limit=At("experts.swiglu_limit"))
    ),
    "deepseek_ocr2_text": Family(
        "DeepseekOcr2TextMoe",
        renormalize=False,
        scale=At("gate.routed_scaling_factor", 1.0),
        groups=_deepseek_v2_groups,
        group_score="max",
        shared="shared_experts",
    ),
    "unlimited_ocr_text": Family(
        "UnlimitedOcrTextMoe",
        renormalize=False,
        scale=At("gate.routed_scaling_factor", 1.0),
        groups=_deepseek_v2_groups,
        group_score="max",
        shared="shared_experts",
    ),
    # Mistral-Large-4: softmax, groups by their top 2 (dropped ones zero-filled), renorm + 1e-20, scale; shared
    "mistral_large4_text": Family(
        "MistralLarge4TextMoE",
        renorm_eps=1e-20,
        scale=At("gate.routed_scaling_factor", 1.0),
        groups=(At("gate.num_group"), At("gate.topk_group")),
        dropped_groups="zero",
        shared="shared_experts",
    ),
    # Step-3.7 (text type step3p5): sigmoid + bias, no eps, the scale on the block's routed output; shared
    "step3p5": Family(
        "Step3p7SparseMoeBlock",
        score="sigmoid",
        scale=At("routed_scaling_factor", 1.0),
        choice_bias="gate.e_score_correction_bias",
        shared="shared_experts",
        check=_step3p7_clamp,
    ),
    "minimax_m3_vl_text": Family(
        "MiniMaxM3VLSparseMoeBlock",
        score="sigmoid",
        scale=At("routed_scaling_factor", 1.0),
        choice_bias="gate.e_score_correction_bias",
        shared="shared_experts",
        activation_field=None,
        expert_options=dict(
            swiglu_limit=At("experts.swiglu_limit"), swiglu_alpha=At("experts.swiglu_alpha"), swiglu_up_offset=1.0
        ),
    ),
}

# transformers' activation name (``hidden_act``, ``ACT2FN``) -> the gate activation of mode's gated experts
# (``ExpertConfig.glu_act``): a gated family computes ``ACT2FN[hidden_act](gate) * up`` with whichever it names.
# gelu_new and gelu_fast are the tanh approximation written out (the same function, rounded differently).
GLU_ACTS: dict[str, str] = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "quick_gelu": "quick_gelu",
    "relu": "relu",
    "relu2": "relu2",
    "sigmoid": "sigmoid",
    "tanh": "tanh",
    "mish": "mish",
}

# Decoder MoE families of transformers 5.23 that do not convert yet, and what they need (the refusal says it)
NOT_YET: dict[str, str] = {
    "ernie4_5_vl_moe_text": "ERNIE-4.5-VL's block holds a text and a vision expert set chosen per token by "
    "moe_mm_token_type_ids, with the shared experts on the outer block",
    "muse_spark_text": "Muse-Spark's experts run in a latent space (a projection in, RMSNorms around each expert, a "
    "projection out) and its logits are scaled by an output multiplier before the sigmoid",
    "inkling_text": "Inkling normalises the chosen sigmoid scores together with its shared experts' router logits "
    "(gated shared experts inside the router)",
    "zaya": "Zaya's router is an MLP over a down-projection plus the previous layer's router state, with a skip class",
    "doge": "Doge's product-key experts are rows of embeddings, and its routing mixes tokens (not causal)",
}

# A multimodal family is keyed by its text decoder's model type (Llama-4: "llama4_text", Qwen3.5-MoE:
# "qwen3_5_moe_text"), which is what the converter reads (``config.get_text_config(decoder=True)``).

# model type -> why it does not convert (the refusal names it)
REFUSED: dict[str, str] = {
    "switch_transformers": "an encoder-decoder model (mode.hf converts decoder-only causal LMs), whose experts are "
    "capacity-limited per sequence with dropped tokens",
    "nllb_moe": "an encoder-decoder model (mode.hf converts decoder-only causal LMs), with batch-prioritised "
    "capacity routing and biased ReLU experts",
}


# sparse block class name -> model type
BLOCKS = {spec.block: model_type for model_type, spec in FAMILIES.items()}

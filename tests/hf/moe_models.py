"""Small random transformers MoE causal LMs of each family converted by ``mode.hf.to_mode_moe`` (shared by the
one-process tests and the gloo pools). Nothing is downloaded: each is built from its config with a seed."""

from __future__ import annotations

import torch

D, V = 32, 96


def config(family: str, **overrides):
    """A 2-layer config of ``family`` with every routed path exercised (top-k > 1, shared experts, groups)."""
    import transformers as tf

    common = dict(vocab_size=V, hidden_size=D, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=128, num_experts_per_tok=2, attn_implementation="sdpa",
                  tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "mixtral":
        cfg = tf.MixtralConfig(intermediate_size=48, num_local_experts=8, **common)
    elif family == "olmoe":
        cfg = tf.OlmoeConfig(intermediate_size=48, num_experts=8, norm_topk_prob=False, **common)
    elif family == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(intermediate_size=64, moe_intermediate_size=48, shared_expert_intermediate_size=40,
                                num_experts=8, norm_topk_prob=False, **common)
    elif family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=48, num_experts=8, norm_topk_prob=True,
                                head_dim=8, **common)
    elif family == "deepseek_v3":
        common = {**common, "num_experts_per_tok": 4, "num_key_value_heads": 4}  # MLA: one K/V head per head
        cfg = tf.DeepseekV3Config(intermediate_size=64, moe_intermediate_size=16, n_routed_experts=16, n_group=4,
                                  topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                                  first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                                  qk_nope_head_dim=8, v_head_dim=8, **common)
    else:
        raise ValueError(family)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


FAMILIES = ("mixtral", "olmoe", "qwen2_moe", "qwen3_moe", "deepseek_v3")


def build(family: str, seed: int = 0, **overrides):
    """The family's causal LM with random weights (every weight and buffer drawn: transformers zeroes some
    routers and biases at init, which would hide a wrong mapping)."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config(family, **overrides))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if "inv_freq" in name or not t.is_floating_point():
                continue
            scale = 0.05 if "bias" in name else (1.0 if "norm" in name else t.shape[-1] ** -0.5)
            base = 1.0 if "norm" in name else 0.0
            if t.device.type == "meta":  # under mode.model.build_on_meta: recorded there, replayed in order
                draw = torch.randn(t.shape, generator=g)
            else:  # drawn on the CPU (the same draws on every test device), then onto the parameter's device
                draw = torch.randn(t.shape, generator=g, device="cpu").to(t.device)
            t.copy_(base + draw * scale * (0.1 if "norm" in name else 1.0))
    return model.float()

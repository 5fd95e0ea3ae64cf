"""Small random transformers MoE causal LMs of each family converted by ``mode.hf.to_mode_moe`` (shared by the
one-process tests and the gloo pools). Nothing is downloaded: each is built from its config with a seed."""

from __future__ import annotations

import torch

D, V = 32, 96


def config(family: str, **overrides):
    """A 2-layer config of ``family`` with every routed path exercised (top-k > 1, shared experts, groups)."""
    import transformers as tf

    common = dict(
        vocab_size=V,
        hidden_size=D,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        num_experts_per_tok=2,
        attn_implementation="sdpa",
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if family == "mixtral":
        cfg = tf.MixtralConfig(intermediate_size=48, num_local_experts=8, **common)
    elif family == "olmoe":
        cfg = tf.OlmoeConfig(intermediate_size=48, num_experts=8, norm_topk_prob=False, **common)
    elif family == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(
            intermediate_size=64,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=40,
            num_experts=8,
            norm_topk_prob=False,
            **common,
        )
    elif family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(
            intermediate_size=64, moe_intermediate_size=48, num_experts=8, norm_topk_prob=True, head_dim=8, **common
        )
    elif family == "deepseek_v3":
        common = {**common, "num_experts_per_tok": 4, "num_key_value_heads": 4}  # MLA: one K/V head per head
        cfg = tf.DeepseekV3Config(
            intermediate_size=64,
            moe_intermediate_size=16,
            n_routed_experts=16,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            first_k_dense_replace=1,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            **common,
        )
    elif family == "qwen3_next":  # layers: linear (gated delta net) + dense MLP, full attention + MoE, linear + MoE
        cfg = tf.Qwen3NextConfig(
            intermediate_size=64,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=40,
            num_experts=8,
            norm_topk_prob=True,
            head_dim=8,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            mlp_only_layers=[0],
            **{**common, "num_hidden_layers": 3},
            layer_types=["linear_attention", "full_attention", "linear_attention"],
        )
    elif family == "qwen3_5_moe":  # text-only; every layer sparse (no dense rule); linear + full attention
        cfg = tf.Qwen3_5MoeTextConfig(
            moe_intermediate_size=48,
            shared_expert_intermediate_size=40,
            num_experts=8,
            head_dim=8,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            layer_types=["linear_attention", "full_attention"],
            **common,
        )
    elif family == "deepseek_v2":
        common = {**common, "num_experts_per_tok": 4, "num_key_value_heads": 4}
        cfg = tf.DeepseekV2Config(
            intermediate_size=64,
            moe_intermediate_size=16,
            n_routed_experts=16,
            n_group=4,
            topk_group=2,
            topk_method="group_limited_greedy",
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=False,
            first_k_dense_replace=1,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            **common,
        )
    elif family in ("deepseek_v32", "glm_moe_dsa"):  # MLA + lightning indexer (index_topk < sequence length)
        common = {**common, "num_experts_per_tok": 4, "num_key_value_heads": 4}
        cls = tf.DeepseekV32Config if family == "deepseek_v32" else tf.GlmMoeDsaConfig
        cfg = cls(
            intermediate_size=64,
            moe_intermediate_size=16,
            n_routed_experts=16,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            first_k_dense_replace=1,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            index_topk=4,
            index_head_dim=16,
            index_n_heads=2,
            **common,
        )
    elif family == "deepseek_v4":  # layer 0 hash-routed (needs input_ids: tid2eid[input_ids]), layers 1-2 top-k
        common = {**common, "num_experts_per_tok": 4, "num_key_value_heads": 1, "attn_implementation": "eager"}
        cfg = tf.DeepseekV4Config(
            moe_intermediate_size=16,
            n_routed_experts=8,
            n_shared_experts=1,
            head_dim=16,
            q_lora_rank=16,
            o_groups=2,
            o_lora_rank=16,
            hc_mult=2,
            hc_sinkhorn_iters=3,
            index_n_heads=2,
            index_head_dim=16,
            index_topk=4,
            sliding_window=8,
            compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
            layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
            mlp_layer_types=["hash_moe", "moe", "moe"],
            router_jitter_noise=0.0,
            num_nextn_predict_layers=0,
            **{**common, "num_hidden_layers": 3},
        )
    elif family == "glm4_moe":
        common = {**common, "num_experts_per_tok": 4}
        cfg = tf.Glm4MoeConfig(
            intermediate_size=64,
            moe_intermediate_size=16,
            n_routed_experts=16,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            first_k_dense_replace=1,
            head_dim=8,
            use_qk_norm=True,
            **common,
        )
    elif family == "glm4_moe_lite":
        common = {**common, "num_experts_per_tok": 4, "num_key_value_heads": 4}
        cfg = tf.Glm4MoeLiteConfig(
            intermediate_size=64,
            moe_intermediate_size=16,
            n_routed_experts=16,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            routed_scaling_factor=1.8,
            norm_topk_prob=True,
            mlp_layer_types=["dense", "sparse"],
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            **common,
        )
    elif family == "dots1":
        common = {**common, "num_experts_per_tok": 4}
        cfg = tf.Dots1Config(
            intermediate_size=64,
            moe_intermediate_size=16,
            n_routed_experts=16,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            first_k_dense_replace=1,
            **common,
        )
    elif family == "exaone_moe":
        common = {**common, "num_experts_per_tok": 4}
        cfg = tf.ExaoneMoeConfig(
            intermediate_size=64,
            moe_intermediate_size=16,
            num_experts=16,
            n_group=4,
            topk_group=2,
            num_shared_experts=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            first_k_dense_replace=1,
            sliding_window=8,
            sliding_window_pattern=2,
            **common,
        )
    elif family == "kimi_linear":  # layers: KDA + dense MLP, MLA + MoE, KDA + MoE
        common = {**common, "num_experts_per_tok": 4, "num_key_value_heads": 4, "num_hidden_layers": 3}
        cfg = tf.KimiLinearConfig(
            intermediate_size=64,
            moe_intermediate_size=16,
            num_experts=16,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            linear_attn_config={"head_dim": 8, "num_heads": 4, "short_conv_kernel_size": 4},
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            mlp_layer_types=["dense", "sparse", "sparse"],
            **common,
        )
    elif family == "bailing_hybrid":  # layers: linear (KDA) + dense MLP, MLA + MoE
        common = {**common, "num_experts_per_tok": 4, "num_key_value_heads": 4}
        cfg = tf.BailingHybridConfig(
            intermediate_size=64,
            moe_intermediate_size=16,
            num_experts=16,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            first_k_dense_replace=1,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            head_dim=8,
            layer_group_size=2,
            num_nextn_predict_layers=0,
            **common,
        )
    elif family == "mimo_v2_flash":  # no SDPA in transformers (attention sinks): eager
        common = {**common, "num_experts_per_tok": 4}
        common = {**common, "attn_implementation": "eager"}
        cfg = tf.MiMoV2FlashConfig(
            intermediate_size=64,
            moe_intermediate_size=16,
            n_routed_experts=16,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            head_dim=12,
            v_head_dim=8,
            sliding_window=8,
            layer_types=["full_attention", "sliding_attention"],
            **common,
        )
    elif family == "ernie4_5_moe":
        cfg = tf.Ernie4_5_MoeConfig(
            intermediate_size=64,
            moe_intermediate_size=48,
            moe_num_experts=8,
            moe_num_shared_experts=1,
            moe_layer_start_index=1,
            **common,
        )
    elif family == "hunyuan_v1_moe":
        cfg = tf.HunYuanMoEV1Config(intermediate_size=48, num_experts=8, head_dim=8, **common)
    elif family == "longcat_flash":  # num_hidden_layers = 2 * num_layers (two attention sublayers per layer)
        common = {k: v for k, v in common.items() if k not in ("num_hidden_layers", "num_key_value_heads")}
        cfg = tf.LongcatFlashConfig(
            num_layers=1,
            num_key_value_heads=4,
            ffn_hidden_size=64,
            expert_ffn_hidden_size=16,
            n_routed_experts=8,
            zero_expert_num=4,
            routed_scaling_factor=6.0,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            head_dim=8,
            **common,
        )
    elif family == "gpt_oss":  # no SDPA in transformers (attention sinks): eager; every layer sparse
        yarn = {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4,
        }  # 128 / 4 = factor: no mismatch warning
        cfg = tf.GptOssConfig(
            intermediate_size=16,
            num_local_experts=8,
            head_dim=8,
            sliding_window=8,
            rope_parameters=yarn,
            attn_implementation="eager",
            **{k: v for k, v in common.items() if k != "attn_implementation"},
        )
    elif family == "llama4":  # text only (Llama4ForCausalLM); layer 0 dense, layer 1 MoE with shared expert
        cfg = tf.Llama4TextConfig(
            intermediate_size=16,
            intermediate_size_mlp=64,
            num_local_experts=8,
            head_dim=8,
            interleave_moe_layer_step=2,
            attention_chunk_size=8,
            router_jitter_noise=0.0,
            **common,
        )
    elif family == "phimoe":  # router_jitter_noise is sparsemixer's threshold: 0.0 keeps train() deterministic
        cfg = tf.PhimoeConfig(
            intermediate_size=48, num_local_experts=8, router_jitter_noise=0.0, input_jitter_noise=0.0, **common
        )
    elif family == "flex_olmo":
        cfg = tf.FlexOlmoConfig(intermediate_size=48, num_experts=8, norm_topk_prob=False, **common)
    elif family == "minimax":  # layers: full attention, lightning (linear) attention
        cfg = tf.MiniMaxConfig(
            intermediate_size=48,
            num_local_experts=8,
            head_dim=8,
            block_size=4,
            router_jitter_noise=0.0,
            layer_types=["full_attention", "linear_attention"],
            **common,
        )
    elif family == "minimax_m2":
        cfg = tf.MiniMaxM2Config(
            intermediate_size=48, num_local_experts=8, head_dim=8, router_jitter_noise=0.0, **common
        )
    elif family == "granitemoe":
        cfg = tf.GraniteMoeConfig(
            intermediate_size=48,
            num_local_experts=8,
            embedding_multiplier=2.0,
            logits_scaling=2.0,
            residual_multiplier=0.5,
            attention_multiplier=0.25,
            **common,
        )
    elif family == "granitemoeshared":
        cfg = tf.GraniteMoeSharedConfig(
            intermediate_size=48,
            num_local_experts=8,
            shared_intermediate_size=40,
            embedding_multiplier=2.0,
            logits_scaling=2.0,
            residual_multiplier=0.5,
            attention_multiplier=0.25,
            **common,
        )
    elif family == "granitemoehybrid":  # layers: mamba2, attention; every layer MoE + shared MLP
        cfg = tf.GraniteMoeHybridConfig(
            intermediate_size=48,
            num_local_experts=8,
            shared_intermediate_size=40,
            embedding_multiplier=2.0,
            logits_scaling=2.0,
            residual_multiplier=0.5,
            attention_multiplier=0.25,
            position_embedding_type="rope",
            layer_types=["linear_attention", "full_attention"],
            mamba_n_heads=8,
            mamba_d_state=16,
            mamba_d_head=8,
            mamba_chunk_size=8,
            **common,
        )
    elif family == "jetmoe":  # also a mixture of attention experts (num_attention_heads = kv heads * top-k)
        common = {k: v for k, v in common.items() if k != "num_attention_heads"}
        cfg = tf.JetMoeConfig(intermediate_size=48, num_local_experts=8, kv_channels=8, **common)
    elif family == "dbrx":  # attn_config needs rope_theta (DbrxAttention reads it; the default config lacks it) and
        # a clip_qkv (None crashes clamp) in transformers 5.23; its jitter is ffn_config["moe_jitter_eps"] (None = off)
        cfg = tf.DbrxConfig(
            d_model=D,
            n_heads=4,
            n_layers=2,
            max_seq_len=128,
            vocab_size=V,
            attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
            attn_implementation="sdpa",
            tie_word_embeddings=False,
            ffn_config={"ffn_hidden_size": 48, "moe_num_experts": 8, "moe_top_k": 2, "moe_jitter_eps": None},
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )
    elif family == "lfm2_moe":  # layers: short conv + dense MLP, attention + MoE, conv + MoE
        cfg = tf.Lfm2MoeConfig(
            intermediate_size=64,
            moe_intermediate_size=16,
            num_experts=8,
            use_expert_bias=True,
            routed_scaling_factor=2.0,
            norm_topk_prob=True,
            num_dense_layers=1,
            layer_types=["conv", "full_attention", "conv"],
            **{**common, "num_hidden_layers": 3},
        )
    elif family == "afmoe":
        cfg = tf.AfmoeConfig(
            intermediate_size=64,
            moe_intermediate_size=16,
            num_experts=8,
            num_shared_experts=1,
            num_dense_layers=1,
            head_dim=8,
            route_scale=2.0,
            global_attn_every_n_layers=2,
            sliding_window=8,
            **common,
        )
    elif family == "cohere2_moe":
        cfg = tf.Cohere2MoeConfig(
            intermediate_size=48,
            num_experts=8,
            num_shared_experts=1,
            head_dim=8,
            first_k_dense_replace=1,
            prefix_dense_intermediate_size=64,
            sliding_window=8,
            sliding_window_pattern=2,
            **common,
        )
    elif family == "jamba":  # layer 0: mamba + dense MLP, layer 1: attention + MoE
        cfg = tf.JambaConfig(
            intermediate_size=48,
            num_experts=8,
            expert_layer_period=2,
            expert_layer_offset=1,
            attn_layer_period=2,
            attn_layer_offset=1,
            mamba_d_state=8,
            **common,
        )
    elif family == "aria":  # text only (AriaTextForCausalLM); every layer MoE with shared experts
        cfg = tf.AriaTextConfig(
            intermediate_size=48, moe_num_experts=8, moe_topk=2, moe_num_shared_experts=1, head_dim=8, **common
        )
    elif family in ("axk1", "mistral4", "solar_open", "hy_v4", "axk2", "dots3_note"):  # DeepSeek-V3-style groups
        # mistral4: the config builds, but AutoModelForCausalLM does not map it (see PROBLEMS)
        common = {**common, "num_experts_per_tok": 4, "num_key_value_heads": 4}
        kw = dict(
            intermediate_size=64,
            moe_intermediate_size=16,
            n_routed_experts=16,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
        )
        mla = dict(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
        if family == "axk1":
            cfg = tf.AXK1Config(mlp_layer_types=["dense", "sparse"], **kw, **mla, **common)
        elif family == "mistral4":
            cfg = tf.Mistral4Config(first_k_dense_replace=1, **kw, **mla, **common)
        elif family == "solar_open":
            kw.pop("intermediate_size")
            cfg = tf.SolarOpenConfig(head_dim=8, **kw, **{**common, "num_key_value_heads": 2})
        elif family == "axk2":
            cfg = tf.AXK2Config(
                mlp_layer_types=["dense", "sparse"],
                index_topk=4,
                index_head_dim=16,
                index_n_heads=2,
                **kw,
                **mla,
                **common,
            )
        elif family == "hy_v4":  # no SDPA in transformers: eager
            cfg = tf.HYV4Config(
                mlp_layer_types=["dense", "sparse"],
                index_topk=4,
                index_head_dim=16,
                index_n_heads=2,
                **kw,
                **mla,
                **{**common, "attn_implementation": "eager"},
            )
        else:  # text only (Dots3NoteForCausalLM); the sliding layer's MLA sizes are the swa_* keys
            cfg = tf.Dots3NoteTextConfig(
                mlp_layer_types=["dense", "sparse"],
                index_topk=4,
                index_head_dim=16,
                index_n_heads=2,
                head_dim=8,
                sliding_window=8,
                shared_experts_intermediate_size=16,
                swa_num_attention_heads=4,
                swa_num_key_value_heads=4,
                swa_q_lora_rank=16,
                swa_kv_lora_rank=16,
                swa_head_dim=16,
                swa_qk_nope_head_dim=8,
                swa_v_head_dim=8,
                layer_types=["indexed_attention", "sliding_attention"],
                **kw,
                **mla,
                **common,
            )
    elif family == "beam":  # layer 0 sliding + dense, layer 1 full + sparse; groups
        common = {**common, "num_experts_per_tok": 4}
        cfg = tf.BeamConfig(
            intermediate_size=64,
            moe_intermediate_size=16,
            num_experts=16,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            head_dim=8,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            mlp_layer_types=["dense", "sparse"],
            **common,
        )
    elif family == "flint":  # no SDPA in transformers: eager
        cfg = tf.FlintConfig(
            intermediate_size=64,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            num_experts=8,
            norm_topk_prob=True,
            mlp_only_layers=[0],
            head_dim=8,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            **{**common, "attn_implementation": "eager"},
        )
    elif family == "gemma4":  # text only (Gemma4ForCausalLM); MoE block beside the dense MLP in every layer
        common = {k: v for k, v in common.items() if k != "num_experts_per_tok"}
        cfg = tf.Gemma4TextConfig(
            intermediate_size=64,
            enable_moe_block=True,
            num_experts=8,
            top_k_experts=2,
            moe_intermediate_size=16,
            head_dim=8,
            global_head_dim=16,
            sliding_window=8,
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=V,
            layer_types=["sliding_attention", "full_attention"],
            **common,
        )
    elif family == "granitemoe_swa":  # no SDPA in transformers (attention sinks): eager
        cfg = tf.GraniteMoeSWAConfig(
            intermediate_size=48,
            num_local_experts=8,
            shared_intermediate_size=40,
            embedding_multiplier=2.0,
            logits_scaling=2.0,
            residual_multiplier=0.5,
            attention_multiplier=0.25,
            sliding_window=8,
            layer_types=["full_attention", "sliding_attention"],
            **{**common, "attn_implementation": "eager"},
        )
    elif family == "hy_v3":
        cfg = tf.HYV3Config(
            intermediate_size=64,
            moe_intermediate_size=16,
            num_experts=8,
            num_shared_experts=1,
            router_scaling_factor=2.5,
            head_dim=8,
            mlp_layer_types=["dense", "sparse"],
            **common,
        )
    elif family in ("inkling", "inkling2"):  # text only; inkling2 has no SDPA (eager), no dense rule, no shared experts
        cls = tf.InklingTextConfig if family == "inkling" else tf.Inkling2TextConfig
        kw = {}
        if family == "inkling":
            kw = dict(n_shared_experts=1, intermediate_size=64, mlp_layer_types=["dense", "sparse"])
        cfg = cls(
            moe_intermediate_size=16,
            n_routed_experts=8,
            head_dim=8,
            swa_num_attention_heads=4,
            swa_num_key_value_heads=2,
            swa_head_dim=8,
            sliding_window_size=8,
            route_scale=2.0,
            layer_types=["hybrid_sliding", "hybrid"],
            **kw,
            **{**common, "attn_implementation": "sdpa" if family == "inkling" else "eager"},
        )
    elif family == "kolibri1":
        cfg = tf.Kolibri1Config(
            moe_intermediate_size=16,
            num_local_experts=8,
            norm_topk_prob=True,
            head_dim=8,
            sliding_window=8,
            shared_expert_intermediate_size=24,
            layer_types=["sliding_attention", "full_attention"],
            **common,
        )
    elif family == "laguna":
        cfg = tf.LagunaConfig(
            intermediate_size=64,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            num_experts=8,
            head_dim=8,
            sliding_window=8,
            moe_routed_scaling_factor=2.0,
            layer_types=["sliding_attention", "full_attention"],
            mlp_layer_types=["dense", "sparse"],
            **common,
        )
    elif family == "mellum":
        cfg = tf.MellumConfig(
            intermediate_size=64,
            moe_intermediate_size=16,
            num_local_experts=8,
            norm_topk_prob=True,
            head_dim=8,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            mlp_layer_types=["dense", "sparse"],
            **common,
        )
    elif family == "minimax_m3_vl":  # text only (MiniMaxM3VLForCausalLM)
        cfg = tf.MiniMaxM3VLTextConfig(
            intermediate_size=16,
            num_local_experts=8,
            head_dim=8,
            router_jitter_noise=0.0,
            dense_intermediate_size=64,
            shared_intermediate_size=24,
            routed_scaling_factor=2.0,
            mlp_layer_types=["dense", "sparse"],
            index_n_heads=2,
            index_head_dim=8,
            index_block_size=4,
            index_topk_blocks=2,
            **common,
        )
    elif family == "nemotron_h":  # blocks (one mixer per layer): mamba2, MoE, attention, dense MLP
        common = {k: v for k, v in common.items() if k != "num_hidden_layers"}
        common = {**common, "num_experts_per_tok": 4}
        cfg = tf.NemotronHConfig(
            layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
            intermediate_size=64,
            n_routed_experts=16,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            moe_intermediate_size=16,
            moe_shared_expert_intermediate_size=24,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            head_dim=8,
            mamba_num_heads=8,
            mamba_head_dim=8,
            n_groups=2,
            ssm_state_size=16,
            chunk_size=8,
            **common,
        )
    elif family == "qwen4_exp":  # text only (Qwen4ExpForCausalLM)
        cfg = tf.Qwen4ExpTextConfig(
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            num_experts=8,
            norm_topk_prob=True,
            head_dim=8,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            # the checkpoints' spelling: 5.23 reads it as "indexed_attention", 5.17 as "qwen_sparse_attention"
            layer_types=["linear_attention", "full_attention"],
            hc_count=2,
            hc_lowrank=8,
            indexer_n_heads=2,
            indexer_kv_heads=1,
            indexer_head_dim=8,
            indexer_budget=4,
            indexer_compress_ratio=2,
            **common,
        )
    elif family == "zaya":  # ZayaConfig accepts num_experts_per_tok=1 only (top-1 routing)
        cfg = tf.ZayaConfig(
            moe_intermediate_size=16,
            num_experts=8,
            head_dim=8,
            router_hidden_size=16,
            **{**common, "num_experts_per_tok": 1},
        )
    elif family == "doge":  # product-key MoE (CDMoE): experts are single rows, num_experts a square (keys 4 x 4).
        # transformers 5.23 splits the key logits with view(2, B*S, keys), not along the last dim: a token's keys come
        # from other tokens (later ones and other rows too), so its outputs are not causal (cached decode differs)
        cfg = tf.DogeConfig(
            intermediate_size=48,
            is_moe=True,
            num_experts=16,
            num_experts_per_tok=4,
            **{k: v for k, v in common.items() if k != "num_experts_per_tok"},
        )
    elif family in MULTIMODAL_FAMILIES:
        cfg = _multimodal_config(family, {k: v for k, v in common.items() if k != "attn_implementation"})
    else:
        raise ValueError(family)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def _multimodal_config(family: str, common: dict):
    """The multimodal config of a family whose MoE text decoder exists only inside a ...ForConditionalGeneration:
    the text decoder as small as the causal LMs', the vision (and audio) towers the smallest that build."""
    import transformers as tf

    rope = {"rope_type": "default", "rope_theta": 10000.0}
    groups = dict(
        intermediate_size=64,
        moe_intermediate_size=16,
        n_routed_experts=16,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
    )
    qwen_vision = dict(
        depth=1,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=D,
        deepstack_visual_indexes=[0],
        num_position_embeddings=16,
        patch_size=4,
    )
    if family == "qwen3_vl_moe":  # the router always renormalises (no norm_topk_prob)
        text = dict(
            intermediate_size=64,
            moe_intermediate_size=48,
            num_experts=8,
            head_dim=8,
            rope_parameters={**rope, "mrope_section": [2, 1, 1]},
            **common,
        )
        return tf.Qwen3VLMoeConfig(text_config=text, vision_config=qwen_vision, tie_word_embeddings=False)
    if family == "qwen3_omni_moe":  # the thinker (Qwen3OmniMoeThinkerForConditionalGeneration), no talker
        text = dict(
            intermediate_size=64,
            moe_intermediate_size=48,
            num_experts=8,
            norm_topk_prob=True,
            head_dim=8,
            rope_parameters={**rope, "mrope_section": [2, 1, 1]},
            **common,
        )
        audio = dict(
            num_mel_bins=16,
            encoder_layers=1,
            encoder_attention_heads=2,
            encoder_ffn_dim=32,
            d_model=16,
            output_dim=D,
            downsample_hidden_size=8,
        )
        cfg = tf.Qwen3OmniMoeThinkerConfig(text_config=text, vision_config=qwen_vision, audio_config=audio)
        cfg.vision_start_token_id = 151652  # read by its rope index, not set by the thinker config in 5.23
        return cfg
    if family == "glm4v_moe":
        text = dict(
            **groups,
            norm_topk_prob=True,
            first_k_dense_replace=1,
            head_dim=8,
            rope_parameters={**rope, "partial_rotary_factor": 0.5, "mrope_section": [1, 1, 0]},
            **{**common, "num_experts_per_tok": 4},
        )
        vision = dict(
            depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=D, image_size=8, patch_size=4
        )
        return tf.Glm4vMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
    if family == "glm5_next":  # layers: KDA + dense MLP, indexed (NoPE MLA) attention + MoE
        text = dict(
            **groups,
            norm_topk_prob=True,
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=0,
            qk_nope_head_dim=8,
            v_head_dim=8,
            mlp_layer_types=["dense", "sparse"],
            index_topk=4,
            index_head_dim=16,
            index_n_heads=2,
            index_kpool=2,
            linear_head_dim=8,
            linear_num_heads=4,
            hc_mult=2,
            hc_sinkhorn_iters=3,
            # the checkpoints' spelling: 5.23 reads it as "indexed_attention", 5.17 as "deepseek_sparse_attention"
            layer_types=["linear_attention", "full_attention"],
            indexer_types=["full", "full"],
            **{**common, "num_experts_per_tok": 4, "num_key_value_heads": 4},
        )
        vision = dict(
            depth=1,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            out_hidden_size=D,
            image_size=8,
            patch_size=4,
            projection_intermediate_size=32,
        )
        return tf.Glm5NextConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
    if family in ("deepseek_ocr2", "unlimited_ocr"):  # DeepSeek-V2's router (softmax, groups by their best)
        text = dict(
            **groups,
            topk_method="group_limited_greedy",
            head_dim=8,
            mlp_layer_types=["dense", "sparse"],
            **{**common, "num_experts_per_tok": 4, "num_key_value_heads": 4},
        )
        sam = dict(
            hidden_size=16,
            output_channels=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=64,
            patch_size=16,
            window_size=2,
            global_attn_indexes=[0],
            mlp_dim=32,
            downsample_channels=[16, 32],
        )
        enc = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
        if family == "deepseek_ocr2":
            vision = dict(sam_config=sam, encoder_config={**enc, "num_key_value_heads": 2, "vocab_size": V})
            return tf.DeepseekOcr2Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
        vision = dict(sam_config=sam, encoder_config={**enc, "image_size": 28})
        return tf.UnlimitedOcrConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
    if family == "mistral_large4":  # softmax with groups, always renormalised; MLA + indexer (DSA) attention
        text = dict(
            **groups,
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            head_dim=8,
            first_k_dense_replace=1,
            index_topk=4,
            index_head_dim=16,
            index_n_heads=2,
            rope_parameters=rope,
            **{**common, "num_experts_per_tok": 4, "num_key_value_heads": 4},
        )
        vision = dict(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            head_dim=8,
            image_size=32,
            patch_size=16,
        )
        return tf.MistralLarge4Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    if family == "step3p7":  # text model_type step3p5; no swiglu_limits (no clamped experts)
        text = dict(
            intermediate_size=64,
            moe_intermediate_size=16,
            n_routed_experts=8,
            share_expert_dim=24,
            head_dim=8,
            num_sliding_attention_heads=4,
            query_pre_attn_scalar=8,
            moe_router_scaling_factor=2.0,
            mlp_layer_types=["dense", "sparse"],
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            **common,
        )
        vision = dict(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        )
        return tf.Step3p7Config(text_config=text, vision_config=vision)
    if family == "ernie4_5_vl_moe":  # modality-isolated experts (text, vision); text-only runs the text set
        text = dict(
            intermediate_size=64,
            moe_intermediate_size=[48, 16],
            moe_k=2,
            moe_num_experts=8,
            moe_num_shared_experts=1,
            mlp_layer_types=["dense", "sparse"],
            rope_parameters={**rope, "mrope_section": [1, 1, 2]},
            **{k: v for k, v in common.items() if k != "num_experts_per_tok"},
        )
        vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4)
        return tf.Ernie4_5_VLMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
    if family == "muse_spark":  # experts in a latent space (moe_hidden_size) between two projections
        text = dict(
            intermediate_size=64,
            head_dim=8,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            layer_rope_theta=[10000.0, 10000.0],
            moe_intermediate_size=16,
            num_local_experts=8,
            routed_scaling_factor=2.0,
            moe_hidden_size=16,
            mlp_layer_types=["dense", "sparse"],
            **common,
        )
        vision = dict(
            num_attention_heads=2,
            num_hidden_layers=1,
            hidden_size=16,
            intermediate_size=32,
            pos_emb_height=4,
            pos_emb_width=4,
            max_position_embeddings=16,
        )
        audio = dict(patch_sizes=[16, 2], hidden_sizes=[8, 16], depths=[1, 1], num_hidden_layers=2, out_hidden_size=D)
        return tf.MuseSparkConfig(
            text_config=text,
            vision_config=vision,
            audio_config=audio,
            projector_hidden_size=32,
            tie_word_embeddings=False,
        )
    raise ValueError(family)


FAMILIES = ("mixtral", "olmoe", "qwen2_moe", "qwen3_moe", "deepseek_v3")

# Every family ``config`` knows whose model builds and runs here (CPU, float32): left-padded forward with labels and
# output_router_logits, backward, greedy generate, save_pretrained round trip. ``FAMILIES`` is what the converter
# supports today.
ALL_FAMILIES = (
    *FAMILIES,
    "qwen3_next",
    "qwen3_5_moe",
    "deepseek_v2",
    "deepseek_v32",
    "deepseek_v4",
    "glm4_moe",
    "glm4_moe_lite",
    "glm_moe_dsa",
    "dots1",
    "exaone_moe",
    "kimi_linear",
    "bailing_hybrid",
    "mimo_v2_flash",
    "ernie4_5_moe",
    "hunyuan_v1_moe",
    "longcat_flash",
    "gpt_oss",
    "llama4",
    "phimoe",
    "flex_olmo",
    "minimax",
    "minimax_m2",
    "granitemoe",
    "granitemoeshared",
    "granitemoehybrid",
    "jetmoe",
    "dbrx",
    "lfm2_moe",
    "afmoe",
    "cohere2_moe",
    "jamba",
)

# More MoE causal LMs of transformers 5.23 that ``config`` knows and that pass the same checks; not in
# ``ALL_FAMILIES``. Multimodal types appear by their text-only causal LM (aria, dots3_note, gemma4, inkling,
# inkling2, minimax_m3_vl, qwen4_exp). zaya routes top-1 only (its config refuses more), and like dbrx its
# save_pretrained round trip matches up to CPU matmul rounding (4.8e-7), exactly once the loaded tensors are cloned.
MORE_FAMILIES = (
    "aria",
    "axk1",
    "axk2",
    "beam",
    "doge",
    "dots3_note",
    "flint",
    "gemma4",
    "granitemoe_swa",
    "hy_v3",
    "hy_v4",
    "inkling",
    "inkling2",
    "kolibri1",
    "laguna",
    "mellum",
    "minimax_m3_vl",
    "nemotron_h",
    "qwen4_exp",
    "solar_open",
    "zaya",
)

# MoE text decoders that exist only inside a multimodal ...ForConditionalGeneration (built here as that, with tiny
# vision/audio towers; text-only left-padded forward with labels, backward and greedy generate run): not in
# ``ALL_FAMILIES`` / ``MORE_FAMILIES``, whose checks assume a causal LM. Their text model types are those of
# ``config(family).get_text_config(decoder=True)`` (step3p7's is "step3p5"). ``build`` makes each with the class
# of ``MULTIMODAL_CLASSES`` (default: AutoModelForImageTextToText).
MULTIMODAL_FAMILIES = (
    "qwen3_vl_moe",
    "qwen3_omni_moe",
    "glm4v_moe",
    "glm5_next",
    "deepseek_ocr2",
    "unlimited_ocr",
    "mistral_large4",
    "step3p7",
    "ernie4_5_vl_moe",
    "muse_spark",
)
MULTIMODAL_CLASSES = {"qwen3_omni_moe": "Qwen3OmniMoeThinkerForConditionalGeneration"}

# MoE model types of transformers that cannot be built or run here as a causal LM, and why (one line each).
# The multimodal ones of ``MULTIMODAL_FAMILIES`` build as their ...ForConditionalGeneration.
# dbrx needs two config workarounds (see config), and its save_pretrained round trip matches only up to CPU matmul
# rounding (safetensors-loaded expert tensors are not 64-byte aligned), exactly once the tensors are cloned.
PROBLEMS: dict[str, str] = {
    "mistral4": "Mistral4ForCausalLM exists, but AutoModelForCausalLM does not map Mistral4Config (no auto class)",
    "deepseek_ocr2": "MoE text decoder only inside DeepseekOcr2ForConditionalGeneration; no text-only causal LM",
    "unlimited_ocr": "MoE text decoder only inside UnlimitedOcrForConditionalGeneration; no text-only causal LM",
    "ernie4_5_vl_moe": "MoE text decoder only inside Ernie4_5_VLMoeForConditionalGeneration; no text causal LM",
    "glm4v_moe": "MoE text decoder only inside Glm4vMoeForConditionalGeneration (Glm4vMoeTextModel has no LM head)",
    "glm5_next": "MoE text decoder only inside Glm5NextForConditionalGeneration (Glm5NextTextModel has no LM head)",
    "mistral_large4": "MoE text decoder only inside MistralLarge4ForConditionalGeneration; no text causal LM",
    "muse_spark": "MoE text decoder only inside MuseSparkForConditionalGeneration; no text-only causal LM",
    "qwen3_vl_moe": "MoE text decoder only inside Qwen3VLMoeForConditionalGeneration; no text-only causal LM",
    "qwen3_omni_moe": "MoE thinker/talker only inside Qwen3OmniMoe*ForConditionalGeneration; no text causal LM",
    "step3p7": "MoE text decoder (text model_type step3p5) only inside Step3p7ForConditionalGeneration",
    "diffusion_gemma": "MoE decoder of a block-diffusion model (DiffusionGemmaForBlockDiffusion), not a causal LM",
    "openai_privacy_filter": "bidirectional MoE encoder for token classification (is_causal=False), no causal LM",
    "nllb_moe": "encoder-decoder (NllbMoeForConditionalGeneration), not a decoder-only causal LM",
    "switch_transformers": "encoder-decoder (SwitchTransformersForConditionalGeneration), not a causal LM",
}


def available(family: str) -> bool:
    """Whether the installed transformers ships ``family`` (the oldest release the hf extra allows lacks the
    newest families: their config class is not there)."""
    try:
        config(family)
    except AttributeError as e:
        if "module transformers has no attribute" in str(e):
            return False
        raise
    return True


def build(family: str, seed: int = 0, **overrides):
    """The family's causal LM (a multimodal family's ...ForConditionalGeneration) with random weights (every
    weight and buffer drawn: transformers zeroes some routers and biases at init, which would hide a wrong mapping)."""
    import transformers as tf

    torch.manual_seed(seed)
    if family in MULTIMODAL_CLASSES:
        model = getattr(tf, MULTIMODAL_CLASSES[family])._from_config(config(family, **overrides))
    elif family in MULTIMODAL_FAMILIES:
        model = tf.AutoModelForImageTextToText.from_config(config(family, **overrides))
    else:
        model = tf.AutoModelForCausalLM.from_config(config(family, **overrides))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("tid2eid"):  # deepseek_v4 hash routing (token id -> top-k experts), zeros at init
                draw = torch.rand((t.shape[0], model.config.n_routed_experts), generator=g).argsort(-1)
                t.copy_(draw[:, : t.shape[1]].to(t.device))  # distinct experts per token
                continue
            if "inv_freq" in name or not t.is_floating_point() or t.dim() == 0:  # 0-d: gemma4's scalar buffers
                continue
            scale = 0.05 if "bias" in name else (1.0 if "norm" in name else t.shape[-1] ** -0.5)
            base = 1.0 if "norm" in name else 0.0
            if t.device.type == "meta":  # under mode.model.build_on_meta: recorded there, replayed in order
                draw = torch.randn(t.shape, generator=g)
            else:  # drawn on the CPU (the same draws on every test device), then onto the parameter's device
                draw = torch.randn(t.shape, generator=g, device="cpu").to(t.device)
            t.copy_(base + draw * scale * (0.1 if "norm" in name else 1.0))
            if name.endswith("gate.balancing_biases"):  # zaya's skip expert: from_pretrained resets it to -1
                t[-1] = -1.0
    return model.float()

"""transformers' own MoE blocks (Qwen2-MoE, Qwen3-MoE, DeepSeek-V3) and our MoELayer configured as each
(``mode.hf.moe.blocks``): the same output and input gradient, float32, to 1e-5."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install 'mode-torch[hf]'): the blocks to compare with"
)

from mode.hf.moe.blocks import from_block, moe_config  # noqa: E402

D, B, S = 32, 3, 10


def qwen3():
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(
        hidden_size=D, moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True
    )
    return Qwen3MoeSparseMoeBlock(cfg), cfg


def qwen2():
    from transformers.models.qwen2_moe.configuration_qwen2_moe import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    cfg = Qwen2MoeConfig(
        hidden_size=D,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=80,
        num_experts=8,
        num_experts_per_tok=3,
        norm_topk_prob=False,
    )
    return Qwen2MoeSparseMoeBlock(cfg), cfg


def deepseek_v3():
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = DeepseekV3Config(
        hidden_size=D,
        moe_intermediate_size=16,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        n_shared_experts=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )
    return DeepseekV3MoE(cfg), cfg


FAMILIES = {"qwen3_moe": qwen3, "qwen2_moe": qwen2, "deepseek_v3": deepseek_v3}


def randomize(block: torch.nn.Module) -> None:
    """transformers initialises some of these weights to zeros: random values exercise every path."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, t in [*block.named_parameters(), *block.named_buffers()]:
            draw = torch.randn(t.shape, generator=g, device="cpu").to(t.device)  # the same draws on every device
            t.copy_(draw * (0.05 if "bias" in name else t.shape[-1] ** -0.5))


@pytest.mark.parametrize("backend", ["reference", "grouped"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_our_layer_configured_as_the_block_computes_what_it_computes(family, backend):
    torch.manual_seed(0)
    block, cfg = FAMILIES[family]()
    randomize(block)
    layer = from_block(block, cfg, backend=backend)
    x = torch.randn(B, S, D)
    x_hf, x_us = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_hf = block(x_hf)
    y_us, aux = layer(x_us)
    torch.testing.assert_close(y_us, y_hf, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y_hf)
    (gx_hf,) = torch.autograd.grad(y_hf, x_hf, g)
    (gx_us,) = torch.autograd.grad(y_us, x_us, g)
    torch.testing.assert_close(gx_us, gx_hf, rtol=1e-5, atol=1e-5)
    assert aux.stats["router"].kept_E.sum() == B * S * cfg.num_experts_per_tok  # dropless, no no-op slots


def test_deepseek_groups_and_bias_decide_the_choice():
    """With the correction bias and the group limit both active, a token's experts lie in its topk_group
    groups, and changing the bias changes choices but not the gate of a chosen expert."""
    block, cfg = deepseek_v3()
    randomize(block)
    layer = from_block(block, cfg, backend="reference")
    x = torch.randn(B, S, D)
    plan = layer.router(x)
    per_group = cfg.n_routed_experts // cfg.n_group
    groups_T = [set() for _ in range(B * S)]
    for t, e in zip(plan.token_idx_A.tolist(), plan.expert_idx_A.tolist()):
        groups_T[t].add(e // per_group)
    assert max(len(g) for g in groups_T) <= cfg.topk_group


def test_unsupported_blocks_and_activations_are_refused():
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig

    with pytest.raises(ValueError, match=r"block=Linear: not a supported transformers MoE block"):
        from_block(torch.nn.Linear(2, 2), Qwen3MoeConfig())
    with pytest.raises(ValueError, match=r"hidden_act='gelu_10'"):  # a clipped gelu: not in GLU_ACTS
        block, cfg = qwen3()
        cfg.hidden_act = "gelu_10"
        moe_config(block, cfg)
    block, cfg = qwen3()
    cfg.hidden_act = "gelu"  # GeGLU experts, as transformers runs them
    assert moe_config(block, cfg).expert_options["glu_act"] == "gelu"

"""No host synchronisation in a training step of any local layer, nor of the LM (the GPU-readiness budget).

``HostSyncCounter`` counts, on the CPU, the operations that would make the host wait for a GPU: scalar
reads, ``tolist``, data-dependent shapes (``nonzero``, boolean-mask indexing) and tensors built from host
data. Budgets: 0 per training step (forward + backward) for every layer with the default expert backend,
with and without padding and capacity limits; the "reference" backend keeps its documented one.
"""

from __future__ import annotations

import pytest
import torch

from mode import MLP, IntegratedMoDE, MoD, MoDRouter, MoDRouterConfig, MoEConfig, MoELayer, StagedMoDE, TransformerBlock
from mode.measure.host_sync import HostSyncCounter
from mode.model import LM, LMConfig

D, H, B, S = 32, 64, 2, 24


def moe(**kw) -> MoELayer:
    return MoELayer.from_config(MoEConfig(d_model=D, d_hidden=H, num_experts=4, **kw))


LAYERS = {
    "mod": lambda: MoD(TransformerBlock(D, 2, MLP(D, H)), MoDRouter(MoDRouterConfig(d_model=D, capacity=0.25))),
    "mod_random": lambda: MoD(TransformerBlock(D, 2, MLP(D, H)),
                              MoDRouter(MoDRouterConfig(d_model=D, selection="random"))),
    "mod_aux_bce": lambda: MoD(TransformerBlock(D, 2, MLP(D, H)), MoDRouter(MoDRouterConfig(d_model=D, causal="aux_bce"))),
    "moe_tc_dropless": lambda: moe(top_k=2),
    "moe_tc_capacity": lambda: moe(top_k=2, capacity_factor=1.0),
    "moe_tc_sigmoid_renorm": lambda: moe(top_k=2, gate="sigmoid", renormalize=True),
    "moe_ec": lambda: moe(router="expert_choice", capacity_factor=1.5),
    "integrated": lambda: IntegratedMoDE.from_config(MoEConfig(d_model=D, d_hidden=H, num_experts=4, num_noop=4)),
    "integrated_ec": lambda: IntegratedMoDE.from_config(MoEConfig(d_model=D, d_hidden=H, num_experts=4, num_noop=2,
                                                                  router="expert_choice")),
    "staged": lambda: StagedMoDE(TransformerBlock(D, 2, moe(top_k=2, capacity_factor=1.25)),
                                 MoDRouter(MoDRouterConfig(d_model=D, capacity=0.5))),
    # the recipes of DeepSeek-V3 and Qwen-MoE (docs/routing.md)
    "moe_deepseek_v3": lambda: moe(top_k=2, gate="sigmoid", renormalize=True, num_shared=2, activation="swiglu",
                                   router_options=dict(n_group=2, topk_group=1, bias_balance=True, scale=2.5,
                                                       balance_scope="sequence")),
    "moe_qwen2": lambda: moe(top_k=2, renormalize=True, num_shared=1, shared_hidden=48, shared_gate=True,
                             router_options=dict(balance_scope="global")),
    "integrated_budget": lambda: IntegratedMoDE.from_config(MoEConfig(
        d_model=D, d_hidden=H, num_experts=4, num_noop=4, top_k=2,
        router_options=dict(bias_balance=True, noop_target=0.5))),
}


def step_syncs(layer, x, mask=None) -> HostSyncCounter:
    with HostSyncCounter() as syncs:
        y, aux = layer(x) if mask is None else layer(x, mask)
        (y.square().mean() + aux.total()).backward()
    return syncs


@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_training_step_has_no_host_sync(name, padded):
    layer = LAYERS[name]()
    mask = None
    if padded:
        mask = torch.ones(B, S, dtype=torch.bool)
        mask[0, S // 3:] = False
    syncs = step_syncs(layer, torch.randn(B, S, D, requires_grad=True), mask)
    assert syncs.count == 0, syncs.events


def test_lm_training_step_has_no_host_sync():
    cfg = LMConfig(vocab_size=64, seq_len=S, d_model=D, n_heads=2, d_hidden=H, num_experts=4, num_noop=2,
                   layers=("dense", "mod", "mod_random", "moe", "staged", "integrated"), capacity_factor=1.5)
    lm = LM(cfg)
    idx = torch.randint(0, 64, (B, S))
    with HostSyncCounter() as syncs:
        out = lm(idx, idx)
        (out.loss + out.aux.total()).backward()
    assert syncs.count == 0, syncs.events


def test_lm_training_step_with_the_moe_recipes_and_its_bias_update_have_no_host_sync():
    from mode.routing import update_expert_bias

    cfg = LMConfig(vocab_size=64, seq_len=S, d_model=D, n_heads=2, d_hidden=H, num_experts=4, num_noop=2, top_k=2,
                   layers=("moe", "staged", "integrated"), num_shared=1, shared_gate=True,
                   router_options=dict(gate="sigmoid", n_group=2, topk_group=1, bias_balance=True, scale=2.0))
    lm = LM(cfg)
    idx = torch.randint(0, 64, (B, S))
    with HostSyncCounter() as syncs:
        out = lm(idx, idx)
        (out.loss + out.aux.total()).backward()
        assert update_expert_bias(lm) == 3
    assert syncs.count == 0, syncs.events


def test_reference_backend_keeps_its_one_documented_sync():
    layer = moe(top_k=2, backend="reference")
    syncs = step_syncs(layer, torch.randn(B, S, D, requires_grad=True))
    assert syncs.by_reason == {"list read": 1}, syncs.events  # counts_E.tolist() to split the rows


def test_counter_sees_the_syncs_it_is_meant_to():
    x = torch.randn(8)
    with HostSyncCounter() as syncs:
        float(x.sum())
        x[x > 0]
        (x > 0).nonzero()
        x.tolist()
        torch.tensor([1.0, 2.0])
        torch.full((3,), 2.0)  # a fill: no sync
        x.topk(3)
    assert syncs.by_reason == {"scalar read": 1, "data-dependent shape (boolean-mask indexing)": 1,
                               "data-dependent shape (nonzero)": 1, "list read": 1,
                               "host data copied to the device": 1}
    assert torch.Tensor.tolist is not None and [1.0] == torch.ones(1).tolist()  # patch removed on exit

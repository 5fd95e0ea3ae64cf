"""torch.compile traces every layer and agrees with eager (outputs and gradients).

Uses the ``aot_eager`` backend: it runs dynamo and AOTAutograd (graph capture, fake tensors, the custom
grouped-mm op's shape function and backward) without inductor's ~30 s C++ compile. The speed of the
inductor path is measured in benchmarks/bench_performance.py.
"""

import pytest
import torch

from mode import MLP, MoD, MoDRouter, MoDRouterConfig, MoEConfig, MoELayer, StagedMoDE, TransformerBlock
from mode.layers.moe import IntegratedMoDE

D = 32


def _no_sync(module: torch.nn.Module) -> torch.nn.Module:
    """Drop the NaN check (a host sync, hence a graph break) from every router."""
    for m in module.modules():
        if hasattr(m, "cfg") and hasattr(m.cfg, "check_finite"):
            m.cfg.check_finite = False
    return module


def _layers():
    moe = lambda **kw: MoEConfig(d_model=D, d_hidden=64, num_experts=4, **kw)  # noqa: E731
    return {
        "mod": MoD(TransformerBlock(D, 2, MLP(D, 64)), MoDRouter(MoDRouterConfig(D, capacity=0.25))),
        "moe_top2_dropping": MoELayer.from_config(moe(top_k=2, capacity_factor=1.0, backend="grouped")),
        "moe_dropless": MoELayer.from_config(moe(top_k=1, backend="grouped")),
        "moe_expert_choice": MoELayer.from_config(moe(router="expert_choice", backend="grouped")),
        "staged": StagedMoDE(TransformerBlock(D, 2, MoELayer.from_config(moe(top_k=2))),
                             MoDRouter(MoDRouterConfig(D, capacity=0.5))),
        "integrated": IntegratedMoDE.from_config(moe(top_k=1, num_noop=2, backend="grouped")),
    }


@pytest.fixture
def dynamic_output_shapes():
    cfg = torch._dynamo.config
    saved = (cfg.capture_dynamic_output_shape_ops, cfg.capture_scalar_outputs)
    cfg.capture_dynamic_output_shape_ops = cfg.capture_scalar_outputs = True
    torch._dynamo.reset()
    yield
    cfg.capture_dynamic_output_shape_ops, cfg.capture_scalar_outputs = saved
    torch._dynamo.reset()


@pytest.mark.parametrize("name", list(_layers()))
def test_compiled_layer_matches_eager(name, dynamic_output_shapes):
    layer = _no_sync(_layers()[name])
    x = torch.randn(2, 16, D)
    x_eager, x_comp = x.clone().requires_grad_(), x.clone().requires_grad_()

    y_ref, aux_ref = layer(x_eager)
    (y_ref.square().sum() + aux_ref.total()).backward()
    grads_ref = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    layer.zero_grad(set_to_none=True)

    y, aux = torch.compile(layer, backend="aot_eager", fullgraph=True)(x_comp)
    (y.square().sum() + aux.total()).backward()
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x_comp.grad, x_eager.grad, rtol=1e-5, atol=1e-5)
    for n, p in layer.named_parameters():
        if n in grads_ref:
            torch.testing.assert_close(p.grad, grads_ref[n], rtol=1e-5, atol=1e-5, msg=n)
    assert aux.losses.keys() == aux_ref.losses.keys()


def test_mod_is_one_static_graph():
    """MoD's shapes never depend on the data: one graph, no breaks, without dynamic-shape flags."""
    torch._dynamo.reset()
    layer = _no_sync(_layers()["mod"])
    explanation = torch._dynamo.explain(layer)(torch.randn(2, 16, D))
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0

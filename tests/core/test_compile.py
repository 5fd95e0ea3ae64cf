"""torch.compile traces every layer and agrees with eager (outputs and gradients).

Uses the ``aot_eager`` backend: it runs dynamo and AOTAutograd (graph capture, fake tensors, the custom
grouped-mm op's shape function and backward) without inductor's ~30 s C++ compile. The speed of the
inductor path is measured in benchmarks/layers/bench_performance.py.
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
        "staged": StagedMoDE(
            TransformerBlock(D, 2, MoELayer.from_config(moe(top_k=2))), MoDRouter(MoDRouterConfig(D, capacity=0.5))
        ),
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


def _grouped_ops(layer: torch.nn.Module, x: torch.Tensor) -> set[str]:
    """The grouped-GEMM calls in the graph dynamo traces of ``layer(x)`` (fullgraph)."""
    seen: set[str] = set()

    def backend(gm, example_inputs):
        seen.update(
            "torch._grouped_mm" if n.target is torch._grouped_mm else str(n.target)
            for n in gm.graph.nodes
            if n.op == "call_function" and "grouped_mm" in str(n.target)
        )
        return gm.forward

    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.compile(layer, backend=backend, fullgraph=True)(x)
    torch._dynamo.reset()
    return seen


@pytest.mark.parametrize("top_k", [1, 2])
def test_compiled_bf16_moe_calls_torch_grouped_mm_natively_and_matches_eager(top_k, monkeypatch):
    """Compiled on the bfloat16 path of a device in ``NATIVE_WHEN_COMPILING`` (CUDA; the CPU added here), the
    MoE layer calls ``torch._grouped_mm`` itself -- an aten op inductor lowers -- not the opaque custom op, with
    torch's own backward; fullgraph, and the same outputs and gradients as eager (which keeps the custom op) up
    to bfloat16 rounding. Eager and a float32 compile keep the custom op."""
    from mode.experts import grouped_mm as gm

    layer = _no_sync(
        MoELayer.from_config(
            MoEConfig(d_model=D, d_hidden=64, num_experts=4, top_k=top_k, activation="swiglu", backend="grouped")
        )
    )
    torch.manual_seed(0)
    x = torch.randn(2, 16, D)
    assert _grouped_ops(layer, x) == {"mode.grouped_mm.default"}  # CUDA only by default
    monkeypatch.setattr(gm, "NATIVE_WHEN_COMPILING", {"cpu", "cuda"})
    ops = _grouped_ops(layer, x)
    assert ops == {"torch._grouped_mm"}, ops

    x_eager, x_comp = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_ref, aux_ref = layer(x_eager)
    (y_ref.float().square().sum() + aux_ref.total()).backward()
    grads_ref = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    layer.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, aux = torch.compile(layer, backend="aot_eager", fullgraph=True)(x_comp)
    (y.float().square().sum() + aux.total()).backward()  # .sum(): an expanded incoming gradient
    torch._dynamo.reset()
    # the same bfloat16 products; only the order of the float32 accumulations may differ: bounds scaled to values
    scale = lambda t: 2e-2 * float(t.abs().max()) + 1e-6  # noqa: E731
    assert float((y.float() - y_ref.float()).abs().max()) <= scale(y_ref)
    assert float((x_comp.grad - x_eager.grad).abs().max()) <= scale(x_eager.grad)
    for n, p in layer.named_parameters():
        if n in grads_ref:
            assert float((p.grad - grads_ref[n]).abs().max()) <= scale(grads_ref[n]), n


def test_grouped_mm_checks_are_cached_and_still_raise():
    """The metadata checks run once per combination (an lru_cache), and a bad call raises every time."""
    from mode.experts.grouped_mm import _check_metadata_cached, grouped_mm

    x, w = torch.randn(8, 16), torch.randn(2, 16, 8)
    offs = torch.tensor([4, 8], dtype=torch.int32)
    _check_metadata_cached.cache_clear()
    for _ in range(3):
        grouped_mm(x, w, offs)
    info = _check_metadata_cached.cache_info()
    assert (info.misses, info.hits) == (1, 2), info
    for _ in range(2):
        with pytest.raises(TypeError, match="offsets_E.dtype=torch.int64: torch._grouped_mm needs int32 offsets"):
            grouped_mm(x, w, offs.long())
    with pytest.raises(ValueError, match=r"x_AK.shape\[1\]=12: must equal w_EKN.shape\[1\]=16"):
        grouped_mm(torch.randn(8, 12), w, offs)


def test_capacity_helpers_are_marked_constant_as_torch_marks_them():
    """mode.routing.capacity marks floor_of/ceil_of for dynamo itself (torch.compiler.assume_constant_result
    imports torch._dynamo, 1.4 s of every ``import mode``): the same attributes torch's decorator sets."""
    from mode.routing.capacity import ceil_of, floor_of

    def plain(x):
        return x

    marked = dict(vars(torch.compiler.assume_constant_result(plain)))
    assert marked and all(vars(fn).get(key) == value for fn in (floor_of, ceil_of) for key, value in marked.items())


def test_importing_the_model_does_not_start_dynamo():
    import subprocess
    import sys

    code = "import sys, mode, mode.model, mode.layers, mode.routing; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"

"""The operator counter (mode.measure.op_count) and the launch budget of every layer kind
(benchmarks/layers/count_ops.py).

Counts are deterministic (no timing): the bounds below are what the lean hot path reaches (docs/performance.md),
so a change that adds operators to a layer's training step fails here and must say why.
"""

import sys
from pathlib import Path

import pytest
import torch

from mode.measure.op_count import OpCounter

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.layers.count_ops import count_all  # noqa: E402

# layer -> (fp32, bf16) at most: one forward + aux.total() + backward, E=8 top-2, d 256 (before: docs/performance.md)
BOUNDS = {
    "MoE token choice": (33, 39),  # was 119, 127; 62, 70 after the lean hot path
    "MoE expert choice": (77, 85),  # was 105, 113; 83, 91
    "integrated MoDE": (62, 68),  # was 139, 147; 97, 105
    "dense SwiGLU MLP": (13, 19),
    "MoD block": (110, 129),  # was 142, 161; 128, 147
    "staged MoDE": (130, 149),  # was 248, 269; 177, 198
    "dense block": (95, 114),
}


def test_counter_skips_views_and_allocations_and_counts_a_custom_op_once():
    x = torch.randn(4, 6)
    with OpCounter() as ops:
        x.view(6, 4).t()[:3].unsqueeze(0).expand(2, 3, 6)  # views only (a reshape of the transpose would copy)
        torch.empty(3)
        torch.empty_like(x)
    assert ops.count == 0
    with OpCounter() as ops:
        y = x.exp() + 1
        torch.zeros(3)
    assert ops.count == 3 and ops.by_name["aten.exp.default"] == 1
    from mode.experts.swiglu import swiglu

    h = torch.randn(5, 8)
    with OpCounter() as ops:
        swiglu(h)  # a custom op: the operators inside it run with the mode off
    assert ops.events == ["mode.swiglu.default"]
    del y


def test_launch_budget_of_every_layer_kind():
    """The goals: an MoE layer in bf16 at most 40 operators (reached: 39, with the fused kernels of mode.kernels),
    the MoD block at capacity 0.125 at most the dense block's + 15 (reached: + 15). Held here: the bounds above.
    No host sync in any."""
    result = count_all(torch.device("cpu"), d=256, experts=8, hidden=512, batch=2, seq=16, peers=False)
    rows = {r["layer"]: r for r in result["rows"]}
    assert set(rows) == set(BOUNDS)
    for name, (fp32, bf16) in BOUNDS.items():
        row = rows[name]
        assert row["ops_float32"] <= fp32 and row["ops_bfloat16"] <= bf16, (
            name,
            row["ops_float32"],
            row["ops_bfloat16"],
        )
        assert row["syncs_float32"] == 0 and row["syncs_bfloat16"] == 0, name
    assert rows["MoE token choice"]["ops_bfloat16"] <= 40  # the goal
    # the MoD block's overhead over the dense block it wraps: the goal
    assert rows["MoD block"]["ops_bfloat16"] - rows["dense block"]["ops_bfloat16"] <= 15


@pytest.mark.parametrize("seq", [16, 64])
def test_counts_do_not_depend_on_the_token_count(seq):
    result = count_all(
        torch.device("cpu"), d=64, experts=4, hidden=64, batch=2, seq=seq, dtypes=("float32",), peers=False
    )
    rows = {r["layer"]: r["ops_float32"] for r in result["rows"]}
    assert rows["MoE token choice"] == BOUNDS["MoE token choice"][0]
    assert rows["MoD block"] == BOUNDS["MoD block"][0]

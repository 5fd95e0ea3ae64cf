"""Every layer's forward and backward run on the meta device: no tensor is created on a hard-coded device
and no step reads a value on the host (a meta tensor has no values, so either would raise)."""

from __future__ import annotations

import pytest
import torch
from test_host_sync import LAYERS, B, D, S

from mode.model import LM, LMConfig


@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_forward_backward_on_meta(name):
    with torch.device("meta"):
        layer = LAYERS[name]()
    x = torch.randn(B, S, D, device="meta", requires_grad=True)
    mask = torch.ones(B, S, dtype=torch.bool, device="meta")
    y, aux = layer(x, mask)
    assert y.device.type == "meta" and y.shape == x.shape
    assert all(v.device.type == "meta" for v in aux.losses.values())
    assert all(st.kept_E.device.type == "meta" and st.compute_T.device.type == "meta" for st in aux.stats.values())
    (y.sum() + aux.total().to("meta")).backward()
    assert x.grad is not None and x.grad.device.type == "meta"
    missing = [n for n, p in layer.named_parameters() if p.grad is None and "predictor" not in n]
    assert not missing


def test_lm_forward_backward_on_meta():
    cfg = LMConfig(
        vocab_size=64,
        seq_len=S,
        d_model=D,
        n_heads=2,
        d_hidden=64,
        num_experts=4,
        num_noop=2,
        layers=("dense", "mod", "mod_random", "moe", "staged", "integrated"),
    )
    with torch.device("meta"):
        lm = LM(cfg)
    idx = torch.zeros(B, S, dtype=torch.long, device="meta")
    out = lm(idx, idx)
    assert out.logits_BSV.device.type == "meta"
    (out.loss + out.aux.total().to("meta")).backward()
    assert all(p.grad is not None for p in lm.parameters())

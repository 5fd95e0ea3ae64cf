"""MoD around blocks a user wrote: ``forward(x)``, ``forward(x, positions)``, ``forward(x, positions, mask)``,
``**kwargs``, keyword names, tuple outputs; what MoD passes is read once from the signature
(``mode.layers.block_call``), and what it cannot pass is a TypeError when the MoD is built or, for KV-cached
decoding, when a cache is given.

Shape legend: B batch, S tokens, D hidden, C routed slots per sequence.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

from mode import MLP, Aux, MoD, MoDRouter, MoDRouterConfig, TransformerBlock
from mode.layers.block_call import block_call
from mode.layers.kv_cache import KVCache
from mode.model import LM, LMConfig
from mode.model.generate import decode_step, generate, prefill

B, S, D = 2, 16, 32


def router(capacity: float = 0.25, gate: str = "raw", **kw) -> MoDRouter:
    torch.manual_seed(1)
    return MoDRouter(MoDRouterConfig(D, capacity=capacity, gate=gate, **kw))


def top_c(x_BSD: torch.Tensor, r: MoDRouter, C: int) -> torch.Tensor:
    """(B, C) routed positions by hand: the top-C scores of each sequence (float64), in position order."""
    score_BS = x_BSD.double() @ r.weight.double()
    return score_BS.topk(C, dim=1).indices.sort(dim=1).values


class XOnly(nn.Module):
    """The block a user writes first: a residual MLP over each token."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.mlp = nn.Sequential(nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x):
        return x + self.mlp(x)


class Recorder(XOnly):
    """Records what it was given; its output is XOnly's, so the layer's output can be checked by hand."""

    def __init__(self):
        super().__init__()
        self.seen = []


class WithPositions(Recorder):
    def forward(self, x, pos):
        self.seen.append({"positions": pos})
        return x + self.mlp(x)


class WithPositionsAndMask(Recorder):
    def forward(self, x, pos, attn_mask):
        self.seen.append({"positions": pos, "mask": attn_mask})
        return x + self.mlp(x)


class ByName(Recorder):
    """Keyword names in another order than MoD's (mask first): matched by name, not by place."""

    def forward(self, x, mask_BS=None, positions_BS=None):
        self.seen.append({"positions": positions_BS, "mask": mask_BS})
        return x + self.mlp(x)


class Kwargs(Recorder):
    def forward(self, x, **kwargs):
        self.seen.append(dict(kwargs))
        return x + self.mlp(x)


class TupleOut(Recorder):
    """transformers style: a tuple whose first element is the output; an ``Aux`` in it is merged."""

    def forward(self, x):
        aux = Aux()
        aux.add_loss("mine", x.square().mean(), 0.5)
        return x + self.mlp(x), torch.zeros(3), aux


def hand_output(layer: MoD, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What MoD must give for a per-token block: ``x + r * (f(x) - x)`` at the top-C tokens, ``x`` elsewhere."""
    C = layer.router.seq_capacity(x_BSD.shape[1])
    pos_BC = top_c(x_BSD, layer.router, C)
    with torch.no_grad():
        f_BSD = XOnly.forward(layer.block, x_BSD)
        r_BS = x_BSD @ layer.router.weight
    want = x_BSD.clone()
    rows = torch.arange(x_BSD.shape[0])[:, None]
    want[rows, pos_BC] = x_BSD[rows, pos_BC] + r_BS[rows, pos_BC, None] * (f_BSD - x_BSD)[rows, pos_BC]
    return want, pos_BC


@pytest.mark.parametrize("block_cls", [XOnly, WithPositions, WithPositionsAndMask, ByName, Kwargs, TupleOut])
def test_a_user_block_of_each_kind_is_routed(block_cls):
    """Every kind of block gives the hand-computed MoD output (routed tokens ``x + r * (f(x) - x)``, skipped
    ones bit for bit ``x``), and gets exactly what its signature asks for."""
    layer = MoD(block_cls(), router(0.25))
    x = torch.randn(B, S, D)
    y, aux = layer(x)
    want, pos_BC = hand_output(layer, x)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    skipped = torch.ones(B, S, dtype=torch.bool)
    skipped[torch.arange(B)[:, None], pos_BC] = False
    assert torch.equal(y[skipped], x[skipped])
    assert "mod.router" in aux.stats
    seen = getattr(layer.block, "seen", [])
    if block_cls in (WithPositions, WithPositionsAndMask, ByName):
        assert len(seen) == 1 and torch.equal(seen[0]["positions"], pos_BC)
        if "mask" in seen[0]:
            assert seen[0]["mask"] is None  # no padding: every slot is a routed token
    if block_cls is Kwargs:
        assert set(seen[0]) == {"positions_BS", "mask_BS"} and torch.equal(seen[0]["positions_BS"], pos_BC)
    if block_cls is TupleOut:
        assert aux.coefs["mine"] == 0.5 and set(aux.losses) == {"mine"}


def test_what_each_block_takes_is_read_once_from_its_signature():
    assert block_call(XOnly()).takes == frozenset()
    assert block_call(WithPositions()).takes == {"positions"}
    assert block_call(WithPositionsAndMask()).takes == {"positions", "mask"}
    assert block_call(ByName()).keyword == (("mask_BS", "mask"), ("positions_BS", "positions"))
    assert block_call(Kwargs()).takes == {"positions", "mask", "cache"}
    tb = block_call(TransformerBlock(D, 2, MLP(D, D)))
    assert tb.takes == {"positions", "mask", "cache"} and tb.positional == ()
    assert block_call(nn.Sequential(nn.Linear(D, D))).takes == frozenset()  # forward(input)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.compile's own use of torch.jit
        compiled = torch.compile(XOnly())
    assert block_call(compiled).takes == frozenset()  # the compiled module's original forward

    class PosOnly(nn.Module):
        def forward(self, x, p, m, /):
            return x

    assert block_call(PosOnly()).positional == ("positions", "mask")


def test_positions_and_mask_reach_the_block_with_padding():
    """A padding mask: the block gets the routed tokens' original positions and the slot mask."""
    layer = MoD(WithPositionsAndMask(), router(0.5))
    x = torch.randn(B, S, D)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1, 5:] = False  # row 1 has 5 real tokens for C = 8 slots
    positions = torch.arange(S).expand(B, S) + 100
    y, _ = layer(x, mask, positions_BS=positions)
    seen = layer.block.seen[0]
    assert seen["mask"].shape == (B, 8) and seen["mask"][0].all() and int(seen["mask"][1].sum()) == 5
    assert (seen["positions"] >= 100).all()  # the original positions, not the slot indices
    assert torch.equal(y[1, 5:], x[1, 5:])  # padding is never updated


def test_a_gate_one_router_at_capacity_one_gives_the_users_block_exactly():
    block = XOnly()
    layer = MoD(block, router(1.0, gate="one"))
    x = torch.randn(B, S, D)
    y, _ = layer(x)
    with torch.no_grad():
        assert torch.equal(y.detach(), block(x))


def test_gradients_reach_the_users_block_and_the_router():
    layer = MoD(WithPositions(), router(0.25))
    x = torch.randn(B, S, D, requires_grad=True)
    y, aux = layer(x)
    (y.square().mean() + aux.total()).backward()
    assert layer.router.weight.grad.abs().sum() > 0
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layer.block.parameters())


def lit(text: str) -> str:
    return re.escape(text)


def test_a_block_mod_cannot_call_is_refused_when_the_mod_is_built():
    class NeedsMore(nn.Module):
        def forward(self, x, pos, mask, scale):
            return x * scale

    class MaskFirst(nn.Module):
        def forward(self, x, attn_mask, pos):
            return x

    class NoX(nn.Module):
        def forward(self, *, x):
            return x

    with pytest.raises(
        TypeError,
        match=lit("NeedsMore.forward(x, pos, mask, scale)") + ".*" + lit("MoD cannot fill the parameter 'scale'"),
    ):
        MoD(NeedsMore(), router())
    with pytest.raises(TypeError, match=lit("MoD would pass the positions as 'attn_mask'")):
        MoD(MaskFirst(), router())
    with pytest.raises(TypeError, match=lit("must take the routed tokens x as its first positional argument")):
        MoD(NoX(), router())


def test_a_block_output_of_the_wrong_kind_or_shape_is_refused():
    class Wide(nn.Module):
        def forward(self, x):
            return torch.cat([x, x], -1)

    class Named(nn.Module):
        def forward(self, x):
            return {"y": x}

    with pytest.raises(
        ValueError, match=lit("block=Wide returned shape (2, 4, 64): must equal its input's shape (2, 4, 32)")
    ):
        MoD(Wide(), router())(torch.randn(B, S, D))
    with pytest.raises(TypeError, match=lit("block=Named returned dict: MoD needs the output y_BCD")):
        MoD(Named(), router())(torch.randn(B, S, D))


# ------------------------------------------------------------------------------------ causal routing, decoding


def causal_lm() -> LM:
    torch.manual_seed(0)
    cfg = LMConfig(
        vocab_size=64,
        seq_len=64,
        d_model=D,
        n_heads=2,
        d_hidden=64,
        layers=("dense", "mod"),
        capacity=0.25,
        causal="predictor",
        predictor_hidden=16,
    )
    model = LM(cfg).eval()
    with torch.no_grad():
        model.embed.weight.normal_(std=1.0)
    return model


@torch.no_grad()
def calibrate(model: LM, x_BS: torch.Tensor) -> None:
    """About 40% of the tokens route causally at layer 1 (its input does not depend on routing)."""
    x_BSD, _ = model.layers[0](model.embed(x_BS))
    r = model.layers[1].router
    r.predictor[-1].bias -= torch.quantile(r.decision_logits(x_BSD, r.scores(x_BSD)).flatten(), 0.6)


class PerTokenDecoding(XOnly):
    """A per-token block that accepts the mask and the cache and ignores them: it needs no other token, so
    KV-cached decoding through it is exact."""

    def forward(self, x, positions_BS=None, mask_BS=None, cache=None):
        return x + self.mlp(x)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@torch.no_grad()
def test_a_user_block_that_takes_the_cache_decodes_like_the_full_pass(static):
    model = causal_lm()
    model.layers[1] = MoD(PerTokenDecoding(), model.layers[1].router)
    x = torch.randint(0, 64, (3, 20), generator=torch.Generator().manual_seed(3))
    calibrate(model, x)
    full = model(x, causal_routing=True)
    st = full.aux.stats["layers.1.mod.router"]
    assert 0.05 < float(st.compute_T.mean()) < 0.95, "the test needs mixed routing"
    logits_BV, caches, pos_B = prefill(model, x[:, :6].tolist(), capacity=20, static=static)
    torch.testing.assert_close(logits_BV, full.logits_BSV[:, 5], rtol=1e-5, atol=1e-5)
    for s in range(6, 20):
        logits_BV = decode_step(model, x[:, s], pos_B, caches)
        pos_B = pos_B + 1
        torch.testing.assert_close(logits_BV, full.logits_BSV[:, s], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_a_block_without_a_cache_routes_causally_but_refuses_kv_cached_decoding():
    """``forward(x)``: a full causal forward works (no cache is involved); generate, which hands every layer its
    KV cache, stops at once with what the block needs."""
    model = causal_lm()
    model.layers[1] = MoD(XOnly(), model.layers[1].router)
    x = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(4))
    calibrate(model, x)
    assert model(x, causal_routing=True).logits_BSV.shape == (2, 12, 64)
    need = (
        lit("cache: KV-cached decoding passes the block its rows of the cache (cache=)")
        + ".*"
        + lit("XOnly.forward(x) takes no mask and no cache parameter")
    )
    with pytest.raises(TypeError, match=need):
        generate(model, [[1, 2, 3]], max_new_tokens=2)
    with pytest.raises(TypeError, match=need):
        model.layers[1](torch.randn(2, 1, D), cache=KVCache(2, 2, 8, D // 2, torch.float32), causal=True)

    class CacheNoMask(XOnly):
        def forward(self, x, positions_BS=None, cache=None):
            return x + self.mlp(x)

    layer = MoD(CacheNoMask(), router(causal="predictor"))
    with pytest.raises(TypeError, match=lit("takes no mask parameter")):
        layer(torch.randn(2, 1, D), cache=KVCache(2, 2, 8, D // 2, torch.float32), causal=True)

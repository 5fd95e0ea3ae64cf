"""Causal routing and KV-cached generation: what sampling sees equals one full causal forward pass.

Shape legend: B batch, S sequence, V vocabulary, H heads, K head dim, C routed slots.

Models here are tiny but *sharpened*: embeddings are drawn with std 1 (so router logits are O(1) and
depend strongly on the token), and each predictor's output bias is calibrated so that ~40% of tokens
route. An untrained predictor otherwise routes ~all or ~no tokens, and a test on such a model would pass
for any cache bug. Every test that relies on routing being mixed asserts it.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import mode.layers.attention as attention_module
from mode.layers.kv_cache import KVCache
from mode.layers.rope import apply_rope, rope_angles
from mode.measure.host_sync import HostSyncCounter
from mode.model import LM, LMConfig
from mode.model.causal_eval import causal_eval
from mode.model.generate import decode_step, generate, prefill
from mode.train import TrainConfig, Trainer
from mode.train.data import eval_batches, file_corpus

V, D, S = 64, 32, 24
MIXES = [("dense", "mod", "dense", "mod"), ("moe", "staged"), ("integrated", "mod")]
METHODS = ["predictor", "aux_bce"]
CASES = [(m, mix) for m in METHODS for mix in MIXES]
CASE_IDS = [f"{m}-{'-'.join(mix)}" for m, mix in CASES]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These shapes are tiny: a second intra-op thread only adds spin-waits (badly so on a loaded machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def lit(text: str) -> str:
    return re.escape(text)


def cfg_for(layers, causal: str = "predictor", **kw) -> LMConfig:
    base = dict(
        vocab_size=V,
        seq_len=64,
        d_model=D,
        n_heads=2,
        d_hidden=64,
        layers=tuple(layers),
        num_experts=4,
        capacity=0.25,
        causal=causal,
        predictor_hidden=16,
        num_noop=1 if "integrated" in layers else 0,
    )
    base.update(kw)
    return LMConfig(**base)


def mod_ids(model: LM) -> list[int]:
    return [i for i, routed in enumerate(model.routed) if routed]


def decisions(out, i: int) -> torch.Tensor:
    """(B, S) bool: which tokens layer ``i``'s MoD router sent through its block in this forward."""
    st = out.aux.stats[f"layers.{i}.mod.router"]
    return st.compute_T.view(st.batch_shape).bool()


def layer_inputs(model: LM, fn):
    """Run ``fn()`` and return {layer index: list of hidden-state inputs that layer received}."""
    seen: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(model.layers))}
    hooks = [
        layer.register_forward_pre_hook(
            lambda mod, args, kwargs, i=i: seen[i].append(args[0].detach()), with_kwargs=True
        )
        for i, layer in enumerate(model.layers)
    ]
    try:
        fn()
    finally:
        for h in hooks:
            h.remove()
    return seen


@torch.no_grad()
def calibrate(model: LM, x_BS: torch.Tensor, fraction: float) -> None:
    """Shift each predictor's output bias so that ``fraction`` of the tokens of ``x_BS`` route causally
    (layer by layer: a layer's input depends on the routing of the layers before it)."""
    for i in mod_ids(model):
        router = model.layers[i].router
        if router.predictor is None:
            continue
        x_BSD = layer_inputs(model, lambda: model(x_BS, causal_routing=True))[i][0]
        logits = router.decision_logits(x_BSD, router.scores(x_BSD))
        router.predictor[-1].bias -= torch.quantile(logits.flatten(), 1 - fraction)


def make_lm(layers, causal: str = "predictor", seed: int = 0, fraction: float = 0.4, **kw) -> LM:
    torch.manual_seed(seed)
    model = LM(cfg_for(layers, causal, **kw)).eval()
    with torch.no_grad():
        model.embed.weight.normal_(std=1.0)  # O(1) hidden states: routing depends strongly on the tokens
    calibrate(model, tokens(4, 64, seed + 100), fraction)
    return model


def tokens(B: int, S_: int, seed: int) -> torch.Tensor:
    # drawn on the CPU (the same tokens on every test device), then moved to the default device
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, S_), generator=g, device="cpu").to(torch.get_default_device())


def assert_mixed_routing(model: LM, out) -> None:
    """Every MoD layer routed some tokens and skipped others (else the test proves nothing)."""
    for i in mod_ids(model):
        frac = float(decisions(out, i).float().mean())
        assert 0.05 < frac < 0.95, f"layer {i}: routed fraction {frac:.2f}; the test needs mixed routing"


# ------------------------------------------------------------------------------------------------ causality


@pytest.mark.parametrize("method,layers", CASES, ids=CASE_IDS)
@torch.no_grad()
def test_future_tokens_change_nothing_at_or_before_t(method, layers):
    model = make_lm(layers, method)
    x = tokens(3, 40, seed=1)
    ref = model(x, causal_routing=True)
    assert_mixed_routing(model, ref)
    for t in (0, 6, 17, 31):
        x2 = x.clone()
        x2[:, t + 1 :] = (x2[:, t + 1 :] + torch.randint(1, V, x2[:, t + 1 :].shape)) % V  # every later token changes
        out = model(x2, causal_routing=True)
        torch.testing.assert_close(out.logits_BSV[:, : t + 1], ref.logits_BSV[:, : t + 1], rtol=1e-5, atol=1e-5)
        for i in mod_ids(model):
            assert torch.equal(decisions(out, i)[:, : t + 1], decisions(ref, i)[:, : t + 1])
        assert not torch.allclose(out.logits_BSV[:, t + 1 :], ref.logits_BSV[:, t + 1 :])


@pytest.mark.parametrize("method", METHODS)
@torch.no_grad()
def test_top_k_routing_is_not_causal_but_causal_routing_is(method):
    """Teeth: fill the future with the token the first router likes best. Top-k then moves all C slots into
    the future, so earlier tokens lose their block and their logits change; causal routing does not care."""
    model = make_lm(("mod", "dense", "mod", "dense"), method)
    router = model.layers[0].router
    best = int((model.embed.weight @ router.weight).argmax())  # layer 0's input is the embedding
    x = tokens(2, 16, seed=3)
    x[x == best] = (best + 1) % V
    t = 7
    x2 = x.clone()
    x2[:, t + 1 :] = best
    top, top2 = model(x), model(x2)
    assert decisions(top, 0)[:, : t + 1].any(), "some early token must be in the original top-C"
    assert not decisions(top2, 0)[:, : t + 1].any()  # C = 4 <= 8 future copies of the best token
    assert (top.logits_BSV[:, : t + 1] - top2.logits_BSV[:, : t + 1]).abs().max() > 1e-3
    cau, cau2 = model(x, causal_routing=True), model(x2, causal_routing=True)
    torch.testing.assert_close(cau2.logits_BSV[:, : t + 1], cau.logits_BSV[:, : t + 1], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------- prefill + decoding


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("method,layers", CASES, ids=CASE_IDS)
@torch.no_grad()
def test_prefill_then_decode_equals_full_forward(method, layers, static):
    model = make_lm(layers, method)
    x = tokens(3, S, seed=2)
    full = model(x, causal_routing=True)
    assert_mixed_routing(model, full)
    for split in (1, 7, 16, S - 1):
        logits_BV, caches, pos_B = prefill(model, x[:, :split].tolist(), capacity=S, static=static)
        assert pos_B.tolist() == [split] * 3
        torch.testing.assert_close(logits_BV, full.logits_BSV[:, split - 1], rtol=1e-5, atol=1e-5)
        for s in range(split, S):
            logits_BV = decode_step(model, x[:, s], pos_B, caches)
            pos_B = pos_B + 1
            torch.testing.assert_close(logits_BV, full.logits_BSV[:, s], rtol=1e-5, atol=1e-5)
        # the caches hold what the full pass routed: every token at dense layers, the routed ones at MoD layers
        for i, cache in enumerate(caches):
            want = decisions(full, i).sum(1) if model.routed[i] else torch.full((3,), S)
            assert cache.len_B.tolist() == want.tolist(), f"layer {i}, split {split}"
    lens = [caches[i].len_B.tolist() for i in mod_ids(model)]
    assert any(len(set(row_lens)) > 1 for row_lens in lens), f"rows must route differently, got {lens}"


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("case", ["capacity_one", "steered"])
@torch.no_grad()
def test_decode_routes_what_the_full_pass_routes_when_the_decision_is_not_the_bare_logit(case, static):
    """Decoding computes the predictor's logit in fused kernels. At capacity 1.0 every token routes, and with a
    steered threshold (``steer_decision``) a token routes when the logit passes it: in both the decision is
    not that logit, and a decode step must still route what the full pass routes."""
    from dataclasses import replace

    from mode.layers.mod import MoD
    from mode.routing.mod_topk import MoDRouter

    model = make_lm(("dense", "mod"), "predictor", capacity=1.0 if case == "capacity_one" else 0.25)
    x = tokens(3, S, seed=2)
    if case == "steered":
        old = model.layers[1]
        router = MoDRouter(replace(old.router.cfg, steer_decision=True))
        router.load_state_dict({**old.router.state_dict(), "threshold": router.threshold}, strict=True)
        x_BSD = layer_inputs(model, lambda: model(x, causal_routing=True))[1][0]
        logits = router.raw_decision_logits(x_BSD, router.scores(x_BSD))
        router.threshold.fill_(float(torch.quantile(logits.flatten(), 0.8)))  # ~20% route, not the 40% of > 0
        model.layers[1] = MoD(old.block, router)
    full = model(x, causal_routing=True)
    routed = decisions(full, 1)
    if case == "capacity_one":
        assert routed.all()
    else:
        assert_mixed_routing(model, full)
        assert 0.05 < float(routed.float().mean()) < 0.35  # the threshold, not the bare logit, decided
    logits_BV, caches, pos_B = prefill(model, x[:, :7].tolist(), capacity=S, static=static)
    for s_ in range(7, S):
        logits_BV = decode_step(model, x[:, s_], pos_B, caches)
        pos_B = pos_B + 1
        torch.testing.assert_close(logits_BV, full.logits_BSV[:, s_], rtol=1e-5, atol=1e-5)
    assert caches[1].len_B.tolist() == routed.sum(1).tolist()


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("method,layers", CASES, ids=CASE_IDS)
@torch.no_grad()
def test_prompts_of_different_lengths_decode_like_the_full_pass(method, layers, static):
    """Right-padded prefill, then each row continues at its own position with its own tokens."""
    model = make_lm(layers, method)
    x = tokens(3, S, seed=4)
    full = model(x, causal_routing=True)
    plens = [3, 9, 14]
    logits_BV, caches, pos_B = prefill(
        model, [x[b, :p].tolist() for b, p in enumerate(plens)], capacity=S, static=static
    )
    assert pos_B.tolist() == plens
    rows = torch.arange(3)
    torch.testing.assert_close(logits_BV, full.logits_BSV[rows, pos_B - 1], rtol=1e-5, atol=1e-5)
    for _ in range(S - max(plens)):
        logits_BV = decode_step(model, x[rows, pos_B], pos_B, caches)
        torch.testing.assert_close(logits_BV, full.logits_BSV[rows, pos_B], rtol=1e-5, atol=1e-5)
        pos_B = pos_B + 1
    for i, cache in enumerate(caches):  # row b has seen its first pos_B[b] tokens
        seen_BS = torch.arange(S)[None, :] < pos_B[:, None]
        want = (decisions(full, i) & seen_BS).sum(1) if model.routed[i] else pos_B
        assert cache.len_B.tolist() == want.tolist(), f"layer {i}"


def reference_keys(model: LM, i: int, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values layer ``i`` computes for *every* token of its input at the token's position
    (B, H, S, K), recomputed from the layer's weights without any routing or packing."""
    block = model.layers[i].block if model.routed[i] else model.layers[i]
    attn = block.attn
    B, S_, _ = x_BSD.shape
    _, k, v = attn.qkv(block.attn_norm(x_BSD)).view(B, S_, 3, attn.n_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
    cos, sin = rope_angles(torch.arange(S_).expand(B, S_), attn.head_dim, attn.rope_base)
    return apply_rope(k, cos, sin), v


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("method,layers", CASES, ids=CASE_IDS)
@torch.no_grad()
def test_each_layer_caches_exactly_its_routed_tokens(method, layers, static):
    model = make_lm(layers, method)
    x = tokens(3, S, seed=5)
    result = {}
    inputs = layer_inputs(model, lambda: result.setdefault("full", model(x, causal_routing=True)))
    full = result["full"]
    assert_mixed_routing(model, full)
    split = 10
    _, caches, pos_B = prefill(model, x[:, :split].tolist(), capacity=S + 4, static=static)
    for s in range(split, S):
        decode_step(model, x[:, s], pos_B, caches)
        pos_B = pos_B + 1
    for i, cache in enumerate(caches):
        k_ref, v_ref = reference_keys(model, i, inputs[i][0])
        keep_BS = decisions(full, i) if model.routed[i] else torch.ones(3, S, dtype=torch.bool)
        for b in range(3):
            pos = keep_BS[b].nonzero().squeeze(1)
            n = int(cache.len_B[b])
            assert n == pos.numel(), f"layer {i} row {b}: cache holds {n} tokens, {pos.numel()} were routed"
            torch.testing.assert_close(cache.k_BHLK[b, :, :n], k_ref[b, :, pos], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(cache.v_BHLK[b, :, :n], v_ref[b, :, pos], rtol=1e-5, atol=1e-5)
            assert not cache.k_BHLK[b, :, n:].any(), "nothing is written past a row's length"


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("method,layers", CASES, ids=CASE_IDS)
@torch.no_grad()
def test_batched_generation_equals_each_prompt_alone(method, layers, static):
    model = make_lm(layers, method)
    x = tokens(3, S, seed=6)
    prompts = [x[0, :4].tolist(), x[1, :11].tolist(), x[2, :7].tolist()]
    batched = generate(model, prompts, max_new_tokens=12, temperature=0, static_cache=static)
    alone = [generate(model, [p], max_new_tokens=12, temperature=0, static_cache=static)[0] for p in prompts]
    assert batched == alone
    assert all(len(o) == 12 for o in batched)
    # and the logits agree step by step, while the rows' caches fill at different rates
    logits_BV, caches, pos_B = prefill(model, prompts, capacity=30, static=static)
    solo = [prefill(model, [p], capacity=30, static=static) for p in prompts]
    for _ in range(12):
        for b, (lg, _, _) in enumerate(solo):
            torch.testing.assert_close(logits_BV[b], lg[0], rtol=1e-5, atol=1e-5)
        next_B = logits_BV.argmax(-1)
        logits_BV = decode_step(model, next_B, pos_B, caches)
        solo = [(decode_step(model, next_B[b : b + 1], p, c), c, p + 1) for b, (_, c, p) in enumerate(solo)]
        pos_B = pos_B + 1
    for i in mod_ids(model):
        assert caches[i].len_B.tolist() == [int(c[i].len_B[0]) for _, c, _ in solo]
    assert any(len(set(caches[i].len_B.tolist())) > 1 for i in mod_ids(model))


# ---------------------------------------------------------------------------------------- RoPE positions


class RopeRecorder:
    """Records the positions every attention call hands to RoPE, tagged with the calling layer."""

    def __init__(self, model: LM, monkeypatch):
        self.calls: list[tuple[int, torch.Tensor]] = []
        self.current = -1
        for i, layer in enumerate(model.layers):
            block = layer.block if model.routed[i] else layer
            block.attn.register_forward_pre_hook(lambda mod, args, i=i: setattr(self, "current", i))
        real = attention_module.rope_angles

        def recording(positions_BS, head_dim, base):
            self.calls.append((self.current, positions_BS.clone()))
            return real(positions_BS, head_dim, base)

        monkeypatch.setattr(attention_module, "rope_angles", recording)

    def take(self) -> dict[int, list[torch.Tensor]]:
        out: dict[int, list[torch.Tensor]] = {}
        for i, pos in self.calls:
            out.setdefault(i, []).append(pos)
        self.calls = []
        return out


@pytest.mark.parametrize("method", METHODS)
@torch.no_grad()
def test_rope_sees_true_positions_in_full_pass_and_decode(method, monkeypatch):
    model = make_lm(("dense", "mod", "dense", "mod"), method)
    rec = RopeRecorder(model, monkeypatch)
    x = tokens(2, S, seed=7)
    full = model(x, causal_routing=True)
    assert_mixed_routing(model, full)
    seen = rec.take()
    for i in range(4):
        (pos_BC,) = seen[i]
        if not model.routed[i]:
            assert pos_BC.tolist() == [list(range(S))] * 2
            continue
        dec = decisions(full, i)
        assert pos_BC.shape[1] == int(dec.sum(1).max())
        for b in range(2):
            routed = dec[b].nonzero().squeeze(1).tolist()
            assert routed and routed != list(range(len(routed)))  # not trivially 0, 1, 2, ...
            assert pos_BC[b, : len(routed)].tolist() == routed

    plens = [5, 12]
    _, caches, pos_B = prefill(model, [x[0, :5].tolist(), x[1, :12].tolist()], capacity=S + 12)
    rec.take()
    skipped_steps = 0
    for _ in range(12):
        out = model(x[torch.arange(2), pos_B][:, None], positions_BS=pos_B[:, None], caches=caches, causal_routing=True)
        seen = rec.take()
        for i in range(4):
            if not model.routed[i]:
                assert [p.tolist() for p in seen[i]] == [pos_B[:, None].tolist()]
                continue
            rows = decisions(out, i)[:, 0].nonzero().squeeze(1)
            if rows.numel() == 0:
                assert i not in seen, "a layer no row routed to must not run attention"
                skipped_steps += 1
            else:
                assert [p.tolist() for p in seen[i]] == [pos_B[rows][:, None].tolist()]
        pos_B = pos_B + 1
    assert pos_B.tolist() == [p + 12 for p in plens]
    assert skipped_steps > 0


# ---------------------------------------------------------------------------------- skipped tokens do no work


@pytest.mark.parametrize(
    "method,layers",
    [("predictor", ("dense", "mod", "dense", "mod")), ("aux_bce", ("moe", "staged"))],
    ids=["predictor-mod", "aux_bce-staged"],
)
@torch.no_grad()
def test_decode_runs_a_block_only_on_rows_that_route(method, layers):
    model = make_lm(layers, method, fraction=0.3)
    calls: dict[int, list[int]] = {i: [] for i in mod_ids(model)}
    for i in mod_ids(model):
        model.layers[i].block.register_forward_hook(lambda mod, args, out, i=i: calls[i].append(args[0].shape[0]))
    x = tokens(3, S, seed=8)
    _, caches, pos_B = prefill(model, x[:, :4].tolist(), capacity=S)
    for i in mod_ids(model):
        calls[i].clear()
    none_routed = some_routed = 0
    for s in range(4, S):
        out = model(x[:, s : s + 1], positions_BS=pos_B[:, None], caches=caches, causal_routing=True)
        pos_B = pos_B + 1
        for i in mod_ids(model):
            n_routed = int(decisions(out, i).sum())
            got = calls[i]
            calls[i] = []
            if n_routed == 0:
                assert got == [], f"layer {i}: no row routed, yet the block ran on {got} rows"
                none_routed += 1
            else:
                assert got == [n_routed], f"layer {i}: {n_routed} rows routed, the block ran on {got} rows"
                some_routed += 1
    assert none_routed > 0 and some_routed > 0


@pytest.mark.parametrize("masked", [False, True])
@torch.no_grad()
def test_a_causal_call_that_routes_nothing_returns_the_general_empty_plan(masked):
    """Decode steps mostly route nothing and take a short path; its plan must be the one the general
    path builds for zero routed slots (same fields, shapes, dtypes and values)."""
    model = make_lm(("dense", "mod"), "predictor")
    router = model.layers[1].router
    with torch.no_grad():
        router.predictor[-1].bias.fill_(-1e4)  # nothing routes
    x_BSD = torch.randn(2, 5, D)
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2]) if masked else None
    fast = router(x_BSD, mask, causal=True)
    r_BS = router.scores(x_BSD)
    pos_BC = torch.zeros(2, 0, dtype=torch.long)
    slow = router.plan_from_positions(r_BS, pos_BC, torch.zeros(2, 0, dtype=torch.bool), mask)
    for field in ("token_idx_A", "expert_idx_A", "weight_A", "counts_E", "valid_A"):
        a, b = getattr(fast, field), getattr(slow, field)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), field
    assert (fast.num_tokens, fast.seq_capacity) == (slow.num_tokens, slow.seq_capacity) == (10, 0)
    sf, ss = fast.aux.stats["router"], slow.aux.stats["router"]
    for field in ("kept_E", "requested_X", "dropped", "noop", "tokens", "compute_T"):
        a, b = getattr(sf, field), getattr(ss, field)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), field
    assert sf.entropy is None and sf.batch_shape == ss.batch_shape == (2, 5)
    assert float(sf.tokens) == (8 if masked else 10)
    y, aux = model.layers[1](x_BSD, mask, causal=True)
    assert torch.equal(y, x_BSD) and set(aux.stats) == {"mod.router"}


def test_generate_refuses_non_causal_models():
    torch.manual_seed(0)
    model = LM(cfg_for(("dense", "mod"), causal="none"))
    with pytest.raises(ValueError, match=lit("causal='none': this model's MoD layers use non-causal top-k")):
        generate(model, [[1, 2, 3]], max_new_tokens=2)
    with pytest.raises(ValueError, match=lit("causal='none'")):
        prefill(model, [[1, 2, 3]], capacity=8)
    with pytest.raises(ValueError, match=lit("causal=True: this MoD router was built with causal='none'")):
        model(torch.zeros(1, 4, dtype=torch.long), causal_routing=True)
    ec = LM(cfg_for(("dense", "moe"), causal="none", router="expert_choice"))
    with pytest.raises(
        ValueError,
        match=lit("router='expert_choice': expert-choice routing picks tokens across the sequence and is not causal"),
    ):
        generate(ec, [[1, 2, 3]], max_new_tokens=2)
    # token-choice capacity drops depend on the rest of the batch: decoding would silently differ
    dropping = LM(cfg_for(("dense", "moe"), causal="none", capacity_factor=1.0))
    with pytest.raises(
        ValueError,
        match=lit("capacity_factor=1.0: token-choice capacity drops depend on the other tokens of the batch"),
    ):
        generate(dropping, [[1, 2, 3]], max_new_tokens=2)
    dropless = LM(cfg_for(("dense", "moe"), causal="none"))
    dropless.load_state_dict(dropping.state_dict())  # the documented way out: same weights, dropless routing
    assert len(generate(dropless, [[1, 2, 3]], max_new_tokens=2)[0]) == 2


@torch.no_grad()
def test_dense_model_generates_without_a_causal_method():
    torch.manual_seed(0)
    model = LM(cfg_for(("dense", "moe"), causal="none")).eval()
    x = tokens(1, 12, seed=9)
    full = model(x)
    logits_BV, caches, pos_B = prefill(model, [x[0, :5].tolist()], capacity=12)
    torch.testing.assert_close(logits_BV, full.logits_BSV[:, 4], rtol=1e-5, atol=1e-5)
    for s in range(5, 12):
        logits_BV = decode_step(model, x[:, s], pos_B, caches)
        pos_B = pos_B + 1
        torch.testing.assert_close(logits_BV, full.logits_BSV[:, s], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@torch.no_grad()
def test_budget_held_integrated_mode_decodes_like_the_full_pass(static):
    """Integrated MoDE holding its no-op budget with a bias (and the DeepSeek/Qwen recipes beside it): token
    choice decides each token alone, so KV-cached decoding equals the full pass with no causal method, and
    generate() gives the same tokens as recomputing the full pass for every new token."""
    torch.manual_seed(0)
    cfg = cfg_for(
        ("integrated", "moe", "integrated"),
        causal="none",
        num_noop=4,
        top_k=2,
        num_shared=1,
        shared_gate=True,
        router_options=dict(
            bias_balance=True, noop_target=0.5, gate="sigmoid", renormalize=True, scale=2.0, n_group=2, topk_group=1
        ),
    )
    model = LM(cfg).eval()
    with torch.no_grad():
        model.embed.weight.normal_(std=1.0)
        for m in model.modules():
            if hasattr(m, "bias_X"):
                m.bias_X.normal_(std=0.3)  # a trained bias: it decides choices
    x = tokens(3, S, seed=4)
    full = model(x)
    noop = [float(st.noop / st.requested_X.sum()) for k, st in full.aux.stats.items() if k.startswith("layers.0")]
    assert 0.1 < noop[0] < 0.9  # some tokens skip the MLP, some do not
    logits_BV, caches, pos_B = prefill(model, x[:, :7].tolist(), capacity=S, static=static)
    torch.testing.assert_close(logits_BV, full.logits_BSV[:, 6], rtol=1e-5, atol=1e-5)
    for s in range(7, S):
        logits_BV = decode_step(model, x[:, s], pos_B, caches)
        pos_B = pos_B + 1
        torch.testing.assert_close(logits_BV, full.logits_BSV[:, s], rtol=1e-5, atol=1e-5)
    prompt = x[:2, :5]
    out = generate(model, prompt.tolist(), max_new_tokens=6, temperature=0.0, static_cache=static)
    seq = prompt
    for _ in range(6):  # greedy by full recomputation
        seq = torch.cat([seq, model(seq).logits_BSV[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert out == seq[:, 5:].tolist()


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_cache_overflow_is_a_clear_error(static):
    model = make_lm(("dense", "mod"))
    _, caches, pos_B = prefill(model, [[1, 2, 3, 4]], capacity=4, static=static)
    with pytest.raises(ValueError, match=lit("KV cache capacity=4: cannot hold 5 tokens")):
        decode_step(model, torch.tensor([5]), pos_B, caches)


# ----------------------------------------------------------------------------- the static and dynamic paths


@pytest.mark.parametrize("method,layers", CASES, ids=CASE_IDS)
@torch.no_grad()
def test_static_and_dynamic_paths_generate_the_same_tokens_and_caches(method, layers):
    model = make_lm(layers, method)
    x = tokens(3, S, seed=14)
    prompts = [x[0, :5].tolist(), x[1, :12].tolist(), x[2, :8].tolist()]
    outs = {
        static: generate(model, prompts, max_new_tokens=14, temperature=0, static_cache=static)
        for static in (False, True)
    }
    assert outs[False] == outs[True]
    # step by step: the same logits, and every layer's cache holds the same tokens
    runs = {static: list(prefill(model, prompts, capacity=30, static=static)) for static in (False, True)}
    for _ in range(14):
        (lg_d, _, _), (lg_s, _, _) = runs[False], runs[True]
        torch.testing.assert_close(lg_s, lg_d, rtol=1e-5, atol=1e-5)
        next_B = lg_d.argmax(-1)
        for run in runs.values():
            run[0] = decode_step(model, next_B, run[2], run[1])
            run[2] = run[2] + 1
    for i, (cd, cs) in enumerate(zip(runs[False][1], runs[True][1])):
        assert cd.len_B.tolist() == cs.len_B.tolist(), f"layer {i}"
        for b, n in enumerate(cd.len_B.tolist()):
            torch.testing.assert_close(cs.k_BHLK[b, :, :n], cd.k_BHLK[b, :, :n], rtol=1e-5, atol=1e-5)
            assert not cs.k_BHLK[b, :, n:].any() and not cd.k_BHLK[b, :, n:].any()
    assert any(len(set(runs[False][1][i].len_B.tolist())) > 1 for i in mod_ids(model))


def sync_mixes():
    return [("dense", "dense"), ("dense", "mod", "dense", "mod"), ("moe", "staged"), ("integrated", "mod")]


@pytest.mark.parametrize("layers", sync_mixes(), ids=["-".join(m) for m in sync_mixes()])
@torch.no_grad()
def test_static_decode_makes_no_host_sync_and_generate_one_per_step(layers):
    """The GPU budget (issue 16): a static-path decode step never makes the host wait for the device, so
    ``generate`` makes exactly one sync per step (reading the sampled tokens)."""
    method = "predictor" if any(k in ("mod", "staged") for k in layers) else "none"
    model = make_lm(layers, method) if method != "none" else LM(cfg_for(layers, "none")).eval()
    x = tokens(3, S, seed=15)
    prompts = [x[0, :5].tolist(), x[1, :9].tolist(), x[2, :7].tolist()]
    logits_BV, caches, pos_B = prefill(model, prompts, capacity=S, static=True)
    routed_steps = 0
    for _ in range(10):
        with HostSyncCounter() as syncs:
            out = model(
                logits_BV.argmax(-1)[:, None],
                positions_BS=pos_B[:, None],
                caches=caches,
                causal_routing=model.cfg.uses_mod,
            )
        assert syncs.count == 0, syncs.events
        logits_BV, pos_B = out.logits_BSV[:, -1], pos_B + 1
        routed_steps += sum(int(decisions(out, i).any()) for i in mod_ids(model))
    assert routed_steps > 0 or not mod_ids(model)
    steps = 12
    with HostSyncCounter() as prefill_syncs:
        prefill(model, prompts, capacity=max(map(len, prompts)) + steps, static=True)
    with HostSyncCounter() as all_syncs:
        generate(model, prompts, max_new_tokens=steps, temperature=0, static_cache=True)
    assert all_syncs.count - prefill_syncs.count == steps, all_syncs.by_reason


class GroupedGemmDtypes(TorchDispatchMode):
    """Records the input dtypes of every grouped expert GEMM (``mode::grouped_mm``, below autocast)."""

    def __init__(self):
        super().__init__()
        self.dtypes: set[tuple[torch.dtype, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith("mode.grouped_mm"):
            self.dtypes.add(tuple(a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@torch.no_grad()
def test_bf16_generation_runs_the_experts_in_bfloat16_with_bfloat16_caches(static):
    """generate(bf16=True): prefill and every step under bfloat16 autocast (on CUDA the experts' grouped GEMM
    has its fast, sync-free kernel in bfloat16 only), bfloat16 KV caches; the float32 weights are untouched."""
    model = make_lm(("moe", "staged"), "predictor")
    x = tokens(3, S, seed=17)
    prompts = [x[0, :5].tolist(), x[1, :9].tolist(), x[2, :7].tolist()]
    with GroupedGemmDtypes() as spy:
        outs = generate(model, prompts, max_new_tokens=6, temperature=0, static_cache=static, bf16=True)
    assert [len(o) for o in outs] == [6, 6, 6] and all(0 <= t < V for o in outs for t in o)
    assert spy.dtypes == {(torch.bfloat16, torch.bfloat16)}, spy.dtypes
    assert {p.dtype for p in model.parameters()} == {torch.float32} and not model.training
    with GroupedGemmDtypes() as fp32_spy:  # the default: the model's own dtype
        generate(model, prompts, max_new_tokens=2, temperature=0, static_cache=static)
    assert fp32_spy.dtypes == {(torch.float32, torch.float32)}, fp32_spy.dtypes
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        _, caches, _ = prefill(model, prompts, capacity=16, static=static, cache_dtype=torch.bfloat16)
    assert {c.k_BHLK.dtype for c in caches} == {c.v_BHLK.dtype for c in caches} == {torch.bfloat16}
    with pytest.raises(TypeError, match=lit("bf16='yes': must be a bool")):
        generate(model, prompts, max_new_tokens=2, bf16="yes")


@torch.no_grad()
def test_dynamic_decode_syncs_once_per_mod_layer():
    model = make_lm(("dense", "mod", "dense", "mod"), fraction=0.4)
    x = tokens(3, S, seed=16)
    logits_BV, caches, pos_B = prefill(model, x[:, :6].tolist(), capacity=S)
    for _ in range(10):
        with HostSyncCounter() as syncs:
            logits_BV = decode_step(model, logits_BV.argmax(-1), pos_B, caches)
        pos_B = pos_B + 1
        # one read of each MoD layer's decisions; the routed rows' index when only some rows route
        assert syncs.by_reason["list read"] == 2, syncs.events
        assert set(syncs.by_reason) <= {"list read", "host data copied to the device"}, syncs.events
        assert syncs.count <= 4


class FreshTensors(TorchDispatchMode):
    """Records the size of every tensor an op allocates (outputs not sharing storage with its inputs)."""

    def __init__(self):
        super().__init__()
        self.sizes: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.sizes.append((str(func), t.numel()))
        return out


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@torch.no_grad()
def test_decode_copies_no_cached_keys_or_values(static):
    """Issue 16.7: a decode step writes each new key/value in place and attends through views; no op makes
    a tensor as large as one row's cached keys (the old path copied the routed rows' whole cache)."""
    model = make_lm(("dense", "mod", "dense", "mod"), fraction=0.4)
    B = 2
    x = tokens(B, S, seed=17)
    logits_BV, caches, pos_B = prefill(model, x[:, :20].tolist(), capacity=S + 12, static=static)
    logits_BV = decode_step(model, logits_BV.argmax(-1), pos_B, caches)  # the first step builds the MoD
    pos_B = pos_B + 1  # layers' fused router weights (once; not a per-step copy)
    for _ in range(11):
        shortest = min(min(c.len_B.tolist()) for c in caches)
        row_numel = shortest * D  # one row's cached keys: tokens x H x K
        assert row_numel > B * 3 * D, "the widest per-token tensor of a step (q, k, v of B rows) must be smaller"
        with FreshTensors() as fresh:
            logits_BV = decode_step(model, logits_BV.argmax(-1), pos_B, caches)
        pos_B = pos_B + 1
        big = [(op, n) for op, n in fresh.sizes if n >= row_numel]
        assert not big, (row_numel, big)


@pytest.mark.parametrize("method", METHODS)
def test_decode_router_logits_equal_the_routers_own(method):
    """Decoding computes the router's logits in fused matmuls (no grad); they equal the router's own methods,
    also after a parameter changes in place, and with autograd on the reference path is taken exactly."""
    model = make_lm(("dense", "mod"), method)
    layer, router = model.layers[1], model.layers[1].router
    x_B1D = torch.randn(5, 1, D)

    def check():
        with torch.no_grad():
            r_BX, logits_BK = layer._decide(x_B1D)
            r_B1 = r_BX[:, :1]
            want_r = router.scores(x_B1D)
            want_d = router.decision_logits(x_B1D, want_r)
        torch.testing.assert_close(r_B1, want_r, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(logits_BK[:, -1:], want_d, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(logits_BK[:, :1], F.silu(want_r) if router.predictor else want_r)
        assert r_B1.dtype == logits_BK.dtype == torch.float32 and logits_BK.shape == (5, 2 if router.predictor else 1)

    check()
    with torch.no_grad():
        router.weight.mul_(-2.0)  # an in-place update (an optimizer step) must reach the fused weights
        if router.predictor is not None:
            router.predictor[0].weight.add_(0.5)
            router.predictor[2].bias.add_(1.0)
    check()
    r_BX, logits_BK = layer._decide(x_B1D)  # autograd on: the router's own methods, exactly
    assert torch.equal(r_BX, router.scores(x_B1D)) and r_BX.requires_grad


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@torch.no_grad()
def test_decode_stats_equal_the_general_paths(static):
    """A decode step's router stats (built lazily) equal the ones the general causal path reports."""
    model = make_lm(("dense", "mod"), fraction=0.5)
    x_B1D = torch.randn(6, 1, D)
    layer = model.layers[1]
    general = layer.router(x_B1D, causal=True).aux.stats["router"]
    cache = KVCache(6, 2, 8, D // 2, torch.float32, static=static)
    _, aux = layer(x_B1D, positions_BS=torch.zeros(6, 1, dtype=torch.long), cache=cache, causal=True)
    fast = aux.stats["mod.router"]
    assert 0 < float(fast.kept_E[0]) < 6, "the test needs mixed routing"
    for field in ("kept_E", "requested_X", "dropped", "noop", "tokens", "compute_T"):
        a, b = getattr(fast, field), getattr(general, field)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), field
    assert fast.batch_shape == general.batch_shape == (6, 1) and fast.entropy is None
    assert cache.len_B.tolist() == fast.compute_T.long().tolist()  # routed rows stored their token


# The dynamic path reads the logits on the host and raises at once on every device; the static path never
# makes the host wait, so on CUDA its check is a device-side assert.
@pytest.mark.parametrize(
    "static",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.device_assert("the static decode path's finite check is a torch._assert_async on CUDA"),
        ),
    ],
    ids=["dynamic", "static"],
)
@torch.no_grad()
def test_decode_refuses_nan_router_logits(static):
    model = make_lm(("dense", "mod"))
    cache = KVCache(2, 2, 8, D // 2, torch.float32, static=static)
    x_B1D = torch.randn(2, 1, D)
    x_B1D[1, 0, 3] = float("nan")
    with pytest.raises(ValueError, match=lit("MoDRouter: ") + ".*" + lit("router logits are NaN or inf")):
        model.layers[1](x_B1D, positions_BS=torch.zeros(2, 1, dtype=torch.long), cache=cache, causal=True)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@torch.no_grad()
def test_decode_enters_a_collective_block_even_when_nothing_routes(static):
    """``skip_empty=False`` (expert-parallel blocks): every rank must enter the block every step."""
    model = make_lm(("dense", "mod"), fraction=0.4)
    layer = model.layers[1]
    layer.skip_empty = False
    layer.router.predictor[-1].bias.fill_(-1e4)  # nothing routes
    calls = []
    layer.block.register_forward_hook(lambda mod, args, out: calls.append(args[0].shape[0]))
    cache = KVCache(3, 2, 8, D // 2, torch.float32, static=static)
    x_B1D = torch.randn(3, 1, D)
    y, _ = layer(x_B1D, positions_BS=torch.zeros(3, 1, dtype=torch.long), cache=cache, causal=True)
    assert calls == [3] and torch.equal(y, x_B1D)
    assert cache.len_B.tolist() == [0, 0, 0] and not cache.k_BHLK.any()


# ------------------------------------------------------------------------------------------ causal losses


def bce_reference(model: LM, i: int, x_BSD: torch.Tensor, out) -> torch.Tensor:
    """Hand BCE of layer ``i``'s causal logit against its top-C targets (from this forward's stats)."""
    router = model.layers[i].router
    target = decisions(out, i).float()
    if router.predictor is None:
        logit = x_BSD.float() @ router.weight.float()
    else:
        logit = router.predictor(x_BSD).squeeze(-1)
    return F.binary_cross_entropy_with_logits(logit, target)


@pytest.mark.parametrize("method", METHODS)
def test_causal_bce_is_in_aux_with_its_coefficient(method):
    model = make_lm(("dense", "mod", "dense", "staged"), method, causal_coef=0.37).train()
    x = tokens(2, S, seed=10)
    result = {}
    inputs = layer_inputs(model, lambda: result.setdefault("out", model(x)))
    out = result["out"]
    for i in (1, 3):
        name = f"layers.{i}.mod.causal_bce"
        assert out.aux.coefs[name] == 0.37
        torch.testing.assert_close(out.aux.losses[name], bce_reference(model, i, inputs[i][0], out))
        assert float(decisions(out, i).sum()) == 2 * math.floor(0.25 * S)  # the targets are the top-C
    expected = sum(out.aux.coefs[k] * v for k, v in out.aux.losses.items())
    torch.testing.assert_close(out.aux.total(), expected)
    # causal routing itself adds no BCE (no target), and neither does a model without a causal method
    assert not any(k.endswith("causal_bce") for k in model(x, causal_routing=True).aux.losses)
    torch.manual_seed(0)
    plain = LM(cfg_for(("dense", "mod"), causal="none"))
    assert not any(k.endswith("causal_bce") for k in plain(x).aux.losses)


def test_predictor_trains_on_a_stop_gradient_copy():
    model = make_lm(("dense", "mod", "dense", "mod"), "predictor").train()
    out = model(tokens(2, S, seed=11))
    sum(v for k, v in out.aux.losses.items() if k.endswith("causal_bce")).backward()
    g = model.embed.weight.grad
    assert g is None or not g.any(), "the predictor's loss must not reach the embedding"
    for i in mod_ids(model):
        router = model.layers[i].router
        assert router.weight.grad is None or not router.weight.grad.any()
        for name, p in router.predictor.named_parameters():
            assert p.grad is not None and p.grad.abs().sum() > 0, f"layer {i} predictor.{name}"
    for name, p in model.named_parameters():
        if ".predictor." not in name:
            assert p.grad is None or not p.grad.any(), name


def test_aux_bce_trains_the_router_itself():
    model = make_lm(("dense", "mod", "dense", "mod"), "aux_bce").train()
    out = model(tokens(2, S, seed=12))
    out.aux.losses["layers.3.mod.causal_bce"].backward()
    assert model.layers[3].router.weight.grad.abs().sum() > 0
    assert model.embed.weight.grad.abs().sum() > 0  # r = w . x: the router input is not detached
    assert not any(".predictor." in n for n, _ in model.named_parameters())


# --------------------------------------------------------------------------------------------- causal eval


@pytest.mark.parametrize("method", METHODS)
def test_causal_eval_reports_sensible_numbers(method):
    model = make_lm(("dense", "mod", "dense", "mod"), method).train()
    x = tokens(4, S + 1, seed=13)
    batches = [(x[:2, :-1], x[:2, 1:]), (x[2:, :-1], x[2:, 1:])]
    r = causal_eval(model, batches)
    assert model.training  # restored
    assert {"loss_topk", "loss_causal", "ar_gap", "causal_accuracy", "routed_fraction"} <= set(r)
    assert math.isfinite(r["loss_topk"]) and math.isfinite(r["loss_causal"])
    assert r["loss_topk"] > 0 and r["loss_causal"] > 0
    assert r["ar_gap"] == pytest.approx(r["loss_causal"] / r["loss_topk"] - 1)
    assert 0 <= r["causal_accuracy"] <= 1 and 0 <= r["routed_fraction"] <= 1
    assert r["capacity"] == 0.25
    assert set(r["layers"]) == {"layers.1.mod.router", "layers.3.mod.router"}
    # independent: recompute from the two forwards by hand
    model.eval()
    with torch.no_grad():
        routed, agree = [], []
        for xb, yb in batches:
            cau, top = model(xb, yb, causal_routing=True), model(xb, yb)
            inputs = layer_inputs(model, lambda: model(xb))  # noqa: B023 - called in this iteration
            for i in (1, 3):
                router = model.layers[i].router
                h = inputs[i][0]
                causal_says = router.decision_logits(h, router.scores(h)) > 0
                agree.append((causal_says == decisions(top, i)).float().mean())
                routed.append(decisions(cau, i).float().mean())
    assert r["routed_fraction"] == pytest.approx(float(torch.stack(routed).mean()), abs=1e-6)
    assert r["causal_accuracy"] == pytest.approx(float(torch.stack(agree).mean()), abs=1e-6)
    assert 0.05 < r["routed_fraction"] < 0.95


def test_causal_eval_refuses_models_without_a_causal_method():
    torch.manual_seed(0)
    model = LM(cfg_for(("dense", "mod"), causal="none"))
    with pytest.raises(ValueError, match=lit("causal_eval: the model needs MoD layers built with causal=")):
        causal_eval(model, [(tokens(1, 8, 0), tokens(1, 8, 1))])


def test_short_training_teaches_the_predictor(tmp_path):
    """150 steps on a repetitive text: the predictor beats "never route" (accuracy 1 - capacity) clearly,
    routes about ``capacity`` of the tokens, and sampling's loss ends close to the top-k loss."""
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    g = torch.Generator().manual_seed(0)
    text = " ".join(words[int(i)] for i in torch.randint(0, len(words), (4000,), generator=g, device="cpu")) + "\n"
    path = tmp_path / "text.txt"
    path.write_text(text)
    seq = 64
    corpus = file_corpus(path, min_bytes=1000)
    mcfg = LMConfig(
        vocab_size=256,
        seq_len=seq,
        d_model=32,
        n_heads=2,
        d_hidden=64,
        layers=("dense", "mod", "dense", "mod"),
        capacity=0.25,
        causal="predictor",
        predictor_hidden=32,
        causal_coef=1.0,
    )
    tcfg = TrainConfig(
        steps=150, batch_size=8, lr=1e-2, warmup_steps=10, eval_every=1000, eval_batches=2, log_every=1000
    )
    trainer = Trainer(mcfg, tcfg, corpus, tmp_path / "run", progress=False)
    val = eval_batches(corpus.val, 8, seq, 2)
    before = causal_eval(trainer.model, val)
    trainer.run()
    after = causal_eval(trainer.model, val)
    baseline = 1 - mcfg.capacity
    assert after["causal_accuracy"] > baseline + 0.1, (before, after)  # seed 0 reaches ~0.97 vs 0.75
    for name, layer in after["layers"].items():
        assert layer["causal_accuracy"] > baseline + 0.05, (name, layer)
        assert 0.1 < layer["routed_fraction"] < 0.45, (name, layer)  # near capacity: not nothing, not everything
    assert after["loss_causal"] < before["loss_causal"]
    assert abs(after["ar_gap"]) < 0.05, after  # sampling's loss is close to the top-k loss


# ------------------------------------------------------------------------------------ CUDA graphs (decode)


@torch.no_grad()
def test_a_static_step_does_exactly_its_host_half():
    """What a replayed CUDA graph of a decode step relies on (``mode.model.decode_graphs``): a static step's
    only host effect on each cache is ``advance_static`` -- one more token in ``bound``, lengths known on the
    device only -- and it attends the width ``static_step_width()`` announced before it."""
    model = make_lm(("moe", "staged", "dense", "mod"), "predictor")
    x = tokens(3, S, seed=21)
    prompts = [x[0, :5].tolist(), x[1, :9].tolist(), x[2, :7].tolist()]
    logits_BV, caches, pos_B = prefill(model, prompts, capacity=80, static=True)
    for _ in range(70):  # past the first width bucket (64)
        widths = [c.static_step_width() for c in caches]
        bounds = [c.bound for c in caches]
        logits_BV = decode_step(model, logits_BV.argmax(-1), pos_B, caches)
        pos_B = pos_B + 1
        assert [c.bound for c in caches] == [b + 1 for b in bounds]
        assert all(c.host_len is None for c in caches)
        assert [c._width(c.bound) for c in caches] == widths
    assert len({c.static_step_width() for c in caches}) >= 1 and max(c.bound for c in caches) > 64
    dynamic = KVCache(2, 2, 8, 4, torch.float32)
    with pytest.raises(ValueError, match=lit("advance_static: this cache is dynamic (static=False)")):
        dynamic.advance_static()
    full = KVCache(1, 2, 2, 4, torch.float32, static=True)
    full.bound = 2
    with pytest.raises(ValueError, match=lit("KV cache capacity=2: cannot hold 3 tokens")):
        full.advance_static()


def test_generate_with_cuda_graphs_needs_cuda():
    with torch.device("cpu"):  # a model on the CPU, whatever the test device
        model = make_lm(("dense", "mod"))
    with pytest.raises(ValueError, match=lit("cuda_graphs=True needs CUDA: the model is on cpu")):
        generate(model, [[1, 2, 3]], max_new_tokens=4, cuda_graphs=True)
    with pytest.raises(TypeError, match=lit("cuda_graphs=1: must be a bool")):
        generate(model, [[1, 2, 3]], max_new_tokens=4, cuda_graphs=1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layers", [("moe", "staged"), ("dense", "mod", "dense", "mod")], ids=["moe-staged", "mod"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_cuda_graph_decoding_gives_the_same_tokens(layers, temperature, monkeypatch):
    """generate(cuda_graphs=True): each step replayed from a graph captured per attended width (two widths
    here), the same tokens as the eager static path, bf16 and float32."""
    import mode.model.generate as gen
    from mode.model.decode_graphs import GraphedDecode

    made: list[GraphedDecode] = []

    class Recorded(GraphedDecode):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

    monkeypatch.setattr(gen, "GraphedDecode", Recorded)
    model = make_lm(layers, "predictor").cuda()
    x = tokens(3, S, seed=22)
    prompts = [x[0, :5].tolist(), x[1, :9].tolist(), x[2, :7].tolist()]
    for bf16 in (False, True):
        kw = dict(max_new_tokens=80, temperature=temperature, seed=3, bf16=bf16)
        eager = generate(model, prompts, static_cache=True, **kw)
        graphed = generate(model, prompts, cuda_graphs=True, **kw)
        assert graphed == eager
        assert made[-1].captures >= 2 and made[-1].replays >= 70
    with pytest.raises(ValueError, match=lit("cuda_graphs=True with static_cache=False")):
        generate(model, prompts, max_new_tokens=4, cuda_graphs=True, static_cache=False)

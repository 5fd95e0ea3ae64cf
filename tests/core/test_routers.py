"""Routers: MoD top-k, token choice, expert choice, their aux losses and stats.

Every expectation is computed by hand in the test (Python loops and ``math``), never by calling the
router's own helpers. Routers built with ``identity_router`` have an identity weight, so the router
logits are exactly the input: a test writes the logits it wants as the hidden states.
"""

from __future__ import annotations

import math

import pytest
import torch

from mode.routing import (
    ExpertChoiceConfig,
    ExpertChoiceRouter,
    MoDRouter,
    MoDRouterConfig,
    TokenChoiceConfig,
    TokenChoiceRouter,
    load_balancing_loss,
    router_z_loss,
)


def identity_router(router):
    """Set a token-/expert-choice router's weight (X, D) with X == D to the identity: logits == x."""
    with torch.no_grad():
        router.weight.copy_(torch.eye(router.weight.shape[0]))
    return router


def softmax_py(row):
    m = max(row)
    e = [math.exp(v - m) for v in row]
    return [v / sum(e) for v in e]


def sigmoid_py(v):
    return 1.0 / (1.0 + math.exp(-v))


def assert_stats(stats, *, kept_E, requested_X, dropped, noop, tokens, compute_T):
    assert stats.kept_E.tolist() == [float(v) for v in kept_E]
    assert stats.requested_X.tolist() == [float(v) for v in requested_X]
    assert stats.dropped.item() == dropped
    assert stats.noop.item() == noop
    assert stats.tokens.item() == tokens
    assert stats.compute_T.tolist() == [float(v) for v in compute_T]


# ----------------------------------------------------------------------------------------------- MoD top-k


def hand_topk_positions(x_BSD, w_D, C, mask_BS=None):
    """Per sequence, the C positions with the highest score x . w (float64), in increasing order."""
    r = (x_BSD.double() @ w_D.double()).tolist()
    out = []
    for b, row in enumerate(r):
        cand = [s for s in range(len(row)) if mask_BS is None or bool(mask_BS[b, s])]
        out.append(sorted(sorted(cand, key=lambda s: -row[s])[:C]))
    return out


@pytest.mark.parametrize("capacity,S,C", [(0.125, 16, 2), (0.25, 10, 2), (0.1, 5, 1), (0.5, 9, 4), (1.0, 7, 7)])
def test_mod_routes_exactly_C_top_scores_in_order(capacity, S, C):
    B, D = 3, 8
    router = MoDRouter(MoDRouterConfig(d_model=D, capacity=capacity))
    x = torch.randn(B, S, D)
    plan = router(x).compact()
    assert plan.seq_capacity == C
    assert plan.num_assignments == B * C
    assert plan.counts_E.tolist() == [B * C]
    assert plan.expert_idx_A.tolist() == [0] * (B * C)
    assert plan.valid_A is None
    pos = (plan.token_idx_A.view(B, C) - torch.arange(B)[:, None] * S).tolist()
    assert pos == hand_topk_positions(x, router.weight.detach(), C)  # the top scores, original order


@pytest.mark.parametrize("how", ["zero_weight", "identical_tokens"])
def test_mod_exactly_C_with_ties(how):
    B, S, D, C = 2, 16, 8, 4
    router = MoDRouter(MoDRouterConfig(d_model=D, capacity=0.25))
    if how == "zero_weight":
        with torch.no_grad():
            router.weight.zero_()  # every score is 0
        x = torch.randn(B, S, D)
    else:
        x = torch.randn(1, 1, D).expand(B, S, D).contiguous()  # every token the same
    plan = router(x).compact()
    tok = plan.token_idx_A.view(B, C)
    for b in range(B):
        row = tok[b].tolist()
        assert len(set(row)) == C, "C distinct tokens per sequence even when all scores tie"
        assert all(b * S <= t < (b + 1) * S for t in row), "a sequence only routes its own tokens"
        assert row == sorted(row)


def test_mod_padding_never_takes_capacity():
    B, S, D, C = 2, 8, 8, 4
    router = MoDRouter(MoDRouterConfig(d_model=D, capacity=0.5))
    w = router.weight.detach()
    x = torch.randn(B, S, D)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[0, 6:] = False  # 6 real tokens >= C
    mask[1, 2:] = False  # 2 real tokens < C
    x[~mask] = 100.0 * w  # padded tokens would win top-k by far if they were eligible
    plan = router(x, mask).compact()
    pos = (plan.token_idx_A.view(B, C) - torch.arange(B)[:, None] * S).tolist()
    assert pos[0] == hand_topk_positions(x, w, C, mask)[0]
    assert all(p < 6 for p in pos[0])
    assert plan.valid_A.view(B, C)[0].tolist() == [True] * 4
    # Sequence 1: both real tokens are routed; the two remaining slots hold padding and are invalid.
    assert {0, 1} <= set(pos[1])
    assert plan.valid_A.view(B, C)[1].tolist() == [p < 2 for p in pos[1]]
    assert plan.valid_A.sum().item() == 6

    compute = [0.0] * (B * S)
    for b in range(B):
        for p in pos[b]:
            compute[b * S + p] = float(bool(mask[b, p]))
    assert_stats(
        plan.aux.stats["router"], kept_E=[6], requested_X=[6, 2], dropped=0, noop=2, tokens=8, compute_T=compute
    )


def test_mod_stats_without_mask():
    B, S, D, C = 2, 8, 4, 2
    router = MoDRouter(MoDRouterConfig(d_model=D, capacity=0.25))
    x = torch.randn(B, S, D)
    plan = router(x).compact()
    compute = [0.0] * (B * S)
    for b, row in enumerate(hand_topk_positions(x, router.weight.detach(), C)):
        for p in row:
            compute[b * S + p] = 1.0
    assert_stats(
        plan.aux.stats["router"], kept_E=[4], requested_X=[4, 12], dropped=0, noop=12, tokens=16, compute_T=compute
    )
    assert plan.aux.losses == {}


@pytest.mark.parametrize("gate", ["raw", "sigmoid", "one"])
def test_mod_gates(gate):
    B, S, D, C = 2, 8, 4, 2
    router = MoDRouter(MoDRouterConfig(d_model=D, capacity=0.25, gate=gate))
    x = torch.randn(B, S, D)
    plan = router(x).compact()
    assert plan.weight_A.numel() == B * C
    w = router.weight.detach().double()
    expected = []
    for t in plan.token_idx_A.tolist():
        r = float(x.reshape(-1, D)[t].double() @ w)
        expected.append({"raw": r, "sigmoid": sigmoid_py(r), "one": 1.0}[gate])
    assert plan.weight_A.dtype == torch.float32
    torch.testing.assert_close(
        plan.weight_A.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-5, atol=1e-6
    )
    assert plan.weight_A.requires_grad == (gate != "one")


@pytest.mark.parametrize("causal", ["none", "aux_bce"])
def test_ste_gate_trains_the_router_weight_and_sends_nothing_into_x(causal):
    """The "ste" gate's value is exactly 1, so nothing in the forward depends on r: its surrogate gradient (and
    the causal BCE on r) reach the router's weight and never x. A regression: let into x, they trained the
    converted layers' adapters toward the router's scores, and healing a MoD model did not heal."""
    D = 6
    router = MoDRouter(MoDRouterConfig(d_model=D, capacity=0.5, gate="ste", causal=causal))
    x = torch.randn(2, 8, D, requires_grad=True)
    plan = router(x)
    assert torch.equal(plan.weight_A, torch.ones_like(plan.weight_A))
    (plan.weight_A * torch.arange(plan.weight_A.numel())).sum().add(plan.aux.total()).backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    assert x.grad is None
    raw = MoDRouter(MoDRouterConfig(d_model=D, capacity=0.5, gate="raw"))
    raw(x).weight_A.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0  # a gate whose value is r: a true gradient into x


# ------------------------------------------------------------------------------------------- token choice


def hand_token_choice(logits, K, E, gate="softmax", renormalize=False):
    """Sorted list of (expert, token, gate) for every computed choice (no capacity)."""
    rows = []
    for t, row in enumerate(logits):
        p = softmax_py(row) if gate == "softmax" else [sigmoid_py(v) for v in row]
        chosen = sorted(range(len(row)), key=lambda i: -p[i])[:K]
        g = [p[i] for i in chosen]
        if renormalize:
            g = [v / sum(g) for v in g]
        rows += [(e, t, gi) for e, gi in zip(chosen, g) if e < E]
    return sorted(rows)


def plan_rows(plan):
    return list(zip(plan.expert_idx_A.tolist(), plan.token_idx_A.tolist()))


@pytest.mark.parametrize(
    "gate,renormalize", [("softmax", False), ("softmax", True), ("sigmoid", False), ("sigmoid", True)]
)
@pytest.mark.parametrize("top_k", [1, 2])
def test_token_choice_topk_and_gates(gate, renormalize, top_k):
    T, X = 6, 4
    router = identity_router(
        TokenChoiceRouter(TokenChoiceConfig(d_model=X, num_experts=X, top_k=top_k, gate=gate, renormalize=renormalize))
    )
    logits = torch.randn(1, T, X)
    plan = router(logits).compact()
    expected = hand_token_choice(logits[0].tolist(), top_k, X, gate, renormalize)
    assert plan_rows(plan) == [(e, t) for e, t, _ in expected]
    torch.testing.assert_close(plan.weight_A, torch.tensor([g for *_, g in expected]), rtol=1e-5, atol=1e-6)
    assert plan.counts_E.tolist() == [sum(e == i for e, _, _ in expected) for i in range(X)]


def test_token_choice_top1_capacity_drops_later_tokens():
    # 6 tokens, 2 experts, capacity_factor 0.5 -> ceil(0.5 * 6 * 1 / 2) = 2 per expert.
    logits = [[2.0, 0.0], [1.0, 0.0], [3.0, 1.0], [0.5, 0.0], [0.0, 1.0], [0.0, 2.0]]  # choices 0 0 0 0 1 1
    router = identity_router(TokenChoiceRouter(TokenChoiceConfig(d_model=2, num_experts=2, capacity_factor=0.5)))
    plan = router(torch.tensor([logits])).compact()
    assert plan_rows(plan) == [(0, 0), (0, 1), (1, 4), (1, 5)]  # tokens 2 and 3 dropped from expert 0
    gates = [softmax_py(logits[t])[e] for e, t in plan_rows(plan)]
    torch.testing.assert_close(plan.weight_A, torch.tensor(gates), rtol=1e-6, atol=1e-7)
    assert_stats(
        plan.aux.stats["router"],
        kept_E=[2, 2],
        requested_X=[4, 2],
        dropped=2,
        noop=0,
        tokens=6,
        compute_T=[1, 1, 0, 0, 1, 1],
    )


def test_token_choice_top2_capacity_first_choices_before_second():
    # 3 experts, top-2, 4 tokens, capacity_factor 0.75 -> ceil(0.75 * 4 * 2 / 3) = 2 per expert.
    logits = [
        [3.0, 2.0, 0.0],  # t0: 1st e0, 2nd e1
        [0.0, 3.0, 2.0],  # t1: 1st e1, 2nd e2
        [0.0, 3.0, 2.0],  # t2: 1st e1, 2nd e2
        [3.0, 0.0, 2.0],  # t3: 1st e0, 2nd e2
    ]
    # Priority: all first choices in token order, then all second choices in token order.
    # e1 keeps the first choices of t1 and t2 and drops t0's *second* choice although t0 comes first
    # (token-major priority would instead drop t2's first choice); e2 keeps t1 and t2 and drops t3.
    router = identity_router(
        TokenChoiceRouter(TokenChoiceConfig(d_model=3, num_experts=3, top_k=2, capacity_factor=0.75))
    )
    plan = router(torch.tensor([logits])).compact()
    assert router.capacity(4) == 2
    assert plan_rows(plan) == [(0, 0), (0, 3), (1, 1), (1, 2), (2, 1), (2, 2)]
    assert plan.counts_E.tolist() == [2, 2, 2]
    gates = [softmax_py(logits[t])[e] for e, t in plan_rows(plan)]
    torch.testing.assert_close(plan.weight_A, torch.tensor(gates), rtol=1e-6, atol=1e-7)
    assert_stats(
        plan.aux.stats["router"],
        kept_E=[2, 2, 2],
        requested_X=[2, 3, 3],
        dropped=2,
        noop=0,
        tokens=4,
        compute_T=[1, 2, 2, 1],
    )


@pytest.mark.parametrize("top_k", [1, 2])
def test_token_choice_dropless_drops_none(top_k):
    B, S, D, E = 2, 16, 8, 4
    router = TokenChoiceRouter(TokenChoiceConfig(d_model=D, num_experts=E, top_k=top_k, capacity_factor=None))
    with torch.no_grad():
        router.weight[0] += 5.0  # heavily imbalanced: expert 0 is everyone's favourite
    x = torch.randn(B, S, D).abs()
    plan = router(x).compact()
    T = B * S
    assert plan.counts_E[0].item() == T  # far above any capacity-factor-1 limit
    assert plan.num_assignments == T * top_k
    assert torch.bincount(plan.token_idx_A, minlength=T).tolist() == [top_k] * T
    stats = plan.aux.stats["router"]
    assert stats.dropped.item() == 0
    assert stats.kept_E.tolist() == stats.requested_X.tolist()


def test_token_choice_noop_experts_never_in_plan():
    # 2 real experts + 1 no-op (slot 2); top-1 choices: 2 0 2 1 0 2.
    logits = [[0.0, 0.0, 1.0], [2.0, 0.0, 1.0], [0.0, 1.0, 3.0], [0.0, 2.0, 1.0], [1.0, 0.0, 0.5], [0.0, 0.0, 0.1]]
    router = identity_router(TokenChoiceRouter(TokenChoiceConfig(d_model=3, num_experts=2, num_noop=1)))
    plan = router(torch.tensor([logits])).compact()
    assert plan_rows(plan) == [(0, 1), (0, 4), (1, 3)]
    assert plan.num_experts == 2 and plan.counts_E.tolist() == [2, 1]
    torch.testing.assert_close(plan.weight_A, torch.tensor([softmax_py(logits[t])[e] for e, t in plan_rows(plan)]))
    assert_stats(
        plan.aux.stats["router"],
        kept_E=[2, 1],
        requested_X=[2, 1, 3],
        dropped=0,
        noop=3,
        tokens=6,
        compute_T=[0, 1, 0, 1, 1, 0],
    )
    stats = plan.aux.stats["router"]
    assert stats.num_experts == 2 and stats.num_noop == 1


def test_token_choice_noop_top2_with_capacity_and_mask():
    # 2 real experts + 2 no-op slots, top-2, capacity_factor 0.5 over T = 8 -> ceil(0.5 * 8 * 2 / 2) = 4.
    logits = [
        [3.0, 2.0, 0.0, 0.0],  # e0, e1
        [3.0, 0.0, 2.0, 0.0],  # e0, noop2
        [0.0, 0.0, 3.0, 2.0],  # noop2, noop3 -> no expert output
        [3.0, 2.0, 0.0, 0.0],  # e0, e1
        [3.0, 2.0, 0.0, 0.0],  # e0, e1 (padding: ignored)
        [2.0, 3.0, 0.0, 0.0],  # e1, e0
        [3.0, 0.0, 0.0, 2.0],  # e0, noop3
        [3.0, 2.0, 0.0, 0.0],  # e0, e1
    ]
    mask = torch.ones(1, 8, dtype=torch.bool)
    mask[0, 4] = False
    router = identity_router(
        TokenChoiceRouter(TokenChoiceConfig(d_model=4, num_experts=2, num_noop=2, top_k=2, capacity_factor=0.5))
    )
    plan = router(torch.tensor([logits]), mask).compact()
    # Real tokens' first choices for e0: t0 t1 t3 t6 t7 (5 > 4: t7 dropped); e1 first: t5.
    # Second choices for e1: t0 t3 t7 (t5's second choice e0 is over capacity: dropped).
    assert plan_rows(plan) == [(0, 0), (0, 1), (0, 3), (0, 6), (1, 0), (1, 3), (1, 5), (1, 7)]
    assert_stats(
        plan.aux.stats["router"],
        kept_E=[4, 4],
        requested_X=[6, 4, 2, 2],
        dropped=2,
        noop=4,
        tokens=7,
        compute_T=[2, 1, 0, 2, 0, 1, 1, 1],
    )


def test_token_choice_plan_grouped_by_expert_and_sorted_by_token():
    B, S, D, E = 3, 16, 8, 5
    router = TokenChoiceRouter(TokenChoiceConfig(d_model=D, num_experts=E, num_noop=2, top_k=3, capacity_factor=0.8))
    plan = router(torch.randn(B, S, D)).compact()
    expert, token = plan.expert_idx_A.tolist(), plan.token_idx_A.tolist()
    assert expert == sorted(expert)
    assert all(0 <= e < E for e in expert)
    counts = [expert.count(e) for e in range(E)]
    assert plan.counts_E.tolist() == counts
    start = 0
    for c in counts:
        seg = token[start : start + c]
        assert seg == sorted(seg) and len(set(seg)) == len(seg)  # sorted, no duplicate token per expert
        start += c
    assert max(counts) <= router.capacity(B * S)
    stats = plan.aux.stats["router"]
    assert stats.kept_E.tolist() == [float(c) for c in counts]
    assert stats.compute_T.sum().item() == len(token)
    assert stats.requested_X.sum().item() == B * S * 3  # every token makes top_k requests
    assert stats.dropped.item() + stats.noop.item() + len(token) == B * S * 3


# ------------------------------------------------------------------------------------------ expert choice


def hand_expert_choice(logits_BSX, c, E, mask_BS=None):
    rows = []
    B, S, X = logits_BSX.shape
    for b in range(B):
        probs = [softmax_py(logits_BSX[b, s].tolist()) for s in range(S)]
        cand = [s for s in range(S) if mask_BS is None or bool(mask_BS[b, s])]
        for e in range(E):
            for s in sorted(cand, key=lambda s: -probs[s][e])[:c]:
                rows.append((e, b * S + s, probs[s][e]))
    return sorted(rows)


@pytest.mark.parametrize("num_noop", [0, 1])
def test_expert_choice_each_expert_takes_c_tokens_per_sequence(num_noop):
    B, S, E = 2, 8, 3
    X = E + num_noop
    router = identity_router(
        ExpertChoiceRouter(ExpertChoiceConfig(d_model=X, num_experts=E, num_noop=num_noop, capacity_factor=1.5))
    )
    c = math.ceil(1.5 * S / X)
    logits = torch.randn(B, S, X)
    plan = router(logits).compact()
    expected = hand_expert_choice(logits, c, E)
    assert plan_rows(plan) == [(e, t) for e, t, _ in expected]
    torch.testing.assert_close(plan.weight_A, torch.tensor([g for *_, g in expected]), rtol=1e-5, atol=1e-7)
    assert plan.counts_E.tolist() == [B * c] * E
    for e in range(E):  # exactly c per expert per sequence
        tok = plan.token_idx_A[plan.expert_idx_A == e]
        assert torch.bincount(tok // S, minlength=B).tolist() == [c] * B
    stats = plan.aux.stats["router"]
    assert_stats(
        stats,
        kept_E=[B * c] * E,
        requested_X=[B * c] * X,
        dropped=0,
        noop=B * c * num_noop,
        tokens=B * S,
        compute_T=torch.bincount(torch.tensor([t for _, t, _ in expected]), minlength=B * S).tolist(),
    )


def test_expert_choice_noop_slots_not_computed():
    # One real expert and one no-op slot; slot 1 (no-op) wins every token by a wide margin, yet the real
    # expert still computes exactly its c tokens and nothing is computed for the no-op picks.
    B, S = 1, 8
    router = identity_router(ExpertChoiceRouter(ExpertChoiceConfig(d_model=2, num_experts=1, num_noop=1)))
    logits = torch.zeros(B, S, 2)
    logits[0, :, 1] = 5.0
    logits[0, :, 0] = torch.arange(S, dtype=torch.float32) / 10  # token 7 and 6 are expert 0's favourites
    plan = router(logits).compact()
    c = 4  # ceil(1.0 * 8 / 2)
    assert plan.expert_idx_A.tolist() == [0] * c
    assert plan.token_idx_A.tolist() == [4, 5, 6, 7]
    assert plan.aux.stats["router"].noop.item() == c


def test_expert_choice_with_mask():
    B, S, E = 2, 8, 2
    router = identity_router(ExpertChoiceRouter(ExpertChoiceConfig(d_model=E, num_experts=E)))
    logits = torch.randn(B, S, E)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[0, 5:] = False  # 5 real tokens >= c = 4
    mask[1, 2:] = False  # 2 real tokens < c
    logits[~mask] = 10.0  # padding would be everybody's favourite if it were eligible
    plan = router(logits, mask).compact()
    expected = hand_expert_choice(logits, 4, E, mask)
    assert plan_rows(plan) == [(e, t) for e, t, _ in expected]
    assert all(bool(mask.reshape(-1)[t]) for t in plan.token_idx_A.tolist())
    assert plan.aux.stats["router"].tokens.item() == 7
    assert plan.counts_E.tolist() == [4 + 2, 4 + 2]


# ----------------------------------------------------------------------------------------------- aux losses

PROBS = [[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.25, 0.15, 0.6], [0.7, 0.2, 0.1]]


def test_load_balancing_loss_hand_computed_top1():
    # top-1 choices: 0, 1, 2, 0 -> f = [2/4, 1/4, 1/4]
    # P = column means = [1.55/4, 1.25/4, 1.2/4] = [0.3875, 0.3125, 0.3]
    # loss = 3 * (0.5 * 0.3875 + 0.25 * 0.3125 + 0.25 * 0.3) = 3 * 0.346875 = 1.040625
    probs = torch.tensor(PROBS)
    loss = load_balancing_loss(probs, torch.tensor([[0], [1], [2], [0]]))
    assert loss.item() == pytest.approx(1.040625, abs=1e-6)
    # The same through the router: identity weight and logits log(p) make softmax(logits) == p.
    router = identity_router(TokenChoiceRouter(TokenChoiceConfig(d_model=3, num_experts=3)))
    aux = router(probs.log()[None]).aux
    assert aux.losses["balance"].item() == pytest.approx(1.040625, abs=1e-6)
    assert aux.coefs["balance"] == 0.01


def test_load_balancing_loss_hand_computed_top2():
    # top-2 choices: {0,1}, {1,2}, {2,0}, {0,1} -> f = [3/8, 3/8, 2/8]; P = [0.3875, 0.3125, 0.3]
    # loss = 3 * (0.375 * 0.3875 + 0.375 * 0.3125 + 0.25 * 0.3) = 3 * 0.3375 = 1.0125
    router = identity_router(TokenChoiceRouter(TokenChoiceConfig(d_model=3, num_experts=3, top_k=2)))
    loss = router(torch.tensor(PROBS).log()[None]).aux.losses["balance"]
    assert loss.item() == pytest.approx(1.0125, abs=1e-6)


def test_load_balancing_loss_ignores_padding():
    # Token 1 is padding. Real tokens 0, 2, 3 choose 0, 2, 0 -> f = [2/3, 0, 1/3];
    # P = [(0.5 + 0.25 + 0.7) / 3, ., (0.2 + 0.6 + 0.1) / 3] -> loss = 3 * (2/3 * 1.45/3 + 1/3 * 0.9/3)
    expected = 3 * (2 / 3 * 1.45 / 3 + 1 / 3 * 0.9 / 3)
    router = identity_router(TokenChoiceRouter(TokenChoiceConfig(d_model=3, num_experts=3)))
    mask = torch.tensor([[True, False, True, True]])
    loss = router(torch.tensor(PROBS).log()[None], mask).aux.losses["balance"]
    assert loss.item() == pytest.approx(expected, abs=1e-6)


def test_load_balancing_loss_counts_noop_slots():
    # Slot 2 is a no-op: its choices still count in f (the loss balances all slots).
    router = identity_router(TokenChoiceRouter(TokenChoiceConfig(d_model=3, num_experts=2, num_noop=1)))
    loss = router(torch.tensor(PROBS).log()[None]).aux.losses["balance"]
    assert loss.item() == pytest.approx(1.040625, abs=1e-6)


def test_load_balancing_loss_is_one_for_uniform_routing():
    B, S, D, X = 2, 8, 6, 4
    router = TokenChoiceRouter(TokenChoiceConfig(d_model=D, num_experts=X, top_k=X))
    with torch.no_grad():
        router.weight.zero_()  # every probability is exactly 1/4 and every token picks every slot
    assert router(torch.randn(B, S, D)).aux.losses["balance"].item() == 1.0
    # Perfectly balanced top-1 choices with uniform probabilities: f = P = 1/4.
    probs = torch.full((8, X), 0.25)
    chosen = torch.tensor([[0], [1], [2], [3], [3], [2], [1], [0]])
    assert load_balancing_loss(probs, chosen).item() == 1.0
    # Any imbalance with the same probabilities keeps the loss at 1 (P uniform) ...
    assert load_balancing_loss(probs, torch.zeros(8, 1, dtype=torch.long)).item() == 1.0
    # ... while skewed probabilities that follow the choices push it above 1.
    skew = torch.tensor([[0.7, 0.1, 0.1, 0.1]] * 8)
    assert load_balancing_loss(skew, torch.zeros(8, 1, dtype=torch.long)).item() == pytest.approx(4 * 0.7)


def test_load_balancing_loss_gradient_only_through_probabilities():
    probs = torch.tensor(PROBS, requires_grad=True)
    load_balancing_loss(probs, torch.tensor([[0], [1], [2], [0]])).backward()
    # d/dp_ti of X * sum_i f_i * mean_t p_ti = X * f_i / T
    f = [0.5, 0.25, 0.25]
    expected = torch.tensor([[3 * fi / 4 for fi in f]] * 4)
    torch.testing.assert_close(probs.grad, expected)


def test_router_z_loss_hand_computed():
    # Row 0: logits log 1, log 2, log 5 -> logsumexp = log 8; row 1: zeros -> log 3.
    logits = torch.tensor([[0.0, math.log(2), math.log(5)], [0.0, 0.0, 0.0]])
    expected = (math.log(8) ** 2 + math.log(3) ** 2) / 2
    assert router_z_loss(logits).item() == pytest.approx(expected, rel=1e-6)
    assert router_z_loss(logits, torch.tensor([False, True])).item() == pytest.approx(math.log(3) ** 2, rel=1e-6)
    tc = identity_router(TokenChoiceRouter(TokenChoiceConfig(d_model=3, num_experts=3, z_coef=0.5)))
    aux = tc(logits[None]).aux
    assert aux.losses["z_loss"].item() == pytest.approx(expected, rel=1e-6)
    assert aux.coefs["z_loss"] == 0.5
    ec = identity_router(ExpertChoiceRouter(ExpertChoiceConfig(d_model=3, num_experts=3)))
    assert ec(logits[None]).aux.losses["z_loss"].item() == pytest.approx(expected, rel=1e-6)


def test_aux_total_is_weighted_sum():
    router = identity_router(
        TokenChoiceRouter(TokenChoiceConfig(d_model=3, num_experts=3, balance_coef=0.1, z_coef=0.01))
    )
    logits = torch.tensor(PROBS).log()
    aux = router(logits[None]).aux
    z = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / 4
    assert aux.total().item() == pytest.approx(0.1 * 1.040625 + 0.01 * z, rel=1e-5)


def test_router_gradients_reach_the_router_weight():
    router = TokenChoiceRouter(TokenChoiceConfig(d_model=8, num_experts=4, top_k=2))
    plan = router(torch.randn(2, 8, 8)).compact()
    (plan.weight_A.sum() + plan.aux.total()).backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


# -- the token-choice router's fast paths against their readable references ---------------------------


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("num_noop", [0, 2])
def test_token_choice_balance_loss_from_counts_is_bitwise_the_reference(masked, num_noop):
    """The router computes the balance loss from its choice counts (no (T, X) one-hot); it must equal
    losses.load_balancing_loss bit for bit, with and without a padding mask and no-op slots."""
    torch.manual_seed(0)
    router = TokenChoiceRouter(TokenChoiceConfig(d_model=8, num_experts=5, num_noop=num_noop, top_k=2))
    x = torch.randn(3, 11, 8)
    mask = None
    if masked:
        mask = torch.ones(3, 11, dtype=torch.bool)
        mask[1, 4:] = False
    plan = router(x, mask)
    probs = (x.reshape(33, 8) @ router.weight.detach().t()).softmax(-1)
    chosen = probs.topk(2, dim=-1).indices
    want = load_balancing_loss(probs, chosen, None if mask is None else mask.reshape(33))
    assert torch.equal(plan.aux.losses["balance"].detach(), want)


@pytest.mark.device_assert("the token-choice finite check is a torch._assert_async on CUDA")
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_token_choice_finite_check_catches_nan_and_both_infinities(bad):
    router = identity_router(TokenChoiceRouter(TokenChoiceConfig(d_model=4, num_experts=4, top_k=2)))
    x = torch.randn(2, 5, 4)
    x[1, 2, 3] = bad  # the matmul spreads it over that token's logits (inf * 0 is NaN)
    with pytest.raises(ValueError, match=r"TokenChoiceRouter: 4 router logits are NaN or inf"):
        router(x)


@pytest.mark.parametrize(
    "kw,masked,padded",
    [
        (dict(), False, False),  # dropless, no no-op experts, no mask: A == counts.sum()
        (dict(), True, True),  # a mask: masked tokens' choices are padding
        (dict(num_noop=2), False, True),  # no-op choices are padding
        (dict(capacity_factor=1.0), False, True),  # capacity drops are padding
    ],
)
def test_token_choice_plan_says_statically_whether_it_has_padding(kw, masked, padded):
    router = TokenChoiceRouter(TokenChoiceConfig(d_model=8, num_experts=4, top_k=2, **kw))
    mask = torch.ones(2, 6, dtype=torch.bool) if masked else None
    plan = router(torch.randn(2, 6, 8), mask)
    assert plan.padded is padded
    if not padded:
        assert int(plan.counts_E.sum()) == plan.num_assignments


@pytest.mark.device_assert("the routers' finite check is a torch._assert_async on CUDA")
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_finite_check_on_a_reduction_names_the_bad_logits(bad):
    """``check_finite_via``: three operators on a reduction over every logit (a loss the step forms anyway, or the
    sum); NaN and either infinity make the reduction non-finite, and the failure counts the bad logits."""
    from mode._checks import check_finite_via

    logits = torch.randn(6, 5)
    check_finite_via("TokenChoiceRouter", logits)  # finite: no error
    check_finite_via("TokenChoiceRouter", logits, torch.logsumexp(logits, -1).square().sum())
    check_finite_via("TokenChoiceRouter", logits[:0])  # empty: no error
    logits[2, 1] = bad
    with pytest.raises(ValueError, match=r"TokenChoiceRouter: 1 router logits are NaN or inf"):
        check_finite_via("TokenChoiceRouter", logits)
    if bad != float("-inf"):  # a lone -inf logit leaves logsumexp finite (softmax gives it probability 0)
        with pytest.raises(ValueError, match=r"TokenChoiceRouter: 1 router logits are NaN or inf"):
            check_finite_via("TokenChoiceRouter", logits, torch.logsumexp(logits, -1).square().sum())


def test_finite_check_refuses_an_overflowing_loss_and_says_why():
    from mode._checks import check_finite_via

    with pytest.raises(ValueError, match="overflowed to inf although every logit is finite"):
        check_finite_via("TokenChoiceRouter", torch.full((2, 3), 3e38), torch.full((), float("inf")))


def test_a_steered_threshold_never_lands_on_a_logit():
    """A quantile on a lump of equal decision logits (at layer 0 a token id's score is always the same) moves to
    the midpoint up to the next larger logit: the same tokens pass "> threshold", each with a margin, so that
    the rounding of another kernel cannot flip them (the H200's greedy generate vs full forward of
    tests/hf/test_hf.py differed by 1.6e-3 in float32: a layer-0 threshold equal to one token id's score, tied
    in 8 of 30 seeds of that test's model on the CPU). A quantile between distinct logits is unchanged."""
    from mode.routing.mod_topk import MoDRouter, MoDRouterConfig

    def steered(values, capacity=0.5):
        router = MoDRouter(MoDRouterConfig(d_model=4, capacity=capacity, causal="threshold"))
        with torch.device("cpu"):
            logit = torch.tensor([values])
        router._steer_threshold(logit.to(router.threshold.device), None)
        return float(router.threshold), logit

    t, logit = steered([0.0, 1.0, 1.0, 1.0, 2.0, 3.0])  # the median is 1.0, a logit (three tokens)
    assert t == 1.5 and ((logit > t) == (logit > 1.0)).all()
    assert steered([0.0, 1.0, 2.0, 3.0])[0] == 1.5  # between two logits: the quantile itself
    assert steered([1.0, 1.0, 1.0, 1.0])[0] == 1.0  # nothing above: the quantile (no token passes either way)


def test_hash_routing_takes_the_experts_of_each_token_id_from_the_table():
    """Hash routing (DeepSeek-V4's first layers): the table row of a token's id names its k experts; the gates
    are the scores at those experts, renormalised; no ids is an error naming them."""
    from mode.routing.token_choice import TokenChoiceConfig, TokenChoiceRouter

    cfg = TokenChoiceConfig(
        d_model=8,
        num_experts=6,
        top_k=2,
        gate="sqrtsoftplus",
        renormalize=True,
        renorm_eps=1e-20,
        scale=1.5,
        hash_vocab=10,
    )
    router = TokenChoiceRouter(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.hash_table_VK.copy_(torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(10)]))
    x = torch.randn(2, 5, 8, generator=g)
    ids = torch.randint(0, 10, (2, 5), generator=g)
    plan = router(x, ids_BS=ids)
    scores_TX = torch.nn.functional.softplus(x.reshape(10, 8) @ router.weight.t()).sqrt()
    chosen_TK = router.hash_table_VK[ids.reshape(10)]
    gate_TK = scores_TX.gather(1, chosen_TK)
    gate_TK = 1.5 * gate_TK / (gate_TK.sum(-1, keepdim=True) + 1e-20)
    got = {(int(t), int(e)): float(w) for t, e, w in zip(plan.token_idx_A, plan.expert_idx_A, plan.weight_A)}
    want = {(t, int(chosen_TK[t, k])): float(gate_TK[t, k]) for t in range(10) for k in range(2)}
    assert got.keys() == want.keys()
    for key, w in want.items():
        assert got[key] == pytest.approx(w, rel=1e-6)
    with pytest.raises(ValueError, match="hash routing.*chooses by the token ids"):
        router(x)
    with pytest.raises(ValueError, match="hash_vocab=10: hash routing takes its experts from the table"):
        TokenChoiceConfig(d_model=8, num_experts=6, top_k=2, hash_vocab=10, bias_balance=True)


def test_dropped_groups_zero_and_bias_on_logits_change_the_choice_as_their_families_do():
    """AXK2 scores the experts of dropped groups 0, not -inf: one of them beats a kept expert whose biased score
    is negative. Kolibri-1 adds its bias to the raw logits, not to the sigmoid scores."""
    from mode.routing.token_choice import TokenChoiceConfig, TokenChoiceRouter

    def router(**kw):
        r = TokenChoiceRouter(
            TokenChoiceConfig(d_model=4, num_experts=4, top_k=2, gate="sigmoid", bias_balance=True, **kw)
        )
        with torch.no_grad():
            r.weight.copy_(torch.eye(4))
        return r

    x = torch.tensor([[[5.0, 2.0, -3.0, -4.0]]])  # group 0 = experts {0, 1} wins its group score either way
    for fill in ("ninf", "zero"):
        r = router(n_group=2, topk_group=1, dropped_groups=fill)
        with torch.no_grad():
            r.bias_X.copy_(torch.tensor([0.0, -1.0, 0.0, 0.0]))  # expert 1: sigmoid(2) - 1 < 0
        chosen = set(r(x).expert_idx_A.tolist())
        # -inf: both kept experts; 0: a dropped-group expert (score 0) beats expert 1's negative biased score
        assert chosen == {0, 1} if fill == "ninf" else (0 in chosen and 1 not in chosen and len(chosen) == 2), fill
    x = torch.tensor([[[2.0, 1.0, 0.0, -3.0]]])
    for bias_on, expected in (("scores", {0, 3}), ("logits", {0, 1})):
        r = router(bias_on=bias_on)
        with torch.no_grad():  # +1.5 on expert 3: its score 0.05 + 1.5 beats every score; its logit -1.5 does not
            r.bias_X.copy_(torch.tensor([0.0, 0.0, 0.0, 1.5]))
        plan = r(x)
        assert set(plan.expert_idx_A.tolist()) == expected, bias_on
        gates = dict(zip(plan.expert_idx_A.tolist(), plan.weight_A.tolist()))
        assert gates[0] == pytest.approx(torch.sigmoid(torch.tensor(2.0)).item())  # gates: unbiased scores


def test_given_choices_build_the_plan_a_token_choice_router_would():
    """GivenChoices (Gemma-4: transformers' router chooses, mode's experts compute): the plan of the given top-k
    and gates equals TokenChoiceRouter's plan for the same choices; forward refuses, naming plan()."""
    from mode.routing.given import GivenChoices
    from mode.routing.token_choice import TokenChoiceConfig, TokenChoiceRouter

    router = TokenChoiceRouter(TokenChoiceConfig(d_model=8, num_experts=6, top_k=2, renormalize=True))
    x = torch.randn(2, 5, 8)
    ref = router(x)
    probs = (x.reshape(10, 8) @ router.weight.t()).softmax(-1)
    w, idx = probs.topk(2, dim=-1)
    given = GivenChoices(num_experts=6, top_k=2).plan(idx, w / w.sum(-1, keepdim=True))
    assert torch.equal(given.token_idx_A, ref.token_idx_A) and torch.equal(given.expert_idx_A, ref.expert_idx_A)
    assert torch.equal(given.counts_E, ref.counts_E)
    torch.testing.assert_close(given.weight_A, ref.weight_A)
    assert float(given.aux.stats["router"].kept_E.sum()) == 20
    with pytest.raises(TypeError, match=r"router.plan\(index_TK, weight_TK\)"):
        GivenChoices(6, 2)(x)
    with pytest.raises(ValueError, match="must both be"):
        GivenChoices(6, 2).plan(idx[:, :1], w)


def test_renorm_p_and_logit_softcap_follow_their_formulas():
    """renorm_p (DBRX: the k gates over their p-norm) and logit_softcap (Laguna: c * tanh(logit / c) first)."""
    from mode.routing.token_choice import TokenChoiceConfig, TokenChoiceRouter

    router = TokenChoiceRouter(
        TokenChoiceConfig(d_model=8, num_experts=6, top_k=3, renormalize=True, renorm_p=2.0, logit_softcap=0.7)
    )
    x = torch.randn(2, 4, 8)
    plan = router(x)
    logits = x.reshape(8, 8) @ router.weight.t()
    capped = torch.tanh(logits / 0.7) * 0.7
    torch.testing.assert_close(plan.logits_TX, capped)
    w, idx = capped.softmax(-1).topk(3, dim=-1)
    w = w / torch.linalg.vector_norm(w, ord=2, dim=-1, keepdim=True)
    got = {(int(t), int(e)): float(g) for t, e, g in zip(plan.token_idx_A, plan.expert_idx_A, plan.weight_A)}
    want = {(t, int(idx[t, k])): float(w[t, k]) for t in range(8) for k in range(3)}
    assert got.keys() == want.keys()
    for key, g in want.items():
        assert got[key] == pytest.approx(g, rel=1e-6)
    with pytest.raises(ValueError, match="renorm_p=2.0: need renormalize=True"):
        TokenChoiceConfig(d_model=8, num_experts=6, top_k=2, renorm_p=2.0)

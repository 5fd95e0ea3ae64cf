"""The MoE recipes of DeepSeek-V3 and Qwen-MoE in the token-choice router and the MoE layer: bias balancing,
device-limited routing, the routed scaling factor, the balance-loss scopes, the no-op budget, shared experts."""

from __future__ import annotations

import pytest
import torch

from mode import IntegratedMoDE, MoEConfig, MoELayer, TokenChoiceConfig, TokenChoiceRouter
from mode.routing import load_balancing_loss, update_expert_bias

D, H, B, S = 16, 32, 4, 12


def router(**kw) -> TokenChoiceRouter:
    base = dict(d_model=D, num_experts=4, top_k=2, balance_coef=0.0, z_coef=0.0)
    return TokenChoiceRouter(TokenChoiceConfig(**{**base, **kw}))


def chosen_and_gates(r: TokenChoiceRouter, x):
    """(token, expert) -> gate of every computed assignment of the plan."""
    plan = r(x)
    return {
        (t, e): w
        for t, e, w in zip(plan.token_idx_A.tolist(), plan.expert_idx_A.tolist(), plan.weight_A.tolist())
        if e < r.num_experts
    }


# ---------------------------------------------------------------------------------------- bias balancing


@pytest.mark.parametrize("gate", ["softmax", "sigmoid"])
def test_the_bias_changes_the_choice_not_the_gates(gate):
    torch.manual_seed(0)
    r = router(gate=gate, bias_balance=True)
    x = torch.randn(B, S, D)
    probs_TX = (
        (x.reshape(-1, D) @ r.weight.t()).softmax(-1)
        if gate == "softmax"
        else (x.reshape(-1, D) @ r.weight.t()).sigmoid()
    )
    before = chosen_and_gates(r, x)
    with torch.no_grad():
        r.bias_X.copy_(torch.tensor([5.0, 0.0, 0.0, -5.0]))  # expert 0 always chosen, expert 3 never
    after = chosen_and_gates(r, x)
    assert before.keys() != after.keys()
    assert all((t, 0) in after for t in range(B * S)) and not any(e == 3 for _, e in after)
    for (t, e), w in after.items():  # the gate of a chosen expert is its unbiased score
        assert w == pytest.approx(float(probs_TX[t, e]), rel=1e-6)


def test_the_update_moves_by_the_sign_and_recentres():
    r = router(num_experts=4, bias_balance=True, bias_rate=0.01)
    with torch.no_grad():
        r.bias_X.copy_(torch.tensor([0.3, 0.0, 0.0, 0.0]))
        r.load_X.copy_(torch.tensor([10.0, 0.0, 5.0, 5.0]))  # mean 5: over, under, on, on target
    assert update_expert_bias(r) == 1
    moved = torch.tensor([0.3 - 0.01, 0.01, 0.0, 0.0])
    torch.testing.assert_close(r.bias_X, moved - moved.mean())
    assert float(r.bias_X.sum()) == pytest.approx(0.0, abs=1e-7) and not r.load_X.any()


def test_only_training_forwards_with_gradients_count_the_load():
    torch.manual_seed(0)
    r = router(bias_balance=True)
    x = torch.randn(B, S, D)
    r.eval()
    r(x)
    r.train()
    with torch.no_grad():
        r(x)
    assert not r.load_X.any()  # eval() and no_grad forwards leave it (and so the bias) alone
    plan = r(x)
    stats = plan.aux.stats["router"]
    torch.testing.assert_close(r.load_X, stats.requested_X)  # the choices, before any capacity limit
    r.eval()
    bias = r.bias_X.clone()
    r(x)
    torch.testing.assert_close(r.bias_X, bias)


def test_the_bias_is_part_of_the_state_dict_and_the_load_is_not():
    r = router(bias_balance=True)
    assert "bias_X" in r.state_dict() and "load_X" not in r.state_dict()
    assert "bias_X" not in router().state_dict()


def test_bias_balancing_evens_out_a_skewed_router(device):
    """A router whose weights favour one expert: the bias alone (the default rate, 1e-3) brings the worst
    expert's load from 3.6x the mean to within 10% of it (on the CPU; see the bound below elsewhere)."""
    torch.manual_seed(0)
    with torch.device("cpu"):  # the same router and batch on every test device
        r = router(num_experts=8, top_k=2, bias_balance=True)
        with torch.no_grad():
            r.weight[0] += 0.5  # expert 0 wins for most tokens (the inputs lean the same way)
        x = torch.randn(64, S, D) + 0.5
    r, x = r.to(device), x.to(device)
    worst = []
    for _ in range(1500):
        counts = r(x).aux.stats["router"].requested_X
        worst.append(float(counts.max() / counts.mean()))
        update_expert_bias(r)
    # Sign updates at a fixed rate on one fixed batch end in a limit cycle whose worst load depends on the
    # draw: 1.04x to 1.73x the mean over seeds 0-19 on the CPU (this draw: 1.08x). Another device rounds the
    # logits differently, which can flip near-tied choices and land in another cycle, so there the bound is
    # the one every seed meets (an H200 run that drew the router and batch with CUDA's RNG ended at 1.31x).
    bound = 1.1 if device.type == "cpu" else 1.8
    assert worst[0] > 3.5 and max(worst[-100:]) < bound, (worst[0], max(worst[-100:]))


@pytest.mark.parametrize("target", [0.25, 0.5, 0.75])
def test_the_noop_budget_holds_its_share_on_training_and_held_out_tokens(target):
    """Integrated MoDE with a compute budget: after warm-up, the bias holds the share of choices on no-op
    slots at the target (+-2 points), over the training steps (a fresh batch each) and on held-out tokens,
    with the real experts balanced."""
    torch.manual_seed(0)
    layer = IntegratedMoDE.from_config(
        MoEConfig(
            D,
            H,
            num_experts=4,
            num_noop=4,
            top_k=2,
            balance_coef=0.0,
            router_options=dict(bias_balance=True, noop_target=target, bias_rate=0.005),
        )
    )
    r = layer.router
    shares = []
    for _ in range(300):
        st = r(torch.randn(64, S, D)).aux.stats["router"]
        shares.append(float(st.noop / st.requested_X.sum()))
        update_expert_bias(r)
    assert abs(sum(shares[-100:]) / 100 - target) <= 0.02, shares[-100:]
    with torch.no_grad():
        st = r(torch.randn(256, S, D)).aux.stats["router"]
    assert abs(float(st.noop / st.requested_X.sum()) - target) <= 0.02
    assert float(st.kept_E.max() / st.kept_E.mean()) < 1.25  # unsteered: 3.6 in the test above


def test_noop_budget_sets_the_nominal_assignments():
    cfg = TokenChoiceConfig(d_model=D, num_experts=4, num_noop=4, top_k=2, bias_balance=True, noop_target=0.75)
    assert cfg.assignments(100) == pytest.approx(100 * 2 * 0.25)
    assert cfg.target_shares() == [0.0625] * 4 + [0.1875] * 4


# ---------------------------------------------------------------------------------- device-limited routing


def test_a_token_chooses_inside_its_best_groups_only():
    """16 experts in 4 groups (one per expert-parallel rank of 4, contiguous like the dispatcher's shards),
    each token keeps 2 groups: its rows travel to at most 2 ranks; the group scores are the sum of each
    group's two best (biased) scores."""
    torch.manual_seed(0)
    r = router(num_experts=16, top_k=4, gate="sigmoid", n_group=4, topk_group=2, bias_balance=True)
    with torch.no_grad():
        r.bias_X.normal_(0, 0.1)
    x = torch.randn(B, S, D)
    plan = r(x)
    ranks_T: dict[int, set] = {}
    for t, e in zip(plan.token_idx_A.tolist(), plan.expert_idx_A.tolist()):
        ranks_T.setdefault(t, set()).add(e // 4)
    assert max(len(v) for v in ranks_T.values()) == 2 and len(ranks_T) == B * S
    free = router(num_experts=16, top_k=4, gate="sigmoid")
    free.load_state_dict({"weight": r.weight.detach()})
    reach = [len({e // 4 for (tt, e) in chosen_and_gates(free, x) if tt == t}) for t in range(B * S)]
    assert max(reach) > 2  # without the limit some tokens do reach 3 or 4 ranks
    scores_TX = (x.reshape(-1, D) @ r.weight.t()).sigmoid() + r.bias_X
    best_G = scores_TX.view(-1, 4, 4).topk(2, dim=-1).values.sum(-1).topk(2, dim=-1).indices
    for t, groups in ranks_T.items():
        assert groups <= set(best_G[t].tolist())


def test_routed_scaling_factor_multiplies_the_renormalised_gates():
    torch.manual_seed(0)
    x = torch.randn(B, S, D)
    plain, scaled = router(gate="sigmoid", renormalize=True), router(gate="sigmoid", renormalize=True, scale=2.5)
    scaled.load_state_dict(plain.state_dict())
    a, b = chosen_and_gates(plain, x), chosen_and_gates(scaled, x)
    assert a.keys() == b.keys()
    for k in a:
        assert b[k] == pytest.approx(2.5 * a[k], rel=1e-6)


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(n_group=3), r"n_group=3: must divide num_experts=4"),
        (dict(n_group=2, topk_group=3), r"topk_group=3: must be <= n_group=2"),
        (
            dict(num_experts=8, n_group=4, topk_group=1, top_k=3),
            r"top_k=3: must be <= the slots a token can choose "
            r"from, topk_group \* num_experts / n_group \+ num_noop = 2",
        ),
        (dict(noop_target=0.5, num_noop=2), r"noop_target=0.5: needs bias_balance=True and num_noop >= 1"),
        (dict(noop_target=0.5, bias_balance=True), r"noop_target=0.5: needs bias_balance=True and num_noop >= 1"),
        (dict(noop_target=1.0, bias_balance=True, num_noop=2), r"noop_target=1.0: must be in \(0, 1\)"),
        (dict(bias_rate=0.0, bias_balance=True), r"bias_rate=0.0: must be finite and > 0"),
        (dict(scale=-1.0), r"scale=-1.0: must be finite and > 0"),
        (dict(balance_scope="rank"), r"balance_scope='rank'"),
    ],
)
def test_recipe_options_are_checked(kw, msg):
    with pytest.raises(ValueError, match=msg):
        TokenChoiceConfig(**{**dict(d_model=D, num_experts=4, top_k=2), **kw})


# ------------------------------------------------------------------------------------ balance-loss scopes


def test_sequence_wise_balance_loss_is_the_mean_of_each_sequences_loss():
    torch.manual_seed(0)
    r = router(balance_scope="sequence", balance_coef=1.0)
    x = torch.randn(B, S, D)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1, 5:] = False
    mask[3] = False  # a sequence of padding only: not part of the mean
    loss = r(x, mask).aux.losses["balance"]
    probs_TX = (x.reshape(-1, D) @ r.weight.t()).softmax(-1).view(B, S, -1)
    chosen = probs_TX.topk(2, dim=-1).indices
    by_hand = [load_balancing_loss(probs_TX[b][mask[b]], chosen[b][mask[b]]) for b in range(3)]
    torch.testing.assert_close(loss, torch.stack(by_hand).mean())


def test_global_balance_loss_over_ranks_equals_one_process_on_the_whole_batch():
    """Two ranks, simulated in one process: each rank's loss uses the choice counts of both (what
    ``reduce_counts`` sums over the mesh) and its own probabilities; their mean is the loss of one router on
    the whole batch, and so is its gradient."""
    torch.manual_seed(0)
    one = router(balance_scope="global", balance_coef=1.0)
    x = torch.randn(2 * B, S, D)
    loss_one = one(x).aux.losses["balance"]
    (g_one,) = torch.autograd.grad(loss_one, one.weight)

    halves = x.chunk(2)
    with torch.no_grad():  # what each rank would send: its choice counts and its token count
        sent = [
            torch.cat([one(h).aux.stats["router"].requested_X.float(), torch.tensor([float(h.shape[0] * S)])])
            for h in halves
        ]
    one.reduce_counts = lambda t: sum(sent)  # the all-reduce of both ranks' counts
    per_rank = [one(h).aux.losses["balance"] for h in halves]
    loss_ranks = torch.stack(per_rank).mean()
    (g_ranks,) = torch.autograd.grad(loss_ranks, one.weight)
    torch.testing.assert_close(loss_ranks, loss_one)
    torch.testing.assert_close(g_ranks, g_one)
    one.reduce_counts = None  # "batch" per rank: not the same loss
    assert not torch.allclose(torch.stack([one(h).aux.losses["balance"] for h in halves]).mean(), loss_one)


# --------------------------------------------------------------------------------------- shared experts


@pytest.mark.parametrize("gated", [False, True])
def test_shared_experts_add_an_mlp_of_every_token_to_the_routed_output(gated):
    torch.manual_seed(0)
    cfg = MoEConfig(D, H, num_experts=4, top_k=2, num_noop=2, num_shared=2, shared_gate=gated, activation="swiglu")
    layer = IntegratedMoDE.from_config(cfg)
    assert layer.shared_experts.w_out_HD.shape == (2 * H, D)  # num_shared * d_hidden
    routed = IntegratedMoDE(layer.router, layer.experts)
    x = torch.randn(B, S, D)
    shared, _ = layer.shared_experts(x)
    if gated:
        shared = torch.sigmoid(x @ layer.shared_gate.weight.t()) * shared
    torch.testing.assert_close(layer(x)[0], routed(x)[0] + shared)


def test_shared_experts_keep_the_routed_layers_random_draws():
    """Built after the routed layer: a seeded MoE layer gets the same router and experts with or without them."""
    torch.manual_seed(0)
    plain = MoELayer.from_config(MoEConfig(D, H, num_experts=4))
    torch.manual_seed(0)
    shared = MoELayer.from_config(MoEConfig(D, H, num_experts=4, num_shared=1))
    for name, p in plain.named_parameters():
        assert torch.equal(p, dict(shared.named_parameters())[name]), name


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(num_shared=-1), r"num_shared=-1: must be >= 0"),
        (dict(shared_gate=True), r"shared_hidden=None, shared_gate=True: need num_shared >= 1"),
        (dict(shared_hidden=8), r"shared_hidden=8, shared_gate=False: need num_shared >= 1"),
    ],
)
def test_shared_expert_options_are_checked(kw, msg):
    with pytest.raises(ValueError, match=msg):
        MoEConfig(D, H, **kw)

"""The lean hot path computes what the routers computed before it (tests/core/legacy: a frozen copy of them).

What changed: routing statistics are computed on first read; a router's balance and z losses are formed as one
pre-weighted scalar (the raw losses computed on first read); the finite check rides on that scalar; a dropless
plan comes from one stable sort; the bank applies the gates inside its fused SwiGLU. What must not change: the
plans, the raw losses and every statistic, bit for bit (the same arithmetic); the layers' outputs bit for bit (the
same plans through the same bank); ``aux.total()`` and the gradients up to float32 rounding (the objective is
summed in another order), judged against float64.
"""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/core/legacy as the package "legacy"

from legacy import (
    expert_choice as old_ec,
    mod_topk as old_mod,
    token_choice as old_tc,
)

from mode import MLP, MoD, MoELayer, TransformerBlock
from mode.experts.bank import ExpertBank, ExpertConfig
from mode.routing.expert_choice import ExpertChoiceConfig, ExpertChoiceRouter
from mode.routing.mod_topk import MoDRouter, MoDRouterConfig
from mode.routing.token_choice import TokenChoiceConfig, TokenChoiceRouter

B, S, D, E = 2, 12, 16, 4
STAT_FIELDS = (
    "kept_E",
    "requested_X",
    "dropped",
    "noop",
    "tokens",
    "compute_T",
    "entropy",
    "batch_shape",
    "causal_accuracy",
)

TOKEN_CHOICE = {
    "dropless_top2": dict(top_k=2),
    "dropless_top1": dict(top_k=1),
    "renormalized_scaled": dict(top_k=2, renormalize=True, scale=2.5),
    "sigmoid": dict(top_k=2, gate="sigmoid", renormalize=True),
    "sqrtsoftplus": dict(top_k=2, gate="sqrtsoftplus", renormalize=True),
    "capacity": dict(top_k=2, capacity_factor=0.75),
    "noop": dict(top_k=2, num_noop=2),
    "sequence_scope": dict(top_k=2, balance_scope="sequence"),
    "global_scope_one_process": dict(top_k=2, balance_scope="global"),
    "bias_balance": dict(top_k=2, bias_balance=True, balance_coef=0.0),
    "group_limited": dict(top_k=2, n_group=2, topk_group=1),
    "no_z_loss": dict(top_k=2, z_coef=0.0),
    "no_losses": dict(top_k=2, z_coef=0.0, balance_coef=0.0),
    "softcap": dict(top_k=2, logit_softcap=3.0),
    "sparsemixer": dict(top_k=2, gate="sparsemixer", mixer_eps=0.1),
}


def _pair_token_choice(kw: dict):
    cfg = TokenChoiceConfig(d_model=D, num_experts=E, z_coef=kw.pop("z_coef", 0.1), **kw)
    new = TokenChoiceRouter(cfg)
    new_since_the_copy = ("fused_kernels", "surplus_from_dropped")  # the copy computes them as their defaults do
    assert not cfg.surplus_from_dropped
    old_fields = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in new_since_the_copy}
    old = old_tc.TokenChoiceRouter(old_tc.TokenChoiceConfig(**old_fields))
    old.load_state_dict(new.state_dict())
    return new, old


def _same_stats(new, old) -> None:
    for name in STAT_FIELDS:
        a, b = getattr(new, name), getattr(old, name)
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), name
        else:
            assert a == b, name


def _same_plan(new, old) -> None:
    for name in ("token_idx_A", "expert_idx_A", "counts_E", "weight_A"):
        a, b = getattr(new, name), getattr(old, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert new.padded == old.padded and new.num_tokens == old.num_tokens


def _total_close(new, old) -> None:
    """The pre-weighted objective against the old sum of coef * loss, recomputed in float64 from the raw losses."""
    want = sum(old.coefs[k] * old.losses[k].double() for k in old.losses)
    got = new.total()
    assert got.dtype == torch.float32
    assert abs(float(got.detach()) - float(want.detach())) <= 1e-6 * max(1.0, abs(float(want.detach())))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "composed"])
@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "mask"])
@pytest.mark.parametrize("case", list(TOKEN_CHOICE))
def test_token_choice_router_matches_the_old_one(case, masked, fused):
    """Both router paths (``mode.kernels.router_topk`` where the configuration allows it, and the composed torch
    ops) against the frozen copy."""
    torch.manual_seed(0)
    new, old = _pair_token_choice(dict(TOKEN_CHOICE[case], fused_kernels=fused))
    assert new._fused == (fused and new.cfg.fusable)
    new.train(), old.train()
    x = torch.randn(B, S, D)
    mask = None
    if masked:
        mask = torch.ones(B, S, dtype=torch.bool)
        mask[1, 7:] = False
    x_new, x_old = x.clone().requires_grad_(), x.clone().requires_grad_()
    p_new, p_old = new(x_new, mask), old(x_old, mask)
    _same_plan(p_new, p_old)
    _same_stats(p_new.aux.stats["router"], p_old.aux.stats["router"])
    assert list(p_new.aux.losses) == list(p_old.aux.losses) and p_new.aux.coefs == p_old.aux.coefs
    for k in p_old.aux.losses:  # the raw losses, read after the fact, are the old values bit for bit
        assert torch.equal(p_new.aux.losses[k], p_old.aux.losses[k]), k
    _total_close(p_new.aux, p_old.aux)
    if case == "bias_balance":
        assert torch.equal(new.load_X, old.load_X)
    # gradients of the gates and the objective together: float32 rounding of a sum taken in another order
    g_A = torch.randn(p_new.weight_A.shape)
    for p, _x in ((p_new, x_new), (p_old, x_old)):
        ((p.weight_A * g_A).sum() + p.aux.total()).backward()
    scale = max(1.0, float(old.weight.grad.abs().max()))
    torch.testing.assert_close(new.weight.grad, old.weight.grad, rtol=1e-5, atol=1e-6 * scale)
    torch.testing.assert_close(x_new.grad, x_old.grad, rtol=1e-5, atol=1e-6 * max(1.0, float(x_old.grad.abs().max())))


def test_raw_losses_stay_lazy_until_read_and_keep_their_gradient():
    torch.manual_seed(0)
    new, _ = _pair_token_choice(dict(top_k=2))
    aux = new(torch.randn(B, S, D)).aux
    assert aux.losses.is_lazy("balance") and aux.losses.is_lazy("z_loss")
    assert len(aux.weighted) == 1 and aux.total() is aux.weighted[0]  # one layer: total() adds nothing
    assert aux.losses["balance"].requires_grad and not aux.losses.is_lazy("balance")
    merged = type(aux)().merge(aux, "layers.0.moe.")
    assert merged.losses.is_lazy("layers.0.moe.z_loss")
    assert torch.equal(merged.losses["layers.0.moe.z_loss"], aux.losses["z_loss"])
    assert torch.equal(merged.total(), aux.total())


def test_stats_are_computed_only_when_read():
    """A training step that does not read the statistics launches none of their operators."""
    from mode.measure.op_count import OpCounter

    torch.manual_seed(0)
    new, _ = _pair_token_choice(dict(top_k=2))
    plan = new(torch.randn(B, S, D))
    with OpCounter() as ops:
        plan.aux.stats["router"].kept_E  # noqa: B018 - the access is what is counted (a lazy property)
    assert ops.count == 1  # kept_E alone: one cast
    with OpCounter() as ops:
        plan.aux.stats["router"].kept_E  # noqa: B018 - the access is what is counted (a lazy property)
    assert ops.count == 0  # computed once


@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "mask"])
def test_expert_choice_router_matches_the_old_one(masked):
    torch.manual_seed(0)
    cfg = ExpertChoiceConfig(d_model=D, num_experts=E, num_noop=1, capacity_factor=1.0, z_coef=0.1)
    new = ExpertChoiceRouter(cfg)
    old = old_ec.ExpertChoiceRouter(old_ec.ExpertChoiceConfig(**dataclasses.asdict(cfg)))
    old.load_state_dict(new.state_dict())
    x = torch.randn(B, S, D)
    mask = None
    if masked:
        mask = torch.ones(B, S, dtype=torch.bool)
        mask[0, 9:] = False
    p_new, p_old = new(x, mask), old(x, mask)
    _same_plan(p_new, p_old)
    _same_stats(p_new.aux.stats["router"], p_old.aux.stats["router"])
    assert torch.equal(p_new.aux.losses["z_loss"], p_old.aux.losses["z_loss"])
    _total_close(p_new.aux, p_old.aux)


@pytest.mark.parametrize(
    "kw", [dict(), dict(gate="sigmoid"), dict(causal="aux_bce")], ids=["raw", "sigmoid", "aux_bce"]
)
@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "mask"])
def test_mod_router_and_block_match_the_old_ones(kw, masked):
    torch.manual_seed(0)
    cfg = MoDRouterConfig(d_model=D, capacity=0.25, **kw)
    new = MoDRouter(cfg)
    old = old_mod.MoDRouter(old_mod.MoDRouterConfig(**dataclasses.asdict(cfg)))
    old.load_state_dict(new.state_dict())
    x = torch.randn(B, S, D)
    mask = None
    if masked:
        mask = torch.ones(B, S, dtype=torch.bool)
        mask[1, 5:] = False
    p_new, p_old = new(x, mask), old(x, mask)
    _same_plan(p_new, p_old)
    assert torch.equal(p_new.seq_pos_BC, p_new.token_idx_A.view(B, -1) - torch.arange(B)[:, None] * S)
    _same_stats(p_new.aux.stats["router"], p_old.aux.stats["router"])
    assert list(p_new.aux.losses) == list(p_old.aux.losses)
    for k in p_old.aux.losses:
        assert torch.equal(p_new.aux.losses[k], p_old.aux.losses[k]), k

    # the block: the same output and gradients bit for bit (the plan's positions come with it now)
    block = TransformerBlock(D, 2, MLP(D, 32))
    lay_new = MoD(block, new)
    lay_old = MoD(TransformerBlock(D, 2, MLP(D, 32)), MoDRouter(cfg))
    lay_old.load_state_dict(lay_new.state_dict())
    lay_old.router.forward = lambda x_, m_=None, causal=False, **kw: _as_new_plan(old(x_, m_))
    old.load_state_dict(lay_old.router.state_dict())
    x_new, x_old = x.clone().requires_grad_(), x.clone().requires_grad_()
    (y_new, a_new), (y_old, a_old) = lay_new(x_new, mask), lay_old(x_old, mask)
    assert torch.equal(y_new, y_old)
    g = torch.randn_like(y_new)
    ((y_new * g).sum() + a_new.total()).backward()
    ((y_old * g).sum() + a_old.total()).backward()
    assert torch.equal(x_new.grad, x_old.grad)
    grads_old = {n: p.grad for n, p in lay_old.block.named_parameters()}
    for n, p in lay_new.block.named_parameters():
        assert torch.equal(p.grad, grads_old[n]), n


class _OldRouter(torch.nn.Module):
    """An old router whose plans the new layers read (``_as_new_plan``)."""

    def __init__(self, router):
        super().__init__()
        self.inner = router
        self.num_experts, self.num_slots, self.cfg = router.num_experts, router.num_slots, router.cfg

    def forward(self, x_BSD, mask_BS=None):
        return _as_new_plan(self.inner(x_BSD, mask_BS))


def _as_new_plan(plan):
    """An old plan with the new ``Aux`` (the same losses and stats) and no ``seq_pos_BC`` (the MoD layer then
    derives the positions itself, as it did)."""
    from mode.routing.plan import Aux, RoutingPlan

    aux = Aux()
    for k in plan.aux.losses:
        aux.add_loss(k, plan.aux.losses[k], plan.aux.coefs[k])
    aux.stats.update(plan.aux.stats)
    fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan) if f.name != "aux"}
    return RoutingPlan(aux=aux, **fields)


@pytest.mark.parametrize("case", ["dropless_top2", "noop", "capacity"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_moe_layer_matches_the_old_router_through_the_same_bank(case, dtype):
    """The same plan through the same experts: the output and the experts' gradients bit for bit; the router's
    gradient (which the objective's rounding reaches) to float32 rounding."""
    torch.manual_seed(0)
    new_router, old_router = _pair_token_choice(dict(TOKEN_CHOICE[case]))
    bank = ExpertBank(ExpertConfig(d_model=D, d_hidden=32, num_experts=E, activation="swiglu", backend="grouped"))
    bank_old = ExpertBank(bank.cfg)
    bank_old.load_state_dict(bank.state_dict())
    lay_new, lay_old = MoELayer(new_router, bank), MoELayer(_OldRouter(old_router), bank_old)
    x = torch.randn(B, S, D)
    x_new, x_old = x.clone().requires_grad_(), x.clone().requires_grad_()
    amp = dict(device_type="cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
    with torch.autocast(**amp):
        (y_new, a_new), (y_old, a_old) = lay_new(x_new), lay_old(x_old)
    assert torch.equal(y_new, y_old)
    g = torch.randn_like(y_new)
    ((y_new * g).float().sum() + a_new.total()).backward()
    ((y_old * g).float().sum() + a_old.total()).backward()
    for name in ("w_in_EDF", "w_out_EHD"):
        assert torch.equal(getattr(bank, name).grad, getattr(bank_old, name).grad), name
    scale = max(1.0, float(old_router.weight.grad.abs().max()))
    torch.testing.assert_close(new_router.weight.grad, old_router.weight.grad, rtol=1e-5, atol=1e-6 * scale)

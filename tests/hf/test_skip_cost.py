"""``mode.hf.skip_costs``: the loss a layer costs when every token skips its attention, MLP or whole layer."""

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from mod_models import FAMILIES, V, batch, tiny

# Zeroing what the part adds to the residual stream, by hand: the model the hooks must reproduce.
ZEROED = {"attention": ("self_attn.o_proj",), "mlp": ("mlp.down_proj",), "layer": ("self_attn.o_proj", "mlp.down_proj")}


def loss_of(hf, model, batches):
    return hf.dense.skip_cost._mean_loss(model, batches)


def batches_for(seed=0, left_pad=3):
    torch.manual_seed(seed)
    ids, mask = batch(B=2, S=16, left_pad=left_pad)
    return [{"input_ids": ids, "attention_mask": mask}, torch.randint(1, V, (3, 10))]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("part", ("attention", "mlp", "layer"))
def test_cost_equals_the_model_with_the_part_zeroed_by_hand(hf, family, part):
    torch.manual_seed(0)
    model = tiny(family, layers=3)
    data = batches_for()
    costs = hf.skip_costs(model, data, part=part)
    assert sorted(costs) == [0, 1, 2]
    base = loss_of(hf, model, data)
    for i, cost in costs.items():
        by_hand = copy.deepcopy(model)
        for name in ZEROED[part]:
            by_hand.model.layers[i].get_submodule(name).weight.data.zero_()
        assert cost == pytest.approx(loss_of(hf, by_hand, data) - base, abs=1e-6)
        assert cost != 0.0  # a random layer's part matters


def test_a_part_that_adds_nothing_costs_nothing(hf):
    torch.manual_seed(1)
    model = tiny("llama", layers=3)
    model.model.layers[1].self_attn.o_proj.weight.data.zero_()
    model.model.layers[2].mlp.down_proj.weight.data.zero_()
    data = batches_for(1)
    assert hf.skip_costs(model, data, part="attention")[1] == 0.0
    assert hf.skip_costs(model, data, part="mlp")[2] == 0.0
    assert hf.skip_costs(model, data, part="mlp", layers=[0, 1])[1] != 0.0


def test_the_model_is_left_as_it_was(hf):
    torch.manual_seed(2)
    model = tiny("qwen2", layers=3).train()
    ids = torch.randint(1, V, (2, 9))
    with torch.no_grad():
        before = model(ids).logits
    hf.skip_costs(model, [ids], part="layer", layers=[0, 2])
    assert model.training
    assert all(not m._forward_hooks for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_padding_is_not_counted(hf):
    """A row's left padding changes no cost: the padded batch equals its real tokens alone."""
    torch.manual_seed(3)
    model = tiny("mistral", layers=2)
    ids, mask = batch(B=2, S=12, left_pad=4)
    padded = hf.skip_costs(model, [{"input_ids": ids, "attention_mask": mask}])
    alone = hf.skip_costs(model, [ids[:1], ids[1:, 4:]])  # weighted by target tokens: 11 and 7
    for i in padded:
        assert padded[i] == pytest.approx(alone[i], abs=1e-5)


def test_cheapest_and_bad_input(hf):
    assert hf.cheapest({0: 0.5, 1: 0.1, 2: 0.3, 3: 0.1}, 2) == [1, 3]
    assert hf.cheapest({5: 1.0, 3: 2.0}, 2) == [3, 5]
    with pytest.raises(ValueError, match="k=3"):
        hf.cheapest({0: 0.5, 1: 0.1}, 3)
    with pytest.raises(ValueError, match="k"):
        hf.cheapest({0: 0.5}, 0)
    model = tiny("llama", layers=2)
    with pytest.raises(ValueError, match="part"):
        hf.skip_costs(model, [torch.randint(1, V, (1, 5))], part="heads")
    with pytest.raises(ValueError, match="batches"):
        hf.skip_costs(model, [])
    with pytest.raises(ValueError, match="index 2"):
        hf.skip_costs(model, [torch.randint(1, V, (1, 5))], layers=[2])
    with pytest.raises(ValueError, match="target token"):
        hf.skip_costs(model, [torch.randint(1, V, (2, 1))])


@pytest.mark.parametrize("family", ("llama", "qwen2"))
def test_cost_with_the_estimate_equals_deleting_the_layer_with_its_estimate_by_hand(hf, family):
    """``estimate_rank=R``: each layer's cost is the loss of the model with that layer deleted and its fitted
    rank-R estimate in its place (``delete_layers`` with ``layer_estimates``, the pruning mechanics)."""
    from mode.hf.dense.layer_io import layer_estimates
    from mode.hf.dense.prune import delete_layers

    torch.manual_seed(3)
    model = tiny(family, layers=3)
    data, fit = batches_for(3), batches_for(4, left_pad=5)
    costs = hf.skip_costs(model, data, part="layer", estimate_rank=4, fit_batches=fit)
    base = loss_of(hf, model, data)
    for i, cost in costs.items():
        by_hand = copy.deepcopy(model)
        delete_layers(by_hand, [i], layer_estimates(model, fit, [i], 4))
        assert cost == pytest.approx(loss_of(hf, by_hand, data) - base, abs=1e-6), i
    plain = hf.skip_costs(model, data, part="layer")
    assert costs != plain


def _linear_layer(model, i, rank=2, scale=3.0, seed=0):
    """Layer ``i`` made an affine map of its input of rank ``rank`` (a forward hook replaces its output): the
    update an estimate of that rank recovers exactly, and a large one, so skipping the layer costs much."""
    g = torch.Generator().manual_seed(seed)
    D = model.config.hidden_size
    w_DD = scale * torch.randn(D, rank, generator=g) @ torch.randn(rank, D, generator=g) / D

    def hook(module, args, kwargs, output):
        x_BSD = args[0] if args else kwargs["hidden_states"]
        y_BSD = x_BSD + x_BSD @ w_DD
        return (y_BSD,) + output[1:] if isinstance(output, tuple) else y_BSD

    return model.model.layers[i].register_forward_hook(hook, with_kwargs=True)


def test_a_layer_its_estimate_predicts_costs_nearly_nothing_with_it(hf):
    """A random model's layers cost little and at random (some costs are negative); a planted affine layer costs
    much skipped outright and almost nothing with its estimate. ``prune_layers(by="skip_cost", estimate_rank)``
    deletes the layers those costs rank cheapest."""
    torch.manual_seed(6)
    model = tiny("llama", layers=4, initializer_range=0.1)  # large enough weights that the layers matter
    _linear_layer(model, 2, scale=10.0)
    data = batches_for(6)
    plain = hf.skip_costs(model, data, part="layer")
    with_est = hf.skip_costs(model, data, part="layer", estimate_rank=2)
    assert plain[2] > 0.1, plain  # measured 0.207
    assert abs(with_est[2]) < 0.1 * plain[2], (with_est, plain)  # measured -0.008
    for n in (1, 2):
        want = sorted(sorted(with_est, key=with_est.get)[:n])
        assert hf.prune_layers(copy.deepcopy(model), n, "skip_cost", data, estimate_rank=2) == want
    given = {i: -c for i, c in with_est.items()}  # scores measured before: used, not measured again
    assert hf.prune_layers(copy.deepcopy(model), 1, "skip_cost", data, 2, scores=given) == [
        max(with_est, key=with_est.get)
    ]
    with pytest.raises(ValueError, match="scores: has layers \\[0, 1\\]"):
        hf.prune_layers(copy.deepcopy(model), 1, "skip_cost", data, 2, scores={0: 0.0, 1: 1.0})


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("part", ("attention", "mlp"))
def test_a_halfs_cost_with_its_estimate_is_the_conversion_with_nothing_routed(hf, family, part):
    """``estimate_rank=R`` for a half: its cost is the loss of ``to_mod(part=..., skip_rank=R)`` on that layer
    with every token skipping (threshold +inf, causal routing) and the fitted estimate in its ``mod_skip``: what
    the conversion leaves for a skipped token. The estimate is fitted on the stream ``router_fit`` fits the
    layer's ``mod_skip`` on (the same data: the same estimate)."""
    from mode.hf.dense.layer_io import layer_estimates
    from mode.hf.dense.router_fit import _collect

    torch.manual_seed(5)
    model = tiny(family, layers=3, initializer_range=0.1)
    data, fit = batches_for(5), batches_for(6, left_pad=4)
    costs = hf.skip_costs(model, data, part=part, estimate_rank=3, fit_batches=fit)
    plain = hf.skip_costs(model, data, part=part)
    base = loss_of(hf, model, data)
    for i, cost in costs.items():
        (est,) = layer_estimates(model, fit, [i], 3, part).values()
        mod = hf.to_mod(copy.deepcopy(model), layers=[i], part=part, causal="threshold", skip_rank=3, capacity=0.5)
        layer = mod.model.layers[i]
        f_ND, _, u_ND, _ = _collect(mod, fit, {i: layer})[i]
        by_collect = copy.deepcopy(est)
        by_collect.fit(f_ND, u_ND)  # router_fit's stream and update for this part, every token
        with torch.no_grad():  # the map each applies (an SVD factor's sign is free: down and up alone may flip)
            torch.testing.assert_close(by_collect(f_ND[None]), est(f_ND[None]), rtol=1e-4, atol=1e-5)
        layer.mod_skip.load_state_dict(est.state_dict())
        layer.mod_router.threshold.fill_(float("inf"))  # no token passes: every token skips the part
        with hf.routing(mod, "causal"):
            assert cost == pytest.approx(loss_of(hf, mod, data) - base, abs=1e-5), (i, part)
        assert cost != pytest.approx(plain[i], abs=1e-4), (i, part)  # the estimate changed what skipping costs


@pytest.mark.parametrize("part", ("attention", "mlp"))
def test_a_halfs_estimate_is_fitted_on_the_stream_it_reads_and_the_update_it_adds(hf, part):
    """``layer_estimates(part=...)`` regresses the half's output on what the half reads from the residual stream:
    the decoder layer's input for the attention, the stream after the attention (the post-attention norm's
    input) for the MLP, both seen here by hooks of the test's own; its estimate equals one fitted by hand on
    them, and differs from one fitted on the other half's stream."""
    from mode.hf.dense.layer_io import layer_estimates
    from mode.hf.dense.skip_update import SkipUpdate

    torch.manual_seed(8)
    model = tiny("llama", layers=3)
    layer, seen = model.model.layers[1], {}
    D = model.config.hidden_size

    def reads(name):
        def hook(module, args, kwargs):
            seen.setdefault(name, []).append((args[0] if args else kwargs["hidden_states"]).flatten(0, 1))

        return hook

    layer.register_forward_pre_hook(reads("layer input"), with_kwargs=True)
    layer.post_attention_layernorm.register_forward_pre_hook(reads("after attention"), with_kwargs=True)
    layer.self_attn.register_forward_hook(
        lambda m, a, out: seen.setdefault("attention", []).append(out[0].flatten(0, 1))
    )
    layer.mlp.register_forward_hook(lambda m, a, out: seen.setdefault("mlp", []).append(out.flatten(0, 1)))
    fit = [torch.randint(1, V, (4, 24)), torch.randint(1, V, (2, 16))]  # no padding: every token is real
    (est,) = layer_estimates(model, fit, [1], 3, part).values()
    stream = "layer input" if part == "attention" else "after attention"
    cat = {k: torch.cat(v) for k, v in seen.items()}
    by_hand, other = SkipUpdate(D, 3), SkipUpdate(D, 3)
    by_hand.fit(cat[stream], cat[part])
    other.fit(cat["after attention" if part == "attention" else "layer input"], cat[part])
    with torch.no_grad():  # the map each applies (an SVD factor's sign is free: down and up alone may flip)
        torch.testing.assert_close(est(cat[stream][None]), by_hand(cat[stream][None]), rtol=1e-4, atol=1e-5)
    w_DD, w_other_DD = (est.down @ est.up).detach(), (other.down @ other.up).detach()
    assert float((w_DD - w_other_DD).norm() / w_DD.norm()) > 0.5  # measured 0.92 (attention), 0.74 (mlp)


def test_the_estimate_needs_fit_batches_and_a_valid_rank(hf):
    model = tiny("llama", layers=2)
    data = batches_for()
    with pytest.raises(ValueError, match="fit_batches: empty"):
        hf.skip_costs(model, data, part="layer", estimate_rank=4, fit_batches=[])
    with pytest.raises(ValueError, match="fit_batches: empty"):
        hf.skip_costs(model, data, part="attention", estimate_rank=4, fit_batches=[])
    with pytest.raises(ValueError, match="skip_rank=65"):
        hf.skip_costs(model, data, part="mlp", estimate_rank=65)

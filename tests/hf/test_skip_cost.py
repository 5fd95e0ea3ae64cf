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


def test_the_estimate_is_for_whole_layers_and_needs_fit_batches(hf):
    model = tiny("llama", layers=2)
    data = batches_for()
    with pytest.raises(ValueError, match="estimate_rank=4 with part='mlp'"):
        hf.skip_costs(model, data, part="mlp", estimate_rank=4)
    with pytest.raises(ValueError, match="fit_batches: empty"):
        hf.skip_costs(model, data, part="layer", estimate_rank=4, fit_batches=[])
    with pytest.raises(ValueError, match="skip_rank=65"):
        hf.skip_costs(model, data, part="layer", estimate_rank=65)

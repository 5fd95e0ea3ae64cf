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

"""``convert_to_macs`` and ``mode convert`` on tiny random decoders: the MACs reached are within 1% of the target
(MoD) or the nearest whole-layer count (pruning), healing is reported and merged, bad settings are refused with
the field named, and the command's folder loads back onto the original with the losses it reported."""

import copy
import json
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from mod_models import V, tiny

S = 64


def _windows(n: int = 6, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, V, (4, S), generator=g) for _ in range(n)]


def _original(layers: int = 8):
    torch.manual_seed(0)
    return tiny("llama", layers=layers, initializer_range=0.1)


@pytest.mark.parametrize("part", ("layer", "mlp"))
def test_mod_reaches_the_target_macs(hf, part):
    model = _original()
    result = hf.convert_to_macs(model, hf.BudgetConfig(0.8, seq_len=S, part=part), _windows())
    assert abs(result.macs - 0.8) <= 0.01 * 0.8, result
    assert result.macs == pytest.approx(hf.conversion_macs(model, S))
    assert sorted(hf.mod_layers(model)) == result.layers and result.capacity is not None
    assert result.heal is None and "router_fit" in result.seconds and "skip_costs" in result.seconds


def test_a_mixed_conversion_reaches_the_target_and_loads_back(hf, tmp_path):
    """part="mixed": attention halves in some layers, MLP halves in others, ranked by ``mixed_order`` from the
    skip costs of both halves; the MACs are within 1% and the saved folder loads back to the same logits."""
    data = _windows()
    model = _original()
    costs = {half: hf.skip_costs(model, data[:1], half) for half in ("attention", "mlp")}
    order = hf.mixed_order(model, costs, S)
    original = copy.deepcopy(model)
    result = hf.convert_to_macs(model, hf.BudgetConfig(0.8, seq_len=S, part="mixed", min_capacity=0.25), data)
    assert abs(result.macs - 0.8) <= 0.01 * 0.8, result
    assert result.part == "mixed" and sorted(result.parts) == result.layers == sorted(hf.mod_layers(model))
    assert {i: layer.mod_part for i, layer in hf.mod_layers(model).items()} == result.parts
    assert set(result.parts.values()) <= {"attention", "mlp", "layer"}
    halves = [(i, h) for i, p in result.parts.items() for h in (("attention", "mlp") if p == "layer" else (p,))]
    assert sorted(halves) == sorted(order[: len(halves)])  # the cheapest units per MAC, as ranked
    json.dumps(result.to_dict())
    hf.save_conversion(model, tmp_path)
    back = hf.load_conversion(original, tmp_path)
    with torch.no_grad():
        assert torch.equal(model.eval()(data[0]).logits, back.eval()(data[0]).logits)


def test_mod_order_by_skip_cost_takes_the_cheapest_layers(hf):
    data = _windows()
    model = _original()
    costs = hf.skip_costs(model, data[:1], "layer")
    result = hf.convert_to_macs(model, hf.BudgetConfig(0.8, seq_len=S), data)
    assert result.layers == sorted(sorted(costs, key=lambda i: (costs[i], i))[: len(result.layers)])


def test_with_an_estimate_the_order_is_the_skip_cost_with_the_estimate(hf):
    """part "layer" with ``skip_rank``: the layers ordered by what skipping each costs with its fitted estimate
    standing in (fitted on the fit batches), the routers fitted with ``router_label``."""
    data = _windows()
    model = _original()
    costs = hf.skip_costs(model, data[:1], "layer", estimate_rank=4, fit_batches=data)
    cfg = hf.BudgetConfig(0.8, seq_len=S, skip_rank=4, router_label="residual", min_capacity=0.25)
    result = hf.convert_to_macs(model, cfg, data)
    assert result.layers == sorted(sorted(costs, key=lambda i: (costs[i], i))[: len(result.layers)])
    assert abs(result.macs - 0.8) <= 0.01 * 0.8, result
    plain = hf.skip_costs(_original(), data[:1], "layer")
    assert sorted(costs, key=costs.get) != sorted(plain, key=plain.get)  # the estimate changes the order here
    by_update = _original()  # the same plan fitted with the default label: other routers
    hf.convert_to_macs(by_update, hf.BudgetConfig(0.8, seq_len=S, skip_rank=4, min_capacity=0.25), data)
    i = result.layers[0]
    assert not torch.equal(by_update.model.layers[i].mod_router.weight, model.model.layers[i].mod_router.weight)


@pytest.mark.parametrize("part", ("mixed", "mlp"))
def test_with_an_estimate_the_halves_are_ranked_by_their_cost_with_it(hf, part):
    """With ``skip_rank`` an attention or MLP half is ranked, as a whole layer is, by what skipping it costs with
    its fitted estimate standing in (``skip_costs(part, estimate_rank=R)``): the mixed units are the first of
    ``mixed_order`` of those costs, the MLP layers the cheapest of them."""
    data = _windows()
    model = _original()
    halves = ("attention", "mlp") if part == "mixed" else (part,)
    costs = {h: hf.skip_costs(model, data[:1], h, estimate_rank=4, fit_batches=data) for h in halves}
    plain = {h: hf.skip_costs(model, data[:1], h) for h in halves}
    cfg = hf.BudgetConfig(0.85, seq_len=S, part=part, skip_rank=4, min_capacity=0.25)
    result = hf.convert_to_macs(model, cfg, data)
    assert abs(result.macs - 0.85) <= 0.01 * 0.85, result
    if part == "mixed":
        order, before = hf.mixed_order(model, costs, S, skip_rank=4), hf.mixed_order(model, plain, S, skip_rank=4)
        got = [(i, h) for i, p in result.parts.items() for h in (("attention", "mlp") if p == "layer" else (p,))]
        assert sorted(got) == sorted(order[: len(got)])
    else:
        order, before = (sorted(c, key=lambda i: (c[i], i)) for c in (costs[part], plain[part]))
        assert result.layers == sorted(order[: len(result.layers)])
    assert order != before  # the estimates change the ranking here


def test_prune_deletes_the_nearest_layer_count(hf):
    from mode.hf.dense.budget import layers_to_delete, pruned_macs

    model = _original()
    n = layers_to_delete(model, S, 0.8)
    gaps = [abs(pruned_macs(model, S, k) - 0.8) for k in range(1, 8)]
    assert gaps[n - 1] == min(gaps)
    result = hf.convert_to_macs(model, hf.BudgetConfig(0.8, method="prune", seq_len=S), _windows())
    assert len(result.layers) == n and result.capacity is None
    assert result.macs == pytest.approx(pruned_macs(_original(), S, n))
    assert len(model.model.layers) == 8 - n


@pytest.mark.parametrize("cost_batches", (1, 3))
def test_mod_and_pruning_measure_skip_costs_on_the_same_batches(hf, monkeypatch, cost_batches):
    """One cost rule (issue 70): with order / prune_by "skip_cost", both methods measure each layer's skip cost
    on the first ``cost_batches`` fit batches, with the estimate fitted on all of them; pruning deletes the
    layers those costs rank cheapest."""
    from mode.hf.dense import budget

    seen = {}

    def recording(model, batches, part="attention", *args, fit_batches=None, **kwargs):
        seen.setdefault(method, []).append(([id(b) for b in batches], [id(b) for b in fit_batches or []]))
        return original(model, batches, part, *args, fit_batches=fit_batches, **kwargs)

    original = budget.skip_costs
    monkeypatch.setattr(budget, "skip_costs", recording)
    data = _windows()
    for method in ("mod", "prune"):
        cfg = hf.BudgetConfig(
            0.8, method=method, seq_len=S, skip_rank=2, prune_by="skip_cost", cost_batches=cost_batches
        )
        result = hf.convert_to_macs(_original(), cfg, data)
        if method == "prune":
            costs = original(_original(), data[:cost_batches], "layer", estimate_rank=2, fit_batches=data)
            assert result.layers == sorted(sorted(costs, key=lambda i: (costs[i], i))[: len(result.layers)])
    expected = [([id(b) for b in data[:cost_batches]], [id(b) for b in data])]
    assert seen == {"mod": expected, "prune": expected}


@pytest.mark.parametrize("method", ("mod", "prune"))
def test_healed_conversion_saves_and_loads(hf, tmp_path, method):
    original = _original(layers=4)
    model = copy.deepcopy(original)
    data = _windows(4)
    heal = hf.HealConfig(steps=3, lr=1e-2, rank=2)
    cfg = hf.BudgetConfig(0.75, method=method, seq_len=S, skip_rank=2, heal=heal, min_capacity=0.25)
    result = hf.convert_to_macs(model, cfg, data)
    assert result.heal is not None and result.heal.steps == 3 and result.heal.tokens == 3 * 4 * S
    assert not any("lora" in n for n, _ in model.named_parameters())  # merged
    assert model.mode_conversion.get("healed")
    d = result.to_dict()
    assert d["heal"]["loss_first_last"] and "losses" not in d["heal"]
    json.dumps(d)
    hf.save_conversion(model, tmp_path)
    back = hf.load_conversion(copy.deepcopy(original), tmp_path)
    x = data[0]
    with torch.no_grad():
        assert torch.equal(model.eval()(x).logits, back.eval()(x).logits)


def test_a_heal_probe_sees_each_point_as_the_conversion_would_end_there_and_changes_nothing(hf):
    """heal_probe: called before healing and every probe_every steps (not the last: that is the result), each
    time with a copy that is what a conversion healed for that many steps would be (adapters merged, thresholds
    recalibrated: the same logits as a 2-step conversion at step 2); the probed conversion ends bit-equal to an
    unprobed one."""
    data = _windows(4)

    def convert(steps: int, probe=None):
        model = _original(layers=4)
        heal = hf.HealConfig(steps=steps, lr=1e-2, rank=2, seed=0)
        cfg = hf.BudgetConfig(0.75, seq_len=S, skip_rank=2, min_capacity=0.25, heal=heal)
        kw = {"heal_probe": probe, "probe_every": 2} if probe else {}
        result = hf.convert_to_macs(model, cfg, data, **kw)
        return model, result

    seen = {}

    def probe(step, snapshot):
        assert not any("lora" in n for n, _ in snapshot.named_parameters())  # merged
        with torch.no_grad():
            seen[step] = snapshot.eval()(data[0]).logits
        for p in snapshot.parameters():  # a copy: what the probe does to it stays there
            p.data.zero_()

    probed, result = convert(5, probe)
    plain, plain_result = convert(5)
    assert sorted(seen) == [0, 2, 4]
    assert all(torch.equal(a, b) for a, b in zip(probed.state_dict().values(), plain.state_dict().values()))
    assert result.heal.losses == plain_result.heal.losses and result.heal.data_digest == plain_result.heal.data_digest
    # step 2 of a 5-step heal is a 2-step heal (constant learning rate); the data of its first 2 steps is the same
    two, _ = convert(2)
    with torch.no_grad():
        assert torch.equal(seen[2], two.eval()(data[0]).logits)
    with pytest.raises(ValueError, match="cfg.heal is None"):
        hf.convert_to_macs(_original(layers=4), hf.BudgetConfig(0.75, seq_len=S), data, heal_probe=probe, probe_every=1)
    with pytest.raises(ValueError, match="probe_every=0"):
        convert_cfg = hf.BudgetConfig(0.75, seq_len=S, heal=hf.HealConfig(steps=2, rank=2))
        hf.convert_to_macs(_original(layers=4), convert_cfg, data, heal_probe=probe, probe_every=0)


def test_thresholds_are_set_on_the_calibration_batches(hf):
    """calibration_batches: the causal thresholds after router_fit, and again after healing, are those
    ``calibrate`` sets on them, not on the fit batches (which give other thresholds)."""
    data, other = _windows(4), _windows(3, seed=11)
    thresholds = {}
    for heal in (None, hf.HealConfig(steps=2, lr=1e-2, rank=2, seed=0)):
        runs = {}
        for cal in (None, other):
            model = _original(layers=4)
            cfg = hf.BudgetConfig(0.75, seq_len=S, skip_rank=2, min_capacity=0.25, heal=heal)
            hf.convert_to_macs(model, cfg, data, calibration_batches=cal)
            runs[cal is None] = model
        got = {i: float(layer.mod_router.threshold) for i, layer in hf.mod_layers(runs[False]).items()}
        again = hf.calibrate(copy.deepcopy(runs[False]), other)  # the same weights: the same thresholds
        on_fit = {i: float(layer.mod_router.threshold) for i, layer in hf.mod_layers(runs[True]).items()}
        assert got == again and got != on_fit, (got, again, on_fit)
        thresholds[heal is None] = got
    assert thresholds[True] != thresholds[False]  # healing moved the routers' inputs: set again after it
    with pytest.raises(ValueError, match="calibration_batches"):
        hf.convert_to_macs(_original(layers=4), hf.BudgetConfig(0.75, seq_len=S), data, calibration_batches=[])


def test_bad_settings_name_the_field(hf):
    with pytest.raises(ValueError, match="macs=1.2"):
        hf.BudgetConfig(1.2)
    with pytest.raises(ValueError, match="method"):
        hf.BudgetConfig(0.8, method="distil")
    with pytest.raises(ValueError, match="part='mlp'"):
        hf.BudgetConfig(0.8, method="prune", part="mlp")
    with pytest.raises(ValueError, match="causal"):
        hf.BudgetConfig(0.8, causal="predictor")
    with pytest.raises(ValueError, match="order='every_other'"):
        hf.BudgetConfig(0.8, part="mixed", order="every_other")
    with pytest.raises(ValueError, match="router_label"):
        hf.BudgetConfig(0.8, router_label="norm")
    with pytest.raises(ValueError, match="router_label='residual'.*skip_rank"):
        hf.BudgetConfig(0.8, router_label="residual")  # no estimate: nothing to miss
    with pytest.raises(ValueError, match="router_label='residual'.*method='prune'"):
        hf.BudgetConfig(0.8, method="prune", skip_rank=4, router_label="residual")
    with pytest.raises(TypeError, match="heal"):
        hf.BudgetConfig(0.8, heal={"steps": 3})  # type: ignore[arg-type]
    model = _original(layers=4)
    with pytest.raises(ValueError, match="fit_batches"):
        hf.convert_to_macs(model, hf.BudgetConfig(0.8, seq_len=S), [])
    hf.to_mod(model, layers=[1])
    with pytest.raises(ValueError, match="already carries a conversion"):
        hf.convert_to_macs(model, hf.BudgetConfig(0.8, seq_len=S), _windows(1))


def _checkpoint(folder: Path, text: str) -> None:
    """A tiny Llama and a word-level tokenizer of ``text`` saved as a transformers checkpoint folder."""
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted(set(text.split()))[: V - 2]
    vocab = {"[EOS]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="[EOS]", unk_token="[UNK]").save_pretrained(folder)
    _original(layers=4).save_pretrained(folder)


def test_command_writes_a_folder_load_conversion_reads(hf, tmp_path):
    from mode.cli import main
    from mode.hf.convert_command import held_out_loss, load_model
    from mode.hf.dense.windows import file_windows

    g = torch.Generator().manual_seed(5)
    words = [f"w{i}" for i in range(60)]
    text = " ".join(words[int(i)] for i in torch.randint(0, 60, (3000,), generator=g))
    (tmp_path / "text.txt").write_text(text, encoding="utf-8")
    _checkpoint(tmp_path / "ckpt", text)
    out = tmp_path / "out"
    argv = ["convert", str(tmp_path / "ckpt"), "--macs", "0.8", "--out", str(out), "--data", str(tmp_path / "text.txt")]
    argv += ["--seq-len", "32", "--fit-windows", "16", "--val-windows", "8", "--heal-steps", "2"]
    argv += ["--heal-tokens", "64", "--min-capacity", "0.25"]
    assert main(argv) == 0
    report = json.loads((out / "convert_report.json").read_text())
    assert abs(report["result"]["macs"] - 0.8) <= 0.008
    assert report["result"]["heal"]["steps"] == 2 and report["result"]["heal"]["tokens"] == 2 * 64
    original, tokenizer, _ = load_model(str(tmp_path / "ckpt"))
    _, held_WS = file_windows(tokenizer, tmp_path / "text.txt", 32)
    val_WS = held_WS[torch.linspace(0, len(held_WS) - 1, min(8, len(held_WS))).long()]
    assert held_out_loss(original, val_WS) == pytest.approx(report["held_out"]["original_loss"], rel=1e-6)
    back = hf.load_conversion(original, out)
    assert held_out_loss(back, val_WS) == pytest.approx(report["held_out"]["loss"], rel=1e-6)
    assert main(argv) == 2  # the folder holds a conversion: refused without --force
    assert main([*argv, "--force"]) == 0
    with_est = [*argv, "--force", "--skip-rank", "2", "--router-label", "residual"]
    with_est += ["--heal-layers", "all", "--calibrate", "docstrings"]  # issue 49's recipe
    assert main(with_est) == 0
    report = json.loads((out / "convert_report.json").read_text())
    assert report["settings"]["router_label"] == "residual" and report["settings"]["skip_rank"] == 2
    assert report["settings"]["calibrate"] == "docstrings"
    assert report["result"]["heal"]["lora_layers"] == [0, 1, 2, 3]  # every layer, not only the converted ones
    back = hf.load_conversion(load_model(str(tmp_path / "ckpt"))[0], out)
    assert held_out_loss(back, val_WS) == pytest.approx(report["held_out"]["loss"], rel=1e-6)
    assert "heal_curve" not in report
    assert main([*argv, "--force", "--heal-steps", "3", "--heal-probe-every", "2", "--unseen-windows", "0"]) == 0
    report = json.loads((out / "convert_report.json").read_text())
    curve = report["heal_curve"]
    assert [p["step"] for p in curve] == [0, 2, 3]  # before healing, every 2 steps, and the end (the result)
    assert curve[-1]["held_out"] == report["held_out"]["d_loss_pct"]
    assert not (out / "heal_curve.partial.json").exists()  # the report holds the whole curve
    assert len({p["held_out"] for p in curve}) == 3


def test_command_refuses_bad_input(hf, tmp_path, capsys):
    from mode.cli import main

    assert main(["convert", str(tmp_path), "--macs", "0.8", "--out", str(tmp_path / "o")]) == 2
    assert "config.json" in capsys.readouterr().err
    assert main(["convert", "smollm2", "--macs", "0.8", "--out", str(tmp_path / "o"), "--seq-len", "0"]) == 2
    assert "--seq-len=0" in capsys.readouterr().err
    assert main(["convert", "smollm2", "--macs", "1.5", "--out", str(tmp_path / "o")]) == 2
    assert "macs=1.5" in capsys.readouterr().err
    assert (
        main(["convert", "smollm2", "--macs", "0.8", "--out", str(tmp_path / "o"), "--router-label", "residual"]) == 2
    )
    assert "router_label='residual'" in capsys.readouterr().err  # no --skip-rank: refused before loading
    argv = ["convert", "smollm2", "--macs", "0.8", "--out", str(tmp_path / "o"), "--heal-probe-every"]
    assert main([*argv, "-1"]) == 2
    assert "--heal-probe-every=-1" in capsys.readouterr().err
    assert main([*argv, "5", "--heal-steps", "0"]) == 2
    assert "--heal-probe-every=5: needs healing" in capsys.readouterr().err


def test_every_phase_of_a_conversion_shows_progress(hf, capsys):
    """``progress``: each phase (skip costs with their estimates, router fits, calibration, the heal) writes
    lines while it runs (every 0 s here) and an end line; without ``progress`` nothing is written."""
    import io

    from mode.train.progress import Progress

    out = io.StringIO()
    heal = hf.HealConfig(steps=2, rank=2, layers="all")
    cfg = hf.BudgetConfig(0.8, seq_len=S, skip_rank=2, heal=heal)
    hf.convert_to_macs(_original(layers=4), cfg, _windows(3), progress=Progress(bar=False, every_s=0, out=out))
    text = out.getvalue()
    for name in ("estimates (layer, rank 2)", "skip costs (layer)", "router fit (update)", "calibration"):
        assert re.search(rf"^{re.escape(name)}: \d+/\d+ .* ETA ", text, re.M), (name, text)
        assert re.search(rf"^{re.escape(name)}: \d+ .* done in ", text, re.M), (name, text)
    assert re.search(r"^heal: step 2/2 done in ", text, re.M), text
    pruned = io.StringIO()
    cfg = hf.BudgetConfig(0.8, method="prune", seq_len=S, skip_rank=2, prune_by="skip_cost")
    hf.convert_to_macs(_original(layers=4), cfg, _windows(3), progress=Progress(bar=False, every_s=0, out=pruned))
    assert "skip costs (layer): 5 loss passes done in" in pruned.getvalue(), pruned.getvalue()
    capsys.readouterr()
    hf.convert_to_macs(_original(layers=4), hf.BudgetConfig(0.8, seq_len=S, skip_rank=2), _windows(3))
    assert capsys.readouterr().out == ""

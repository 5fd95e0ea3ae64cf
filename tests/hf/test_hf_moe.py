"""transformers MoE models converted by ``mode.hf.to_mode_moe``: the same function (logits, losses, gradients,
``generate``, ``output_router_logits``) on the model's own tensors, the way back to a plain transformers folder,
the report, and the refusals. The expert-parallel side is tests/parallel/test_hf_moe_ep.py."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install 'mode-torch[hf]'): the models to convert"
)

import mode.hf as mh  # noqa: E402
from mode.hf.moe.convert import transformers_names  # noqa: E402
from mode.hf.moe.families import FAMILIES as SPECS, NOT_YET, REFUSED, get_path  # noqa: E402
from mode.routing import update_expert_bias  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import moe_models as mm  # noqa: E402
from scaled_close import assert_close_scaled  # noqa: E402

# How close a converted model comes to transformers' own, in float32. Not bit for bit: the sums run in another
# order (the CPU GEMM's rounding of a row depends on its place in the block, and transformers orders an expert's
# rows by choice rank, we by token), and how far that moves a value depends on the CPU's kernels (AVX-512/AMX or
# AVX2 MKL) and the thread count. So the bound is per tensor and scaled to it: max |ours - theirs| <= REL * max
# |theirs|, never element-wise (an element-wise atol of 2e-6 failed on an AMX Xeon for embedding gradients that
# differed by 3.5e-6). Measured 2026-11-27 on an AMD EPYC (AVX-512-BF16), every family, logits + loss (train and
# eval) + every gradient, torch threads 1/2/4, with ATEN_CPU_CAPABILITY=avx2 and/or MKL_ENABLE_INSTRUCTIONS=AVX2:
# largest max|d|/max|ref| 1.35e-5 (deepseek_v4, 2 threads; then qwen4_exp 9.8e-6, the AMX Xeon's kimi_linear
# ~7e-6), so REL = 1e-4 leaves 7x headroom. A wrong mapping (an expert, a gate, a renormalisation) moves the
# result by 1e-2 or more. DBRX's random model is ill-conditioned: its residual stream reaches |h| = 33 after
# layer 1 (where ours is within 6e-8 relative, as for every family) and the final LayerNorm divides by a small
# spread, amplifying that: 1.5e-4 measured (avx2 paths), so its bound is 1e-3. Re-measure with
# scripts/tolerance_margins.py tests/hf/test_hf_moe.py (1.0 = the bound).
REL = 1e-4
FAMILY_REL = {"dbrx": 1e-3}


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, family: str = "", what: str = "") -> None:
    """``max |actual - expected| <= rel * max |expected|`` (tests/scaled_close.py), rel by family (see REL)."""
    assert_close_scaled(actual, expected, FAMILY_REL.get(family, REL), f"{family} {what}")


def _model_type(family: str) -> str:
    return mm.config(family).get_text_config(decoder=True).model_type


# every MoE decoder family built here that the installed transformers ships (all of them on the test extra's pin)
EVERY = (*mm.ALL_FAMILIES, *mm.MORE_FAMILIES, *mm.MULTIMODAL_FAMILIES)
BUILT = tuple(f for f in EVERY if mm.available(f))
CONVERTS = tuple(f for f in BUILT if _model_type(f) in SPECS)
REFUSES = tuple(f for f in BUILT if _model_type(f) in REFUSED)
NOT_CONVERTED = tuple(f for f in BUILT if _model_type(f) in NOT_YET)


def _grads(model) -> dict:
    """Every parameter's gradient under transformers' names; the rows LongCat's experts never read get zeros
    (kept as a buffer: no gradient of ours), as transformers' own gradient has there."""
    grads = {n: p.grad for n, p in model.named_parameters()}
    grads.update({n: torch.zeros_like(b) for n, b in model.named_buffers() if ".kept." in n and n.endswith("__rest")})
    return transformers_names(model, grads)


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, mm.V, (3, 12), generator=g, device="cpu").to(torch.get_default_device())
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    mask[2, :1] = 0
    return ids, mask


def _records_router_logits(model) -> bool:
    """Whether transformers declares a ``router_logits`` recorder on ``model`` or a submodule (its class's
    ``_can_record_outputs``): where it does not, ``output_router_logits`` gives nothing to compare."""
    return any("router_logits" in (getattr(type(m), "_can_record_outputs", None) or {}) for m in model.modules())


def _pair(family: str, **overrides):
    model = mm.build(family, **overrides)
    ref = copy.deepcopy(model)
    return ref, mh.to_mode_moe(model)


@pytest.mark.parametrize("family", CONVERTS)
def test_converted_model_computes_the_original_on_its_own_tensors(family):
    model = mm.build(family)
    ref = copy.deepcopy(model)
    spec = SPECS[_model_type(family)]
    blocks = {name: m for name, m in model.named_modules() if type(m).__name__ == spec.block}
    tensors = {
        name: (
            get_path(b, f"{spec.router}.{spec.router_weight}"),
            *(get_path(get_path(b, spec.experts), w) for w in spec.weights),
        )
        for name, b in blocks.items()
    }
    mh.to_mode_moe(model)
    slots = mh.converted_moe(model)
    assert sorted(slots) == sorted(blocks) and slots
    for name, slot in slots.items():  # nothing copied: the very Parameters (LongCat: a view of the rows read)
        gate, w_in, w_out = tensors[name]
        bank_in, bank_out = slot.moe.experts.w_in, slot.moe.experts.w_out
        if spec.router is None:  # Gemma-4: transformers' router stays, the experts are ours
            assert isinstance(slot, mh.moe.convert.ConvertedExperts) and bank_in is w_in and bank_out is w_out
            continue
        assert slot.moe.router.weight is gate
        if family == "dbrx":  # fused 2D weights: the input weight is one copy, the output weight a view
            assert bank_out.data_ptr() == w_out.data_ptr()
            continue
        assert slot.moe.router.weight is gate and bank_out is w_out
        assert bank_in is w_in or (bank_in.data_ptr() == w_in.data_ptr() and family == "longcat_flash")
    ids, mask = _batch()
    refuses = spec.train_refusal is not None  # PhiMoE: evaluation only (its training samples the routing)
    # transformers 5.17 records no router logits for Granite and DBRX (its own forward with labels then fails on
    # an int aux loss): asked for where the installed transformers records them (every family on 5.23)
    kw = dict(output_router_logits=True) if _records_router_logits(ref) else {}
    for training in (False,) if refuses else (True, False):
        model.train(training)
        ref.train(training)
        out_ref = ref(input_ids=ids, attention_mask=mask, labels=ids, **kw)
        out = model(input_ids=ids, attention_mask=mask, labels=ids, **kw)
        assert_matches(out.logits, out_ref.logits, family, f"logits, training={training}")
        assert_matches(out.loss, out_ref.loss, family, f"loss, training={training}")
        # output_router_logits: transformers' own balance loss, as before (5.17's DeepSeek-V3 output has none)
        if getattr(out_ref, "aux_loss", None) is not None:
            assert_matches(out.aux_loss, out_ref.aux_loss, family, "aux_loss")
        # transformers 5.17's DeepSeek-V3 returns none, its Qwen3-Omni thinker None (5.23 returns them): as it does
        if getattr(out_ref, "router_logits", None) is None:
            assert getattr(out, "router_logits", None) is None
            continue
        # JetMoE records its attention routers too; DeepSeek-V4 not its hash layers: as many as transformers
        assert len(out.router_logits) == len(out_ref.router_logits) > 0
        for i, (a, b) in enumerate(zip(out.router_logits, out_ref.router_logits)):
            assert_matches(a, b, family, f"router_logits[{i}]")
    model.train(not refuses)  # the gradients of evaluation mode, where training is refused
    ref.train(not refuses)
    for m in (model, ref):
        m.zero_grad()
        m(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    ours = _grads(model)
    theirs = {n: p.grad for n, p in ref.named_parameters()}
    assert set(ours) == set(theirs)
    for n, g in theirs.items():
        if g is None:  # a tensor the forward never reads (LongCat's classifier bias): none on either side
            assert ours[n] is None, n
            continue
        assert_matches(ours[n], g, family, f"{n}.grad")


@pytest.mark.parametrize("family", CONVERTS)
def test_generate_is_unchanged(family):
    ref, model = _pair(family)
    ids, mask = _batch(1)
    ref.eval()
    model.eval()
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))


def test_router_logits_recorded_when_transformers_hooked_the_model_before_conversion():
    model = mm.build("qwen3_moe")
    ref = copy.deepcopy(model)
    ids, mask = _batch()
    model(input_ids=ids, attention_mask=mask, output_router_logits=True)  # transformers installs its hooks now
    mh.to_mode_moe(model)
    out = model(input_ids=ids, attention_mask=mask, labels=ids, output_router_logits=True)
    out_ref = ref(input_ids=ids, attention_mask=mask, labels=ids, output_router_logits=True)
    assert len(out.router_logits) == 2
    assert_matches(out.aux_loss, out_ref.aux_loss, "qwen3_moe", "aux_loss")


def test_our_losses_are_off_by_default_and_on_when_asked():
    model = mh.to_mode_moe(mm.build("mixtral"), balance_coef=0.01, z_coef=1e-3)
    ids, mask = _batch()
    model(input_ids=ids, attention_mask=mask)
    aux = mh.collect_aux(model)
    assert sorted(aux.losses) == [
        "layers.0.moe.balance",
        "layers.0.moe.z_loss",
        "layers.1.moe.balance",
        "layers.1.moe.z_loss",
    ]
    assert float(aux.total().detach()) > 0
    plain = mh.to_mode_moe(mm.build("mixtral"))
    plain(input_ids=ids, attention_mask=mask)
    assert float(mh.collect_aux(plain).total()) == 0.0


def test_deepseek_bias_balancing_moves_the_transformers_buffer():
    model = mh.to_mode_moe(mm.build("deepseek_v3"))
    slot = next(iter(mh.converted_moe(model).values()))
    before = slot.moe.router.bias_X.clone()
    ids, mask = _batch()
    model.train()
    model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    update_expert_bias(model)
    assert not torch.equal(slot.moe.router.bias_X, before)
    saved = transformers_names(model, model.state_dict())
    key = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert torch.equal(saved[key], slot.moe.router.bias_X)


def test_round_trip_to_a_plain_transformers_folder(tmp_path):
    """Each family, trained one step, written by save_transformers, loaded by transformers in a process where
    ``import mode`` fails: the same logits."""
    expected, classes_saved = {}, {}
    for family in CONVERTS:
        model = mh.to_mode_moe(mm.build(family))
        model.train(SPECS[_model_type(family)].train_refusal is None)
        ids, mask = _batch()
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:  # LongCat's classifier bias is never read
                    p -= 0.05 * p.grad
        folder = mh.save_transformers(model, tmp_path / family)
        assert sorted(f.name for f in folder.iterdir()) == [
            "config.json",
            "generation_config.json",
            "model.safetensors",
        ]
        model.eval()
        with torch.no_grad():
            expected[family] = model(input_ids=ids, attention_mask=mask).logits
        # on the CPU: the child process's model is (under MODE_TEST_DEVICE=cuda these were CUDA tensors, and the
        # child's CPU model refused them)
        torch.save({"ids": ids.cpu(), "mask": mask.cpu()}, tmp_path / f"{family}.batch.pt")
        classes_saved[family] = type(model).__name__  # multimodal ones load with their own class
    code = f"""
import json, sys
sys.modules["mode"] = None  # transformers alone: `import mode` would raise
import torch, transformers
out = {{}}
for family in {list(CONVERTS)!r}:
    cls = getattr(transformers, {classes_saved!r}[family])
    m = cls.from_pretrained({str(tmp_path)!r} + "/" + family, dtype=torch.float32).eval()
    b = torch.load({str(tmp_path)!r} + "/" + family + ".batch.pt")
    with torch.no_grad():
        torch.save(m(input_ids=b["ids"], attention_mask=b["mask"]).logits, {str(tmp_path)!r} + "/" + family + ".out.pt")
    out[family] = type(m).__name__
print(json.dumps(out))
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    classes = json.loads(res.stdout.strip().splitlines()[-1])
    assert classes["qwen3_moe"] == "Qwen3MoeForCausalLM" and classes["mixtral"] == "MixtralForCausalLM"
    for family, logits in expected.items():
        # DBRX: transformers itself differs by 1e-5 from itself after save/load (its loaded 2D expert views
        # round differently in the CPU matmul), so its bound is the family one
        assert_matches(torch.load(tmp_path / f"{family}.out.pt"), logits.cpu(), family, "logits after save/load")


def test_save_replaces_the_folder_whole(tmp_path):
    model = mh.to_mode_moe(mm.build("qwen3_moe"))
    mh.save_transformers(model, tmp_path / "out")
    with torch.no_grad():
        next(iter(mh.converted_moe(model).values())).moe.experts.w_in_EFD.add_(1.0)
    mh.save_transformers(model, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary or old folder left
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    torch.testing.assert_close(
        again.model.layers[0].mlp.experts.gate_up_proj, model.model.layers[0].mlp.moe.experts.w_in_EFD
    )


def test_report_counts_every_layer_on_real_tokens_only():
    model = mh.to_mode_moe(mm.build("qwen2_moe"))
    ids, mask = _batch()
    acc, summary = mh.moe_report(model, ids, mask)
    assert sorted(summary["layers"]) == ["0", "1"]
    for layer in summary["layers"].values():
        assert layer["experts_per_token"] == pytest.approx(2.0)  # dropless top-2; padding is not a token
        assert sum(layer["expert_frac"]) == pytest.approx(1.0, abs=1e-5)
        assert layer["dropped_frac"] == 0.0 and layer["noop_share"] == 0.0
    D, H, Hs, E = mm.D, 48, 40, 8
    per_layer = 2 * 6 * D * H + 6 * D * Hs + 2 * D + 2 * D * E  # routed, shared, its gate, router
    assert summary["overall"]["moe_flops_per_token"] == pytest.approx(2 * per_layer)
    assert model.training  # restored
    acc2, _ = mh.moe_report(model, ids, mask, acc=acc)  # sums over batches
    assert acc2 is acc and acc.router_summary("layers.0.moe.router")["calls"] == 2


def test_refusals_name_what_is_missing():
    with pytest.raises(ValueError, match="model_type='llama'.*missing"):
        mh.to_mode_moe(
            transformers.LlamaForCausalLM(
                transformers.LlamaConfig(
                    vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
                )
            )
        )
    assert REFUSES == ()  # no decoder family is refused for good
    pin = re.search(r'"transformers==([0-9.]+)"', (Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert pin is not None  # the test extra pins the newest release the hf extra allows: every family is there
    if transformers.__version__ == pin.group(1):
        assert BUILT == EVERY, sorted(set(EVERY) - set(BUILT))
    assert set(CONVERTS) | set(NOT_CONVERTED) == set(BUILT)  # every family built here is in the table
    for family in NOT_CONVERTED:  # each says what it needs
        with pytest.raises(ValueError, match=f"model_type='{_model_type(family)}'.*does not convert it yet: "):
            mh.to_mode_moe(mm.build(family))
    switch = transformers.SwitchTransformersForConditionalGeneration(
        transformers.SwitchTransformersConfig(
            vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2, num_experts=4
        )
    )
    with pytest.raises(ValueError, match="model_type='switch_transformers'.*does not convert.*encoder-decoder"):
        mh.to_mode_moe(switch)
    model = mm.build("qwen3_moe")
    model.config.quantization_config = {"quant_method": "bitsandbytes"}
    with pytest.raises(ValueError, match="quantization_config"):
        mh.to_mode_moe(model)
    with pytest.raises(ValueError, match="hidden_act='gelu_10'"):  # a gelu transformers clips: not in GLU_ACTS
        mh.to_mode_moe(mm.build("olmoe", hidden_act="gelu_10"))
    converted = mh.to_mode_moe(mm.build("olmoe"))
    with pytest.raises(ValueError, match="already converted"):
        mh.to_mode_moe(converted)
    with pytest.raises(TypeError, match="PreTrainedModel"):
        mh.to_mode_moe(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="no ConvertedMoE"):
        mh.save_transformers(mm.build("olmoe"), "unused")


@pytest.mark.parametrize(
    "family,field",
    [("mixtral", "router_jitter_noise"), ("minimax_m2", "router_jitter_noise"), ("phimoe", "input_jitter_noise")],
)
def test_router_jitter_converts_exact_in_eval_and_refuses_training(family, field):
    ref, model = _pair(family, **{field: 0.1})
    ids, mask = _batch()
    ref.eval()
    model.eval()
    assert_matches(
        model(input_ids=ids, attention_mask=mask).logits,
        ref(input_ids=ids, attention_mask=mask).logits,
        family,
        "logits",
    )
    model.train()
    with pytest.raises(ValueError, match="jitter 0.1 is on.*set the config's jitter to 0.0"):
        model(input_ids=ids, attention_mask=mask)


def test_longcat_zero_experts_are_copy_noop_slots_held_at_a_budget_by_the_bias():
    """LongCat-Flash's zero-computation experts are integrated MoDE's no-op slots of kind "copy"; with
    ``noop_target`` its correction bias (our bias controller) holds the share of choices they get, so the
    average activated experts per token stays fixed: within 2 points of the target over training."""
    from mode.layers.moe import IntegratedMoDE
    from mode.routing import update_expert_bias

    model = mh.to_mode_moe(mm.build("longcat_flash"), noop_target=0.2)
    slots = mh.converted_moe(model)
    for slot in slots.values():
        assert isinstance(slot.moe, IntegratedMoDE) and slot.moe.noop.kinds == ("copy",) * 4
        slot.moe.router.cfg.bias_rate = 0.01  # LongCat's controller step; the default 1e-3 is 10x slower
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    shares = []
    model.train()
    for _ in range(60):
        ids = torch.randint(3, mm.V, (8, 16), generator=g).to(torch.get_default_device())
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        update_expert_bias(model)
        stats = list(mh.collect_aux(model).stats.values())
        shares.append(sum(float(s.noop) for s in stats) / sum(float(s.requested_X.sum()) for s in stats))
    assert shares[0] > 0.3  # left alone, a third of the choices go to the zero experts
    assert abs(sum(shares[30:]) / 30 - 0.2) < 0.02, shares


@pytest.mark.parametrize("eps", [0.0, 0.01, 0.3, 2.0])
def test_phimoe_sparsemixer_exact_in_eval_at_every_gap_and_training_refused(eps):
    """PhiMoE's router_jitter_noise is the sparsemixer's relative gap (Phi-3.5-MoE: 0.01), not noise in
    evaluation: each slot's gate is a softmax over the logits within 2 eps of it. Training samples the choice
    (Gumbel) with a custom gradient: the converted model refuses it."""
    ref, model = _pair("phimoe", router_jitter_noise=eps)
    ids, mask = _batch()
    ref.eval()
    model.eval()
    out = model(input_ids=ids, attention_mask=mask, labels=ids, output_router_logits=True)
    out_ref = ref(input_ids=ids, attention_mask=mask, labels=ids, output_router_logits=True)
    assert_matches(out.logits, out_ref.logits, "phimoe", "logits")
    assert_matches(out.aux_loss, out_ref.aux_loss, "phimoe", "aux_loss")
    model.train()
    with pytest.raises(ValueError, match="phimoe: a training forward is refused: PhiMoE trains its router by Gumbel"):
        model(input_ids=ids, attention_mask=mask)


def test_laguna_router_softcap_is_exact_when_on():
    """The test config leaves Laguna's router softcap off (its default); on, the converted router caps the
    logits as transformers does (``TokenChoiceConfig.logit_softcap``): the same logits, loss and gradients."""
    ref, model = _pair("laguna", moe_router_logit_softcapping=0.5)
    assert next(iter(mh.converted_moe(model).values())).moe.router.cfg.logit_softcap == 0.5
    ids, mask = _batch()
    for m in (model, ref):
        m.zero_grad()
    out, out_ref = (m(input_ids=ids, attention_mask=mask, labels=ids, output_router_logits=True) for m in (model, ref))
    assert_matches(out.logits, out_ref.logits, "laguna", "logits")
    for a, b in zip(out.router_logits, out_ref.router_logits):
        assert_matches(a, b, "laguna", "router_logits")
    out.loss.backward()
    out_ref.loss.backward()
    theirs = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    ours = _grads(model)
    for n, g in theirs.items():
        assert_matches(ours[n], g, "laguna", f"{n}.grad")

"""A converted transformers MoE model still behaves as a transformers model (issue 50): ``save_pretrained`` writes
the family's own checkpoint (the bytes of ``save_transformers``), ``init_weights`` / ``post_init`` initialise
mode's tensors as the family does, every gated activation converts, and the transformers API around the model
(attention switch, padding-free inputs, dtype loading, resizing, metadata) keeps working. Every converted family
built by tests/hf/moe_models.py, at tiny sizes on the CPU."""

from __future__ import annotations

import copy
import re
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install 'mode-torch[hf]'): the models to convert"
)

import mode.hf as mh  # noqa: E402
from mode.hf.moe.families import FAMILIES as SPECS, GLU_ACTS  # noqa: E402
from mode.hf.moe.saving import transformers_names, transformers_state_dict  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import moe_models as mm  # noqa: E402
from test_hf_moe import CONVERTS, _batch, _grads, _model_type, _pair, assert_matches  # noqa: E402


def _class(family: str):
    """The class a family's model is built with (a multimodal family's ...ForConditionalGeneration)."""
    return type(mm.build(family)) if family in mm.MULTIMODAL_FAMILIES else transformers.AutoModelForCausalLM


def _meta(family: str):
    """The family's model built on the meta device (nothing allocated, nothing initialised)."""
    cfg = mm.config(family)
    with torch.device("meta"):
        if family in mm.MULTIMODAL_CLASSES:
            return getattr(transformers, mm.MULTIMODAL_CLASSES[family])._from_config(cfg)
        if family in mm.MULTIMODAL_FAMILIES:
            return transformers.AutoModelForImageTextToText.from_config(cfg)
        return transformers.AutoModelForCausalLM.from_config(cfg)


def _step(model, ids, mask, lr: float = 0.05) -> None:
    """One plain SGD step, so the saved tensors are not the built ones."""
    model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad
    model.zero_grad()


def _logits(model, ids, mask):
    with torch.no_grad():
        return model.eval()(input_ids=ids, attention_mask=mask).logits


# ---- (1) saving never loses data ----------------------------------------------------------------------------


@pytest.mark.parametrize("family", CONVERTS)
def test_save_pretrained_writes_the_family_checkpoint(family, tmp_path):
    """``model.save_pretrained`` of a converted model writes what ``save_transformers`` writes, byte for byte;
    plain transformers loads it with no missing, unexpected or re-initialised key, and the converted model's
    logits (its family's tolerance: the expert sums run in another order); the loaded tensors loaded back into a
    converted model give its logits bit for bit (a family checkpoint loads into a converted model)."""
    model = mh.to_mode_moe(mm.build(family))
    ids, mask = _batch()
    model.train(SPECS[_model_type(family)].train_refusal is None)
    _step(model, ids, mask)
    model.save_pretrained(tmp_path / "pretrained")
    mh.save_transformers(model, tmp_path / "transformers")
    for name in ("model.safetensors", "config.json", "generation_config.json"):
        assert (tmp_path / "pretrained" / name).read_bytes() == (tmp_path / "transformers" / name).read_bytes(), name
    plain, info = _class(family).from_pretrained(tmp_path / "pretrained", dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    theirs = plain.state_dict()
    for k, v in transformers_state_dict(model).items():
        assert torch.equal(theirs[k], v), k
    expected = _logits(model, ids, mask)
    assert_matches(_logits(plain, ids, mask), expected, family, "logits after save_pretrained")
    again = mh.to_mode_moe(mm.build(family, seed=1))
    again.load_state_dict(theirs, strict=True)
    assert torch.equal(_logits(again, ids, mask), expected)


def test_save_pretrained_keeps_the_folder_and_renames_a_given_state_dict(tmp_path):
    """Like transformers' own, it writes into the folder (a tokenizer saved there stays); a ``state_dict`` in
    mode's names (HF Trainer, accelerate) is written in the family's; a partial one raises naming
    save_transformers instead of leaving plain transformers to initialise the rest."""
    model = mh.to_mode_moe(mm.build("qwen3_moe"))
    (tmp_path / "tokenizer.json").write_text("{}")
    model.save_pretrained(tmp_path, state_dict=model.state_dict())
    assert (tmp_path / "tokenizer.json").exists()
    plain, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    partial = {k: v for k, v in model.state_dict().items() if "experts" not in k}
    with pytest.raises(ValueError, match="missing .*mlp.experts.*save_transformers"):
        model.save_pretrained(tmp_path / "partial", state_dict=partial)


# ---- (2) transformers' initialisation ---------------------------------------------------------------------


def _same_distribution(ours: torch.Tensor, theirs: torch.Tensor, name: str) -> None:
    """A constant tensor (zeros, ones) exactly; a random one with the same spread: within 6 standard errors
    where it has enough values to measure one (128), else within 10 of the family's standard deviations."""
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype, name
    if (theirs == theirs.flatten()[0]).all():
        assert torch.equal(ours, theirs), name
        return
    std, n = float(theirs.float().std()), theirs.numel()
    assert float(ours.float().abs().max()) < 10 * std + float(theirs.float().abs().max()), name
    if n >= 128:
        ratio = float(ours.float().std()) / std
        assert abs(ratio - 1) < 6 / (2 * n) ** 0.5, (name, ratio)
        assert abs(float(ours.float().mean() - theirs.float().mean())) < 6 * std / n**0.5, name


def _nan_filled(model):
    """``model`` with every floating-point tensor NaN (in place): what ``to_empty`` left there, made visible, so
    a tensor the family's ``init_weights`` does not write stays NaN."""
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.is_floating_point():
                t.fill_(float("nan"))
    return model


@pytest.mark.parametrize("family", CONVERTS)
def test_init_weights_initialises_our_tensors_as_the_family(family):
    """``init_weights()`` (so ``post_init``) on a converted pretrained model changes nothing, as on the family's
    own; on one built on meta and materialised with ``to_empty``, every tensor (mode's router, experts and
    correction bias under the family's names) gets the family's initialisation: the constants exactly, the
    random ones with the family's spread (``initializer_range``)."""
    model = mh.to_mode_moe(mm.build(family))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.init_weights()
    model.post_init()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    ref = _nan_filled(_meta(family).to_empty(device="cpu"))
    ref.init_weights()
    ours = _nan_filled(mh.to_mode_moe(_meta(family)).to_empty(device="cpu"))
    ours.init_weights()
    got, want = transformers_names(ours, ours.state_dict()), ref.state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        if v.is_floating_point() and v.isnan().all():  # the family leaves it (5.17: Ernie-4.5-MoE's router weight)
            assert got[k].isnan().all(), k  # so ours does too
        elif v.is_floating_point():
            _same_distribution(got[k], v, k)
    for slot in mh.converted_moe(ours).values():  # mode's own buffers: their construction values
        router = slot.moe.router
        if getattr(router, "load_X", None) is not None:
            assert torch.equal(router.load_X, torch.zeros_like(router.load_X))
            assert torch.equal(router.share_X, torch.tensor(router.cfg.target_shares()))


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3", "longcat_flash"])
def test_built_on_meta_and_initialised_trains_like_built_on_the_cpu(family):
    """A converted model made on meta, materialised and initialised, trains as one made on the CPU: the same
    starting loss (both initialised by the family's rules) to 2%, and both fall over a few AdamW steps."""
    ids, mask = _batch()
    losses = {}
    for where in ("meta", "cpu"):
        torch.manual_seed(0)
        if where == "meta":
            model = mh.to_mode_moe(_meta(family)).to_empty(device="cpu")
            model.init_weights()
        else:
            model = mh.to_mode_moe(
                _class(family).from_config(mm.config(family))
                if family not in mm.MULTIMODAL_FAMILIES
                else mm.build(family)
            )
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        run = []
        for _ in range(6):
            loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.append(loss.item())
        losses[where] = run
    for run in losses.values():
        assert all(map(torch.isfinite, torch.tensor(run))) and run[-1] < run[0] - 0.05, losses
    assert abs(losses["meta"][0] - losses["cpu"][0]) < 0.02 * losses["cpu"][0], losses


# ---- (3) every gated activation ---------------------------------------------------------------------------

GATED = tuple(
    f
    for f in CONVERTS
    if SPECS[_model_type(f)].activation == "swiglu"
    and SPECS[_model_type(f)].activation_field is not None
    and SPECS[_model_type(f)].activation_name is None
)


def _act_field(family: str) -> str:
    return SPECS[_model_type(family)].activation_field


def _compare(family: str, ref, model) -> None:
    ids, mask = _batch()
    for m in (model, ref):
        m.train(SPECS[_model_type(family)].train_refusal is None)
        m.zero_grad()
    out, out_ref = (m(input_ids=ids, attention_mask=mask, labels=ids) for m in (model, ref))
    assert_matches(out.logits, out_ref.logits, family, "logits")
    out.loss.backward()
    out_ref.loss.backward()
    ours = _grads(model)
    for n, p in ref.named_parameters():
        if p.grad is not None:
            assert_matches(ours[n], p.grad, family, f"{n}.grad")


def _text_config_with(monkeypatch, field: str, value) -> None:
    """``mm.build`` sets the field on the text config (a multimodal family's is nested)."""
    config = mm.config

    def patched(family, **overrides):
        cfg = config(family, **overrides)
        setattr(cfg.get_text_config(decoder=True), field, value)
        return cfg

    monkeypatch.setattr(mm, "config", patched)


@pytest.mark.parametrize("family", GATED)
def test_gelu_experts_convert_with_transformers_logits_and_gradients(family, monkeypatch):
    """``hidden_act="gelu"`` (transformers: GeGLU experts, ``gelu(gate) * up``) converts in every gated family,
    with transformers' logits and gradients (Aria's and HY-V4's experts are SiLU whatever hidden_act says: their
    entries fix the activation, and they convert as SiLU)."""
    _text_config_with(monkeypatch, _act_field(family), "gelu")
    ref, model = _pair(family)
    for slot in mh.converted_moe(model).values():
        assert slot.moe.experts.cfg.glu_act == "gelu"
    _compare(family, ref, model)


@pytest.mark.parametrize("act", sorted(GLU_ACTS))
def test_every_transformers_activation_we_name_converts(act):
    """Each activation name of ``GLU_ACTS`` computes transformers' ``ACT2FN[act]`` gated experts (Qwen2-MoE,
    whose shared expert uses the same activation)."""
    ref, model = _pair("qwen2_moe", hidden_act=act)
    _compare("qwen2_moe", ref, model)


def test_an_activation_we_do_not_compute_is_refused_by_name():
    with pytest.raises(ValueError, match="hidden_act='gelu_10': mode's gated experts compute act"):
        mh.to_mode_moe(mm.build("mixtral", hidden_act="gelu_10"))


def test_glm5_next_experts_clamp_as_transformers_when_the_limit_bites(monkeypatch):
    """GLM-5-Next's experts clamp gate and up at ``swiglu_limit`` (silu whatever hidden_act says); at the test
    sizes the default 10 never bites, 0.05 does."""
    _text_config_with(monkeypatch, "swiglu_limit", 0.05)
    ref, model = _pair("glm5_next")
    _compare("glm5_next", ref, model)


# ---- (4) group-limited routing at any top_k transformers accepts ----------------------------------------------


# Mistral-Large-4 only where the installed transformers ships it (5.23, not 5.17)
@pytest.mark.parametrize(
    "family", [f for f in ("deepseek_v3", "glm4_moe", "axk2", "mistral_large4") if mm.available(f)]
)
def test_top_k_above_the_kept_groups_slots_computes_what_transformers_computes(family, monkeypatch):
    """top_k 8 with one kept group of 4 experts: transformers' ``torch.topk(..., sorted=False)`` takes the other 4
    from the dropped groups (score -inf, or 0 where dropped groups are zero-filled) with their real gates; the
    converted router takes the same ones (``surplus_from_dropped``): transformers' logits and gradients."""
    for field, value in (("num_experts_per_tok", 8), ("topk_group", 1)):
        _text_config_with(monkeypatch, field, value)
    ref, model = _pair(family)
    router = next(iter(mh.converted_moe(model).values())).moe.router
    assert router.cfg.top_k == 8 and router.cfg.surplus_from_dropped
    _compare(family, ref, model)


# ---- (5) set_experts_implementation, (6) metadata -------------------------------------------------------------


def test_set_experts_implementation_selects_our_backends_or_raises():
    ref, model = _pair("qwen3_moe")
    ids, mask = _batch()
    expected = _logits(ref, ids, mask)
    for name, backend in (
        ("reference", "reference"),
        ("eager", "reference"),
        ("grouped_mm", "grouped"),
        ("grouped", "grouped"),
        ("auto", "auto"),
    ):
        model.set_experts_implementation(name)
        assert {s.moe.experts.cfg.backend for s in mh.converted_moe(model).values()} == {backend}
        if name in ("eager", "grouped_mm"):  # transformers' names: its config says so, as transformers' own would
            assert model.config._experts_implementation == name
        assert_matches(_logits(model, ids, mask), expected, "qwen3_moe", f"logits with {name}")
    with pytest.raises(
        ValueError,
        match="experts_implementation='batched_mm': a converted model's experts are "
        "mode's; call set_experts_implementation with one of 'auto'",
    ):
        model.set_experts_implementation("batched_mm")
    with pytest.raises(TypeError, match="experts_implementation=.*a str"):
        model.set_experts_implementation({"text_config": "eager"})


def test_metadata_names_our_tensors_and_the_fp32_rule_holds(tmp_path):
    """DeepSeek-V3: the strict fp32 pattern names our correction bias too; tp/ep plans no longer name the
    experts' tensors (gone) but follow the shared experts; ``_no_split_modules`` names ConvertedMoE. Loaded in
    bfloat16 the bias stays float32 (transformers' rule), through the conversion and a save_pretrained ->
    from_pretrained(dtype=bfloat16) round trip."""
    model = mh.to_mode_moe(mm.build("deepseek_v3"))
    assert model._keep_in_fp32_modules_strict == {"moe.router.bias_X"}  # the family's pattern names nothing now
    assert "ConvertedMoE" in model._no_split_modules and "DeepseekV3DecoderLayer" in model._no_split_modules
    # the model's expert-parallel plan: transformers 5.23 has one (DistributedMixin.ep_plan), 5.17 none
    for plan in (model.tp_plan, *((model.ep_plan,) if hasattr(type(model), "ep_plan") else ())):
        assert not any(
            "experts.gate_up_proj" in k or "experts.down_proj" in k or k.endswith("mlp.experts") for k in plan
        ), plan
    assert model.tp_plan["model.layers.*.mlp.moe.shared_experts.mlp.gate_proj"] == "colwise"
    assert model.tp_plan["model.layers.*.mlp.gate_proj"] == "colwise"  # layer 0's dense MLP is still there
    model.save_pretrained(tmp_path / "fp32")
    half = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.bfloat16)
    assert half.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    mh.to_mode_moe(half)
    router = mh.converted_moe(half)["model.layers.1.mlp"].moe.router
    assert router.bias_X.dtype == torch.float32 and router.weight.dtype == torch.bfloat16
    half.save_pretrained(tmp_path / "bf16")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    assert again.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32


# ---- (7) the transformers features that keep working --------------------------------------------------------


def _attentions(model) -> list[str]:
    """The attention backends the family's model accepts, of eager and sdpa."""
    ok = []
    for impl in ("eager", "sdpa"):
        try:
            model.set_attn_implementation(impl)
            ok.append(impl)
        except (ValueError, ImportError):
            pass
    return ok


def _failure(f, *args) -> RuntimeError | None:
    """The RuntimeError ``f(*args)`` raises (torch's, from a transformers forward), or None where it runs."""
    try:
        f(*args)
    except RuntimeError as e:
        return e
    return None


@pytest.mark.parametrize("family", CONVERTS)
def test_transformers_features_keep_working(family, tmp_path):
    """On a converted model, each with the original model's numbers (the family's tolerance): the attention
    switch (eager / sdpa, and through from_pretrained), padding-free packed inputs with position_ids,
    from_pretrained(..., ignore_mismatched_sizes=True) of its saved checkpoint, dtype=bfloat16 loading (the
    converted model's own numbers, bit for bit through its save_pretrained), and resize_token_embeddings (same
    seed on both). Where transformers' own model gives NaN (a backend) or raises (bfloat16), the converted one
    refuses or raises alike (transformers 5.17 only; 5.23 computes every case)."""
    ref, model = _pair(family)
    ids, mask = _batch()
    impls = []  # the backends with finite transformers logits on the padded batch
    for impl in _attentions(ref):
        ref.set_attn_implementation(impl)
        model.set_attn_implementation(impl)
        expected = _logits(ref, ids, mask)
        if not expected.isfinite().all():  # transformers 5.17's Qwen4-Exp eager: NaN rows under left padding
            with pytest.raises(ValueError, match="router logits are NaN or inf"):  # ours refuses them, by name
                _logits(model, ids, mask)
            continue
        impls.append(impl)
        assert_matches(_logits(model, ids, mask), expected, family, f"logits, {impl}")
    assert impls
    # padding-free: two sequences packed in one row, positions restarting (what a packing collator gives)
    packed = ids[1:, :].reshape(1, -1)
    pos = torch.arange(ids.shape[1]).repeat(2)[None].to(packed.device)
    with torch.no_grad():
        assert_matches(
            model(input_ids=packed, position_ids=pos).logits,
            ref(input_ids=packed, position_ids=pos).logits,
            family,
            "packed logits",
        )
    model.save_pretrained(tmp_path / "f32")
    plain = _class(family).from_pretrained(
        tmp_path / "f32", dtype=torch.float32, ignore_mismatched_sizes=True, attn_implementation=impls[0]
    )
    converted = mh.to_mode_moe(copy.deepcopy(plain))
    assert_matches(
        _logits(converted, ids, mask),
        _logits(plain, ids, mask),
        family,
        f"logits after from_pretrained(ignore_mismatched_sizes, attn_implementation={impls[0]!r})",
    )
    # dtype=bfloat16: the converted model's own numbers, through its own save_pretrained round trip, bit for bit
    # (against transformers' bfloat16 model the routing may differ: mode's routers take float32 logits)
    half = _class(family).from_pretrained(tmp_path / "f32", dtype=torch.bfloat16)
    broken = _failure(_logits, half, ids, mask)  # transformers' own model in bfloat16
    mh.to_mode_moe(half)
    assert {s.moe.experts.w_in.dtype for s in mh.converted_moe(half).values()} == {torch.bfloat16}
    if broken is not None:  # transformers 5.17's DeepSeek-V4: float32 hyper-connections meet bfloat16 projections
        with pytest.raises(type(broken), match=re.escape(str(broken))):  # ours fails there, as transformers' own
            _logits(half, ids, mask)
    else:
        expected = _logits(half, ids, mask)
        assert expected.isfinite().all()
        half.save_pretrained(tmp_path / "bf16")
        again = mh.to_mode_moe(_class(family).from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16))
        assert torch.equal(_logits(again, ids, mask), expected)
    for m in (model, ref):
        torch.manual_seed(0)
        m.resize_token_embeddings(mm.V + 8, mean_resizing=False)
    # a new token id (DeepSeek-V4's hash layers route by a (vocab, k) table transformers does not resize: old ids)
    new_id = mm.V + 3 if SPECS[_model_type(family)].hash_table is None else 5
    ids2 = torch.cat([ids, torch.full_like(ids[:, :2], new_id)], 1)
    mask2 = torch.cat([mask, torch.ones_like(mask[:, :2])], 1)
    assert_matches(_logits(model, ids2, mask2), _logits(ref, ids2, mask2), family, "logits after resizing")

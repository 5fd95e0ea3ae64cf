"""Every model class a family defines, converted, behaves as the family's own (issue 66): the base model and the
sequence-classification, token-classification and question-answering heads save in the family's layout (a class
that cannot generate writes no generation config), reload through plain transformers and into a converted model
with equal outputs (the routers included), initialise every tensor through ``_init_weights``, keep the family's
fp32 tensors in fp32, and honour ``ignore_mismatched_sizes``. A model transformers has split with its own tensor
parallelism is refused by name. Four families (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3), tiny, on the CPU."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install 'mode-torch[hf]')"
)

import mode.hf as mh  # noqa: E402
from mode.hf.moe.saving import mode_names, transformers_state_dict  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import moe_models as mm  # noqa: E402
from test_hf_moe import assert_matches  # noqa: E402

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"]
HEADS = ["Model", "ForCausalLM", "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering"]
NO_HEAD = {("deepseek_v3", "ForQuestionAnswering")}  # DeepSeek-V3 defines no question-answering head
CLASSES = [(f, h) for f in FAMILIES for h in HEADS if (f, h) not in NO_HEAD]
PREFIX = {"mixtral": "Mixtral", "qwen2_moe": "Qwen2Moe", "qwen3_moe": "Qwen3Moe", "deepseek_v3": "DeepseekV3"}


def _cls(family: str, head: str):
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    name = PREFIX[family] + head
    if not hasattr(module, name):
        pytest.fail(f"{name}: not in transformers {transformers.__version__} (the head list above is out of date)")
    return getattr(module, name)


def _build(family: str, head: str, seed: int = 0):
    """The class ``head`` of ``family``, every tensor drawn (transformers zeroes routers and biases at init, which
    would hide a tensor that did not reload), converted."""
    torch.manual_seed(seed)
    model = _cls(family, head)(mm.config(family, num_labels=3))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.is_floating_point() and "inv_freq" not in name:
                t.copy_(torch.randn(t.shape, generator=g) * (0.05 if "bias" in name else t.shape[-1] ** -0.5))
    return mh.to_mode_moe(model.eval())


def _outputs(model, ids, mask) -> list[torch.Tensor]:
    with torch.no_grad():
        out = model.eval()(input_ids=ids, attention_mask=mask)
    return [v for v in out.values() if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize("family, head", CLASSES)
def test_every_class_saves_the_family_layout_and_reloads_equal(family, head, tmp_path):
    model = _build(family, head)
    ids = torch.randint(3, mm.V, (2, 9))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    expected = _outputs(model, ids, mask)
    model.save_pretrained(tmp_path)  # raised AttributeError (generation_config) for every class but the causal LM
    assert (tmp_path / "generation_config.json").exists() == model.can_generate()
    plain, info = type(model).from_pretrained(tmp_path, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # the family's own names: nothing missing, unexpected or re-initialised
    assert not mh.converted_moe(plain)
    for got, want in zip(_outputs(plain, ids, mask), expected, strict=True):  # another summation order: the
        assert_matches(got, want, family, f"{head} reloaded in plain transformers")  # families' scaled bound
    again = mh.to_mode_moe(plain)  # and back into a converted model: every tensor, the routers included
    theirs = again.state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(theirs[k], v), k
    assert any(".moe.router." in k for k in theirs)
    for got, want in zip(_outputs(again, ids, mask), expected, strict=True):
        assert torch.equal(got, want)
    fresh = _build(family, head, seed=1)  # a family checkpoint loaded into a converted model (load_state_dict)
    fresh.load_state_dict(transformers_state_dict(model), strict=True)
    for got, want in zip(_outputs(fresh, ids, mask), expected, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_class_initialises_every_tensor_through_init_weights(family):
    """Built on meta, converted, materialised and initialised (transformers' way to load): every tensor of every
    class is set by ``_init_weights`` (none left as the uninitialised memory ``to_empty`` gives), and the buffers
    equal those of the same class built on the CPU (transformers' test_init_weights_can_init_buffers)."""
    for head in [h for f, h in CLASSES if f == family]:
        torch.manual_seed(0)
        cpu = mh.to_mode_moe(_cls(family, head)(mm.config(family, num_labels=3)))
        with torch.device("meta"):
            meta = _cls(family, head)(mm.config(family, num_labels=3))
        mh.to_mode_moe(meta)
        meta.to_empty(device="cpu")
        with torch.no_grad():  # what to_empty may leave: make any tensor _init_weights skips stand out
            for t in [*meta.parameters(), *meta.buffers()]:
                if t.is_floating_point():
                    t.fill_(float("nan"))
        meta.init_weights()
        for name, t in [*meta.named_parameters(), *meta.named_buffers()]:
            if t.is_floating_point():
                assert torch.isfinite(t).all(), f"{head}: {name} not initialised"
        want = dict(cpu.named_buffers())
        got = dict(meta.named_buffers())
        assert set(got) == set(want), head
        for k, v in want.items():
            assert torch.equal(got[k], v), (head, k)


def test_fp32_modules_stay_fp32_and_name_tensors_that_exist(tmp_path):
    """DeepSeek-V3's strict fp32 rule (``e_score_correction_bias``): every pattern of every converted class names
    a tensor it has (the family's names nothing now and is dropped; ours names the router's ``bias_X``), and a
    converted model loaded in float16 or bfloat16 keeps that tensor in float32, every other in the load dtype."""
    import re

    for head in [h for f, h in CLASSES if f == "deepseek_v3"]:
        model = _build("deepseek_v3", head)
        names = list(model.state_dict())
        patterns = model._keep_in_fp32_modules | model._keep_in_fp32_modules_strict
        assert patterns == {"moe.router.bias_X"}, head
        for p in patterns:
            assert any(re.search(rf"(?:^|\.){p}(?:\.|$)", n) for n in names), (head, p)
        model.save_pretrained(tmp_path / head)
        for dtype in (torch.float16, torch.bfloat16):
            loaded = mh.to_mode_moe(type(model).from_pretrained(tmp_path / head, dtype=dtype))
            for n, t in loaded.state_dict().items():
                if t.is_floating_point():
                    want = torch.float32 if n.endswith("moe.router.bias_X") else dtype
                    assert t.dtype == want, (head, n, t.dtype)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_ignore_mismatched_sizes_reinitialises_the_head_only(family, tmp_path):
    """A converted classifier saved with 3 labels reloads with 5 (``ignore_mismatched_sizes=True``): the score
    head is re-initialised (reported as mismatched, under its own name), every other tensor is the saved one;
    without the flag the load raises, as transformers does."""
    model = _build(family, "ForSequenceClassification")
    model.save_pretrained(tmp_path)
    with pytest.raises(RuntimeError):
        type(model).from_pretrained(tmp_path, num_labels=5)
    loaded, info = type(model).from_pretrained(tmp_path, num_labels=5, ignore_mismatched_sizes=True,
                                               output_loading_info=True)  # fmt: skip
    assert [k for k, *_ in info["mismatched_keys"]] == ["score.weight"], info
    mh.to_mode_moe(loaded)
    saved = model.state_dict()
    for k, v in loaded.state_dict().items():
        if k == "score.weight":
            assert v.shape == (5, mm.D)
        else:
            assert torch.equal(v, saved[k]), k


def test_mode_names_inverts_the_family_names():
    """A load report's (or a checkpoint's) family names, as the converted model names the same tensors."""
    model = _build("qwen2_moe", "ForCausalLM")
    theirs = list(transformers_state_dict(model))
    assert sorted(mode_names(model, theirs)) == sorted(model.state_dict())
    assert mode_names(model, ["lm_head.weight"]) == ["lm_head.weight"]


def test_a_model_split_by_transformers_tensor_parallelism_is_refused():
    """``from_pretrained(tp_plan=...)`` / ``distributed_config`` leave the blocks' tensors split across ranks
    (``_tp_size`` > 1): mode's layers need them whole, and its own expert parallelism shards them."""
    model = _cls("qwen3_moe", "ForCausalLM")(mm.config("qwen3_moe"))
    model._tp_size = 2
    with pytest.raises(
        ValueError, match=r"sharded by transformers' tensor or expert parallelism \(tp_size=2.*parallelize"
    ):
        mh.to_mode_moe(model)
    assert not mh.converted_moe(model)

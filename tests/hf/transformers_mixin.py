"""transformers' own ``ModelTesterMixin`` (``tests/test_modeling_common.py`` of the installed release's sdist, which
the wheel does not ship) run on models converted by ``mode.hf.to_mode_moe``, with a model tester of our own.

    package = mixin_package()          # the sdist's file, unchanged, in an importable package (cached)
    case = mixin_case("qwen3_moe")     # a unittest.TestCase class: ModelTesterMixin + our tester for the family
    run_mixin(case, ["test_save_load"])   # -> {test id: "passed" | "failed: ..." | "skipped: ..."}

The sdist is fetched once with ``pip download --no-binary :all: --no-deps transformers==<installed>`` into
``$MODE_CACHE`` (default ``~/.cache/mode``), written atomically: the file that is tested is always the release
of the transformers that is installed (5.23.0 in CI; the range's other end in its own run, docs/testing.md).
Two relative imports of the file are not in the sdist either (``.generation.test_utils``, the generate tests'
mixin; ``.exporters.test_export``, torch.export's): they get empty mixins, so those tests are not run here.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import unittest
from pathlib import Path

import torch

from tests.hf.convert_on_construct import converting
from tests.hf.moe_models import config as family_config

# The families whose every class the mixin runs on here (3 of the 6 measured in docs/adopt_moe.md): Mixtral
# (plain top-k softmax), Qwen2-MoE (shared expert with its sigmoid gate), DeepSeek-V3 (sigmoid scores, groups,
# correction bias kept in fp32, a dense first layer). Each defines the base model, the causal LM and heads.
FAMILIES = ("mixtral", "qwen2_moe", "deepseek_v3")

_STUBS = {
    "generation/test_utils.py": "class GenerationTesterMixin:\n    pass\n",
    "exporters/test_export.py": "class ExportTesterMixin:\n    pass\n",
}


def cache_dir() -> Path:
    return Path(os.environ.get("MODE_CACHE", Path.home() / ".cache" / "mode"))


def mixin_package() -> str:
    """The importable package (its name; its folder is put on ``sys.path``) holding the installed transformers
    release's ``test_modeling_common.py``; downloads the sdist the first time (about 10 MB from PyPI)."""
    import transformers

    version = transformers.__version__
    name = "hf_model_tests_" + version.replace(".", "_")
    root = cache_dir() / "transformers-tests"
    pkg = root / name
    if not (pkg / "test_modeling_common.py").exists():
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
        try:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:", "--no-deps"]
                + [f"transformers=={version}", "-d", str(tmp)],
                check=True,
                timeout=600,
            )
            (sdist,) = tmp.glob("transformers-*.tar.gz")
            member = f"transformers-{version}/tests/test_modeling_common.py"
            with tarfile.open(sdist) as tar:
                data = tar.extractfile(member)
                assert data is not None, member
                source = data.read()
            out = tmp / name
            out.mkdir()
            (out / "test_modeling_common.py").write_bytes(source)  # unchanged
            (out / "__init__.py").write_text("")
            for rel, text in _STUBS.items():
                (out / rel).parent.mkdir(exist_ok=True)
                (out / rel).parent.joinpath("__init__.py").write_text("")
                (out / rel).write_text(text)
            try:
                out.rename(pkg)  # atomic: another worker may have won the race, and then its copy stays
            except OSError:
                if not (pkg / "test_modeling_common.py").exists():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return name


class ConvertedModelTester:
    """What the mixin reads of a model tester: a small config of the family (tests/hf/moe_models.config, every
    routed path on: top-k 2 or 4, shared experts, groups) and its inputs (random ids, a left-padding mask)."""

    batch_size = 2
    seq_length = 7
    is_training = True

    def __init__(self, parent: unittest.TestCase, family: str):
        self.parent = parent
        self.family = family
        cfg = self.get_config()
        self.vocab_size = cfg.vocab_size
        self.hidden_size = cfg.hidden_size
        self.num_hidden_layers = cfg.num_hidden_layers
        self.num_attention_heads = cfg.num_attention_heads

    def get_config(self):
        cfg = family_config(self.family, num_labels=3)
        cfg._attn_implementation = None  # the mixin picks the attention backend per test
        if getattr(cfg, "head_dim", 0) is None:  # Mixtral's default; transformers' rope scaling helpers read it
            cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
        return cfg

    def prepare_config_and_inputs_for_common(self):
        ids_BS = torch.randint(3, self.vocab_size, (self.batch_size, self.seq_length))
        mask_BS = torch.ones_like(ids_BS)
        mask_BS[0, :2] = 0  # one row left-padded
        return self.get_config(), {"input_ids": ids_BS, "attention_mask": mask_BS}


def _family_classes(family: str) -> tuple[type, ...]:
    """The family's model classes: the base model, the causal LM and the heads it defines."""
    from transformers import PreTrainedModel

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    return tuple(
        c
        for c in vars(module).values()
        if isinstance(c, type)
        and issubclass(c, PreTrainedModel)
        and c.__module__ == module.__name__
        and not c.__name__.endswith("PreTrainedModel")
    )


def mixin_case(family: str) -> type[unittest.TestCase]:
    """``ModelTesterMixin`` + ``unittest.TestCase`` for ``family``'s classes, with our tester; every model the
    tests build or load is converted (``convert_on_construct.converting``)."""
    common = importlib.import_module(mixin_package() + ".test_modeling_common")

    def setUp(self):
        torch.manual_seed(0)
        self.model_tester = ConvertedModelTester(self, family)

    generation = importlib.import_module(mixin_package() + ".generation.test_utils")
    return type(
        f"Converted_{family}_Test",
        # the generate tests are not run (their mixin is not in the sdist); the mixin checks a generative
        # model's tester names it
        (common.ModelTesterMixin, generation.GenerationTesterMixin, unittest.TestCase),
        {"all_model_classes": _family_classes(family), "setUp": setUp, "test_all_params_have_gradient": False},
    )


def run_mixin(case: type[unittest.TestCase], names: list[str], convert: bool = True) -> dict[str, str]:
    """Run the named tests of ``case`` (a name matches every parameterisation: ``test_eager_matches_sdpa_inference``
    is its 25 cases) with the family's models converted (or not: ``convert=False``, the baseline); returns each
    test's outcome."""
    every = unittest.TestLoader().getTestCaseNames(case)
    tests = [n for n in every if any(n == x or n.startswith(x + "_") for x in names)]
    missing = [x for x in names if not any(n == x or n.startswith(x + "_") for n in tests)]
    if missing:
        raise ValueError(f"names={missing}: not tests of {case.__name__}'s mixin")
    suite = unittest.TestSuite(case(n) for n in tests)
    result = unittest.TestResult()
    family = case.__name__.removeprefix("Converted_").removesuffix("_Test")
    with converting([family] if convert else []):
        suite.run(result)
    out = dict.fromkeys(tests, "passed")
    for test, why in result.failures + result.errors:
        out[_name(test)] = "failed: " + why.strip().splitlines()[-1][:300]
    for test, why in result.skipped:
        out[_name(test)] = "skipped: " + str(why)[:200]
    return out


def _name(test) -> str:
    # a subTest's failure names its parent test
    parent = getattr(test, "test_case", test)
    return parent.id().rpartition(".")[2]

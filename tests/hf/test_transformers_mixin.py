"""transformers' own ``ModelTesterMixin`` (the installed release's ``tests/test_modeling_common.py``, unchanged, from
its sdist) on converted models of 3 families, every class each defines (the base model, the causal LM, the
sequence-classification, token-classification and question-answering heads): issue 66.

Every test of the mixin runs, in three groups per family (each well under a minute): the save/load tests, the
eager-vs-sdpa tests, and the rest. A test passes or skips as it does for the family's own models, except those
of ``KNOWN``: each fails for the reason written beside it (docs/adopt_moe.md's table), and is checked to still fail, so
that the list cannot go stale.
"""

from __future__ import annotations

import unittest

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'mode-torch[hf]')")

from tests.hf.transformers_mixin import FAMILIES, mixin_case, run_mixin

# The mixin's tests that fail on a converted model, on purpose, with the reason (docs/adopt_moe.md, "transformers' own
# model tests").
KNOWN = {
    "test_eager_matches_batched_and_grouped_inference": (
        "it switches transformers' experts kernels (eager, batched_mm, grouped_mm) and checks that each of them is "
        "called: a converted model's experts are mode's, and set_experts_implementation refuses batched_mm by name"
    ),
    "test_from_pretrained_no_checkpoint": (
        "it hands the converted model's state_dict() (mode's names) to the family's from_pretrained(state_dict=...), "
        "which reads the family's names: mode.hf.moe.saving.transformers_state_dict(model) is that state dict"
    ),
}

SAVE_LOAD = (
    "test_save_load",
    "test_save_load_keys_to_ignore_on_save",
    "test_torch_save_load",
    "test_can_use_safetensors",
    "test_load_save_without_tied_weights",
    "test_correct_missing_keys",
    "test_bc_torch_dtype",
    "test_base_model_prefix_loads_base_weights",
    "test_load_contiguous_weights",
    "test_reverse_loading_mapping",
    "test_cannot_load_with_meta_device_context_manager",
    "test_model_weights_reload_no_missing_tied_weights",
    "test_can_load_from_already_mapped_keys",
    "test_can_init_all_missing_weights",
    "test_init_weights_can_init_buffers",
    "test_keep_in_fp32_modules",
    "test_keep_in_fp32_modules_exist",
    "test_load_with_mismatched_shapes",
    "test_can_load_ignoring_mismatched_shapes",
    "test_from_pretrained_no_checkpoint",
)
SDPA = ("test_eager_matches_sdpa_inference", "test_eager_matches_batched_and_grouped_inference")


def _group(case, group: str) -> list[str]:
    """The group's tests that this transformers release's mixin has (an older one lacks a few)."""
    every = unittest.TestLoader().getTestCaseNames(case)
    if group == "rest":
        return [n for n in every if not any(n == x or n.startswith(x + "_") for x in SAVE_LOAD + SDPA)]
    names = SAVE_LOAD if group == "save_load" else SDPA
    return [x for x in names if any(n == x or n.startswith(x + "_") for n in every)]


def _known(test: str) -> str | None:
    return next((why for name, why in KNOWN.items() if test == name or test.startswith(name + "_")), None)


@pytest.mark.parametrize("group", ["save_load", "sdpa", "rest"])
@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_model_tests_pass_on_converted_models(family, group):
    case = mixin_case(family)
    outcome = run_mixin(case, _group(case, group))
    assert len(outcome) >= (25 if group == "sdpa" else 15), outcome  # the groups are the mixin's tests, not empty
    unexpected = {t: o for t, o in outcome.items() if o.startswith("failed") and _known(t) is None}
    assert not unexpected, unexpected
    stale = [t for t, o in outcome.items() if _known(t) is not None and not o.startswith("failed")]
    assert not stale, f"{stale}: pass (or skip) now; take them out of KNOWN and docs/adopt_moe.md"
    if group == "save_load":  # the tests that issue 66 found failing all ran (none skipped)
        ran = {t for t, o in outcome.items() if not o.startswith("skipped")}
        assert {"test_save_load", "test_can_use_safetensors", "test_can_init_all_missing_weights"} <= ran, outcome

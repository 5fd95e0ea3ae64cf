"""What a new user runs first stays runnable: the README's Python snippets and
examples/custom_transformer.py (at 3 steps). The other examples have their own tests (grep tests for
'examples')."""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def readme_snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_the_readme_has_its_snippets():
    assert len(readme_snippets()) >= 2  # the layers, and MoD around a block of one's own


@pytest.mark.parametrize("index", range(len(readme_snippets())))
def test_each_readme_snippet_runs(index):
    namespace: dict = {}
    torch.manual_seed(0)
    exec(compile(readme_snippets()[index], f"README.md python block {index}", "exec"), namespace)
    if {"x", "y", "aux"} <= namespace.keys():  # a MoD snippet: the skipped tokens are unchanged
        stats = namespace["aux"].stats["mod.router"]
        routed_BS = stats.compute_T.view(stats.batch_shape).bool()
        assert 0 < int(routed_BS.sum()) < routed_BS.numel()
        assert torch.equal(namespace["y"][~routed_BS], namespace["x"][~routed_BS])


def test_the_readme_quick_start_is_the_quick_run_and_keeps_the_test_command():
    text = (ROOT / "README.md").read_text()
    quick = text[text.index("## Quick start"):text.index("**The full run.**")]
    block = re.search(r"```bash\n(.*?)```", quick, re.S).group(1)
    lines = [line.split("#")[0].strip() for line in block.strip().splitlines()]
    assert lines[0].startswith("git clone ") and lines[0].endswith("&& cd mode")
    assert lines[1:] == ["pip install torch==2.13.0", "pip install -e .", "mode compare --quick"]
    assert 'pip install torch==2.13.0 && pip install -e ".[test]" && python -m pytest -q' in text  # CI runs it


def test_custom_transformer_example_trains_and_prints_a_line_every_n_steps(capsys):
    spec = importlib.util.spec_from_file_location("custom_transformer_example",
                                                  ROOT / "examples" / "custom_transformer.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    n = torch.get_num_threads()
    try:
        out = example.main(["--steps", "3", "--log-every", "2", "--batch", "2", "--seq", "32"])
    finally:
        torch.set_num_threads(n)
    printed = capsys.readouterr().out
    assert [line.split()[1] for line in printed.splitlines() if line.startswith("step ")] == ["2/3", "3/3"]
    assert math.isfinite(out["val_loss"]) and out["val_loss"] < math.log(256) + 1
    assert "mod_own.mod.router" in out["stats"]  # MoD around the example's own block routed tokens
    assert "mod_own" in printed

"""What a new user runs first stays runnable: the Python blocks of the README and of the tutorials
(docs/tutorial_*.md), and examples/custom_transformer.py (at 3 steps). The other examples have their own tests
(grep tests for 'examples')."""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


PAGES = ["README.md", "docs/tutorial_first_model.md", "docs/tutorial_convert.md"]


def python_blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), re.S)


def readme_snippets() -> list[str]:
    return python_blocks("README.md")


SNIPPETS = [(page, i) for page in PAGES for i in range(len(python_blocks(page)))]


def test_the_pages_have_their_snippets():
    assert len(readme_snippets()) >= 1  # MoD and MoE composed (staged MoDE)
    assert "StagedMoDE" in readme_snippets()[0] and "MoELayer" in readme_snippets()[0]
    assert len(python_blocks("docs/tutorial_first_model.md")) >= 2  # the layers, and MoD around a block of one's own
    assert any("to_mode_moe" in block for block in python_blocks("docs/tutorial_convert.md"))


@pytest.mark.parametrize("page,index", SNIPPETS, ids=[f"{page}:{i}" for page, i in SNIPPETS])
def test_each_snippet_runs(page, index):
    code = python_blocks(page)[index]
    if "transformers" in code:
        pytest.importorskip("transformers", reason="mode.hf needs transformers 5.x: pip install -e '.[hf]'")
    namespace: dict = {}
    torch.manual_seed(0)
    exec(compile(code, f"{page} python block {index}", "exec"), namespace)
    if {"x", "y", "aux"} <= namespace.keys():  # a MoD snippet: the skipped tokens are unchanged
        stats = namespace["aux"].stats["mod.router"]
        routed_BS = stats.compute_T.view(stats.batch_shape).bool()
        assert 0 < int(routed_BS.sum()) < routed_BS.numel()
        assert torch.equal(namespace["y"][~routed_BS], namespace["x"][~routed_BS])


def test_the_readme_quick_start_is_the_quick_run_and_keeps_the_test_command():
    text = (ROOT / "README.md").read_text()
    quick = text[text.index("## Quick start") : text.index("**Tests**")]
    block = re.search(r"```bash\n(.*?)```", quick, re.S).group(1)
    lines = [line.split("#")[0].strip() for line in block.strip().splitlines()]
    assert lines[0].startswith("git clone ") and lines[0].endswith("&& cd mode")
    assert lines[1:] == ["pip install torch==2.13.0", "pip install -e .", "mode compare --quick"]
    assert 'pip install torch==2.13.0 && pip install -e ".[test]" && python -m pytest -q' in text  # CI runs it


def test_custom_transformer_example_trains_and_prints_a_line_every_n_steps(capsys):
    spec = importlib.util.spec_from_file_location(
        "custom_transformer_example", ROOT / "examples" / "custom_transformer.py"
    )
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

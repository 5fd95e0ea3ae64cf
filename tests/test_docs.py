"""Numbers in README.md and docs/*.md that drift stay true or stay out.

Test counts go stale with every test added, so the docs state none (the size of a suite is what
``python -m pytest --collect-only -q PATH | tail -1`` prints); only the run records keep theirs, each the dated
result of the command shown beside it. The count of transformers MoE families is kept where a reader needs it
and is checked against ``mode.hf.moe.families``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN_RECORDS = {"gpu.md", "results-gpu.md"}  # past runs: each count is one run's output, its command beside it

TEST_COUNT = re.compile(r"\b\d[\d,]*\s+(?:[\w-]+\s+)?(?:tests?|passed)\b")
FAMILY_COUNTS = {  # phrase -> which table of mode.hf.moe.families it counts
    re.compile(r"\b(\d+) (?:transformers |MoE )families\b"): "FAMILIES",
    re.compile(r"\b(\d+) model types convert\b"): "FAMILIES",
    re.compile(r"\b(\d+) say what they still need\b"): "NOT_YET",
    re.compile(r"\b(\d+) encoder-decoders are refused\b"): "REFUSED",
}


def count_claims(text: str) -> list[str]:
    return [m.group() for m in TEST_COUNT.finditer(text)]


def test_the_docs_state_no_test_counts():
    found = [
        f"{path.relative_to(ROOT)}:{i}: {claim!r}"
        for path in DOCS
        if path.name not in RUN_RECORDS
        for i, line in enumerate(path.read_text().splitlines(), 1)
        for claim in count_claims(line)
    ]
    assert not found, (
        "test counts in the docs go stale; drop them (or record a run in docs/gpu.md with its "
        "command):\n" + "\n".join(found)
    )


def test_the_count_pattern_finds_what_went_stale():
    assert count_claims("(`python -m pytest`, 3421 tests in 12.5 minutes on 2 cores") == ["3421 tests"]
    assert count_claims("tests/hf/   # 110 tests, ~25 s on one CPU thread") == ["110 tests"]
    assert count_claims("only the 50 tests that need a GPU skip; 2,560 passed") == ["50 tests", "2,560 passed"]
    assert count_claims("8 SmolLM2 tests") == ["8 SmolLM2 tests"]
    assert not count_claims("3 families × 2 parts, tests/hf/test_hf.py, 12.5 minutes")


def test_family_counts_match_the_family_table():
    pytest.importorskip("transformers", reason="mode.hf needs transformers 5.x: pip install -e '.[hf]'")
    from mode.hf.moe import families

    claims = []
    for path in DOCS:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            for pattern, table in FAMILY_COUNTS.items():
                for m in pattern.finditer(line):
                    n = int(m.group(1))
                    claims.append((f"{path.relative_to(ROOT)}:{i}", table, n))
    assert {table for _, table, _ in claims} == {"FAMILIES", "NOT_YET", "REFUSED"}, claims  # the patterns match
    wrong = [
        f"{where}: {n} (len({table}) is {len(getattr(families, table))})"
        for where, table, n in claims
        if n != len(getattr(families, table))
    ]
    assert not wrong, "family counts that differ from mode.hf.moe.families:\n" + "\n".join(wrong)


def test_the_readme_is_a_landing_page_under_10_kb():
    size = len((ROOT / "README.md").read_bytes())
    assert size < 10_000, f"README.md is {size} bytes: move detail into docs/ (docs/results.md, docs/commands.md)"


def test_relative_links_in_the_readme_and_docs_resolve():
    """Every relative link's file exists (anchors are checked by ``mkdocs build --strict`` for docs/)."""
    broken = []
    for path in [*DOCS, *sorted((ROOT / "docs").glob("*/*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"[a-z]+:|#", target):
                continue
            if not (path.parent / target.split("#")[0]).exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert not broken, "links to missing files:\n" + "\n".join(broken)


def test_what_left_the_readme_is_in_the_docs():
    """The README keeps a summary; the command table, the conventions and the results with their commands live
    in docs/ (moved there, not dropped)."""
    commands = (ROOT / "docs" / "commands.md").read_text()
    for command in (
        "mode compare",
        "mode isoflop",
        "mode sample",
        "mode report",
        "mode train",
        "mode tokenize",
        "mode export",
        "python benchmarks/layers/bench_performance.py",
    ):
        assert f"| `{command}" in commands, command
    assert "## Conventions" in commands and "status 2" in commands and "--force" in commands
    results = (ROOT / "docs" / "results.md").read_text()
    for heading in (
        "Against the isoFLOP-optimal dense model",
        "Speed",
        "MoE recipes",
        "transformers MoE models",
        "MoD on a real pretrained model",
        "Correctness",
    ):
        assert f"## {heading}" in results, heading
    assert "benchmarks/layers/count_ops.py" in results and "mode isoflop" in results  # numbers beside their commands
    assert "| piece | module |" in (ROOT / "docs" / "architecture.md").read_text()
    readme = (ROOT / "README.md").read_text()
    for page in ("docs/results.md", "docs/commands.md", "docs/tutorial_first_model.md"):
        assert page in readme, f"the README links {page}"


def test_no_page_is_over_800_lines_and_the_how_tos_over_400():
    """Issue 70: a how-to is read top to bottom; the experiment history lives in docs/results/."""
    long = {
        str(p.relative_to(ROOT)): n
        for p in [*sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "results").glob("*.md"))]
        if (n := len(p.read_text().splitlines())) > 800
    }
    assert not long, long
    for how_to in ("convert_and_heal.md", "adopt_moe.md"):
        assert len((ROOT / "docs" / how_to).read_text().splitlines()) <= 400, how_to


def test_the_benchmarks_index_names_every_result_file():
    """docs/benchmarks.md's index: every file under benchmarks/results/ with the claim it backs and its command."""
    index = (ROOT / "docs" / "benchmarks.md").read_text()
    missing = [
        str(p.relative_to(ROOT / "benchmarks" / "results"))
        for p in sorted((ROOT / "benchmarks" / "results").rglob("*"))
        if p.is_file() and f"{p.relative_to(ROOT / 'benchmarks' / 'results')}`" not in index
    ]
    assert not missing, f"not in docs/benchmarks.md's index: {missing}"

"""scripts/junit_compare.py: how many of a baseline run's passing tests pass in another run, per test file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import junit_compare

REPORT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">{}</testsuite></testsuites>"""


def _case(module: str, name: str, tag: str = "", message: str = "") -> str:
    inner = f'<{tag} message="{message}"/>' if tag else ""
    return f'<testcase classname="tests.models.{module}.T" name="{name}">{inner}</testcase>'


def test_counts_the_baselines_passes_that_pass_again_and_names_the_rest(tmp_path, capsys):
    base = tmp_path / "base.xml"
    other = tmp_path / "other.xml"
    base.write_text(REPORT.format("".join([
        _case("a", "t1"), _case("a", "t2"), _case("a", "t3", "skipped", "no GPU"), _case("b", "t1"),
        _case("b", "t2", "failure", "flaky"),
    ])))  # fmt: skip
    other.write_text(REPORT.format("".join([
        _case("a", "t1"), _case("a", "t2", "failure", "AssertionError: 1 != 2"), _case("a", "t3"),
        _case("b", "t1", "skipped", "needs X"), _case("b", "t2"),
    ])))  # fmt: skip
    out = tmp_path / "cmp.json"
    assert junit_compare.main([str(base), str(other), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    a, b = result["groups"]["tests/models/a.py"], result["groups"]["tests/models/b.py"]
    assert (a["baseline_passed"], a["passed"]) == (2, 1) and (b["baseline_passed"], b["passed"]) == (1, 0)
    assert a["not_passed"] == {"tests/models/a.py::T::t2": "failed: AssertionError: 1 != 2"}
    assert b["not_passed"] == {"tests/models/b.py::T::t1": "skipped: needs X"}
    assert result["total"] == {"baseline_passed": 3, "passed": 1, "share": 1 / 3}
    assert "| **all** | 3 | 1 | 33.3% |" in capsys.readouterr().out

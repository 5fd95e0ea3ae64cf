"""Compare two pytest ``--junitxml`` reports of the same tests: how many of the tests that pass in the first (the
baseline) pass in the second, per group, and which do not, with the reason pytest gave.

    python scripts/junit_compare.py baseline.xml converted.xml --group-by file
    python scripts/junit_compare.py baseline.xml converted.xml --json out.json

Used for transformers' own model tests run unchanged on models converted by ``mode.hf.to_mode_moe``
(docs/adopt_moe.md, "transformers' own model tests"): the baseline is the same run without the conversion.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def outcomes(path: str | Path) -> dict[str, tuple[str, str]]:
    """Test id (``file::class::name``) -> (``passed`` / ``failed`` / ``skipped``, the message)."""
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        module, _, cls = case.get("classname", "").rpartition(".")
        test = f"{module.replace('.', '/')}.py::{cls}::{case.get('name')}"
        state, why = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                state = "skipped" if tag == "skipped" else "failed"
                why = (node.get("message") or "").strip().splitlines()[0][:200] if node.get("message") else ""
                break
        if test in out and out[test][0] == "failed":  # a test reported twice (an error in teardown): failed wins
            continue
        out[test] = (state, why)
    return out


def group_of(test: str, by: str) -> str:
    if by == "file":
        return test.split("::", 1)[0]
    return "all"


def compare(baseline: dict, other: dict, by: str = "file") -> dict:
    """Per group: the baseline's passes, how many pass in ``other``, and the rest with their outcome there."""
    groups: dict = defaultdict(lambda: {"baseline_passed": 0, "passed": 0, "not_passed": {}})
    for test, (state, _) in baseline.items():
        if state != "passed":
            continue
        g = groups[group_of(test, by)]
        g["baseline_passed"] += 1
        got = other.get(test, ("missing", "not run"))
        if got[0] == "passed":
            g["passed"] += 1
        else:
            g["not_passed"][test] = f"{got[0]}: {got[1]}"
    total = {"baseline_passed": sum(g["baseline_passed"] for g in groups.values())}
    total["passed"] = sum(g["passed"] for g in groups.values())
    total["share"] = total["passed"] / max(total["baseline_passed"], 1)
    return {"groups": dict(groups), "total": total}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("baseline")
    p.add_argument("other")
    p.add_argument("--group-by", choices=("file", "all"), default="file")
    p.add_argument("--json", default=None, help="write the comparison here")
    args = p.parse_args(argv)
    result = compare(outcomes(args.baseline), outcomes(args.other), args.group_by)
    print("| group | pass in the baseline | pass in the other | share |")
    print("|---|---|---|---|")
    for name, g in sorted(result["groups"].items()):
        print(f"| {name} | {g['baseline_passed']} | {g['passed']} | {g['passed'] / max(g['baseline_passed'], 1):.1%} |")
    t = result["total"]
    print(f"| **all** | {t['baseline_passed']} | {t['passed']} | {t['share']:.1%} |")
    for g in result["groups"].values():
        for test, why in sorted(g["not_passed"].items()):
            print(f"{test}: {why}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

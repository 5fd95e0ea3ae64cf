"""Render a gpu_suite.json (benchmarks/gpu/gpu_suite.py) as Markdown: the goals, every stage's numbers, the MoE
table beside the peers, decode, training, the profiler's top kernels, and what failed or was not run.

    PYTHONPATH=. python benchmarks/gpu/gpu_report.py benchmarks/results/gpu_suite_h200.json > report.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def _table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]
    return out


def render(payload: dict) -> str:
    budget = "no overall deadline" if payload.get("budget_s") is None else f"of a {payload['budget_s']:.0f} s budget"
    lines = [
        f"Device: **{payload.get('device', '?')}**; command: `{payload.get('command')}`; "
        f"{payload.get('seconds', '?')} s, {budget}"
        f"{' (smoke run)' if payload.get('smoke') else ''}.",
        "",
    ]
    versions = payload.get("versions") or {}
    if versions:
        lines += ["Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items() if k != "nvidia_smi") + ".", ""]
        if versions.get("nvidia_smi"):
            lines += ["```text", versions["nvidia_smi"], "```", ""]
    lines += ["### Goals", ""]
    lines += _table(
        ["goal", "measured", "rule", "verdict"],
        [[g["goal"], g["value"], g["rule"], g["verdict"]] for g in payload.get("goals", [])],
    )
    lines += ["", "### Stages", ""]
    lines += _table(
        ["stage", "status", "seconds", "limit s", "error or note"],
        [
            [
                n,
                r["status"] + (" (slow)" if r.get("slow") else ""),
                r.get("seconds"),
                r.get("limit_s"),
                (r.get("error") or r.get("reason") or r.get("slow") or "").replace("|", "/")[:200],
            ]
            for n, r in payload["stages"].items()
        ],
    )
    stages = payload["stages"]
    for name, rec in stages.items():
        if rec["status"] != "ok":
            lines += ["", f"#### {name}: {rec['status']}", "", "```text", *rec.get("tail", []), "```"]
            continue
        lines += ["", f"### {name}", ""]
        lines += _table(["number", "value"], [[k, v] for k, v in rec["numbers"].items()])
        details = rec.get("details", {})
        if name == "tests":
            if details.get("failure_groups"):
                lines += ["", "Failures, grouped by message and library frame:", ""]
                lines += _table(
                    ["tests", "message", "library frame", "test frame", "example"],
                    [
                        [
                            g["count"],
                            g["message"][:160].replace("|", "/"),
                            g["library_frame"],
                            g["test_frame"],
                            g["example"],
                        ]
                        for g in details["failure_groups"]
                    ],
                )
            elif details.get("failed"):
                shown = details["failed"][:25]
                more = len(details["failed"]) - len(shown)
                lines += [
                    "",
                    "Failed (no reasons recorded in this run): "
                    + ", ".join(f"`{t}`" for t in shown)
                    + (f" and {more} more" if more else ""),
                ]
            if details.get("skip_reasons"):
                lines += ["", "Skipped, by reason:", ""]
                lines += _table(["reason", "tests"], sorted(details["skip_reasons"].items(), key=lambda kv: -kv[1]))
            if details.get("summary"):
                lines += ["", f"pytest: {details['summary']}"]
        if name == "moe":
            configs = list(dict.fromkeys(r["config"] for r in details["results"]))
            impls = list(dict.fromkeys(r["implementation"] for r in details["results"]))
            by = {(r["implementation"], r["config"]): r for r in details["results"]}
            header = ["implementation"] + [f"{c}: time / dense bf16" for c in configs] + [f"{c}: ms" for c in configs]
            lines += [
                "",
                *_table(
                    header,
                    [
                        [i]
                        + [by.get((i, c), {}).get("ratio_median") for c in configs]
                        + [by.get((i, c), {}).get("ms") for c in configs]
                        for i in impls
                    ],
                ),
            ]
            if details.get("skipped"):
                lines += ["", "Peers skipped: " + "; ".join(f"{k}: {v}" for k, v in details["skipped"].items())]
        if name == "decode":
            cols = [
                "size",
                "batch",
                "path",
                "mod_decode_tok_s",
                "dense_decode_tok_s",
                "decode_speedup",
                "flop_bound",
                "bytes_bound",
                "routed_fraction_decode",
            ]
            lines += ["", *_table(cols, [[r.get(c) for c in cols] for r in details["results"]])]
        if name == "profile":
            for wl, res in details.get("workloads", {}).items():
                lines += [
                    "",
                    f"**{wl}**: {res['wall_ms']:.2f} ms per step"
                    + (
                        ""
                        if res.get("device_busy_ms") is None
                        else f", device busy {res['device_busy_ms']:.2f} ms ({res['busy_fraction']:.0%})"
                    ),
                    "",
                ]
                lines += _table(
                    ["kernel / op", "ms per step", "share", "calls per step"],
                    [
                        [t["name"].replace("|", "/"), t["ms_per_step"], t["share"], t["calls_per_step"]]
                        for t in res["top"]
                    ],
                )
                if res.get("top_host"):
                    lines += [
                        "",
                        f"Host side: {res['host_ms']:.2f} ms of op CPU time per step, "
                        f"{res['host_ops_per_step']:.0f} ops; the most expensive:",
                        "",
                    ]
                    lines += _table(
                        ["op (host)", "ms per step", "share", "calls per step"],
                        [
                            [t["name"].replace("|", "/"), t["ms_per_step"], t["share"], t["calls_per_step"]]
                            for t in res["top_host"][:6]
                        ],
                    )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", help="a gpu_suite.json")
    args = p.parse_args(argv)
    try:
        payload = json.loads(Path(args.json).read_text())
    except (OSError, ValueError) as err:
        raise SystemExit(f"{args.json}: cannot read a gpu_suite.json ({err})") from None
    if payload.get("suite") != "gpu_suite":
        raise SystemExit(f"{args.json}: not a gpu_suite.json (its 'suite' is {payload.get('suite')!r})")
    sys.stdout.write(render(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The tests and gtests stages: the test suite (and the CUDA-graph, kernel, generate and compile tests) on
CUDA, under the stage's time limit; the pytest output parsed into passed/failed/skipped counts and grouped
failures."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from benchmarks.gpu.stage_base import ROOT, Ctx, kill_group

# The test files that exercise the device, first; the rest of the suite after them, as time allows.
TEST_ORDER = (
    "tests/test_device_switch.py",
    "tests/test_device_asserts.py",
    "tests/test_host_data.py",
    "tests/core",
    "tests/measure",
    "tests/train",
    "tests/parallel/test_meta_init.py",
    "tests/test_architecture.py",
    "tests/hf",
    "tests/experiments",
    "tests/test_errors.py",
    "tests/test_fuzz.py",
)


# The rehearsal on the CPU runs one small file of each list: it checks the stage (pytest started, its output parsed,
# its failures grouped), not the tests, which the suite runs anyway (the whole lists cost 45 CPU-seconds more per
# rehearsal, issue 70). tests/test_gpu_suite.py checks that every entry of the lists names a path.
SMOKE_TESTS = ("tests/core/test_registry.py",)


_RESULT_RE = re.compile(r"^(\S+::\S+.*?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


_XDIST_RE = re.compile(r"^\[gw\d+\] \[\s*\d+%\] (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+::\S+)")


XDIST_WORKERS = 8  # pytest-xdist processes sharing the one GPU, when the plugin is there


_SKIP_RE = re.compile(r"^SKIPPED \[(\d+)\] ([^:]+(?::\d+)?): (.*)$")


def parse_pytest(text: str) -> dict:
    """Counts, failing tests and skip reasons from ``pytest -v -rfEs`` output (complete or cut off)."""
    counts: dict[str, int] = {}
    failed = []
    for line in text.splitlines():
        m = _RESULT_RE.match(line)
        x = None if m else _XDIST_RE.match(line)
        if m or x:
            nodeid, status = (m.group(1), m.group(2).lower()) if m else (x.group(2), x.group(1).lower())
            counts[status] = counts.get(status, 0) + 1
            if status in ("failed", "error"):
                failed.append(nodeid)
    skips: dict[str, int] = {}
    for line in text.splitlines():
        m = _SKIP_RE.match(line)
        if m:
            reason = m.group(3).strip()
            skips[reason] = skips.get(reason, 0) + int(m.group(1))
    summary = next(
        (
            line.strip("= ")
            for line in reversed(text.splitlines())
            if re.search(r"\d+ (passed|failed|error)", line) and line.startswith("=")
        ),
        None,
    )
    return {"counts": counts, "failed": sorted(set(failed)), "skip_reasons": skips, "summary": summary}


def group_failures(failures: list[dict], top: int = 40) -> list[dict]:
    """Failures with the same exception message and library frame, counted, most frequent first (numbers in
    the message are kept: a shape or a value is usually the clue)."""
    groups: dict[tuple, dict] = {}
    for f in failures:
        key = (f["message"][:200], f.get("library_frame"))
        g = groups.setdefault(
            key,
            {
                "count": 0,
                "message": f["message"],
                "library_frame": f.get("library_frame"),
                "test_frame": f.get("test_frame"),
                "example": f["test"],
                "files": set(),
            },
        )
        g["count"] += 1
        g["files"].add(f["test"].split("::")[0])
    ranked = sorted(groups.values(), key=lambda g: -g["count"])[:top]
    return [{**g, "files": sorted(g["files"])} for g in ranked]


def stage_tests(ctx: Ctx) -> dict:
    return run_tests(ctx, SMOKE_TESTS if ctx.smoke else TEST_ORDER)


# tests/kernels first: the fused Triton kernels against their torch references, compiled on the GPU (on the CPU
# they only ever ran in triton's interpreter)
GRAPH_TESTS = (
    "tests/kernels",
    "tests/train/test_graphs.py",
    "tests/train/test_gpu_preset.py",
    "tests/core/test_generate.py",
    "tests/core/test_compile.py",
    "tests/train/test_train.py",
    "tests/hf/test_export_gpu.py",  # an exported model's logits on CUDA equal mode's (issue 65)
)


GRAPH_SMOKE_TESTS = ("tests/train/test_gpu_preset.py",)


def stage_gtests(ctx: Ctx) -> dict:
    """The fused kernels' tests and the tests of the CUDA-graph work, on CUDA: the gpu-marked tests (capture, replay,
    equal results, one
    sync per replayed step) and the CPU tests of the same files under the CUDA default device."""
    return run_tests(ctx, GRAPH_SMOKE_TESTS if ctx.smoke else GRAPH_TESTS)


def run_tests(ctx: Ctx, order: tuple[str, ...]) -> dict:
    targets = [t for t in order if (ROOT / t).exists()]
    env = dict(
        os.environ, MODE_TEST_DEVICE=ctx.device.type if ctx.device.type == "cuda" else "cpu", PYTHONUNBUFFERED="1"
    )
    log = ctx.work / "pytest.log"
    import importlib.util

    xdist = not ctx.smoke and importlib.util.find_spec("xdist") is not None
    failures_path = ctx.work / "failures.jsonl"
    failures_path.unlink(missing_ok=True)
    env["MODE_FAILURES_JSONL"] = str(failures_path)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-v",
        "-rfEs",
        "-p",
        "no:cacheprovider",
        "-p",
        "benchmarks.gpu.pytest_failures",
        "--timeout",
        "90",
        "-o",
        "addopts=",
        *(["-n", str(XDIST_WORKERS)] if xdist else []),
        *targets,
    ]
    print(" ".join(cmd), flush=True)
    inner = max(ctx.limit_s - 15, 5)  # leave time to parse and report what ran before the limit
    cut_off = False
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=inner)
        except subprocess.TimeoutExpired:
            cut_off = True
            kill_group(proc)
    text = log.read_text(errors="replace")
    print("\n".join(text.splitlines()[-40:]))
    parsed = parse_pytest(text)
    failures = [json.loads(line) for line in failures_path.read_text().splitlines()] if failures_path.exists() else []
    parsed["failure_groups"] = group_failures(failures)
    for g in parsed["failure_groups"]:
        print(
            f"FAILURE GROUP x{g['count']}: {g['message']}\n    at {g['library_frame']} / {g['test_frame']}; "
            f"e.g. {g['example']}"
        )
    c = parsed["counts"]
    numbers = {
        "passed": c.get("passed", 0),
        "failed": c.get("failed", 0) + c.get("error", 0),
        "skipped": c.get("skipped", 0),
        "cut_off": cut_off,
        "returncode": proc.returncode,
    }
    details = {"command": " ".join(cmd), "targets": targets, "time_limit_s": inner, **parsed}
    if cut_off:
        details["note"] = f"pytest ran past {inner:.0f} s and was stopped; the counts are of what ran before"
    return {"numbers": numbers, "details": details}

"""A pytest plugin for the GPU suite's tests stage: every failure, as it happens, as one JSON line (test id,
phase, the exception line, and the deepest frame in the library and in the tests), written to the file
named by ``MODE_FAILURES_JSONL``. A stage cut off at its time limit still has every failure's reason, and
with pytest-xdist only the controller writes (each report reaches it once).

A CUDA device-side assert (``torch._assert_async`` on bad input, an index out of range in a kernel) leaves
the process's CUDA context unusable: every later test in that process fails with the same error (the
first H200 run lost 776 tests so). So an xdist worker that reports one ends itself after that test, and
xdist starts a fresh worker for the rest.

    MODE_FAILURES_JSONL=failures.jsonl python -m pytest -p benchmarks.gpu.pytest_failures ...
"""

from __future__ import annotations

import json
import os

ENV = "MODE_FAILURES_JSONL"
_config = None


def pytest_configure(config) -> None:
    global _config
    _config = config


def _frames(longrepr) -> list[tuple[str, int, str]]:
    entries = getattr(getattr(longrepr, "reprtraceback", None), "reprentries", None) or []
    out = []
    for entry in entries:
        loc = getattr(entry, "reprfileloc", None)
        if loc is not None:
            out.append((str(loc.path), int(loc.lineno), str(loc.message)))
    return out


def failure_record(report) -> dict:
    crash = getattr(report.longrepr, "reprcrash", None)
    message = crash.message if crash is not None else (report.longreprtext or "").strip().splitlines()[-1:] or [""]
    if isinstance(message, list):
        message = message[0]
    frames = _frames(report.longrepr)
    lib = [f for f in frames if "/mode/" in f[0] or f[0].startswith("mode/")]
    tests = [f for f in frames if "/tests/" in f[0] or os.path.basename(f[0]).startswith("test_")]
    return {
        "test": report.nodeid,
        "when": report.when,
        "message": " ".join(str(message).split())[:500],
        "library_frame": f"{lib[-1][0]}:{lib[-1][1]}" if lib else None,
        "test_frame": f"{tests[-1][0]}:{tests[-1][1]}" if tests else None,
    }


DEVICE_ASSERT = "device-side assert triggered"
_poisoned = False


def pytest_runtest_logreport(report) -> None:
    global _poisoned
    path = os.environ.get(ENV)
    if not path or not report.failed:
        return
    if _config is not None and hasattr(_config, "workerinput"):  # an xdist worker: the controller writes
        _poisoned = _poisoned or DEVICE_ASSERT in (report.longreprtext or "")
        return
    with open(path, "a") as fh:
        fh.write(json.dumps(failure_record(report)) + "\n")


def pytest_runtest_logfinish(nodeid, location) -> None:
    if _poisoned:  # the report is already on its way to the controller; xdist replaces this worker
        os._exit(70)

"""How close each float comparison of a test run comes to its bound: the measurement behind the tolerances.

With ``MODE_TOLERANCE_LOG=FILE`` set, ``tests/conftest.py`` wraps ``torch.testing.assert_close`` so that every
call appends one JSON line to FILE: the test's node id, the call site and ``ratio``, the largest
``|actual - expected| / (atol + rtol * |expected|)`` over the elements (1.0 is the bound; a failing call logs
too, then raises as before). ``scripts/tolerance_margins.py`` runs chosen tests under several thread counts and
CPU kernel paths with it and prints the comparisons that come nearest their bounds.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch.testing._comparison import default_tolerances

ENV = "MODE_TOLERANCE_LOG"


def _ratio(actual, expected, rtol, atol) -> float | None:
    if not (isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor)):
        return None
    if not (actual.is_floating_point() or actual.is_complex()) or actual.shape != expected.shape:
        return None
    if rtol is None or atol is None:
        rtol, atol = default_tolerances(actual, expected)
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    both = torch.isfinite(a) & torch.isfinite(e)
    if not both.any():
        return 0.0
    allowed = atol + rtol * e.abs()
    err = (a - e).abs()
    ratio = torch.where(both, err / allowed.clamp_min(1e-300), torch.zeros_like(err))
    return float(ratio.max())


def install(path: str) -> None:
    """Wrap ``torch.testing.assert_close`` for this process (the test modules look it up at call time)."""
    original = torch.testing.assert_close

    def logged(actual, expected, *args, **kwargs):
        ratio = _ratio(actual, expected, kwargs.get("rtol"), kwargs.get("atol"))
        if ratio is not None:
            frame = sys._getframe(1)
            line = {
                "test": os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0],
                "at": f"{os.path.relpath(frame.f_code.co_filename)}:{frame.f_lineno}",
                "ratio": ratio,
                "threads": torch.get_num_threads(),
                "cpu": torch.backends.cpu.get_cpu_capability(),
            }
            with open(path, "a") as f:  # one short line per call: appends from several processes do not interleave
                f.write(json.dumps(line) + "\n")
        return original(actual, expected, *args, **kwargs)

    torch.testing.assert_close = logged

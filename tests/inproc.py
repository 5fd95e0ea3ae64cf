"""A benchmark's ``main(argv)`` called in this process, answered like ``subprocess.run``.

A subprocess call of a benchmark script costs an interpreter and its torch and transformers imports, 3 to 7
CPU-seconds each, more than the toy work of most smoke runs (issue 70). Where a test checks what a script writes
and prints, not how its process ends (a kill, a resume after a kill, what it does to the process's malloc),
``run_main`` calls its ``main`` here instead: the same argv, its stdout and stderr captured, the exit status of
``SystemExit`` (argparse's refusals) or 1 for an exception, whose traceback goes to the captured stderr as an
interpreter would print it. ``check=True`` raises as ``subprocess.run(check=True)`` does.

tests/conftest.py checks after every test that torch's process-wide settings (threads, default device and dtype,
grad mode) are as before, so a script that changes one for its process fails here instead of changing later tests.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import subprocess
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def run_main(
    module: str, argv: list[str], *, cwd: str | Path | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    """``python -m module *argv`` as a call of ``module.main(argv)`` in this process (``module``: a dotted name
    such as ``benchmarks.hf.heal_vs_prune``), in ``cwd`` if given."""
    main = importlib.import_module(module).main
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.ExitStack() as stack:
        if cwd is not None:
            stack.enter_context(contextlib.chdir(cwd))
        stack.enter_context(contextlib.redirect_stdout(out))
        stack.enter_context(contextlib.redirect_stderr(err))
        try:
            main([str(a) for a in argv])
        except SystemExit as exc:  # argparse's refusals, or an explicit exit
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if exc.code is not None and not isinstance(exc.code, int):
                print(exc.code, file=sys.stderr)
        except Exception:  # noqa: BLE001  (what an interpreter would print, and its exit status)
            traceback.print_exc()
            code = 1
    proc = subprocess.CompletedProcess([module, *map(str, argv)], code, out.getvalue(), err.getvalue())
    if check and code != 0:
        raise subprocess.CalledProcessError(code, proc.args, proc.stdout, proc.stderr)
    return proc

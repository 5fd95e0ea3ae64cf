"""tests/conftest.py's run order for pytest-xdist: the slowest modules first, each module whole."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# by path: under pytest ``import conftest`` may find another folder's conftest.py (tests/kernels has one)
_spec = importlib.util.spec_from_file_location("mode_suite_conftest", ROOT / "tests" / "conftest.py")
assert _spec is not None and _spec.loader is not None
conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(conftest)


def test_every_slowest_first_entry_names_a_test_module():
    missing = [path for path in conftest.SLOWEST_FIRST if not (ROOT / path).is_file()]
    assert not missing, f"SLOWEST_FIRST names files that do not exist (renamed or removed?): {missing}"
    assert len(set(conftest.SLOWEST_FIRST)) == len(conftest.SLOWEST_FIRST)


class _Item:
    def __init__(self, nodeid: str):
        self.nodeid = nodeid


def test_slowest_modules_go_first_and_every_module_stays_whole(monkeypatch):
    monkeypatch.setattr(conftest, "SLOWEST_FIRST", ("tests/c.py", "tests/a.py"))
    ids = [
        "tests/a.py::t1",
        "tests/a.py::t2[x]",
        "tests/b.py::t1",
        "tests/c.py::K::t1",
        "tests/c.py::t2",
        "tests/d.py::t",
    ]
    items = [_Item(i) for i in ids]
    conftest._slowest_first(items)  # type: ignore[arg-type]
    assert [i.nodeid for i in items] == [
        "tests/c.py::K::t1",
        "tests/c.py::t2",
        "tests/a.py::t1",
        "tests/a.py::t2[x]",
        "tests/b.py::t1",
        "tests/d.py::t",
    ]


@pytest.mark.cpu_only("the scheduler choice is for CPU runs")
def test_xdist_runs_whole_modules_on_the_cpu(tmp_path):
    """A real two-worker run: each module's tests all report from one worker."""
    import subprocess
    import sys

    for name in ("a", "b", "c"):
        (tmp_path / f"test_{name}.py").write_text(
            "import os\n"
            + "".join(f"def test_{i}():\n    print(os.environ['PYTEST_XDIST_WORKER'])\n" for i in range(4))
        )
    (tmp_path / "conftest.py").write_text(  # the suite's conftest, loaded under another module name
        "import importlib.util\n"
        f"path = {str(ROOT / 'tests' / 'conftest.py')!r}\n"
        "spec = importlib.util.spec_from_file_location('mode_suite_conftest', path)\n"
        "suite = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(suite)\n"
        "globals().update({k: v for k, v in vars(suite).items() if k.startswith('pytest_')})\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "-v", "-p", "no:cacheprovider", "-o", "addopts=", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    workers: dict[str, set[str]] = {}
    for line in proc.stdout.splitlines():
        if " PASSED " in line and line.startswith("["):  # "[gw0] [ 8%] PASSED test_a.py::test_0"
            worker, nodeid = line.split()[0].strip("[]"), line.split()[-1]
            workers.setdefault(nodeid.split("::")[0], set()).add(worker)
    assert set(workers) == {"test_a.py", "test_b.py", "test_c.py"}, proc.stdout[-3000:]
    assert all(len(w) == 1 for w in workers.values()), workers

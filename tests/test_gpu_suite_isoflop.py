"""benchmarks/gpu/gpu_suite.py --only isoflop: the isoflop stage's smoke rehearsal on the CPU (the sweep, its report,
plots and archive; a second call finishing the grid from the first call's archive; a call cut off by its limit).
A module of its own so that a parallel test run (pytest-xdist, ``--dist loadscope``) can start it beside
tests/test_gpu_suite.py's smoke halves."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpu_suite_run import run_smoke  # noqa: E402

from benchmarks.gpu import gpu_suite, stage_isoflop  # noqa: E402

pytestmark = pytest.mark.cpu_only("runs the suite's --smoke rehearsal as subprocesses on the CPU")


def _isoflop(tmp: Path, cache: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    proc, payload, _ = run_smoke(tmp, "--only", "isoflop", *args, timeout=240, env={"MODE_CACHE_DIR": str(cache)})
    return proc, payload


@pytest.fixture(scope="module")
def isoflop_smoke(tmp_path_factory):
    """One rehearsal of the isoflop stage: the gpu preset's code path at toy sizes, 2 seeds, on the packages
    corpus of this machine's site-packages (built once into a cache shared by this module's runs)."""
    tmp = tmp_path_factory.mktemp("isoflop")
    cache = tmp_path_factory.mktemp("cache")
    proc, payload = _isoflop(tmp, cache)
    return tmp, cache, proc, payload


def test_isoflop_stage_runs_the_sweep_and_brings_back_report_plots_and_runs(isoflop_smoke):
    import tarfile

    tmp, _, proc, payload = isoflop_smoke
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert list(payload["stages"]) == ["isoflop"]
    rec = payload["stages"]["isoflop"]
    assert rec["status"] == "ok", rec
    nums = rec["numbers"]
    p = stage_isoflop.isoflop_smoke_preset()
    total = 2 * len(p.budgets) * len(p.sizes) * 6
    assert nums["complete"] is True and nums["runs_done"] == nums["runs_total"] == total and nums["seeds"] == 2
    assert nums["corpus_files"] > 100 and len(nums["corpus_list_sha256"]) == 64 and 0 < nums["epochs_max"] <= 1
    assert nums["estimated_s"] > 0 and nums["measured_over_estimated"] > 0
    for key in stage_isoflop.CLAIM_KEYS.values():  # every claim, with its 95% interval over the 2 seeds
        low, high = nums[f"{key}_interval"]
        assert low <= nums[key] <= high and isinstance(nums[f"{key}_significant"], bool)
        assert isinstance(nums[f"{key}_at_edge"], list)
    out = tmp / "out" / stage_isoflop.ISOFLOP_DIR
    assert sorted(f.name for f in out.iterdir()) == sorted(
        [*stage_isoflop.ISOFLOP_REPORT_FILES, stage_isoflop.ISOFLOP_ARCHIVE]
    )
    report = json.loads((out / "isoflop.json").read_text())
    assert report["data"]["list_sha256"] == nums["corpus_list_sha256"] and report["data"]["packages"]["files"] > 100
    assert report["machine"]["bf16"] is True
    with tarfile.open(out / stage_isoflop.ISOFLOP_ARCHIVE) as tar:
        names = tar.getnames()
    assert "isoflop_run.json" in names and sum(n.endswith("/result.json") for n in names) == total
    assert not any(n.endswith("ckpt.pt") for n in names)  # too large to bring back; finished runs need none
    # what a GPU call can bring back: at most 8 files, no deeper than 2 folders under OUT
    files = [f for f in (tmp / "out").rglob("*") if f.is_file()]
    assert len(files) <= 8 and all(len(f.relative_to(tmp / "out").parts) <= 3 for f in files)
    assert f"\n  {'isoflop':<8}ok" in proc.stdout and "complete=True" in proc.stdout


def test_a_second_call_finishes_the_grid_from_the_first_calls_archive(isoflop_smoke, tmp_path):
    """A call cut off before the grid was done: its archive holds the finished runs; the next call, given
    the archive, trains only what is missing and reports the whole grid."""
    import tarfile

    first, cache, _, payload = isoflop_smoke
    archive = first / "out" / stage_isoflop.ISOFLOP_DIR / stage_isoflop.ISOFLOP_ARCHIVE
    cut = tmp_path / "cut.tar.gz"  # the first call's archive without its last run: as if killed in that run
    with tarfile.open(archive) as src, tarfile.open(cut, "w:gz") as dst:
        members = src.getmembers()
        last = [m.name for m in members if m.name.endswith("/seed1/result.json")][-1]  # a run of seed 1
        for m in members:
            if not m.name.startswith(last.rsplit("/", 1)[0] + "/"):
                dst.addfile(m, src.extractfile(m))
    sweep = tmp_path / "unpacked"
    assert stage_isoflop.unpack_isoflop(cut, sweep) == payload["stages"]["isoflop"]["numbers"]["runs_total"] - 1
    assert stage_isoflop.complete_seeds(sweep, smoke=True, seeds=2)[0] == 1  # seed 0 whole, seed 1 not
    proc, again = _isoflop(tmp_path, cache, "--isoflop-from", str(cut))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    nums = again["stages"]["isoflop"]["numbers"]
    assert nums["complete"] is True and again["stages"]["isoflop"]["details"]["runs_reused"] == nums["runs_total"] - 1
    log = (tmp_path / "out" / gpu_suite.LOG_NAME).read_text()
    assert f"{nums['runs_total'] - 1} of {nums['runs_total']} runs done in an earlier run" in log
    old = payload["stages"]["isoflop"]["numbers"]
    assert nums["corpus_list_sha256"] == old["corpus_list_sha256"]
    # the retrained run repeats the first call's (same seed, same data order, CPU): the same claims
    assert nums["mod_minus_dense"] == pytest.approx(old["mod_minus_dense"], abs=1e-4)


def test_a_call_cut_off_by_its_limit_reports_the_complete_seeds_and_keeps_the_rest(isoflop_smoke, tmp_path):
    """The stage stops the sweep ISOFLOP_RESERVE_S before its limit; then it packs what is finished and writes
    the report of the seeds that are complete. Here the limit leaves the sweep 1 s (no run can finish in it),
    and the archive given lacks seed 1's last 3 runs: the report is seed 0's, and the rest is for a next call."""
    import tarfile

    first, cache, _, payload = isoflop_smoke
    archive = first / "out" / stage_isoflop.ISOFLOP_DIR / stage_isoflop.ISOFLOP_ARCHIVE
    cut = tmp_path / "cut.tar.gz"
    with tarfile.open(archive) as src, tarfile.open(cut, "w:gz") as dst:
        members = src.getmembers()
        drop = set(
            sorted(m.name.rsplit("/", 1)[0] for m in members if m.name.endswith("/seed1/result.json"))[-3:]
        )  # 3 runs of seed 1
        for m in members:
            if m.name.rsplit("/", 1)[0] not in drop:
                dst.addfile(m, src.extractfile(m))
    limit = stage_isoflop.ISOFLOP_RESERVE_S + 1
    proc, again = _isoflop(tmp_path, cache, "--isoflop-from", str(cut), "--stage-budget", f"isoflop={limit}")
    rec = again["stages"]["isoflop"]
    assert rec["status"] == "ok", rec
    nums, total = rec["numbers"], payload["stages"]["isoflop"]["numbers"]["runs_total"]
    assert nums["complete"] is False and rec["details"]["timed_out"] is True
    assert nums["runs_done"] == total - 3 and nums["seeds_complete"] == 1 and nums["seeds"] == 1
    assert nums["mod_minus_dense_interval"] is None  # one seed: a difference, no interval
    assert "--isoflop-from" in rec["details"]["next"]
    out = tmp_path / "out" / stage_isoflop.ISOFLOP_DIR
    assert sorted(f.name for f in out.iterdir()) == sorted(
        [*stage_isoflop.ISOFLOP_REPORT_FILES, stage_isoflop.ISOFLOP_ARCHIVE]
    )
    assert json.loads((out / "isoflop.json").read_text())["config"]["seeds"] == [0]
    with tarfile.open(out / stage_isoflop.ISOFLOP_ARCHIVE) as tar:
        assert sum(n.endswith("/result.json") for n in tar.getnames()) == total - 3

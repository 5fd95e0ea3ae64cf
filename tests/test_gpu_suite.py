"""benchmarks/gpu_suite.py: the one command of a GPU run. The smoke run on the CPU, stage isolation (a stage
that raises or hangs is recorded and the next one runs, within the deadline), and its parsers."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import gpu_report, gpu_suite  # noqa: E402

pytestmark = pytest.mark.cpu_only("runs the suite's --smoke rehearsal as subprocesses on the CPU")


def _run(tmp_path: Path, *args: str, timeout: float) -> tuple[subprocess.CompletedProcess, dict, float]:
    out = tmp_path / "out"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), "--smoke", "--out", str(out),
                           "--work", str(tmp_path / "work"), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    seconds = time.monotonic() - t0
    return proc, json.loads((out / gpu_suite.RESULT_NAME).read_text()), seconds


@pytest.mark.timeout(900)  # the rehearsal of every stage, ~4 min unloaded (the subprocess's own limit: 900 s)
def test_smoke_run_names_every_stage_in_json_and_table(tmp_path):
    proc, payload, _ = _run(tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert list(payload["stages"]) == list(gpu_suite.STAGE_NAMES)
    for name, rec in payload["stages"].items():
        assert rec["status"] == "ok", (name, rec)
        assert rec["numbers"], name
        assert f"\n  {name:<8}ok" in proc.stdout
    nums = {name: rec["numbers"] for name, rec in payload["stages"].items()}
    assert nums["env"]["matmul_bf16_tflops"] > 0 and nums["env"]["copy_gbs"] > 0
    assert nums["tests"]["passed"] > 0 and nums["tests"]["failed"] == 0
    assert nums["moe"]["moe_ratio_E8"] > 0 and nums["moe"]["moe_ratio_E64"] > 0
    assert 0 < nums["mod"]["block_flop_ratio"] < nums["mod"]["lm_flop_ratio"] < 1
    assert nums["decode"]["speedup_b1"] > 0
    assert nums["train"]["tok_s_eager"] > 0 and nums["train"]["tok_s_compile"] > 0
    assert nums["nccl"]["backend"] == "gloo" and nums["nccl"]["last_step"] == 30
    # the CUDA-graph stages rehearse their CPU part and say what they left out
    from mode.parallel.command import GPU_PRESET_PARAMS

    assert nums["gtests"]["passed"] > 0 and nums["gtests"]["failed"] == 0
    assert nums["graphs"]["tok_s_eager"] > 0 and nums["graphs"]["graphs"] == gpu_suite.NO_CUDA
    assert nums["gdecode"]["tok_s_eager_mod_b1"] > 0 and nums["gdecode"]["graphs"] == gpu_suite.NO_CUDA
    assert nums["gpumfu"]["params"] == GPU_PRESET_PARAMS and nums["gpumfu"]["gpu_preset"] == gpu_suite.NO_CUDA
    assert payload["versions"]["torch"]
    # a smoke run's toy shapes are not held against the goals
    assert {g["verdict"] for g in payload["goals"]} <= {"not judged", "not measured"}
    markdown = gpu_report.render(payload)  # the page docs/results-gpu.md is written from
    assert "### Goals" in markdown and all(f"### {name}" in markdown for name in gpu_suite.STAGE_NAMES)
    log = (tmp_path / "out" / gpu_suite.LOG_NAME).read_text()
    assert all(f"===== stage {name} " in log for name in gpu_suite.STAGE_NAMES)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [gpu_suite.RESULT_NAME, gpu_suite.LOG_NAME]


def test_a_stage_that_raises_or_hangs_is_recorded_and_the_next_stage_runs(tmp_path):
    proc, payload, seconds = _run(tmp_path, "--only", "env", "moe", "mod", "decode", "--inject", "moe=raise",
                                  "mod=hang", "--stage-budget", "mod=8", timeout=300)
    assert proc.returncode == 1  # not every stage passed
    st = payload["stages"]
    assert st["env"]["status"] == "ok"
    assert st["moe"]["status"] == "failed"
    assert "injected failure in stage 'moe'" in st["moe"]["error"]
    assert any("injected failure" in line for line in st["moe"]["tail"])
    assert st["mod"]["status"] == "timeout" and 8 <= st["mod"]["seconds"] < 8 + 2 * gpu_suite.KILL_GRACE_S + 5
    assert any("hanging on purpose" in line for line in st["mod"]["tail"])
    assert st["decode"]["status"] == "ok" and st["decode"]["numbers"]["speedup_b1"] > 0
    assert "moe     failed" in proc.stdout and "mod     timeout" in proc.stdout


def test_the_overall_deadline_stops_later_stages(tmp_path):
    proc, payload, seconds = _run(tmp_path, "--only", "env", "mod", "decode", "--inject", "mod=hang",
                                  "--budget-s", "25", timeout=300)
    st = payload["stages"]
    assert st["env"]["status"] == "ok"
    assert st["mod"]["status"] == "timeout"
    assert st["decode"]["status"] == "not run" and "deadline" in st["decode"]["reason"]
    assert seconds < 25 + 2 * gpu_suite.KILL_GRACE_S + 20  # the deadline, the kill and two interpreter starts


@pytest.mark.parametrize("argv, message", [
    (["--smoke", "--out", "x", "--only", "gpu"], "--only 'gpu'"),
    (["--smoke", "--out", "x", "--inject", "moe=explode"], "--inject 'moe=explode'"),
    (["--smoke", "--out", "x", "--stage-budget", "moe=-1"], "--stage-budget 'moe=-1'"),
    (["--smoke", "--out", "x", "--budget-s", "0"], "--budget-s=0.0"),
    (["--smoke"], "--out DIR"),
])
def test_bad_arguments_are_refused_by_name(argv, message):
    with pytest.raises(SystemExit, match=message):
        gpu_suite.main(argv)


PYTEST_OUTPUT = """\
tests/core/test_a.py::test_one PASSED                                    [ 25%]
tests/core/test_a.py::test_two[cuda] FAILED                              [ 50%]
tests/core/test_a.py::test_three SKIPPED (cpu_only on cuda:0: gloo)      [ 75%]
tests/core/test_b.py::test_four ERROR                                    [100%]
=========================== short test summary info ============================
SKIPPED [3] tests/parallel/test_x.py:12: cpu_only on cuda:0: gloo
SKIPPED [1] tests/core/test_a.py:30: needs a CUDA device
FAILED tests/core/test_a.py::test_two[cuda] - AssertionError
============ 1 failed, 1 passed, 4 skipped, 1 error in 3.21s ============
"""


def test_parse_pytest_counts_failures_and_skip_reasons():
    parsed = gpu_suite.parse_pytest(PYTEST_OUTPUT)
    assert parsed["counts"] == {"passed": 1, "failed": 1, "skipped": 1, "error": 1}
    assert parsed["failed"] == ["tests/core/test_a.py::test_two[cuda]", "tests/core/test_b.py::test_four"]
    assert parsed["skip_reasons"] == {"cpu_only on cuda:0: gloo": 3, "needs a CUDA device": 1}
    assert parsed["summary"] == "1 failed, 1 passed, 4 skipped, 1 error in 3.21s"
    cut = gpu_suite.parse_pytest("\n".join(PYTEST_OUTPUT.splitlines()[:2]))  # killed mid-run: what ran counts
    assert cut["counts"] == {"passed": 1, "failed": 1} and cut["summary"] is None


def test_steady_speed_leaves_out_the_first_steps():
    # 10 steps of 1 s each, then 10 of 0.5 s: the steady state from step 10 on is 2x the first steps' rate
    recs = [dict(step=s, loss=1.0, tokens=100 * s, flops=1e9 * s, wall=s * 1.0 if s <= 10 else 10 + 0.5 * (s - 10),
                 tok_s=0.0) for s in (5, 10, 15, 20)]
    recs.insert(2, dict(step=10, val_loss=2.0, tokens=1000, flops=1e10, wall=10.0, tok_s=0.0))
    speed = gpu_suite.steady_speed(recs, skip_steps=10)
    assert speed["from_step"] == 10 and speed["to_step"] == 20
    assert speed["tok_s"] == pytest.approx(1000 / 5.0)
    assert speed["flop_s"] == pytest.approx(1e10 / 5.0)
    with pytest.raises(RuntimeError, match="two logged training steps"):
        gpu_suite.steady_speed(recs[:1], skip_steps=0)


def test_goals_are_judged_against_their_thresholds():
    stages = {"moe": {"numbers": {"moe_ratio_E8": 1.10, "moe_ratio_E64": 1.30, "ahead_of_peers_E8": True}},
              "decode": {"numbers": {"speedup_b1": 1.69}}}
    verdicts = {g["key"]: g["verdict"] for g in gpu_suite.evaluate_goals(stages)}
    assert verdicts["moe_ratio_E8"] == "met" and verdicts["moe_ratio_E64"] == "missed"
    assert verdicts["ahead_of_peers_E8"] == "met" and verdicts["ahead_of_peers_E64"] == "not measured"
    assert verdicts["speedup_b1"] == "missed" and verdicts["mfu_eager"] == "not measured"
    assert {g["verdict"] for g in gpu_suite.evaluate_goals(stages, smoke=True)} == {"not judged", "not measured"}


def test_parse_pytest_reads_xdist_lines():
    text = ("[gw0] [ 50%] PASSED tests/core/test_a.py::test_one \n"
            "[gw1] [100%] FAILED tests/core/test_a.py::test_two[cuda] \n")
    parsed = gpu_suite.parse_pytest(text)
    assert parsed["counts"] == {"passed": 1, "failed": 1}
    assert parsed["failed"] == ["tests/core/test_a.py::test_two[cuda]"]


def test_failures_plugin_writes_each_failure_with_its_reason_and_groups_them(tmp_path):
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "@pytest.mark.parametrize('n', [1, 2])\n"
        "def test_mismatch(n):\n"
        "    raise RuntimeError('Expected all tensors to be on the same device')\n"
        "def test_ok():\n"
        "    pass\n"
        "def test_assert():\n"
        "    assert 1 == 2\n")
    jsonl = tmp_path / "failures.jsonl"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "benchmarks.pytest_failures", "-p",
                           "no:cacheprovider", str(tmp_path / "test_sample.py")], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**__import__("os").environ, "MODE_FAILURES_JSONL": str(jsonl),
                                                       "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 1, proc.stdout
    failures = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert len(failures) == 3 and all(f["when"] == "call" for f in failures)
    groups = gpu_suite.group_failures(failures)
    assert groups[0]["count"] == 2 and "same device" in groups[0]["message"]
    assert groups[0]["test_frame"].endswith("test_sample.py:4")
    assert groups[1]["count"] == 1 and "assert 1 == 2" in groups[1]["message"]


def test_last_error_names_the_exception_line():
    text = ("Traceback (most recent call last):\n  File \"x.py\", line 1\n"
            "torch._inductor.exc.InductorError: ImportError: main.so: file too short\n\n"
            "Set TORCHDYNAMO_VERBOSE=1 for the internal stack trace\n")
    assert gpu_suite._last_error(text).startswith("torch._inductor.exc.InductorError: ImportError")
    assert gpu_suite._last_error("RuntimeError: boom\nother\n") == "RuntimeError: boom"
    assert gpu_suite._last_error("") == "(no output)"

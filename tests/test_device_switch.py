"""The suite's device switch (tests/conftest.py): MODE_TEST_DEVICE / --device, and the cpu_only and bitwise
markers. Each case runs pytest in a subprocess on a small test file next to a copy of the conftest."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CONFTEST = Path(__file__).with_name("conftest.py")

PROBE = """
import pytest
import torch


@pytest.mark.cpu_only("probe: CPU only")
def test_cpu_only():
    pass


@pytest.mark.bitwise(reason="probe: bitwise")
def test_bitwise():
    pass


def test_default_device(device):
    assert torch.empty(1).device == device
    assert torch.nn.Linear(2, 2).weight.device == device
"""


def run_probe(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_probe.py").write_text(PROBE)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # keeps the repository's configuration out
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MODE_TEST_")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", *args],
        cwd=tmp_path,
        env={**environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cpu_runs_everything(tmp_path):
    r = run_probe(tmp_path, MODE_TEST_DEVICE="cpu")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "3 passed" in r.stdout and "mode test device: cpu" in r.stdout


@pytest.mark.parametrize("how", [dict(env="meta"), dict(env="cpu", opt="mps")])  # --device wins over the variable
def test_an_unsupported_device_stops_pytest(tmp_path, how):
    args = ("--device", how["opt"]) if "opt" in how else ()
    env = {"MODE_TEST_DEVICE": how["env"]} if "env" in how else {}
    r = run_probe(tmp_path, *args, **env)
    assert r.returncode == 4, r.stdout + r.stderr  # pytest's usage error: nothing ran, nothing passed
    assert "must be cpu, cuda or cuda:N" in r.stderr and "passed" not in r.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_a_gpu_stops_pytest(tmp_path):
    r = run_probe(tmp_path, MODE_TEST_DEVICE="cuda")
    assert r.returncode == 4, r.stdout + r.stderr
    assert "torch.cuda.is_available() is False" in r.stderr and "passed" not in r.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("deterministic", ["0", "1"])
def test_cuda_skips_cpu_only_and_bitwise_without_determinism(tmp_path, deterministic):
    r = run_probe(tmp_path, MODE_TEST_DEVICE="cuda", MODE_TEST_DETERMINISTIC=deterministic)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "cpu_only on cuda:0: probe: CPU only" in r.stdout
    if deterministic == "1":
        assert "2 passed, 1 skipped" in r.stdout
    else:
        assert "1 passed, 2 skipped" in r.stdout and "probe: bitwise" in r.stdout

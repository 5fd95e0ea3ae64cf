"""The performance benchmark still runs end to end (quick shapes) and writes the JSON the docs cite."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def test_bench_performance_quick_writes_every_case(tmp_path, device):
    out = tmp_path / "performance.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    # a subprocess: the benchmark tunes malloc for its whole process (--malloc retain, the default)
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_performance.py"), "--quick", "--no-compile",
                    "--threads", "1", "--device", str(device), "--out", str(out)], cwd=tmp_path, env=env,
                   capture_output=True, text=True, timeout=300, check=True)
    payload = json.loads(out.read_text())
    assert payload["malloc"]["malloc"] == "retain"
    machine = payload["machine"]
    assert payload["device"] == machine["device"] == str(device) and machine["torch"] == torch.__version__
    assert machine["device_name"] == (torch.cuda.get_device_name(device) if device.type == "cuda" else
                                      machine["processor"])
    cases = [r["case"] for r in payload["results"]]
    assert sum(c.startswith("MoE top-") for c in cases) == 8  # top-1/2 x E=8/64 x reference/grouped
    assert any(c.startswith("MoE expert-choice E=64") for c in cases)
    assert any(c.startswith("MoD c=0.125") for c in cases) and any(c.startswith("MoD LM step") for c in cases)
    gpu_rows = [r for r in payload["results"] if r["kind"] == "gpu"]
    assert len(gpu_rows) == (8 if device.type == "cuda" else 0)  # top-1/2 x E=8/64 x grouped/megablocks
    for row in payload["results"]:
        if "skipped" in row:  # MegaBlocks where it does not import
            assert row["backend"] == "megablocks", row
            continue
        assert math.isfinite(row["ratio_median"]) and row["ratio_median"] > 0, row
        assert row["ratio_min"] <= row["ratio_median"] <= row["ratio_max"], row
        assert isinstance(row["meets_target"], bool), row


def test_bench_peers_quick_runs_what_imports_and_says_why_not(tmp_path, device):
    """The peer benchmark at tiny sizes: mode's rows always; transformers / torchtitan rows where they
    import, else a reason in the JSON (CI installs only .[test], so there they are skipped)."""
    out = tmp_path / "peers.json"
    # keep a PYTHONPATH that points at separately installed peers
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_peers.py"), "--quick", "--threads", "1",
                    "--repeats", "2", "--warmup", "1", "--device", str(device), "--out", str(out)],
                   cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=True)
    payload = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    rows = payload["results"]
    configs = {r["config"] for r in rows}
    assert len(configs) == 2
    for config in configs:
        names = {r["implementation"] for r in rows if r["config"] == config}
        assert {"mode, auto", "mode, reference"} <= names and any(n.startswith("dense") for n in names)
    for family in ("transformers", "torchtitan"):
        ran = [r for r in rows if r["family"] == family]
        if not ran:  # skipped: the JSON says why, with the way to install it
            assert family in payload["skipped"] and payload["skipped"][family], family
    for r in rows:
        assert math.isfinite(r["ratio_median"]) and r["ratio_median"] > 0, r
        if r["family"] == "dense":
            assert r["ratio_median"] == 1.0
        elif r["computes_in"] == "float32":  # same weights, same routing: the same numbers
            assert r["agrees"] is True, (r["implementation"], r["max_abs_diff_y"], r["max_abs_diff_dx"])

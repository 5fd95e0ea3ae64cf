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

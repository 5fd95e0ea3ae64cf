"""Run chosen tests under several thread counts and CPU kernel paths and print the float comparisons that
come nearest their bounds: the measurement a tolerance in tests/ is derived from.

    python scripts/tolerance_margins.py tests/hf tests/hf/test_moe_blocks.py --json margins.json

Each setting runs pytest once with ``MODE_TOLERANCE_LOG`` (tests/tolerance_log.py): every
``torch.testing.assert_close`` logs ``ratio`` = the largest ``|actual - expected| / (atol + rtol |expected|)``
(1.0 is the bound). The settings: torch's intra-op threads 1, 2 and 4 (``MODE_TEST_THREADS``), and the older
kernel paths an AVX2-only CPU takes (``ATEN_CPU_CAPABILITY=avx2`` for ATen's own kernels,
``MKL_ENABLE_INSTRUCTIONS=AVX2`` for MKL's GEMMs, each alone and both). A bound with a ratio above
``--warn`` (0.25 by default: less than 4x headroom) on any setting is listed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict

SETTINGS = {
    "threads1": {"MODE_TEST_THREADS": "1"},
    "threads2": {"MODE_TEST_THREADS": "2"},
    "threads4": {"MODE_TEST_THREADS": "4"},
    "aten_avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "mkl_avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "both_avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("tests", nargs="+", help="pytest paths or node ids")
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated subset of: " + ", ".join(SETTINGS))
    p.add_argument("-k", default=None, help="pytest -k expression")
    p.add_argument("--warn", type=float, default=0.25, help="list comparisons whose ratio exceeds this")
    p.add_argument("--json", default=None, help="write every setting's worst ratio per call site here")
    args = p.parse_args()
    worst: dict[str, dict[str, float]] = defaultdict(dict)  # call site (test, line) -> setting -> worst ratio
    failed = {}
    for name in args.settings.split(","):
        if name not in SETTINGS:
            p.error(f"--settings: {name!r} is not one of {', '.join(SETTINGS)}")
        with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as f:
            log = f.name
        env = {**os.environ, **SETTINGS[name], "MODE_TOLERANCE_LOG": log}
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args.tests]
        if args.k:
            cmd += ["-k", args.k]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        summary = (r.stdout.strip().splitlines() or ["(no output)"])[-1]
        failed[name] = r.returncode
        print(f"{name:>10}: {summary}", flush=True)
        with open(log) as f:
            for line in f:
                rec = json.loads(line)
                key = f"{rec['test']} @ {rec['at']}"
                worst[key][name] = max(worst[key].get(name, 0.0), rec["ratio"])
        os.unlink(log)
    rows = sorted(worst.items(), key=lambda kv: -max(kv[1].values()))
    print(f"\n{len(rows)} comparison sites; worst ratio over the settings (1.0 = the bound):")
    for key, by in rows:
        top = max(by.values())
        if top < args.warn:
            break
        print(f"  {top:7.3f}  {key}  " + " ".join(f"{s}={v:.3f}" for s, v in by.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"settings": {k: SETTINGS[k] for k in args.settings.split(",")}, "exit": failed, "worst": worst},
                f,
                indent=1,
            )
    return max(failed.values(), default=0)


if __name__ == "__main__":
    sys.exit(main())

"""On CUDA, the routers' NaN/inf checks (and LM's token-id range check) are ``torch._assert_async``: they never
make the host wait, and a failure is a device-side assert at the next synchronisation. Such an assert poisons
the CUDA context of the whole process (every later CUDA call fails), so the tests that feed bad values on purpose
are marked ``device_assert`` and skipped on CUDA (tests/conftest.py). This test proves the checks do fire there:
each case runs in a fresh Python process, first on finite input (which must pass and synchronise cleanly), then
on the bad input, and the child must die with a device-side assert while this process's CUDA context stays
healthy.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

PRELUDE = """
import torch
torch.set_default_device({device!r})
from mode import MLP, MoD, MoDRouter, MoDRouterConfig, TokenChoiceConfig, TokenChoiceRouter, TransformerBlock
from mode.layers.kv_cache import KVCache
from mode.model import LM, LMConfig
D = 8
"""

# Each case defines run(bad: bool); the child calls run(False), synchronises, prints FINITE_OK, then run(True).
CASES = {
    "token_choice_router": """
        router = TokenChoiceRouter(TokenChoiceConfig(d_model=D, num_experts=4, top_k=2))
        def run(bad):
            x = torch.randn(2, 5, D)
            if bad:
                x[1, 2, 3] = float("nan")
            router(x)
    """,
    "mod_router": """
        router = MoDRouter(MoDRouterConfig(d_model=D, capacity=0.5))
        def run(bad):
            x = torch.randn(2, 4, D)
            if bad:
                x[0, 1, 2] = float("nan")
            router(x)
    """,
    "static_decode": """
        model = LM(LMConfig(vocab_size=64, seq_len=16, d_model=D, n_heads=2, d_hidden=16, layers=("dense", "mod"),
                            capacity=0.25, causal="predictor", predictor_hidden=16)).eval()
        @torch.no_grad()
        def run(bad):
            cache = KVCache(2, 2, 8, D // 2, torch.float32, static=True)
            x = torch.randn(2, 1, D)
            if bad:
                x[1, 0, 3] = float("nan")
            model.layers[1](x, positions_BS=torch.zeros(2, 1, dtype=torch.long), cache=cache, causal=True)
    """,
    "token_ids_out_of_range": """
        model = LM(LMConfig(vocab_size=32, seq_len=16, d_model=D, n_heads=2, d_hidden=16, layers=("dense",)))
        def run(bad):
            model(torch.full((2, 4), 32 if bad else 31))
    """,
}

FINITE_OK = "finite input ran cleanly"


def _child_script(case: str, device: torch.device) -> str:
    return (
        PRELUDE.format(device=str(device))
        + textwrap.dedent(CASES[case])
        + f"run(False)\ntorch.cuda.synchronize()\nprint({FINITE_OK!r}, flush=True)\n"
        "run(True)\ntorch.cuda.synchronize()\nprint('bad input was not caught', flush=True)\n"
    )


@pytest.mark.parametrize("case", list(CASES))
def test_device_side_checks_fire_in_a_subprocess(case, device):
    if device.type != "cuda":
        pytest.skip("needs a CUDA device")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [sys.executable, "-c", _child_script(case, device)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = proc.stdout + proc.stderr
    assert FINITE_OK in proc.stdout, out[-4000:]  # the finite input passed: the failure below is the check's
    assert proc.returncode != 0 and "device-side assert" in out, out[-4000:]
    assert "bad input was not caught" not in proc.stdout
    # this process's CUDA context is untouched by the child's assert
    assert torch.ones(3, device=device).add(1).sum().item() == 6.0
    torch.cuda.synchronize(device)

"""Gradient accumulation and activation checkpointing on a (2, 2) gloo mesh (4 processes, CPU) equal one
process training the whole batch without them: the first step's every gradient (gathered from the shards,
1e-6), the loss and gradient-norm curve, the balancing bias.

The model has token-choice MoE, staged and integrated MoDE layers with the "global" balance loss (its
choice counts summed over the ranks and, with ``grad_accum``, over the micro-batches), bias balancing and a
causal predictor. At (dp, ep) = (2, 2) with ``grad_accum=2`` each rank trains micro-batches of one row;
FSDP reduces the gradients after the second only (``MeshRuntime.set_gradient_sync``). With activation
checkpointing the backward recomputes every block, and with it the expert-parallel all-to-alls and the
global count all-reduce: the test also shows it does not hang (the pool's collective timeout, 60 s).
Single-process references: tests/train/test_train_features.py.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pools
import pytest
import ties
import torch

from mode.model import LMConfig
from mode.train import TrainConfig, Trainer
from mode.train.data import Corpus

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.cpu_only("gloo ranks on CPU; the CPU run covers them (NCCL needs one GPU per rank)"),
]

TIMEOUT_S = 60.0
JOIN_TIMEOUT_S = 240.0
MODEL = LMConfig(
    seq_len=16,
    d_model=32,
    n_heads=2,
    d_hidden=64,
    layers=("moe", "staged", "integrated"),
    num_experts=4,
    num_noop=2,
    top_k=2,
    capacity=0.5,
    balance_coef=0.05,
    causal="predictor",
    router_options=dict(balance_scope="global", bias_balance=True, bias_rate=0.01),
)
TRAIN = TrainConfig(
    steps=3, batch_size=8, lr=1e-3, warmup_steps=1, eval_every=3, eval_batches=1, log_every=1, grad_clip=1e9, seed=3
)  # grad_clip out of the way: the raw gradients are compared
CASES = {
    "accum2": dict(grad_accum=2),
    "ac": dict(activation_checkpointing=True),
    "ac_accum2": dict(grad_accum=2, activation_checkpointing=True),
}
# float64 runs, every top-k gap of the reference above GAP_FLOOR: the mesh takes the same routing decisions by
# construction (tests/ties.py), and differs by sums in another order, ~1e-15.
DTYPE = torch.float64
GRAD_TOL = TOL = 1e-9
GAP_FLOOR = 1e-9


def _corpus() -> Corpus:
    """Zipf bytes, none following itself: no exact ties of identical hidden states (tests/ties.py)."""
    data = ties.zipf_no_repeat(40_000, 256, seed=0).astype(np.uint8)
    return Corpus(train=data[:36_000], val=data[36_000:], source="zipf-bytes-no-repeat")


def _capture_first_grads(t: Trainer, full) -> dict:
    """Wrap the optimizer so that its first step records every gradient, whole (``full(grad)``)."""
    grads: dict = {}
    step = t.optimizer.step

    def capture(*a, **k):
        if not grads:
            grads.update(
                {n: full(p.grad).detach().clone() for n, p in t.model.named_parameters() if p.grad is not None}
            )
        return step(*a, **k)

    t.optimizer.step = capture
    return grads


def _summary(t: Trainer) -> dict:
    return {
        "curve": [(r["loss"], r["grad_norm"]) for r in t.history if "loss" in r],
        "val": [r["val_loss"] for r in t.history if "val_loss" in r],
        "bias": [r.bias_X.tolist() for r in t.bias_routers],
    }


# ----------------------------------------------------------------------------------------------------
# worker side


def _worker(rank: int, world: int, store: str, out_dir: str, pool: str, out4: str) -> None:
    pools.run_rank(
        rank, world, store, out_dir, TIMEOUT_S, lambda: _cases(rank, Path(out_dir)), barrier=True, destroy=True
    )


def _cases(rank: int, out: Path) -> dict:
    from mode.parallel import build_mesh
    from mode.parallel.mesh import ParallelDims

    def case(name: str, kw: dict) -> dict:
        mesh = build_mesh(ParallelDims(2, 2), timeout_s=TIMEOUT_S)
        t = Trainer(
            MODEL,
            replace(TRAIN, **kw),
            _corpus(),
            out / name,
            progress=False,
            mesh=mesh,
            timeout_s=TIMEOUT_S,
            dtype=DTYPE,
        )
        calls = []
        sync = t._gradient_sync
        if sync is not None:
            t._gradient_sync = lambda model, on: calls.append(on) or sync(model, on)
        grads = _capture_first_grads(t, lambda g: g.full_tensor())  # a collective per tensor, every rank
        t.run()
        if rank == 0:
            torch.save(grads, out / f"{name}_grads.pt")
        return {**_summary(t), "sync_calls": calls[:4]}

    res = {}
    for name, kw in CASES.items():
        pools.run_case(res, name, lambda name=name, kw=kw: case(name, kw))
    return res


# ----------------------------------------------------------------------------------------------------
# parent side


@pytest.fixture(scope="module")
def runs():
    pool = {"mesh4": 4}
    with pools.running(_worker, pool) as run:
        tmp = run.tmp
        ref = Trainer(MODEL, TRAIN, _corpus(), tmp / "ref", progress=False, dtype=DTYPE)  # whole batch, no features
        ref_grads = _capture_first_grads(ref, lambda g: g)
        with ties.active() as gaps:
            ref.run()
        results = run.wait(None, JOIN_TIMEOUT_S)  # every rank reports
        grads = {name: torch.load(p) if (p := tmp / "mesh4" / f"{name}_grads.pt").exists() else None for name in CASES}
        yield {"gaps": gaps, "ref": _summary(ref), "ref_grads": ref_grads, "results": results, "grads": grads}


def test_reference_decisions_are_not_near_ties(runs):
    """The precondition of the equalities below (tests/ties.py)."""
    runs["gaps"].assert_above(GAP_FLOOR, "the whole-batch reference")


@pytest.mark.parametrize("name", list(CASES))
def test_first_step_gradients_equal_one_process_whole_batch(runs, name):
    pools.case_results(runs["results"], "mesh4", name)
    got, want = runs["grads"][name], runs["ref_grads"]
    assert got is not None and got.keys() == want.keys() and want, (sorted(got or {}), sorted(want))
    worst = max(float((got[k] - want[k]).abs().max()) for k in want)
    assert worst <= GRAD_TOL, f"{name}: largest gradient difference {worst}"


@pytest.mark.parametrize("name", list(CASES))
def test_curve_and_bias_equal_one_process_whole_batch(runs, name):
    ref = runs["ref"]
    for r, x in enumerate(pools.case_results(runs["results"], "mesh4", name)):
        assert len(x["curve"]) == len(ref["curve"]) == TRAIN.steps
        for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(x["curve"], ref["curve"]), 1):
            assert abs(loss - ref_loss) <= TOL, f"{name} rank {r} step {step}: loss {loss} vs {ref_loss}"
            assert math.isclose(norm, ref_norm, rel_tol=TOL), f"{name} rank {r} step {step}: {norm} vs {ref_norm}"
        assert abs(x["val"][-1] - ref["val"][-1]) <= TOL
        for got, want in zip(x["bias"], ref["bias"], strict=True):
            assert np.allclose(got, want, rtol=0, atol=1e-6), (name, r, got, want)
    assert any(v != 0 for b in ref["bias"] for v in b)  # the bias did move


def test_fsdp_reduces_after_the_last_micro_batch_only(runs):
    for x in pools.case_results(runs["results"], "mesh4", "accum2"):
        assert x["sync_calls"] == [False, True, False, True]  # two steps' worth
    for x in pools.case_results(runs["results"], "mesh4", "ac"):
        assert x["sync_calls"] == []  # one micro-batch: FSDP as usual

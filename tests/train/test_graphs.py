"""The CUDA-graph training step (``mode.train.graphs``): capture-safe on the CPU, equal to eager, checkpoints
that any run resumes; the capture itself on a GPU (``gpu`` tests, skipped without CUDA)."""

from __future__ import annotations

import importlib

import pytest
import torch
from test_train import corpus, model_cfg, stable, train_cfg

from mode.measure.host_sync import HostSyncCounter
from mode.train import Trainer
from mode.train.graphs import GRAPH_WARMUP_STEPS, GraphedTrainStep, StepSums

LAYERS = ("moe", "staged", "integrated")  # dropless token choice, MoD top-C with an MoE inside, no-op slots


@pytest.fixture
def capturable_on_cpu(monkeypatch):
    """AdamW's capturable path refuses CPU tensors by a device list only (its foreach math runs anywhere):
    allow the CPU for the rehearsal of the captured step, so that its optimizer is the one a GPU captures."""
    adam = importlib.import_module("torch.optim.adam")  # the module (torch.optim.adam may name a function)
    supported = adam._get_capturable_supported_devices
    monkeypatch.setattr(
        adam, "_get_capturable_supported_devices", lambda supports_xla=True: [*supported(supports_xla), "cpu"]
    )


def rehearsal(tmp_path, name: str = "graphs", **kw) -> Trainer:
    """A CPU trainer whose steps run the captured code eagerly (``capture=False``)."""
    t = Trainer(model_cfg(*LAYERS), train_cfg(**kw), corpus(), tmp_path / name, progress=False)
    t.graphed = GraphedTrainStep(t, capture=False)
    return t


def losses(history: list[dict]) -> list[float]:
    return [r["loss"] for r in history if "loss" in r]


def test_cuda_graphs_need_cuda(tmp_path):
    with pytest.raises(ValueError, match=r"cuda_graphs=True needs CUDA: this run is on cpu"):
        Trainer(model_cfg(*LAYERS), train_cfg(), corpus(), tmp_path, progress=False, device="cpu", cuda_graphs=True)
    with pytest.raises(TypeError, match=r"cuda_graphs='yes': must be a bool"):
        Trainer(model_cfg(*LAYERS), train_cfg(), corpus(), tmp_path, progress=False, cuda_graphs="yes")


def test_mode_train_cuda_graphs_on_a_cpu_is_a_clear_error(tmp_path, data, capsys):
    from mode.parallel.command import main

    rc = main(
        [
            "--preset",
            "quick",
            "--device",
            "cpu",
            "--cuda-graphs",
            "--steps",
            "2",
            "--data",
            str(data),
            "--out",
            str(tmp_path / "run"),
            "--no-progress",
        ]
    )
    assert rc == 2
    assert "cuda_graphs=True needs CUDA" in capsys.readouterr().err


def test_unsupported_combinations_are_refused(tmp_path):
    cfg = model_cfg(*LAYERS)
    with pytest.raises(ValueError, match=r"activation_checkpointing=True: not supported together"):
        GraphedTrainStep(
            Trainer(cfg, train_cfg(activation_checkpointing=True), corpus(), tmp_path / "a", progress=False),
            capture=False,
        )
    glob = model_cfg(*LAYERS, router_options={"balance_scope": "global"})
    with pytest.raises(ValueError, match=r"grad_accum=2 and a 'global' balance loss: its counting pass"):
        GraphedTrainStep(
            Trainer(glob, train_cfg(grad_accum=2), corpus(), tmp_path / "b", progress=False), capture=False
        )
    with pytest.raises(ValueError, match=r"warmup=0: must be an int >= 1"):
        GraphedTrainStep(Trainer(cfg, train_cfg(), corpus(), tmp_path / "c", progress=False), capture=False, warmup=0)


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_the_captured_step_trains_like_the_eager_one(tmp_path, capturable_on_cpu, grad_accum):
    """The captured code run eagerly every step (the rehearsal): the same losses, gradient norms and routing
    statistics as the trainer's own step, within float rounding (capturable AdamW forms its bias correction on
    the device, in float32)."""
    plain = Trainer(model_cfg(*LAYERS), train_cfg(grad_accum=grad_accum), corpus(), tmp_path / "plain", progress=False)
    graphed = rehearsal(tmp_path, grad_accum=grad_accum)
    hist_p, hist_g = plain.run(), graphed.run()
    assert graphed.graphed.eager_steps == GRAPH_WARMUP_STEPS and graphed.graphed.sums is not None
    assert [r["step"] for r in hist_p] == [r["step"] for r in hist_g]
    torch.testing.assert_close(
        torch.tensor(losses(hist_g), dtype=torch.float64),
        torch.tensor(losses(hist_p), dtype=torch.float64),
        rtol=1e-5,
        atol=1e-6,
    )
    norms = [[r["grad_norm"] for r in h if "grad_norm" in r] for h in (hist_p, hist_g)]
    torch.testing.assert_close(torch.tensor(norms[1]), torch.tensor(norms[0]), rtol=1e-4, atol=1e-6)
    routing = [[r["routing"] for r in h if "routing" in r] for h in (hist_p, hist_g)]
    assert len(routing[0]) == len(routing[1]) == 3
    for a, b in zip(*routing):  # per-step statistics summed in place, drained at each record
        assert a.keys() == b.keys()
        for key in a["overall"]:
            assert b["overall"][key] == pytest.approx(a["overall"][key], rel=1e-4, abs=1e-6), key
    for p, q in zip(plain.model.parameters(), graphed.model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5)


def test_the_captured_region_makes_no_host_sync(tmp_path, capturable_on_cpu):
    """Forward, backward, clipping, AdamW, the bias update and the in-place routing sums: nothing that would
    make a GPU's host wait, copy host data in, or change shape with the data (HostSyncCounter, any device).
    The one exception is the CPU's own: AdamW adds 1 to CPU step counters with a CPU scalar tensor (one per
    parameter group); on CUDA, where the counters live on the device, it adds a Python 1."""
    t = rehearsal(tmp_path, steps=GRAPH_WARMUP_STEPS + 2)
    t.run(GRAPH_WARMUP_STEPS + 1)  # past the warm-up: the in-place sums are laid out
    step_is_cpu = t.optimizer.state[t.params[0]]["step"].is_cpu
    with HostSyncCounter() as syncs:
        out = t.graphed._body(t.graphed.sums)
    expected = [("aten.lift_fresh.default", "host data copied to the device")] * len(t.optimizer.param_groups)
    assert step_is_cpu and syncs.events == expected, syncs.events
    ce, flops, grad_norm = out
    assert all(isinstance(v, torch.Tensor) for v in (ce, flops, grad_norm))  # read later, with the step's scalars


def test_step_sums_add_in_place_and_refuse_a_new_layout():
    from mode.measure.stats import RoutingAccumulator

    acc = RoutingAccumulator()
    acc._acc("r|kept_E", torch.tensor([1.0, 2.0]))
    acc._acc("r|calls", 1.0)
    sums = StepSums.like(acc, torch.device("cpu"))
    before = {k: v.data_ptr() for k, v in sums.sums.items()}
    for _ in range(3):
        sums._acc("r|kept_E", torch.tensor([1, 2]))
        sums._acc("r|calls", 1.0)
    assert {k: v.data_ptr() for k, v in sums.sums.items()} == before  # the graph's addresses
    assert sums.sums["r|kept_E"].tolist() == [3.0, 6.0] and sums.sums["r|calls"].tolist() == [3.0]
    with pytest.raises(RuntimeError, match=r"routing statistic 'r\|new' appeared after the warm-up"):
        sums._acc("r|new", 1.0)
    with pytest.raises(RuntimeError, match=r"'r\|kept_E': 3 values, the warm-up had 2"):
        sums._acc("r|kept_E", torch.ones(3))
    sums.zero_()
    assert sums.sums["r|kept_E"].tolist() == [0.0, 0.0]


def test_checkpoints_stay_plain_and_resume_either_way(tmp_path, capturable_on_cpu):
    """A run with the captured step saves AdamW in the plain format (float lr, capturable False, CPU float32 step
    counters); a plain run resumes it, and it resumes a plain run, each continuing as the uninterrupted run."""
    from mode.train.checkpoint import load_checkpoint

    full = Trainer(model_cfg(*LAYERS), train_cfg(), corpus(), tmp_path / "full", progress=False)
    ref = losses(full.run())
    first = rehearsal(tmp_path, "first")
    first.run(6)
    first.save()
    opt = load_checkpoint(first.ckpt_path, training=True)["optimizer"]
    assert all(isinstance(g["lr"], float) and g["capturable"] is False for g in opt["param_groups"])
    assert all(s["step"].device.type == "cpu" and s["step"].dtype == torch.float32 for s in opt["state"].values())
    assert isinstance(first.optimizer.param_groups[0]["lr"], torch.Tensor)  # the live optimizer is untouched

    plain = Trainer(model_cfg(*LAYERS), train_cfg(), corpus(), tmp_path / "plain", progress=False)
    plain.load(first.ckpt_path)
    torch.testing.assert_close(torch.tensor(losses(plain.run())), torch.tensor(ref), rtol=1e-5, atol=1e-6)

    half = Trainer(model_cfg(*LAYERS), train_cfg(), corpus(), tmp_path / "half", progress=False)
    half.run(6)
    half.save()
    back = rehearsal(tmp_path, "back")
    back.load(half.ckpt_path)
    assert back.optimizer.param_groups[0]["capturable"] is True
    assert all(g["lr"] is back.graphed.lr_t for g in back.optimizer.param_groups)
    torch.testing.assert_close(torch.tensor(losses(back.run())), torch.tensor(ref), rtol=1e-5, atol=1e-6)
    assert back.graphed.eager_steps == GRAPH_WARMUP_STEPS  # warmed up again after the load


# ------------------------------------------------------------------------------------------------- on a GPU


def cuda_trainer(tmp_path, name: str, cuda_graphs: bool, steps: int = 10) -> Trainer:
    return Trainer(
        model_cfg(*LAYERS),
        train_cfg(steps=steps, eval_every=5),
        corpus(),
        tmp_path / name,
        progress=False,
        device="cuda",
        bf16=True,
        cuda_graphs=cuda_graphs,
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_training_equals_eager_on_a_gpu(tmp_path):
    """Captured once, replayed for every later step: the same losses as eager within bf16 kernels'
    nondeterminism (index_add_ / scatter atomics), evaluation and checkpoints in between."""
    eager, graphed = cuda_trainer(tmp_path, "eager", False), cuda_trainer(tmp_path, "graphs", True)
    hist_e, hist_g = eager.run(), graphed.run()
    assert graphed.graphed.captures == 1 and graphed.graphed.graph is not None
    torch.testing.assert_close(torch.tensor(losses(hist_g)), torch.tensor(losses(hist_e)), rtol=2e-3, atol=2e-3)
    assert (
        stable([r for r in hist_g if "routing" in r])[-1].keys()
        == stable([r for r in hist_e if "routing" in r])[-1].keys()
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_replayed_step_makes_one_host_sync(tmp_path):
    """A replayed step: the batch copied in without blocking, one graph launch, and the step's scalars read
    once: CUDA's own sync debug mode counts exactly that one."""
    from mode.measure.host_sync import CudaSyncCounter

    before = torch.get_default_device()
    torch.set_default_device(None)
    try:
        t = cuda_trainer(tmp_path, "sync", True)
        for _ in range(GRAPH_WARMUP_STEPS + 1):
            t.train_step()
        torch.cuda.synchronize()
        with CudaSyncCounter() as syncs:
            t.train_step()
    finally:
        torch.set_default_device(None if before.type == "cpu" else before)
    assert t.graphed.captures == 1
    assert syncs.count == 1, syncs.events

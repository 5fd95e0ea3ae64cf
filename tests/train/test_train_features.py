"""Gradient accumulation, activation checkpointing and the log's speed, in one process (the (2, 2) gloo mesh:
tests/parallel/test_train_features_mesh.py).

    * ``grad_accum`` N = 2 and 4 equal the whole batch: the loss and every gradient (1e-6), for dense, MoD,
      token choice with the "global" balance loss and bias balancing, and expert choice; without the
      counting pass the global balance loss would not (the test would notice);
    * activation checkpointing gives the gradients of the plain model for every layer kind (random MoD
      included: its draws are replayed), and the recompute counts nothing twice (bias load, threshold EMA,
      routing statistics);
    * every log line has tok_s; MFU with a peak rate; TensorBoard files with the scalar tags (skipped without
      the ``tb`` extra);
    * the errors name the field, the value and the rule.
"""

from __future__ import annotations

import contextlib
import io
import math
import re
import sys

import numpy as np
import pytest
import ties
import torch

from mode.model import LM, LMConfig, checkpointing
from mode.model.checkpointing import checkpoint_blocks, is_checkpointed, preserved_buffers
from mode.train import TrainConfig, Trainer
from mode.train.accumulate import GradAccumulation, global_balance_routers
from mode.train.data import Corpus
from mode.train.log_sinks import known_peak_tflops
from mode.train.progress import Progress
from mode.train.runtime import OneProcess

SEQ, BATCH = 16, 8
GRAD_TOL = 1e-6


def corpus() -> Corpus:
    """Zipf bytes, none following itself: no identical hidden states whose routing scores tie exactly and break
    by the batch's shape, whole batch against micro-batches (docs/distributed.md, "Near ties"; tests/ties.py)."""
    data = ties.zipf_no_repeat(40_000, 256, seed=0).astype(np.uint8)
    return Corpus(train=data[:36_000], val=data[36_000:], source="zipf-bytes-no-repeat")


def model_cfg(*layers: str, **kw) -> LMConfig:
    base = dict(
        seq_len=SEQ,
        d_model=16,
        n_heads=2,
        d_hidden=32,
        layers=layers,
        num_experts=4,
        capacity=0.25,
        num_noop=1 if "integrated" in layers else 0,
    )
    base.update(kw)
    return LMConfig(**base)


def train_cfg(**kw) -> TrainConfig:
    # grad_clip out of the way: the gradients compared are the raw ones
    base = dict(
        steps=3,
        batch_size=BATCH,
        lr=1e-3,
        warmup_steps=1,
        eval_every=3,
        eval_batches=1,
        log_every=1,
        grad_clip=1e9,
        seed=0,
    )
    base.update(kw)
    return TrainConfig(**base)


GLOBAL = dict(balance_coef=0.05, router_options=dict(balance_scope="global", bias_balance=True, bias_rate=0.01))
MODELS = {
    "dense": model_cfg("dense", "dense"),
    "mod": model_cfg("mod", "dense", "mod"),
    "token_choice_global": model_cfg("moe", "staged", "integrated", top_k=2, **GLOBAL),
    "expert_choice": model_cfg("moe", "dense", router="expert_choice", top_k=1),
}


def first_step(cfg: LMConfig, tcfg: TrainConfig, tmp_path, **trainer_kw) -> tuple[float, dict, Trainer]:
    """One training step: (its loss, every gradient before the optimizer used it, the trainer)."""
    t = Trainer(cfg, tcfg, corpus(), tmp_path, progress=False, **trainer_kw)
    grads: dict[str, torch.Tensor] = {}
    step = t.optimizer.step

    def capture(*a, **k):
        grads.update({n: p.grad.detach().clone() for n, p in t.model.named_parameters() if p.grad is not None})
        return step(*a, **k)

    t.optimizer.step = capture
    loss, _ = t.train_step()
    return loss, grads, t


def max_grad_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a, (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# ------------------------------------------------------------------------------------ gradient accumulation


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("name", list(MODELS))
def test_grad_accum_equals_the_whole_batch(tmp_path, name, n):
    cfg = MODELS[name]
    loss1, grads1, t1 = first_step(cfg, train_cfg(), tmp_path / "whole")
    loss_n, grads_n, tn = first_step(cfg, train_cfg(grad_accum=n), tmp_path / "micro")
    assert abs(loss_n - loss1) <= GRAD_TOL, (loss_n, loss1)
    assert max_grad_diff(grads_n, grads1) <= GRAD_TOL
    # the bias update counted every micro-batch: the same load, the same bias
    for r1, rn in zip(t1.bias_routers, tn.bias_routers, strict=True):
        assert torch.equal(r1.bias_X, rn.bias_X)
    # the routing statistics counted every micro-batch
    s1, sn = t1.routing.summary(), tn.routing.summary()
    assert s1["layers"].keys() == sn["layers"].keys()
    for key in s1["overall"]:
        assert math.isclose(sn["overall"][key], s1["overall"][key], rel_tol=1e-6, abs_tol=1e-6), key
    assert sum(v.sum().item() for k, v in tn.routing.sums.items() if k.endswith("tokens")) == sum(
        v.sum().item() for k, v in t1.routing.sums.items() if k.endswith("tokens")
    )


def test_grad_accum_curve_equals_the_whole_batch(tmp_path):
    """Three steps (the bias moving between them), losses and gradient norms, validation loss."""
    cfg = MODELS["token_choice_global"]
    whole = Trainer(cfg, train_cfg(), corpus(), tmp_path / "whole", progress=False)
    micro = Trainer(cfg, train_cfg(grad_accum=4), corpus(), tmp_path / "micro", progress=False)
    h1, hn = whole.run(), micro.run()
    c1 = [(r["loss"], r["grad_norm"]) for r in h1 if "loss" in r]
    cn = [(r["loss"], r["grad_norm"]) for r in hn if "loss" in r]
    assert len(c1) == len(cn) == 3
    for (a, na), (b, nb) in zip(c1, cn):
        assert abs(a - b) <= 1e-5 and math.isclose(na, nb, rel_tol=1e-5)
    assert abs(h1[-1]["val_loss"] - hn[-1]["val_loss"]) <= 1e-5
    assert micro.flops == pytest.approx(whole.flops, rel=1e-9) and micro.tokens == whole.tokens


def test_global_balance_loss_sums_the_counts_of_every_micro_batch():
    """The aux losses of the N micro-batches (each / N) add up to the whole batch's, and the balance loss
    needs the counting pass for it: without, the micro-batches' own counts give another loss."""
    cfg = MODELS["token_choice_global"]
    torch.manual_seed(0)
    model = LM(cfg)
    x = torch.randint(0, 256, (BATCH, SEQ))
    whole = model(x, x).aux
    acc = GradAccumulation(model, 4, contextlib.nullcontext, torch.device("cpu"))
    assert acc.routers == global_balance_routers(model) and len(acc.routers) == 3
    micro = acc.split(x, x)
    with acc.whole_batch_routing(micro):
        outs = [model(xm, ym).aux for xm, ym in micro]
    assert all(r.reduce_counts is None for r in acc.routers)  # put back
    for key, value in whole.losses.items():
        got = sum(o.losses[key] for o in outs) / 4
        assert torch.allclose(got, value, rtol=1e-6, atol=0), (key, got, value)
    assert "layers.0.moe.balance" in whole.losses
    alone = sum(model(xm, ym).aux.losses["layers.0.moe.balance"] for xm, ym in micro) / 4
    assert abs(float((alone - whole.losses["layers.0.moe.balance"]).detach())) > 1e-4  # the micro-batches' own counts


def test_grad_accum_without_the_counting_pass_would_differ(tmp_path, monkeypatch):
    cfg = MODELS["token_choice_global"]
    _, grads1, _ = first_step(cfg, train_cfg(), tmp_path / "whole")
    monkeypatch.setattr(GradAccumulation, "whole_batch_routing", lambda self, micro: contextlib.nullcontext())
    _, grads_n, _ = first_step(cfg, train_cfg(grad_accum=4), tmp_path / "micro")
    assert max_grad_diff(grads_n, grads1) > 100 * GRAD_TOL


def test_counting_pass_leaves_no_trace():
    """RNG (a random MoD layer draws in it), every buffer (the threshold EMA), the bias load: as before."""
    cfg = model_cfg("mod_random", "moe", "mod", causal="threshold", **GLOBAL)
    torch.manual_seed(0)
    model = LM(cfg)
    model(torch.randint(0, 256, (2, SEQ)))  # the threshold calibrated (a training-mode forward)
    x = torch.randint(0, 256, (BATCH, SEQ))
    acc = GradAccumulation(model, 2, contextlib.nullcontext, torch.device("cpu"))
    before = {n: b.clone() for n, b in model.named_buffers()}
    rng = torch.get_rng_state()
    totals = acc.count(acc.split(x, x))
    assert torch.equal(torch.get_rng_state(), rng)
    for n, b in model.named_buffers():
        assert torch.equal(b, before[n]) or (b.isnan().all() and before[n].isnan().all()), n
    (router,) = acc.routers
    assert totals[0][-1].item() == BATCH * SEQ  # tokens of both micro-batches
    assert totals[0][:-1].sum().item() == BATCH * SEQ * cfg.top_k  # every choice of them
    assert torch.equal(router.load_X, before["layers.1.mlp.router.load_X"])  # the calibrating forward's only


# ----------------------------------------------------------------------------------- activation checkpointing

AC_MODELS = {
    "dense": model_cfg("dense", "dense"),
    "mod": model_cfg("mod", "dense"),
    "mod_random": model_cfg("mod_random", "dense", "mod_random"),
    "moe_token_choice": model_cfg("moe", "moe", top_k=2, **GLOBAL),
    "moe_expert_choice": model_cfg("moe", "dense", router="expert_choice"),
    "staged": model_cfg("staged", "dense", causal="threshold"),
    "integrated": model_cfg("integrated", "staged", causal="predictor"),
}


def _grads_and_buffers(model: LM, x: torch.Tensor, seed: int) -> tuple[dict, dict, torch.Tensor]:
    torch.manual_seed(seed)
    out = model(x, x)
    (out.loss + out.aux.total()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, {n: b.clone() for n, b in model.named_buffers()}, out.loss.detach()


@pytest.mark.parametrize("name", list(AC_MODELS))
def test_activation_checkpointing_gives_the_same_gradients_and_counts_once(name):
    cfg = AC_MODELS[name]
    torch.manual_seed(0)
    plain = LM(cfg)
    ac = LM(cfg)
    ac.load_state_dict(plain.state_dict())
    checkpoint_blocks(ac)
    x = torch.randint(0, 256, (4, SEQ))
    g1, b1, l1 = _grads_and_buffers(plain, x, seed=5)
    g2, b2, l2 = _grads_and_buffers(ac, x, seed=5)
    assert torch.equal(l1, l2)
    assert max_grad_diff(g2, g1) <= GRAD_TOL
    for n in b1:  # load_X of bias balancing, the threshold EMA: one forward's worth, not two
        assert torch.equal(b1[n], b2[n]) or (b1[n].isnan().all() and b2[n].isnan().all()), n
    assert any("load_X" in n for n in b1) == (name == "moe_token_choice")
    if name == "moe_token_choice":
        assert b2["layers.0.mlp.router.load_X"].sum().item() == 4 * SEQ * 2  # each token's 2 choices, once


def test_random_mod_needs_its_draws_replayed(monkeypatch):
    """Without the RNG state replayed, the recompute of a random MoD block routes other tokens: the test
    above would fail."""
    cfg = AC_MODELS["mod_random"]
    torch.manual_seed(0)
    plain = LM(cfg)
    ac = LM(cfg)
    ac.load_state_dict(plain.state_dict())
    checkpoint_blocks(ac)
    real = checkpointing.checkpoint
    monkeypatch.setattr(
        checkpointing,
        "checkpoint",
        lambda fn, *a, **k: real(fn, *a, **{**k, "preserve_rng_state": False, "determinism_check": "none"}),
    )
    x = torch.randint(0, 256, (4, SEQ))
    g1, _, _ = _grads_and_buffers(plain, x, seed=5)
    g2, _, _ = _grads_and_buffers(ac, x, seed=5)
    assert max_grad_diff(g2, g1) > 10 * GRAD_TOL


def test_recompute_without_restored_buffers_would_count_twice(monkeypatch):
    cfg = AC_MODELS["moe_token_choice"]
    torch.manual_seed(0)
    model = LM(cfg)
    checkpoint_blocks(model)
    monkeypatch.setattr(
        checkpointing.CheckpointedForward,
        "_contexts",
        lambda self: (contextlib.nullcontext(), contextlib.nullcontext()),
    )
    _, buffers, _ = _grads_and_buffers(model, torch.randint(0, 256, (4, SEQ)), seed=5)
    assert buffers["layers.0.mlp.router.load_X"].sum().item() == 2 * 4 * SEQ * 2


@pytest.mark.parametrize("n", [1, 2])
def test_trainer_with_activation_checkpointing_trains_the_same_run(tmp_path, n):
    """The whole loop: curve, bias, routing records (counted once) and checkpoint equal the plain run's."""
    cfg = model_cfg("mod_random", "moe", "staged", "integrated", causal="threshold", **GLOBAL)
    drop = ("wall", "tok_s", "mfu", "mfu_measured")
    plain = Trainer(cfg, train_cfg(grad_accum=n), corpus(), tmp_path / "plain", progress=False)
    h1 = [{k: v for k, v in r.items() if k not in drop} for r in plain.run()]  # (the random MoD layer draws
    ac = Trainer(
        cfg, train_cfg(grad_accum=n, activation_checkpointing=True), corpus(), tmp_path / "ac", progress=False
    )  # from the global RNG, which each trainer seeds: one after the other)
    assert all(is_checkpointed(layer) for layer in ac.model.layers)
    h2 = [{k: v for k, v in r.items() if k not in drop} for r in ac.run()]
    assert h1 == h2  # bit for bit on the CPU: the same operations, recomputed
    assert any("routing" in r for r in h2)
    for r1, r2 in zip(plain.bias_routers, ac.bias_routers, strict=True):
        assert torch.equal(r1.bias_X, r2.bias_X)
    s1, s2 = plain.model.state_dict(), ac.model.state_dict()
    assert s1.keys() == s2.keys()  # checkpointing renames nothing
    assert all(torch.equal(s1[k], s2[k]) or s1[k].isnan().all() for k in s1)


def test_checkpoint_blocks_only_in_training_forwards():
    torch.manual_seed(0)
    model = LM(model_cfg("mod", "dense", causal="predictor"))
    keys = list(model.state_dict())
    blocks = checkpoint_blocks(model)
    assert blocks == list(model.layers) and checkpoint_blocks(model) == blocks  # again: nothing changes
    assert list(model.state_dict()) == keys
    calls = []
    real = checkpointing.checkpoint
    checkpointing.checkpoint = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        x = torch.randint(0, 256, (2, SEQ))
        with torch.no_grad():
            model(x)
        assert not calls
        from mode.model.generate import generate

        model.eval()
        generate(model, x[:, :4].tolist(), max_new_tokens=3)
        assert not calls
        model.train()
        model(x, x).loss.backward()
        assert len(calls) == 2
    finally:
        checkpointing.checkpoint = real


def test_preserved_buffers_restores_values_and_objects():
    m = torch.nn.BatchNorm1d(3)
    mean = m.running_mean
    with preserved_buffers(m):
        m.running_mean.add_(1.0)
        m.running_var = torch.full((3,), 7.0)
    assert m.running_mean is mean and torch.equal(mean, torch.zeros(3))
    assert torch.equal(m.running_var, torch.ones(3))


# ------------------------------------------------------------------------------------------------ the log


def test_every_log_line_has_tokens_per_second_and_no_mfu_on_a_cpu(tmp_path):
    t = Trainer(model_cfg("dense"), train_cfg(), corpus(), tmp_path, progress=False)
    hist = t.run()
    lines = [r for r in hist if "loss" in r or "val_loss" in r]
    assert lines and all(r["tok_s"] > 0 for r in lines)
    assert not any("mfu" in r for r in hist)  # a CPU has no known peak


class _Terminal(io.StringIO):
    def isatty(self) -> bool:  # the bar is drawn on a terminal only (mode.train.progress)
        return True


def test_mfu_against_a_given_peak(tmp_path):
    term = _Terminal()
    t = Trainer(
        model_cfg("dense", "moe"),
        train_cfg(peak_tflops=0.5),
        corpus(),
        tmp_path,
        progress=Progress(err=term, out=io.StringIO()),
    )
    hist = t.run()
    last = [r for r in hist if "loss" in r][-1]
    assert last["mfu"] == pytest.approx(last["flops"] / last["wall"] / 0.5e12)
    assert last["tok_s"] == pytest.approx(last["tokens"] / last["wall"])
    bar = term.getvalue()
    assert "tok_s=" in bar and re.search(r"mfu=\d+\.\d%", bar), bar[-400:]


@pytest.mark.parametrize(
    "device_name,expected",
    [
        ("NVIDIA H100 80GB HBM3", ("H100 SXM", 989.0)),
        ("NVIDIA H100 PCIe", ("H100 PCIe", 756.0)),
        ("NVIDIA H100 NVL", ("H100 NVL", 835.0)),
        ("NVIDIA H200", ("H200 SXM", 989.0)),
        ("NVIDIA A100-SXM4-80GB", ("A100", 312.0)),
        ("NVIDIA A100 80GB PCIe", ("A100", 312.0)),
        ("NVIDIA L4", ("L4", 121.0)),
        ("NVIDIA A10", ("A10", 125.0)),
        ("NVIDIA A10G", None),
        ("NVIDIA GeForce RTX 4090", ("GeForce RTX 4090", 165.2)),
        ("Tesla T4", None),
    ],
)
def test_known_peak_rates(device_name, expected):
    assert known_peak_tflops(device_name) == expected


def test_tensorboard_event_files_hold_the_scalars(tmp_path):
    pytest.importorskip("tensorboard", reason="the tb extra (pip install 'mode-torch[tb]') is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = model_cfg("moe", "mod")
    t = Trainer(cfg, train_cfg(tensorboard=True, peak_tflops=1.0), corpus(), tmp_path, progress=False)
    hist = t.run()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    ea = EventAccumulator(str(tmp_path / "tb"))
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tok_s", "train/mfu", "val/loss"} <= tags
    assert any(tag.startswith("routing/") for tag in tags)
    losses = [(e.step, e.value) for e in ea.Scalars("train/loss")]
    assert losses == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in hist if "loss" in r]


def test_tensorboard_missing_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    with pytest.raises(
        ValueError,
        match=re.escape("tensorboard=True: needs the tensorboard package")
        + ".*"
        + re.escape("pip install 'mode-torch[tb]'"),
    ):
        Trainer(model_cfg("dense"), train_cfg(tensorboard=True), corpus(), tmp_path, progress=False)


# ------------------------------------------------------------------------------------------ flags, errors


def test_mode_train_flags():
    from mode.parallel.command import build_parser, configs

    args = build_parser().parse_args(
        ["--preset", "small", "--grad-accum", "2", "--ac", "--tensorboard", "--peak-tflops", "312"]
    )
    _, tcfg, _ = configs(args)
    assert (tcfg.grad_accum, tcfg.activation_checkpointing, tcfg.tensorboard, tcfg.peak_tflops) == (
        2,
        True,
        True,
        312.0,
    )
    _, tcfg, _ = configs(build_parser().parse_args([]))
    assert (tcfg.grad_accum, tcfg.activation_checkpointing, tcfg.tensorboard, tcfg.peak_tflops) == (
        1,
        False,
        False,
        None,
    )


@pytest.mark.parametrize(
    "kw,exc,msg",
    [
        (dict(grad_accum=0), ValueError, "grad_accum=0: must be >= 1"),
        (dict(grad_accum=2.0), TypeError, "grad_accum=2.0: must be an int"),
        (dict(grad_accum=3), ValueError, "grad_accum=3: must divide batch_size=8"),
        (dict(activation_checkpointing=1), TypeError, "activation_checkpointing=1: must be a bool"),
        (dict(tensorboard="yes"), TypeError, "tensorboard='yes': must be a bool"),
        (dict(peak_tflops=0.0), ValueError, "peak_tflops=0.0: must be finite and > 0"),
    ],
)
def test_train_config_errors(kw, exc, msg):
    with pytest.raises(exc, match=re.escape(msg)):
        train_cfg(**kw)


class TwoProcesses(OneProcess):
    world_size = 2


def test_grad_accum_must_divide_each_process_rows(tmp_path):
    with pytest.raises(
        ValueError,
        match=re.escape(
            "grad_accum=8: must divide the rows each process trains on, batch_size / processes = 8 / 2 = 4"
        ),
    ):
        Trainer(
            model_cfg("dense"),
            train_cfg(grad_accum=8),
            corpus(),
            tmp_path,
            progress=False,
            runtime=TwoProcesses(torch.device("cpu")),
        )


def test_activation_checkpointing_with_compile_is_refused(tmp_path):
    with pytest.raises(
        ValueError, match=re.escape("activation_checkpointing=True with compile=True: not supported together yet")
    ):
        Trainer(
            model_cfg("dense"),
            train_cfg(activation_checkpointing=True),
            corpus(),
            tmp_path,
            progress=False,
            compile=True,
        )


def test_checkpoint_blocks_needs_blocks():
    with pytest.raises(ValueError, match=r"model=Linear: has no blocks to checkpoint"):
        checkpoint_blocks(torch.nn.Linear(2, 2))


def test_mode_train_refuses_a_grad_accum_that_does_not_divide_the_batch(capsys):
    from mode.parallel.command import main

    assert main(["--preset", "quick", "--grad-accum", "3", "--no-progress"]) == 2
    assert "grad_accum=3: must divide batch_size=8" in capsys.readouterr().err


def test_run_identity_keeps_old_records_resumable():
    """mode compare / mode isoflop resume only the same run: the new fields that change nothing computed stay out
    of the recorded identity, and grad_accum only enters it when it is not 1."""
    old = {
        "steps",
        "batch_size",
        "lr",
        "min_lr_ratio",
        "warmup_steps",
        "weight_decay",
        "grad_clip",
        "eval_every",
        "eval_batches",
        "log_every",
        "ckpt_every",
        "stats_every",
        "seed",
    }
    assert set(TrainConfig().identity()) == old
    assert set(TrainConfig(activation_checkpointing=True, tensorboard=True, peak_tflops=9.0).identity()) == old
    assert TrainConfig(grad_accum=2).identity()["grad_accum"] == 2

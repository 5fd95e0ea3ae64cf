"""Training on a (dp, ep) device mesh (gloo, CPU) equals training in one process: mode.train.Trainer with a
mesh, mode.parallel.parallelize on a hand-written model, sharded (DCP) checkpoints across layouts.

Spawned pools, all started at once by one module fixture (their start-up overlaps the single-process
references the parent computes meanwhile); each runs many cases on one process group, and every rank
writes what it saw to a file (judged here, not by exit codes: gloo's shutdown may abort a finished rank):
    * 4 processes: the LM with MoE, staged-MoDE and integrated-MoDE layers, with token-choice and with
      expert-choice routers, trained at (dp, ep) = (2, 2), (1, 4), (4, 1); the shards each rank holds
      right after set-up; a sharded checkpoint at step 3 of the (2, 2) run; the example's hand-written
      model (examples/parallel_custom_model.py) parallelized at (2, 2);
    * 2 processes: resume from the (2, 2) checkpoint at (1, 2) and (2, 1); import from one file (the same
      checkpoint exported); per-rank aux losses (balance loss, capacity) against micro-batches; bf16
      autocast; then rank 1 is killed (SIGKILL) in the middle of training: rank 0 must raise;
    * 2 processes, collective timeout 8 s: rank 1 sleeps through a step: rank 0 must raise after the timeout.
The parent then resumes the (2, 2) checkpoint in one process and reads the checkpoints with load_model.

Exactness. Every rank holds the same number of rows, so the mean of the per-rank cross-entropies is the
global mean, and so is the mean of the z-losses; MoD top-C and expert choice pick per sequence. With
balance_coef=0 and no capacity limit the mesh computes exactly the single-process function: per-step
losses and gradient norms equal one process's up to float rounding (sums in another order). The Switch
balance loss and a capacity limit are per rank, so with them on, a run on P row groups equals one process
that splits each batch into P micro-batches.

Near-ties, excluded by construction (tests/ties.py). A routing decision whose top-k boundary gap is below
the rounding that differs between the runs flips, and the runs part by far more than rounding: on an AVX2
EPYC the expert-choice curve at step 6 differed by 6e-5 (issue 46). Two causes, each removed:
    * exact ties. i.i.d. Zipf bytes repeat a byte at the start of a window often (p ~ 0.05 per window); the
      leading positions of a run of one byte have identical hidden states (causal attention over identical
      values), so their scores tie exactly, and topk breaks the tie by an order that depends on the tensor's
      shape: a batch of 8 rows against a rank's 2. Measured in one process, whole batch against 4 micro-
      batches: 6e-5 apart in float32 and in float64 alike. The data here never repeat a byte twice in a row.
    * rounding. Every run here is float64 (Trainer(dtype=torch.float64)): the runs differ by ~1e-15
      (measured: whole batch against micro-batches, 9e-16 in loss, 6e-15 in grad norm), and the reference's
      every top-k gap is asserted above GAP_FLOOR = 1e-9 (test_reference_decisions_are_not_near_ties).
So the mesh is held to TOL = 1e-9 at every step, and its routing statistics to the same. A bug that moves a
row or an expert's weights changes the loss by far more (docs/testing.md: the mutation checks).

Silent failures this guards: expert shards that FSDP would treat as replicated (the expert-shard and
grad-norm checks), experts never reduced over dp (the (2, 2) and (4, 1) curves), a checkpoint holding one
ep group's experts (every expert tensor in the checkpoint has all E rows; resume on other layouts).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import signal
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pools
import pytest
import ties
import torch

from mode.model import LM, LMConfig
from mode.parallel.mesh import ParallelDims, mesh_dims
from mode.train import TrainConfig, Trainer, build_optimizer, lr_at
from mode.train.data import BatchSampler, Corpus

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.cpu_only("gloo ranks on CPU; the CPU run covers them (NCCL needs one GPU per rank)"),
]

ROOT = Path(__file__).resolve().parents[2]
JOIN_TIMEOUT_S = 240.0
TRAIN_TIMEOUT_S = 60.0  # the training pools' collective timeout (generous: 2 shared cores)
STUCK_TIMEOUT_S = 8.0  # the stuck pool's
TOL = 1e-9  # float64 runs differ by ~1e-15 (the module docstring)
NORM_RTOL = 1e-9
GAP_FLOOR = 1e-9  # every top-k gap of the references exceeds this: no decision can flip (tests/ties.py)
DTYPE = torch.float64

TOKEN_CHOICE = LMConfig(
    seq_len=16,
    d_model=32,
    n_heads=2,
    d_hidden=64,
    layers=("moe", "staged", "integrated"),
    num_experts=8,
    num_noop=2,
    top_k=2,
    capacity=0.5,
    capacity_factor=None,
    balance_coef=0.0,
    z_coef=1e-3,
)
EXPERT_CHOICE = replace(TOKEN_CHOICE, router="expert_choice", top_k=1)
# DeepSeek-V3 / Qwen-MoE recipes: a balancing bias updated from the choice counts of every rank, the global-batch
# balance loss (counts summed over the mesh before the loss), shared experts with Qwen2's gate, 4 groups (one per
# ep rank at ep = 4) of which each token keeps 2, sigmoid gates scaled by 2.5
RECIPES = replace(
    TOKEN_CHOICE,
    balance_coef=0.01,
    num_shared=1,
    shared_gate=True,
    router_options=dict(
        gate="sigmoid",
        renormalize=True,
        scale=2.5,
        n_group=4,
        topk_group=2,
        bias_balance=True,
        bias_rate=0.01,
        balance_scope="global",
    ),
)
MODELS = {"token_choice": TOKEN_CHOICE, "expert_choice": EXPERT_CHOICE, "recipes": RECIPES}
MODEL_AUX = replace(TOKEN_CHOICE, balance_coef=0.01, capacity_factor=1.0)  # per-rank balance loss and drops
TRAIN = TrainConfig(steps=6, batch_size=8, lr=1e-3, warmup_steps=2, eval_every=3, eval_batches=2, log_every=1, seed=3)
LAYOUTS = [(2, 2), (1, 4), (4, 1)]
SAVE_AT = 3  # the (2, 2) token-choice run saves a sharded checkpoint here: CKPT3
CKPT3 = "ckpt3"
CUSTOM_STEPS = 4


def _corpus() -> Corpus:
    """Bytes drawn from a Zipf law over the 256 values, a byte never following itself: learnable (the
    unigram law), and no two positions of a window with identical hidden states, whose routing scores would
    tie exactly (the module docstring)."""
    data = ties.zipf_no_repeat(200_000, 256, seed=0).astype(np.uint8)
    return Corpus(train=data[:180_000], val=data[180_000:], source="zipf-bytes-no-repeat")


def _custom_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Global batches of 8 windows of 16 for the example's model, from ``_corpus()``."""
    sampler = BatchSampler(_corpus().train, 8, 16, seed=0)
    return [sampler.next() for _ in range(CUSTOM_STEPS)]


def _curve(history: list[dict]) -> list[tuple[float, float]]:
    return [(r["loss"], r["grad_norm"]) for r in history if "loss" in r]


def _example():
    path = ROOT / "examples" / "parallel_custom_model.py"
    spec = importlib.util.spec_from_file_location("parallel_custom_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _trained(t: Trainer) -> dict:
    t.run()
    return _run_summary(t)


def _run_summary(t: Trainer) -> dict:
    return {
        "curve": _curve(t.history),
        "val": [r["val_loss"] for r in t.history if "val_loss" in r],
        "routing": [r for r in t.history if "routing" in r],
        "flops": t.flops,
        "step": t.step,
        "bias": [r.bias_X.tolist() for r in t.bias_routers],
    }


# ----------------------------------------------------------------------------------------------------
# worker side


def _shards(t: Trainer) -> dict:
    """What this rank holds right after set-up: each expert weight's local rows (their sums, to find them in
    the full weight), each dense weight's local and global element counts."""
    out = {"experts": {}, "dense": {}}
    for name, p in t.model.named_parameters():
        local = p.to_local()
        if ".experts." in name:
            out["experts"][name] = local.detach().sum(dim=tuple(range(1, local.dim()))).tolist()
        else:
            out["dense"][name] = [local.numel(), p.numel()]
    return out


def _pool4(rank: int, out: Path) -> dict:
    from mode.parallel import build_mesh, parallelize

    corpus, res = _corpus(), {}
    for name, cfg in MODELS.items():
        for dp, ep in LAYOUTS:

            def run(name=name, cfg=cfg, dp=dp, ep=ep):
                mesh = build_mesh(ParallelDims(dp, ep), timeout_s=TRAIN_TIMEOUT_S)
                t = Trainer(
                    cfg,
                    TRAIN,
                    corpus,
                    out / f"{name}_{dp}x{ep}",
                    progress=False,
                    mesh=mesh,
                    timeout_s=TRAIN_TIMEOUT_S,
                    dtype=DTYPE,
                )
                extra = {}
                if (name, dp, ep) == ("token_choice", 2, 2):
                    extra["shards"] = _shards(t)
                    t.run(stop_step=SAVE_AT)
                    t.save(out / CKPT3)
                    if rank == 0:
                        (out / f"{CKPT3}.ready").write_text("")
                t.run()
                return {**_run_summary(t), **extra, "ckpt": str(t.ckpt_path)}

            pools.run_case(res, f"{name}_{dp}x{ep}", run)

    def custom():
        ex = _example()
        mesh = build_mesh(ParallelDims(2, 2), timeout_s=TRAIN_TIMEOUT_S)
        torch.manual_seed(0)
        model = parallelize(ex.TinyMoDE().to(DTYPE), mesh)
        return {"curve": ex.train(model, _custom_batches(), world_size=4, row_rank=rank)}

    pools.run_case(res, "custom", custom)
    return res


def _pool2(rank: int, out: Path, out4: Path) -> dict:
    from mode.parallel import build_mesh
    from mode.parallel.checkpoint import export
    from mode.parallel.process_group import CollectiveError

    corpus, res = _corpus(), {}

    def mesh(dp, ep):
        return build_mesh(ParallelDims(dp, ep), timeout_s=TRAIN_TIMEOUT_S)

    def aux():
        t = Trainer(MODEL_AUX, TRAIN, corpus, out / "aux", progress=False, mesh=mesh(1, 2), dtype=DTYPE)
        return _trained(t)

    pools.run_case(res, "aux", aux)

    def bf16():
        t = Trainer(
            TOKEN_CHOICE, replace(TRAIN, steps=2), corpus, out / "bf16", progress=False, mesh=mesh(2, 1), bf16=True
        )
        return _trained(t)

    pools.run_case(res, "bf16", bf16)

    ready = out4 / f"{CKPT3}.ready"
    for dp, ep in [(1, 2), (2, 1)]:

        def resume(dp=dp, ep=ep):
            pools.wait_for_file(ready, JOIN_TIMEOUT_S / 2)
            t = Trainer(
                TOKEN_CHOICE, TRAIN, corpus, out / f"resume_{dp}x{ep}", progress=False, mesh=mesh(dp, ep), dtype=DTYPE
            )
            t.load(out4 / CKPT3)
            assert t.step == SAVE_AT, t.step
            return _trained(t)

        pools.run_case(res, f"resume_{dp}x{ep}", resume)

    def import_file():
        single = out / "ckpt3.pt"
        if rank == 0:
            export(out4 / CKPT3, single)  # this process alone, no collectives
            (out / "ckpt3.pt.ready").write_text("")
        pools.wait_for_file(out / "ckpt3.pt.ready", 60)
        t = Trainer(TOKEN_CHOICE, TRAIN, corpus, out / "import", progress=False, mesh=mesh(1, 2), dtype=DTYPE)
        t.load(single)
        return _trained(t)

    pools.run_case(res, "import", import_file)

    def killed():
        t = Trainer(
            TOKEN_CHOICE, TRAIN, corpus, out / "killed", progress=False, mesh=mesh(1, 2), timeout_s=TRAIN_TIMEOUT_S
        )
        t.train_step()
        t.train_step()
        if rank == 1:
            (out / "rank1.json").write_text(json.dumps(res))  # what it has, before it dies
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.monotonic()
        try:
            t.train_step()
        except CollectiveError as e:
            return {"error": str(e), "seconds": time.monotonic() - t0}
        return {"error": None, "seconds": time.monotonic() - t0}

    pools.run_case(res, "killed", killed)
    return res


def _pool_stuck(rank: int, out: Path) -> dict:
    from mode.parallel import build_mesh
    from mode.parallel.process_group import CollectiveError

    t = Trainer(
        TOKEN_CHOICE,
        TRAIN,
        _corpus(),
        out,
        progress=False,
        mesh=build_mesh(ParallelDims(1, 2), timeout_s=STUCK_TIMEOUT_S),
        timeout_s=STUCK_TIMEOUT_S,
    )
    t.train_step()
    if rank == 1:
        time.sleep(3 * STUCK_TIMEOUT_S)  # stuck: never reaches step 2's collectives in time
        os._exit(0)
    t0 = time.monotonic()
    try:
        t.train_step()
    except CollectiveError as e:
        return {"stuck": {"error": str(e), "seconds": time.monotonic() - t0}}
    return {"stuck": {"error": None, "seconds": time.monotonic() - t0}}


def _worker(rank: int, world: int, store: str, out_dir: str, pool: str, out4: str) -> None:
    out = Path(out_dir)
    work = {
        "mesh4": lambda: _pool4(rank, out),
        "mesh2": lambda: _pool2(rank, out, Path(out4)),
        "stuck": lambda: _pool_stuck(rank, out),
    }[pool]
    pools.run_rank(
        rank,
        world,
        store,
        out_dir,
        STUCK_TIMEOUT_S if pool == "stuck" else TRAIN_TIMEOUT_S,
        work,
        barrier=pool == "mesh4",
        destroy=pool == "mesh4",
    )


# ----------------------------------------------------------------------------------------------------
# parent side: single-process references


def _single(model_cfg: LMConfig, tmp: Path) -> Trainer:
    t = Trainer(model_cfg, TRAIN, _corpus(), tmp, progress=False, dtype=DTYPE)
    t.run()
    return t


def _micro_batched(model_cfg: LMConfig, micro: int) -> list[tuple[float, float]]:
    """One process, each global batch split into ``micro`` micro-batches, losses averaged (gradient
    accumulation): (loss, grad norm) per step. The function a mesh of ``micro`` row groups computes when aux
    losses and capacity are per rank, and the same float operations per row group."""
    torch.manual_seed(TRAIN.seed)
    model = LM(model_cfg).to(DTYPE)
    opt = build_optimizer(model, TRAIN)
    sampler = BatchSampler(_corpus().train, TRAIN.batch_size, model_cfg.seq_len, TRAIN.seed)
    curve = []
    for step in range(TRAIN.steps):
        x_BS, y_BS = sampler.next()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, TRAIN)
        ce = 0.0
        for x, y in zip(x_BS.chunk(micro), y_BS.chunk(micro)):
            out = model(x, y)
            ((out.loss + out.aux.total()) / micro).backward()
            ce += float(out.loss.detach()) / micro
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), TRAIN.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        curve.append((ce, float(norm)))
    return curve


POOLS = {"mesh4": 4, "mesh2": 2, "stuck": 2}
REPORTING = {"mesh4": [0, 1, 2, 3], "mesh2": [0, 1], "stuck": [0]}  # the stuck rank never reports


@pytest.fixture(scope="module")
def runs():
    from mode.parallel.checkpoint import save_folder
    from mode.parallel.dcp_safe import read_metadata
    from mode.train import evaluate
    from mode.train.checkpoint import load_model

    with pools.running(_worker, POOLS) as run:
        tmp = run.tmp
        ex = _example()
        gaps = {}
        with ties.active() as gaps["ref"]:
            ref = {name: _single(cfg, tmp / f"ref_{name}") for name, cfg in MODELS.items()}
        with ties.active() as gaps["ref_aux"]:
            ref_aux = _micro_batched(MODEL_AUX, 2)
        torch.manual_seed(0)  # as the ranks do before building the example's model
        with ties.active() as gaps["ref_custom"]:
            ref_custom = ex.train(ex.TinyMoDE().to(DTYPE), _custom_batches())
        torch.manual_seed(TRAIN.seed)
        init = LM(TOKEN_CHOICE).state_dict()  # the weights every rank starts from
        results = run.wait(REPORTING, JOIN_TIMEOUT_S)
        # Everything that needs the checkpoint folders runs before they go away.
        parent = {}
        ckpt3 = tmp / "mesh4" / CKPT3
        if (tmp / "mesh4" / f"{CKPT3}.ready").exists():
            t = Trainer(TOKEN_CHOICE, TRAIN, _corpus(), tmp / "resume_one", progress=False, dtype=DTYPE)
            t.load(ckpt3)  # one process, no process group, from a 4-process (2, 2) checkpoint
            parent["resume_one"] = {"start": t.step, **_trained(t)}
            md = read_metadata(save_folder(ckpt3), "ckpt3")
            parent["expert_rows"] = {
                k: list(v.size)
                for k, v in md.state_dict_metadata.items()
                if ".experts." in k and not k.endswith(".step")
            }
        final = tmp / "mesh4" / "token_choice_2x2" / "ckpt"
        if final.exists():
            model, state = load_model(final)
            parent["final_val"] = evaluate(model, ref["token_choice"].val_batches)
            parent["final_step"] = state["step"]
        exported = tmp / "mesh2" / "ckpt3.pt"
        if exported.exists():
            a, _ = load_model(exported)
            b, _ = load_model(ckpt3)
            parent["export_equal"] = all(torch.equal(a.state_dict()[k], v) for k, v in b.state_dict().items())
            # the transformers export of the (2, 2) sharded folder and of the same model in one process
            from safetensors.torch import load_file

            from mode.hf.export import export_transformers

            export_transformers(ckpt3, tmp / "hf_mesh", verify=False)
            export_transformers(b, tmp / "hf_one", verify=False)
            mesh_t, one_t = (load_file(str(tmp / d / "model.safetensors")) for d in ("hf_mesh", "hf_one"))
            parent["hf_export_equal"] = mesh_t.keys() == one_t.keys() and all(
                torch.equal(v, one_t[k]) for k, v in mesh_t.items()
            )
        yield {
            "gaps": gaps,
            "results": results,
            "ref": ref,
            "ref_aux": ref_aux,
            "ref_custom": ref_custom,
            "init": init,
            "parent": parent,
            "wall": time.monotonic() - run.started,
        }


_assert_curve = functools.partial(pools.assert_curve, tol=TOL, norm_rtol=NORM_RTOL)


# ----------------------------------------------------------------------------------------------------
# tests


@pytest.mark.parametrize("ref", ["ref", "ref_aux", "ref_custom"])
def test_reference_decisions_are_not_near_ties(runs, ref):
    """The precondition of every equality below (tests/ties.py): no routing decision of the references lies
    within GAP_FLOOR of a flip, so a run on a mesh, whose arithmetic differs by ~1e-15, takes the same ones."""
    runs["gaps"][ref].assert_above(GAP_FLOOR, ref)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"dp{x[0]}xep{x[1]}")
@pytest.mark.parametrize("name", list(MODELS))
def test_curve_and_grad_norm_equal_one_process(runs, name, layout):
    dp, ep = layout
    ref = runs["ref"][name]
    # every rank: the global numbers
    for r, x in enumerate(pools.case_results(runs["results"], "mesh4", f"{name}_{dp}x{ep}")):
        _assert_curve(x["curve"], _curve(ref.history), f"{name} ({dp}, {ep}) rank {r}")
        ref_val = [v["val_loss"] for v in ref.history if "val_loss" in v]
        assert len(x["val"]) == len(ref_val) and max(abs(a - b) for a, b in zip(x["val"], ref_val)) <= TOL
        assert math.isclose(x["flops"], ref.flops, rel_tol=1e-9)  # realized-routing FLOPs add up over ranks
    # routing statistics summed over the ranks == one process's (the same decisions: the module docstring)
    ref_routing = [v["routing"]["overall"] for v in ref.history if "routing" in v]
    got = [v["routing"]["overall"] for v in x["routing"]]
    assert len(got) == len(ref_routing) > 0
    for a, b in zip(got, ref_routing):
        for key, value in b.items():
            assert math.isclose(a[key], value, rel_tol=TOL, abs_tol=TOL), (key, a[key], value)
    assert _curve(ref.history)[-1][0] < _curve(ref.history)[0][0]  # it does train


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"dp{x[0]}xep{x[1]}")
def test_balancing_bias_equals_one_process(runs, layout):
    """The bias moves by the sign of the load summed over every rank: after 6 steps it is one process's, on
    every rank (the counts are integers: summed in any order they are exact)."""
    dp, ep = layout
    ref = [r.bias_X.tolist() for r in runs["ref"]["recipes"].bias_routers]
    assert len(ref) == 3 and any(v != 0 for b in ref for v in b)
    for r, x in enumerate(pools.case_results(runs["results"], "mesh4", f"recipes_{dp}x{ep}")):
        for got, want in zip(x["bias"], ref, strict=True):
            assert np.allclose(got, want, rtol=0, atol=1e-6), (layout, r, got, want)


def test_shards_after_setup(runs):
    """(2, 2): each rank's expert rows are its own part of the full weight (the ranks' parts differ and
    tile all E rows exactly once: a plain-tensor shard replicated over the ep ranks would fail); each dense
    weight is split over the 4 ranks (1/4 each where its first dimension divides)."""
    shards = [x["shards"] for x in pools.case_results(runs["results"], "mesh4", "token_choice_2x2")]
    init = runs["init"]
    for name, full in init.items():
        if ".experts." not in name:
            continue
        row_sums = full.sum(dim=tuple(range(1, full.dim()))).tolist()
        covered = []
        for r, s in enumerate(shards):
            local = s["experts"][name]
            assert 0 < len(local) < len(row_sums), (name, r, len(local))
            starts = [
                o
                for o in range(len(row_sums) - len(local) + 1)
                if all(
                    math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-5) for a, b in zip(local, row_sums[o : o + len(local)])
                )
            ]
            assert len(starts) == 1, f"{name} rank {r}: its rows are not one part of the full weight"
            covered += range(starts[0], starts[0] + len(local))
        assert sorted(covered) == list(range(full.shape[0])), f"{name}: rows covered {sorted(covered)}"
    for name, _ in shards[0]["dense"].items():
        locals_ = [s["dense"][name][0] for s in shards]
        total = shards[0]["dense"][name][1]
        assert sum(locals_) == total, (name, locals_, total)
        if init[name].shape[0] % 4 == 0:
            assert locals_ == [total // 4] * 4, (name, locals_)


def test_checkpoint_holds_every_expert_row(runs):
    rows = runs["parent"]["expert_rows"]
    assert rows and len(rows) == 6 * 3  # 3 layers x 2 weights, each with exp_avg and exp_avg_sq
    assert all(size[0] == TOKEN_CHOICE.num_experts for size in rows.values()), rows


def test_resume_on_other_layouts_and_one_process(runs):
    """Saved at step 3 on (2, 2); resumed on (1, 2), (2, 1) and in one process: the uninterrupted curve."""
    expected = _curve(runs["ref"]["token_choice"].history)
    for layout in ("1x2", "2x1"):
        for r, x in enumerate(pools.case_results(runs["results"], "mesh2", f"resume_{layout}")):
            _assert_curve(x["curve"], expected, f"resumed on {layout} rank {r}")
    one = runs["parent"]["resume_one"]
    assert one["start"] == SAVE_AT
    _assert_curve(one["curve"], expected, "resumed in one process")
    # the continued (2, 2) run itself, and its final sharded checkpoint read in one process
    x = pools.case_results(runs["results"], "mesh4", "token_choice_2x2")[0]
    assert runs["parent"]["final_step"] == TRAIN.steps
    assert abs(runs["parent"]["final_val"] - x["val"][-1]) <= TOL


def test_export_then_import_a_single_file(runs):
    assert runs["parent"]["export_equal"]


def test_transformers_export_of_a_sharded_checkpoint_equals_one_process(runs):
    assert runs["parent"]["hf_export_equal"]
    for r, x in enumerate(pools.case_results(runs["results"], "mesh2", "import")):
        _assert_curve(x["curve"], _curve(runs["ref"]["token_choice"].history), f"imported rank {r}")


def test_aux_losses_per_rank(runs):
    """Balance loss and capacity on: 2 row groups == one process with 2 micro-batches per step."""
    x = pools.case_results(runs["results"], "mesh2", "aux")[0]
    _assert_curve(x["curve"], runs["ref_aux"], "balance loss and capacity on 2 row groups")


def test_bf16_autocast_trains(runs):
    x = pools.case_results(runs["results"], "mesh2", "bf16")[0]
    fp32 = _curve(runs["ref"]["token_choice"].history)[:2]
    assert all(math.isfinite(loss) and math.isfinite(norm) for loss, norm in x["curve"])
    assert max(abs(a[0] - b[0]) for a, b in zip(x["curve"], fp32)) < 0.05  # bfloat16 rounding, not a bug


def test_user_model_parallelized(runs):
    for r, x in enumerate(pools.case_results(runs["results"], "mesh4", "custom")):
        _assert_curve(x["curve"], runs["ref_custom"], f"examples/parallel_custom_model.py at (2, 2) rank {r}")


def test_killed_rank_raises_within_the_timeout(runs):
    x = pools.case_results(runs["results"], "mesh2", "killed", ranks=[0])[0]
    assert x["error"] is not None, x
    assert "rank 0/2" in x["error"] and "training step 3" in x["error"] and "another rank died" in x["error"]
    assert x["seconds"] < TRAIN_TIMEOUT_S, x  # the closed connection is noticed well before the timeout


def test_stuck_rank_raises_after_the_timeout(runs):
    x = pools.case_results(runs["results"], "stuck", "stuck", ranks=[0])[0]
    assert x["error"] is not None and "rank 0/2" in x["error"] and "training step 2" in x["error"], x
    assert STUCK_TIMEOUT_S * 0.8 <= x["seconds"] < STUCK_TIMEOUT_S + 20, x


# ----------------------------------------------------------------------------------------------------
# errors that need no process group


@pytest.mark.parametrize(
    "call,exc,msg",
    [
        (lambda: ParallelDims(dp=0), ValueError, "dp=0: must be >= 1"),
        (lambda: ParallelDims(ep=2.0), TypeError, "ep=2.0: must be an int"),
        (lambda: ParallelDims.for_world(4, dp=3), ValueError, "dp=3: must divide the number of processes 4"),
        (
            lambda: ParallelDims.for_world(4, dp=2, ep=4),
            ValueError,
            "dp=2, ep=4: dp * ep = 8 must equal the number of processes 4",
        ),
        (lambda: ParallelDims(1, 3).check_experts(8), ValueError, "num_experts=8: must be divisible by ep=3"),
        (lambda: mesh_dims("cpu"), TypeError, "mesh=str: must be a torch DeviceMesh"),
        (
            lambda: Trainer(TOKEN_CHOICE, TRAIN, _corpus(), tempfile.mkdtemp(), device="tpu"),
            ValueError,
            "device='tpu': must be 'auto', 'cpu', 'cuda' or 'cuda:N'",
        ),
        (
            lambda: Trainer(TOKEN_CHOICE, TRAIN, _corpus(), tempfile.mkdtemp(), bf16="yes"),
            TypeError,
            "bf16='yes': must be a bool",
        ),
        (
            lambda: Trainer(TOKEN_CHOICE, TRAIN, _corpus(), tempfile.mkdtemp(), dtype=torch.bfloat16),
            ValueError,
            "dtype=torch.bfloat16: must be torch.float32 or torch.float64",
        ),
        (
            lambda: Trainer(TOKEN_CHOICE, TRAIN, _corpus(), tempfile.mkdtemp(), bf16=True, dtype=torch.float64),
            ValueError,
            "bf16=True with dtype=torch.float64: choose one",
        ),
    ],
)
def test_parallel_config_errors(call, exc, msg):
    with pytest.raises(exc, match=msg.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        call()


def test_build_mesh_needs_a_process_group():
    from mode.parallel import build_mesh

    with pytest.raises(ValueError, match="torch.distributed is not initialised"):
        build_mesh(ParallelDims(1, 1))


def test_default_dims_spread_the_experts():
    assert ParallelDims.for_world(8) == ParallelDims(1, 8)
    assert ParallelDims.for_world(8, dp=2) == ParallelDims(2, 4)
    assert ParallelDims.for_world(8, ep=2) == ParallelDims(4, 2)


def test_train_command_refuses_several_processes_without_torchrun(tmp_path, capsys, monkeypatch):
    from mode.cli import main

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["train", "--dp", "2", "--out", str(tmp_path), "--no-progress"]) == 2
    assert "start the command with torchrun --nproc-per-node 2 -m mode train" in capsys.readouterr().err

"""Checkpoints you can trust across machines, and your own model on a mesh (docs/distributed.md, docs/checkpoints.md).

In one process: every DCP folder (``save_state``, the trainer's sharded saves) carries ``SHA256SUMS``, the
manifest coreutils' ``sha256sum -c`` checks; a flipped byte in any file of it is a ``ChecksumError`` naming the
file and both sums; an old folder without one loads with a warning; ``collective_guard`` turns a raw backend
error into a ``CollectiveError``; ``init_distributed`` refuses to make a group of one when more processes are
asked for, and ``build_mesh`` says how to start them.

Spawned pools (gloo), started together, each rank writing what it saw to a file (tests/parallel/pools.py):
    * 4 processes, a (2, 2) mesh: the example's hand-written model (examples/parallel_custom_model.py) with 6
      experts, parallelized and trained 2 steps, saved with PyTorch's own calls (get_state_dict + dcp.save) and
      with ``save_state``, then trained 2 more steps (the uninterrupted curve); the placements and local rows
      of an expert weight as a user sees them; the LM trained by ``Trainer`` with ``MeshRuntime(async_save=True)``
      and checkpoints at steps 2 and 4;
    * 3 processes, a (1, 3) mesh (6 experts: 2 per rank): both checkpoints loaded (``dcp.load`` +
      ``set_state_dict``, and ``load_state``) into a model built from another seed, steps 3-4 trained; a copy
      with one flipped byte refused on every rank before any tensor changes; then rank 2 leaves, and the
      others' next all-reduce fails: raw, and inside ``collective_guard``.
The parent loads both checkpoints into a plain model with no process group and trains steps 3-4 too: every
curve equals the uninterrupted one.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pools
import pytest
import torch

from mode.model import LMConfig
from mode.train import TrainConfig, Trainer
from mode.train.checkpoint import CheckpointError, ChecksumError
from mode.train.data import BatchSampler, Corpus

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.cpu_only("gloo ranks on CPU; the CPU run covers them (NCCL needs one GPU per rank)"),
]

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 60.0
JOIN_TIMEOUT_S = 240.0
TOL = 1e-5
NORM_RTOL = 1e-4
EXPERTS = 6  # divisible by ep = 2 and by ep = 3
BATCH = 12  # rows of every global batch: divisible by 4 and by 3 processes
SEQ = 16
STEPS, SAVE_AT = 4, 2
LM_CFG = LMConfig(
    seq_len=16,
    d_model=32,
    n_heads=2,
    d_hidden=64,
    layers=("moe", "integrated"),
    num_experts=4,
    num_noop=2,
    top_k=2,
    capacity_factor=None,
    balance_coef=0.0,
    z_coef=1e-3,
)
LM_TRAIN = TrainConfig(
    steps=6, batch_size=8, lr=1e-3, warmup_steps=2, eval_every=100, eval_batches=1, log_every=1, ckpt_every=2, seed=0
)


def _example():
    spec = importlib.util.spec_from_file_location(
        "parallel_custom_model", ROOT / "examples" / "parallel_custom_model.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _corpus() -> Corpus:
    """i.i.d. Zipf bytes: no runs of identical bytes whose near-tied routing scores flip under float rounding
    (tests/parallel/test_ep_training.py, NEAR_TIES)."""
    rng = np.random.default_rng(0)
    p = 1.0 / np.arange(1, 257)
    data = rng.choice(256, size=50_000, p=p / p.sum()).astype(np.uint8)
    return Corpus(train=data[:45_000], val=data[45_000:], source="zipf-bytes")


def _batches():
    sampler = BatchSampler(_corpus().train, BATCH, SEQ, seed=0)
    return [sampler.next() for _ in range(STEPS)]


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def _steps(model, optimizer, batches, world: int = 1, rank: int = 0) -> list[tuple[float, float]]:
    """The example's training step (its rows of each global batch, backward on loss / world, one clip over both
    meshes); returns (global mean loss, gradient norm) per step."""
    from mode.parallel import clip_grad_norm_

    curve = []
    for x_BS, y_BS in batches:
        b = x_BS.shape[0] // world
        loss, aux = model(x_BS[rank * b : (rank + 1) * b], y_BS[rank * b : (rank + 1) * b])
        ((loss + aux.total()) / world).backward()
        norm = clip_grad_norm_(list(model.parameters()), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = loss.detach().double()
        if world > 1:
            import torch.distributed as dist

            dist.all_reduce(loss)
        curve.append((float(loss) / world, float(norm)))
    return curve


def _flip(path: Path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x01
    path.write_bytes(bytes(data))


# ----------------------------------------------------------------------------------------------------
# worker side


def _pool4(rank: int, out: Path) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from mode.parallel import MeshRuntime, ParallelDims, build_mesh, parallelize
    from mode.parallel.model_state import save_state

    ex, res = _example(), {}
    batches = _batches()

    def custom():
        mesh = build_mesh(ParallelDims(2, 2), timeout_s=TIMEOUT_S)
        torch.manual_seed(0)
        model = ex.TinyMoDE(experts=EXPERTS)
        full_W = model.layers["moe"].mlp.experts.w_in_EDF.detach().clone()
        model = parallelize(model, mesh)
        w = model.layers["moe"].mlp.experts.w_in_EDF
        local = w.to_local().detach()
        seen = {
            "type": type(w).__name__,
            "placements": repr(w.placements),
            "mesh": list(w.device_mesh.mesh_dim_names),
            "local": list(local.shape),
            "global": list(w.shape),
            "rows": [next(i for i in range(EXPERTS) if torch.equal(full_W[i], row)) for row in local],
        }
        optimizer = _optimizer(model)
        curve = _steps(model, optimizer, batches[:SAVE_AT], 4, rank)
        seen["after_steps"] = repr(w.placements)
        # PyTorch's own calls: every rank saves its shards, at their global shapes
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=out / "raw")
        save_state(out / "ours", model, optimizer, extra={"step": SAVE_AT})  # the same, checked and atomic
        if rank == 0:
            (out / "ready").write_text("")
        curve += _steps(model, optimizer, batches[SAVE_AT:], 4, rank)
        return {"curve": curve, "seen": seen}

    pools.run_case(res, "custom", custom)

    def async_trainer():
        mesh = build_mesh(ParallelDims(2, 2), timeout_s=TIMEOUT_S)
        runtime = MeshRuntime(mesh, TIMEOUT_S, async_save=True)
        t = Trainer(LM_CFG, LM_TRAIN, _corpus(), out / "async", progress=False, runtime=runtime, timeout_s=TIMEOUT_S)
        t.run(stop_step=STEPS)  # saves at 2 and 4 in the background; returns once the last one is complete
        return {
            "curve": [(r["loss"], r["grad_norm"]) for r in t.history if "loss" in r],
            "pending_after_run": runtime._pending is not None,
        }

    pools.run_case(res, "async", async_trainer)
    return res


def _pool3(rank: int, out: Path, out4: Path) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from mode.parallel import ParallelDims, build_mesh, collective_guard, parallelize
    from mode.parallel.model_state import load_state

    ex, res = _example(), {}
    batches = _batches()
    pools.wait_for_file(out4 / "ready", JOIN_TIMEOUT_S)
    mesh = build_mesh(ParallelDims(1, 3), timeout_s=TIMEOUT_S)

    def fresh():
        torch.manual_seed(1)  # other weights than the saved ones: the load must replace every one
        model = parallelize(ex.TinyMoDE(experts=EXPERTS), mesh)
        return model, _optimizer(model)

    def raw():
        model, optimizer = fresh()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=out4 / "raw")  # each rank reads the chunks of its own shards
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        return {"curve": _steps(model, optimizer, batches[SAVE_AT:], 3, rank)}

    pools.run_case(res, "raw", raw)

    def ours():
        model, optimizer = fresh()
        step = load_state(out4 / "ours", model, optimizer)["step"]
        return {"step": step, "curve": _steps(model, optimizer, batches[SAVE_AT:], 3, rank)}

    pools.run_case(res, "ours", ours)

    def flipped():
        model, optimizer = fresh()
        if rank == 0:
            shutil.copytree(out4 / "ours", out / "bad")
            _flip(out / "bad" / "__1_0.distcp")  # rank 1's shard of the (2, 2) save
        dist.barrier()
        before = {k: v.to_local().clone() for k, v in model.state_dict().items()}
        try:
            load_state(out / "bad", model, optimizer)
            error = None
        except Exception as e:  # noqa: BLE001 - reported to the parent
            error = {"type": type(e).__name__, "message": str(e)}
        unchanged = all(torch.equal(v.to_local(), before[k]) for k, v in model.state_dict().items())
        return {"error": error, "unchanged": unchanged}

    pools.run_case(res, "flipped", flipped)

    def peer_leaves():
        dist.barrier()
        if rank == 2:
            (out / "rank2.json").write_text(json.dumps(res))
            os._exit(0)  # gone: its connections close
        time.sleep(1.0)
        seen = {}
        try:
            dist.all_reduce(torch.ones(1))
            seen["raw"] = None
        except Exception as e:  # noqa: BLE001 - what a user's own loop gets
            seen["raw"] = {"type": type(e).__name__, "message": str(e)[:500]}
        try:
            with collective_guard("the loss all-reduce of step 3", TIMEOUT_S):
                dist.all_reduce(torch.ones(1))
            seen["guarded"] = None
        except Exception as e:  # noqa: BLE001 - reported to the parent
            seen["guarded"] = {"type": type(e).__name__, "message": str(e)[:800]}
        return seen

    pools.run_case(res, "peer_leaves", peer_leaves)
    return res


def _worker(rank: int, world: int, store: str, out_dir: str, pool: str, out4: str) -> None:
    out = Path(out_dir)
    work = {"mesh4": lambda: _pool4(rank, out), "mesh3": lambda: _pool3(rank, out, Path(out4))}[pool]
    pools.run_rank(rank, world, store, out_dir, TIMEOUT_S, work, barrier=pool == "mesh4")


# ----------------------------------------------------------------------------------------------------
# parent side

POOLS = {"mesh4": 4, "mesh3": 3}
REPORTING = {"mesh4": [0, 1, 2, 3], "mesh3": [0, 1, 2]}


def _plain_resume(ex, folder: Path, how: str) -> list[tuple[float, float]]:
    """Load a checkpoint of the (2, 2) mesh into a plain model in this process (no process group) and train
    steps 3-4."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from mode.parallel.model_state import load_state

    torch.manual_seed(1)
    model = ex.TinyMoDE(experts=EXPERTS)
    optimizer = _optimizer(model)
    if how == "ours":
        assert load_state(folder, model, optimizer)["step"] == SAVE_AT
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP: "loading in one process"
            dcp.load(state, checkpoint_id=folder, no_dist=True)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return _steps(model, optimizer, _batches()[SAVE_AT:])


@pytest.fixture(scope="module")
def runs():
    from mode.parallel import dcp_safe
    from mode.parallel.checkpoint import save_folder

    with pools.running(_worker, POOLS) as run:
        tmp = run.tmp
        ex = _example()
        torch.manual_seed(0)
        model = ex.TinyMoDE(experts=EXPERTS)
        ref_custom = _steps(model, _optimizer(model), _batches())  # one process, 4 steps
        ref_lm = Trainer(LM_CFG, LM_TRAIN, _corpus(), tmp / "ref_lm", progress=False)
        ref_lm.run()
        results = run.wait(REPORTING, JOIN_TIMEOUT_S)
        parent = {}
        for how in ("ours", "raw"):
            if (tmp / "mesh4" / how).exists():
                parent[how] = _plain_resume(ex, tmp / "mesh4" / how, how)
        ckpt = tmp / "mesh4" / "async" / "ckpt"
        if ckpt.exists():
            folder = save_folder(ckpt)
            parent["async_folders"] = sorted(p.name for p in ckpt.iterdir())
            parent["async_verified"] = dcp_safe.verify_folder(folder)
            t = Trainer(LM_CFG, LM_TRAIN, _corpus(), tmp / "async_resumed", progress=False)
            t.load(ckpt)
            parent["async_resumed_at"] = t.step
            t.run()
            parent["async_resumed"] = [(r["loss"], r["grad_norm"]) for r in t.history if "loss" in r]
        yield {
            "results": results,
            "ref_custom": ref_custom,
            "ref_lm": [(r["loss"], r["grad_norm"]) for r in ref_lm.history if "loss" in r],
            "parent": parent,
        }


_assert_curve = functools.partial(pools.assert_curve, tol=TOL, norm_rtol=NORM_RTOL)


def test_own_model_saved_on_2x2_resumes_on_1x3_and_with_no_process_group(runs):
    """PyTorch's get_state_dict + dcp.save / dcp.load + set_state_dict, and save_state / load_state: saved on
    (2, 2) after step 2, loaded on (1, 3) and into a plain model in one process; steps 3-4 are the
    uninterrupted run's (which is the single-process run's)."""
    mesh4 = pools.case_results(runs["results"], "mesh4", "custom")
    for r, x in enumerate(mesh4):
        _assert_curve(x["curve"], runs["ref_custom"], f"(2, 2) rank {r}")
    after = runs["ref_custom"][SAVE_AT:]
    for how in ("raw", "ours"):
        for r, x in enumerate(pools.case_results(runs["results"], "mesh3", how)):
            _assert_curve(x["curve"], after, f"{how}: resumed on (1, 3), rank {r}")
            if how == "ours":
                assert x["step"] == SAVE_AT
        _assert_curve(runs["parent"][how], after, f"{how}: resumed in one process, no process group")


def test_expert_weights_on_a_2x2_mesh_show_strided_shard_and_their_local_rows(runs):
    """What docs/distributed.md shows a user: 6 experts on (dp, ep) = (2, 2). ep rank e holds experts
    [3e, 3e+3); FSDP splits those 3 over dp as 2 + 1 (torch.chunk: uneven sizes, no padding shown)."""
    seen = [x["seen"] for x in pools.case_results(runs["results"], "mesh4", "custom")]
    for s in seen:
        assert s["type"] == "DTensor" and s["mesh"] == ["dp", "ep"] and s["global"] == [EXPERTS, 32, 64], s
        assert s["placements"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))", s
        assert s["after_steps"] == s["placements"], s
    # rank = d * ep + e
    assert [s["rows"] for s in seen] == [[0, 1], [3, 4], [2], [5]]
    assert [s["local"][0] for s in seen] == [2, 2, 1, 1]


def test_a_flipped_byte_is_refused_on_every_rank_before_any_tensor_changes(runs):
    for r, x in enumerate(pools.case_results(runs["results"], "mesh3", "flipped")):
        assert x["error"] is not None, f"rank {r} loaded a corrupt checkpoint"
        assert x["error"]["type"] == "ChecksumError", x
        assert "__1_0.distcp is corrupt: its SHA-256 is " in x["error"]["message"], x
        assert "SHA256SUMS says " in x["error"]["message"], x
        assert x["unchanged"], f"rank {r}: the model changed before the error"


def test_collective_guard_turns_a_raw_backend_error_of_your_own_loop_into_collective_error(runs):
    for r, x in enumerate(pools.case_results(runs["results"], "mesh3", "peer_leaves", ranks=[0, 1])):
        assert x["raw"] is not None and x["raw"]["type"] in ("RuntimeError", "DistBackendError", "DistError"), x
        g = x["guarded"]
        assert g is not None and g["type"] == "CollectiveError", x
        assert g["message"].startswith(
            f"rank {r}/3: a collective failed during the loss all-reduce of step 3: "
            "another rank died, is stuck (no answer within 60 s"
        ), g


def test_async_checkpoints_of_the_trainer_complete_and_resume_exactly(runs):
    """MeshRuntime(async_save=True): the curve is the single-process one, run() returns with the last save
    complete (latest names it, its SHA256SUMS verify, the step-2 save removed), and one process resumes it
    to the uninterrupted curve."""
    for r, x in enumerate(pools.case_results(runs["results"], "mesh4", "async")):
        _assert_curve(x["curve"], runs["ref_lm"][:STEPS], f"async (2, 2) rank {r}")
        assert not x["pending_after_run"]
    parent = runs["parent"]
    names = parent["async_folders"]
    assert names[0] == "latest" and len(names) == 2 and names[1].startswith("step-00000004-"), names
    assert {".metadata", "meta.json", "__0_0.distcp", "__3_0.distcp"} <= set(parent["async_verified"])
    assert parent["async_resumed_at"] == STEPS
    _assert_curve(parent["async_resumed"][STEPS:], runs["ref_lm"][STEPS:], "async checkpoint resumed in one process")


# ----------------------------------------------------------------------------------------------------
# one process: the manifest, flipped bytes, old folders


class Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _saved(tmp_path: Path) -> tuple[Path, Small, torch.optim.Optimizer]:
    from mode.parallel.model_state import save_state

    torch.manual_seed(0)
    model = Small()
    optimizer = _optimizer(model)
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    return save_state(tmp_path / "ckpt", model, optimizer, extra={"step": 1}), model, optimizer


def _load(folder: Path):
    from mode.parallel.model_state import load_state

    torch.manual_seed(1)
    model = Small()
    optimizer = _optimizer(model)
    return load_state(folder, model, optimizer), model


def test_save_state_writes_sha256sums_that_coreutils_checks(tmp_path):
    import hashlib

    folder, model, _ = _saved(tmp_path)
    lines = (folder / "SHA256SUMS").read_text().splitlines()
    names = sorted(line.split("  ", 1)[1] for line in lines)
    assert names == [".metadata", "__0_0.distcp", "extra.json"]
    for line in lines:
        digest, name = line.split("  ", 1)
        assert digest == hashlib.sha256((folder / name).read_bytes()).hexdigest(), name
    if shutil.which("sha256sum"):
        done = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=folder, capture_output=True, text=True)
        assert done.returncode == 0 and done.stdout.count(": OK") == 3, done
    extra, loaded = _load(folder)
    assert extra == {"step": 1}
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in loaded.state_dict().items())


@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata", "extra.json"])
def test_a_flipped_byte_in_any_file_of_save_state_is_a_checksum_error_naming_it(tmp_path, name):
    folder, _, _ = _saved(tmp_path)
    expected = dict(line.split("  ")[::-1] for line in (folder / "SHA256SUMS").read_text().splitlines())[name]
    _flip(folder / name)
    with pytest.raises(
        ChecksumError,
        match=rf"checkpoint '.*': {name} is corrupt: its SHA-256 is [0-9a-f]{{64}}, "
        rf"SHA256SUMS says {expected} \(changed since it was saved",
    ):
        _load(folder)
    assert issubclass(ChecksumError, CheckpointError) and issubclass(ChecksumError, ValueError)


@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata", "meta.json"])
def test_a_flipped_byte_in_a_trainers_sharded_checkpoint_is_a_checksum_error(tmp_path, name):
    from mode.parallel import dcp_safe
    from mode.parallel.checkpoint import save_folder, save_sharded
    from mode.train.checkpoint import load_model

    t = Trainer(LM_CFG, LM_TRAIN, _corpus(), tmp_path / "run", progress=False)
    t.run(stop_step=1)
    save_sharded(
        tmp_path / "ckpt", t.model, t.optimizer, {**t._progress_state(), "routing_acc": t.routing.state_dict()}
    )
    folder = save_folder(tmp_path / "ckpt")
    assert dcp_safe.verify_folder(folder) == [".metadata", "__0_0.distcp", "meta.json"]
    assert dcp_safe.verify_folder(tmp_path / "ckpt") == [".metadata", "__0_0.distcp", "meta.json"]  # via latest
    _flip(folder / name, 0.3)
    for read in (
        load_model,
        lambda p: Trainer(LM_CFG, LM_TRAIN, _corpus(), tmp_path / "other", progress=False).load(p),
        dcp_safe.verify_folder,
    ):
        with pytest.raises(ChecksumError, match=f"{name} is corrupt: its SHA-256 is"):
            read(tmp_path / "ckpt" if read is not dcp_safe.verify_folder else folder)


def test_an_old_folder_without_sha256sums_loads_with_a_warning(tmp_path):
    from mode.parallel.dcp_safe import UnverifiedCheckpointWarning

    folder, model, _ = _saved(tmp_path)
    (folder / "SHA256SUMS").unlink()
    with pytest.warns(UnverifiedCheckpointWarning, match="no SHA256SUMS in it .*its files are not verified"):
        extra, loaded = _load(folder)
    assert extra == {"step": 1}
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in loaded.state_dict().items())


def test_a_file_left_out_of_the_manifest_or_a_malformed_manifest_is_refused(tmp_path):
    folder, _, _ = _saved(tmp_path)
    sums = folder / "SHA256SUMS"
    good = sums.read_text()
    sums.write_text("".join(line + "\n" for line in good.splitlines() if not line.endswith("__0_0.distcp")))
    with pytest.raises(ChecksumError, match="__0_0.distcp is not listed in its SHA256SUMS"):
        _load(folder)
    sums.write_text("not a checksum line\n")
    with pytest.raises(ChecksumError, match=r"SHA256SUMS line 1 is not '<sha256>  <file>'"):
        _load(folder)


# ----------------------------------------------------------------------------------------------------
# collective_guard and init_distributed, without a process group


def test_collective_guard_is_public_and_converts_only_collective_failures():
    import mode.parallel as mp_
    from mode.parallel import CollectiveError, collective_guard

    assert mp_.collective_guard is collective_guard and "collective_guard" in mp_.__all__
    raw = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:20614"
    )
    with pytest.raises(
        CollectiveError,
        match=r"^rank 0/1: a collective failed during my step 7: another rank died, "
        r"is stuck \(no answer within 30 s.*Backend error: \[.*Connection "
        r"closed by peer",
    ) as info:
        with collective_guard("my step 7", 30):
            raise raw
    assert info.value.__cause__ is raw
    with pytest.raises(CollectiveError, match="^rank 2/4: .* during x: .*the process-group timeout"):
        with collective_guard("x", rank=2, world_size=4):
            raise RuntimeError("gloo timed out")
    with pytest.raises(RuntimeError, match="^shapes do not match$"):  # not a collective's failure: unchanged
        with collective_guard("x", 30):
            raise RuntimeError("shapes do not match")
    with pytest.raises(KeyError):
        with collective_guard("x", 30):
            raise KeyError("k")


@pytest.fixture
def environ():
    saved = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    yield os.environ
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def no_group(monkeypatch):
    """init_process_group recorded, never run."""
    import torch.distributed as dist

    calls = []
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(dist, "is_initialized", lambda: bool(calls))
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: int(os.environ["WORLD_SIZE"]))
    return calls


@pytest.mark.parametrize(
    "env,world,msg",
    [
        (
            {},
            4,
            r"init_distributed\(world_size=4\): this process was not started by torchrun \(RANK and WORLD_SIZE "
            r"are not set\), so it would be a process group of one and train alone; start every process with "
            r"torchrun \(one machine: torchrun --nproc-per-node 4 SCRIPT",
        ),
        ({"WORLD_SIZE": "4"}, None, "init_distributed: WORLD_SIZE is set but RANK, MASTER_ADDR, MASTER_PORT not"),
        ({"RANK": "0", "WORLD_SIZE": "2"}, None, "RANK and WORLD_SIZE set but MASTER_ADDR, MASTER_PORT not"),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
            4,
            r"init_distributed\(world_size=4\): WORLD_SIZE=2 processes were started; start 4",
        ),
        ({}, 0, r"world_size=0: must be an int >= 1"),
    ],
)
def test_init_distributed_refuses_to_train_alone_when_more_processes_are_asked_for(environ, no_group, env, world, msg):
    from mode.parallel import init_distributed

    environ.update(env)
    with pytest.raises(ValueError, match=msg):
        init_distributed("gloo", timeout_s=5, world_size=world)
    assert not no_group, "a process group was started"


def test_init_distributed_without_torchrun_is_still_a_group_of_one_when_one_is_asked_for(environ, no_group):
    from mode.parallel import init_distributed

    for world in (None, 1):
        no_group.clear()
        environ.pop("RANK", None), environ.pop("WORLD_SIZE", None)
        ctx = init_distributed("gloo", timeout_s=5, world_size=world)
        assert (ctx.rank, ctx.world_size) == (0, 1) and len(no_group) == 1


def test_build_mesh_on_a_group_of_one_says_how_to_start_the_processes(tmp_path):
    """A real group of one (its own process: this one must stay without a group)."""
    code = (
        "import os\n"
        "for n in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK'): os.environ.pop(n, None)\n"
        "from mode.parallel import ParallelDims, build_mesh, init_distributed\n"
        "ctx = init_distributed('gloo', timeout_s=20)\n"
        "try:\n"
        "    build_mesh(ParallelDims(2, 2), 'cpu', 20)\n"
        "except ValueError as e:\n"
        "    print('ERROR', e)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert (
        "ERROR dp=2, ep=2: dp * ep = 4 must equal the number of processes 1; this process is a group of one: "
        "start the script with torchrun --nproc-per-node 4"
    ) in done.stdout, done

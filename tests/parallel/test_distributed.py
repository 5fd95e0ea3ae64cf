"""Expert parallelism over torch.distributed (gloo, CPU) equals the single-process layer.

One spawned run per world size (2 and 4 processes) executes every case on a shared process group and
writes its findings to JSON files; the pytest items below only read them. The 4-process run also runs
every case on two 2-rank subgroups ([0, 1] and [2, 3]) at once, so a group handed in from outside
whose ranks differ from the global ranks is covered too.

The reference is exact: every rank has its own tokens (uneven counts across ranks), and since capacity
limits and aux losses are per rank, the single-process layer (all E experts, same weights) is run on
each rank's tokens separately, with the loss summed over ranks. Then
    output, input gradient, aux losses, stats  on rank r == reference on rank r's tokens
    expert-weight gradient on rank r           == the matching slice of the full reference gradient
    replicated-parameter gradients summed over ranks (what the training loop all-reduces) == reference
"""

from __future__ import annotations

import copy
import json
import re
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pools
import pytest
import torch

from mode.experts.bank import ExpertBank, ExpertConfig
from mode.layers.block import TransformerBlock
from mode.layers.mod import StagedMoDE
from mode.layers.moe import IntegratedMoDE, MoEConfig, MoELayer
from mode.parallel.ep_model import shard_layer
from mode.routing.mod_topk import MoDRouter, MoDRouterConfig

pytestmark = pytest.mark.timeout(300)

WORLD_SIZES = (2, 4)
JOIN_TIMEOUT_S = 240.0  # a hang fails the module instead of stalling it
ATOL = RTOL = 1e-5
D, H, E = 16, 24, 8  # E=8: 4 local experts per rank on 2 ranks, 2 on 4 ranks (the permutation matters)

# name -> (kind, config overrides, per-rank (B, S) chosen by group rank, mask?)
CASES = {
    "top1_capacity": ("moe", dict(top_k=1, capacity_factor=1.0), False),
    "top2_capacity_drop": ("moe", dict(top_k=2, capacity_factor=0.5, renormalize=True), True),
    "top2_dropless_sigmoid": ("moe", dict(top_k=2, capacity_factor=None, gate="sigmoid"), False),
    "expert_choice": ("moe", dict(router="expert_choice", capacity_factor=1.0, z_coef=1e-3), False),
    "expert_choice_noop": ("moe", dict(router="expert_choice", num_noop=2, capacity_factor=1.5), True),
    "integrated_mode_top2": ("integrated", dict(top_k=2, num_noop=2, capacity_factor=None), False),
    "integrated_mode_skewed": ("skewed", dict(top_k=1, num_noop=1, capacity_factor=None), False),
    "staged_mode": ("staged", dict(top_k=1, capacity_factor=1.0), False),
    "reference_backend": ("moe", dict(top_k=2, capacity_factor=1.0, backend="reference"), False),
    # dedup=True: one row per (token, destination rank); gates applied on the expert's rank
    "dedup_top2_capacity_drop": ("moe", dict(top_k=2, capacity_factor=0.5, renormalize=True, dedup=True), True),
    "dedup_top4_groups": (
        "moe",
        dict(
            top_k=4,
            gate="sigmoid",
            renormalize=True,
            dedup=True,
            router_options=dict(n_group=2, topk_group=1, bias_balance=True, scale=2.5),
        ),
        False,
    ),
    "dedup_integrated_shared": (
        "integrated",
        dict(top_k=3, num_noop=2, num_shared=1, shared_gate=True, dedup=True),
        True,
    ),
    "dedup_staged": ("staged", dict(top_k=2, capacity_factor=1.0, dedup=True), False),
    # copy and constant no-op experts (LongCat-Flash, MoE++): computed on the token's own rank, never sent
    "integrated_copy_constant": (
        "integrated",
        dict(top_k=2, num_noop=3, noop_kinds=("copy", "constant", "zero"), capacity_factor=None),
        True,
    ),
}
SHAPES = [(2, 8), (1, 5), (3, 7), (2, 6)]  # per group rank: uneven token counts (16, 5, 21, 12)
# The spawned ranks are gloo processes on CPU whatever the session's device: a CUDA session skips them.
GLOO_ONLY = pytest.mark.cpu_only("gloo ranks on CPU; the CPU run covers them (NCCL needs one GPU per rank)")


# ----------------------------------------------------------------------------------------------------
# worker side (runs in the spawned processes)


def _moe_config(overrides: dict) -> MoEConfig:
    return MoEConfig(**{**dict(d_model=D, d_hidden=H, num_experts=E), **overrides})


def _inputs(case: str, kind: str, world: int, use_mask: bool):
    """Every rank builds every rank's inputs (the reference needs them all), deterministically."""
    g = torch.Generator().manual_seed(1000 + list(CASES).index(case))
    xs, grads, masks = [], [], []
    for r in range(world):
        B, S = SHAPES[r]
        x = torch.randn(B, S, D, generator=g)
        if kind == "skewed":
            # Rank 0's tokens all choose the no-op slot (it sends nothing); the others never do.
            x[..., 1:] = x[..., 1:].abs() + 1.0
            x[..., 0] = 4.0 if r == 0 else -4.0
        xs.append(x)
        grads.append(torch.randn(B, S, D, generator=g))
        if use_mask:
            m = torch.ones(B, S, dtype=torch.bool)
            m[-1, -2:] = False  # padding at the end of the last sequence
            masks.append(m)
        else:
            masks.append(None)
    return xs, grads, masks


def _build_full(case: str, kind: str, overrides: dict, world: int) -> torch.nn.Module:
    torch.manual_seed(7 + list(CASES).index(case))
    cfg = _moe_config(overrides)
    if kind == "staged":
        block = TransformerBlock(D, n_heads=2, mlp=MoELayer.from_config(cfg))
        return StagedMoDE(block, MoDRouter(MoDRouterConfig(d_model=D, capacity=0.5)))
    if kind in ("integrated", "skewed"):
        layer = IntegratedMoDE.from_config(cfg)
    else:
        layer = MoELayer.from_config(cfg)
    if kind == "skewed":
        with torch.no_grad():
            w = layer.router.weight  # (E + 1, D)
            w[:, 0] = 0.0
            w[E, :] = 0.0
            w[E, 0] = 10.0  # the no-op logit is 10 * x[0]: +40 on rank 0, -40 elsewhere
            last = E - E // world  # the last rank's experts get very negative logits: never chosen
            w[last:E, 1:] = -3.0
    return layer


def _moe_of(model: torch.nn.Module) -> MoELayer:
    return model.block.mlp if isinstance(model, StagedMoDE) else model


def _ep_model(full: torch.nn.Module, dispatcher) -> torch.nn.Module:
    if isinstance(full, StagedMoDE):
        ep = copy.deepcopy(full)
        ep.block.mlp = shard_layer(full.block.mlp, dispatcher)
        ep.skip_empty = False  # an expert-parallel block must be entered by every rank
        return ep
    return shard_layer(full, dispatcher)


def _run_case(case: str, group, dist) -> dict:
    from mode.dispatch.expert_parallel import ExpertParallelDispatcher

    kind, overrides, use_mask = CASES[case]
    overrides = dict(overrides)
    dedup = overrides.pop("dedup", False)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    out = {"failures": [], "max_err": {}}

    def check(name, actual, expected):
        if actual is None:
            actual = torch.zeros_like(expected)
        if expected is None:
            expected = torch.zeros_like(actual)
        err = (actual - expected).abs().max().item() if actual.numel() else 0.0
        out["max_err"][name] = max(err, out["max_err"].get(name, 0.0))
        try:
            torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL)
        except AssertionError as e:
            out["failures"].append(f"{name}: {e}")

    full = _build_full(case, kind, overrides, world)
    xs, gs, masks = _inputs(case, kind, world, use_mask)
    L = E // world

    # Single-process reference: each rank's tokens separately, gradients accumulated over ranks.
    ref_y, ref_dx, ref_aux, ref_plans = [], [], [], []
    for r in range(world):
        x = xs[r].clone().requires_grad_(True)
        y, aux = full(x, masks[r])
        ((y * gs[r]).sum() + aux.total()).backward()
        ref_y.append(y.detach())
        ref_dx.append(x.grad)
        ref_aux.append(aux)
        with torch.no_grad():  # the plan the MoE router made for rank r (staged: on its routed tokens)
            moe = _moe_of(full)
            moe_in = xs[r] if kind != "staged" else None
            ref_plans.append(None if moe_in is None else moe.router(moe_in, masks[r]).compact())

    dispatcher = ExpertParallelDispatcher(group, E, dedup=dedup)
    ep = _ep_model(full, dispatcher)
    ep.zero_grad(set_to_none=True)
    x = xs[rank].clone().requires_grad_(True)
    y, aux = ep(x, masks[rank])
    ((y * gs[rank]).sum() + aux.total()).backward()

    check("output", y.detach(), ref_y[rank])
    check("input_grad", x.grad, ref_dx[rank])
    if set(aux.losses) != set(ref_aux[rank].losses):
        out["failures"].append(f"aux loss names {sorted(aux.losses)} != {sorted(ref_aux[rank].losses)}")
    for k, v in aux.losses.items():
        check(f"aux.{k}", v.detach(), ref_aux[rank].losses[k].detach())
    for k, s in aux.stats.items():
        rs = ref_aux[rank].stats[k]
        for f in ("kept_E", "requested_X", "dropped", "noop", "compute_T"):
            check(f"stats.{k}.{f}", getattr(s, f), getattr(rs, f))

    # Expert shard gradients vs the matching slice; replicated gradients summed over the group.
    full_params = dict(full.named_parameters())
    for name, p in ep.named_parameters():
        ref_grad = full_params[name].grad
        if ".experts." in name or name.startswith("experts."):
            check(f"grad.{name}", p.grad, ref_grad[rank * L : (rank + 1) * L])
        else:
            g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(g, group=group)  # the training loop's job, not forward's
            check(f"grad.{name}(sum)", g, ref_grad)

    # Bytes: only computed assignments travel, and only those whose expert lives elsewhere.
    st = dispatcher.last_dispatch
    out["bytes"] = {
        "sent": st.sent_bytes,
        "local": st.local_bytes,
        "received": st.received_bytes,
        "combine_sent": dispatcher.last_combine.sent_bytes,
    }
    rstats = aux.stats[[k for k in aux.stats if k.endswith("router") and not k.startswith("mod.")][0]]
    computed = int(rstats.requested_X[:E].sum() - rstats.dropped)  # real choices minus capacity drops
    if dedup and ref_plans[rank] is not None:  # one row per (token, destination rank), fewer than the choices
        plan = ref_plans[rank]
        computed = len(set(zip(plan.token_idx_A.tolist(), (plan.expert_idx_A // L).tolist())))
        remote = len(
            {(t, e // L) for t, e in zip(plan.token_idx_A.tolist(), plan.expert_idx_A.tolist()) if e // L != rank}
        )
        out["rows_saved"] = int(rstats.requested_X[:E].sum() - rstats.dropped) - computed
    if st.sent_rows + st.local_rows != computed and not (dedup and ref_plans[rank] is None):
        out["failures"].append(
            f"rows sent {st.sent_rows} + local {st.local_rows} != computed assignments "
            f"{computed} (no-op {int(rstats.noop)}, dropped {int(rstats.dropped)})"
        )
    if ref_plans[rank] is not None:
        if not dedup:
            remote = int((ref_plans[rank].expert_idx_A // L != rank).sum())
        if st.sent_bytes != remote * D * 4:
            out["failures"].append(f"sent_bytes={st.sent_bytes} != {remote} remote rows * D * 4")
        if dispatcher.last_sent_bytes != st.sent_bytes:
            out["failures"].append("last_sent_bytes disagrees with last_dispatch.sent_bytes")
    if dispatcher.last_combine.sent_bytes != st.received_bytes:
        out["failures"].append("combine must send back exactly the rows dispatch received")
    totals = torch.tensor([st.sent_rows, st.received_rows])
    dist.all_reduce(totals, group=group)
    if totals[0] != totals[1]:
        out["failures"].append(f"rows sent over the group {int(totals[0])} != rows received {int(totals[1])}")
    out["rows"] = {
        "sent": st.sent_rows,
        "local": st.local_rows,
        "received": st.received_rows,
        "noop": int(rstats.noop),
        "dropped": int(rstats.dropped),
    }
    return out


def _errors_case(group, dist) -> dict:
    """User mistakes raise ValueError naming the field, the value and the rule."""
    from mode.dispatch.expert_parallel import ExpertParallelDispatcher

    world = dist.get_world_size(group)
    msgs = {}
    for name, fn in {
        "indivisible": lambda: ExpertParallelDispatcher(group, E + 1),
        "full_bank": lambda: MoELayer(
            MoELayer.from_config(_moe_config({})).router,
            ExpertBank(ExpertConfig(D, H, E)),
            ExpertParallelDispatcher(group, E),
        ),
        "router_size": lambda: MoELayer(
            MoELayer.from_config(_moe_config({"num_experts": 2 * E})).router,
            ExpertBank(ExpertConfig(D, H, E // world)),
            ExpertParallelDispatcher(group, E),
        ),
    }.items():
        try:
            fn()
            msgs[name] = None
        except ValueError as e:
            msgs[name] = str(e)
    return msgs


def _worker(rank: int, world: int, store: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        groups = {f"world{world}": dist.group.WORLD}
        if world == 4:  # every rank creates every group, in the same order
            subgroups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
            groups["sub2"] = subgroups[rank // 2]
        results = {}
        for gname, group in groups.items():
            for case in CASES:
                t0 = time.perf_counter()
                try:
                    res = _run_case(case, group, dist)
                except Exception:  # noqa: BLE001 - reported to the parent, which fails the case
                    res = {"failures": [traceback.format_exc()]}
                res["seconds"] = time.perf_counter() - t0
                results[f"{gname}/{case}"] = res
            results[f"{gname}/errors"] = _errors_case(group, dist)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


# ----------------------------------------------------------------------------------------------------
# parent side


def _launch(world: int, tmp: Path):
    import torch.multiprocessing as mp

    out_dir = tmp / f"world{world}"
    out_dir.mkdir()
    args = (world, str(tmp / f"store{world}"), str(out_dir))
    ctx = mp.start_processes(_worker, args=args, nprocs=world, join=False, start_method=pools.forkserver())
    return ctx, out_dir


@pytest.fixture(scope="module")
def results():
    """Run both world sizes at once (they overlap their start-up) and collect rank -> case -> result."""
    with tempfile.TemporaryDirectory() as tmp:
        runs = {w: _launch(w, Path(tmp)) for w in WORLD_SIZES}
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        pending = dict(runs)
        try:
            while pending:
                for w, (ctx, _) in list(pending.items()):
                    if ctx.join(timeout=0.2):  # raises ProcessRaisedException if a worker failed
                        del pending[w]
                if time.monotonic() > deadline:
                    pytest.fail(
                        f"expert-parallel workers for world sizes {sorted(pending)} did not finish "
                        f"in {JOIN_TIMEOUT_S:.0f} s (hang in a collective?)"
                    )
        finally:
            for ctx, _ in runs.values():
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
        return {
            w: [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(w)] for w, (_, out) in runs.items()
        }


def _groups(world: int) -> list[str]:
    return [f"world{world}"] + (["sub2"] if world == 4 else [])


@GLOO_ONLY
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_expert_parallel_equals_single_process(results, world, case):
    for gname in _groups(world):
        for rank, res in enumerate(results[world]):
            r = res[f"{gname}/{case}"]
            assert not r["failures"], f"{gname} rank {rank}: " + "\n".join(r["failures"])
            assert r["max_err"], "no comparison was made"


@GLOO_ONLY
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_uneven_routing_zero_rows(results, world):
    """Skewed case: rank 0 routes everything to the no-op (sends nothing); the last rank's experts are
    never chosen (it receives nothing). Tokens on a no-op never leave their rank."""
    for gname in _groups(world):
        rows = [res[f"{gname}/integrated_mode_skewed"]["rows"] for res in results[world]]
        size = 2 if gname == "sub2" else world
        for rank, rw in enumerate(rows):
            g_rank = rank % size
            if g_rank == 0:
                assert rw["sent"] == 0 and rw["local"] == 0 and rw["noop"] == SHAPES[0][0] * SHAPES[0][1]
            if g_rank == size - 1:
                assert rw["received"] == 0 and rw["local"] == 0
        assert any(rw["sent"] > 0 for rw in rows)


@GLOO_ONLY
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_byte_count(results, world):
    """Bytes sent = routed rows going to other ranks * D * 4 (checked in the workers), and no-op and
    dropped assignments are really excluded: there are some in the cases below."""
    res0 = results[world][0][f"world{world}/top2_capacity_drop"]
    assert res0["rows"]["dropped"] > 0
    assert res0["bytes"]["sent"] == res0["rows"]["sent"] * D * 4 > 0
    noop_rows = sum(res[f"world{world}/integrated_mode_top2"]["rows"]["noop"] for res in results[world])
    assert noop_rows > 0


@GLOO_ONLY
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_dedup_sends_one_row_per_token_and_rank(results, world):
    """With dedup, a token whose top-k experts share a rank sends its row there once (the workers check the
    rows against the unique (token, rank) pairs of the plan): top-4 over 8 experts saves rows on every rank."""
    for res in results[world]:
        r = res[f"world{world}/dedup_top4_groups"]
        assert r["rows_saved"] > 0, r
        assert r["bytes"]["sent"] == r["rows"]["sent"] * D * 4


@GLOO_ONLY
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_errors(results, world):
    for gname in _groups(world):
        size = 2 if gname == "sub2" else world
        msgs = results[world][0][f"{gname}/errors"]
        assert msgs["indivisible"] and re.search(
            rf"num_experts={E + 1}: must be divisible by the expert-parallel group size {size}", msgs["indivisible"]
        )
        assert msgs["full_bank"] and re.search(
            rf"experts.num_experts={E}: must equal .* router.num_experts={E}, which is {E // size}", msgs["full_bank"]
        )
        assert msgs["router_size"] and "router.num_experts=16" in msgs["router_size"]


def test_shard_experts_rejects_indivisible():
    from mode.parallel.ep_model import shard_experts

    bank = ExpertBank(ExpertConfig(D, H, E))
    with pytest.raises(ValueError, match=r"num_experts=8: must be divisible by the expert-parallel group size 3"):
        shard_experts(bank, 0, 3)
    shard = shard_experts(bank, 1, 4)
    assert shard.num_experts == 2 and torch.equal(shard.w_in_EDF, bank.w_in_EDF[2:4])


def test_model_math_never_imports_torch_distributed():
    """Routers, experts, layers, the model and the local dispatcher never import torch.distributed;
    only the process-group plumbing (expert-parallel dispatch, launch helpers, stats all-reduce) does."""
    root = Path(__file__).resolve().parents[2] / "mode"
    model_math = [
        *(root / d for d in ("routing", "experts", "layers", "model")),
        root / "dispatch" / "local.py",
        root / "measure",
        root / "train" / "data.py",
    ]
    files = [f for m in model_math for f in ([m] if m.suffix == ".py" else m.rglob("*.py"))]
    assert len(files) > 15
    offenders = [
        str(p.relative_to(root))
        for p in files
        if re.search(r"^\s*(import|from)\s+torch\.distributed", p.read_text(), re.M)
    ]
    assert not offenders, f"torch.distributed imported by model math: {offenders}"


def test_only_the_parallel_package_and_the_distributed_helpers_import_torch_distributed():
    root = Path(__file__).resolve().parents[2] / "mode"
    allowed = {"dispatch/expert_parallel.py"}
    offenders = sorted(
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if p.relative_to(root).parts[0] != "parallel"
        and str(p.relative_to(root)) not in allowed
        and re.search(r"^\s*(import|from)\s+torch\.distributed", p.read_text(), re.M)
    )
    assert not offenders, f"torch.distributed imported outside mode.parallel and the helpers: {offenders}"


# ----------------------------------------------------------------------------------------------------
# process-group set-up (mode.parallel.process_group.init_distributed), without starting a group: init_process_group
# and the CUDA queries are replaced, so the NCCL path is checked on a CPU-only machine too.


@pytest.fixture
def environ():
    """os.environ, restored in full afterwards (init_distributed writes RANK, MASTER_PORT, TORCH_NCCL_*)."""
    import os

    saved = dict(os.environ)
    for name in [n for n in os.environ if n.startswith(("TORCH_NCCL_", "TORCH_FR_"))]:
        del os.environ[name]  # start from a user who set none of them
    yield os.environ
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def fake_dist(monkeypatch):
    """Record init_process_group's arguments instead of starting a group; pretend 2 GPUs are present."""
    import os

    import torch.distributed as dist

    calls = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.setdefault("set_device", d))
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: "init" in calls)
    monkeypatch.setattr(
        dist, "init_process_group", lambda *args, **kwargs: calls.setdefault("init", (args, kwargs, dict(os.environ)))
    )
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    return calls


def test_init_distributed_nccl_passes_device_id_and_sets_env_defaults(environ, fake_dist):
    from mode.parallel import process_group as mdist

    environ.update(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    ctx = mdist.init_distributed("nccl", timeout_s=42)
    args, kwargs, env_at_init = fake_dist["init"]
    assert args == ("nccl",)
    assert kwargs == {"timeout": timedelta(seconds=42), "device_id": torch.device("cuda", 1)}
    assert fake_dist["set_device"] == torch.device("cuda", 1)
    assert (ctx.backend, ctx.device, ctx.rank, ctx.world_size, ctx.local_rank) == ("nccl", ctx.device, 1, 2, 1)
    assert ctx.device == torch.device("cuda", 1)
    # the defaults were in the environment when the group was built (ProcessGroupNCCL reads them then)
    for name, value in mdist.NCCL_ENV_DEFAULTS.items():
        assert env_at_init[name] == value, name


def test_nccl_env_defaults_never_override_the_user(environ, fake_dist):
    from mode.parallel import process_group as mdist

    environ.update(
        RANK="0",
        WORLD_SIZE="2",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
        TORCH_NCCL_ASYNC_ERROR_HANDLING="1",  # what torchrun exports when the user set nothing
        TORCH_NCCL_DUMP_ON_TIMEOUT="0",
        TORCH_FR_BUFFER_SIZE="50",
    )  # the newer name of the buffer size
    mdist.init_distributed("nccl", timeout_s=10)
    env = fake_dist["init"][2]
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"
    assert env["TORCH_FR_BUFFER_SIZE"] == "50" and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env


def test_nccl_env_defaults_with_blocking_wait_leave_error_handling_alone():
    from mode.parallel.process_group import NCCL_ENV_DEFAULTS, nccl_env_defaults

    env = {"TORCH_NCCL_BLOCKING_WAIT": "1"}
    applied = nccl_env_defaults(env)
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in env
    assert applied == {k: v for k, v in NCCL_ENV_DEFAULTS.items() if k != "TORCH_NCCL_ASYNC_ERROR_HANDLING"}
    assert nccl_env_defaults(env) == {}  # a second call changes nothing


def test_init_distributed_gloo_has_no_device_id_and_no_nccl_env(environ, fake_dist):
    from mode.parallel import process_group as mdist

    environ.update(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    ctx = mdist.init_distributed("gloo", timeout_s=5)
    args, kwargs, env_at_init = fake_dist["init"]
    assert args == ("gloo",) and kwargs == {"timeout": timedelta(seconds=5)}
    assert ctx.device == torch.device("cpu") and "set_device" not in fake_dist
    assert not [n for n in env_at_init if n.startswith("TORCH_NCCL_")]


def test_init_distributed_nccl_rejects_more_processes_than_gpus(environ, fake_dist):
    from mode.parallel import process_group as mdist

    environ.update(RANK="2", WORLD_SIZE="3", LOCAL_RANK="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    with pytest.raises(
        ValueError,
        match=r"LOCAL_RANK=2: this machine has 2 GPU\(s\); start at most one process "
        r"per GPU",
    ):
        mdist.init_distributed("nccl", timeout_s=5)
    assert "init" not in fake_dist

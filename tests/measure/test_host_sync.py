"""No host synchronisation in a training step of any local layer, nor of the LM (the GPU-readiness budget).

``HostSyncCounter`` counts, on the CPU, the operations that would make the host wait for a GPU: scalar
reads, ``tolist``, data-dependent shapes (``nonzero``, boolean-mask indexing) and tensors built from host
data. Budgets: 0 per training step (forward + backward) for every layer with the default expert backend,
with and without padding and capacity limits; the "reference" backend keeps its documented one.

On a GPU (marked ``gpu``, skipped elsewhere with the reason) ``CudaSyncCounter`` checks the same budgets
against the syncs CUDA itself reports: a bfloat16-autocast training step of every layer and of the LM, and
a static-path decode step, make none; float32 experts make some (torch's grouped-GEMM fallback), which
``HostSyncCounter`` cannot see.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

from mode import MLP, IntegratedMoDE, MoD, MoDRouter, MoDRouterConfig, MoEConfig, MoELayer, StagedMoDE, TransformerBlock
from mode.experts.grouped_mm import SlowPathWarning
from mode.measure.host_sync import CudaSyncCounter, HostSyncCounter
from mode.model import LM, LMConfig
from mode.model.generate import decode_step, prefill

D, H, B, S = 32, 64, 2, 24


def moe(**kw) -> MoELayer:
    return MoELayer.from_config(MoEConfig(d_model=D, d_hidden=H, num_experts=4, **kw))


LAYERS = {
    "mod": lambda: MoD(TransformerBlock(D, 2, MLP(D, H)), MoDRouter(MoDRouterConfig(d_model=D, capacity=0.25))),
    "mod_random": lambda: MoD(
        TransformerBlock(D, 2, MLP(D, H)), MoDRouter(MoDRouterConfig(d_model=D, selection="random"))
    ),
    "mod_aux_bce": lambda: MoD(
        TransformerBlock(D, 2, MLP(D, H)), MoDRouter(MoDRouterConfig(d_model=D, causal="aux_bce"))
    ),
    "moe_tc_dropless": lambda: moe(top_k=2),
    "moe_tc_capacity": lambda: moe(top_k=2, capacity_factor=1.0),
    "moe_tc_sigmoid_renorm": lambda: moe(top_k=2, gate="sigmoid", renormalize=True),
    "moe_ec": lambda: moe(router="expert_choice", capacity_factor=1.5),
    "integrated": lambda: IntegratedMoDE.from_config(MoEConfig(d_model=D, d_hidden=H, num_experts=4, num_noop=4)),
    "integrated_ec": lambda: IntegratedMoDE.from_config(
        MoEConfig(d_model=D, d_hidden=H, num_experts=4, num_noop=2, router="expert_choice")
    ),
    "staged": lambda: StagedMoDE(
        TransformerBlock(D, 2, moe(top_k=2, capacity_factor=1.25)), MoDRouter(MoDRouterConfig(d_model=D, capacity=0.5))
    ),
    # the recipes of DeepSeek-V3 and Qwen-MoE (docs/routing.md)
    "moe_deepseek_v3": lambda: moe(
        top_k=2,
        gate="sigmoid",
        renormalize=True,
        num_shared=2,
        activation="swiglu",
        router_options=dict(n_group=2, topk_group=1, bias_balance=True, scale=2.5, balance_scope="sequence"),
    ),
    "moe_qwen2": lambda: moe(
        top_k=2,
        renormalize=True,
        num_shared=1,
        shared_hidden=48,
        shared_gate=True,
        router_options=dict(balance_scope="global"),
    ),
    "integrated_budget": lambda: IntegratedMoDE.from_config(
        MoEConfig(
            d_model=D,
            d_hidden=H,
            num_experts=4,
            num_noop=4,
            top_k=2,
            router_options=dict(bias_balance=True, noop_target=0.5),
        )
    ),
}


def step_syncs(layer, x, mask=None) -> HostSyncCounter:
    with HostSyncCounter() as syncs:
        y, aux = layer(x) if mask is None else layer(x, mask)
        (y.square().mean() + aux.total()).backward()
    return syncs


@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_training_step_has_no_host_sync(name, padded):
    layer = LAYERS[name]()
    mask = None
    if padded:
        mask = torch.ones(B, S, dtype=torch.bool)
        mask[0, S // 3 :] = False
    syncs = step_syncs(layer, torch.randn(B, S, D, requires_grad=True), mask)
    assert syncs.count == 0, syncs.events


def test_lm_training_step_has_no_host_sync():
    cfg = LMConfig(
        vocab_size=64,
        seq_len=S,
        d_model=D,
        n_heads=2,
        d_hidden=H,
        num_experts=4,
        num_noop=2,
        layers=("dense", "mod", "mod_random", "moe", "staged", "integrated"),
        capacity_factor=1.5,
    )
    lm = LM(cfg)
    idx = torch.randint(0, 64, (B, S))
    with HostSyncCounter() as syncs:
        out = lm(idx, idx)
        (out.loss + out.aux.total()).backward()
    assert syncs.count == 0, syncs.events


def test_lm_training_step_with_the_moe_recipes_and_its_bias_update_have_no_host_sync():
    from mode.routing import update_expert_bias

    cfg = LMConfig(
        vocab_size=64,
        seq_len=S,
        d_model=D,
        n_heads=2,
        d_hidden=H,
        num_experts=4,
        num_noop=2,
        top_k=2,
        layers=("moe", "staged", "integrated"),
        num_shared=1,
        shared_gate=True,
        router_options=dict(gate="sigmoid", n_group=2, topk_group=1, bias_balance=True, scale=2.0),
    )
    lm = LM(cfg)
    idx = torch.randint(0, 64, (B, S))
    with HostSyncCounter() as syncs:
        out = lm(idx, idx)
        (out.loss + out.aux.total()).backward()
        assert update_expert_bias(lm) == 3
    assert syncs.count == 0, syncs.events


def test_reference_backend_keeps_its_one_documented_sync():
    layer = moe(top_k=2, backend="reference")
    syncs = step_syncs(layer, torch.randn(B, S, D, requires_grad=True))
    assert syncs.by_reason == {"list read": 1}, syncs.events  # counts_E.tolist() to split the rows


def test_counter_sees_the_syncs_it_is_meant_to():
    x = torch.randn(8)
    with HostSyncCounter() as syncs:
        float(x.sum())
        x[x > 0]
        (x > 0).nonzero()
        x.tolist()
        torch.tensor([1.0, 2.0])
        torch.full((3,), 2.0)  # a fill: no sync
        x.topk(3)
    assert syncs.by_reason == {
        "scalar read": 1,
        "data-dependent shape (boolean-mask indexing)": 1,
        "data-dependent shape (nonzero)": 1,
        "list read": 1,
        "host data copied to the device": 1,
    }
    assert torch.Tensor.tolist is not None and [1.0] == torch.ones(1).tolist()  # patch removed on exit


# -- CudaSyncCounter: its bookkeeping on any machine, the real syncs on a GPU --------------------------


def test_cuda_sync_counter_keeps_the_sync_reports_and_restores_the_mode(monkeypatch):
    """The bookkeeping, with CUDA's debug mode faked: the sync reports are counted with their place, other
    warnings pass through, the debug mode's own notice is dropped, and the previous mode comes back."""
    modes = [1]  # the mode in force before ("warn", as a user may have set it)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: modes[-1])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    with pytest.warns(UserWarning, match="unrelated") as passed:
        with CudaSyncCounter() as syncs:
            assert modes[-1] == "warn"
            warnings.warn(  # noqa: B028 - the test checks this line warns
                "Synchronization debug mode is a prototype feature and does not yet detect all synchronizing operations"
            )
            for _ in range(2):  # the same line twice: both count
                warnings.warn("called a synchronizing CUDA operation")  # noqa: B028 - the test checks this line warns
            warnings.warn("Synchronizing CUDA operation forced by Tensor.item()")  # noqa: B028 - other torch versions' wording
            warnings.warn("unrelated")  # noqa: B028 - the test checks this line warns
    assert modes[-1] == 1
    assert syncs.count == 3 and all(where.startswith(__file__) for where, _ in syncs.events), syncs.events
    assert [str(w.message) for w in passed] == ["unrelated"]
    with CudaSyncCounter(error=True):
        assert modes[-1] == "error"
    with pytest.raises(TypeError, match="error='yes': must be a bool"):
        CudaSyncCounter(error="yes")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_sync_counter_needs_cuda():
    with pytest.raises(ValueError, match="CudaSyncCounter: torch.cuda.is_available.. is False"):
        with CudaSyncCounter():
            pass


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = "cuda"


def cuda_step_syncs(layer, x, dtype=torch.bfloat16) -> CudaSyncCounter:
    """Real CUDA syncs of one training step (forward under autocast in ``dtype``, or none for float32;
    backward), counted after a warm-up step (lazy initialisation, backend resolution)."""

    def step():
        with contextlib.nullcontext() if dtype == torch.float32 else torch.autocast(CUDA, dtype=dtype):
            y, aux = layer(x)
        (y.float().square().mean() + aux.total()).backward()

    step()
    torch.cuda.synchronize()
    with CudaSyncCounter() as syncs:
        step()
    return syncs


@pytest.mark.gpu
@requires_cuda
def test_cuda_sync_counter_sees_real_syncs_and_only_those():
    x = torch.randn(64, device=CUDA)
    with CudaSyncCounter() as none:
        y = (x * 2).softmax(0)
        torch.ones(3, device=CUDA).add_(1)
    assert none.count == 0, none.events
    for sync in (lambda: float(y.sum()), x.cpu, x.nonzero):  # a scalar read, a blocking copy, a dynamic shape
        with CudaSyncCounter() as syncs:
            sync()
        assert syncs.count >= 1, syncs.events
    with pytest.raises(RuntimeError, match="synchronizing CUDA operation"):
        with CudaSyncCounter(error=True):
            x.sum().item()
    assert torch.cuda.get_sync_debug_mode() == 0  # restored


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("name", list(LAYERS))
def test_bf16_training_step_makes_no_real_cuda_sync(name):
    """The GPU check of test_training_step_has_no_host_sync: bfloat16 autocast, every layer, forward and
    backward, no sync that CUDA reports (the grouped GEMM's fast kernel included)."""
    layer = LAYERS[name]().to(CUDA)
    syncs = cuda_step_syncs(layer, torch.randn(B, S, D, device=CUDA, requires_grad=True))
    assert syncs.count == 0, syncs.events


@pytest.mark.gpu
@requires_cuda
def test_bf16_lm_training_step_makes_no_real_cuda_sync():
    cfg = LMConfig(
        vocab_size=64,
        seq_len=S,
        d_model=D,
        n_heads=2,
        d_hidden=H,
        num_experts=4,
        num_noop=2,
        layers=("dense", "mod", "mod_random", "moe", "staged", "integrated"),
        capacity_factor=1.5,
    )
    lm = LM(cfg).to(CUDA)
    idx = torch.randint(0, 64, (B, S), device=CUDA)

    def step():
        with torch.autocast(CUDA, dtype=torch.bfloat16):
            out = lm(idx, idx)
        (out.loss + out.aux.total()).backward()

    step()
    torch.cuda.synchronize()
    with CudaSyncCounter() as syncs:
        step()
    assert syncs.count == 0, syncs.events


@pytest.mark.gpu
@requires_cuda
def test_float32_experts_sync_on_cuda_where_host_sync_counter_sees_nothing():
    """Why HostSyncCounter's counts are would-be syncs: in float32, torch._grouped_mm on CUDA takes its
    fallback, which copies the offsets to the host inside the op (one sync per GEMM, 6 per MoE training step).
    If this fails, torch's float32 grouped GEMM no longer syncs: update SlowPathWarning and docs/backends.md."""
    layer = moe(top_k=2).to(CUDA)
    x = torch.randn(B, S, D, device=CUDA, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowPathWarning)  # said once per process; expected here
        real = cuda_step_syncs(layer, x, torch.float32)
    with HostSyncCounter() as would_be:
        y, aux = layer(x)
        (y.square().mean() + aux.total()).backward()
    assert would_be.count == 0, would_be.events
    assert real.count >= 2, real.events  # at least the forward's two GEMMs


DECODE_MIXES = [("dense", "dense"), ("dense", "mod", "dense", "mod"), ("moe", "staged"), ("integrated", "mod")]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("layers", DECODE_MIXES, ids=["-".join(m) for m in DECODE_MIXES])
@torch.no_grad()
def test_static_decode_step_makes_no_real_cuda_sync(layers):
    """The static decode path under bfloat16 autocast with bfloat16 caches (generate(bf16=True) on CUDA): no
    sync that CUDA reports in a decode step, MoE, staged and integrated layers included."""
    uses_mod = any(k in ("mod", "staged") for k in layers)
    cfg = LMConfig(
        vocab_size=64,
        seq_len=64,
        d_model=D,
        n_heads=2,
        d_hidden=H,
        num_experts=4,
        layers=layers,
        capacity=0.25,
        causal="predictor" if uses_mod else "none",
        predictor_hidden=16,
        num_noop=1 if "integrated" in layers else 0,
    )
    torch.manual_seed(0)
    model = LM(cfg).to(CUDA).eval()
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11, 12, 13, 14], [3, 1, 4, 1, 5, 9, 2]]
    with torch.autocast(CUDA, dtype=torch.bfloat16):
        logits_BV, caches, pos_B = prefill(model, prompts, capacity=32, static=True, cache_dtype=torch.bfloat16)
        logits_BV = decode_step(model, logits_BV.argmax(-1), pos_B, caches)  # warm-up step
        pos_B = pos_B + 1
        torch.cuda.synchronize()
        for _ in range(6):
            next_B = logits_BV.argmax(-1)
            with CudaSyncCounter() as syncs:
                logits_BV = decode_step(model, next_B, pos_B, caches)
                pos_B = pos_B + 1
            assert syncs.count == 0, syncs.events

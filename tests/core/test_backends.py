"""Expert-bank backend selection, the grouped-mm custom op's checks and autocast rule, and the
MegaBlocks backend's requirements, all checkable on a CPU (the GPU agreement tests are in test_experts.py).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mode.experts import ExpertBank, ExpertConfig, grouped_mm as gmm_mod, megablocks_backend
from mode.experts.bank import resolve_backend
from mode.experts.grouped_mm import grouped_mm

D, H = 16, 24
COUNTS = [3, 0, 5, 1]
N_REAL, N_PAD = sum(COUNTS), 3
SIZES = {"d_model": D, "d_hidden": H}
needs_grouped_mm = pytest.mark.skipif(not gmm_mod.grouped_mm_available(), reason="needs torch._grouped_mm (torch>=2.9)")


def make_bank(backend, activation="swiglu", d_model=D, d_hidden=H):
    torch.manual_seed(0)
    return ExpertBank(
        ExpertConfig(
            d_model=d_model, d_hidden=d_hidden, num_experts=len(COUNTS), activation=activation, backend=backend
        )
    )


class GemmDtypes(TorchDispatchMode):
    """Records the input dtypes of every GEMM that reaches the kernels (below autocast and autograd)."""

    GEMMS = ("mode.grouped_mm", "mode.grouped_mm_t", "aten.mm", "aten.bmm", "aten._grouped_mm")

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, tuple[torch.dtype, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name in self.GEMMS:
            self.calls.append((name, tuple(a.dtype for a in args[:2] if isinstance(a, torch.Tensor))))
        return func(*args, **(kwargs or {}))


# --- what "auto" picks --------------------------------------------------------------------------------


@needs_grouped_mm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_auto_picks_grouped_for_the_dtypes_grouped_mm_takes(dtype):
    assert resolve_backend("auto", "cpu", dtype, SIZES) == "grouped"


def test_auto_picks_reference_for_float64_and_other_devices():
    assert resolve_backend("auto", "cpu", torch.float64, SIZES) == "reference"
    assert resolve_backend("auto", "mps", torch.float32, SIZES) == "reference"


@needs_grouped_mm
def test_auto_picks_reference_when_the_sizes_are_not_16_byte_aligned():
    sizes = {"d_model": 12, "d_hidden": 24}  # 12 floats = 48 bytes (fine), 12 bf16 = 24 bytes (not)
    assert resolve_backend("auto", "cpu", torch.float32, sizes) == "grouped"
    assert resolve_backend("auto", "cpu", torch.bfloat16, sizes) == "reference"


@needs_grouped_mm
def test_auto_bank_with_unaligned_sizes_runs_in_bf16():
    bank = make_bank("auto", d_model=12, d_hidden=20).bfloat16()
    assert bank.backend == "reference"
    y = bank(torch.randn(N_REAL + N_PAD, 12, dtype=torch.bfloat16), torch.tensor(COUNTS))
    assert y.shape == (N_REAL + N_PAD, 12) and torch.equal(y[N_REAL:], torch.zeros_like(y[N_REAL:]))


def test_resolution_is_cached_per_device_and_dtype():
    bank = make_bank("auto")
    x = torch.randn(N_REAL, D)
    bank(x, torch.tensor(COUNTS))
    bank(x.double(), torch.tensor(COUNTS))
    assert bank._resolved == {
        (x.device, torch.float32): resolve_backend("auto", x.device.type, torch.float32, SIZES),
        (x.device, torch.float64): "reference",
    }


# --- explicit backends that cannot run raise, naming the reason ---------------------------------------


@needs_grouped_mm
def test_grouped_rejects_float64_with_a_clear_error():
    bank = make_bank("grouped").double()
    with pytest.raises(
        ValueError,
        match=r"backend='grouped': dtype=torch.float64 is not supported by "
        r"torch._grouped_mm \(float32, bfloat16, float16 .*"
        r"use backend='reference' or 'auto'",
    ):
        bank(torch.randn(N_REAL, D, dtype=torch.float64), torch.tensor(COUNTS))


@needs_grouped_mm
def test_grouped_rejects_unaligned_sizes():
    with pytest.raises(ValueError, match=r"backend='grouped': d_model=6 is not a multiple of 4"):
        make_bank("grouped", d_model=6)  # fails every dtype: refused at construction
    bank = make_bank("grouped", d_model=16, d_hidden=12).bfloat16()  # float32 fine, bfloat16 not
    with pytest.raises(
        ValueError,
        match=r"backend='grouped': d_hidden=12 is not a multiple of 8: "
        r"torch._grouped_mm needs 16-byte aligned rows",
    ):
        bank(torch.randn(N_REAL, D, dtype=torch.bfloat16), torch.tensor(COUNTS))


@needs_grouped_mm
def test_grouped_mm_op_checks_offsets_and_sizes():
    x, w = torch.randn(9, 16), torch.randn(4, 16, 24)
    with pytest.raises(TypeError, match=r"offsets_E.dtype=torch.int64: torch._grouped_mm needs int32 offsets"):
        grouped_mm(x, w, torch.tensor([3, 3, 8, 9]))
    with pytest.raises(ValueError, match=r"offsets_E.shape=\(3,\): must be \(4,\)"):
        grouped_mm(x, w, torch.tensor([3, 8, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"grouped_mm: w_EKN.shape\[2\]=10 is not a multiple of 4"):
        grouped_mm(x, torch.randn(4, 16, 10), torch.tensor([3, 3, 8, 9], dtype=torch.int32))
    with pytest.raises(TypeError, match=r"w_EKN.dtype=torch.bfloat16: must equal x_AK.dtype=torch.float32"):
        grouped_mm(x, w.bfloat16(), torch.tensor([3, 3, 8, 9], dtype=torch.int32))


@needs_grouped_mm
def test_grouped_mm_op_with_zero_rows_and_an_expanded_gradient(device):
    """y.sum() over zero rows hands backward an expanded (stride 0) gradient that .contiguous() keeps."""
    x = torch.randn(0, 16, device=device, requires_grad=True)
    w = torch.randn(4, 16, 24, device=device, requires_grad=True)
    y = grouped_mm(x, w, torch.zeros(4, dtype=torch.int32, device=device))
    assert y.shape == (0, 24)
    y.sum().backward()
    assert x.grad.shape == (0, 16) and torch.equal(w.grad, torch.zeros_like(w))


@needs_grouped_mm
def test_size_rule_matches_what_the_kernel_accepts_on_cpu():
    """The rule in unsupported_reason is the kernel's: every (dtype, row length) it allows runs, the rest fail."""
    offs = torch.tensor([2, 5], dtype=torch.int32)
    for dtype in gmm_mod.SUPPORTED_DTYPES:
        for n in (4, 6, 8, 12, 16):
            x, w = torch.randn(5, 16, dtype=dtype), torch.randn(2, 16, n, dtype=dtype)
            allowed = gmm_mod.unsupported_reason("cpu", dtype, {"n": n}) is None
            try:
                torch._grouped_mm(x, w, offs=offs)
                ran = True
            except RuntimeError:
                ran = False
            assert ran == allowed, (dtype, n)
    with pytest.raises(RuntimeError):  # and float64 is refused by the kernel itself
        torch._grouped_mm(
            torch.randn(5, 16, dtype=torch.float64), torch.randn(2, 16, 8, dtype=torch.float64), offs=offs
        )


def test_more_than_1023_experts_per_process_are_refused_on_cuda_only():
    """torch._grouped_mm on CUDA refuses 1024 or more groups: "grouped" says so; "auto" picks another backend."""
    for dtype in (torch.bfloat16, torch.float32):
        assert gmm_mod.unsupported_reason("cuda", dtype, SIZES, num_experts=gmm_mod.MAX_CUDA_GROUPS) is None
        reason = gmm_mod.unsupported_reason("cuda", dtype, SIZES, num_experts=1024)
        assert reason is not None and "num_experts=1024" in reason and "1023" in reason
        assert gmm_mod.unsupported_reason("cpu", dtype, SIZES, num_experts=4096) is None  # the CPU has no limit
    with pytest.raises(ValueError, match=r"backend='grouped': num_experts=1024 .* at most 1023 groups"):
        resolve_backend("grouped", "cuda", torch.bfloat16, SIZES, num_experts=1024)
    assert resolve_backend("auto", "cuda", torch.bfloat16, SIZES, num_experts=1024) != "grouped"
    bank = ExpertBank(ExpertConfig(d_model=8, d_hidden=8, num_experts=1024))  # resolving needs no GPU
    assert bank.backend_for(torch.device("cpu"), torch.bfloat16) == "grouped"
    assert bank.backend_for(torch.device("cuda"), torch.bfloat16) != "grouped"
    if torch.cuda.is_available():  # the op's own check, before any kernel runs
        with pytest.raises(ValueError, match=r"grouped_mm: num_experts=1024 "):
            grouped_mm(
                torch.randn(4, 8, device="cuda"),
                torch.randn(1024, 8, 8, device="cuda"),
                torch.zeros(1024, dtype=torch.int32, device="cuda"),
            )


@needs_grouped_mm
def test_dw_gemm_gets_a_column_major_activation_whatever_x_is(monkeypatch):
    """The backward's 2-D x 2-D GEMM is handed x_AK.t() column-major even when x_AK is not row-major: the one
    layout the CUDA kernel accepts with empty groups and group sizes that are not multiples of 8."""
    offs = torch.tensor([3, 3, 8, 9], dtype=torch.int32)  # an empty group, sizes 3, 5, 1
    x_KA = torch.randn(D, 9)
    dy_AN = torch.randn(9, H)
    seen = []
    real = torch._grouped_mm

    def spy(a, b, *args, **kwargs):
        seen.append((a.dim(), a.stride(), tuple(a.shape)))
        return real(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", spy)
    dw_EKN = torch.ops.mode.grouped_mm_t(x_KA.t(), dy_AN, offs)  # x_AK column-major (a transposed view)
    assert seen == [(2, (1, D), (D, 9))]  # a = x_AK.t() with x_AK row-major
    starts = [0, 3, 3, 8]
    want = torch.stack([x_KA[:, s:e] @ dy_AN[s:e] for s, e in zip(starts, offs.tolist())])
    torch.testing.assert_close(dw_EKN, want)


def test_slow_cuda_dtypes_warn_once_per_process(monkeypatch):
    """float32 (or float16) grouped GEMMs on CUDA take torch's looped fallback with host syncs: one clear
    warning per process and dtype, naming the way out; bfloat16 and the CPU say nothing."""
    import warnings

    monkeypatch.setattr(gmm_mod, "_warned_slow", set())
    with pytest.warns(gmm_mod.SlowPathWarning, match=r"torch\.float32 on CUDA.*bfloat16 only.*host sync") as record:
        gmm_mod.warn_if_slow("cuda", torch.float32)
    assert "torch.autocast('cuda', dtype=torch.bfloat16)" in str(record[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning below fails the test
        gmm_mod.warn_if_slow("cuda", torch.float32)  # said once
        gmm_mod.warn_if_slow("cuda", torch.bfloat16)
        gmm_mod.warn_if_slow("cpu", torch.float32)
    with pytest.warns(gmm_mod.SlowPathWarning, match=r"torch\.float16 on CUDA"):
        gmm_mod.warn_if_slow("cuda", torch.float16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@needs_grouped_mm
def test_float32_bank_on_cuda_warns_and_bfloat16_autocast_does_not(monkeypatch):
    import warnings

    monkeypatch.setattr(gmm_mod, "_warned_slow", set())
    bank = make_bank("grouped").cuda()
    x = torch.randn(N_REAL, D, device="cuda")
    counts = torch.tensor(COUNTS, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            bank(x, counts)
    with pytest.warns(gmm_mod.SlowPathWarning):
        bank(x, counts)


# --- a torch without torch._grouped_mm (MegaBlocks' torch 2.7.0), with and without MegaBlocks --------


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm at all")
@pytest.mark.parametrize("version,usable", [("2.8.0+cu128", False), ("2.9.0a0+git1234", True), ("2.13.0", True)])
def test_grouped_needs_torch_2_9(monkeypatch, version, usable):
    """torch 2.8 has torch._grouped_mm, but for bfloat16 on sm90 GPUs only: "auto" must not pick it there."""
    monkeypatch.setattr(torch, "__version__", version)
    assert gmm_mod.grouped_mm_available() is usable
    assert (resolve_backend("auto", "cpu", torch.float32, SIZES) == "grouped") is usable


def test_without_grouped_mm_auto_falls_back_to_reference(monkeypatch):
    monkeypatch.setattr(gmm_mod, "grouped_mm_available", lambda: False)
    monkeypatch.setattr(megablocks_backend, "megablocks_available", lambda: False)
    for device_type, dtype in [("cpu", torch.float32), ("cpu", torch.bfloat16), ("cuda", torch.bfloat16)]:
        assert resolve_backend("auto", device_type, dtype, SIZES) == "reference"
    bank = make_bank("auto")
    assert bank.backend == "reference"
    x = torch.randn(N_REAL + N_PAD, D, requires_grad=True)
    bank(x, torch.tensor(COUNTS)).sum().backward()
    assert torch.equal(x.grad[N_REAL:], torch.zeros(N_PAD, D))
    with pytest.raises(
        ValueError,
        match=r"backend='grouped': torch .* has no torch._grouped_mm that runs on CPU "
        r".*\(it needs torch>=2.9\)",
    ):
        make_bank("grouped")


def test_without_grouped_mm_auto_picks_megablocks_on_cuda_bf16_where_it_imports(monkeypatch):
    monkeypatch.setattr(gmm_mod, "grouped_mm_available", lambda: False)
    monkeypatch.setattr(megablocks_backend, "megablocks_available", lambda: True)
    assert resolve_backend("auto", "cuda", torch.bfloat16, SIZES) == "megablocks"
    assert resolve_backend("auto", "cuda", torch.float32, SIZES) == "reference"  # grouped_gemm: bf16 only
    assert resolve_backend("auto", "cpu", torch.bfloat16, SIZES) == "reference"  # grouped_gemm: CUDA only


@needs_grouped_mm
def test_grouped_wins_over_megablocks_where_both_run(monkeypatch):
    monkeypatch.setattr(megablocks_backend, "megablocks_available", lambda: True)
    assert resolve_backend("auto", "cuda", torch.bfloat16, SIZES) == "grouped"


def test_megablocks_explicit_errors(monkeypatch):
    monkeypatch.setattr(megablocks_backend, "megablocks_available", lambda: True)
    with pytest.raises(
        ValueError,
        match=r"backend='megablocks': dtype=torch.float32 is not supported by "
        r"grouped_gemm \(bfloat16 only\)",
    ):
        resolve_backend("megablocks", "cuda", torch.float32, SIZES)
    with pytest.raises(ValueError, match=r"backend='megablocks': device='cpu' is not supported by grouped_gemm"):
        resolve_backend("megablocks", "cpu", torch.bfloat16, SIZES)
    monkeypatch.setattr(megablocks_backend, "megablocks_available", lambda: False)
    with pytest.raises(
        ValueError,
        match=r"backend='megablocks': grouped_gemm is not importable; "
        r"pip install \"mode-torch\[megablocks\]\"",
    ):
        resolve_backend("megablocks", "cuda", torch.bfloat16, SIZES)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error; this machine has CUDA")
def test_megablocks_require_names_cuda_then_the_import(monkeypatch):
    with pytest.raises(ValueError, match=r"backend='megablocks': needs a CUDA GPU"):
        megablocks_backend.require()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # get past the GPU check to the import
    if megablocks_backend.megablocks_available():
        pytest.skip("grouped_gemm imports here")
    with pytest.raises(
        ValueError,
        match=r"backend='megablocks': grouped_gemm \(MegaBlocks' grouped GEMM kernel\) "
        r"is not importable",
    ):
        megablocks_backend.require()


def test_auto_never_picks_megablocks_where_grouped_gemm_does_not_import():
    try:
        import grouped_gemm  # noqa: F401
    except ImportError:
        assert megablocks_backend.megablocks_available() is False
        assert resolve_backend("auto", "cuda", torch.bfloat16, {"d_model": 12, "d_hidden": 12}) == "reference"
    else:
        pytest.skip("grouped_gemm is installed here")


def test_mode_imports_and_trains_on_a_torch_without_grouped_mm():
    """A fresh interpreter whose torch lacks torch._grouped_mm (as torch 2.7.0 does): mode imports, the
    custom op is not registered, "auto" resolves to "reference" and an MoE layer runs forward and backward."""
    code = textwrap.dedent("""
        import torch
        del torch._grouped_mm
        import mode
        from mode import MoEConfig, MoELayer
        assert not hasattr(torch.ops.mode, "grouped_mm")
        layer = MoELayer.from_config(MoEConfig(d_model=16, d_hidden=24, num_experts=4, top_k=2))
        assert layer.experts.backend == "reference", layer.experts.backend
        x = torch.randn(2, 5, 16, requires_grad=True)
        y, aux = layer(x)
        (y.square().sum() + aux.total()).backward()
        assert torch.isfinite(x.grad).all()
        try:
            MoELayer.from_config(MoEConfig(d_model=16, d_hidden=24, num_experts=4, backend="grouped"))
        except ValueError as e:
            assert "has no torch._grouped_mm" in str(e), e
        else:
            raise AssertionError("backend='grouped' built without torch._grouped_mm")
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


# --- autocast -----------------------------------------------------------------------------------------


@needs_grouped_mm
@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
def test_grouped_mm_op_computes_in_the_autocast_dtype(autocast_dtype, device):
    x = torch.randn(9, 16, device=device, requires_grad=True)
    w = torch.randn(4, 16, 24, device=device, requires_grad=True)
    offs = torch.tensor([3, 3, 8, 9], dtype=torch.int32, device=device)
    rec = GemmDtypes()
    with torch.autocast(device.type, dtype=autocast_dtype), rec:
        y = grouped_mm(x, w, offs)
        y.float().sum().backward()  # backward inside autocast: the backward op has the rule too
    assert y.dtype == autocast_dtype
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    assert rec.calls and all(dt == (autocast_dtype, autocast_dtype) for _, dt in rec.calls), rec.calls
    want = torch.cat([x[:3] @ w[0], x[3:8] @ w[2], x[8:] @ w[3]])
    # Rounding x and w to bfloat16 (2^-9 relative each) and y once more bounds the error by 1.5 * 2^-8 * (|x| @ |w|)
    # element-wise, whatever order a kernel sums in (float32 accumulation adds far less): 2^-7 * (|x| @ |w|),
    # the rule for float16 (2^-11) too
    ax, aw = x.detach().abs(), w.detach().abs()
    bound = 2.0**-7 * torch.cat([ax[:3] @ aw[0], ax[3:8] @ aw[2], ax[8:] @ aw[3]])
    err = (y.float() - want.detach()).abs()
    assert (err <= bound).all(), f"max error / bound {(err / bound).max():.3f}"


@needs_grouped_mm
def test_grouped_mm_op_leaves_float64_alone_under_autocast(device):
    x = torch.randn(9, 16, dtype=torch.float64, device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16), pytest.raises(ValueError, match="float64"):
        grouped_mm(
            x,
            torch.randn(4, 16, 24, dtype=torch.float64, device=device),
            torch.tensor([3, 3, 8, 9], dtype=torch.int32, device=device),
        )


@needs_grouped_mm
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_bank_under_autocast_computes_in_bf16_and_agrees_with_reference(activation, device):
    x = torch.randn(N_REAL + N_PAD, D, device=device)
    x[N_REAL:] = float("nan")
    counts = torch.tensor(COUNTS, device=device)
    results = {}
    for backend in ("grouped", "reference"):
        bank = make_bank(backend, activation).to(device)
        xb = x.clone().requires_grad_(True)
        rec = GemmDtypes()
        with torch.autocast(device.type, dtype=torch.bfloat16), rec:
            y = bank(xb, counts)
        y.float().square().sum().backward()
        assert y.dtype == torch.bfloat16, backend
        assert bank.backend_for(x.device, torch.bfloat16) == backend
        assert rec.calls and all(dt == (torch.bfloat16, torch.bfloat16) for _, dt in rec.calls), (backend, rec.calls)
        assert xb.grad.dtype == torch.float32 and bank.w_in_EDF.grad.dtype == torch.float32
        assert torch.equal(y[N_REAL:], torch.zeros_like(y[N_REAL:]))
        assert torch.equal(xb.grad[N_REAL:], torch.zeros_like(xb.grad[N_REAL:]))
        results[backend] = (y, xb.grad, bank.w_in_EDF.grad, bank.w_out_EHD.grad)
    for name, g, w in zip(["y", "x.grad", "w_in.grad", "w_out.grad"], results["grouped"], results["reference"]):
        torch.testing.assert_close(g.float(), w.float(), rtol=5e-2, atol=5e-2, msg=name)


def test_bank_under_autocast_keeps_float64(device):
    bank = make_bank("auto").to(device).double()
    with torch.autocast(device.type, dtype=torch.bfloat16):
        y = bank(torch.randn(N_REAL, D, dtype=torch.float64, device=device), torch.tensor(COUNTS, device=device))
    assert y.dtype == torch.float64 and bank.backend == "reference"


# --- torch.compile --------------------------------------------------------------------------------------


@needs_grouped_mm
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast-bf16"])
def test_compiled_grouped_bank_matches_eager_with_padding(autocast, fresh_dynamo, device):
    """fullgraph: the backend lookup, the padding masks and the autocast rule all trace without a break."""
    bank = make_bank("grouped").to(device)
    x = torch.randn(N_REAL + N_PAD, D, device=device)
    x[N_REAL:] = float("nan")
    counts = torch.tensor(COUNTS, device=device)

    def run(fn):
        bank.zero_grad(set_to_none=True)
        xb = x.clone().requires_grad_(True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            y = fn(xb, counts)
        y.float().square().sum().backward()
        return y.detach(), xb.grad, bank.w_in_EDF.grad.clone(), bank.w_out_EHD.grad.clone()

    got = run(torch.compile(bank, backend="aot_eager", fullgraph=True))  # first call: resolves while tracing
    want = run(bank)
    assert got[0].dtype == (torch.bfloat16 if autocast else torch.float32)
    assert torch.equal(got[0][N_REAL:], torch.zeros_like(got[0][N_REAL:]))
    assert torch.equal(got[1][N_REAL:], torch.zeros_like(got[1][N_REAL:]))
    for name, g, w in zip(["y", "x.grad", "w_in.grad", "w_out.grad"], got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=name)

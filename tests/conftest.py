"""Shared pytest set-up: the device the suite runs on, and the same RNG state before every test.

Device: ``MODE_TEST_DEVICE`` (or ``--device``, which wins): ``cpu`` (the default), ``cuda`` or ``cuda:N``.

    MODE_TEST_DEVICE=cuda python -m pytest -q        # the whole suite on the first GPU

On CUDA the session's default device is set (``torch.set_default_device``), so the tensors and modules a
test creates without naming a device land on the GPU; a test can also take the ``device`` fixture. Any
other value (``meta``, ``mps``, a typo), or ``cuda`` where torch sees no GPU, stops pytest before it collects
anything (exit status 4), so a misconfigured run never passes by running on the CPU.

``MODE_TEST_THREADS=N`` sets torch's intra-op threads (1 by default); ``MODE_TOLERANCE_LOG=FILE`` logs how
near each ``torch.testing.assert_close`` comes to its bound (tests/tolerance_log.py, scripts/tolerance_margins.py).

``MODE_TEST_DETERMINISTIC=1`` turns on ``torch.use_deterministic_algorithms`` for the session (with
``CUBLAS_WORKSPACE_CONFIG=:4096:8`` where unset); see docs/gpu.md for what it costs.

Markers (a reason is the first argument):
    cpu_only   skipped unless the device is the CPU: gloo multi-process runs, the CPU allocator.
    bitwise    asserts bit-for-bit equality that holds on the CPU but not on CUDA, where index_add_ and the
               attention backward add with atomics in no fixed order; runs on CUDA only under
               MODE_TEST_DETERMINISTIC=1.
    device_assert  feeds NaN/inf (or other bad values) to a check that, on CUDA, is a device-side assert
               (``torch._assert_async``: sync-free, so no ValueError is raised where the bad value goes in).
               A device-side assert poisons the CUDA context of the whole process, failing every later test
               in it, so on CUDA these are skipped; tests/test_device_asserts.py runs representative cases in
               fresh subprocesses to prove the checks fire there.
"""

import os
import sys

import pytest
import torch

DEVICE_ENV = "MODE_TEST_DEVICE"
DETERMINISTIC_ENV = "MODE_TEST_DETERMINISTIC"
_DEVICE = pytest.StashKey[torch.device]()
_DETERMINISTIC = pytest.StashKey[bool]()

# Test tensors are tiny: one intra-op thread is faster than two fighting over the cores, and keeps
# timing stable when several pytest or gloo worker processes share the machine.
torch.set_num_threads(int(os.environ.get("MODE_TEST_THREADS", "1")))
# ... and in every process a test starts (a script, mode train, torchrun's ranks), unless the test sets it: two
# OpenMP threads per process beside the other worker's processes spin in their barriers (a rehearsal stage took
# 7x its idle time, issue 70).
os.environ.setdefault("OMP_NUM_THREADS", os.environ.get("MODE_TEST_THREADS", "1"))


def _cache_bytecode() -> None:
    """Keep compiled bytecode for this run and every process it starts under mode's cache folder
    (``PYTHONPYCACHEPREFIX``: nothing is written into the source tree), also where ``PYTHONDONTWRITEBYTECODE``
    is set: the suite starts about 150 interpreters (ranks, rehearsal stages, commands), and each compiled
    mode's sources and rewrote pytest's test files again (about a tenth of their CPU, issue 70). A prefix the
    user set is kept; ``MODE_TEST_PYCACHE=0`` leaves Python's settings as they are."""
    if os.environ.get("MODE_TEST_PYCACHE") == "0" or os.environ.get("PYTHONPYCACHEPREFIX"):
        return
    from mode._cache import cache_root

    prefix = str(cache_root() / "pycache")
    os.environ["PYTHONPYCACHEPREFIX"] = prefix
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.pycache_prefix = prefix
    sys.dont_write_bytecode = False


_cache_bytecode()

if os.environ.get("MODE_TOLERANCE_LOG"):  # measuring how near each comparison comes to its bound: tolerance_log.py
    import tolerance_log

    tolerance_log.install(os.environ["MODE_TOLERANCE_LOG"])

# Without a GPU, tests/kernels runs mode.kernels' Triton kernels in triton's interpreter, which must be chosen
# before triton is first imported (torch._dynamo imports it, and a test module may import torch._dynamo): here,
# before any test module is collected. Where no GPU exists no compiled triton kernel can run, so nothing else changes
# (torch.compile on the CPU generates C++). tests/kernels/conftest.py checks that it took effect.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device", default=None, help=f"cpu (default), cuda or cuda:N; overrides ${DEVICE_ENV}")


def _resolve_device(raw: str, source: str) -> torch.device:
    rule = "must be cpu, cuda or cuda:N"
    try:
        device = torch.device(raw.strip())
    except RuntimeError:
        raise pytest.UsageError(f"{source}={raw!r}: {rule}") from None
    if device.type == "cpu" and device.index in (None, 0):
        return torch.device("cpu")
    if device.type != "cuda":
        raise pytest.UsageError(f"{source}={raw!r}: {rule} (the suite runs on the CPU or on one CUDA GPU)")
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise pytest.UsageError(
            f"{source}={raw!r}: torch.cuda.is_available() is False (torch {torch.__version__}, "
            f"{build}); install a CUDA build of torch on a machine with a GPU, or use "
            f"{DEVICE_ENV}=cpu"
        )
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise pytest.UsageError(f"{source}={raw!r}: this machine has {torch.cuda.device_count()} GPU(s)")
    return torch.device("cuda", index)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cpu_only(reason): skipped unless the test device is the CPU")
    config.addinivalue_line(
        "markers", f"bitwise(reason): bit-for-bit claim; on CUDA runs only with {DETERMINISTIC_ENV}=1"
    )
    config.addinivalue_line(
        "markers",
        "device_assert(reason): trips a device-side assert on CUDA; skipped there "
        "(checked in a subprocess by tests/test_device_asserts.py)",
    )
    raw, source = config.getoption("--device"), "--device"
    if raw is None:
        raw, source = os.environ.get(DEVICE_ENV, "cpu"), DEVICE_ENV
    device = _resolve_device(raw, source)
    flag = os.environ.get(DETERMINISTIC_ENV, "0").strip()
    if flag not in ("0", "1", ""):
        raise pytest.UsageError(f"{DETERMINISTIC_ENV}={flag!r}: must be 0 or 1")
    deterministic = flag == "1"
    config.stash[_DEVICE], config.stash[_DETERMINISTIC] = device, deterministic
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts: before any GPU op
        torch.use_deterministic_algorithms(True)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.set_default_device(device)
        torch.set_float32_matmul_precision("highest")  # no TF32: float32 tolerances assume full precision


def pytest_report_header(config: pytest.Config) -> str:
    device = config.stash[_DEVICE]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    det = "on" if config.stash[_DETERMINISTIC] else "off"
    return f"mode test device: {device} ({name}), torch {torch.__version__}, deterministic algorithms {det}"


def _reason(marker: pytest.Mark) -> str:
    return str(marker.kwargs.get("reason") or (marker.args[0] if marker.args else "no reason given"))


# The README's test command runs the suite on pytest-xdist workers (``-n auto``). On the CPU each module runs whole
# on one worker (``pytest_xdist_make_scheduler`` below: loadscope), so its module-scoped fixtures, a process pool
# or a trained model, are built once; a free worker takes the next module in collection order, so the slowest
# modules go first: started last, one of them would run alone at the end. Seconds per module summed from
# ``python -m pytest -q -n 2 --junitxml=FILE`` (2026-11-29, 2-core AMD EPYC, AVX2); modules not listed keep their
# collection order after these. tests/test_conftest_order.py checks that every entry names a file.
SLOWEST_FIRST = (
    "tests/test_gpu_suite.py",  # 273 s
    "tests/test_benchmarks.py",  # 202
    "tests/parallel/test_faults.py",  # 146
    "tests/test_gpu_suite_isoflop.py",  # 139
    "tests/hf/test_pretrained.py",  # 107
    "tests/parallel/test_machines.py",  # ~110 (2026-12-07: machines as network namespaces, as root)
    "tests/hf/test_transformers_mixin.py",  # 65
    "tests/parallel/test_train_resume_auto.py",  # 62
    "tests/parallel/test_hf_moe_ep.py",  # 62
    "tests/parallel/test_ep_training.py",  # 62
    "tests/experiments/test_compare.py",  # 58
    "tests/hf/test_hf_moe_api.py",  # 51
    "tests/parallel/test_meta_init.py",  # 49
    "tests/experiments/test_isoflop.py",  # 48
)


def _slowest_first(items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: modules stay whole


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker per core this process may use, at most 4 (past that the slowest module, minutes
    alone, bounds the run; and each worker holds torch and transformers in memory)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, 4))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Whole modules per worker, in collection order (``--dist loadscope --no-loadscope-reorder``), where xdist
    would deal out single tests (``--dist load``, its default with ``-n``; any other ``--dist`` is kept). Not on
    CUDA: the GPU stage's workers are replaced after a device-side assert (benchmarks/gpu/pytest_failures.py),
    which suits single tests."""
    if config.getoption("dist") != "load" or config.stash[_DEVICE].type != "cpu":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False
    return LoadScopeScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _slowest_first(items)
    device, deterministic = config.stash[_DEVICE], config.stash[_DETERMINISTIC]
    if device.type == "cpu":
        return
    for item in items:
        for marker in item.iter_markers("cpu_only"):
            item.add_marker(pytest.mark.skip(reason=f"cpu_only on {device}: {_reason(marker)}"))
        if device.type == "cuda":
            for marker in item.iter_markers("device_assert"):
                item.add_marker(
                    pytest.mark.skip(
                        reason=f"device_assert on {device}: {_reason(marker)}; a device-side "
                        "assert would poison this process's CUDA context: checked in "
                        "a subprocess by tests/test_device_asserts.py"
                    )
                )
        if not deterministic:
            for marker in item.iter_markers("bitwise"):
                item.add_marker(
                    pytest.mark.skip(reason=f"bitwise on {device} without {DETERMINISTIC_ENV}=1: {_reason(marker)}")
                )


@pytest.fixture(scope="session")
def device(pytestconfig: pytest.Config) -> torch.device:
    """The device the session runs on (also torch's default device when it is a GPU)."""
    return pytestconfig.stash[_DEVICE]


@pytest.fixture(autouse=True)
def seed() -> int:
    """Seed torch's global RNG before each test (module init and random inputs are then reproducible)."""
    torch.manual_seed(0)
    return 0


def _global_torch_state() -> dict:
    """The process-wide torch settings a test may change and must give back: a test that leaves one changed
    alters every later test on the same xdist worker (a default device left on the function-mode stack made the
    meta-default-device check in tests/test_host_data.py pass vacuously, issue 70)."""
    return {
        "torch function modes on the stack": torch._C._len_torch_function_stack(),
        "torch function enabled": torch._C._is_torch_function_enabled(),
        "default device": str(torch.get_default_device()),
        "default dtype": torch.get_default_dtype(),
        "grad enabled": torch.is_grad_enabled(),
        "inference mode": torch.is_inference_mode_enabled(),
        "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
        "intra-op threads": torch.get_num_threads(),
    }


@pytest.fixture(autouse=True)
def gives_back_global_torch_state():
    """Fails the test that leaves torch's process-wide state changed, naming what it changed."""
    before = _global_torch_state()
    yield
    after = _global_torch_state()
    changed = {key: (before[key], after[key]) for key in before if before[key] != after[key]}
    if changed:
        pytest.fail(f"the test left torch's global state changed (before, after): {changed}", pytrace=False)


@pytest.fixture
def fresh_dynamo():
    """A clean dynamo cache before and after a torch.compile test."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()

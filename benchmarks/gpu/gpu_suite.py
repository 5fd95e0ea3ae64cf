"""The GPU suite: one command that turns a few minutes of GPU time into every GPU number ``mode`` lacks.

    PYTHONPATH=. python benchmarks/gpu/gpu_suite.py --out DIR [--budget-s 480]     # on the GPU (docs/gpu.md)
    PYTHONPATH=. python benchmarks/gpu/gpu_suite.py --smoke --out DIR               # the rehearsal, on a CPU (~2 min)

Stages, in this order, each in its own subprocess with its own time limit, under one overall deadline:

    env      nvidia-smi, versions, and two measured ceilings: a large bf16 matmul (TFLOP/s) and a
             device-to-device copy (GB/s, bytes read + written)
    gtests   the tests of the CUDA-graph work on CUDA (test_graphs, test_gpu_preset, test_generate, test_compile,
             test_train), gpu-marked ones included: capture, replay, equal results, one sync per replayed step
    graphs   the training step replayed from one CUDA graph vs eager (preset base, bf16, in-process): step
             time, speed-up, the losses of the two runs side by side
    gdecode  generate() on the static path, eager vs cuda_graphs=True (MoD and dense, batch 1 and 8): tokens/s
             and whether the tokens are the same
    gpumfu   the "gpu" preset (873M parameters, batch 32 on >= 100 GiB, else 16) with --cuda-graphs and eager:
             MFU against the datasheet peak and against the matmul ceiling measured at start-up
    tests    the test suite on CUDA (MODE_TEST_DEVICE=cuda), the files that exercise the device first, with
             the stage's time limit; what it skipped, by reason
    moe      benchmarks/layers/bench_peers.py in bf16: our MoE layer / the dense SwiGLU MLP of the same active FLOPs
             at 8 and 64 experts, beside transformers' grouped_mm Mixtral/Qwen3 blocks and torchtitan's block
             in the same rounds; achieved TFLOP/s of the layer against the matmul ceiling
    mod      the MoD block (capacity 0.125) and the MoD LM training step / dense, each beside its FLOP ratio
             (bf16 autocast, as ``mode train --bf16``)
    decode   benchmarks/layers/bench_decode.py: MoD / dense decode tokens/s at batch 1 and 8, dynamic and static paths
    train    ``mode train --preset base --bf16`` for a fixed number of steps, eager and ``--compile``:
             steady-state tokens/s and MFU (against the datasheet peak and against the measured ceiling)
    nccl     ``torchrun --nproc-per-node 1 -m mode train`` (NCCL, the mesh path through ``parallelize``,
             MeshRuntime, a sharded checkpoint) and a resume from it
    profile  torch.profiler over the MoE layers, the MoD and dense blocks and a training step of the base
             preset: wall time against the device's busy time, and the kernels that take the most of it

A stage that raises, exits non-zero or runs past its limit is recorded with its error and the last lines of
its output, and the next stage starts. After every stage ``DIR/gpu_suite.json`` is rewritten (atomically)
with the device, the versions and each stage's status, seconds and numbers; ``DIR/gpu_suite.log`` holds
every stage's output. At the end one short table is printed (only the last lines of a GPU run's output come
back) together with the goals (met / missed / not measured).

``--smoke`` runs every stage at its smallest on whatever device there is (the CPU here): it proves that the
command, the JSON and the table work before GPU time is spent on them. Its stage budgets are yardsticks, not
limits: a stage over its budget (a loaded or older CPU) is recorded ``ok`` with a ``slow`` note, and is killed
only past ``SMOKE_HANG_FACTOR`` times it; a rehearsal has no overall deadline unless ``--budget-s`` is given.
``--only``/``--skip`` pick stages
(a second run after a failure reruns only what failed). ``--inject STAGE=raise|hang`` makes a stage fail
on purpose (the isolation test).

Scratch files (training runs, benchmark JSONs) go to ``--work`` (default: a temporary folder), so that DIR
holds only the three files a GPU run can bring back.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere without installing
    sys.path.insert(0, str(ROOT))

RESULT_NAME = "gpu_suite.json"
LOG_NAME = "gpu_suite.log"
TAIL_LINES = 25
MIN_STAGE_S = 10.0  # a stage with less time than this left before the deadline is not started
# --smoke: a stage's rehearsal budget is what it takes on an idle 2-core CPU with room to spare, not a limit. On a
# loaded or older CPU a stage may take several times as long (the nccl stage: 68 s against a 60 s inner limit
# with two other jobs on the cores), and that is reported as slow, not failed. The limit that kills a stage
# is this many times its budget: a guard against a hang only. --stage-budget and --budget-s still apply as given.
SMOKE_HANG_FACTOR = 6.0
GPU_BUDGET_S = 480.0  # the overall deadline of a GPU run (the device's time is short); --smoke has none
KILL_GRACE_S = 5.0


@dataclass(frozen=True)
class Stage:
    name: str
    budget_s: float  # its time limit on the GPU
    smoke_budget_s: float  # and in the rehearsal
    doc: str
    default: bool = True  # run without --only; False: only when --only names it (a stage of its own call)


STAGES = (
    Stage("env", 45, 60, "nvidia-smi, versions, bf16 matmul and copy ceilings"),
    Stage(
        "gtests",
        90,
        120,
        "the fused kernels' tests and the CUDA-graph, generate, compile and preset tests on CUDA (gpu-marked included)",
    ),
    Stage("graphs", 90, 120, "training step: CUDA graph vs eager (preset base, bf16): step time, losses agree"),
    Stage("gdecode", 60, 90, "decode with CUDA graphs vs the eager static path: tokens/s, the same tokens"),
    Stage("gpumfu", 150, 120, "mode train --preset gpu --bf16, eager and --cuda-graphs: MFU vs nominal and measured"),
    Stage("tests", 100, 150, "the test suite on CUDA"),
    Stage("moe", 90, 150, "MoE layer / dense MLP, bf16, beside transformers and torchtitan"),
    Stage("mod", 60, 90, "MoD block and LM step / dense, beside their FLOP ratios"),
    Stage("decode", 75, 120, "MoD / dense decode tokens/s at batch 1 and 8"),
    Stage("train", 150, 300, "mode train --preset base --bf16, eager and compiled: tokens/s and MFU"),
    Stage("nccl", 60, 120, "torchrun, one rank, NCCL: mesh training, sharded checkpoint, resume"),
    Stage("profile", 60, 90, "torch.profiler: wall time vs device busy time and the top kernels of each workload"),
    Stage(
        "isoflop",
        540,
        150,
        "mode isoflop --preset gpu --seeds 2 on the packages corpus: the paper's claims, "
        "isoFLOP-optimal against isoFLOP-optimal, paired over seeds",
        default=False,
    ),
)

STAGE_NAMES = tuple(s.name for s in STAGES)
DEFAULT_STAGES = tuple(s.name for s in STAGES if s.default)

# The goals of the first GPU run (docs/gpu.md): (key in the stage's numbers, rule, threshold, what it says)
GOALS = (
    ("moe", "moe_ratio_E8", "<=", 1.15, "MoE layer (E=8) <= 1.15 x dense MLP of the same active FLOPs, bf16"),
    ("moe", "moe_ratio_E64", "<=", 1.15, "MoE layer (E=64) <= 1.15 x dense MLP of the same active FLOPs, bf16"),
    ("moe", "ahead_of_peers_E8", "==", True, "MoE layer ahead of every transformers/torchtitan block at E=8"),
    ("moe", "ahead_of_peers_E64", "==", True, "MoE layer ahead of every transformers/torchtitan block at E=64"),
    ("mod", "block_gap", "<=", 0.05, "MoD block ratio within +0.05 of its FLOP ratio"),
    ("mod", "lm_gap", "<=", 0.05, "MoD LM step ratio within +0.05 of its FLOP ratio"),
    ("decode", "speedup_b1", ">=", 1.7, "MoD decode >= 1.7 x dense at batch 1 (best path)"),
    ("train", "mfu_eager", ">=", 0.40, "mode train --preset base --bf16 MFU >= 40% (eager)"),
    ("train", "mfu_compile", ">=", 0.40, "mode train --preset base --bf16 MFU >= 40% (--compile)"),
    ("gpumfu", "mfu_graphs", ">=", 0.40, "mode train --preset gpu --bf16 --cuda-graphs MFU >= 40% (datasheet peak)"),
)


# --------------------------------------------------------------------------------------------------------------
# the stages (each runs in its own process: ``gpu_suite.py --run-stage NAME``)
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Ctx:
    smoke: bool
    work: Path  # scratch folder of this stage
    device: object  # torch.device
    limit_s: float  # the stage's time limit (inner timeouts stay under it)
    options: dict = None  # stage options from the command line (the isoflop stage's: out, from, seeds)


def _device(smoke: bool):
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if not smoke:
        raise RuntimeError(
            "no CUDA device is visible (torch.cuda.is_available() is False); on a machine without "
            "a GPU run the rehearsal: --smoke"
        )
    return torch.device("cpu")


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn: Callable[[], None], device, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _versions() -> dict:
    import importlib.metadata
    import platform

    import torch

    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
    }
    try:
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    except Exception as err:  # noqa: BLE001 - a version probe must not end the stage
        out["nccl"] = f"unavailable: {err}"
    for dist in ("triton", "transformers", "torchtitan", "tokenizers", "accelerate", "numpy"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def stage_env(ctx: Ctx) -> dict:
    import torch

    smi = shutil.which("nvidia-smi")
    nvidia_smi = None
    if smi:
        query = "name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,power.limit,pcie.link.gen.max"
        nvidia_smi = subprocess.run(
            [smi, f"--query-gpu={query}", "--format=csv"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
        print(nvidia_smi)
    device = ctx.device
    info = {"device": str(device), "nvidia_smi": nvidia_smi or "nvidia-smi not found", **_versions()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            device_name=props.name,
            capability=f"{props.major}.{props.minor}",
            memory_gib=round(props.total_memory / 2**30, 1),
            sm_count=props.multi_processor_count,
        )
    else:
        import platform

        info.update(device_name=platform.processor() or platform.machine())

    # the matmul ceiling: bf16 (n, n) @ (n, n), 2 n^3 FLOPs
    n = 8192 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    mm_s = _median_time(lambda: torch.mm(a, b), device, warmup=3, repeats=10 if ctx.smoke else 30)
    tflops = 2 * n**3 / mm_s / 1e12
    # the copy ceiling: read + write of a large buffer
    nbytes = (2 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(nbytes // 4, device=device, dtype=torch.float32).normal_()
    dst = torch.empty_like(src)
    copy_s = _median_time(lambda: dst.copy_(src), device, warmup=2, repeats=10 if ctx.smoke else 20)
    gbs = 2 * nbytes / copy_s / 1e9
    print(f"bf16 matmul {n}^3: {tflops:.1f} TFLOP/s; copy {nbytes >> 20} MiB: {gbs:.0f} GB/s (read + write)")
    numbers = {"matmul_bf16_tflops": tflops, "copy_gbs": gbs, "device_name": info["device_name"]}
    return {"numbers": numbers, "details": {**info, "matmul_n": n, "copy_bytes": nbytes}}


# The test files that exercise the device, first; the rest of the suite after them, as time allows.
TEST_ORDER = (
    "tests/test_device_switch.py",
    "tests/test_device_asserts.py",
    "tests/test_host_data.py",
    "tests/core",
    "tests/measure",
    "tests/train",
    "tests/parallel/test_meta_init.py",
    "tests/test_architecture.py",
    "tests/hf",
    "tests/experiments",
    "tests/test_errors.py",
    "tests/test_fuzz.py",
)
SMOKE_TESTS = ("tests/test_device_switch.py", "tests/core/test_registry.py")
_RESULT_RE = re.compile(r"^(\S+::\S+.*?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
_XDIST_RE = re.compile(r"^\[gw\d+\] \[\s*\d+%\] (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+::\S+)")
XDIST_WORKERS = 8  # pytest-xdist processes sharing the one GPU, when the plugin is there
_SKIP_RE = re.compile(r"^SKIPPED \[(\d+)\] ([^:]+(?::\d+)?): (.*)$")


def parse_pytest(text: str) -> dict:
    """Counts, failing tests and skip reasons from ``pytest -v -rfEs`` output (complete or cut off)."""
    counts: dict[str, int] = {}
    failed = []
    for line in text.splitlines():
        m = _RESULT_RE.match(line)
        x = None if m else _XDIST_RE.match(line)
        if m or x:
            nodeid, status = (m.group(1), m.group(2).lower()) if m else (x.group(2), x.group(1).lower())
            counts[status] = counts.get(status, 0) + 1
            if status in ("failed", "error"):
                failed.append(nodeid)
    skips: dict[str, int] = {}
    for line in text.splitlines():
        m = _SKIP_RE.match(line)
        if m:
            reason = m.group(3).strip()
            skips[reason] = skips.get(reason, 0) + int(m.group(1))
    summary = next(
        (
            line.strip("= ")
            for line in reversed(text.splitlines())
            if re.search(r"\d+ (passed|failed|error)", line) and line.startswith("=")
        ),
        None,
    )
    return {"counts": counts, "failed": sorted(set(failed)), "skip_reasons": skips, "summary": summary}


def group_failures(failures: list[dict], top: int = 40) -> list[dict]:
    """Failures with the same exception message and library frame, counted, most frequent first (numbers in
    the message are kept: a shape or a value is usually the clue)."""
    groups: dict[tuple, dict] = {}
    for f in failures:
        key = (f["message"][:200], f.get("library_frame"))
        g = groups.setdefault(
            key,
            {
                "count": 0,
                "message": f["message"],
                "library_frame": f.get("library_frame"),
                "test_frame": f.get("test_frame"),
                "example": f["test"],
                "files": set(),
            },
        )
        g["count"] += 1
        g["files"].add(f["test"].split("::")[0])
    ranked = sorted(groups.values(), key=lambda g: -g["count"])[:top]
    return [{**g, "files": sorted(g["files"])} for g in ranked]


def stage_tests(ctx: Ctx) -> dict:
    return run_tests(ctx, SMOKE_TESTS if ctx.smoke else TEST_ORDER)


# tests/kernels first: the fused Triton kernels against their torch references, compiled on the GPU (on the CPU
# they only ever ran in triton's interpreter)
GRAPH_TESTS = (
    "tests/kernels",
    "tests/train/test_graphs.py",
    "tests/train/test_gpu_preset.py",
    "tests/core/test_generate.py",
    "tests/core/test_compile.py",
    "tests/train/test_train.py",
)
GRAPH_SMOKE_TESTS = ("tests/train/test_graphs.py", "tests/train/test_gpu_preset.py")


def stage_gtests(ctx: Ctx) -> dict:
    """The fused kernels' tests and the tests of the CUDA-graph work, on CUDA: the gpu-marked tests (capture, replay,
    equal results, one
    sync per replayed step) and the CPU tests of the same files under the CUDA default device."""
    return run_tests(ctx, GRAPH_SMOKE_TESTS if ctx.smoke else GRAPH_TESTS)


def run_tests(ctx: Ctx, order: tuple[str, ...]) -> dict:
    targets = [t for t in order if (ROOT / t).exists()]
    env = dict(
        os.environ, MODE_TEST_DEVICE=ctx.device.type if ctx.device.type == "cuda" else "cpu", PYTHONUNBUFFERED="1"
    )
    log = ctx.work / "pytest.log"
    import importlib.util

    xdist = not ctx.smoke and importlib.util.find_spec("xdist") is not None
    failures_path = ctx.work / "failures.jsonl"
    failures_path.unlink(missing_ok=True)
    env["MODE_FAILURES_JSONL"] = str(failures_path)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-v",
        "-rfEs",
        "-p",
        "no:cacheprovider",
        "-p",
        "benchmarks.gpu.pytest_failures",
        "--timeout",
        "90",
        "-o",
        "addopts=",
        *(["-n", str(XDIST_WORKERS)] if xdist else []),
        *targets,
    ]
    print(" ".join(cmd), flush=True)
    inner = max(ctx.limit_s - 15, 5)  # leave time to parse and report what ran before the limit
    cut_off = False
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=inner)
        except subprocess.TimeoutExpired:
            cut_off = True
            _kill_group(proc)
    text = log.read_text(errors="replace")
    print("\n".join(text.splitlines()[-40:]))
    parsed = parse_pytest(text)
    failures = [json.loads(line) for line in failures_path.read_text().splitlines()] if failures_path.exists() else []
    parsed["failure_groups"] = group_failures(failures)
    for g in parsed["failure_groups"]:
        print(
            f"FAILURE GROUP x{g['count']}: {g['message']}\n    at {g['library_frame']} / {g['test_frame']}; "
            f"e.g. {g['example']}"
        )
    c = parsed["counts"]
    numbers = {
        "passed": c.get("passed", 0),
        "failed": c.get("failed", 0) + c.get("error", 0),
        "skipped": c.get("skipped", 0),
        "cut_off": cut_off,
        "returncode": proc.returncode,
    }
    details = {"command": " ".join(cmd), "targets": targets, "time_limit_s": inner, **parsed}
    if cut_off:
        details["note"] = f"pytest ran past {inner:.0f} s and was stopped; the counts are of what ran before"
    return {"numbers": numbers, "details": details}


# bf16 shapes a GPU is not idle on: 16k tokens, d 1024; E=8 of hidden 2048 and E=64 of hidden 512, top-2
MOE_GPU_ARGS = [
    "--tokens",
    "16384",
    "--d-model",
    "1024",
    "--configs",
    "8:2048",
    "64:512",
    "--warmup",
    "3",
    "--repeats",
    "15",
]
PEER_FAMILIES = ("transformers", "torchtitan", "liger")


def _compiling(ctx: Ctx) -> bool:
    """False with --no-compile: the torch.compile rows are left out (recorded as such)."""
    return not (ctx.options or {}).get("no_compile")


def compiled_ratio(candidate, baseline, x, g, device, warmup: int, repeats: int, compile_fn=None) -> dict:
    """``torch.compile``-d candidate / compiled baseline, forward + backward under bf16 autocast, interleaved
    pairs after a warm-up whose first call compiles: what eager's per-op launch cost hides (the host-bound
    share the profile stage shows)."""
    import torch

    from benchmarks.common import time_pair

    torch._dynamo.config.capture_dynamic_output_shape_ops = True
    torch._dynamo.config.capture_scalar_outputs = True
    steps = []
    for module in (candidate, baseline):
        compiled = (compile_fn or torch.compile)(module)
        params = [p for p in module.parameters() if p.requires_grad]

        def step(compiled=compiled, params=params) -> None:
            for p in params:
                p.grad = None
            x.grad = None
            with torch.autocast(device.type, dtype=torch.bfloat16):
                out = compiled(x)
            y, aux = out if isinstance(out, tuple) else (out, None)
            total = None if aux is None else aux.total()
            outs, grads = ([y, total], [g, None]) if total is not None and total.requires_grad else ([y], [g])
            torch.autograd.backward(outs, grads)

        steps.append(step)
    t0 = time.monotonic()
    steps[0]()
    steps[1]()
    _sync(device)
    compile_s = time.monotonic() - t0
    res = time_pair(steps[0], steps[1], warmup=warmup, repeats=repeats, device=device)
    return {
        "ratio": res["ratio_median"],
        "candidate_ms": 1e3 * res["candidate_s_median"],
        "baseline_ms": 1e3 * res["baseline_s_median"],
        "compile_s": compile_s,
    }


def _size_key(num_experts: int, configs) -> str:
    """A configuration's key in the numbers: E8 for the fewest experts, E64 for the other (also in --quick, whose
    configurations have 4 and 16)."""
    return "E8" if num_experts == min(E for E, _ in configs) else "E64"


def stage_moe(ctx: Ctx) -> dict:
    from benchmarks.layers import bench_peers

    out = ctx.work / "peers_bf16.json"
    argv = ["--precision", "bf16", "--device", str(ctx.device), "--out", str(out)]
    argv += ["--quick", "--threads", "2"] if ctx.smoke else MOE_GPU_ARGS
    payload = bench_peers.main(argv)
    numbers: dict = {}
    for E in sorted({r["num_experts"] for r in payload["results"]}):
        rows = [r for r in payload["results"] if r["num_experts"] == E]
        ours = next(r for r in rows if r["implementation"] == "mode, auto")
        dense = next(r for r in rows if r["family"] == "dense" and "bf16" in r["implementation"])
        k, d, h, T = ours["top_k"], ours["d_model"], ours["expert_hidden"], ours["tokens"]
        flops = 3 * (2 * T * k * 3 * d * h)  # fwd + bwd of the active SwiGLU experts (3 matmuls, bwd 2x fwd)
        key = _size_key(E, payload["config"]["configs"])
        numbers[f"moe_ratio_{key}"] = ours["ratio_median"]
        numbers[f"moe_tflops_{key}"] = flops / ours["s_median"] / 1e12
        numbers[f"dense_tflops_{key}"] = flops / dense["s_median"] / 1e12
        numbers[f"moe_us_per_token_{key}"] = 1e6 * ours["s_median"] / T
        peers = {r["implementation"]: r["ratio_median"] for r in rows if r["family"] in PEER_FAMILIES}
        numbers[f"best_peer_ratio_{key}"] = min(peers.values()) if peers else None
        numbers[f"ahead_of_peers_{key}"] = all(ours["ratio_median"] < v for v in peers.values()) if peers else None
        numbers[f"num_experts_{key}"] = E
    # the same layer and dense MLP compiled (first configuration only in the smoke run: CPU compiles are slow)
    import torch

    from mode import MLP

    compiled = {}
    cfg = payload["config"]
    for E, H in (cfg["configs"][:1] if ctx.smoke else cfg["configs"]) if _compiling(ctx) else ():
        key = _size_key(E, cfg["configs"])
        torch.manual_seed(0)
        x = torch.randn(1, cfg["tokens"], cfg["d_model"], device=ctx.device, requires_grad=True)
        g = torch.randn(1, cfg["tokens"], cfg["d_model"], device=ctx.device)
        layer = bench_peers.build_mode(cfg, E, H, "auto", seed=1).to(ctx.device)
        dense = MLP(cfg["d_model"], bench_peers.TOP_K * H, activation="swiglu").to(ctx.device)
        compiled[key] = compiled_ratio(layer, dense, x, g, ctx.device, warmup=2, repeats=5 if ctx.smoke else 15)
        numbers[f"moe_ratio_compiled_{key}"] = compiled[key]["ratio"]
        print(f"compiled E={E}: {compiled[key]}", flush=True)
    return {
        "numbers": numbers,
        "details": {
            "skipped": payload["skipped"],
            "config": payload["config"],
            "compiled": compiled,
            "results": payload["results"],
        },
    }


MOD_GPU_BLOCK = dict(d_model=1024, n_heads=16, mod_batch=8, mod_seq=2048, warmup=3, repeats=15)
MOD_GPU_BLOCK_LARGE = dict(MOD_GPU_BLOCK, mod_batch=32)  # 4x the tokens: does the gap close as work grows?
MOD_GPU_LM = (1024, 16, 1024, 8)  # seq_len, batch, d_model, layers
MOD_SMOKE_BLOCK = dict(d_model=64, n_heads=2, mod_batch=2, mod_seq=128, warmup=1, repeats=3)
MOD_SMOKE_LM = (128, 2, 64, 2)


def stage_mod(ctx: Ctx) -> dict:
    import torch

    from benchmarks.layers.bench_layers import bench_mod
    from benchmarks.layers.bench_performance import bench_lm_step

    device = ctx.device
    block_cfg, lm_shape = (MOD_SMOKE_BLOCK, MOD_SMOKE_LM) if ctx.smoke else (MOD_GPU_BLOCK, MOD_GPU_LM)
    # bf16 autocast for the whole measurement, as mode train --bf16 (weights, optimizer float32)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        block = bench_mod(block_cfg, device, seed=0)
        large = None if ctx.smoke else bench_mod(MOD_GPU_BLOCK_LARGE, device, seed=0)
        lm = bench_lm_step(
            False, device, seed=0, warmup=block_cfg["warmup"], repeats=block_cfg["repeats"], shape=lm_shape
        )
    from mode import MLP, MoD, MoDRouter, MoDRouterConfig, TransformerBlock

    d, heads, B, S = block_cfg["d_model"], block_cfg["n_heads"], block_cfg["mod_batch"], block_cfg["mod_seq"]
    torch.manual_seed(0)
    x = torch.randn(B, S, d, device=device, requires_grad=True)
    g = torch.randn(B, S, d, device=device)
    mod = MoD(
        TransformerBlock(d, heads, MLP(d, 4 * d)),
        MoDRouter(MoDRouterConfig(d_model=d, capacity=0.125, check_finite=False)),
    )
    compiled = None
    if _compiling(ctx):
        compiled = compiled_ratio(
            mod.to(device),
            TransformerBlock(d, heads, MLP(d, 4 * d)).to(device),
            x,
            g,
            device,
            warmup=2,
            repeats=block_cfg["repeats"],
        )
        print(f"compiled MoD block / compiled dense block: {compiled}")
    print(
        f"MoD block {block['ratio_median']:.3f} (FLOP ratio {block['flop_ratio']:.3f}); "
        f"LM step {lm['ratio_median']:.3f} (FLOP ratio {lm['flop_ratio']:.3f})"
    )
    numbers = {
        "block_ratio": block["ratio_median"],
        "block_flop_ratio": block["flop_ratio"],
        "block_gap": block["ratio_median"] - block["flop_ratio"],
        "lm_ratio": lm["ratio_median"],
        "lm_flop_ratio": lm["flop_ratio"],
        "lm_gap": lm["ratio_median"] - lm["flop_ratio"],
        "block_dense_ms": 1e3 * block["baseline_s_median"],
        "lm_dense_ms": 1e3 * lm["baseline_s_median"],
        **(
            {}
            if compiled is None
            else {
                "block_ratio_compiled": compiled["ratio"],
                "block_gap_compiled": compiled["ratio"] - block["flop_ratio"],
            }
        ),
        **(
            {}
            if large is None
            else {
                "block_ratio_batch32": large["ratio_median"],
                "block_gap_batch32": large["ratio_median"] - large["flop_ratio"],
            }
        ),
    }
    return {
        "numbers": numbers,
        "details": {
            "dtype": "bf16 autocast",
            "block": block,
            "lm": lm,
            "block_batch32": large,
            "block_compiled": compiled,
        },
    }


def stage_decode(ctx: Ctx) -> dict:
    from benchmarks.layers import bench_decode

    out = ctx.work / "decode.json"
    argv = ["--device", str(ctx.device), "--out", str(out)]
    argv += ["--quick", "--repeats", "2"] if ctx.smoke else ["--sizes", "base", "--repeats", "5", "--threads", "0"]
    payload = bench_decode.main(argv)
    numbers: dict = {}
    for r in payload["results"]:
        numbers[f"speedup_{r['size']}_b{r['batch']}_{r['path']}"] = r["decode_speedup"]
        numbers[f"flop_bound_{r['size']}_b{r['batch']}"] = r["flop_bound"]
    first = payload["results"][0]["size"]
    for B in sorted({r["batch"] for r in payload["results"]}):
        best = [r["decode_speedup"] for r in payload["results"] if r["batch"] == B and r["size"] == first]
        numbers["speedup_b1" if B == 1 else f"speedup_b{B}"] = max(best)
    return {"numbers": numbers, "details": {"config": payload["config"], "results": payload["results"]}}


def steady_speed(records: list[dict], skip_steps: int) -> dict:
    """tokens/s and FLOP/s between the first logged step past ``skip_steps`` and the last one (the logged
    ``tok_s`` averages from step 1, start-up and compilation included)."""
    rows = [r for r in records if "tok_s" in r and "val_loss" not in r]
    if len(rows) < 2:
        raise RuntimeError(f"need two logged training steps to time the steady state, found {len(rows)}")
    later = [r for r in rows if r["step"] > skip_steps] or rows[-1:]
    a = next((r for r in reversed(rows) if r["step"] <= later[0]["step"] - 1), rows[0])
    b = rows[-1]
    dt = b["wall"] - a["wall"]
    return {
        "from_step": a["step"],
        "to_step": b["step"],
        "tok_s": (b["tokens"] - a["tokens"]) / dt,
        "flop_s": (b["flops"] - a["flops"]) / dt,
        "final_loss": b["loss"],
        "first_loss": rows[0]["loss"],
        "tok_s_logged_cumulative": b["tok_s"],
        "mfu_logged_cumulative": b.get("mfu"),
    }


TRAIN_GPU = dict(preset="base", steps=60, skip=20)
TRAIN_SMOKE = dict(preset="quick", steps=20, skip=10)


def _run_logged(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int, str]:
    print("$ " + " ".join(cmd), flush=True)
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, _ = proc.communicate()
        print(out[-4000:])
        raise RuntimeError(f"{cmd[2:5]} ran past {timeout:.0f} s") from None
    print(out[-4000:])
    return proc.returncode, out


def stage_train(ctx: Ctx) -> dict:
    from mode.train.log_sinks import peak_flops  # the datasheet peak the trainer's MFU uses

    p = TRAIN_SMOKE if ctx.smoke else TRAIN_GPU
    device = "cuda" if ctx.device.type == "cuda" else "cpu"
    numbers: dict = {}
    details: dict = {}
    env_ceiling = _read_stage_numbers(ctx.work.parent, "env").get("matmul_bf16_tflops")
    peak = peak_flops(ctx.device)
    t_start = time.monotonic()
    for variant, extra in (("eager", []), ("compile", ["--compile"])):
        if variant == "compile" and not _compiling(ctx):
            details[variant] = {"error": "not run: --no-compile"}
            continue
        left = ctx.limit_s - (time.monotonic() - t_start) - 5
        if left < 20:
            details[variant] = {"error": f"not run: {left:.0f} s left in the stage"}
            continue
        out = ctx.work / f"train_{variant}"
        shutil.rmtree(out, ignore_errors=True)
        cmd = [
            sys.executable,
            "-m",
            "mode",
            "train",
            "--preset",
            p["preset"],
            "--bf16",
            "--device",
            device,
            "--steps",
            str(p["steps"]),
            "--eval-every",
            str(10 * p["steps"]),
            "--no-progress",
            "--out",
            str(out),
            *extra,
        ]
        try:  # a variant that fails or runs out of time is recorded; the other one's numbers stay
            rc, text = _run_logged(cmd, timeout=left)
            if rc != 0:
                raise RuntimeError(f"mode train ({variant}) exited with {rc}: {_last_error(text)}")
            records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines() if line.strip()]
            speed = steady_speed(records, p["skip"])
        except RuntimeError as err:
            details[variant] = {"command": " ".join(cmd[1:]), "error": str(err)}
            print(f"train ({variant}): {err}", flush=True)
            continue
        numbers[f"tok_s_{variant}"] = speed["tok_s"]
        numbers[f"tflops_{variant}"] = speed["flop_s"] / 1e12
        if peak:
            numbers[f"mfu_{variant}"] = speed["flop_s"] / peak
        if env_ceiling:
            numbers[f"mfu_vs_measured_{variant}"] = speed["flop_s"] / (env_ceiling * 1e12)
        details[variant] = {"command": " ".join(cmd[1:]), **speed}
    if not numbers:
        raise RuntimeError(
            "neither training run gave numbers: "
            + "; ".join(f"{v}: {details[v].get('error')}" for v in ("eager", "compile"))
        )
    if "tok_s_eager" in numbers and "tok_s_compile" in numbers:
        numbers["compile_speedup"] = numbers["tok_s_compile"] / numbers["tok_s_eager"]
    details["peak_flops_datasheet"] = peak
    details["measured_ceiling_tflops"] = env_ceiling
    return {"numbers": numbers, "details": details}


def train_in_process(
    preset: str,
    steps: int,
    skip: int,
    device,
    cuda_graphs: bool,
    work: Path,
    batch_size: int | None = None,
    measured_peak: float | None = None,
) -> dict:
    """``steps`` training steps of a ``mode train`` preset under bf16 autocast, in this process (no evaluation,
    no checkpoint: an 873M-parameter run's would write 10 GB), each timed to its end (a step ends with its one
    host sync); steady state = the median of the steps after ``skip`` (warm-up and capture before)."""
    from dataclasses import replace

    import torch

    from mode.parallel.command import PRESETS
    from mode.train import Trainer
    from mode.train.sources import load_corpus

    p = PRESETS[preset]
    train_cfg = replace(
        p.train,
        steps=steps,
        eval_every=10 * steps,
        log_every=1,
        **({} if batch_size is None else {"batch_size": batch_size}),
    )
    corpus = load_corpus(None, p.model.seq_len, 4_000_000)
    model_cfg = replace(p.model, vocab_size=corpus.vocab_size)
    import gc

    gc.collect()  # a previous run's trainer (a cycle through its graphed step) and its graph's memory pool go first
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.monotonic()
    trainer = Trainer(
        model_cfg, train_cfg, corpus, work, progress=False, device=str(device), bf16=True, cuda_graphs=cuda_graphs
    )
    trainer.measured_peak_flops = measured_peak
    build_s = time.monotonic() - t0
    times, losses, flops = [], [], []
    for _ in range(steps):
        f0, t1 = trainer.flops, time.perf_counter()
        loss, _ = trainer.train_step()
        times.append(time.perf_counter() - t1)
        losses.append(loss)
        flops.append(trainer.flops - f0)
    steady = times[skip:] or times[-1:]
    step_s = statistics.median(steady)
    flop_s = statistics.median(flops[skip:] or flops[-1:]) / step_s
    tokens = train_cfg.batch_size * model_cfg.seq_len
    out = {
        "preset": preset,
        "cuda_graphs": cuda_graphs,
        "batch_size": train_cfg.batch_size,
        "seq_len": model_cfg.seq_len,
        "params": trainer.model.num_params(),
        "steps": steps,
        "skip": skip,
        "build_s": build_s,
        "first_steps_ms": [1e3 * t for t in times[:skip]],
        "step_ms": 1e3 * step_s,
        "tok_s": tokens / step_s,
        "tflops": flop_s / 1e12,
        "losses": losses,
        "mfu": None if trainer.peak_flops is None else flop_s / trainer.peak_flops,
        "mfu_measured": None if not measured_peak else flop_s / measured_peak,
    }
    if device.type == "cuda":
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    if trainer.graphed is not None:
        out["captures"] = trainer.graphed.captures
    del trainer
    return out


def _loss_agreement(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(x), 1e-9) for x, y in zip(a, b))


GRAPHS_GPU = dict(preset="base", steps=30, skip=10)
GRAPHS_SMOKE = dict(preset="quick", steps=8, skip=4)
NO_CUDA = "skipped: no CUDA"


def stage_graphs(ctx: Ctx) -> dict:
    """The training step replayed from one CUDA graph against the eager step, same preset, same batches."""
    p = GRAPHS_SMOKE if ctx.smoke else GRAPHS_GPU
    eager = train_in_process(p["preset"], p["steps"], p["skip"], ctx.device, False, ctx.work / "eager")
    numbers = {"step_ms_eager": eager["step_ms"], "tok_s_eager": eager["tok_s"]}
    details = {"eager": eager}
    if ctx.device.type != "cuda":
        details["graphs"] = NO_CUDA
        numbers["graphs"] = NO_CUDA
    else:
        graphs = train_in_process(p["preset"], p["steps"], p["skip"], ctx.device, True, ctx.work / "graphs")
        details["graphs"] = graphs
        numbers.update(
            step_ms_graphs=graphs["step_ms"],
            tok_s_graphs=graphs["tok_s"],
            graph_speedup=eager["step_ms"] / graphs["step_ms"],
            captures=graphs.get("captures"),
            loss_rel_diff_max=_loss_agreement(eager["losses"], graphs["losses"]),
        )
    print(f"graphs: {numbers}", flush=True)
    return {"numbers": numbers, "details": details}


GDECODE_GPU = dict(size="base", prompt=128, new=192, batches=(1, 8), repeats=3)
GDECODE_SMOKE = dict(size="tiny", prompt=16, new=24, batches=(1, 2), repeats=1)


def stage_gdecode(ctx: Ctx) -> dict:
    """generate() on the static path, eager and with cuda_graphs=True: tokens/s, and the same tokens."""

    from benchmarks.layers import bench_decode
    from mode.model.generate import generate

    p = GDECODE_SMOKE if ctx.smoke else GDECODE_GPU
    size = bench_decode.SIZES[p["size"]]
    cfg = dict(size, seq_len=p["prompt"] + p["new"])
    numbers: dict = {}
    details: dict = {"config": {**p, **cfg}}
    for kind in ("mod", "dense"):
        model = bench_decode.build(cfg, kind == "mod", seed=0, device=ctx.device)
        for B in p["batches"]:
            prompts = bench_decode.text_windows(B, p["prompt"], seed=B).tolist()
            row: dict = {}
            variants = [("eager", False)] + ([("graphs", True)] if ctx.device.type == "cuda" else [])
            outs = {}
            for name, graphs in variants:
                generate(model, prompts, 8, temperature=0, static_cache=True, cuda_graphs=graphs)  # warm-up
                times = []
                for _ in range(p["repeats"]):
                    _sync(ctx.device)
                    t0 = time.perf_counter()
                    outs[name] = generate(
                        model, prompts, p["new"], temperature=0, static_cache=True, cuda_graphs=graphs
                    )
                    _sync(ctx.device)
                    times.append(time.perf_counter() - t0)
                row[f"tok_s_{name}"] = B * p["new"] / statistics.median(times)
            if "graphs" in outs:
                row["same_tokens"] = outs["graphs"] == outs["eager"]
                row["speedup"] = row["tok_s_graphs"] / row["tok_s_eager"]
                numbers[f"speedup_{kind}_b{B}"] = row["speedup"]
                numbers[f"same_tokens_{kind}_b{B}"] = row["same_tokens"]
            else:
                row["graphs"] = NO_CUDA
            numbers[f"tok_s_eager_{kind}_b{B}"] = row["tok_s_eager"]
            details[f"{kind}_b{B}"] = row
            print(f"decode {kind} batch {B}: {row}", flush=True)
        del model
    if ctx.device.type != "cuda":
        numbers["graphs"] = NO_CUDA
    return {"numbers": numbers, "details": details}


GPUMFU_GPU = dict(steps=24, skip=8)


def stage_gpumfu(ctx: Ctx) -> dict:
    """The "gpu" preset (873M parameters) under bf16 autocast, eager and with CUDA graphs: MFU against the
    datasheet peak and against the bf16 matmul ceiling measured at start-up (as ``mode train`` states it).
    Batch 32 where the device has >= 100 GiB (H200), else 16 (H100, 80 GB). The rehearsal builds the preset on
    the meta device (its size) and runs the same code on the quick preset."""
    import torch

    from mode.measure.flops import train_flops_per_token
    from mode.model import LM
    from mode.parallel.command import PRESETS
    from mode.train.log_sinks import measure_matmul_flops

    cfg = PRESETS["gpu"].model
    with torch.device("meta"):
        params = LM(cfg).num_params()
    numbers: dict = {"params": params, "train_gflop_per_token": train_flops_per_token(cfg) / 1e9}
    details: dict = {}
    if ctx.device.type != "cuda":
        details["quick"] = train_in_process("quick", 6, 3, ctx.device, False, ctx.work / "quick")
        numbers["gpu_preset"] = NO_CUDA
        return {"numbers": numbers, "details": details}
    measured = measure_matmul_flops(ctx.device)
    numbers["measured_tflops"] = measured / 1e12
    memory_gib = torch.cuda.get_device_properties(ctx.device).total_memory / 2**30
    batch = 32 if memory_gib >= 100 else 16
    numbers["batch_size"] = batch
    p = GPUMFU_GPU
    t_start = time.monotonic()
    for name, graphs in (("graphs", True), ("eager", False)):  # graphs first: the number the goal is about
        if ctx.limit_s - (time.monotonic() - t_start) < 40:
            details[name] = {"error": "not run: under 40 s left in the stage"}
            continue
        try:
            r = train_in_process(
                "gpu",
                p["steps"],
                p["skip"],
                ctx.device,
                graphs,
                ctx.work / name,
                batch_size=batch,
                measured_peak=measured,
            )
        except torch.cuda.OutOfMemoryError as err:
            details[name] = {"error": f"out of memory at batch {batch}: {str(err)[:300]}"}
            torch.cuda.empty_cache()
            continue
        details[name] = r
        numbers.update(
            {
                f"mfu_{name}": r["mfu"],
                f"mfu_measured_{name}": r["mfu_measured"],
                f"tok_s_{name}": r["tok_s"],
                f"step_ms_{name}": r["step_ms"],
                f"peak_memory_gib_{name}": r.get("peak_memory_gib"),
            }
        )
        print(
            f"gpu preset ({name}): MFU {r['mfu']:.1%} of nominal, {r['mfu_measured']:.1%} of measured "
            f"{measured / 1e12:.0f} TFLOP/s; {r['tok_s']:,.0f} tokens/s; step {r['step_ms']:.1f} ms; peak "
            f"{r.get('peak_memory_gib', 0):.1f} GiB",
            flush=True,
        )
    if "step_ms_graphs" in numbers and "step_ms_eager" in numbers:
        numbers["graph_speedup"] = numbers["step_ms_eager"] / numbers["step_ms_graphs"]
        numbers["loss_rel_diff_max"] = _loss_agreement(details["eager"]["losses"], details["graphs"]["losses"])
    if not any(k.startswith("mfu_") for k in numbers):
        raise RuntimeError(
            "no gpu-preset run gave numbers: " + "; ".join(f"{k}: {v.get('error')}" for k, v in details.items())
        )
    return {"numbers": numbers, "details": details}


def stage_nccl(ctx: Ctx) -> dict:
    import torch

    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    device = "cuda" if ctx.device.type == "cuda" else "cpu"
    out = ctx.work / "nccl_run"
    shutil.rmtree(out, ignore_errors=True)
    common = [
        "-m",
        "mode",
        "train",
        "--preset",
        "quick",
        "--device",
        device,
        "--no-progress",
        "--out",
        str(out),
        "--timeout",
        "60",
    ]
    if device == "cuda":
        common.append("--bf16")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t_start = time.monotonic()
    rc, text = _run_logged(torchrun + common + ["--steps", "20"], timeout=ctx.limit_s / 2, env=env)
    if rc != 0:
        raise RuntimeError(f"torchrun mode train exited with {rc}: {_last_error(text)}")
    first_s = time.monotonic() - t_start
    if not (out / "ckpt").is_dir():
        raise RuntimeError(f"no sharded checkpoint in {out}: {sorted(p.name for p in out.iterdir())}")
    rc, text2 = _run_logged(
        torchrun + common + ["--steps", "30", "--resume"],
        timeout=max(ctx.limit_s - (time.monotonic() - t_start) - 5, 10),
        env=env,
    )
    if rc != 0:
        raise RuntimeError(f"torchrun mode train --resume exited with {rc}: {_last_error(text2)}")
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in records if "loss" in r]
    backend = "nccl" if device == "cuda" else "gloo"
    said = re.findall(r"\b(nccl|gloo)\b", text)
    numbers = {
        "backend": backend,
        "backend_in_output": said[0] if said else None,
        "last_step": max(steps),
        "final_loss": [r["loss"] for r in records if "loss" in r][-1],
        "first_run_s": first_s,
        "nccl_version": ".".join(map(str, torch.cuda.nccl.version())) if device == "cuda" else None,
    }
    if max(steps) != 30:
        raise RuntimeError(f"the resumed run logged steps {steps}, expected to end at 30")
    return {"numbers": numbers, "details": {"log": records[-3:]}}


def profile_step(step: Callable[[], None], device, iters: int, top: int = 8) -> dict:
    """Where one step's time goes: wall time per step against the device's busy time (the sum of its kernels),
    and the kernels (ops on a CPU) that take the most of it, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    for _ in range(3):
        step()
    _sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        _sync(device)
        wall = (time.perf_counter() - t0) / iters

    def own(e) -> float:  # microseconds of the event itself, on the device (CUDA) or the CPU
        if cuda:
            return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
        return e.self_cpu_time_total

    from torch.autograd import DeviceType

    # on CUDA only the kernels (device events) count: an aten op's device time is its kernels' time again
    averages = prof.key_averages()
    events = [e for e in averages if own(e) > 0 and (not cuda or getattr(e, "device_type", None) == DeviceType.CUDA)]
    busy_us = sum(own(e) for e in events) / iters
    ranked = sorted(events, key=own, reverse=True)[:top]
    total_us = sum(own(e) for e in events) or 1.0
    # the host side: CPU time of the ops themselves (dispatch, autograd, Python custom-op wrappers), the
    # launch cost a host-bound step pays; on a CPU this is the same list as "top"
    host = [
        e for e in averages if getattr(e, "device_type", DeviceType.CPU) == DeviceType.CPU and e.self_cpu_time_total > 0
    ]
    host_us = sum(e.self_cpu_time_total for e in host) or 1.0
    host_ranked = sorted(host, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return {
        "wall_ms": 1e3 * wall,
        "device_busy_ms": busy_us / 1e3 if cuda else None,
        "busy_fraction": (busy_us / 1e6) / wall if cuda else None,
        "host_ms": host_us / iters / 1e3,
        "host_ops_per_step": sum(e.count for e in host) / iters,
        "top": [
            {
                "name": e.key[:120],
                "ms_per_step": own(e) / iters / 1e3,
                "share": own(e) / total_us,
                "calls_per_step": e.count / iters,
            }
            for e in ranked
        ],
        "top_host": [
            {
                "name": e.key[:120],
                "ms_per_step": e.self_cpu_time_total / iters / 1e3,
                "share": e.self_cpu_time_total / host_us,
                "calls_per_step": e.count / iters,
            }
            for e in host_ranked
        ],
    }


def stage_profile(ctx: Ctx) -> dict:
    import torch

    from benchmarks.common import fwd_bwd_step
    from mode import MLP, MoD, MoDRouter, MoDRouterConfig, MoEConfig, MoELayer, TransformerBlock
    from mode.model import LM
    from mode.parallel.command import PRESETS

    device = ctx.device
    if ctx.smoke:
        T, d, moe_cfgs, blk, preset, batch, iters = 256, 64, ((4, 64), (16, 16)), MOD_SMOKE_BLOCK, "quick", 4, 2
    else:
        T, d, moe_cfgs, blk, preset, batch, iters = 16384, 1024, ((8, 2048), (64, 512)), MOD_GPU_BLOCK, "base", 64, 5
    workloads: dict[str, Callable[[], None]] = {}
    torch.manual_seed(0)
    x = torch.randn(1, T, d, device=device, requires_grad=True)
    g = torch.randn(1, T, d, device=device)
    for E, H in moe_cfgs:
        moe = MoELayer.from_config(
            MoEConfig(d_model=d, d_hidden=H, num_experts=E, top_k=2, activation="swiglu", capacity_factor=None)
        ).to(device)
        workloads[f"moe E={E} H={H}"] = fwd_bwd_step(moe, x, g)
        workloads[f"dense MLP 2H={2 * H}"] = fwd_bwd_step(MLP(d, 2 * H, activation="swiglu").to(device), x, g)
    dm, heads, B, S = blk["d_model"], blk["n_heads"], blk["mod_batch"], blk["mod_seq"]
    xb = torch.randn(B, S, dm, device=device, requires_grad=True)
    gb = torch.randn(B, S, dm, device=device)
    workloads["MoD block c=0.125"] = fwd_bwd_step(
        MoD(TransformerBlock(dm, heads, MLP(dm, 4 * dm)), MoDRouter(MoDRouterConfig(d_model=dm, capacity=0.125))).to(
            device
        ),
        xb,
        gb,
    )
    workloads["dense block"] = fwd_bwd_step(TransformerBlock(dm, heads, MLP(dm, 4 * dm)).to(device), xb, gb)
    model_cfg = PRESETS[preset].model
    model = LM(model_cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, model_cfg.vocab_size, (batch, model_cfg.seq_len), device=device)

    def train_step() -> None:
        out = model(idx, idx)
        (out.loss + out.aux.total()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    workloads[f"train step, preset {preset}, batch {batch}"] = train_step
    results = {}
    for name, step in workloads.items():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            results[name] = profile_step(step, device, iters)
        r = results[name]
        busy = "" if r["device_busy_ms"] is None else f", device busy {r['device_busy_ms']:.2f} ms"
        print(
            f"{name}: {r['wall_ms']:.2f} ms per step{busy}, host ops {r['host_ms']:.2f} ms "
            f"({r['host_ops_per_step']:.0f} ops)"
        )
        for t in r["top"][:5]:
            print(f"    {t['ms_per_step']:8.3f} ms  {100 * t['share']:5.1f}%  x{t['calls_per_step']:.0f}  {t['name']}")
    numbers = {f"{k}: wall_ms": v["wall_ms"] for k, v in results.items()}
    numbers.update(
        {f"{k}: busy_fraction": v["busy_fraction"] for k, v in results.items() if v["busy_fraction"] is not None}
    )
    return {"numbers": numbers, "details": {"dtype": "bf16 autocast", "iters": iters, "workloads": results}}


# -- isoflop: the paper's questions at the scale one GPU reaches in minutes (docs/isoflop.md) ---------------------

ISOFLOP_DIR = "isoflop"  # OUT/isoflop: the report, the plots and the archive of every finished run
ISOFLOP_ARCHIVE = "isoflop_runs.tar.gz"
ISOFLOP_REPORT_FILES = ("isoflop.json", "isoflop.md", "loss_vs_params.png", "best_loss_vs_budget.png")
ISOFLOP_SEEDS = 2
ISOFLOP_RESERVE_S = 45.0  # of the stage's limit, kept for the report of a sweep that ran out of time
ISOFLOP_PACK_EVERY_S = 20.0  # the archive in OUT is rewritten this often while the sweep runs
CLAIM_KEYS = {
    "MoD - best dense": "mod_minus_dense",
    "learned - random routing": "learned_minus_random",
    "staged - integrated MoDE": "staged_minus_integrated",
    "MoE - best dense": "moe_minus_dense",
}


def isoflop_smoke_preset():
    """The gpu preset at toy sizes for the rehearsal on a CPU: the same variants, seeds, batch layout, corpus
    and code path, with budgets of a few steps."""
    from dataclasses import replace

    from mode.experiments.isoflop_plan import IsoflopPreset, preset

    gpu = preset("gpu")
    base = replace(gpu.base, seq_len=32, d_model=16, n_heads=1, d_hidden=64, num_experts=4)
    train = replace(gpu.train, batch_size=4, warmup_steps=2, log_every=5)
    return IsoflopPreset(
        base,
        train,
        budgets=(3e8,),
        aspect=16,
        n_layers=(2, 3),
        head_dim=16,
        eval_windows=32,
        eval_batch_size=16,
        data=gpu.data,
    )


def run_isoflop_sweep(out: Path, smoke: bool, seeds: int) -> int:
    """The sweep itself (``gpu_suite.py --isoflop-sweep DIR``, a process of its own that the stage can stop):
    ``mode isoflop --preset gpu --data packages --device cuda --bf16``, resuming what ``DIR`` holds."""
    import torch

    from mode.experiments.isoflop import run_isoflop

    device = "cuda" if torch.cuda.is_available() else None  # the rehearsal: the CPU, under bf16 autocast too
    run_isoflop(
        out,
        quick="gpu",
        preset_override=isoflop_smoke_preset() if smoke else None,
        seeds=seeds,
        data="packages",
        device=device,
        bf16=True,
        progress=False,
    )
    return 0


def _finished_files(sweep: Path) -> list[Path]:
    files = [sweep / "isoflop_run.json"] if (sweep / "isoflop_run.json").is_file() else []
    runs = sweep / "runs"
    if runs.is_dir():
        for result in sorted(runs.glob("**/result.json")):
            files.append(result)
            if (result.parent / "log.jsonl").is_file():
                files.append(result.parent / "log.jsonl")
    return files


def pack_isoflop(sweep: Path, archive: Path) -> int:
    """Write (atomically) ``archive``: the sweep's record and every finished run's result and log, paths
    relative to ``sweep``: what a later call needs to resume the sweep (checkpoints of unfinished runs are
    left out: too large to bring back). Returns the number of finished runs in it."""
    import tarfile

    files = _finished_files(sweep)
    archive.parent.mkdir(parents=True, exist_ok=True)
    tmp = archive.with_name(archive.name + ".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for f in files:
            tar.add(f, arcname=f.relative_to(sweep).as_posix())
    os.replace(tmp, archive)
    return sum(1 for f in files if f.name == "result.json")


def unpack_isoflop(source: Path, sweep: Path) -> int:
    """Put an earlier call's finished runs (``source``: its archive, or a folder holding it) into ``sweep``, so
    the sweep reuses them. Only the files ``pack_isoflop`` writes are taken. Returns the runs unpacked."""
    import tarfile

    archive = source / ISOFLOP_ARCHIVE if source.is_dir() else source
    if not archive.is_file():
        raise RuntimeError(f"--isoflop-from {str(source)!r}: no {ISOFLOP_ARCHIVE} there")
    sweep.mkdir(parents=True, exist_ok=True)
    n = 0
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar.getmembers():
            name = member.name
            ok = (
                member.isfile()
                and not name.startswith("/")
                and ".." not in Path(name).parts
                and (
                    name == "isoflop_run.json"
                    or (name.startswith("runs/") and name.endswith(("/result.json", "/log.jsonl")))
                )
            )
            if not ok:
                raise RuntimeError(f"--isoflop-from {str(archive)!r}: unexpected member {name!r}")
            tar.extract(member, sweep, filter="data")
            n += name.endswith("/result.json")
    return n


def complete_seeds(sweep: Path, smoke: bool, seeds: int) -> tuple[int, int, int]:
    """(leading seeds whose every run is finished, finished runs, runs of the whole grid)."""
    from mode.experiments.isoflop_plan import plan, preset

    p = isoflop_smoke_preset() if smoke else preset("gpu")
    specs = plan(p, sweep, list(range(seeds)))
    done = {s.dir for s in specs if (s.dir / "result.json").is_file()}
    full = 0
    while full < seeds and all(s.dir in done for s in specs if s.seed == full):
        full += 1
    return full, len(done), len(specs)


def isoflop_numbers(report: dict) -> dict:
    """The headline of an isoflop report: per budget each claim's mean difference, interval and edge flags."""
    numbers: dict = {
        "seeds": len(report["config"]["seeds"]),
        "budgets": report["config"]["budgets"],
        "run_s": report.get("run_s"),
        "estimated_s": report["estimate"]["estimated_s"],
        "measured_over_estimated": report["estimate"]["measured_over_estimated"],
        "corpus_files": report["data"].get("files"),
        "corpus_list_sha256": report["data"].get("list_sha256"),
        "train_bytes": report["data"]["train_bytes"],
        "epochs_max": max(report["data"]["epochs_per_budget"].values()),
    }
    for i, entry in enumerate(report["budgets"]):
        tag = "" if i == len(report["budgets"]) - 1 else f"_{entry['budget']:.0e}".replace("+", "")
        dense = entry["variants"].get("dense", {}).get("best")
        if dense:
            numbers[f"dense_best{tag}"] = dense["size"] + (" (edge)" if dense["at_edge"] else "")
        for label, c in entry["claims"].items():
            key = CLAIM_KEYS.get(label)
            if key:
                numbers[f"{key}{tag}"] = c["mean"]
                numbers[f"{key}_interval{tag}"] = None if c["low"] is None else [c["low"], c["high"]]
                numbers[f"{key}_significant{tag}"] = c["significant"]
                numbers[f"{key}_at_edge{tag}"] = c["at_edge"]
    return numbers


def stage_isoflop(ctx: Ctx) -> dict:
    opts = ctx.options or {}
    seeds = int(opts.get("isoflop_seeds") or ISOFLOP_SEEDS)
    keep = Path(opts["isoflop_out"]) if opts.get("isoflop_out") else ctx.work / "keep"
    sweep = ctx.work / "sweep"
    details: dict = {"sweep_dir": str(sweep), "kept_in": str(keep)}
    if opts.get("isoflop_from"):
        details["reused_from"] = opts["isoflop_from"]
        details["runs_reused"] = unpack_isoflop(Path(opts["isoflop_from"]), sweep)
        print(f"isoflop: {details['runs_reused']} finished runs from {opts['isoflop_from']}", flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("MODE_CACHE_DIR", str(ctx.work.parent / "cache"))  # the packages corpus, built once per --work
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--isoflop-sweep",
        str(sweep),
        "--isoflop-seeds",
        str(seeds),
    ] + (["--smoke"] if ctx.smoke else [])
    t_start = time.monotonic()
    deadline = t_start + ctx.limit_s - ISOFLOP_RESERVE_S
    print("$ " + " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)  # its output: the stage's log
    packed, timed_out = -1, False
    while True:
        try:
            proc.wait(timeout=max(1.0, min(ISOFLOP_PACK_EVERY_S, deadline - time.monotonic())))
            break
        except subprocess.TimeoutExpired:
            if time.monotonic() >= deadline:
                timed_out = True
                _kill_group(proc)
                break
            n = len(_finished_files(sweep))
            if n != packed:  # what is finished so far reaches OUT even if this call is cut off
                pack_isoflop(sweep, keep / ISOFLOP_ARCHIVE)
                packed = n
    details["sweep_s"] = time.monotonic() - t_start
    runs_packed = pack_isoflop(sweep, keep / ISOFLOP_ARCHIVE)
    full, done, total = complete_seeds(sweep, ctx.smoke, seeds)
    numbers: dict = {
        "complete": done == total and proc.returncode == 0,
        "runs_done": done,
        "runs_total": total,
        "seeds_complete": full,
    }
    details.update(timed_out=timed_out, returncode=proc.returncode, runs_in_archive=runs_packed)
    if not timed_out and proc.returncode != 0:  # an error, not the clock: the log holds its traceback
        raise RuntimeError(
            f"the sweep exited with {proc.returncode} ({done} of {total} runs finished, kept in "
            f"{keep / ISOFLOP_ARCHIVE})"
        )
    if not numbers["complete"]:
        details["next"] = (
            f"{done} of {total} runs finished: rerun the stage with --isoflop-from "
            f"{keep / ISOFLOP_ARCHIVE} (brought back and carried) to train the rest"
        )
        print(f"isoflop: {details['next']}", flush=True)
        if full == 0:  # cut off by the clock before a seed was whole: the archive is what there is
            return {"numbers": numbers, "details": details}
        # the report of the complete seeds: every run of them is finished, so this trains nothing
        rc = subprocess.run(
            cmd[:4] + ["--isoflop-seeds", str(full)] + (["--smoke"] if ctx.smoke else []),
            cwd=ROOT,
            env=env,
            timeout=max(10.0, ctx.limit_s - (time.monotonic() - t_start) - 5),
        ).returncode
        if rc != 0:
            raise RuntimeError(f"the report of the {full} complete seed(s) failed (exit {rc})")
    for name in ISOFLOP_REPORT_FILES:
        shutil.copy2(sweep / name, keep / name)
    report = json.loads((sweep / "isoflop.json").read_text())
    numbers.update(isoflop_numbers(report))
    details["claims"] = {f"{e['budget']:.3g}": e["claims"] for e in report["budgets"]}
    details["best"] = {
        f"{e['budget']:.3g}": {n: v["best"] for n, v in e["variants"].items()} for e in report["budgets"]
    }
    details["data"] = report["data"]
    details["estimate"] = {k: v for k, v in report["estimate"].items() if k != "runs"}
    details["machine"] = report["machine"]
    details["device_name"] = report["machine"].get("device_name")
    return {"numbers": numbers, "details": details}


STAGE_FNS: dict[str, Callable[[Ctx], dict]] = {
    "env": stage_env,
    "gtests": stage_gtests,
    "graphs": stage_graphs,
    "gdecode": stage_gdecode,
    "gpumfu": stage_gpumfu,
    "tests": stage_tests,
    "moe": stage_moe,
    "mod": stage_mod,
    "decode": stage_decode,
    "train": stage_train,
    "nccl": stage_nccl,
    "profile": stage_profile,
    "isoflop": stage_isoflop,
}


def _last_error(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    errs = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b", line.strip())]
    return (errs or lines or ["(no output)"])[-1].strip()[:500]


def _read_stage_numbers(work: Path, name: str) -> dict:
    path = work / name / "result.json"
    try:
        return json.loads(path.read_text()).get("numbers", {})
    except (OSError, ValueError):
        return {}


def run_stage_child(
    name: str, work: Path, smoke: bool, limit_s: float, inject: str | None, options: dict | None = None
) -> int:
    """The child process: run one stage, write ``work/NAME/result.json``; exit 0 on success."""
    stage_work = work / name
    stage_work.mkdir(parents=True, exist_ok=True)
    if inject == "raise":
        raise RuntimeError(f"injected failure in stage {name!r}")
    if inject == "hang":
        print(f"stage {name!r}: hanging on purpose", flush=True)
        while True:
            time.sleep(1)
    ctx = Ctx(smoke=smoke, work=stage_work, device=_device(smoke), limit_s=limit_s, options=options or {})
    result = STAGE_FNS[name](ctx)
    _write_json_atomic(stage_work / "result.json", result)
    return 0


# --------------------------------------------------------------------------------------------------------------
# the orchestrator
# --------------------------------------------------------------------------------------------------------------


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the child's whole process group, then SIGKILL after a grace period."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _write_json_atomic(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def _parse_inject(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        name, _, how = item.partition("=")
        if name not in STAGE_NAMES or how not in ("raise", "hang"):
            raise SystemExit(
                f"--inject {item!r}: must be STAGE=raise or STAGE=hang with STAGE one of {', '.join(STAGE_NAMES)}"
            )
        out[name] = how
    return out


def _pick(names: list[str] | None, flag: str) -> list[str]:
    for n in names or []:
        if n not in STAGE_NAMES:
            raise SystemExit(f"{flag} {n!r}: must be one of {', '.join(STAGE_NAMES)}")
    return list(names or [])


def run_suite(
    out: Path,
    work: Path,
    budget_s: float | None,
    smoke: bool,
    only: list[str],
    skip: list[str],
    inject: dict[str, str],
    stage_budget: dict[str, float],
    isoflop_from: str | None = None,
    isoflop_seeds: int = ISOFLOP_SEEDS,
    no_compile: bool = False,
) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + (budget_s if budget_s is not None else float("inf"))
    started = time.time()
    payload = {
        "suite": "gpu_suite",
        "command": " ".join(["gpu_suite.py", *sys.argv[1:]]),
        "smoke": smoke,
        "budget_s": budget_s,
        "started_unix": started,
        "stages": {},
    }
    log_path = out / LOG_NAME
    log_path.write_text("")
    for stage in STAGES:
        if (only and stage.name not in only) or stage.name in skip or (not only and not stage.default):
            continue
        record: dict = {"doc": stage.doc}
        left = deadline - time.monotonic()
        budget = stage_budget.get(stage.name, stage.smoke_budget_s if smoke else stage.budget_s)
        hang_guard = smoke and stage.name not in stage_budget  # a rehearsal's budget is a yardstick, not a limit
        limit = min(budget * SMOKE_HANG_FACTOR if hang_guard else budget, left)
        if left < MIN_STAGE_S:
            record.update(status="not run", reason=f"the overall deadline ({budget_s:.0f} s): {left:.0f} s left")
            payload["stages"][stage.name] = record
            _write_json_atomic(out / RESULT_NAME, payload)
            continue
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--run-stage",
            stage.name,
            "--work",
            str(work),
            "--stage-limit-s",
            f"{limit:.1f}",
        ] + (["--smoke"] if smoke else [])
        if stage.name in inject:
            cmd += ["--inject", f"{stage.name}={inject[stage.name]}"]
        if no_compile:
            cmd.append("--no-compile")
        if stage.name == "isoflop":
            cmd += ["--isoflop-out", str((out / ISOFLOP_DIR).resolve()), "--isoflop-seeds", str(isoflop_seeds)]
            if isoflop_from:
                cmd += ["--isoflop-from", str(Path(isoflop_from).resolve())]
        print(f"[gpu_suite] stage {stage.name}: limit {limit:.0f} s", file=sys.stderr, flush=True)
        stage_log = work / f"{stage.name}.log"
        t0 = time.monotonic()
        with open(stage_log, "w") as fh:
            proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                stdout=fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=dict(
                    os.environ,
                    PYTHONUNBUFFERED="1",
                    PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                    # a cache of this run's own: a shared one left truncated by a killed
                    # compile ("file too short") failed a rehearsal's compiled run
                    TORCHINDUCTOR_CACHE_DIR=str(work / "inductor_cache"),
                ),
            )
            try:
                proc.wait(timeout=limit)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc)
        seconds = time.monotonic() - t0
        text = stage_log.read_text(errors="replace")
        with open(log_path, "a") as fh:
            fh.write(f"\n===== stage {stage.name} ({seconds:.1f} s, rc {proc.returncode}) =====\n{text}")
        tail = text.strip().splitlines()[-TAIL_LINES:]
        result_path = work / stage.name / "result.json"
        record["seconds"] = round(seconds, 1)
        record["limit_s"] = round(limit, 1)
        record["budget_s"] = round(budget, 1)
        if hang_guard and seconds > budget and not timed_out:
            record["slow"] = (
                f"took {seconds:.0f} s, over its rehearsal budget of {budget:.0f} s (a loaded or slower "
                f"CPU; killed only past {limit:.0f} s)"
            )
        if timed_out:
            record.update(status="timeout", error=f"ran past its limit of {limit:.0f} s and was killed", tail=tail)
        elif proc.returncode != 0 or not result_path.exists():
            record.update(status="failed", error=_last_error(text), returncode=proc.returncode, tail=tail)
        else:
            result = json.loads(result_path.read_text())
            record.update(status="ok", numbers=result["numbers"], details=result["details"])
        if record["status"] != "ok" and result_path.exists():
            result_path.unlink()  # a failed rerun must not leave an earlier run's numbers for later stages
        if stage.name == "isoflop" and record["status"] == "ok" and not payload.get("device"):
            payload["device"] = record["details"].get("device_name")  # an isoflop-only call runs no env stage
            payload.setdefault("versions", {"torch": record["details"].get("machine", {}).get("torch")})
        if stage.name == "env" and record["status"] == "ok":
            payload["device"] = record["details"].get("device_name")
            payload["versions"] = {
                k: record["details"].get(k)
                for k in (
                    "python",
                    "torch",
                    "torch_cuda",
                    "cudnn",
                    "nccl",
                    "triton",
                    "transformers",
                    "torchtitan",
                    "nvidia_smi",
                )
            }
        payload["stages"][stage.name] = record
        payload["goals"] = evaluate_goals(payload["stages"], smoke)
        _write_json_atomic(out / RESULT_NAME, payload)
        print(f"[gpu_suite] stage {stage.name}: {record['status']} in {seconds:.1f} s", file=sys.stderr, flush=True)
    payload["seconds"] = round(time.time() - started, 1)
    payload["goals"] = evaluate_goals(payload["stages"], smoke)
    _write_json_atomic(out / RESULT_NAME, payload)
    return payload


def evaluate_goals(stages: dict, smoke: bool = False) -> list[dict]:
    """Each goal against its stage's number: met, missed, not measured, or (a smoke run's toy shapes on the
    CPU) not judged."""
    out = []
    for stage, key, rule, threshold, text in GOALS:
        numbers = stages.get(stage, {}).get("numbers", {})
        value = numbers.get(key)
        if value is None:
            verdict = "not measured"
        elif smoke:
            verdict = "not judged"
        elif rule == "<=":
            verdict = "met" if value <= threshold else "missed"
        elif rule == ">=":
            verdict = "met" if value >= threshold else "missed"
        else:
            verdict = "met" if value == threshold else "missed"
        out.append(
            {
                "goal": text,
                "stage": stage,
                "key": key,
                "value": value,
                "rule": f"{rule} {threshold}",
                "verdict": verdict,
            }
        )
    return out


def _fmt(value) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


HEADLINE = {
    "env": ("device_name", "matmul_bf16_tflops", "copy_gbs"),
    "tests": ("passed", "failed", "skipped", "cut_off"),
    "gtests": ("passed", "failed", "skipped", "cut_off"),
    "graphs": ("step_ms_eager", "step_ms_graphs", "graph_speedup", "loss_rel_diff_max", "graphs"),
    "gdecode": ("speedup_mod_b1", "speedup_mod_b8", "speedup_dense_b1", "same_tokens_mod_b1", "graphs"),
    "gpumfu": ("params", "batch_size", "mfu_graphs", "mfu_measured_graphs", "mfu_eager", "graph_speedup", "gpu_preset"),
    "moe": (
        "moe_ratio_E8",
        "best_peer_ratio_E8",
        "moe_ratio_E64",
        "best_peer_ratio_E64",
        "moe_ratio_compiled_E8",
        "moe_ratio_compiled_E64",
    ),
    "mod": ("block_ratio", "block_ratio_compiled", "block_flop_ratio", "lm_ratio", "lm_flop_ratio"),
    "decode": ("speedup_b1", "speedup_b8"),
    "train": ("tok_s_eager", "mfu_eager", "tok_s_compile", "mfu_compile", "mfu_vs_measured_eager"),
    "nccl": ("backend", "last_step", "final_loss"),
    "profile": (),
    "isoflop": (
        "complete",
        "runs_done",
        "runs_total",
        "measured_over_estimated",
        "dense_best",
        "mod_minus_dense",
        "mod_minus_dense_significant",
        "learned_minus_random",
        "staged_minus_integrated",
        "moe_minus_dense",
    ),
}


def print_summary(payload: dict) -> None:
    print(
        f"\ngpu_suite: {payload.get('device', '?')}, torch {payload.get('versions', {}).get('torch', '?')}, "
        f"{payload.get('seconds', '?')} s"
        + ("" if payload["budget_s"] is None else f" of {payload['budget_s']:.0f}")
        + (" (smoke)" if payload["smoke"] else "")
    )
    for name, rec in payload["stages"].items():
        if rec["status"] == "ok":
            nums = rec["numbers"]
            what = ", ".join(f"{k}={_fmt(nums[k])}" for k in HEADLINE.get(name, ()) if k in nums)
            if name == "profile":
                busy = [f"{k.split(':')[0]} {v:.0%}" for k, v in nums.items() if k.endswith("busy_fraction")]
                what = (
                    ("device busy: " + ", ".join(busy))
                    if busy
                    else "wall ms per step: " + ", ".join(f"{k.split(':')[0]} {v:.1f}" for k, v in nums.items())
                )
        else:
            what = rec.get("error") or rec.get("reason", "")
        if rec.get("slow"):
            what = f"slow: {rec['slow']}; {what}"
        print(f"  {name:<8}{rec['status']:<8}{rec.get('seconds', 0):>6.1f}s  {what}"[:300])
    for g in payload.get("goals", []):
        print(f"  goal {g['verdict']:<12} {g['goal']}: {_fmt(g['value'])}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="folder for gpu_suite.json and gpu_suite.log (on the GPU machine: $OUT)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help=f"overall deadline in seconds (default {GPU_BUDGET_S:.0f}; with --smoke none: a rehearsal's "
        f"stages are killed only past {SMOKE_HANG_FACTOR:g} x their budget, and a slow one is "
        "reported as slow)",
    )
    p.add_argument("--smoke", action="store_true", help="every stage at its smallest, on any device (rehearsal)")
    p.add_argument("--only", nargs="+", help=f"run only these stages ({', '.join(STAGE_NAMES)})")
    p.add_argument("--skip", nargs="+", help="leave these stages out")
    p.add_argument(
        "--stage-budget",
        nargs="+",
        default=[],
        metavar="STAGE=S",
        help="override a stage's time limit in seconds, e.g. tests=60",
    )
    p.add_argument(
        "--inject",
        nargs="+",
        default=[],
        metavar="STAGE=raise|hang",
        help="make a stage fail on purpose (to test that stages are isolated)",
    )
    p.add_argument("--work", help="scratch folder (default: a new temporary folder)")
    p.add_argument(
        "--no-compile",
        action="store_true",
        help="leave out the torch.compile rows of the moe, mod and train stages (recorded as not run); "
        "on a CPU they take most of a smoke run's time",
    )
    p.add_argument(
        "--isoflop-from",
        metavar="PATH",
        help=f"isoflop stage: the {ISOFLOP_ARCHIVE} an earlier call left in OUT/{ISOFLOP_DIR} (or its "
        "folder): its finished runs are reused and the sweep goes on from there",
    )
    p.add_argument(
        "--isoflop-seeds", type=int, default=ISOFLOP_SEEDS, help=f"isoflop stage: seeds (default {ISOFLOP_SEEDS})"
    )
    p.add_argument("--run-stage", choices=STAGE_NAMES, help=argparse.SUPPRESS)
    p.add_argument("--isoflop-out", help=argparse.SUPPRESS)
    p.add_argument("--isoflop-sweep", help=argparse.SUPPRESS)
    p.add_argument("--stage-limit-s", type=float, default=60.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.isoflop_sweep:
        return run_isoflop_sweep(Path(args.isoflop_sweep), args.smoke, args.isoflop_seeds)
    if args.run_stage:
        inject = _parse_inject(args.inject).get(args.run_stage)
        options = {
            "isoflop_out": args.isoflop_out,
            "isoflop_from": args.isoflop_from,
            "isoflop_seeds": args.isoflop_seeds,
            "no_compile": args.no_compile,
        }
        try:
            return run_stage_child(args.run_stage, Path(args.work), args.smoke, args.stage_limit_s, inject, options)
        except Exception:  # noqa: BLE001 - the parent records the error from this output
            traceback.print_exc()
            return 1

    if not args.out:
        raise SystemExit("--out DIR: required (the folder for gpu_suite.json and gpu_suite.log)")
    if args.budget_s is None and not args.smoke:
        args.budget_s = GPU_BUDGET_S
    if args.budget_s is not None and args.budget_s <= 0:
        raise SystemExit(f"--budget-s={args.budget_s}: must be > 0")
    stage_budget = {}
    for item in args.stage_budget:
        name, _, secs = item.partition("=")
        try:
            value = float(secs)
        except ValueError:
            value = -1.0
        if name not in STAGE_NAMES or value <= 0:
            raise SystemExit(
                f"--stage-budget {item!r}: must be STAGE=SECONDS with STAGE one of "
                f"{', '.join(STAGE_NAMES)} and SECONDS > 0"
            )
        stage_budget[name] = value
    only, skip = _pick(args.only, "--only"), _pick(args.skip, "--skip")
    inject = _parse_inject(args.inject)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gpu_suite_"))
    if args.isoflop_seeds < 1:
        raise SystemExit(f"--isoflop-seeds={args.isoflop_seeds}: must be >= 1")
    if args.isoflop_from and not Path(args.isoflop_from).exists():
        raise SystemExit(f"--isoflop-from {args.isoflop_from!r}: no such file or folder")
    payload = run_suite(
        Path(args.out),
        work,
        args.budget_s,
        args.smoke,
        only,
        skip,
        inject,
        stage_budget,
        args.isoflop_from,
        args.isoflop_seeds,
        args.no_compile,
    )
    print_summary(payload)
    print(f"\nwrote {Path(args.out) / RESULT_NAME} and {LOG_NAME}", file=sys.stderr)
    return 0 if all(r["status"] == "ok" for r in payload["stages"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

"""The stages of the GPU suite, in the order they run: name, time limits, one line each, and the function that
runs it (one module per stage or group of related stages).

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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.gpu.stage_base import Ctx
from benchmarks.gpu.stage_env import stage_env
from benchmarks.gpu.stage_isoflop import stage_isoflop
from benchmarks.gpu.stage_layers import stage_decode, stage_gdecode, stage_mod, stage_moe
from benchmarks.gpu.stage_nccl import stage_nccl
from benchmarks.gpu.stage_profile import stage_profile
from benchmarks.gpu.stage_tests import stage_gtests, stage_tests
from benchmarks.gpu.stage_train import stage_gpumfu, stage_graphs, stage_train


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

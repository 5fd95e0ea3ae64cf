"""The grid of an isoFLOP sweep: model sizes along one aspect ratio, the presets, every run of a sweep
(``RunSpec``: budget, variant, size, seed, steps, folder), and what a run costs: its tokens, the epochs of
the data they are, and its expected seconds on a GPU (``estimate_run_s``). docs/isoflop.md."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from mode import _checks
from mode.experiments import sweep
from mode.experiments.compare import DEFAULT_RECIPE, EXTRA_VARIANTS, MoDRecipe, extra_variants, variants
from mode.measure.flops import train_flops_per_token
from mode.model import LMConfig
from mode.train.config import TrainConfig
from mode.train.data import PACKAGES


@dataclass(frozen=True)
class Size:
    n_layers: int
    d_model: int

    @property
    def name(self) -> str:
        return f"L{self.n_layers}_d{self.d_model}"


@dataclass
class IsoflopPreset:
    """A sweep: the sizes (one aspect ratio), the budgets, and what every run shares."""

    base: LMConfig  # vocabulary, sequence, experts, the MoD recipe; width and depth come from each size
    train: TrainConfig  # batch, learning rate and schedule; steps and seed are set per run
    budgets: tuple[float, ...]  # training FLOPs per run
    aspect: int = 16  # d_model = aspect * n_layers
    n_layers: tuple[int, ...] = (2, 3, 4, 6)
    head_dim: int = 32
    mlp_ratio: int = 4
    eval_windows: int = 512  # fixed validation windows, the same for every run
    eval_batch_size: int = 32
    max_corpus_bytes: int | None = None
    data: str | None = None  # the corpus when none is given: None the built-in one, "packages" (mode.train.packages)
    sizes: tuple[Size, ...] = field(init=False)

    def __post_init__(self) -> None:
        _checks.check_int("aspect", self.aspect)
        for n in self.n_layers:
            _checks.check_int("n_layers", n, min_value=2)  # MoD routes every other block: 1 layer routes none
        if len(set(self.n_layers)) != len(self.n_layers):
            raise ValueError(f"n_layers={self.n_layers}: sizes must be distinct")
        for b in self.budgets:
            _checks.check_positive("budget", b)
        _checks.check_int("eval_windows", self.eval_windows)
        _checks.check_int("eval_batch_size", self.eval_batch_size)
        self.sizes = tuple(Size(n, self.aspect * n) for n in sorted(self.n_layers))


PRESETS = ("quick", "default", "gpu")


def preset(quick: bool | str) -> IsoflopPreset:
    """``"quick"`` (or True), ``"default"`` (or False), ``"gpu"``; docs/isoflop.md has their sizes and times."""
    name = ("quick" if quick else "default") if isinstance(quick, bool) else quick
    _checks.check_choice("preset", name, PRESETS)
    if name == "gpu":
        # One H100/H200, about 6 minutes for 2 seeds of the six variants (docs/isoflop.md has the table).
        # The step of these models is host-bound (the constants below): 10 ms (dense L2_d128) to 37 ms (staged
        # MoDE L4_d256), nearly whatever the batch, until the device's share catches up, which it does near
        # d=256 at 256 x 512 tokens. So the batch is as large as that allows (131,072 tokens a step: more tokens
        # a second for free) and the widths stay at 128-256. Then 6 minutes buy about 15,000 steps in all for
        # 72 runs: two budgets (1e14, 3e14 FLOPs), three sizes (L2_d128, L3_d192, L4_d256: 0.39M, 1.33M, 3.15M
        # non-embedding parameters dense). Per run: 30-985 steps, 3.9M-129M tokens (at most 0.59 epochs of
        # the 219 MB of package sources of the CPU machine; estimate_s's table), an estimated 2.0-20.2 s;
        # the grid, estimate_s(preset("gpu"), seeds=2): 396 s (59 + 140 s a seed). Eager: --compile costs
        # ~35 s per distinct model (gpu_suite run 4), and the grid has 36. `--budgets` adds budgets later.
        base = LMConfig(seq_len=512, d_model=128, n_heads=2, d_hidden=512, num_experts=8)
        train = TrainConfig(batch_size=256, lr=2e-3, warmup_steps=50, eval_every=10**9, eval_batches=1, log_every=25)
        return IsoflopPreset(
            base,
            train,
            budgets=(1e14, 3e14),
            aspect=64,
            n_layers=(2, 3, 4),
            head_dim=64,
            eval_windows=1024,
            eval_batch_size=128,
            data=PACKAGES,
        )
    if name == "quick":  # 10k to 180k parameters
        base = LMConfig(seq_len=128, d_model=64, n_heads=2, d_hidden=256, num_experts=4)
        train = TrainConfig(batch_size=8, lr=3e-3, warmup_steps=20, eval_every=10**9, eval_batches=1, log_every=10)
        return IsoflopPreset(
            base,
            train,
            budgets=(2e10, 6e10, 2e11),
            aspect=8,
            n_layers=(2, 3, 4, 6),
            head_dim=16,
            eval_windows=512,
            max_corpus_bytes=3_000_000,
        )
    # default: 10k to 410k parameters, 5x the quick budgets
    base = LMConfig(seq_len=256, d_model=128, n_heads=4, d_hidden=512, num_experts=8)
    train = TrainConfig(batch_size=8, lr=3e-3, warmup_steps=50, eval_every=10**9, eval_batches=1, log_every=10)
    return IsoflopPreset(
        base, train, budgets=(1e11, 3e11, 1e12), aspect=8, n_layers=(2, 3, 4, 6, 8), head_dim=16, eval_windows=1024
    )


def size_config(p: IsoflopPreset, size: Size) -> LMConfig:
    """The dense model of ``size``: ``p.base`` at that width and depth."""
    d = size.d_model
    return replace(
        p.base,
        d_model=d,
        n_heads=max(1, d // p.head_dim),
        d_hidden=p.mlp_ratio * d,
        layers=("dense",) * size.n_layers,
        predictor_hidden=max(16, d // 2),
    )


def budget_name(budget: float) -> str:
    return f"{budget:.3g}".replace("+", "")


@dataclass
class RunSpec:
    budget: float
    variant: str
    size: Size
    seed: int
    cfg: LMConfig
    steps: int
    dir: Path

    @property
    def label(self) -> str:
        return f"{budget_name(self.budget)} {self.variant} {self.size.name} seed {self.seed}"


def sweep_variants(
    base: LMConfig, causal: str = "predictor", recipe: MoDRecipe = DEFAULT_RECIPE, only: list[str] | None = None
) -> dict[str, LMConfig]:
    """The six variants of ``mode compare`` at ``base``'s size, then the extra ones (``extra_variants``:
    e.g. ``integrated_mode_matched``, integrated MoDE at staged MoDE's FLOPs per token) named in ``only``."""
    return {**variants(base, causal, recipe), **extra_variants(base, causal, only or ())}


def variant_names(causal: str = "predictor") -> list[str]:
    """Every variant a sweep can train: the six, then the extra ones."""
    return list(variants(LMConfig(), causal)) + list(EXTRA_VARIANTS)


def plan(
    p: IsoflopPreset,
    out: Path,
    seeds: list[int],
    causal: str = "predictor",
    only: list[str] | None = None,
    recipe: MoDRecipe = DEFAULT_RECIPE,
) -> list[RunSpec]:
    """Every run of the sweep, seed by seed (a sweep stopped early has whole seeds done)."""
    specs = []
    for seed in seeds:
        for budget in p.budgets:
            for size in p.sizes:
                for name, cfg in sweep_variants(size_config(p, size), causal, recipe, only).items():
                    if only and name not in only:
                        continue
                    steps = sweep.steps_for_budget(cfg, budget, p.train.batch_size, f"{name} {size.name}")
                    specs.append(
                        RunSpec(
                            budget,
                            name,
                            size,
                            seed,
                            cfg,
                            steps,
                            out / "runs" / budget_name(budget) / name / size.name / f"seed{seed}",
                        )
                    )
    order = {name: i for i, name in enumerate(variant_names(causal))}
    return sorted(
        specs, key=lambda s: (seeds.index(s.seed), p.budgets.index(s.budget), order[s.variant], p.sizes.index(s.size))
    )


# -- what a run costs on a GPU: the planning arithmetic of the gpu preset ---------------------------------
#
# One measurement stands behind these constants (docs/results-gpu.md, gpu_suite run 4, one H200, torch
# 2.11): `mode train --preset base --bf16`, eager, 477,526 tokens/s at 64 x 512 tokens a step, i.e. 68.6 ms a
# step; the profile of the same step (run 3) had the device busy 53.6 ms of it, for 5.57e12 training FLOPs.
# At these sizes the step is host-bound: its time is the host's cost of issuing the step's operations. One
# step of that model is 4,647 aten operations (counted on the CPU with a TorchDispatchMode, bf16 autocast;
# the per-layer counts below add up to it within 0.1%; tests/experiments/test_isoflop.py recounts them), so
# the host spends about 14.8 us per operation. A step's time is then estimated as the larger of its host
# time (operations x 14.8 us) and its device time (training FLOPs / 100 TFLOP/s, the base step's rate while
# the device was busy), and a run's as steps x that plus a fixed cost (model built on the CPU and moved,
# the first step's allocations, the final checkpoint, the held-out evaluation). The fixed cost is a guess,
# not a measurement: the first GPU sweep records every run's own seconds (`wall_s` in its result) and the
# report's `estimate` block sets them beside these estimates. The counts are those of the code that was timed
# (6ad4109): the fused ops since (mode/kernels, docs/performance.md) cut a step by 10-15% of its operations,
# but a custom op costs the host more than an aten op, so until a GPU re-times a step the estimate is kept
# as the upper bound it was calibrated as (the test allows a counted step 60% to 110% of it).
HOST_S_PER_OP = 68.6e-3 / 4647
OPS_PER_STEP = 176  # embedding, loss, sampling, AdamW's fixed part, logging: independent of the layers
OPS_PER_LAYER = {"dense": 249, "mod": 481, "mod_random": 379, "moe": 455, "staged": 719, "integrated": 477}
DEVICE_FLOP_S = 100e12
RUN_OVERHEAD_S = 1.0


def step_ops(cfg: LMConfig) -> int:
    """Estimated aten operations of one training step of ``cfg`` (``OPS_PER_STEP`` + ``OPS_PER_LAYER``)."""
    unknown = [k for k in cfg.layers if k not in OPS_PER_LAYER]
    if unknown:
        raise ValueError(
            f"layers={cfg.layers}: no operation count for layer kind {unknown[0]!r}; known: {', '.join(OPS_PER_LAYER)}"
        )
    return OPS_PER_STEP + sum(OPS_PER_LAYER[k] for k in cfg.layers)


def estimate_step_s(cfg: LMConfig, batch_size: int) -> float:
    """Expected seconds of one eager bf16 training step on one H100/H200: host time or device time, the larger."""
    host = step_ops(cfg) * HOST_S_PER_OP
    device = train_flops_per_token(cfg) * batch_size * cfg.seq_len / DEVICE_FLOP_S
    return max(host, device)


def run_cost(spec: RunSpec, p: IsoflopPreset, train_bytes: int | None = None) -> dict:
    """A run's tokens, nominal FLOPs, epochs of ``train_bytes`` (byte-level data: one token per byte) and
    expected seconds on a GPU (``estimate_step_s``; ``RUN_OVERHEAD_S`` per run)."""
    tokens = spec.steps * p.train.batch_size * p.base.seq_len
    step_s = estimate_step_s(spec.cfg, p.train.batch_size)
    return {
        "tokens": tokens,
        "flops": spec.steps * sweep.step_flops(spec.cfg, p.train.batch_size),
        "epochs": None if not train_bytes else tokens / train_bytes,
        "est_step_s": step_s,
        "est_s": spec.steps * step_s + RUN_OVERHEAD_S,
    }


def estimate_s(
    p: IsoflopPreset,
    seeds: int = 1,
    causal: str = "predictor",
    only: list[str] | None = None,
    recipe: MoDRecipe = DEFAULT_RECIPE,
) -> float:
    """Expected seconds of the whole sweep of ``p`` on one H100/H200 (``run_cost``), ``seeds`` seeds."""
    specs = plan(p, Path("."), list(range(seeds)), causal, only, recipe)
    return sum(run_cost(s, p)["est_s"] for s in specs)

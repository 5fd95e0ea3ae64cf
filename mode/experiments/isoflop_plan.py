"""The grid of an isoFLOP sweep: model sizes along one aspect ratio, the presets, and every run of a sweep
(``RunSpec``: budget, variant, size, seed, steps, folder). docs/isoflop.md."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from mode import _checks
from mode.experiments import sweep
from mode.experiments.compare import DEFAULT_RECIPE, MoDRecipe, variants
from mode.model import LMConfig
from mode.train.config import TrainConfig


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
    if name == "gpu":  # 1.4M to 50M parameters; not run yet (no GPU so far): docs/isoflop.md
        base = LMConfig(seq_len=512, d_model=256, n_heads=4, d_hidden=1024, num_experts=8)
        train = TrainConfig(batch_size=64, lr=1e-3, warmup_steps=200, eval_every=10**9, eval_batches=1,
                            log_every=50)
        return IsoflopPreset(base, train, budgets=(1e15, 3e15, 1e16), aspect=64, n_layers=(3, 4, 6, 8, 10),
                             head_dim=64, eval_windows=2048, eval_batch_size=64)
    if name == "quick":  # 10k to 180k parameters
        base = LMConfig(seq_len=128, d_model=64, n_heads=2, d_hidden=256, num_experts=4)
        train = TrainConfig(batch_size=8, lr=3e-3, warmup_steps=20, eval_every=10**9, eval_batches=1,
                            log_every=10)
        return IsoflopPreset(base, train, budgets=(2e10, 6e10, 2e11), aspect=8, n_layers=(2, 3, 4, 6),
                             head_dim=16, eval_windows=512, max_corpus_bytes=3_000_000)
    # default: 10k to 410k parameters, 5x the quick budgets
    base = LMConfig(seq_len=256, d_model=128, n_heads=4, d_hidden=512, num_experts=8)
    train = TrainConfig(batch_size=8, lr=3e-3, warmup_steps=50, eval_every=10**9, eval_batches=1, log_every=10)
    return IsoflopPreset(base, train, budgets=(1e11, 3e11, 1e12), aspect=8, n_layers=(2, 3, 4, 6, 8),
                         head_dim=16, eval_windows=1024)


def size_config(p: IsoflopPreset, size: Size) -> LMConfig:
    """The dense model of ``size``: ``p.base`` at that width and depth."""
    d = size.d_model
    return replace(p.base, d_model=d, n_heads=max(1, d // p.head_dim), d_hidden=p.mlp_ratio * d,
                   layers=("dense",) * size.n_layers, predictor_hidden=max(16, d // 2))


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


def plan(p: IsoflopPreset, out: Path, seeds: list[int], causal: str = "predictor",
         only: list[str] | None = None, recipe: MoDRecipe = DEFAULT_RECIPE) -> list[RunSpec]:
    """Every run of the sweep, seed by seed (a sweep stopped early has whole seeds done)."""
    specs = []
    for seed in seeds:
        for budget in p.budgets:
            for size in p.sizes:
                for name, cfg in variants(size_config(p, size), causal, recipe).items():
                    if only and name not in only:
                        continue
                    steps = sweep.steps_for_budget(cfg, budget, p.train.batch_size, f"{name} {size.name}")
                    specs.append(RunSpec(budget, name, size, seed, cfg, steps,
                                         out / "runs" / budget_name(budget) / name / size.name / f"seed{seed}"))
    order = {name: i for i, name in enumerate(variants(size_config(p, p.sizes[0]), causal))}
    return sorted(specs, key=lambda s: (seeds.index(s.seed), p.budgets.index(s.budget), order[s.variant],
                                        p.sizes.index(s.size)))

"""``convert_to_macs``: one call from an original model to a converted (MoD) or pruned one at a MAC budget,
fitted and optionally healed, ready for ``save_conversion``.

The steps, all of them existing calls of ``mode.hf``:

    method "mod"    order the layers (``skip_costs`` of the part, cheapest first, with ``skip_rank`` measured
                    with each part's estimate standing in; or "every_other"; part "mixed": the attention and
                    MLP halves by ``mixed_order`` of their costs, the least loss per multiply-add saved first),
                    ``plan_to_macs`` (fewest layers at one capacity >= ``min_capacity``),
                    ``to_mod`` per part, ``router_fit`` (router, estimate, causal thresholds; ``router_label``)
    method "prune"  the whole-layer count whose MACs come nearest the target, ``prune_layers`` (block
                    influence or skip cost; with ``skip_rank``: a fitted estimate per deleted layer)
    then, with ``heal``: ``heal`` against the original (a copy is taken before converting when no teacher is
    passed), ``merge_lora``, and the causal thresholds recalibrated on the fit batches.

The causal thresholds are set on ``calibration_batches`` instead of the fit batches when given, after
``router_fit`` and again after healing: a threshold router routes a different share of text unlike the text
its thresholds were set on (docs/hf.md, "Where the share drifts").

``heal_probe`` (with ``probe_every``) looks at the model along the heal: before its first step and after every
``probe_every``-th, it is handed a copy of the model as the conversion would end there (adapters merged, causal
thresholds recalibrated). The heal itself ends as it would without the probe (``heal``'s ``on_step``).

The result (``BudgetResult``) says the MACs reached (``conversion_macs``), the layers, the capacity, what
healing spent, and the seconds each step took. ``mode convert`` (``mode/hf/convert_command.py``) runs it from
the command line and writes a directory ``load_conversion`` reads.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from torch import nn

from mode import _checks
from mode.hf._compat import check_model_type, decoder_config, decoder_layers
from mode.hf.dense.convert import mod_layers, to_mod
from mode.hf.dense.heal import HealConfig, HealReport, heal
from mode.hf.dense.lora import merge_lora
from mode.hf.dense.macs import HALVES, MIXED, PLAN_PARTS, conversion_macs, macs_per_token, mixed_order, plan_to_macs
from mode.hf.dense.prune import PRUNE_BY, prune_layers
from mode.hf.dense.router_fit import LABELS, router_fit
from mode.hf.dense.skip_cost import skip_costs
from mode.hf.dense.tune import calibrate
from mode.train.progress import Progress

METHODS = ("mod", "prune")
ORDERS = ("skip_cost", "every_other")
CAUSAL = ("threshold", "aux_bce")  # router_fit sets the score these decide by ("predictor" has its own MLP)


@dataclass(frozen=True)
class BudgetConfig:
    """What ``convert_to_macs`` builds.

    macs: the target MACs per token ÷ the original's, in (0, 1). method: ``"mod"`` or ``"prune"``. seq_len:
    the sequence length the MACs are counted at (attention grows with it). part (mod): ``"layer"``,
    ``"attention"``, ``"mlp"`` or ``"mixed"`` (attention halves in some layers, MLP halves in others, as
    ``mixed_order`` ranks them; needs order ``"skip_cost"``). causal (mod): ``"threshold"`` or
    ``"aux_bce"``. skip_rank: the rank of the estimate standing in for a skipped part (mod) or a deleted layer
    (prune); None: none. order (mod):
    ``"skip_cost"`` (cheapest layers first, measured on ``cost_batches`` of the fit batches, as pruning's
    ``prune_by="skip_cost"`` measures them; with
    ``skip_rank``: each part, or half for ``"mixed"``, skipped with its estimate, fitted on the fit batches,
    standing in) or
    ``"every_other"``. min_capacity (mod): the lowest capacity the plan may use. router_label (mod):
    ``router_fit``'s label, ``"update"`` (route the largest updates) or ``"residual"`` (the largest the
    estimate misses; needs ``skip_rank``). prune_by (prune): ``"block_influence"`` or ``"skip_cost"`` (with
    ``skip_rank``: with the estimates standing in). heal: a ``HealConfig``, or None for no healing.
    """

    macs: float
    method: str = "mod"
    seq_len: int = 256
    part: str = "layer"
    causal: str = "threshold"
    skip_rank: int | None = None
    order: str = "skip_cost"
    min_capacity: float = 0.5
    router_label: str = "update"
    cost_batches: int = 1
    prune_by: str = "block_influence"
    heal: HealConfig | None = None

    def __post_init__(self):
        if isinstance(self.macs, bool) or not isinstance(self.macs, (int, float)) or not 0 < self.macs < 1:
            raise ValueError(f"macs={self.macs!r}: must be a fraction of the original's MACs in (0, 1)")
        _checks.check_choice("method", self.method, METHODS)
        _checks.check_int("seq_len", self.seq_len)
        _checks.check_choice("part", self.part, PLAN_PARTS)
        _checks.check_choice("causal", self.causal, CAUSAL)
        if self.skip_rank is not None:
            _checks.check_int("skip_rank", self.skip_rank, min_value=0)
        _checks.check_choice("order", self.order, ORDERS)
        _checks.check_fraction("min_capacity", self.min_capacity)
        _checks.check_choice("router_label", self.router_label, LABELS)
        if self.router_label == "residual" and (self.method != "mod" or self.skip_rank is None):
            raise ValueError(
                f"router_label='residual' with method={self.method!r}, skip_rank={self.skip_rank}: it routes what "
                "a MoD layer's estimate misses; it needs method='mod' and a skip_rank"
            )
        _checks.check_int("cost_batches", self.cost_batches)
        _checks.check_choice("prune_by", self.prune_by, PRUNE_BY)
        if self.heal is not None and not isinstance(self.heal, HealConfig):
            raise TypeError(f"heal={type(self.heal).__name__}: must be a mode.hf.HealConfig or None")
        if self.method == "prune" and self.part != "layer":
            raise ValueError(f"part={self.part!r}: method='prune' deletes whole layers; use part='layer'")
        if self.part == MIXED and self.order != "skip_cost":
            raise ValueError(
                f"order={self.order!r}: part='mixed' ranks the halves by their skip costs; use 'skip_cost'"
            )


@dataclass
class BudgetResult:
    """What ``convert_to_macs`` built: ``macs`` reached (``conversion_macs``) against ``target``; ``layers``
    converted or deleted (original indices); ``capacity`` of the MoD layers (None when pruned); ``heal`` (the
    ``HealReport``, None without healing); ``seconds`` per step (wall clock); ``parts``: the part each MoD
    layer skips (empty when pruned)."""

    method: str
    target: float
    macs: float
    layers: list[int]
    capacity: float | None
    part: str
    heal: HealReport | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    parts: dict[int, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """A JSON-ready dict (the heal report without its per-step losses: first and last are kept)."""
        out = asdict(self)
        if self.heal is not None:
            losses = out["heal"].pop("losses")
            out["heal"]["loss_first_last"] = [losses[0], losses[-1]] if losses else []
        return out


def pruned_macs(model: nn.Module, seq_len: int, n: int) -> float:
    """MACs per token ÷ the original's of ``model`` with ``n`` whole layers deleted, no estimate (the layers of
    a decoder are equal in MACs, so which ones does not matter)."""
    config, n_layers = decoder_config(model), len(decoder_layers(model))
    gone = {"part": "layer", "share": 0.0, "kv_all": False, "rank": None, "router": False}
    deleted = dict.fromkeys(range(n), gone)
    return macs_per_token(config, seq_len, deleted, n_layers) / macs_per_token(config, seq_len, {}, n_layers)


def layers_to_delete(model: nn.Module, seq_len: int, macs: float) -> int:
    """The whole-layer count (at least 1, at most all but one) whose MACs come nearest ``macs``."""
    n_layers = len(decoder_layers(model))
    if n_layers < 2:
        raise ValueError(f"model: has {n_layers} decoder layer(s); pruning needs at least 2 (one must stay)")
    return min(range(1, n_layers), key=lambda n: abs(pruned_macs(model, seq_len, n) - macs))


def _steers(model: nn.Module) -> bool:
    return any(layer.mod_router.steers for layer in mod_layers(model).values())


def _prober(model: nn.Module, look: Callable, every: int, last: int, cal_batches: Sequence) -> Callable[[int], None]:
    """``heal``'s ``on_step`` for a heal probe: every ``every`` steps before ``last`` (the conversion's own
    result), ``look(step, copy)``, the copy as the conversion would end there."""

    def probe(step: int) -> None:
        if step % every or step == last:
            return
        snapshot = copy.deepcopy(model)
        merge_lora(snapshot)
        if _steers(snapshot):
            calibrate(snapshot, cal_batches, None)
        look(step, snapshot)

    return probe


def convert_to_macs(
    model: nn.Module,
    cfg: BudgetConfig,
    fit_batches: Sequence,
    heal_batches: Sequence | None = None,
    teacher: nn.Module | None = None,
    progress: bool | Progress | None = None,
    calibration_batches: Sequence | None = None,
    heal_probe: Callable[[int, nn.Module], None] | None = None,
    probe_every: int = 0,
) -> BudgetResult:
    """Convert ``model`` (an original Llama / Qwen2 / Mistral, in place) to ``cfg.macs`` of its MACs per token
    as ``cfg`` says (module doc), fitting on ``fit_batches`` and healing on ``heal_batches`` (default: the fit
    batches) against ``teacher`` (default: a copy of ``model`` taken before converting). Batches are (B, S)
    token ids or dicts with ``input_ids`` / ``attention_mask``. ``progress``: lines for a person from every
    phase (skip costs per layer, estimate fits, router fits, calibration, and the heal's; ``heal``), every 20 s
    and at each phase's end (None: silent). ``calibration_batches``: what the MoD causal thresholds are set on
    (default: the fit batches). ``heal_probe(step, model_copy)``, ``probe_every``: the module doc (a probe
    needs ``cfg.heal`` and ``probe_every`` >= 1).
    Returns a ``BudgetResult``; ``save_conversion`` writes the model."""
    if not isinstance(cfg, BudgetConfig):
        raise TypeError(f"cfg={type(cfg).__name__}: must be a mode.hf.BudgetConfig")
    if heal_probe is not None:
        _checks.check_int("probe_every", probe_every)
        if cfg.heal is None:
            raise ValueError("heal_probe: given, but cfg.heal is None (no heal to look at)")
    check_model_type(model)
    if getattr(model, "mode_conversion", None) or mod_layers(model):
        raise ValueError("convert_to_macs: the model already carries a conversion; start from the original")
    fit_batches = list(fit_batches)
    if not fit_batches:
        raise ValueError("fit_batches: empty; the conversion measures and fits on at least one batch")
    cal_batches = fit_batches if calibration_batches is None else list(calibration_batches)
    if not cal_batches:
        raise ValueError("calibration_batches: empty; pass None to calibrate on the fit batches")
    if cfg.heal is not None and cfg.heal.objective != "lm" and teacher is None:
        teacher = copy.deepcopy(model)  # the original, before any change
    if teacher is not None:
        for p in teacher.parameters():
            p.requires_grad_(False)
    shown = None if progress is None else Progress.of(progress)
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    capacity: float | None = None
    parts: dict[int, str] = {}
    # One cost rule for both methods: a part's skip cost is measured on the first ``cost_batches`` fit batches,
    # with its estimate (if any) fitted on all of them, so MoD and pruning rank layers on the same evidence.
    cost_batches = fit_batches[: cfg.cost_batches]
    if cfg.method == "prune":
        n = layers_to_delete(model, cfg.seq_len, cfg.macs)
        scores = None
        if cfg.prune_by == "skip_cost":
            scores = skip_costs(
                model, cost_batches, "layer", estimate_rank=cfg.skip_rank, fit_batches=fit_batches, progress=shown
            )
        layers = prune_layers(
            model, n, cfg.prune_by, fit_batches, estimate_rank=cfg.skip_rank, scores=scores, progress=shown
        )
        seconds["prune"] = time.perf_counter() - t0
    else:
        n_layers = len(decoder_layers(model))
        order: str | list = cfg.order
        if cfg.order == "skip_cost":  # each part's cost with its estimate standing in, where it has one
            costs = {
                part: skip_costs(
                    model, cost_batches, part, estimate_rank=cfg.skip_rank, fit_batches=fit_batches, progress=shown
                )
                for part in (HALVES if cfg.part == MIXED else (cfg.part,))
            }
            if cfg.part == MIXED:
                order = mixed_order(model, costs, cfg.seq_len, skip_rank=cfg.skip_rank)
            else:
                order = sorted(range(n_layers), key=lambda i: (costs[cfg.part][i], i))
            seconds["skip_costs"] = time.perf_counter() - t0
        plan = plan_to_macs(
            model,
            cfg.macs,
            cfg.seq_len,
            part=cfg.part,
            skip_rank=cfg.skip_rank,
            order=order,
            min_capacity=cfg.min_capacity,
        )
        for group in plan.groups():
            to_mod(model, **group, causal=cfg.causal)
        t1 = time.perf_counter()
        router_fit(model, fit_batches, label=cfg.router_label, calibration_batches=cal_batches, progress=shown)
        seconds["router_fit"] = time.perf_counter() - t1
        layers, capacity, parts = sorted(plan.layers), plan.capacity, plan.parts
    report = None
    if cfg.heal is not None:
        t1 = time.perf_counter()
        probe = None if heal_probe is None else _prober(model, heal_probe, probe_every, cfg.heal.steps, cal_batches)
        batches = heal_batches if heal_batches is not None else fit_batches
        report = heal(model, teacher, batches, cfg.heal, shown, on_step=probe)
        merge_lora(model)
        if _steers(model):
            calibrate(model, cal_batches, shown)  # healing moved the routers: steer the causal thresholds again
        seconds["heal"] = time.perf_counter() - t1
    seconds["total"] = time.perf_counter() - t0
    return BudgetResult(
        method=cfg.method,
        target=float(cfg.macs),
        macs=conversion_macs(model, cfg.seq_len),
        layers=list(layers),
        capacity=capacity,
        part=cfg.part,
        heal=report,
        seconds=seconds,
        parts=parts,
    )

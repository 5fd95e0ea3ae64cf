"""``heal``: train a converted (MoD) or pruned model back toward the original for a fixed budget.

Shape legend: B batch, S sequence, V vocabulary.

What trains (``HealConfig.trainable``): ``"lora"``, LoRA adapters (``mode.hf.dense.lora``) on the linear
projections of the healed layers, plus the MoD routers, the skipped tokens' estimates and the deleted layers'
estimates where the model has them; ``"routers"``, those routers and estimates only; ``"all"``, every
parameter. The healed layers (``layers="auto"``): a MoD model's converted layers; a pruned model's kept layer
after each deleted one (the one before, for the last), so a MoD model with K converted layers and a model with K
layers deleted apart get adapters of the same size; ``layers="all"``: every decoder layer the model has.

The objective (``HealConfig.objective``): ``"distill"``, KL(teacher || model) of the next-token
distributions (the teacher is the original model, passed in: with adapters on, the model run densely is not
the original any more); ``"lm"``, next-token cross-entropy; ``"both"``, their sum. The routers' own losses
(``collect_aux``) are added, as ``router_tune`` does. Top-C routing, train mode, no cache, AdamW.

The budget is the steps; the report (``HealReport``) says what was spent: optimizer steps, real tokens fed,
CPU seconds, the trainable parameter count (LoRA and the rest apart), and a digest of the batches in the
order fed, so that two runs (a MoD model and a pruned one) can be checked to have had equal budgets.

``progress`` shows a long heal to a person (``mode.train.progress``): None, nothing (library use); ``True`` /
``False``, a bar on a terminal or not, plain ``heal: step 40/100 (40%)  loss 0.1523  850 tok/s  ETA 9m10s``
lines on stdout every 20 s and an end line either way; a ``Progress``, as it says.

``on_step(step)`` (optional) is called before the first step (``step=0``) and after each one, for a caller that
looks at the model along the way (``convert_to_macs``'s heal probe): its CPU time is not counted in the report,
and torch's RNG is restored after it, so that a heal with it ends as one without.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn

from mode import _checks
from mode.hf._compat import decoder_layers
from mode.hf.dense.convert import mod_layers
from mode.hf.dense.lora import TARGETS, add_lora, lora_parameters, mark_healed
from mode.hf.dense.routing import collect_aux, routing
from mode.hf.dense.tune import _as_batch, _positions, distill_loss, lm_loss, router_parameters
from mode.train.progress import Progress

TRAINABLE = ("lora", "routers", "all")
HEAL_OBJECTIVES = ("distill", "lm", "both")
LAYER_CHOICES = ("auto", "all")


@dataclass(frozen=True)
class HealConfig:
    """What ``heal`` trains, on what objective, for how long.

    steps: optimizer steps (the budget; the batches are cycled). trainable: ``"lora"``, ``"routers"`` or
    ``"all"``. objective: ``"distill"``, ``"lm"`` or ``"both"``. lr, weight_decay: AdamW's. router_lr: the
    MoD routers' learning rate (``...mod_router.*``; None: ``lr``; 0: the routers stay as fitted). AdamW moves
    every weight by about ``lr`` a step whatever its scale, and a fitted router's weights can be far smaller
    than 1e-3 (the hidden states' scale divides them), so ``lr`` rewrites its ranking. rank, alpha: the
    LoRA rank and scale ``alpha / rank`` (None: scale 1). layers: the decoder layers (current indices) that
    get adapters, ``"auto"`` (see the module doc) or ``"all"``. targets: the projections' names. seed: if set,
    ``torch.manual_seed(seed)`` right before the adapters are made, so their initialisation does not depend on
    what drew from the global generator before (None: it is left as it is).
    """

    steps: int
    trainable: str = "lora"
    objective: str = "distill"
    lr: float = 1e-3
    router_lr: float | None = None
    weight_decay: float = 0.0
    rank: int = 8
    alpha: float | None = None
    layers: str | Sequence[int] = "auto"
    targets: tuple[str, ...] = TARGETS
    seed: int | None = None

    def __post_init__(self):
        _checks.check_int("steps", self.steps)
        _checks.check_choice("trainable", self.trainable, TRAINABLE)
        _checks.check_choice("objective", self.objective, HEAL_OBJECTIVES)
        _checks.check_positive("lr", self.lr)
        if self.router_lr is not None:
            _checks.check_non_negative("router_lr", self.router_lr)
        _checks.check_non_negative("weight_decay", self.weight_decay)
        _checks.check_int("rank", self.rank)
        if self.alpha is not None:
            _checks.check_positive("alpha", self.alpha)
        if isinstance(self.layers, str) and self.layers not in LAYER_CHOICES:
            raise ValueError(f"layers={self.layers!r}: must be 'auto', 'all' or a list of decoder layer indices")
        if self.seed is not None:
            _checks.check_int("seed", self.seed, min_value=0)


@dataclass
class HealReport:
    """What a ``heal`` run spent and reached: ``steps`` (optimizer steps), ``tokens`` (real tokens fed),
    ``cpu_seconds`` (process CPU time), ``trainable`` (parameters trained) = ``lora_params`` + ``other_params``
    (routers, estimates, or the base with ``"all"``), ``lora_layers``, ``objective``, ``trainable_kind``, the
    per-step ``losses`` (the objective, without the routers' losses) and ``data_digest`` (SHA-256 of the
    batches in the order fed)."""

    steps: int
    tokens: int
    cpu_seconds: float
    trainable: int
    lora_params: int
    other_params: int
    lora_layers: list[int]
    objective: str
    trainable_kind: str
    data_digest: str
    losses: list[float] = field(default_factory=list)

    def same_budget(self, other: HealReport) -> bool:
        """Equal steps, tokens, data order, objective and kind of trainable (parameter counts are reported,
        not compared: a MoD router has no counterpart in a pruned model)."""
        keys = ("steps", "tokens", "data_digest", "objective", "trainable_kind")
        return all(getattr(self, k) == getattr(other, k) for k in keys)


def _auto_layers(model: nn.Module) -> list[int]:
    mod = mod_layers(model)
    if mod:
        return sorted(mod)
    pruned = (getattr(model, "mode_conversion", None) or {}).get("pruned")
    if not pruned:
        raise ValueError("layers='auto': the model has neither MoD layers nor deleted ones; pass layers=[...]")
    kept = pruned["kept"]
    out = set()
    for i in pruned["layers"]:
        after = [j for j, k in enumerate(kept) if k > i]
        out.add(after[0] if after else len(kept) - 1)
    return sorted(out)


def heal(
    model: nn.Module,
    teacher: nn.Module | None,
    batches: Iterable,
    cfg: HealConfig,
    progress: bool | Progress | None = None,
    on_step: Callable[[int], None] | None = None,
) -> HealReport:
    """Train ``model`` (in place) as ``cfg`` says on ``batches`` (token ids or dicts with ``input_ids`` /
    ``attention_mask``, cycled) against ``teacher`` (the original model; None only for ``objective="lm"``).
    Adapters stay on the model after it (``merge_lora`` folds them in); the parameters' ``requires_grad`` and
    the model's train/eval mode are restored. ``progress``: see the module doc (None: silent). ``on_step``: see
    the module doc. Returns a ``HealReport``."""
    if not isinstance(cfg, HealConfig):
        raise TypeError(f"cfg={type(cfg).__name__}: must be a mode.hf.HealConfig")
    shown = None if progress is None else Progress.of(progress)
    if cfg.objective != "lm" and teacher is None:
        raise ValueError(f"teacher=None: objective={cfg.objective!r} needs the original model as the teacher")
    if teacher is model:
        raise ValueError("teacher: must be a separate copy of the original model, not the model being healed")
    lora_layers: list[int] = []
    if cfg.trainable == "lora":
        if cfg.layers == "auto":
            lora_layers = _auto_layers(model)
        elif cfg.layers == "all":
            lora_layers = list(range(len(decoder_layers(model))))
        else:
            lora_layers = list(cast("Sequence[int]", cfg.layers))  # add_lora checks them
        if cfg.seed is not None:
            torch.manual_seed(cfg.seed)
        add_lora(model, lora_layers, cfg.rank, cfg.alpha, cfg.targets)
    elif cfg.layers != "auto":
        raise ValueError(f"layers={cfg.layers!r}: only trainable='lora' takes layers (trainable={cfg.trainable!r})")
    lora = lora_parameters(model)
    if cfg.trainable == "all":
        train = dict(model.named_parameters())
    else:
        train = {**router_parameters(model), **(lora if cfg.trainable == "lora" else {})}
    if not train:
        raise ValueError(
            "trainable='routers': the model has no router or estimate to train (to_mod, or prune_layers with "
            "estimate_rank)"
        )
    if cfg.router_lr == 0:  # the routers stay as fitted
        train = {n: p for n, p in train.items() if ".mod_router." not in n}
    if not train:
        raise ValueError("router_lr=0: nothing left to train (the model has only MoD routers to train)")
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.requires_grad_(n in train)
    params = list(train.values())
    routers = [p for n, p in train.items() if ".mod_router." in n]
    rest = [p for n, p in train.items() if ".mod_router." not in n]
    router_lr = cfg.lr if cfg.router_lr is None else cfg.router_lr
    groups = ([{"params": rest}] if rest else []) + ([{"params": routers, "lr": router_lr}] if routers else [])
    opt = torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay)
    device = params[0].device
    digest = hashlib.sha256()
    was_training = model.training
    teacher_training = None if teacher is None else teacher.training
    losses: list[float] = []
    tokens = 0
    cpu0 = time.process_time()
    source, cached = iter(batches), []
    model.train()
    if teacher is not None:
        teacher.eval()
    bar = None if shown is None else shown.start("heal", cfg.steps)
    t_train = 0.0  # wall seconds in training steps, for tokens/s
    cpu_aside = 0.0  # CPU seconds in on_step, left out of the report's

    def look(step: int) -> None:
        nonlocal cpu_aside
        if on_step is None:
            return
        c0 = time.process_time()
        with torch.random.fork_rng(devices=[]):
            on_step(step)
        model.train()
        cpu_aside += time.process_time() - c0

    try:
        look(0)
        for step in range(1, cfg.steps + 1):
            t_step = time.perf_counter()
            try:
                batch = next(source)
                cached.append(batch)
            except StopIteration:
                if not cached:
                    raise ValueError("batches: yielded nothing") from None
                source = iter(cached)
                batch = next(source)
            ids_BS, mask_BS = _as_batch(batch, device)
            digest.update(ids_BS.cpu().numpy().tobytes())
            digest.update(b"" if mask_BS is None else mask_BS.cpu().numpy().tobytes())
            tokens += int(ids_BS.numel() if mask_BS is None else mask_BS.sum())
            pos_BS = _positions(mask_BS)
            with routing(model, "topk") if mod_layers(model) else contextlib.nullcontext():
                logits_BSV = model(ids_BS, attention_mask=mask_BS, position_ids=pos_BS, use_cache=False).logits
            loss = logits_BSV.new_zeros((), dtype=torch.float32)
            if cfg.objective != "distill":
                loss = loss + lm_loss(logits_BSV, ids_BS, mask_BS)
            if cfg.objective != "lm":
                assert teacher is not None
                with torch.no_grad():
                    t_BSV = teacher(ids_BS, attention_mask=mask_BS, position_ids=pos_BS, use_cache=False).logits
                loss = loss + distill_loss(logits_BSV, t_BSV, mask_BS)
            aux = collect_aux(model).total().to(loss.device)
            opt.zero_grad(set_to_none=True)
            (loss + aux).backward()
            opt.step()
            losses.append(float(loss.detach()))
            t_train += time.perf_counter() - t_step
            if bar is not None:
                bar.update(step, losses[-1], tokens / t_train)
            look(step)
    finally:
        if bar is not None:
            bar.close()
        model.train(was_training)
        if teacher is not None and teacher_training is not None:
            teacher.train(teacher_training)
        for n, p in model.named_parameters():
            p.requires_grad_(flags.get(n, True))
    if cfg.trainable == "all":
        mark_healed(model, [n for n in train if n not in lora and n not in router_parameters(model)])
    n_lora = sum(p.numel() for p in lora.values()) if cfg.trainable == "lora" else 0
    n_all = sum(p.numel() for p in params)
    return HealReport(
        steps=cfg.steps,
        tokens=tokens,
        cpu_seconds=time.process_time() - cpu0 - cpu_aside,
        trainable=n_all,
        lora_params=n_lora,
        other_params=n_all - n_lora,
        lora_layers=lora_layers,
        objective=cfg.objective,
        trainable_kind=cfg.trainable,
        data_digest=digest.hexdigest(),
        losses=losses,
    )

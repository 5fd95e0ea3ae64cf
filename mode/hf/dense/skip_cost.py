"""``skip_costs``: which layers can a router skip? The loss each decoder layer costs when every token skips
its attention, its MLP or the whole layer (all others run), measured on the user's batches.

It bounds what a MoD conversion of that layer can lose (a router at capacity C skips the part for a share
1 - C of the tokens, at best the cheapest ones), so the layers with the smallest costs are the ones to
convert first: ``layers=sorted(costs, key=costs.get)[:k]`` for ``to_mod``.

``estimate_rank=R``: a skipped part is not left out but replaced by its rank-R estimate (``layer_estimates``:
the affine map that best predicts the part's update from the residual stream it reads, fitted on
``fit_batches``), which is what a conversion with ``skip_rank=R`` leaves for a token that skips the part (and,
for whole layers, ``prune_layers(estimate_rank=R)`` in a deleted layer's place). On SmolLM2-135M the two
rankings differ a lot: layer 8 costs 1.03 nats skipped, 0.05 with its estimate (docs/hf.md).

Shape legend: B batch, S sequence, D model width.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from mode import _checks
from mode.hf._compat import check_model_type, decoder_config, decoder_layers
from mode.hf.dense.convert import resolve_layers
from mode.hf.dense.layer_io import _SITES, _hidden, layer_estimates
from mode.hf.dense.mod_layer import PARTS
from mode.hf.dense.skip_update import SkipUpdate
from mode.hf.dense.tune import _as_batch, _positions, lm_loss
from mode.train.progress import Progress, phase


def _half_output(module, args, output, read: dict, estimate: SkipUpdate | None):
    """The half (attention or MLP) adds nothing to the residual stream, or ``estimate``'s update of the stream it
    read (``read["x"]``), instead of its own output (attention returns (out, weights), an MLP a tensor)."""
    out = output[0] if isinstance(output, tuple) else output
    x = read.pop("x", None)
    new = torch.zeros_like(out) if estimate is None else estimate(x.float()).to(out.dtype)
    return (new,) + output[1:] if isinstance(output, tuple) else new


def _identity_layer(module, args, kwargs, output, estimate: SkipUpdate | None = None):
    """The whole decoder layer returns its input (the residual stream passes unchanged), plus ``estimate``'s
    update of it if given."""
    x_BSD = _hidden(args, kwargs)
    if estimate is not None:
        x_BSD = x_BSD + estimate(x_BSD.float()).to(x_BSD.dtype)
    return (x_BSD,) + output[1:] if isinstance(output, tuple) else x_BSD


@contextlib.contextmanager
def skipped(model: nn.Module, layer: int, part: str, estimate: SkipUpdate | None = None):
    """Within the block, every token skips ``part`` of decoder layer ``layer`` (forward hooks, removed after);
    ``estimate``: its update of what the part reads (``layer_io._SITES``) is added instead of nothing, as a
    ``to_mod(part=..., skip_rank=R)`` layer adds for a token that skips the part."""
    _checks.check_choice("part", part, PARTS)
    target = decoder_layers(model)[layer]
    if part == "layer":
        hook = functools.partial(_identity_layer, estimate=estimate)
        handles = [target.register_forward_hook(hook, with_kwargs=True)]
    else:
        source, sink = _SITES[part]
        read: dict[str, torch.Tensor] = {}

        def remember(module, args, kwargs):
            read["x"] = _hidden(args, kwargs)

        handles = [
            target.get_submodule(sink).register_forward_hook(
                functools.partial(_half_output, read=read, estimate=estimate)
            )
        ]
        if estimate is not None:
            handles.append(target.get_submodule(source).register_forward_pre_hook(remember, with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def _mean_loss(model: nn.Module, batches: Sequence) -> float:
    device = next(model.parameters()).device
    total, weight = 0.0, 0
    for batch in batches:
        ids_BS, mask_BS = _as_batch(batch, device)
        logits = model(ids_BS, attention_mask=mask_BS, position_ids=_positions(mask_BS), use_cache=False).logits
        # the target tokens lm_loss averages over
        n = int(ids_BS[:, 1:].numel() if mask_BS is None else (mask_BS[:, 1:] * mask_BS[:, :-1]).sum())
        total += float(lm_loss(logits, ids_BS, mask_BS)) * n
        weight += n
    if weight == 0:
        raise ValueError("batches: hold no target token (each row needs at least two real tokens)")
    return total / weight


def skip_costs(
    model: nn.Module,
    batches: Iterable,
    part: str = "attention",
    layers: str | Sequence[int] = "all",
    estimate_rank: int | None = None,
    fit_batches: Iterable | None = None,
    progress: Progress | None = None,
) -> dict[int, float]:
    """For each layer in ``layers``: the mean next-token loss (nats/token, over the real target tokens of
    ``batches``) with ``part`` of that layer skipped by every token, minus the model's own loss. Eval mode,
    no cache, the model is left as it was (its train/eval mode too). ``batches``: (B, S) token ids or dicts
    with ``input_ids`` and ``attention_mask`` (left padding), as for ``router_tune``. ``estimate_rank``:
    the skipped part adds its rank-R estimate instead of nothing, fitted on ``fit_batches`` (default:
    ``batches``); see the module doc. ``progress``: lines for a person, per layer (None: silent).
    """
    check_model_type(model)
    _checks.check_choice("part", part, PARTS)
    chosen = resolve_layers(layers, len(decoder_layers(model)))
    batches = list(batches)
    if not batches:
        raise ValueError("batches: empty; skip_costs needs at least one batch to measure a loss on")
    estimates = {}
    if estimate_rank is not None:
        SkipUpdate(decoder_config(model).hidden_size, estimate_rank)  # validates the rank
        fit = batches if fit_batches is None else list(fit_batches)
        if not fit:
            raise ValueError("fit_batches: empty; the estimates are fitted on at least one batch")
        estimates = layer_estimates(model, fit, chosen, estimate_rank, part, progress)
    shown = phase(progress, f"skip costs ({part})", len(chosen) + 1, "loss passes")
    was_training = model.training
    model.eval()
    try:
        base = _mean_loss(model, batches)
        shown.advance()
        costs = {}
        for i in chosen:
            with skipped(model, i, part, estimates.get(i)):
                costs[i] = _mean_loss(model, batches) - base
            shown.advance()
    finally:
        model.train(was_training)
    shown.close()
    return costs


def cheapest(costs: dict[int, float], k: int) -> list[int]:
    """The ``k`` layers with the smallest costs, in layer order (for ``to_mod(layers=...)``)."""
    _checks.check_int("k", k)
    if k > len(costs):
        raise ValueError(f"k={k}: must be at most the number of measured layers ({len(costs)})")
    return sorted(sorted(costs, key=lambda i: (costs[i], i))[:k])

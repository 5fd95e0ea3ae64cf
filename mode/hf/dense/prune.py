"""``prune_layers``: delete whole decoder layers, the baseline a MoD conversion has to beat at equal compute.

Shape legend: B batch, S sequence, D hidden, N real tokens.

Which layers: ``by="skip_cost"``, the layers whose removal costs the least next-token loss on the batches
(``skip_costs(part="layer")``, He et al., arXiv 2406.15786; with ``estimate_rank=R`` measured with each layer's
estimate standing in, what its deletion will then cost); ``by="block_influence"``, ShortGPT's block
influence (Men et al., arXiv 2403.03853), ``1 - mean cos(input, output)`` of each layer over the batches' real
tokens: a layer that leaves the residual stream's direction unchanged has influence 0 and goes first.

The layers are removed from the ``ModuleList``; the kept layers' ``self_attn.layer_idx`` (which picks the
layer's entry of transformers' cache), ``config.num_hidden_layers`` (the decoder loops over that many layers
and ``DynamicCache`` makes that many entries) and ``config.layer_types`` (Qwen2's per-layer mask kind) are
renumbered, so forward and ``generate()`` run as on a shallower checkpoint.

``estimate_rank=R`` keeps a fitted stand-in for each deleted layer: ``SkipUpdate`` (``mode.hf.dense.
skip_update``, ``x + bias + (x @ down) @ up``) fitted by ridge regression of the layer's update (output minus
input) on its input over the batches' real tokens (each deleted layer fitted on its own input in the original
model). It runs in a pre-hook of the next kept layer (or of the final norm, when the last layers go), in the
deleted layers' order; its parameters are ``...prune_est.{k}.*``, trained by ``heal`` like the MoD estimates and
saved with the conversion.

``model.mode_conversion["pruned"]`` records ``{"layers": deleted, "kept": kept, "n_layers": before,
"by": by, "estimate_rank": R}`` (original indices), so ``load_conversion`` prunes a fresh original the same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch.nn.functional as F
from torch import nn

from mode import _checks
from mode._module_attr import set_module_attr
from mode.hf._compat import check_model_type, decoder_config, decoder_layers
from mode.hf.dense.convert import mod_layers
from mode.hf.dense.layer_io import _hidden, layer_estimates, layer_io
from mode.hf.dense.skip_cost import cheapest, skip_costs
from mode.hf.dense.skip_update import SkipUpdate
from mode.train.progress import Progress

PRUNE_BY = ("skip_cost", "block_influence")


def block_influence(model: nn.Module, batches: Iterable) -> dict[int, float]:
    """ShortGPT's block influence of every decoder layer: ``1 - mean cos(input, output)`` over the real tokens
    of ``batches`` (token ids or dicts with ``input_ids`` / ``attention_mask``). 0: the layer does not turn the
    residual stream at all."""
    check_model_type(model)
    batches = list(batches)
    if not batches:
        raise ValueError("batches: empty; block_influence needs at least one batch")
    n = len(decoder_layers(model))
    sums = dict.fromkeys(range(n), 0.0)
    count = dict.fromkeys(range(n), 0)

    def on_layer(i, x_ND, y_ND):
        sums[i] += float(F.cosine_similarity(x_ND, y_ND, dim=-1).sum())
        count[i] += x_ND.shape[0]

    layer_io(model, batches, range(n), on_layer)
    return {i: 1.0 - sums[i] / max(count[i], 1) for i in range(n)}


def _apply_estimates(module, args, kwargs):
    x_BSD = _hidden(args, kwargs)
    for est in module.prune_est:
        x_BSD = x_BSD + est(x_BSD)
    if args:
        return (x_BSD, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": x_BSD}


def _final_norm(model: nn.Module) -> nn.Module:
    owner = getattr(model, "model", model)
    norm = getattr(owner, "norm", None)
    if not isinstance(norm, nn.Module):
        raise ValueError(f"model={type(model).__name__}: found no final norm (model.model.norm) to host the estimates")
    return norm


def delete_layers(model: nn.Module, chosen: Sequence[int], estimates: dict[int, SkipUpdate] | None = None) -> None:
    """Remove decoder layers ``chosen`` (current indices) and renumber the rest (``layer_idx``,
    ``config.num_hidden_layers``, ``config.layer_types``); ``estimates`` (by deleted index) go before the next
    kept layer, or the final norm. The mechanics of ``prune_layers``, without choosing or recording."""
    layers = decoder_layers(model)
    config = decoder_config(model)
    kept = [i for i in range(len(layers)) if i not in set(chosen)]
    hosts: dict[int, list[SkipUpdate]] = {}
    for i in sorted(estimates or {}):
        host = next((j for j in kept if j > i), -1)  # -1: the final norm
        hosts.setdefault(host, []).append(estimates[i])  # type: ignore[index]
    for host, ests in hosts.items():
        module = _final_norm(model) if host == -1 else layers[host]
        module.prune_est = nn.ModuleList(ests)
        hook = module.register_forward_pre_hook(_apply_estimates, with_kwargs=True)
        set_module_attr(module, "_mode_prune_hook", hook)
    new = nn.ModuleList([layers[i] for i in kept])
    for j, layer in enumerate(new):
        set_module_attr(layer.get_submodule("self_attn"), "layer_idx", j)
    owner = model if getattr(model, "layers", None) is layers else model.get_submodule("model")
    owner.layers = new
    config.num_hidden_layers = len(kept)
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = [config.layer_types[i] for i in kept]


def prune_layers(
    model: nn.Module,
    n: int,
    by: str = "block_influence",
    batches: Iterable = (),
    estimate_rank: int | None = None,
    scores: Mapping[int, float] | None = None,
    progress: Progress | None = None,
) -> list[int]:
    """Delete the ``n`` decoder layers of ``model`` that ``by`` ranks lowest (``"block_influence"`` or
    ``"skip_cost"``, measured on ``batches``; with ``estimate_rank``, with the estimates standing in), in place;
    returns their (original) indices, sorted.
    ``estimate_rank``: None, a deleted layer is gone; an int R, a rank-R affine estimate of its update, fitted on
    ``batches``, stands in for it (see the module doc). ``scores``: ``by``'s score of every layer, measured
    before (e.g. ``skip_costs`` shared with a MoD plan), used instead of measuring them again. The model must be
    unconverted (``to_mod`` may follow). ``progress``: lines for a person while it measures and fits (None:
    silent).
    """
    check_model_type(model)
    n_layers = len(decoder_layers(model))
    _checks.check_int("n", n)
    if n >= n_layers:
        raise ValueError(f"n={n}: must be less than the number of decoder layers ({n_layers}); one must stay")
    _checks.check_choice("by", by, PRUNE_BY)
    if estimate_rank is not None:
        SkipUpdate(decoder_config(model).hidden_size, estimate_rank)  # validates the rank
    spec = getattr(model, "mode_conversion", None) or {}
    if mod_layers(model) or spec:
        raise ValueError(
            "prune_layers: the model already carries a mode.hf conversion or pruning "
            f"({sorted(spec) or 'MoD layers'}); prune the original once, then convert"
        )
    batches = list(batches)
    if not batches:
        raise ValueError(f"batches: empty; prune_layers(by={by!r}) measures the layers on at least one batch")
    if scores is not None:
        if sorted(scores) != list(range(n_layers)):
            raise ValueError(f"scores: has layers {sorted(scores)}; it must score every layer 0..{n_layers - 1}")
    elif by == "block_influence":
        scores = block_influence(model, batches)
    else:  # with an estimate: what deleting the layer costs with its estimate in its place
        scores = skip_costs(model, batches, part="layer", estimate_rank=estimate_rank, progress=progress)
    chosen = cheapest(dict(scores), n)
    estimates = None
    if estimate_rank is not None:
        estimates = layer_estimates(model, batches, chosen, estimate_rank, progress=progress)
    kept = [i for i in range(n_layers) if i not in chosen]
    delete_layers(model, chosen, estimates)
    pruned = {"layers": chosen, "kept": kept, "n_layers": n_layers, "by": by, "estimate_rank": estimate_rank}
    set_module_attr(model, "mode_conversion", {"pruned": pruned})
    return chosen


def prune_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters of the estimates standing in for deleted layers (``...prune_est.*``) by name."""
    return {n: p for n, p in model.named_parameters() if ".prune_est." in n}

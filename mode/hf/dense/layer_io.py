"""What the original decoder layers see and return on the user's batches, and the estimates fitted from it:
``layer_estimates`` fits, for each chosen layer, the rank-R affine map (``SkipUpdate``) that best predicts the
layer's update (output minus input) from its input. ``prune_layers(estimate_rank=R)`` keeps them in place of
deleted layers; ``skip_costs(estimate_rank=R)`` measures what skipping a layer costs with one standing in.

Shape legend: B batch, S sequence, D hidden, N real tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from mode.hf._compat import decoder_layers
from mode.hf.dense.skip_update import SkipUpdate
from mode.hf.dense.tune import _as_batch, _positions


def _hidden(args, kwargs) -> Tensor:
    return args[0] if args else kwargs["hidden_states"]


def _output(output) -> Tensor:
    return output[0] if isinstance(output, tuple) else output


@torch.no_grad()
def layer_io(model: nn.Module, batches: list, want: Sequence[int], on_layer) -> None:
    """One forward per batch (eval, no cache); ``on_layer(i, x_ND, y_ND)`` gets layer ``i``'s input and output
    on the batch's real tokens."""
    layers = decoder_layers(model)
    device = next(model.parameters()).device
    real: dict[str, Tensor] = {}
    seen: dict[int, Tensor] = {}

    def hooks(i):
        def pre(module, args, kwargs):
            seen[i] = _hidden(args, kwargs)

        def post(module, args, kwargs, output):
            on_layer(i, seen.pop(i)[real["BS"]].float(), _output(output)[real["BS"]].float())

        return pre, post

    handles = []
    for i in want:
        pre, post = hooks(i)
        handles.append(layers[i].register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(layers[i].register_forward_hook(post, with_kwargs=True))
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            ids_BS, mask_BS = _as_batch(batch, device)
            real["BS"] = torch.ones_like(ids_BS, dtype=torch.bool) if mask_BS is None else mask_BS.bool()
            model(ids_BS, attention_mask=mask_BS, position_ids=_positions(mask_BS), use_cache=False)
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()


def layer_estimates(model: nn.Module, batches: list, chosen: Sequence[int], rank: int) -> dict[int, SkipUpdate]:
    """For each layer in ``chosen``: a rank-``rank`` ``SkipUpdate`` (float32, on the model's device) fitted by
    ridge regression of the layer's update on its input, each on its own input in ``model`` as it is (one
    forward per batch for all of them; holds every chosen layer's inputs and updates of the real tokens)."""
    data: dict[int, list[tuple[Tensor, Tensor]]] = {i: [] for i in chosen}
    layer_io(model, batches, chosen, lambda i, x_ND, y_ND: data[i].append((x_ND, y_ND - x_ND)))
    ref = next(model.parameters())
    out = {}
    for i in chosen:
        x_ND, u_ND = (torch.cat(t) for t in zip(*data[i]))
        est = SkipUpdate(x_ND.shape[1], rank).to(device=ref.device, dtype=torch.float32)
        est.fit(x_ND, u_ND)
        out[i] = est
    return out

"""What the original decoder layers see and return on the user's batches, and the estimates fitted from it:
``layer_estimates`` fits, for each chosen layer, the rank-R affine map (``SkipUpdate``) that best predicts the
update a part of the layer adds to the residual stream from what it reads there: the whole layer's (output minus
input) from its input, the attention half's from the layer's input, the MLP half's from the residual after the
attention (what ``to_mod(part=..., skip_rank=R)``'s estimate of that part reads). ``prune_layers(estimate_rank=R)``
keeps the layers' in place of deleted layers; ``skip_costs(estimate_rank=R)`` measures what skipping a part costs
with its estimate standing in.

Shape legend: B batch, S sequence, D hidden, N real tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from mode.hf._compat import decoder_layers
from mode.hf.dense.skip_update import SkipUpdate
from mode.hf.dense.tune import _as_batch, _positions
from mode.hf.dense.update_moments import UpdateMoments
from mode.train.progress import Progress, phase


def _hidden(args, kwargs) -> Tensor:
    return args[0] if args else kwargs["hidden_states"]


def _output(output) -> Tensor:
    return output[0] if isinstance(output, tuple) else output


# Where a part reads its input and writes its update: the submodule whose input is the residual stream the part
# reads ("": the decoder layer), and the one whose output is its update ("" for the whole layer: there the update
# is the layer's output minus its input).
_SITES = {"layer": ("", ""), "attention": ("", "self_attn"), "mlp": ("post_attention_layernorm", "mlp")}


@torch.no_grad()
def _io(model: nn.Module, batches: list, want: Sequence[int], source: str, sink: str, on_io, on_batch=None) -> None:
    """One forward per batch (eval, no cache); ``on_io(i, x_ND, y_ND)`` gets the input of layer ``i``'s submodule
    ``source`` and the output of its ``sink`` on the batch's real tokens; ``on_batch()`` after each batch."""
    layers = decoder_layers(model)
    device = next(model.parameters()).device
    real: dict[str, Tensor] = {}
    seen: dict[int, Tensor] = {}

    def hooks(i):
        def pre(module, args, kwargs):
            seen[i] = _hidden(args, kwargs)

        def post(module, args, kwargs, output):
            on_io(i, seen.pop(i)[real["BS"]].float(), _output(output)[real["BS"]].float())

        return pre, post

    handles = []
    for i in want:
        pre, post = hooks(i)
        handles.append(layers[i].get_submodule(source).register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(layers[i].get_submodule(sink).register_forward_hook(post, with_kwargs=True))
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            ids_BS, mask_BS = _as_batch(batch, device)
            real["BS"] = torch.ones_like(ids_BS, dtype=torch.bool) if mask_BS is None else mask_BS.bool()
            model(ids_BS, attention_mask=mask_BS, position_ids=_positions(mask_BS), use_cache=False)
            if on_batch is not None:
                on_batch()
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()


def layer_io(model: nn.Module, batches: list, want: Sequence[int], on_layer) -> None:
    """One forward per batch (eval, no cache); ``on_layer(i, x_ND, y_ND)`` gets layer ``i``'s input and output
    on the batch's real tokens."""
    _io(model, batches, want, "", "", on_layer)


def part_io(model: nn.Module, batches: list, want: Sequence[int], part: str, on_part, on_batch=None) -> None:
    """One forward per batch (eval, no cache); ``on_part(i, x_ND, u_ND)`` gets, on the batch's real tokens, the
    residual stream ``part`` of layer ``i`` reads and the update it adds to it (``_SITES``); ``on_batch()``
    after each batch."""
    source, sink = _SITES[part]
    if sink:
        _io(model, batches, want, source, sink, on_part, on_batch)
    else:
        _io(model, batches, want, source, sink, lambda i, x_ND, y_ND: on_part(i, x_ND, y_ND - x_ND), on_batch)


def layer_estimates(
    model: nn.Module,
    batches: list,
    chosen: Sequence[int],
    rank: int,
    part: str = "layer",
    progress: Progress | None = None,
) -> dict[int, SkipUpdate]:
    """For each layer in ``chosen``: a rank-``rank`` ``SkipUpdate`` (float32, on the model's device) fitted by
    ridge regression of ``part``'s update on what it reads (``_SITES``), each on its own input in ``model`` as it
    is (one forward per batch for all of them; each layer keeps the running sums of its tokens,
    ``UpdateMoments``, two ``(D, D)`` matrices, not the tokens). ``progress``: lines for a person (None: silent)."""
    shown = phase(progress, f"estimates ({part}, rank {rank})", len(batches) + len(chosen), "batches + fits")
    moments = {i: UpdateMoments() for i in chosen}
    part_io(model, batches, chosen, part, lambda i, x_ND, u_ND: moments[i].add(x_ND, u_ND), shown.advance)
    ref = next(model.parameters())
    out = {}
    for i in chosen:
        est = SkipUpdate(moments[i].d_model, rank).to(device=ref.device, dtype=torch.float32)
        est.fit_moments(moments[i])
        out[i] = est
        shown.advance()
    shown.close()
    return out

"""LoRA adapters on a decoder's linear projections, and merging them back into the weights.

Shape legend: N tokens (any leading dims), I in-features, O out-features, R rank.

``add_lora`` gives each chosen ``nn.Linear`` a child ``lora`` (``A (R, I)`` small random, ``B (O, R)`` zero, as
LoRA initialises them: the model starts unchanged) and a forward hook that adds ``scale * (x @ A.T) @ B.T`` to
the projection's output. The projection itself is not replaced: its class, its ``weight`` and the model's
state-dict keys stay what they were (the adapters add ``...{proj}.lora.A`` / ``.B``), so the MoD layers'
routed-query attention, which calls the attention module's own projections, sees the adapted projections.

``merge_lora`` folds each adapter into its weight, ``W + scale * B @ A``, removes the adapter and the hook, and
records the merged weights' names in ``model.mode_conversion["healed"]``, so ``save_conversion`` saves them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from mode import _checks
from mode._module_attr import set_module_attr
from mode.hf._compat import decoder_layers

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRA(nn.Module):
    """A rank-``rank`` update of one linear projection, ``scale * (x @ A.T) @ B.T`` (float32 parameters)."""

    def __init__(self, in_features: int, out_features: int, rank: int, scale: float):
        super().__init__()
        self.scale = scale
        self.A = nn.Parameter(torch.randn(rank, in_features) * in_features**-0.5)
        self.B = nn.Parameter(torch.zeros(out_features, rank))

    def forward(self, x_NI: Tensor) -> Tensor:
        """The update ``(..., O)`` to add to the projection's output."""
        return ((x_NI @ self.A.to(x_NI.dtype).T) @ self.B.to(x_NI.dtype).T) * self.scale

    def delta(self) -> Tensor:
        """The update as a weight ``(O, I)``: ``scale * B @ A``."""
        return (self.B @ self.A) * self.scale


def _add_update(module: nn.Linear, args, output: Tensor) -> Tensor:
    return output + cast(LoRA, module.lora)(args[0])  # the hook add_lora registers beside the adapter


def add_lora(
    model: nn.Module, layers: Sequence[int], rank: int = 8, alpha: float | None = None, targets=TARGETS
) -> dict[str, nn.Parameter]:
    """Put a LoRA adapter of rank ``rank`` (scale ``alpha / rank``; ``alpha`` None: scale 1) on each projection
    named in ``targets`` of decoder layers ``layers``. Returns the adapters' parameters by name. In place;
    the model computes what it did until the adapters are trained."""
    _checks.check_int("rank", rank)
    if alpha is not None:
        _checks.check_positive("alpha", alpha)
    all_layers = decoder_layers(model)
    if isinstance(layers, str) or not isinstance(layers, Sequence) or not layers:
        raise ValueError(f"layers={layers!r}: must be a non-empty list of decoder layer indices")
    for i in layers:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(all_layers):
            raise ValueError(f"layers: index {i!r} must be an int in [0, {len(all_layers)})")
    if isinstance(targets, str) or not targets:
        raise ValueError(f"targets={targets!r}: must be a non-empty tuple of projection names, e.g. {TARGETS}")
    scale = (rank if alpha is None else alpha) / rank
    for i in sorted(set(layers)):
        for name in targets:
            proj = next((m for n, m in all_layers[i].named_modules() if n.split(".")[-1] == name), None)
            if not isinstance(proj, nn.Linear):
                raise ValueError(f"targets: layer {i} has no nn.Linear named {name!r}")
            if hasattr(proj, "lora"):
                raise ValueError(f"layers: layer {i}'s {name} already has a LoRA adapter (merge_lora first)")
            proj.lora = LoRA(proj.in_features, proj.out_features, rank, scale).to(
                device=proj.weight.device, dtype=torch.float32
            )
            set_module_attr(proj, "_mode_lora_hook", proj.register_forward_hook(_add_update))
    return lora_parameters(model)


def lora_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The LoRA adapters' parameters of ``model`` (``...lora.A``, ``...lora.B``) by name."""
    return {n: p for n, p in model.named_parameters() if ".lora.A" in n or ".lora.B" in n}


@torch.no_grad()
def merge_lora(model: nn.Module) -> list[str]:
    """Fold every LoRA adapter of ``model`` into its projection's weight (``W + scale * B @ A``) and remove the
    adapters; returns the merged weights' names, which ``model.mode_conversion["healed"]`` then lists (so
    ``save_conversion`` saves them). The merged model's logits equal the adapted model's up to rounding."""
    merged = []
    for name, module in model.named_modules():
        lora = getattr(module, "lora", None)
        if isinstance(module, nn.Linear) and isinstance(lora, LoRA):
            module.weight += lora.delta().to(module.weight.dtype)
            cast(RemovableHandle, module._mode_lora_hook).remove()
            del module._mode_lora_hook
            del module.lora
            merged.append(f"{name}.weight")
    if not merged:
        raise ValueError("merge_lora: the model has no LoRA adapter (mode.hf.heal with trainable='lora' adds them)")
    mark_healed(model, merged)
    return merged


def mark_healed(model: nn.Module, names: Sequence[str]) -> None:
    """Record base weights changed by healing in ``model.mode_conversion["healed"]`` (sorted, no repeats)."""
    spec = getattr(model, "mode_conversion", None) or {}
    spec["healed"] = sorted(set(spec.get("healed", [])) | set(names))
    set_module_attr(model, "mode_conversion", spec)

"""Which submodules of a model are its "blocks": the units FSDP shards and gathers one at a time, and that
``torch.compile`` compiles one at a time. No ``torch.distributed`` here: the single-process trainer compiles
with it, ``mode.parallel`` shards by it.

The default rule works for the LM and for most hand-written transformers: every child of the model's
outermost ``nn.ModuleList`` / ``nn.ModuleDict`` containers (``model.layers[i]``, ``model.blocks["moe"]``),
if it holds parameters. A model with no such container has no blocks (the root is then one unit).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn


def default_blocks(model: nn.Module) -> list[nn.Module]:
    """The children of the outermost ``ModuleList``/``ModuleDict`` containers of ``model``, in order."""
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                found.extend(c for c in child.children() if any(True for _ in c.parameters()))
            else:
                visit(child)

    visit(model)
    return found


def resolve_blocks(model: nn.Module, blocks: Iterable[nn.Module] | None) -> list[nn.Module]:
    """``blocks`` (submodules of ``model``) checked, or the default rule when None."""
    if blocks is None:
        return default_blocks(model)
    blocks = list(blocks)
    members = {id(m) for m in model.modules()}
    for i, b in enumerate(blocks):
        if not isinstance(b, nn.Module):
            raise TypeError(f"blocks[{i}]={type(b).__name__}: must be an nn.Module")
        if id(b) not in members or b is model:
            raise ValueError(f"blocks[{i}]={type(b).__name__}: must be a submodule of the model (not the model)")
    return blocks


def compile_blocks(model: nn.Module, blocks: Iterable[nn.Module] | None = None) -> list[nn.Module]:
    """``torch.compile`` each block in place (``Module.compile``); returns the blocks. Routing layers break
    the graph where they read counts on the host, so each block compiles into a few graphs."""
    blocks = resolve_blocks(model, blocks)
    for b in blocks or [model]:  # no blocks: the whole model is one compiled unit
        b.compile()
    return blocks

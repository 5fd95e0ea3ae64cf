"""Every transformers model of the named MoE families converted by ``mode.hf.to_mode_moe`` right after it is
built, so that transformers' own model tests (which build ``model_class(config)`` and reload with
``model_class.from_pretrained``) run on converted models, unchanged.

    with converting(["qwen3_moe", "mixtral"]):     # a context manager
        model = Qwen3MoeForCausalLM(config)          # converted
        again = Qwen3MoeForCausalLM.from_pretrained(folder)   # loaded as the family loads it, then converted

    python -m pytest -p tests.hf.convert_on_construct ...    # a pytest plugin: MODE_CONVERT_FAMILIES=a,b,c

What counts as built: the outermost ``__init__`` of a ``PreTrainedModel`` class of the family's modeling module
returns (the base model built inside a causal LM is converted once, with its LM), on any device, the meta
device included. ``from_pretrained`` loads the family's checkpoint into the family's own model, as transformers
does, and converts the loaded model. The family twin that mode's own ``save_pretrained`` builds to write the
family's layout (``mode.hf.moe.saving.transformers_twin``) is left as it is: it is the family's model.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import threading

import torch

_state = threading.local()  # .depth: nested __init__ calls; .loading: inside from_pretrained


def _depth() -> int:
    return getattr(_state, "depth", 0)


def _loading() -> bool:
    return getattr(_state, "loading", 0) > 0


def _convert(model) -> None:
    import mode.hf as mh
    from mode.hf.moe.saving import converted_slots

    if converted_slots(model) or getattr(_state, "twin", 0):
        return
    try:
        mh.to_mode_moe(model)
    except ValueError as e:  # a class without an MoE block (none in these families): stays as built
        if "holds no sparse MoE block" not in str(e):
            raise


def _model_classes(family: str) -> list[type]:
    from transformers import PreTrainedModel

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    return [
        c
        for c in vars(module).values()
        if isinstance(c, type) and issubclass(c, PreTrainedModel) and c.__module__ == module.__name__
    ]


def _wrap_init(cls: type):
    """Wrap ``cls.__init__`` (its own, or the one it inherits: transformers' generic heads define none);
    returns what to restore: the class's own ``__init__``, or None where it had none."""
    own = cls.__dict__.get("__init__")
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        _state.depth = _depth() + 1
        try:
            original(self, *args, **kwargs)
        finally:
            _state.depth -= 1
        if _state.depth == 0 and not _loading():
            _convert(self)

    cls.__init__ = __init__
    return own


@contextlib.contextmanager
def converting(families):
    """Within the block, models of ``families`` (model types) are converted once built or loaded."""
    from transformers import PreTrainedModel

    from mode.hf.moe.saving import mode_names

    saved: list[tuple[object, str, object]] = []  # (owner, attribute, what to put back)
    classes = [c for f in families for c in _model_classes(f)]
    ours = tuple(classes)
    for cls in classes:
        saved.append((cls, "__init__", _wrap_init(cls)))

    loader = PreTrainedModel.__dict__["from_pretrained"]  # a classmethod object

    @functools.wraps(loader.__func__)
    def from_pretrained(cls, *args, **kwargs):
        _state.loading = getattr(_state, "loading", 0) + 1
        try:
            model = loader.__func__(cls, *args, **kwargs)
        finally:
            _state.loading -= 1
        loaded = model[0] if isinstance(model, tuple) else model  # output_loading_info=True: (model, info)
        if not _loading() and isinstance(loaded, ours):
            _convert(loaded)
            if isinstance(model, tuple):  # the report names the tensors as the converted model does
                model[1]["missing_keys"] = set(mode_names(loaded, model[1]["missing_keys"]))
                model[1]["mismatched_keys"] = [
                    (name, *rest) for (key, *rest) in model[1]["mismatched_keys"] for name in mode_names(loaded, [key])
                ]
        return model

    PreTrainedModel.from_pretrained = classmethod(from_pretrained)
    saved.append((PreTrainedModel, "from_pretrained", loader))

    from mode.hf.moe import saving

    twin = saving.transformers_twin

    @functools.wraps(twin)
    def transformers_twin(*args, **kwargs):
        _state.twin = getattr(_state, "twin", 0) + 1
        try:
            return twin(*args, **kwargs)
        finally:
            _state.twin -= 1

    saving.transformers_twin = transformers_twin
    saved.append((saving, "transformers_twin", twin))
    try:
        yield
    finally:
        for cls, name, original in reversed(saved):
            if original is None:
                delattr(cls, name)  # the inherited one shows through again
            else:
                setattr(cls, name, original)


_active = contextlib.ExitStack()


def pytest_configure(config) -> None:
    """As a pytest plugin: convert the families named in ``MODE_CONVERT_FAMILIES`` (comma-separated) for the
    whole session."""
    families = [f for f in os.environ.get("MODE_CONVERT_FAMILIES", "").split(",") if f]
    if families:
        torch.manual_seed(0)
        _active.enter_context(converting(families))


def pytest_unconfigure(config) -> None:
    _active.close()

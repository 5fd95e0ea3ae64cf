"""mode: Mixture-of-Depths, Mixture-of-Experts and MoDE layers for PyTorch.

The package's layers (docs/architecture.md): the library core (``routing``, ``experts``, ``dispatch``,
``layers``, ``model``), ``hf`` beside it, then ``measure``, ``train``, ``parallel`` and ``experiments``, each
importing only those before it; ``cli`` on top.

Importing the package imports no torch: the public names below (``mode.MoD``, ``from mode import MoD``) and the
subpackages (``mode.layers``) load on first use (PEP 562), so that ``mode --help`` answers at once. What the
package used to do on import still happens before anything needs it: ``mode.parallel`` plugs its mesh runtime and
sharded-checkpoint reader into ``mode.train``
as soon as ``mode.train`` is imported (``_PlugParallel`` below), however it is reached.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys

__version__ = "0.1.0"

# public name -> the module that defines it
_PUBLIC = {
    "Aux": "mode.routing",
    "CausalSelfAttention": "mode.layers",
    "Dispatcher": "mode.dispatch",
    "ExpertBank": "mode.experts",
    "ExpertChoiceConfig": "mode.routing",
    "ExpertChoiceRouter": "mode.routing",
    "ExpertConfig": "mode.experts",
    "IntegratedMoDE": "mode.layers",
    "LocalDispatcher": "mode.dispatch",
    "MLP": "mode.layers",
    "MoD": "mode.layers",
    "MoDRouter": "mode.routing",
    "MoDRouterConfig": "mode.routing",
    "MoEConfig": "mode.layers",
    "MoELayer": "mode.layers",
    "RoutingPlan": "mode.routing",
    "RoutingStats": "mode.routing",
    "StagedMoDE": "mode.layers",
    "TokenChoiceConfig": "mode.routing",
    "TokenChoiceRouter": "mode.routing",
    "TransformerBlock": "mode.layers",
}
_SUBPACKAGES = (
    "routing",
    "experts",
    "dispatch",
    "layers",
    "model",
    "hf",
    "measure",
    "train",
    "parallel",
    "experiments",
)

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value  # the next access is a plain attribute
        return value
    if name in _SUBPACKAGES:
        return importlib.import_module(f"mode.{name}")  # the import sets the attribute too
    raise AttributeError(f"module 'mode' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC, *_SUBPACKAGES})


def _register_parallel() -> None:
    import mode.parallel

    mode.parallel.register()


class _ThenRegister(importlib.abc.Loader):
    """The loader of the package ``mode.train``, then ``mode.parallel.register()``."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        _register_parallel()

    def __getattr__(self, name: str):  # get_source, get_resource_reader, ...: the wrapped loader's
        return getattr(self.loader, name)


class _PlugParallel(importlib.abc.MetaPathFinder):
    """``mode.train`` never imports ``mode.parallel`` (the layers); ``mode.parallel`` fills two extension points of
    ``mode.train`` (the mesh runtime, the sharded-checkpoint reader). This finder makes that happen right after
    the package ``mode.train`` loads, however it is imported, without importing either of them before."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "mode.train":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenRegister(spec.loader)
        return spec


if not any(isinstance(f, _PlugParallel) for f in sys.meta_path):
    sys.meta_path.insert(0, _PlugParallel())
if "mode.train" in sys.modules:  # the package re-imported after mode.train (importlib.reload)
    _register_parallel()

"""Old module paths, kept importable for one release after the move to one folder per concern
(docs/architecture.md).

``import mode.checkpoint`` (or ``from mode.distributed import init_distributed``) gives the module at its new
place, the same module object, so attributes, ``isinstance`` checks and monkeypatching behave as before,
with a ``DeprecationWarning`` naming the new path. Nothing here imports a moved module until it is asked for.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

REMOVED_IN = "0.3.0"

MOVED = {
    "mode.flops": "mode.measure.flops",
    "mode.stats": "mode.measure.stats",
    "mode.token_compute": "mode.measure.token_compute",
    "mode.host_sync": "mode.measure.host_sync",
    "mode.data": "mode.train.data",
    "mode.checkpoint": "mode.train.checkpoint",
    "mode.distributed": "mode.parallel.process_group",
    "mode.distributed_stats": "mode.parallel.stats_reduce",
    "mode.parallel.blocks": "mode.model.blocks",
    "mode.compare": "mode.experiments.compare",
    "mode.isoflop": "mode.experiments.isoflop",
    "mode.sweep": "mode.experiments.sweep",
    "mode.run_record": "mode.experiments.run_record",
    "mode.stats_ci": "mode.experiments.stats_ci",
    "mode.report": "mode.experiments.report",
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves an old path to the module at its new one."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; the old path works until mode {REMOVED_IN}", DeprecationWarning,
                      stacklevel=2)
        module = importlib.import_module(new)
        spec.loader_state = module.__spec__  # the import machinery puts the alias's spec on it: restored below
        return module

    def exec_module(self, module) -> None:
        module.__spec__ = module.__spec__.loader_state  # the module stays what it is at its new path


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (``mode/__init__.py`` calls it)."""
    if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())

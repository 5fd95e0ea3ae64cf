"""mkdocs hooks (mkdocs.yml ``hooks:``): the build fails, naming them, when a public name, or a public method or
property of a public class, has no docstring, or a public name no entry in the API reference
(scripts/check_docstrings.py): mkdocstrings itself would render them as nothing."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from mkdocs.exceptions import PluginError

_spec = importlib.util.spec_from_file_location("check_docstrings", Path(__file__).with_name("check_docstrings.py"))
check_docstrings = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_docstrings)


def on_pre_build(config, **kwargs) -> None:
    problems = check_docstrings.missing_docstrings()
    if problems:
        raise PluginError(
            "public names, methods or properties without a docstring, or names without an API entry "
            "(scripts/check_docstrings.py):\n  " + "\n  ".join(problems)
        )

"""Every name ``mode`` exports (``mode.__all__``, what ``from mode import *`` gives) is documented where a user
looks first, ``help(mode.X)``: its own docstring (not one inherited, not the signature a dataclass writes for
itself) says what it computes and names every argument; a module's also has a shape legend, and its
``forward`` says what it returns."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
from torch import nn

import mode


def test_star_import_gives_exactly_all():
    namespace: dict = {}
    exec("from mode import *", namespace)
    assert sorted(k for k in namespace if k != "__builtins__") == sorted(mode.__all__)


def own_doc(obj) -> str:
    """The object's own docstring: ``obj.__doc__`` is inherited by subclasses' instances but not by classes;
    a dataclass without one gets ``Name(field: type, ...)``, which documents nothing."""
    doc = obj.__dict__.get("__doc__") if isinstance(obj, type) else obj.__doc__
    doc = inspect.cleandoc(doc or "")
    if dataclasses.is_dataclass(obj) and doc.startswith(f"{obj.__name__}("):
        return ""
    return doc


def init_arguments(cls: type) -> list[str]:
    params = inspect.signature(cls).parameters.values()
    return [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and not p.name.startswith("_")]


@pytest.mark.parametrize("name", mode.__all__)
def test_every_exported_name_has_a_real_docstring(name):
    obj = getattr(mode, name)
    doc = own_doc(obj)
    assert len(doc.split()) >= 25, f"mode.{name}: its docstring says too little ({len(doc.split())} words): {doc!r}"
    if not isinstance(obj, type):
        return
    undocumented = [a for a in init_arguments(obj) if a not in doc]
    assert not undocumented, f"mode.{name}: the docstring does not name the arguments {undocumented}"
    if issubclass(obj, nn.Module):
        assert "Shape legend" in doc, f"mode.{name}: a module's docstring needs a shape legend"
        assert "Args:" in doc, f"mode.{name}: a module's docstring lists its arguments under 'Args:'"
        forward = inspect.cleandoc(obj.forward.__doc__ or "")
        assert "Returns" in forward and len(forward.split()) >= 15, (
            f"mode.{name}.forward: its docstring must say what it returns: {forward!r}"
        )
        params = [p for p in inspect.signature(obj.forward).parameters if p != "self"]
        assert all(p in forward for p in params), f"mode.{name}.forward: name every argument ({params})"


def test_the_version_is_written_once_and_is_the_installed_metadata():
    """``mode.__version__`` is the one place (pyproject.toml reads it as a dynamic attribute); an installed
    distribution reports the same version."""
    import re
    from importlib import metadata
    from pathlib import Path

    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    project = pyproject[pyproject.index("[project]") : pyproject.index("\n[", pyproject.index("[project]"))]
    assert not re.search(r"^version\s*=", project, re.M), "pyproject.toml: the version lives in mode.__version__"
    assert re.search(r'^dynamic = \[[^]]*"version"', project, re.M)
    assert re.search(r'^version = \{ attr = "mode\.__version__" \}', pyproject, re.M)
    assert re.fullmatch(r"\d+\.\d+\.\d+(?:\.?(?:a|b|rc|dev|post)\d+)*", mode.__version__)
    try:
        installed = metadata.version("mode-torch")
    except metadata.PackageNotFoundError:
        pytest.skip("mode-torch is not installed (pip install -e .)")
    assert installed == mode.__version__


def test_every_public_name_of_the_four_packages_has_a_docstring_and_an_api_entry():
    """scripts/check_docstrings.py (also run by ``mkdocs build``): mode, mode.hf, mode.parallel, mode.train, and
    the public methods and properties of their public classes."""
    pytest.importorskip("griffe", reason="the docs extra reads the source with griffe: pip install -e '.[docs]'")
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "check_docstrings.py"
    spec = importlib.util.spec_from_file_location("check_docstrings", path)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    assert set(check.public_names("mode")) == set(mode.__all__)
    assert not check.missing_docstrings(), "\n".join(check.missing_docstrings())

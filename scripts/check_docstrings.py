"""Every public name of ``mode``, ``mode.hf``, ``mode.parallel`` and ``mode.train`` has a docstring, and the API
reference (``docs/api/*.md``) shows it; so does every public method and property of a public class.

A public name is one in its package's ``__all__``; a public member, one whose name does not start with ``_``.
mkdocstrings renders a missing docstring as nothing, without a warning, so this check is what fails:
``mkdocs build`` runs it first (``scripts/mkdocs_hooks.py``), and it runs alone as

    python scripts/check_docstrings.py            # exit status 1 and one line per missing docstring or API entry
    python scripts/check_docstrings.py --members  # the same, for the public methods and properties only

It reads the source as mkdocstrings does (griffe, statically): it imports neither torch nor ``mode``, so it
runs in a second, before anything heavy is installed.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mode", "mode.hf", "mode.parallel", "mode.train")
API_PAGES = ROOT / "docs" / "api"
# The dict a lazy package (PEP 562 __getattr__) loads its public names from: name -> defining module.
LAZY_TABLES = ("_PUBLIC", "_LAZY")


def public_names(package: str) -> dict[str, str]:
    """``package``'s ``__all__``, each name with the module griffe finds it in (the package itself, or for a
    lazy package the module its table names), read from ``__init__.py`` without importing it."""
    tree = ast.parse((ROOT / package.replace(".", "/") / "__init__.py").read_text())
    tables: dict[str, dict[str, str]] = {}
    names: list[str] | None = None
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            continue
        target = node.targets[0].id
        if target in LAZY_TABLES:
            tables[target] = ast.literal_eval(node.value)
        elif target == "__all__":
            value = node.value
            if (
                isinstance(value, ast.Call)
                and isinstance(value.func, ast.Name)
                and value.func.id == "sorted"
                and isinstance(value.args[0], ast.Name)
            ):
                names = sorted(tables[value.args[0].id])  # __all__ = sorted(_PUBLIC)
            else:
                names = list(ast.literal_eval(value))
    if names is None:
        raise SystemExit(f"{package}: no __all__ that this check can read in its __init__.py")
    lazy = {name: module for table in tables.values() for name, module in table.items()}
    return {name: lazy.get(name, package) for name in names}


def missing_docstrings(names: bool = True, members: bool = True) -> list[str]:
    """One line per problem: with ``names``, each public name without a docstring and each that no API page
    renders; with ``members``, each public method and property of a public class without a docstring."""
    import griffe

    loader = griffe.GriffeLoader(search_paths=[str(ROOT)], docstring_parser=None)
    loader.load("mode")
    loader.resolve_aliases(implicit=False, external=False)
    root = loader.modules_collection["mode"]
    rendered = set(re.findall(r"^::: ([\w.]+)", "\n".join(p.read_text() for p in API_PAGES.glob("*.md")), re.M))

    problems = []
    for package in PACKAGES:
        for name, module in public_names(package).items():
            path = f"{module}.{name}"
            try:
                obj = root[path.removeprefix("mode.")]
                obj = obj.final_target if obj.is_alias else obj
            except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError) as e:
                problems.append(f"{package}.{name}: griffe cannot find {path} ({type(e).__name__})")
                continue
            where = f"{obj.relative_filepath}:{obj.lineno}"
            if names and not (obj.docstring and obj.docstring.value.strip()):
                problems.append(f"{package}.{name} ({where}): no docstring")
            if members and obj.is_class:
                for member in obj.members.values():
                    member = member.final_target if member.is_alias else member
                    if member.name.startswith("_") or not (member.is_function or "property" in member.labels):
                        continue
                    if not (member.docstring and member.docstring.value.strip()):
                        problems.append(
                            f"{package}.{name}.{member.name} ({member.relative_filepath}:{member.lineno}): no docstring"
                        )
            if names and path not in rendered:
                problems.append(f"{package}.{name}: no '::: {path}' in docs/api/*.md, so the reference lacks it")
    return problems


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    problems = missing_docstrings(names="--members" not in argv)
    for line in problems:
        print(line, file=sys.stderr)
    if problems:
        print(
            f"{len(problems)} public names, methods or properties without a docstring, or names without an API "
            "entry (scripts/check_docstrings.py)",
            file=sys.stderr,
        )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

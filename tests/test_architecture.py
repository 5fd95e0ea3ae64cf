"""The package's layers (docs/architecture.md), read from the source with ``ast``: every import of a
``mode`` module, at the top of a file or inside a function, goes down the layers, never up, and no import
circle exists, lazy or not."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "mode"

# The core's own order: a core module imports its own subpackage or the ones before it.
CORE = {
    "_cache": 0,
    "_checks": 0,
    "_module_attr": 0,
    "cpu_allocator": 0,
    "kernels": 0,
    "routing": 1,
    "experts": 1,
    "dispatch": 2,
    "layers": 3,
    "model": 4,
}
# What each layer may import (besides itself); "top" (the package facade and cli) may
# import anything.
MAY_IMPORT = {
    "core": {"core"},
    "hf": {"core", "measure", "train", "parallel"},
    "measure": {"core"},
    "train": {"core", "measure"},
    "parallel": {"core", "measure", "train"},
    "experiments": {"core", "hf", "measure", "train", "parallel"},
}
TOP = {"mode", "mode.__main__", "mode.cli"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def layer(name: str) -> str:
    if name in TOP:
        return "top"
    first = name.split(".")[1]
    return "core" if first in CORE else first


def imports(path: Path, known: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported mode module, line) for every import in the file, lazy ones included. ``from P import n``
    counts as importing ``P.n`` when that is a module, else ``P``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "mode"]
        elif isinstance(node, ast.ImportFrom):
            # the package imports absolutely, so that every import names its layer
            assert node.level == 0, f"{path}:{node.lineno}: a relative import; import mode.* absolutely"
            base = node.module
            if base.split(".")[0] != "mode":
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((sub if sub in known else base, node.lineno))
    return out


def graph() -> dict[str, list[tuple[str, int]]]:
    known = modules()
    return {name: imports(path, known) for name, path in known.items()}


def test_every_module_has_a_layer():
    layers = {layer(n) for n in modules()}
    assert layers <= set(MAY_IMPORT) | {"top"}, f"modules outside the known layers: {layers - set(MAY_IMPORT)}"


def violations(graph: dict[str, list[tuple[str, int]]]) -> list[str]:
    bad = []
    for name, edges in graph.items():
        src = layer(name)
        for target, line in edges:
            dst = layer(target)
            if src == "top" or target == name:
                continue
            if dst == "top":
                bad.append(f"{name}:{line} imports {target} (the package facade / cli: nothing below imports them)")
            elif src == "core" and dst == "core":
                a, b = name.split(".")[1], target.split(".")[1]
                if a != b and CORE[b] >= CORE[a] and CORE[b] > 0:
                    bad.append(f"{name}:{line} imports {target} (core order: {b} does not come before {a})")
            elif dst != src and dst not in MAY_IMPORT[src]:
                bad.append(f"{name}:{line} imports {target} ({src}/ may import {sorted(MAY_IMPORT[src])} only)")
    return bad


def test_imports_go_down_the_layers():
    bad = violations(graph())
    assert not bad, "imports against the layer rules (docs/architecture.md):\n" + "\n".join(bad)


def hf_against_direction(graph: dict[str, list[tuple[str, int]]]) -> list[str]:
    """Inside ``hf/``, ``moe/`` (adopted MoE models) builds on ``dense/`` (converted dense decoders), never the
    other way (docs/architecture.md)."""
    return [
        f"{name}:{line} imports {target} (mode.hf.dense may not import mode.hf.moe)"
        for name, edges in graph.items()
        if name.startswith("mode.hf.dense")
        for target, line in edges
        if target.startswith("mode.hf.moe")
    ]


def test_hf_dense_does_not_import_hf_moe():
    g = graph()
    assert any(n.startswith("mode.hf.dense.") for n in g) and any(n.startswith("mode.hf.moe.") for n in g)
    bad = hf_against_direction(g)
    assert not bad, "\n".join(bad)
    assert hf_against_direction(
        {"mode.hf.dense.tune": [("mode.hf.moe.convert", 3)], "mode.hf.moe.convert": [("mode.hf.dense.routing", 1)]}
    ) == ["mode.hf.dense.tune:3 imports mode.hf.moe.convert (mode.hf.dense may not import mode.hf.moe)"]


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles_lazy_or_not():
    edges = {name: {t for t, _ in e if t != name} for name, e in graph().items()}
    assert not _cycles(edges), f"import circles: {_cycles(edges)}"


def test_the_checks_can_fail():
    """The rules catch what they claim to: upward imports (lazy ones too), core order, circles."""
    lazy = "def f():\n    from mode.parallel.runtime import MeshRuntime\n"
    found = [n.module for n in ast.walk(ast.parse(lazy)) if isinstance(n, ast.ImportFrom)]
    assert found == ["mode.parallel.runtime"]  # ast.walk sees imports inside functions
    assert (
        len(
            violations(
                {
                    "mode.train.trainer": [("mode.parallel.runtime", 3)],
                    "mode.measure.stats": [("mode.parallel.stats_reduce", 9)],
                    "mode.routing.plan": [("mode.layers.moe", 1)],
                    "mode.layers.moe": [("mode.cli", 2)],
                    "mode.hf.dense.convert": [("mode.experiments.compare", 4)],
                }
            )
        )
        == 5
    )
    assert not violations(
        {
            "mode.parallel.runtime": [("mode.train.trainer", 1)],
            "mode.layers.moe": [("mode.routing.plan", 1), ("mode._checks", 2)],
            "mode.cli": [("mode.experiments.compare", 1)],
        }
    )
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]

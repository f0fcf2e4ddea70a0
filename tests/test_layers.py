"""The layers of docs/architecture.md §0, checked on the source: no import circle among our own modules, and
every import goes down the layer order format ← plan ← cache ← loader ← integrations ← cli
(pack on format and plan; benchmarks on top).

Static analysis, not import: every ``import``/``from … import`` statement of every module under
``shardtool/`` (the folders ``loader/``, ``cache/`` and ``benchmarks/`` through their links) is
parsed with `ast` — those inside functions too, since a lazy import is still an edge the day it
runs — and resolved to the module it names (``from .x import y`` is the module ``x.y`` when
that is a file, else ``x``). A circle is a strongly connected component of that graph with more
than one module (or a module importing itself). A package's ``__init__`` re-exporting its
submodules is an edge like any other; importing ``a.b.c`` is an edge to ``a.b.c`` only, not to
the packages above it (Python runs their ``__init__`` first, but they are what re-exports it).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = "shardtool"

# The shardtool packages each layer may import (itself included). The order, bottom up:
# format ← plan ← (pack) ← cache ← loader ← integrations, cli; benchmarks beside cli.
LAYERS = {
    "format": {"format"},
    "plan": {"format", "plan"},
    "pack": {"format", "plan", "pack"},
    "cache": {"format", "plan", "cache"},
    "loader": {"format", "plan", "cache", "loader"},
    "integrations": {"format", "plan", "cache", "loader", "integrations"},
    "cli": {"format", "plan", "pack", "cache", "loader", "cli", "benchmarks"},
    # The tools on top: ``shardtool bench`` runs the benchmarks, and a benchmark may time the CLI's
    # own code (benchmarks.mixture_throughput reads peak memory as ``shardtool plan`` does). Neither
    # is imported by a library layer; the circle check keeps the two apart module by module.
    "benchmarks": {"format", "plan", "pack", "cache", "loader", "cli", "benchmarks"},
}
# shardtool/__init__.py and __main__.py: the format's names, pack() (lazily), the CLI.
TOP = {"format", "pack", "cli"}


def project_modules(repo: str = REPO) -> dict[str, str]:
    """Every module of the package: dotted name -> file (the symlinked folders followed)."""
    modules = {}
    base = os.path.join(repo, ROOT)
    for folder, dirs, files in os.walk(base, followlinks=True):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        rel = os.path.relpath(folder, base)
        package = ROOT if rel == "." else ROOT + "." + rel.replace(os.sep, ".")
        for name in files:
            if name.endswith(".py"):
                stem = name[:-3]
                modules[package if stem == "__init__" else f"{package}.{stem}"] = os.path.join(folder, name)
    return modules


def _imported(module: str, path: str, modules: dict[str, str]) -> set[str]:
    """Our modules that ``module`` (at ``path``) imports, anywhere in its body."""
    is_package = os.path.basename(path) == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    found = set()

    def add(name: str) -> None:
        # The longest prefix of ``name`` that is one of our modules ("a.b.Name" -> "a.b").
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name:
            found.add(name)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                if node.level - 1 >= len(parts):
                    raise ValueError(f"{path}:{node.lineno}: relative import above the package root")
                base = ".".join(parts[: len(parts) - (node.level - 1)])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            for alias in node.names:
                add(f"{target}.{alias.name}")  # a submodule if it is one, else the module itself
    return found


def import_graph(repo: str = REPO) -> dict[str, set[str]]:
    modules = project_modules(repo)
    return {m: _imported(m, p, modules) for m, p in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: strongly connected components (Tarjan, iterative) of more than one
    module, or of one module that imports itself; each sorted, the list sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1 or node in graph.get(node, ()):
                        found.append(sorted(component))
    return sorted(found)


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def test_the_graph_sees_the_whole_package():
    graph = import_graph()
    # Nested packages and the linked folders are walked (a flat listing would miss them).
    assert "shardtool.plan.mixture.config" in graph and "shardtool.loader.observability.observe" in graph
    assert "shardtool.cache.warmer" in graph and "shardtool.benchmarks.plan_scale" in graph
    # Relative, absolute, lazy and "from package import submodule" imports are all edges.
    assert "shardtool.plan.batching" in graph["shardtool.plan.mixture.config"]
    assert "shardtool.loader.errors" in graph["shardtool.loader.observability.observe"]
    assert "shardtool.loader.tokenfields" in graph["shardtool.loader.epochs"]  # from . import tokenfields


def test_the_circle_finder_finds_circles():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"a"}, "b": set()}) == [["a"]]
    assert circles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []
    assert circles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c", "a"}}) == [["a", "b"], ["c", "d"]]


def test_no_import_circle_among_our_modules():
    found = circles(import_graph())
    assert not found, "import circles (each file must import only downward): " + "; ".join(
        " <-> ".join(c) for c in found
    )


def test_imports_go_down_the_layers():
    bad = []
    for module, imported in sorted(import_graph().items()):
        layer = _layer(module)
        allowed = LAYERS[layer] if layer else TOP
        for target in sorted(imported):
            target_layer = _layer(target)
            if target_layer is not None and target_layer not in allowed:
                bad.append(f"{module} ({layer or 'shardtool'}) imports {target} ({target_layer})")
            elif target_layer is None and target != ROOT and layer is not None:
                bad.append(f"{module} imports {target}, outside the layers")
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_no_module_imports_a_top_level_loader_cache_or_benchmarks():
    # The folders are packages of shardtool only (docs/architecture.md §0): ``import loader`` would find a
    # training repo's own loader.py, or nothing once installed.
    bad = []
    for module, path in sorted(project_modules().items()):
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            bad += [
                f"{module}:{node.lineno} {n}" for n in names if n.split(".")[0] in ("loader", "cache", "benchmarks")
            ]
    assert not bad, f"top-level imports of the repository's folders: {bad}"


@pytest.mark.parametrize("layer", ["format", "plan"])
def test_the_pure_layers_never_import_torch(layer):
    # Statically, lazy imports included: ``import shardtool.plan`` importing no torch (below) is
    # the runtime half; this is the "not even in a function" half.
    modules = project_modules()
    bad = []
    for module, path in sorted(modules.items()):
        if _layer(module) == layer:
            for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom) and not node.level
                    else []
                )
                bad += [f"{module}:{node.lineno}" for n in names if n.split(".")[0] == "torch"]
    assert not bad, f"torch imported in shardtool.{layer}: {bad}"


def test_importing_the_planner_imports_no_torch():
    code = "import sys, shardtool.plan; assert 'torch' not in sys.modules, sorted(sys.modules)"
    res = subprocess.run(
        [sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr

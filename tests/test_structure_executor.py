"""The executor's shape, from its source: no import circle, no large class, every module says
what it owns.

The import graph is read with ``ast`` from every module of ``kvplan_nixl``, counting every
import a reader must follow: module level, inside functions, and under ``TYPE_CHECKING``.
``from package import name`` is an edge to the submodule when ``name`` is one, else to the
package.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "kvplan_nixl"
MAX_CLASS_LINES = 300


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _trees() -> dict[str, ast.Module]:
    return {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


TREES = _trees()


def _imports(name: str, tree: ast.Module) -> set[str]:
    """The kvplan_nixl modules ``name`` imports, anywhere in its source."""
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                       for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in MODULES and t != name)
    return out


GRAPH = {name: _imports(name, tree) for name, tree in TREES.items()}


def _cycle() -> list[str] | None:
    """One import circle of GRAPH, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(GRAPH[n]):
            if state.get(m) == 1:
                return [*path[path.index(m):], m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        path.pop()
        state[n] = 2
        return None

    for n in sorted(GRAPH):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_the_graph_sees_function_level_and_type_checking_imports():
    # the staged executor imports the endpoint; parts is imported by the endpoint only
    assert "kvplan_nixl.endpoint" in GRAPH["kvplan_nixl.staged.stager"]
    assert "kvplan_nixl.parts" in GRAPH["kvplan_nixl.endpoint"]
    assert "kvplan_nixl.endpoint" in GRAPH["kvplan_nixl"]  # under TYPE_CHECKING
    assert "kvplan_nixl.endpoint" in GRAPH["kvplan_nixl.cli"]  # inside a function


def test_no_import_circle_in_the_executor():
    cycle = _cycle()
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_no_class_over_300_lines():
    big = [
        f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for name, tree in TREES.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES
    ]
    assert not big, big


def test_every_module_has_a_docstring():
    missing = [name for name, tree in TREES.items() if not ast.get_docstring(tree)]
    assert not missing, missing


def test_lower_rooms_do_not_reach_up_to_the_facades():
    # what the facades compose may not import them (the seams the next changes build on)
    below_endpoint = ["handles", "peers", "routes", "handshake", "notifications", "posting",
                      "envelope",
                      "parts", "transfer", "metadata", "descriptors", "buffers", "errors"]
    for low in below_endpoint:
        assert "kvplan_nixl.endpoint" not in GRAPH[f"kvplan_nixl.{low}"], low
    for name, deps in GRAPH.items():
        if name.startswith("kvplan_nixl.staged.") and name != "kvplan_nixl.staged.stager":
            assert "kvplan_nixl.staged.stager" not in deps, name
    assert not any(d.startswith("kvplan_nixl.staged") for low in below_endpoint
                   for d in GRAPH[f"kvplan_nixl.{low}"])

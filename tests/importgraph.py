"""The import graph of the repo's packages, read from the source (AST), not from a running
interpreter: every ``import`` statement counts wherever it is (module level or inside a
function), because a lazy import still ties a reader of one file to another. Imports under
``if TYPE_CHECKING:`` are left out unless asked for (``typing=True``): they never run and only
name types for annotations.

Used by tests/test_structure.py and tests/test_structure_executor.py.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parents[1]


@attrs.frozen
class Import:
    """One import statement of ``source``: the module it names (resolved to the deepest module
    that exists in the repo when it is one of ours) and where it sits."""

    source: str
    target: str
    line: int
    lazy: bool  # inside a function
    guarded: bool  # inside ``try:`` whose handlers catch ImportError (an optional import)
    #: the qualified name of the function it sits in (``EngineSpec.to_pandas``), "" at module
    #: level: lets a check allow a lazy import in one named method and nowhere else
    function: str = ""
    #: under ``if TYPE_CHECKING:`` (read only with ``typing=True``): never run, but a reader
    #: follows it all the same, so a check may count it and say where it is
    checking: bool = False

    def where(self) -> str:
        """``kvplan.spec:299 (lazily, in EngineSpec.from_hf_config)``: the source, line and
        how the import is reached, for a check's message."""
        how = [w for w, on in (("under TYPE_CHECKING", self.checking),
                               (f"lazily, in {self.function}", self.lazy)) if on]
        return f"{self.source}:{self.line}" + (f" ({', '.join(how)})" if how else "")


def modules(package: str, root: Path = ROOT) -> dict[str, Path]:
    """``{dotted name: file}`` of every module of ``package`` (``pkg/__init__.py`` is ``pkg``)."""
    out = {}
    for path in sorted((root / package.replace(".", "/")).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _catches_import_error(node: ast.Try) -> bool:
    names = set()
    for h in node.handlers:
        for t in (h.type.elts if isinstance(h.type, ast.Tuple) else [h.type]):
            if isinstance(t, ast.Name):
                names.add(t.id)
    return bool(names & {"ImportError", "ModuleNotFoundError"})


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _walk(node: ast.AST, lazy: bool, guarded: bool, typing: bool = False, where: str = "",
          checking: bool = False):
    """Yield ``(import node, lazy, guarded, function, checking)`` under ``node``; TYPE_CHECKING
    blocks only where ``typing`` (a reader follows them; the interpreter never runs them)."""
    for child in ast.iter_child_nodes(node):
        yield from _walk_one(child, lazy, guarded, typing, where, checking)


def _walk_one(node: ast.AST, lazy: bool, guarded: bool, typing: bool = False, where: str = "",
              checking: bool = False):
    if isinstance(node, ast.If) and _is_type_checking(node):
        if typing:
            for n in node.body:
                yield from _walk_one(n, lazy, guarded, typing, where, True)
        for n in node.orelse:
            yield from _walk_one(n, lazy, guarded, typing, where, checking)
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node, lazy, guarded, where, checking
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        inner = f"{where}.{node.name}" if where else node.name
        is_def = not isinstance(node, ast.ClassDef)
        yield from _walk(node, lazy or is_def, guarded, typing, inner, checking)
    elif isinstance(node, ast.Lambda):
        yield from _walk(node, True, guarded, typing, f"{where}.<lambda>" if where else "<lambda>",
                         checking)
    elif isinstance(node, ast.Try):
        optional = _catches_import_error(node)
        for n in node.body:
            yield from _walk_one(n, lazy, guarded or optional, typing, where, checking)
        for n in [*node.handlers, *node.orelse, *node.finalbody]:
            yield from _walk_one(n, lazy, guarded, typing, where, checking)
    else:
        yield from _walk(node, lazy, guarded, typing, where, checking)


def _resolve(name: str, known: Iterable[str]) -> str:
    """The longest prefix of ``name`` that is one of ``known`` (else ``name`` itself)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in known:
            return ".".join(parts[:n])
    return name


def imports_of(module: str, path: Path, known: set[str], typing: bool = False) -> list[Import]:
    """Every import of one module, targets resolved against ``known`` module names (those
    under ``if TYPE_CHECKING:`` too where ``typing``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node, lazy, guarded, where, checking in _walk(tree, False, False, typing):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:  # relative: from . import x / from .m import y
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from pkg import sub`` imports the submodule pkg.sub when there is one
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                     for a in node.names]
        for name in dict.fromkeys(names):
            out.append(Import(module, _resolve(name, known), node.lineno, lazy, guarded, where,
                              checking))
    return out


def graph(*packages: str, root: Path = ROOT, typing: bool = False) -> dict[str, list[Import]]:
    """``{module: its imports}`` over every module of ``packages`` (with ``typing``, the
    imports under ``if TYPE_CHECKING:`` too)."""
    files = {m: p for pkg in packages for m, p in modules(pkg, root).items()}
    known = set(files)
    return {m: imports_of(m, p, known, typing) for m, p in files.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (or a self-import):
    each is an import circle. Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1 or v in edges.get(v, ()):
                        out.append(sorted(comp))
    return out


def reachable(edges: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every module reachable from ``start``, each with the module that first imported it."""
    seen = {start: ""}
    todo = [start]
    while todo:
        v = todo.pop()
        for w in sorted(edges.get(v, ())):
            if w not in seen:
                seen[w] = v
                todo.append(w)
    return seen


def classes(package: str, root: Path = ROOT) -> list[tuple[str, str, int]]:
    """``(module, class name, lines)`` of every class (nested ones too) of ``package``."""
    out = []
    for m, path in modules(package, root).items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                out.append((m, node.name, node.end_lineno - node.lineno + 1))
    return out

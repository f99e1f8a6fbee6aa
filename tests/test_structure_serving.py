"""The engine-neutral room's promise, from its source and from an interpreter: nothing in
``kvplan_nixl.serving`` imports vLLM or torch, at any level, so a connector for another engine
(and a test without vLLM's venv) builds on the connector's lifecycle (loads, pulls, pushes, a
rank's state, the hold protocol) as it is.

Two checks, because each misses what the other sees: the source (AST) finds an import that no
test happens to run (inside a function, under ``TYPE_CHECKING``, ``importlib``), and the
interpreter finds one reached another way (through a module of the executor the room imports).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap

from tests import importgraph as ig

SERVING = "kvplan_nixl.serving"
#: the engines the room may not name (their top-level packages)
ENGINES = ("vllm", "torch")


def _engine_imports(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, module)`` of every import of an engine anywhere in ``tree``: ``import``,
    ``from ... import`` (at module level, in a function, under ``TYPE_CHECKING``, in ``try``)
    and ``importlib.import_module`` / ``__import__`` of a literal name."""
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            f = node.func
            called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                names = [node.args[0].value]
        found += [(node.lineno, n) for n in names if n.split(".")[0] in ENGINES]
    return found


def test_the_source_check_sees_every_kind_of_import():
    src = textwrap.dedent("""
        import os, torch.nn
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from vllm.config import VllmConfig
        def f():
            import importlib
            return importlib.import_module("vllm.logger"), __import__("torch")
        try:
            from vllm import envs
        except ImportError:
            envs = None
        from kvplan_nixl.serving import pulls
        from .pulls import vllm
    """)
    assert [n for _, n in _engine_imports(ast.parse(src))] == [
        "torch.nn", "vllm.config", "vllm", "vllm.logger", "torch"]


def test_no_serving_module_imports_an_engine_in_its_source():
    mods = ig.modules(SERVING)
    assert "kvplan_nixl.serving.pulls" in mods and len(mods) > 20, sorted(mods)
    found = [f"{m}:{line} imports {name}" for m, path in mods.items()
             for line, name in _engine_imports(ast.parse(path.read_text(encoding="utf-8")))]
    assert not found, found


#: imports the room and each of its modules with vLLM and torch made unimportable (a None in
#: sys.modules makes ``import vllm`` raise ImportError, whatever is installed), then checks that
#: neither was imported on the way
BLOCKED = """
import importlib, sys
for name in {engines!r}:
    sys.modules[name] = None
importlib.import_module({package!r})
for m in {modules!r}:
    importlib.import_module(m)
loaded = sorted(k for k, v in sys.modules.items()
                if v is not None and k.split(".")[0] in {engines!r})
assert not loaded, loaded
print("imported", len({modules!r}))
"""


def test_every_serving_module_imports_with_vllm_and_torch_blocked():
    mods = sorted(ig.modules(SERVING))
    script = BLOCKED.format(engines=ENGINES, package=SERVING, modules=mods)
    run = subprocess.run([sys.executable, "-c", script], cwd=ig.ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.split() == ["imported", str(len(mods))], run.stdout

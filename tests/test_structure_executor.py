"""The executor's shape, from its source: no import circle, no large class, every module says
what it owns, and the rooms below the facades never reach up to them.

The graph (tests/importgraph.py) counts every import a reader must follow: module level,
inside functions, and here also under ``TYPE_CHECKING`` (a circle through type hints still
ties two files together for a reader).
"""

from __future__ import annotations

import ast

from tests import importgraph as ig

MAX_CLASS_LINES = 300
GRAPH = {m: {i.target for i in imps if i.target.startswith("kvplan_nixl") and i.target != m}
         for m, imps in ig.graph("kvplan_nixl", typing=True).items()}


def test_the_graph_sees_function_level_and_type_checking_imports():
    # the staged executor imports the endpoint; parts is imported by the endpoint only
    assert "kvplan_nixl.endpoint" in GRAPH["kvplan_nixl.staged.stager"]
    assert "kvplan_nixl.parts" in GRAPH["kvplan_nixl.endpoint"]
    assert "kvplan_nixl.endpoint" in GRAPH["kvplan_nixl"]  # under TYPE_CHECKING
    assert "kvplan_nixl.endpoint" in GRAPH["kvplan_nixl.cli"]  # inside a function


def test_no_import_circle_in_the_executor():
    assert ig.cycles(GRAPH) == []


def test_no_class_over_300_lines():
    big = [f"{m}.{name}: {n} lines" for m, name, n in ig.classes("kvplan_nixl")
           if n > MAX_CLASS_LINES]
    assert not big, big


def test_every_module_has_a_docstring():
    missing = [m for m, path in ig.modules("kvplan_nixl").items()
               if not ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))]
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


SERVING, VLLM = "kvplan_nixl.serving", "kvplan_nixl.vllm"
#: the top-level modules nothing in the executor imports: its entry points
EXECUTOR_ROOTS = {"kvplan_nixl", "kvplan_nixl.cli"}


def _room(module: str) -> str:
    return ("vllm" if module == VLLM or module.startswith(VLLM + ".") else
            "serving" if module == SERVING or module.startswith(SERVING + ".") else "executor")


def test_the_three_rooms_import_one_way():
    """executor <- serving <- vllm (docs/design.md): the executor names neither room above it,
    and the serving protocol never names the vLLM connector."""
    rank = {"executor": 0, "serving": 1, "vllm": 2}
    up = [f"{m} -> {d}" for m, deps in GRAPH.items() for d in deps
          if rank[_room(d)] > rank[_room(m)]]
    assert not up, up


def test_the_serving_protocol_imports_no_engine():
    """A connector for another engine builds on kvplan_nixl.serving: nothing there may import
    vLLM or torch (or the vLLM connector's own messaging stack)."""
    engines = {"vllm", "torch", "zmq", "msgspec"}
    found = [f"{m} imports {i.target}" for m, imps in ig.graph("kvplan_nixl", typing=True).items()
             if _room(m) == "serving" for i in imps if i.target.split(".")[0] in engines]
    assert not found, found


def test_the_executor_holds_only_what_the_executor_uses():
    """A top-level module that only the rooms above import belongs in one of them (the flat
    folder where the vLLM connector's parts sat beside the executor's is gone)."""
    used = {d for m, deps in GRAPH.items() if _room(m) == "executor" for d in deps}
    stray = [m for m in GRAPH if _room(m) == "executor" and m not in used | EXECUTOR_ROOTS]
    assert not stray, stray

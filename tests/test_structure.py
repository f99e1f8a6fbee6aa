"""The shape of the code, checked: the core in layers that import one way, no import circle,
no NIXL or torch under the core (even transitively), no class over 300 lines, and the offline
``kvplan`` commands running in a bare venv that has neither NIXL nor torch.

The import graph is read from the source (tests/importgraph.py): lazy imports inside functions
count, since they tie a reader of one file to another just the same.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests import importgraph as ig

ROOT = ig.ROOT

#: The core's layers (docs/design.md draws them): a module imports only its own layer and the
#: layers below. A new module must be placed here, which is the point.
#:
#:   0  errors, hooks                       nothing from kvplan
#:   1  spec*, placement, layout, runs, compat   the values: engines, regions, layouts
#:   2  planner, allocations                the handshake: maps, lanes, templates
#:   3  plan                                the request: block ids -> runs
#:   4  views, staging, simulate, hf, presets, examples, strategies   built on plans
#:   5  kvplan (the package's __init__)     the public names
#:   6  kvplan.cli                          the command line, on the public names
LAYERS = {
    "kvplan.errors": 0,
    "kvplan.hooks": 0,
    "kvplan.spec": 1,
    "kvplan.regions": 1,
    "kvplan.engine_derive": 1,
    "kvplan.placement": 1,
    "kvplan.layout": 1,
    "kvplan.runs": 1,
    "kvplan.compat": 1,
    "kvplan.cp": 1,
    "kvplan.granules": 1,
    "kvplan.regroup": 1,
    "kvplan.planner": 2,
    "kvplan.allocations": 2,
    "kvplan.plan": 3,
    "kvplan.views": 4,
    "kvplan.staging": 4,
    "kvplan.simulate": 4,
    "kvplan.hf": 4,
    "kvplan.presets": 4,
    "kvplan.examples": 4,
    "kvplan.strategies": 4,
    "kvplan.adapters": 4,
    "kvplan.adapters.vllm": 4,
    "kvplan.cli": 6,
    "kvplan.cli.__main__": 6,
    "kvplan.cli.command": 6,
    "kvplan.cli.engines": 6,
    "kvplan.cli.explain": 6,
    "kvplan.cli.cliargs": 6,
    "kvplan.cli.progress": 6,
    "kvplan": 5,
}

#: The one import from the core into the NIXL package: the CLI's plug-in hook, which must sit
#: in ``try: ... except ImportError`` (kvplan.cli.command._plugins).
PLUGIN_HOOK = ("kvplan.cli.command", "kvplan_nixl.cli")
FORBIDDEN = ("kvplan_nixl", "nixl", "nixl_cu12", "nixl_cu13", "torch")
MAX_CLASS_LINES = 300

GRAPH = ig.graph("kvplan", "kvplan_nixl")
CORE = sorted(m for m in GRAPH if m.split(".")[0] == "kvplan")


def _core_edges() -> dict[str, set[str]]:
    return {m: {i.target for i in GRAPH[m] if i.target in LAYERS} for m in CORE}


def test_every_core_module_has_a_layer():
    assert sorted(set(CORE) - set(LAYERS)) == [], "place the new module in LAYERS (and design.md)"
    assert sorted(set(LAYERS) - set(CORE)) == [], "LAYERS names a module that is gone"


def test_no_import_circle_in_the_core():
    assert ig.cycles(_core_edges()) == []


def test_no_layer_imports_a_higher_one():
    bad = [
        f"{i.source} (layer {LAYERS[i.source]}) line {i.line} imports {i.target} "
        f"(layer {LAYERS[i.target]}){' lazily' if i.lazy else ''}"
        for m in CORE for i in GRAPH[m]
        if i.target in LAYERS and LAYERS[i.target] > LAYERS[m]
    ]
    assert bad == []


def test_the_core_imports_no_nixl_torch_or_executor_but_the_plugin_hook():
    hooks = [i for m in CORE for i in GRAPH[m] if i.target.split(".")[0] in FORBIDDEN]
    assert [(i.source, i.target) for i in hooks] == [PLUGIN_HOOK]
    assert all(i.guarded for i in hooks), "the plug-in hook must be inside try/except ImportError"
    # transitively: follow every import of the core, hook excepted, through both packages
    edges = {m: {i.target for i in GRAPH[m] if (m, i.target) != PLUGIN_HOOK} for m in GRAPH}
    for m in CORE:
        reached = ig.reachable(edges, m)
        assert [n for n in reached if n.split(".")[0] in FORBIDDEN] == [], m


def test_the_executor_holds_no_module_the_core_needs():
    """Nothing of kvplan_nixl is imported by the core (but the hook), so the core installs and
    runs alone: ``pip install kvplan`` without the nixl extra."""
    used = {i.target for m in CORE for i in GRAPH[m]} - {PLUGIN_HOOK[1]}
    assert sorted(t for t in used if t.startswith("kvplan_nixl")) == []


def test_the_graph_sees_lazy_and_guarded_imports():
    """The builder itself: a function-level import and the guarded hook are found."""
    plan = {i.target: i for i in GRAPH["kvplan.cli.command"]}
    hook = plan[PLUGIN_HOOK[1]]
    assert hook.lazy and hook.guarded
    assert not any(i.guarded for i in GRAPH["kvplan.planner"])
    assert "kvplan.hooks" in {i.target for i in GRAPH["kvplan.planner"]}


def test_no_class_in_the_core_over_300_lines():
    big = [(m, c, n) for m, c, n in ig.classes("kvplan") if n > MAX_CLASS_LINES]
    assert big == []


def test_every_core_module_says_what_it_owns():
    """A theory-of-operation docstring at the top of each module, naming its layer."""
    missing = []
    for m, path in ig.modules("kvplan").items():
        doc = ig.ast.get_docstring(ig.ast.parse(path.read_text(encoding="utf-8")))
        if not doc or "layer" not in doc.lower():
            missing.append(m)
    assert missing == []


# -- the offline CLI in a venv without NIXL and torch ---------------------------------------


def _bare_venv(tmp_path: Path, *, with_repo: bool) -> Path:
    """A venv (no pip, nothing downloaded) whose only third-party packages are numpy and attrs
    of this interpreter, plus this checkout (``with_repo``) or the ``kvplan`` package alone."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"
    site = _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout
    deps = tmp_path / "deps"
    deps.mkdir()
    here = Path(sysconfig.get_paths()["purelib"])
    import attr
    import numpy

    for src in (Path(numpy.__file__).parent, Path(attr.__file__).parent,
                Path(attr.__file__).parent.parent / "attrs",
                Path(numpy.__file__).parent.parent / "numpy.libs", here / "numpy.libs"):
        if src.exists() and not (deps / src.name).exists():
            (deps / src.name).symlink_to(src)
    paths = [str(deps)]
    if with_repo:
        paths.insert(0, str(ROOT))
    else:
        (deps / "kvplan").symlink_to(ROOT / "kvplan")
    Path(site.strip(), "kvplan_test.pth").write_text("\n".join(paths) + "\n")
    return python


#: The bare venv's environment: none of this interpreter's search path leaks in.
BARE_ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def _run(python: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), *argv], cwd="/", env=BARE_ENV, capture_output=True,
                          text=True, timeout=120)


def _kvplan(python: Path, *argv: str) -> subprocess.CompletedProcess:
    return _run(python, "-m", "kvplan.cli", *argv)


@pytest.fixture(scope="module")
def bare(tmp_path_factory) -> Path:
    return _bare_venv(tmp_path_factory.mktemp("bare"), with_repo=True)


def test_the_bare_venv_has_no_nixl_and_no_torch(bare):
    for name in ("torch", "nixl_cu12", "nixl", "rich"):
        r = _run(bare, "-c", f"import {name}")
        assert r.returncode != 0 and "ModuleNotFoundError" in r.stderr, name
    r = _run(bare, "-c", "import numpy, attrs, kvplan; print(kvplan.__file__)")
    assert r.returncode == 0 and r.stdout.startswith(str(ROOT)), r.stderr


@pytest.mark.parametrize(("argv", "expect"), [
    (("plan", "--tokens", "64", "--num-blocks", "16"), "TransferPlan pull d1"),
    (("explain", "--prefill", "llama-3.1-8b", "--prefill-tp", "4", "--decode", "llama-3.1-8b",
      "--decode-tp", "2", "--tokens", "256"), "layers.[0-31].attn"),
    (("spec", "llama-3.1-8b", "--tp", "2", "--num-blocks", "8"), '"tp_size": 2'),
    (("presets",), "llama-3.1-70b"),
], ids=["plan", "explain", "spec", "presets"])
def test_offline_commands_run_without_nixl_or_torch(bare, argv, expect):
    r = _kvplan(bare, *argv)
    assert r.returncode == 0, r.stderr
    assert expect in r.stdout
    # stderr may carry progress lines of a long step (kvplan.cli.progress), never an error
    assert "Traceback" not in r.stderr and "error" not in r.stderr.lower(), r.stderr


def test_check_runs_without_nixl_or_torch(bare, tmp_path):
    for tp in (4, 2):
        r = _kvplan(bare, "spec", "qwen3-8b", "--tp", str(tp), "--num-blocks", "8")
        assert r.returncode == 0, r.stderr
        (tmp_path / f"tp{tp}.json").write_text(r.stdout)
    r = _kvplan(bare, "check", str(tmp_path / "tp4.json"), str(tmp_path / "tp2.json"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() and r.stderr == ""


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvplan: ") and "Traceback" not in err, err
    return lines[0]


def test_demo_without_nixl_names_the_extra(bare):
    """kvplan_nixl is there (it ships with kvplan) but nixl is not: one line, exit 2."""
    r = _kvplan(bare, "demo", "--tokens", "64", "--num-blocks", "16")
    assert r.returncode == 2
    assert "[nixl]" in _one_line(r.stderr)


def test_demo_without_the_executor_package_names_the_extra(tmp_path):
    """Only the core installed: the plug-in hook's import fails, demo says what to install."""
    python = _bare_venv(tmp_path, with_repo=False)
    r = _run(python, "-c", "import kvplan_nixl")
    assert r.returncode != 0
    r = _kvplan(python, "demo", "--tokens", "64")
    assert r.returncode == 2
    assert 'pip install "kvplan[nixl]"' in _one_line(r.stderr)
    r = _kvplan(python, "presets")
    assert r.returncode == 0 and "llama-3.1-8b" in r.stdout

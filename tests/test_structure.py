"""The shape of the code, checked: the core in layers that import one way, no registry of names
between them, no import circle, no NIXL or torch under the core (even transitively), no core
module naming the executor's package, no class over 300 lines, and the offline ``kvplan``
commands running in a bare venv that has neither NIXL nor torch, the commands of other packages
coming in through the ``kvplan.commands`` entry points.

The import graph is read from the source (tests/importgraph.py): lazy imports inside functions
count, since they tie a reader of one file to another just the same, and so do imports under
``if TYPE_CHECKING:``: they never run, but a type hint naming a module above is the same
inversion (a value that names the code built on it), and a circle of them is a circle a reader
walks. A check that fails names each offending import by module, line and target.
"""

from __future__ import annotations

import ast
import os
import re
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
#:   0  errors, names, constants            nothing from kvplan
#:   1  spec*, placement, layout, runs, compat, ...   the values: engines, regions, layouts
#:   2  lanes, allocations                  the handshake's values: lanes, templates
#:   3  plan, request                       the request: block ids -> runs (TransferPlan)
#:   4  planner                             the handshake: TransferMap, pull_map, push_map
#:   5  views, rank_picture, staging, simulate, hf, presets, examples, strategies, adapters
#:   6  kvplan (the package's __init__)     the public names
#:   7  kvplan.cli                          the command line, on the public names
LAYERS = {
    "kvplan.errors": 0,
    "kvplan.names": 0,
    "kvplan.constants": 0,
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
    "kvplan.lanes": 2,
    "kvplan.allocations": 2,
    "kvplan.plan": 3,
    "kvplan.request": 3,
    "kvplan.pairs": 3,
    "kvplan.planner": 4,
    "kvplan.views": 5,
    "kvplan.rank_picture": 5,
    "kvplan.staging": 5,
    "kvplan.simulate": 5,
    "kvplan.hf": 5,
    "kvplan.hf_families": 5,
    "kvplan.presets": 5,
    "kvplan.examples": 5,
    "kvplan.strategies": 5,
    "kvplan.strategies_requests": 5,
    "kvplan.adapters": 5,
    "kvplan.adapters.vllm": 5,
    "kvplan.adapters.vllm_nixl": 5,
    "kvplan.adapters.sglang": 5,
    "kvplan.cli": 7,
    "kvplan.cli.__main__": 7,
    "kvplan.cli.command": 7,
    "kvplan.cli.engines": 7,
    "kvplan.cli.explain": 7,
    "kvplan.cli.models": 7,
    "kvplan.cli.counting": 7,
    "kvplan.cli.tables": 7,
    "kvplan.cli.cliargs": 7,
    "kvplan.cli.progress": 7,
    "kvplan": 6,
}

#: The only imports that point up, each inside the one method named, which a reader follows
#: to the function it calls: a value's presentation methods import their view module when
#: shown (the idiom numpy and pandas use for optional presentation code; docs/design.md). Only
#: presentation: a value builds from no adapter (``kvplan.hf.from_hf_config``,
#: ``kvplan.adapters.vllm.spec_from_vllm`` are functions above it, not methods of the spec).
#: Nothing else may point up, not lazily, not under TYPE_CHECKING; an entry no longer in the
#: code fails too.
DELEGATES = {
    ("kvplan.spec", "EngineSpec._repr_html_", "kvplan.views"),
    ("kvplan.spec", "EngineSpec.to_pandas", "kvplan.views"),
    ("kvplan.plan", "TransferPlan.summary", "kvplan.views"),
    ("kvplan.plan", "TransferPlan._repr_html_", "kvplan.views"),
    ("kvplan.plan", "TransferPlan.to_pandas", "kvplan.views"),
    ("kvplan.plan", "TransferPlan.plot", "kvplan.views"),
    ("kvplan.planner", "TransferMap._repr_html_", "kvplan.views"),
    ("kvplan.planner", "TransferMap.to_pandas", "kvplan.views"),
    ("kvplan.planner", "TransferMap.plot", "kvplan.views"),
}
EXECUTOR = "kvplan_nixl"
FORBIDDEN = (EXECUTOR, "nixl", "nixl_cu12", "nixl_cu13", "torch")
MAX_CLASS_LINES = 300

#: The methods a presentation delegate may sit in, and the one module it may import.
PRESENTATION = {"_repr_html_", "to_pandas", "summary", "plot"}
VIEWS = "kvplan.views"

#: Every import a reader follows, type-hint imports included (``Import.checking``).
GRAPH = ig.graph("kvplan", "kvplan_nixl", typing=True)
CORE = sorted(m for m in GRAPH if m.split(".")[0] == "kvplan")


def _delegate(i: ig.Import) -> bool:
    return i.lazy and not i.checking and (i.source, i.function, i.target) in DELEGATES


def _core_imports() -> list[ig.Import]:
    """The core's imports of core modules but the delegating methods' (which point up by
    design): the arrows of the layer table."""
    return [i for m in CORE for i in GRAPH[m] if i.target in LAYERS and not _delegate(i)]


def _circles(imports: list[ig.Import]) -> list[str]:
    """Each import circle as the imports that close it: ``kvplan.spec:24 -> kvplan.engine_derive,
    kvplan.engine_derive:31 (under TYPE_CHECKING) -> kvplan.spec``."""
    edges: dict[str, set[str]] = {}
    for i in imports:
        edges.setdefault(i.source, set()).add(i.target)
    out = []
    for members in ig.cycles(edges):
        inside = sorted((i for i in imports if i.source in members and i.target in members),
                        key=lambda i: (i.source, i.line))
        out.append(", ".join(f"{i.where()} -> {i.target}" for i in inside))
    return out


def _upward(imports: list[ig.Import]) -> list[str]:
    """Each import of a higher layer: ``kvplan.spec:299 (lazily, in EngineSpec.from_hf_config)
    imports kvplan.hf (layer 1 -> 5)``."""
    return [f"{i.where()} imports {i.target} (layer {LAYERS[i.source]} -> {LAYERS[i.target]})"
            for i in imports if LAYERS[i.target] > LAYERS[i.source]]


def test_every_core_module_has_a_layer():
    assert sorted(set(CORE) - set(LAYERS)) == [], "place the new module in LAYERS (and design.md)"
    assert sorted(set(LAYERS) - set(CORE)) == [], "LAYERS names a module that is gone"


def test_no_import_circle_in_the_core():
    """Type-hint imports count: a circle closed only under TYPE_CHECKING is still a circle."""
    circles = _circles(_core_imports())
    assert circles == [], "import circles:\n" + "\n".join(circles)


def test_no_layer_imports_a_higher_one():
    """Not at module level, not lazily, not under TYPE_CHECKING: only DELEGATES point up."""
    up = _upward(_core_imports())
    assert up == [], "upward imports:\n" + "\n".join(up)


def test_the_checks_name_an_upward_import_and_its_circle():
    """The two checks above on a made-up import, as ``spec.py`` had it (``EngineSpec`` building
    itself from a Hugging Face config by ``from kvplan import hf`` in a method): each names the
    module, the line and the target."""
    added = ig.Import("kvplan.spec", "kvplan.hf", 299, lazy=True, guarded=False,
                      function="EngineSpec.from_hf_config")
    assert _upward([added]) == [
        "kvplan.spec:299 (lazily, in EngineSpec.from_hf_config) imports kvplan.hf (layer 1 -> 5)"]
    [circle] = [c for c in _circles([*_core_imports(), added]) if "-> kvplan.hf" in c]
    assert "kvplan.spec:299 (lazily, in EngineSpec.from_hf_config) -> kvplan.hf" in circle
    assert "kvplan.hf:" in circle and "-> kvplan.spec" in circle  # hf's own import of spec


def test_every_upward_delegate_is_presentation_in_the_code_and_lazy():
    found = {(i.source, i.function, i.target) for m in CORE for i in GRAPH[m] if _delegate(i)}
    assert sorted(DELEGATES - found) == [], "DELEGATES names an import that is gone"
    eager = [i.where() for m in CORE for i in GRAPH[m]
             if (i.source, i.target) in {(s, t) for s, _, t in DELEGATES} and not i.lazy]
    assert eager == []
    # presentation only (the guide's one exception): a view module, from a showing method
    assert {t for _, _, t in DELEGATES} == {VIEWS}
    assert {f.rsplit(".", 1)[-1] for _, f, _ in DELEGATES} <= PRESENTATION


def test_no_core_module_imports_a_private_name_of_another():
    """A module uses another's public names (``request.lane_span``, not ``request._span``): what
    a module shares it names, documents and keeps; its ``_`` names it may change alone."""
    bad = []
    for m, path in ig.modules("kvplan").items():
        for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "kvplan":
                bad += [f"{m}:{n.lineno} imports {a.name} from {n.module}"
                        for a in n.names if a.name.startswith("_")]
    assert bad == [], "private names imported:\n" + "\n".join(bad)


def _functions(tree: ast.AST):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_no_registry_of_names_between_layers():
    """No module a value calls through by name: no ``hooks`` module, no decorator taking a
    name (``@provide("build_plan")``), no function storing into a module-level container
    (``_SERVED[name] = fn``). A call is followed by reading its import."""
    assert not (ROOT / "kvplan" / "hooks.py").exists()
    bad = []
    for m, path in ig.modules("kvplan").items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top = {t.id for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
               for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
               if isinstance(t, ast.Name)}
        for fn in _functions(tree):
            for d in fn.decorator_list:
                if isinstance(d, ast.Call) and any(isinstance(a, ast.Constant)
                                                   and isinstance(a.value, str) for a in d.args):
                    bad.append(f"{m}:{d.lineno} a decorator taking a name")
            local = {a.arg for a in [*fn.args.args, *fn.args.kwonlyargs]}
            for n in ast.walk(fn):
                targets = n.targets if isinstance(n, ast.Assign) else []
                for t in targets:
                    if (isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name)
                            and t.value.id in top and t.value.id not in local):
                        bad.append(f"{m}:{n.lineno} stores into module-level {t.value.id}")
    assert bad == []


def test_transfer_map_plan_calls_the_function_it_imports():
    """The request path, by reading: planner.py imports build_plan from request.py at module
    level, and TransferMap.plan calls it."""
    imports = [i for i in GRAPH["kvplan.planner"] if i.target == "kvplan.request"]
    assert imports and not any(i.lazy for i in imports)
    tree = ast.parse((ROOT / "kvplan" / "planner.py").read_text(encoding="utf-8"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TransferMap")
    plan = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "plan")
    calls = {n.func.id for n in ast.walk(plan) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Name)}
    assert "build_plan" in calls


def test_the_core_imports_no_nixl_torch_or_executor():
    reached_by = [(i.source, i.target) for m in CORE for i in GRAPH[m]
                  if i.target.split(".")[0] in FORBIDDEN]
    assert reached_by == []
    # transitively: follow every import of the core through both packages
    edges = {m: {i.target for i in GRAPH[m]} for m in GRAPH}
    for m in CORE:
        reached = ig.reachable(edges, m)
        assert [n for n in reached if n.split(".")[0] in FORBIDDEN] == [], m


def test_no_core_code_names_the_executor():
    """Not even as a string (``importlib.import_module("kvplan_nixl.cli")``): the executor's
    commands come in through entry points. Docstrings may say what an executor does."""
    bad = []
    for m, path in ig.modules("kvplan").items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                  ast.AsyncFunctionDef))
                and n.body and isinstance(n.body[0], ast.Expr)
                and isinstance(n.body[0].value, ast.Constant)}
        for n in ast.walk(tree):
            if (isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
                    and EXECUTOR in n.value):
                bad.append(f"{m}:{n.lineno}")
        bad += [f"{m}:{k + 1} (comment)" for k, line in enumerate(path.read_text().splitlines())
                if "#" in line and EXECUTOR in line.split("#", 1)[1]]
    assert bad == []


def test_demo_comes_from_an_entry_point():
    """pyproject.toml declares ``demo`` in the ``kvplan.commands`` group, and this install
    (editable or not) carries it: a checkout installed before the entry point existed must be
    reinstalled (``pip install -e .``)."""
    from importlib.metadata import entry_points

    from kvplan.cli.command import COMMANDS_GROUP

    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert f'[project.entry-points."{COMMANDS_GROUP}"]\ndemo = "kvplan_nixl.cli:register"' in text
    eps = {ep.name: ep.value for ep in entry_points(group=COMMANDS_GROUP)}
    assert eps.get("demo") == "kvplan_nixl.cli:register", (
        f"installed entry points {eps}: reinstall the checkout (pip install -e .)")


def test_the_graph_sees_lazy_guarded_and_method_imports():
    """The builder itself: a method-level import (with its method) and a guarded one."""
    views = [i for i in GRAPH["kvplan.plan"] if i.target == "kvplan.views"]
    assert {i.function for i in views} >= {"TransferPlan.summary", "TransferPlan.plot"}
    assert all(i.lazy for i in views)
    rich = [i for i in GRAPH["kvplan.cli.progress"] if i.target.startswith("rich")]
    assert rich and all(i.lazy for i in rich) and any(i.guarded for i in rich)
    assert not any(i.guarded for i in GRAPH["kvplan.planner"])
    assert "kvplan.lanes" in {i.target for i in GRAPH["kvplan.planner"]}


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


def _bare_venv(tmp_path: Path, *, with_repo: bool, commands: dict[str, str] | None = None,
               extra: dict[str, str] | None = None) -> Path:
    """A venv (no pip, nothing downloaded) whose only third-party packages are numpy and attrs
    of this interpreter, plus this checkout (``with_repo``) or the ``kvplan`` package alone.

    ``commands`` (name -> ``module:function``) are installed as the ``kvplan.commands`` entry
    points of a distribution's metadata in its site-packages (a dist-info, as pip writes it);
    ``extra`` files (name -> text) are written beside the packages (a plug-in's module)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"
    site = Path(_run(python, "-c",
                     "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
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
    (site / "kvplan_test.pth").write_text("\n".join(paths) + "\n")
    for name, text in (extra or {}).items():
        (deps / name).write_text(text)
    if commands:
        info = site / "kvplan_under_test-0.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvplan-under-test\n"
                                       "Version: 0.0\n")
        (info / "entry_points.txt").write_text(
            "[kvplan.commands]\n" + "".join(f"{k} = {v}\n" for k, v in commands.items()))
    return python


def _declared_commands() -> dict[str, str]:
    """The ``kvplan.commands`` entry points pyproject.toml declares."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    section = text.split('[project.entry-points."kvplan.commands"]', 1)[1].split("\n[", 1)[0]
    return dict(re.findall(r'^(\w+) = "([\w.:]+)"', section, re.M))


#: The bare venv's environment: none of this interpreter's search path leaks in.
BARE_ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def _run(python: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), *argv], cwd="/", env=BARE_ENV, capture_output=True,
                          text=True, timeout=120)


def _kvplan(python: Path, *argv: str) -> subprocess.CompletedProcess:
    return _run(python, "-m", "kvplan.cli", *argv)


@pytest.fixture(scope="module")
def bare(tmp_path_factory) -> Path:
    """This checkout without NIXL or torch, installed with the entry points it declares."""
    return _bare_venv(tmp_path_factory.mktemp("bare"), with_repo=True,
                      commands=_declared_commands())


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
    """The executor's package is there (it ships with kvplan) and adds ``demo`` through its
    entry point, but nixl is not: one line naming the extra, exit 2."""
    assert _declared_commands() == {"demo": "kvplan_nixl.cli:register"}
    r = _kvplan(bare, "demo", "--help")
    assert r.returncode == 0 and "--direct-only" in r.stdout, r.stderr  # the real command
    r = _kvplan(bare, "demo", "--tokens", "64", "--num-blocks", "16")
    assert r.returncode == 2
    assert "[nixl]" in _one_line(r.stderr)


def test_demo_without_the_executor_package_names_the_extra(tmp_path):
    """Only the core installed, no entry point adds demo: demo says what to install."""
    python = _bare_venv(tmp_path, with_repo=False)
    r = _run(python, "-c", "import kvplan_nixl")
    assert r.returncode != 0
    r = _kvplan(python, "demo", "--tokens", "64")
    assert r.returncode == 2
    assert 'pip install "kvplan[nixl]"' in _one_line(r.stderr)
    r = _kvplan(python, "presets")
    assert r.returncode == 0 and "llama-3.1-8b" in r.stdout


PLUGIN = """\
def register(sub):
    s = sub.add_parser("hello", help="say hello from a third-party package")
    s.add_argument("--name", default="world")
    s.set_defaults(fn=lambda args: print(f"hello {args.name}") or 0)
"""


def test_a_third_party_package_adds_its_own_command(tmp_path):
    """The same door the executor uses: an entry point of another distribution."""
    python = _bare_venv(tmp_path, with_repo=False, extra={"kvplan_hello.py": PLUGIN},
                        commands={"hello": "kvplan_hello:register"})
    r = _kvplan(python, "hello", "--name", "kv")
    assert (r.returncode, r.stdout, r.stderr) == (0, "hello kv\n", "")
    assert "say hello from a third-party package" in _kvplan(python, "--help").stdout


def test_a_broken_plugin_leaves_the_other_commands_working(tmp_path):
    python = _bare_venv(tmp_path, with_repo=False, commands={"broken": "no_such_module:register"})
    r = _kvplan(python, "presets")
    assert r.returncode == 0 and "llama-3.1-8b" in r.stdout, r.stderr
    r = _kvplan(python, "broken", "--x")
    assert r.returncode == 2
    line = _one_line(r.stderr)
    assert "no_such_module:register" in line and "ModuleNotFoundError" in line

"""Repository hygiene that a newcomer relies on: lint, documented API, the README's commands."""

import inspect
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvplan
import kvplan_nixl

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_is_clean():
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    r = subprocess.run([ruff, "check", str(ROOT)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("package", [kvplan, kvplan_nixl], ids=lambda p: p.__name__)
def test_every_public_name_is_documented(package):
    missing = []
    for name in package.__all__:
        obj = getattr(package, name)
        if (inspect.isclass(obj) or inspect.isfunction(obj)) and not inspect.getdoc(obj):
            missing.append(name)
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                documentable = callable(member) or isinstance(member, property)
                if attr.startswith("_") or not documentable:
                    continue
                if not inspect.getdoc(member):
                    missing.append(f"{name}.{attr}")
    assert not missing, missing


def test_core_imports_neither_torch_nor_nixl():
    code = ("import sys, kvplan, kvplan.strategies; "
            "print(any(m.split('.')[0] in ('torch', 'nixl', 'nixl_cu12') for m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.stdout.strip() == "False", r.stdout + r.stderr


def test_readme_opens_with_the_two_commands_and_ci_runs_both_tiers():
    """The main job, the fast tier's command, then the engine tier's; CI runs the two test
    commands as written, the fast tier first."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    run_cmd, test_cmd, engine_cmd = (b.strip() for b in blocks[:3])
    assert "torch==2.13.0" in run_cmd and run_cmd.endswith("kvplan demo")
    assert "torch==2.13.0" in test_cmd and test_cmd.endswith("python -m pytest")
    assert engine_cmd == "python -m pytest -m engines"
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if not line.startswith("#")]
    assert ci.index(test_cmd) < ci.index(engine_cmd), ci


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "benchmarks").glob("*.py")))
def test_every_benchmark_prints_its_help_without_running(script):
    """``python benchmarks/X.py --help`` prints argparse's help and exits 0 at once: it never
    starts the benchmark (which takes minutes and NIXL)."""
    import os

    # no wall-clock bound: importing torch and NIXL alone takes a minute on a loaded 2-core CI
    # machine; what tells "help" from "ran" is the output (a benchmark prints a results table)
    r = subprocess.run([sys.executable, f"benchmarks/{script}", "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "KVPLAN_PROGRESS": "0"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("usage: ") and "--help" in r.stdout
    assert "|---" not in r.stdout  # no table: nothing measured


def _collected(*argv: str) -> list[str]:
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                        "-p", "no:cacheprovider", *argv], capture_output=True, text=True,
                       cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [x for x in r.stdout.splitlines() if "::" in x]


def test_the_fast_tier_starts_no_engine_and_the_engine_tier_runs_by_model():
    """``python -m pytest`` leaves out every test that needs the vLLM venv (tests/conftest.py
    marks them), keeping the engine files' other tests; ``-m engines`` takes them, the tests
    that start no engine first, then one model's tests after another across files."""
    files = ["tests/test_vllm_engine.py", "tests/test_vllm_serving.py",
             "tests/test_vllm_mixed.py", "tests/test_vllm_hybrid.py"]
    fast = _collected(*files)
    assert fast and all("example_proxy" in t or "orphan_shm" in t for t in fast), fast
    slow = _collected("-m", "engines", *files)
    assert not set(fast) & set(slow) and len(slow) > 20
    assert slow[0].startswith("tests/test_vllm_serving.py::test_ports_by"), slow[:3]
    # one model at a time: the NemotronH tests of two files run together, after the Llama's
    nemo = [k for k, t in enumerate(slow) if "nemotron_n_groups_1" in t or "mamba2_one" in t]
    llama = [k for k, t in enumerate(slow) if "test_vllm_engine.py" in t]
    assert max(llama) < min(nemo) and max(nemo) - min(nemo) <= 2, slow

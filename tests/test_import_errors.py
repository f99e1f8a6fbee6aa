"""Without NIXL, ``from kvplan_nixl import Endpoint`` fails with one ImportError that says what
to install: one traceback (no chain of the three places nixl may live), last line actionable.
The import is blocked in a subprocess, as if NIXL were not installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_BLOCK = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        hit = next((b for b in {blocked!r} if name == b or name.startswith(b + '.')), None)
        if hit:
            raise ModuleNotFoundError(f"No module named {{hit!r}}", name=hit)
sys.meta_path.insert(0, Block())
import kvplan_nixl  # the errors and the plan tools import without NIXL
from kvplan_nixl import Endpoint
"""


def _run(blocked) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _BLOCK.format(blocked=tuple(blocked))],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_endpoint_without_nixl_is_one_import_error_naming_the_extra():
    r = _run(("nixl", "nixl_cu12", "nixl_cu13"))
    assert r.returncode == 1
    assert r.stderr.count("Traceback") == 1 and "During handling" not in r.stderr
    assert "direct cause" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: kvplan_nixl moves bytes over NIXL: NIXL is not installed")
    assert 'pip install -e ".[nixl]"' in last and "nixl-cu12" in last
    assert "nixl_cu13" not in r.stderr  # the last place tried is not what the user must fix


def test_a_wheel_that_is_present_but_broken_is_named_with_its_reason():
    """nixl_cu12 installed, but a module it needs missing: the message says so."""
    r = _run(("nixl", "nixl_cu13", "nixl_cu12._bindings"))  # its compiled part, say
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert r.stderr.count("Traceback") == 1
    assert "nixl_cu12 is installed but does not import" in last and "_bindings" in last

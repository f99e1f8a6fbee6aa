"""Two network namespaces joined by a veth pair: two "hosts" on one machine, for the e2e tests.

    with TwoHosts() as hosts:                    # tests/test_netns.py's ``world`` uses it
        p = hosts.spawn("a", ["python", ...])     # a process on host A (10.213.7.1)
        hosts.link("down")                        # cut the wire (from inside host A)

Each run creates its own pair of namespaces, ``kvplan-<pid>-<random>-a`` and ``...-b``, and the
veth pair is created from inside the first one straight into the second, so it never exists in
the machine's own namespace: the addresses (:data:`ADDRS`) and the interface (:data:`IFACE`)
exist only inside the namespaces this module created, and nothing else is ever touched. Both
namespaces are deleted on exit, also after a failure (deleting a namespace deletes its end of
the veth, which deletes the pair); every process spawned is killed first (SIGCONT, then SIGKILL,
so a stopped one dies too). Namespaces left by a run that was itself killed (``kill -9`` of
pytest) are removed by the next run: their names carry the pid of the run that made them, and a
namespace of this prefix whose pid is no longer alive is deleted, after killing whatever still
runs inside it.

Processes see UCX over TCP on the veth only (:func:`ucx_env`): ``UCX_TLS=tcp`` keeps UCX off
shared memory and off CMA (``process_vm_readv``, which would otherwise work across network
namespaces, since both processes share one kernel and one PID namespace).

:func:`unavailable` says why namespaces cannot be made here (not root, no ``ip``, no
permission), and the tests skip with that reason; where it returns None the tests run.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

#: Prefix of every namespace this module creates (and the only ones it ever deletes).
PREFIX = "kvplan-"
#: The veth's name inside each namespace (namespaces are isolated: both ends can share it).
IFACE = "kvnet0"
#: Address of host "a" and host "b", only ever configured inside the namespaces made here.
ADDRS = {"a": "10.213.7.1", "b": "10.213.7.2"}


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", "netns", "exec", ns, "ip", *args] if ns else ["ip", *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why two namespaces cannot be created here, or None when they can (checked for real)."""
    if shutil.which("ip") is None:
        return "no `ip` command (install iproute2) to create network namespaces"
    if os.geteuid() != 0:
        return f"creating network namespaces needs root; running as uid {os.geteuid()}"
    probe = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}-probe"
    try:
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"`ip netns add` failed: {made.stderr.strip() or made.returncode}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def namespaces() -> list[str]:
    """Names of the network namespaces ``ip netns`` knows (all of them, not only ours)."""
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.split()]


def remove_stale() -> list[str]:
    """Delete namespaces of this prefix whose creating process is gone, killing what still runs
    inside them first (a peer left stopped by a killed test); returns their names."""
    gone = []
    for name in namespaces():
        fields = name[len(PREFIX):].split("-")
        if name.startswith(PREFIX) and fields[0].isdigit() and not _alive(int(fields[0])):
            pids = _ip("netns", "pids", name, check=False).stdout.split()
            for pid in map(int, pids):
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        break
            _ip("netns", "del", name, check=False)
            gone.append(name)
    return gone


def ucx_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a process on one of the hosts: UCX over TCP on the veth, nothing else."""
    env = dict(os.environ if base is None else base)
    env["UCX_TLS"] = "tcp"
    env["UCX_NET_DEVICES"] = IFACE
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    return env


class TwoHosts:
    """Two namespaces ``a`` and ``b`` joined by a veth (``IFACE`` in both), 10.213.7.1/.2 /24."""

    def __init__(self) -> None:
        tag = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
        self.ns = {"a": f"{tag}-a", "b": f"{tag}-b"}
        self.procs: list[subprocess.Popen] = []
        self._made: list[str] = []

    def __enter__(self) -> TwoHosts:
        try:
            remove_stale()
            for ns in self.ns.values():
                _ip("netns", "add", ns)
                self._made.append(ns)
            a, b = self.ns["a"], self.ns["b"]
            _ip("link", "add", IFACE, "type", "veth", "peer", "name", IFACE, "netns", b, ns=a)
            for host, ns in self.ns.items():
                _ip("addr", "add", f"{ADDRS[host]}/24", "dev", IFACE, ns=ns)
                _ip("link", "set", IFACE, "up", ns=ns)
                _ip("link", "set", "lo", "up", ns=ns)
            self._wait_up()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wait_up(self, timeout: float = 20.0) -> None:
        """Until the veth's carrier is up on both ends: UCX started before that finds no usable
        device ("network device 'kvnet0' is not available"; seen once on a loaded machine)."""
        deadline = time.monotonic() + timeout
        while True:
            states = [_ip("-o", "link", "show", IFACE, ns=ns, check=False).stdout
                      for ns in self.ns.values()]
            if all("state UP" in x for x in states):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"veth {IFACE} not up after {timeout:.0f} s: {states}")
            time.sleep(0.05)

    def spawn(self, host: str, cmd: Sequence[str], **popen) -> subprocess.Popen:
        """Start ``cmd`` inside host ``host`` (``"a"`` or ``"b"``); killed at close."""
        popen.setdefault("env", ucx_env())
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns[host], *cmd], **popen)
        self.procs.append(proc)
        return proc

    def link(self, state: str, host: str = "a") -> None:
        """``ip link set IFACE up|down`` inside ``host``: the wire between the hosts cut/mended."""
        _ip("link", "set", IFACE, state, ns=self.ns[host])  # the address and route come back

    def shape(self, rate: str | None, host: str = "a") -> bool:
        """Slow ``host``'s egress on the veth to ``rate`` (e.g. ``"20mbit"``, a tc token bucket)
        so that a transfer stays in flight long enough to be cut; ``None`` removes it. Returns
        False where the kernel has no tbf qdisc (the caller then holds transfers otherwise)."""
        if shutil.which("tc") is None:
            return False
        if rate is None:
            cmd = ["tc", "qdisc", "del", "dev", IFACE, "root"]
        else:
            cmd = ["tc", "qdisc", "add", "dev", IFACE, "root", "tbf", "rate", rate,
                   "burst", "32kbit", "latency", "400ms"]
        return self.exec(host, *cmd).returncode == 0

    def exec(self, host: str, *cmd: str) -> subprocess.CompletedProcess:
        """Run a short command inside ``host`` (for checks such as ``ping``)."""
        return subprocess.run(["ip", "netns", "exec", self.ns[host], *cmd],
                              capture_output=True, text=True, timeout=30)

    def close(self) -> None:
        """Kill every process spawned here, then delete both namespaces (idempotent)."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGCONT)
                    p.kill()
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                pass
            for f in (p.stdin, p.stdout, p.stderr):
                if f is not None:
                    f.close()
        self.procs.clear()
        while self._made:
            _ip("netns", "del", self._made.pop(), check=False)


class HostProc:
    """A ``tests/netns_host.py`` process (one engine's ranks) on one host, driven by JSON lines.

    Started processes print their metadata when ready; ``wait=False`` returns at once (start
    several, then call :meth:`ready` on each: they import NIXL in parallel).
    ``call(op, **args)`` sends one command and returns its reply (a dict); a reply with
    ``ok: false`` raises AssertionError with the remote traceback, unless ``check=False``.
    """

    def __init__(self, hosts: TwoHosts, host: str, engine: str, spec, ranks: Sequence[int], *,
                 fill: str, seed: int = 0, peer_spec=None, peer_seed: int = 0,
                 ready_timeout: float = 120.0, poll: float = 1e-3,
                 env: dict[str, str] | None = None, stderr=None, wait: bool = True) -> None:
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "netns_host.py")
        cmd = [sys.executable, script, "--engine", engine, "--spec", json.dumps(spec.to_dict()),
               "--ranks", ",".join(map(str, ranks)), "--fill", fill, "--seed", str(seed),
               "--peer-seed", str(peer_seed), "--poll", str(poll),
               "--peer-spec", json.dumps(None if peer_spec is None else peer_spec.to_dict())]
        self.engine, self.ranks = engine, list(ranks)
        self.proc = hosts.spawn(host, cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, env={**ucx_env(), **(env or {})}, stderr=stderr)
        self.metadata: dict[str, str] = {}
        if wait:
            self.ready(ready_timeout)

    def ready(self, timeout: float = 120.0) -> HostProc:
        """Wait for the process's first line (its endpoints made); keeps its metadata."""
        first = self._line(timeout)
        assert first.get("ready"), first
        assert first["pid"] == self.proc.pid  # `ip netns exec` execs: signals reach the peer
        self.metadata = first["metadata"]
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _line(self, timeout: float) -> dict:
        r, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert r, f"{self.engine} ranks {self.ranks} silent for {timeout} s"
        line = self.proc.stdout.readline()
        assert line, f"{self.engine} ranks {self.ranks} exited (rc {self.proc.poll()})"
        return json.loads(line)

    def call(self, op: str, *, timeout: float = 120.0, check: bool = True, **args) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        reply = self._line(timeout)
        if check and not reply.get("ok"):
            raise AssertionError(f"{op} on {self.engine} {self.ranks} failed:\n"
                                 f"{reply.get('traceback', reply)}")
        return reply

    def quit(self, timeout: float = 30.0) -> dict:
        """Close the endpoints cleanly; returns the final handle counts."""
        self.proc.stdin.write('{"op": "quit"}\n')
        self.proc.stdin.flush()
        last = self._line(timeout)
        assert self.proc.wait(timeout) == 0
        return last

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

"""The serving path as users run it, on two hosts: prefill and decode as vLLM's OpenAI HTTP
servers, each in its own network namespace (tests/netns.py) joined by a veth, UCX over that link
only, the side channels on the hosts' addresses, ``examples/pd_proxy.py`` in front.

Every command is built by ``examples/pd_serve.py``, the module docs/vllm.md's "Serving" and
"Two hosts" blocks are rendered from (tests/test_docs.py checks the blocks equal it): what the
docs show is what runs here, with the hosts' values. Two engine sets, one at a time, each
started once and driven in every mode (three proxies, ``pull``, ``push`` and ``layerwise``; the
mode is per request):

- a dense tiny Llama, prefill TP1 (host A) -> decode TP1 (host B);
- a tiny NemotronH with one B/C group, prefill TP1 -> decode TP2 (the pair vLLM's
  NixlConnector decodes garbage for), prompts under one 128-token block (vLLM 0.32's CPU Mamba2
  scan crashes on longer ones with prefix caching on).

vLLM's own router, vllm-router (tests/router_env.py), runs in front of the dense set too, with
a second prefill beside the first: requests spread over both, a decode leg that fails (the
prefill's hold then freed by its lease: the router sends no RELEASE), a prefill killed while
requests come; then with a second decode beside the first too: requests spread over both
prefills and both decodes, a decode killed while requests come (docs/vllm.md, "In front:
vllm-router, or the project's proxy").

Each answer through the proxy must equal the plain run (the same body straight to the prefill),
no transfer may have failed (equal tokens alone would follow a recompute), and the veth's
receive counter on the decode's host must have grown by at least the bytes the connector
logged as moved. The negative control: the same body straight to the decode computes the same
tokens while the link carries a fraction of those bytes, so the counter check can fail.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from examples import pd_serve
from tests import netns, router_env, vllm_engine
from tests.vllm_pool import ENGINE_GIB, cache_root, prompt

REPO = Path(__file__).resolve().parent.parent
WHY = netns.unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"two-host tests: {WHY}")

MODES = {"pull": 8000, "push": 8001, "layerwise": 8002}  # a proxy per mode, on host A
START_TIMEOUT = float(os.environ.get("KVPLAN_VLLM_START_TIMEOUT", 600))
TOKENS = 8
#: what a decode rank logs per pull posted / push received, and per failure
MOVED = re.compile(r"kvplan: (?:pull (req=\S+) remote=\S+ (rank=\d+) .* bytes=(\d+)|push req=\S+ "
                   r"rank=\d+ written by prefill rank\S* \S+: bytes=(\d+))")
#: a decode rank's pull line: the prefill's id of the request it read
PULLED_FROM = re.compile(r"kvplan: pull req=\S+ remote=(\S+) ")
FAILED = re.compile(r"kvplan: pu(ll|sh) req=\S+ from \S+ failed")
HOOKED = re.compile(r"done layer-wise in \S+ s \(\d+ parts, (\d+) from layer hooks\)")
WHOLE = re.compile(r"no registration before its forward|decode not connected")

#: POST (or GET without a body) from inside a host; prints the status and the answer
CLIENT = r"""
import json, sys, urllib.error, urllib.request
url, body = sys.argv[1], sys.argv[2]
req = urllib.request.Request(url, data=body.encode() if body else None,
                             headers={"Content-Type": "application/json"})
try:
    with urllib.request.urlopen(req, timeout=float(sys.argv[3])) as r:
        print(json.dumps({"status": r.status, "body": r.read().decode()}))
except urllib.error.HTTPError as e:
    print(json.dumps({"status": e.code, "body": e.read().decode()}))
except OSError as e:
    print(json.dumps({"status": 0, "body": f"{type(e).__name__}: {e}"}))
"""


class Serving:
    """One engine set on the two hosts: prefill on A, decode on B, a proxy per mode on A."""

    def __init__(self, hosts: netns.TwoHosts, py: Path, workdir: Path, model: Path, *,
                 decode_tp: int, name: str) -> None:
        self.hosts, self.name, self.workdir = hosts, name, workdir
        a, b = netns.ADDRS["a"], netns.ADDRS["b"]
        # cores: the prefill pinned to core 0; a TP 2 decode unpinned (pinned beside another
        # engine its workers starve it: docs/vllm.md), a TP 1 decode on core 1; the engine
        # tests' handshake timeout (CI's two cores: tests/vllm_engine.py)
        self.s = pd_serve.Setup(
            str(model), pd_serve.Host(a, netns.IFACE, "0"),
            pd_serve.Host(b, netns.IFACE, "1" if decode_tp == 1 else "nobind"),
            decode_tp=decode_tp, kv_gib=1, pythonpath=str(REPO), python=str(py),
            extra_config={"handshake_timeout_s": vllm_engine.HANDSHAKE_TIMEOUT_S})
        self.procs: dict[str, subprocess.Popen] = {}  # by role, as the logs
        self.logs: dict[str, Path] = {}
        #: set by a test that killed one of the set's processes: the fixture starts it anew
        self.dead = False
        for role, host in (("prefill", "a"), ("decode", "b")):
            env, argv = pd_serve.engine_command(self.s, role)
            self._spawn(role, host, argv, {
                **env, "HF_HUB_OFFLINE": "1", "NIXL_LOG_LEVEL": "WARN",
                # each engine its own compile and vLLM caches (docs/vllm.md, install notes)
                "TORCHINDUCTOR_CACHE_DIR": str(workdir / f"inductor-{name}-{role}"),
                "VLLM_CACHE_ROOT": str(cache_root(workdir, f"{name}-{role}"))}, workdir)
        for mode, port in MODES.items():
            self._spawn(f"proxy-{mode}", "a", pd_serve.proxy_command(self.s, mode, port),
                        pd_serve.proxy_env(self.s), workdir)
        try:
            self.wait_ready()
        except BaseException:  # its engines' processes (own sessions) must not outlive it
            self.stop()
            raise

    def _spawn(self, role: str, host: str, argv: list[str], env: dict, workdir: Path) -> None:
        log = workdir / f"{self.name}-{role}.log"
        self.logs[role] = log
        with open(log, "w") as f:
            f.write(f"$ {' '.join(argv)}\n")
            f.flush()
            # its own session: the engine's processes (engine core, workers) die with it
            self.procs[role] = self.hosts.spawn(host, argv, env={**os.environ, **env},
                                                stdout=f, stderr=subprocess.STDOUT, cwd=REPO,
                                                start_new_session=True)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        for role, host, port in (("prefill", "a", self.s.http_ports[0]),
                                 ("decode", "b", self.s.http_ports[1])):
            while True:
                r = self.http(host, f"http://127.0.0.1:{port}/health", None, timeout=5)
                if r["status"] == 200:
                    break
                dead = [r for r, p in self.procs.items() if p.poll() is not None]
                assert not dead and time.monotonic() < deadline, (
                    f"{self.name} {role} not ready ({r['body'][:200]}; exited: {dead})"
                    f"{self.tails()}")
                time.sleep(2)

    def http(self, host: str, url: str, body: dict | None, timeout: float = 240) -> dict:
        out = subprocess.run(["ip", "netns", "exec", self.hosts.ns[host], sys.executable, "-c",
                              CLIENT, url, "" if body is None else json.dumps(body),
                              str(timeout)], capture_output=True, text=True,
                             timeout=timeout + 30)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def complete(self, url: str, ids: list[int], what: str) -> list[int]:
        """The token ids ``url`` (``.../v1/completions``, reached from host A) answers."""
        r = self.http("a", url, pd_serve.request_body(self.s, ids, TOKENS))
        assert r["status"] == 200, f"{what}: HTTP {r['status']}: {r['body'][:500]}{self.tails()}"
        choice = json.loads(r["body"])["choices"][0]
        assert choice["token_ids"] and len(choice["token_ids"]) == TOKENS, choice
        return choice["token_ids"]

    def url(self, port: int) -> str:
        return f"http://{self.s.prefill.ip}:{port}/v1/completions"

    def decode_url(self) -> str:
        return f"http://{self.s.decode.ip}:{self.s.http_ports[1]}/v1/completions"

    def rx(self) -> int:
        """Bytes the decode's host received on the veth so far."""
        out = self.hosts.exec("b", "cat", f"/sys/class/net/{netns.IFACE}/statistics/rx_bytes")
        return int(out.stdout)

    def lines(self, role: str) -> list[str]:
        return self.logs[role].read_text(errors="replace").splitlines()

    def moved(self, since: int, role: str = "decode") -> int:
        """Bytes the decode's ranks logged as pulled or pushed to them, past line ``since`` (of
        ``role``'s log: a second decode's is ``decode-1``). A pull posted again on a fresh
        connection (its first post met a restarted prefill's old agent: ``restarts.py``) logs
        its line twice and counts once, its last."""
        got = {}
        for x in self.lines(role)[since:]:
            if m := MOVED.search(x):
                got[m.group(1, 2) if m.group(1) else m.group(0)] = int(m.group(3) or m.group(4))
        return sum(got.values())

    def hooked(self, since: int, n: int) -> list[int]:
        """Parts posted from layer hooks by each layer-wise write the prefill logged past line
        ``since``, once ``n`` are logged (it logs a write once it completed: it may trail
        the answer), or after 10 s."""
        deadline = time.monotonic() + 10
        while True:
            got = [int(m.group(1)) for x in self.lines("prefill")[since:]
                   if (m := HOOKED.search(x))]
            if len(got) >= n or time.monotonic() > deadline:
                return got
            time.sleep(0.2)

    def tails(self, n: int = 30) -> str:
        out = ""
        for role, log in self.logs.items():
            lines = log.read_text(errors="replace").splitlines() if log.exists() else []
            first = next((i for i, x in enumerate(lines) if "Traceback" in x), None)
            cause = "" if first is None else "\n[first traceback]\n" + "\n".join(
                lines[first:first + 25])
            out += f"\n--- {self.name} {role} ({log}) ---\n" + "\n".join(lines[-n:]) + cause
        return out

    def via_proxy(self, mode: str, ids: list[int], what: str) -> dict:
        """The plain run of ``ids``, then the same body through ``mode``'s proxy: equal tokens,
        no failed transfer, and at least the moved bytes on the link. Returns the numbers."""
        return self.via(self.url(MODES[mode]), ids, what)

    def via(self, url: str, ids: list[int], what: str,
            decodes: tuple[str, ...] = ("decode",)) -> dict:
        """:meth:`via_proxy` through the front at ``url`` (a proxy's or a router's). Also
        returns the prefill's request ids the decode pulled (``remote``: its pull lines'), and
        which of the decodes ``decodes`` (roles, all on host B) did: exactly one logged bytes
        moved (``decode``)."""
        plain = self.complete(self.url(self.s.http_ports[0]), ids, f"{what} plain run")
        since, rx = {d: len(self.lines(d)) for d in decodes}, self.rx()
        got = self.complete(url, ids, what)
        assert got == plain, f"{what}: tokens {got} != plain run {plain}{self.tails()}"
        # a push decode logs its write once its PUSHED came, which may trail the answer
        deadline = time.monotonic() + 10
        while not any((moved := {d: self.moved(since[d], d) for d in decodes}).values()) \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        crossed = self.rx() - rx
        failed = [x for d in decodes for x in self.lines(d)[since[d]:] if FAILED.search(x)]
        assert not failed, f"{what}: {failed}{self.tails()}"
        served = [d for d, n in moved.items() if n]
        assert served, f"{what}: the decode logged no bytes moved{self.tails()}"
        assert len(served) == 1, f"{what}: decodes {served} all logged bytes moved"
        d, n = served[0], moved[served[0]]
        assert crossed >= n, f"{what}: {crossed} bytes crossed the veth < {n} moved"
        remote = sorted({m.group(1) for x in self.lines(d)[since[d]:]
                         if (m := PULLED_FROM.search(x))})
        return {"moved": n, "crossed": crossed, "remote": remote, "decode": d}

    def kv_usage(self, role: str = "prefill", **at: tuple[str, int]) -> float:
        """``vllm:kv_cache_usage_perc`` of ``role``'s engine (its ``/metrics``, from its host):
        the fraction of its KV blocks in use (held ones included; prefix-cached free ones
        not). Another engine's role: ``kv_usage(role, **{role: (host, port)})``."""
        host, port = {"prefill": ("a", self.s.http_ports[0]),
                      "decode": ("b", self.s.http_ports[1])}.get(role) or at[role]
        r = self.http(host, f"http://127.0.0.1:{port}/metrics", None, timeout=10)
        assert r["status"] == 200, f"{role} /metrics: HTTP {r['status']}: {r['body'][:200]}"
        m = re.search(r"^vllm:kv_cache_usage_perc\{[^}]*\} (\S+)$", r["body"], re.M)
        assert m, f"{role} /metrics has no vllm:kv_cache_usage_perc"
        return float(m.group(1))

    def kill(self, role: str) -> None:
        """SIGKILL ``role``'s session (an engine's API server, engine core and workers) and
        wait until none of it runs; the set is marked dead (the fixture starts it anew)."""
        self.dead = True
        p = self.procs[role]
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=30)  # our child: reaped here, or a zombie until the fixture ends
        end = time.monotonic() + 30
        while _group_alive(p.pid):
            assert time.monotonic() < end, f"{self.name} {role}: alive 30 s after SIGKILL"
            time.sleep(0.1)

    def drop(self, role: str) -> None:
        """SIGKILL the session of ``role``, a process a test added to the set, wait until none
        of it runs, and forget it: unlike :meth:`kill` the set stays alive."""
        p = self.procs.pop(role)
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(timeout=30)
        end = time.monotonic() + 30
        while _group_alive(p.pid):
            assert time.monotonic() < end, f"{self.name} {role}: alive 30 s after SIGKILL"
            time.sleep(0.1)

    def wait_health(self, role: str, host: str, port: int) -> None:
        """Until ``/health`` at ``port`` on ``host`` answers 200 (``role``: the process that
        serves it, which must not exit meanwhile)."""
        deadline = time.monotonic() + START_TIMEOUT
        while (r := self.http(host, f"http://{netns.ADDRS[host]}:{port}/health", None,
                              timeout=5))["status"] != 200:
            assert self.procs[role].poll() is None and time.monotonic() < deadline, (
                f"{self.name} {role} not ready ({r['body'][:200]}){self.tails()}")
            time.sleep(1)

    def released_by(self, rid: str, roles: tuple[str, ...], since: dict[str, int]) -> str:
        """Which of the prefills ``roles`` logged its hold of request ``rid`` released (its
        decode's CONFIRM), past their lines ``since``; within 10 s (the log may trail)."""
        line = f"kvplan: prefill req={rid} released"
        deadline = time.monotonic() + 10
        while not (who := [r for r in roles if any(line in x for x in
                                                   self.lines(r)[since[r]:])]):
            assert time.monotonic() < deadline, f"no prefill released req={rid}{self.tails()}"
            time.sleep(0.2)
        assert len(who) == 1, (rid, who)
        return who[0]

    def stop(self) -> None:
        """SIGTERM every process's session (vLLM shuts its workers down), SIGKILL what is
        left after 10 s."""
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 30)):
            for p in self.procs.values():
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
            end = time.monotonic() + wait
            while time.monotonic() < end and any(_group_alive(p.pid)
                                                 for p in self.procs.values()):
                time.sleep(0.2)
        for p in self.procs.values():
            p.wait(timeout=30)


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs. Zombies do not count: ``killpg(pgid,
    0)`` succeeds while a killed engine's orphaned workers wait, dead, for a reaper (this
    machine's PID 1 may never reap them), so it would report a killed group alive."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:  # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses
            state, _, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
        if int(pgrp) == pgid and state != "Z":
            return True
    return False


@pytest.fixture(scope="module")
def hosts():
    with netns.TwoHosts() as h:
        yield h


@pytest.fixture(scope="module")
def sets(hosts, pool):
    """Engine sets by name, one alive at a time (a new one stops the previous). Their servers
    are started here, not by the session's ``pool`` (whose model writer they use): room is made
    for them among its parked engines."""
    live: dict[str, Serving] = {}

    def get(name: str) -> Serving:
        if name not in live or live[name].dead:  # a set a test killed is started anew
            for old in list(live):
                live.pop(old).stop()
            model, tp = {"llama": ("llama", 1), "nemo1-tp2": ("nemo1", 2)}[name]
            pool.only()  # park the pool's engines: the cores go to these servers
            pool.make_room(ENGINE_GIB[1] + ENGINE_GIB[tp])
            live[name] = Serving(hosts, pool.py, pool.workdir, pool.model(model),
                                 decode_tp=tp, name=name)
        return live[name]

    yield get
    for s in live.values():
        s.stop()


N = 100  # prompt tokens: the hybrid's under one 128-token block


def modes(s: Serving, name: str) -> None:
    for k, mode in enumerate(MODES):
        since = len(s.lines("prefill"))
        got = s.via_proxy(mode, prompt(1000 * k + N, N), f"{name} {mode}")
        print(f"{name} {mode}: {got['moved']} bytes moved, {got['crossed']} crossed the veth")
        if mode == "layerwise":  # written from the forward's layer hooks, not whole after it
            hooked = s.hooked(since, 1)
            assert hooked and min(hooked) >= 1, f"{name}: hooks {hooked}{s.tails()}"


def control(s: Serving, name: str) -> None:
    """Without the proxy the decode computes the prompt itself: the same tokens, nothing
    logged as moved, and the link carries less than one transfer of the prompt did."""
    moved = s.via_proxy("pull", prompt(7, N), f"{name} control's pull")["moved"]
    ids = prompt(8, N)
    plain = s.complete(s.url(s.s.http_ports[0]), ids, f"{name} control's plain run")
    since, rx = len(s.lines("decode")), s.rx()
    got = s.complete(s.decode_url(), ids, f"{name} straight to the decode")
    crossed = s.rx() - rx
    assert got == plain, f"{name}: the decode alone answered {got}, the prefill {plain}"
    assert s.moved(since) == 0, f"{name}: the decode logged a transfer it was not asked for"
    assert crossed < moved, f"{name}: {crossed} bytes crossed without a transfer, {moved} with"
    print(f"{name} control: {crossed} bytes crossed without a transfer, {moved} moved with one")


def test_layerwise_wait_takes_zero_and_refuses_a_negative_naming_the_key(vllm_python):
    """``layerwise_wait_s`` (the prefill's bounded wait for a registration before its forward)
    is checked at start like every key; 0 turns the wait off (in the vLLM venv: the connector
    package imports vLLM)."""
    check = (
        "from kvplan_nixl.serving.settings import Settings\n"
        "s = lambda v: Settings('e', 'h', 5700, 1, extra={'layerwise_wait_s': v})\n"
        "assert s(0).seconds('layerwise_wait_s', 1.0, zero=True) == 0.0\n"
        "assert Settings('e', 'h', 5700, 1).seconds('layerwise_wait_s', 1.0, zero=True) == 1\n"
        "for bad in (-1, 'soon', float('inf')):\n"
        "    try:\n"
        "        s(bad).seconds('layerwise_wait_s', 1.0, zero=True)\n"
        "    except ValueError as e:\n"
        "        assert \"['layerwise_wait_s'] must be a number of seconds >= 0\" in str(e), e\n"
        "    else:\n"
        "        raise AssertionError(bad)\n"
        "print('ok')\n")
    r = subprocess.run([str(vllm_python), "-c", check], capture_output=True, text=True, timeout=300,
                       cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


# file order: every test of one engine set, then the next set's

@pytest.mark.engines("http")
def test_dense_tp1_to_tp1_in_every_mode_equals_the_plain_run(sets):
    modes(sets("llama"), "llama TP1 -> TP1")


@pytest.mark.engines("http")
def test_dense_negative_control_straight_to_the_decode(sets):
    control(sets("llama"), "llama TP1 -> TP1")


@pytest.mark.engines("http")
def test_layerwise_requests_are_written_from_the_layer_hooks(sets):
    """Both legs sent at once, as the proxy sends them: every layer-wise request's KV is
    written from the prefill's layer hooks, none pushed whole for want of a registration."""
    s = sets("llama")
    n, since = 6, len(s.lines("prefill"))
    for i in range(n):
        s.via_proxy("layerwise", prompt(5000 + i, N), f"layer-wise request {i}")
    hooked = s.hooked(since, n)
    whole = [x for x in s.lines("prefill")[since:] if WHOLE.search(x)]
    print(f"layer-wise: {sum(h > 0 for h in hooked)} of {n} written from layer hooks")
    assert not whole and len(hooked) == n and min(hooked) >= 1, (hooked, whole)


#: vllm-router (tests/router_env.py) in front of the llama set, on host A: ``router`` over
#: both prefills and the set's decode; ``router-deadleg`` over the second prefill and a decode
#: killed before its leg. The second prefill (host A, core 0 beside the first) has its own
#: engine id and ports, and the lease docs/vllm.md recommends behind the router (which sends
#: no RELEASE): ``lease_s`` 30.
ROUTER_PORT, DEADLEG_PORT, FAKE_DECODE_PORT = 8010, 8011, 8299
SECOND = {"engine_id": "prefill-1", "http": 8101, "side": 5710}
ROUTER_LEASE_S = 30.0
#: the router's health checks (default: every 60 s, 3 failures): how soon it stops routing to
#: a dead prefill (docs/vllm.md)
ROUTER_HEALTH = ["--health-check-interval-secs", "2", "--health-failure-threshold", "2"]

#: a decode's stand-in for ``router-deadleg``: answers the router's start-up GETs (``/health``,
#: ``/metrics``), then is killed, so that the router's decode leg finds nothing listening
FAKE_DECODE = r"""
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")
    def log_message(self, *a):
        pass
ThreadingHTTPServer((sys.argv[1], int(sys.argv[2])), H).serve_forever()
"""


def second_prefill(s: Serving) -> tuple[dict, list[str]]:
    """(environment, argv) of a second prefill beside the set's, built by pd_serve as the
    first is, with its own HTTP and side channel ports, engine id and ``lease_s``."""
    setup = dataclasses.replace(
        s.s, http_ports=(SECOND["http"], *s.s.http_ports[1:]),
        side_ports=(SECOND["side"], s.s.side_ports[1]),
        extra_config={**s.s.extra_config, "lease_s": ROUTER_LEASE_S})
    env, argv = pd_serve.engine_command(setup, "prefill")
    assert argv[-2] == "--kv-transfer-config", argv
    argv[-1] = json.dumps({**json.loads(argv[-1]), "engine_id": SECOND["engine_id"]})
    return {**env, "HF_HUB_OFFLINE": "1", "NIXL_LOG_LEVEL": "WARN",
            "TORCHINDUCTOR_CACHE_DIR": str(s.workdir / f"inductor-{s.name}-prefill-1"),
            "VLLM_CACHE_ROOT": str(cache_root(s.workdir, f"{s.name}-prefill-1"))}, argv


def router_binary() -> Path:
    """vllm-router's binary (installed once, tests/router_env.py), or the test skipped with the
    reason printed."""
    try:
        return router_env.ensure()
    except router_env.EnvUnavailable as e:
        print(f"skipped: vllm-router unavailable: {e}")
        pytest.skip(f"vllm-router unavailable: {e}")


def router_command(binary: Path, prefills: list[str], decodes: list[str], port: int,
                   extra: list[str]) -> list[str]:
    """vllm-router's P/D line (docs/vllm.md), round robin so that requests alternate."""
    argv = [str(binary), "--vllm-pd-disaggregation", "--kv-connector", "nixl",
            "--policy", "round_robin"]
    for u in prefills:
        argv += ["--prefill", u]
    for u in decodes:
        argv += ["--decode", u]
    return [*argv, "--host", netns.ADDRS["a"], "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(port + 21000), *extra]


@pytest.mark.engines("http")
def test_dense_behind_vllm_router_two_prefills_a_dead_decode_leg_a_killed_prefill_restarted(
        sets, pool):
    """vllm-router 0.1.17 in front of the llama set and a second prefill (one engine start
    more), pull mode, on the two hosts:

    - requests through the router alternate over both prefills (round robin), each answer
      equal to the plain run, its KV pulled (bytes logged moved and crossing the veth, no
      failed transfer), and the prefill that served it is the one whose hold its decode's
      CONFIRM ended;
    - a decode leg that fails (``router-deadleg``'s decode killed after the router started):
      the router answers 500 naming the decode and sends no RELEASE, so the prefill keeps the
      request's blocks until its lease (30 s, docs/vllm.md's advice behind the router) runs
      out, logged ``lease of 30 s ran out`` (not ``released``) no sooner than the lease after
      the request was sent and within 15 s after the lease from the router's answer; its KV
      usage then back to idle;
    - the second prefill SIGKILLed while requests keep coming: every 200 equal to the plain
      run, every other answer a 500 naming that prefill (vllm-router's P/D mode does not
      retry: docs/vllm.md), and once its health checks marked it down every request goes to
      the first prefill and pulls its KV;
    - that prefill restarted in place (its line again: same ports and engine id, as an
      orchestrator restarts a crashed pod): the router marks it healthy, and requests again
      reach both prefills, each pulled from the incarnation that served its prefill leg.

    The set stays alive (the routers and the stand-in are this test's); so does the second
    prefill where the test passed, for the two-decode test that follows."""
    binary = router_binary()
    s = sets("llama")
    t0 = time.monotonic()  # the set's own start (if this test is its first) not counted
    a, b = netns.ADDRS["a"], netns.ADDRS["b"]
    p0, p1 = f"http://{a}:{s.s.http_ports[0]}", f"http://{a}:{SECOND['http']}"
    decode, fake = f"http://{b}:{s.s.http_ports[1]}", f"http://{b}:{FAKE_DECODE_PORT}"
    router, deadleg = (f"http://{a}:{p}/v1/completions" for p in (ROUTER_PORT, DEADLEG_PORT))
    prefills = ("prefill", "prefill-1")
    pool.make_room(ENGINE_GIB[1])
    passed = False
    try:
        env, argv = second_prefill(s)
        s._spawn("prefill-1", "a", argv, env, s.workdir)
        s._spawn("fake-decode", "b", [sys.executable, "-c", FAKE_DECODE, b,
                                      str(FAKE_DECODE_PORT)], {}, s.workdir)
        s.wait_health("prefill-1", "a", SECOND["http"])
        started = time.monotonic() - t0
        s.wait_health("fake-decode", "b", FAKE_DECODE_PORT)
        s._spawn("router", "a", router_command(binary, [p0, p1], [decode], ROUTER_PORT,
                                               ROUTER_HEALTH), {}, s.workdir)
        s._spawn("router-deadleg", "a", router_command(binary, [p1], [fake], DEADLEG_PORT, []),
                 {}, s.workdir)
        s.wait_health("router", "a", ROUTER_PORT)
        s.wait_health("router-deadleg", "a", DEADLEG_PORT)

        # the decode leg fails: the stand-in killed (its router checks health every 60 s)
        s.drop("fake-decode")
        idle1 = s.kv_usage("prefill-1", **{"prefill-1": ("a", SECOND["http"])})
        since1 = len(s.lines("prefill-1"))
        sent_at = time.monotonic()
        r = s.http("a", deadleg, pd_serve.request_body(s.s, prompt(9100, N), TOKENS))
        failed_at = time.monotonic()
        assert r["status"] == 500 and f"Decode request failed to {fake}/v1/completions" in \
            r["body"], f"dead decode leg: HTTP {r['status']}: {r['body'][:300]}{s.tails()}"
        held = s.kv_usage("prefill-1", **{"prefill-1": ("a", SECOND["http"])})
        assert held > idle1, f"prefill-1 holds nothing after the failed leg: {held} <= {idle1}"

        # while its lease runs: requests spread over both prefills, each KV pulled
        served = {p: 0 for p in prefills}
        for i in range(4):
            since = {p: len(s.lines(p)) for p in prefills}
            got = s.via(router, prompt(9200 + i, N), f"router request {i}")
            assert len(got["remote"]) == 1, got
            served[s.released_by(got["remote"][0], prefills, since)] += 1
        print(f"vllm-router: 4 requests, served by {served}, each pulled")
        assert all(served.values()), f"round robin left a prefill idle: {served}"

        # the failed leg's hold: freed by the lease, not by a RELEASE
        lease = re.compile(r"kvplan: prefill req=(\S+) (lease of \S+ s ran out|released)")
        while not (ended := [m.groups() for x in s.lines("prefill-1")[since1:]
                             if (m := lease.search(x)) and m.group(2).startswith("lease")]):
            assert time.monotonic() < failed_at + ROUTER_LEASE_S + 15, (
                f"prefill-1 kept the dead leg's hold {ROUTER_LEASE_S + 15} s{s.tails()}")
            time.sleep(0.2)
        freed = time.monotonic() - failed_at
        assert len(ended) == 1 and ended[0][1] == f"lease of {ROUTER_LEASE_S:g} s ran out", ended
        # the hold began after the request was sent (its prefill ran first), so its end is
        # seen no sooner than the lease after the send; the router's answer may trail the
        # hold's start by seconds on a loaded host, so it is no lower bound
        assert time.monotonic() - sent_at >= ROUTER_LEASE_S, (
            f"hold ended {time.monotonic() - sent_at:.1f} s after the request was sent")
        released = [x for x in s.lines("prefill-1")[since1:]
                    if f"req={ended[0][0]} released" in x]
        assert not released, released
        while (usage := s.kv_usage("prefill-1", **{"prefill-1": ("a", SECOND["http"])})) \
                > idle1:
            assert time.monotonic() < failed_at + ROUTER_LEASE_S + 25, (usage, idle1)
            time.sleep(0.5)
        print(f"dead decode leg: 500 from the router; prefill-1 req={ended[0][0]} held until "
              f"its lease ran out, seen {freed:.1f} s after the answer (lease_s "
              f"{ROUTER_LEASE_S:g}); KV usage {held} while held, back to {usage} (idle "
              f"{idle1})")

        # the second prefill killed while requests keep coming
        k = 8
        plain = [s.complete(s.url(s.s.http_ports[0]), prompt(9300 + i, N), f"plain run {i}")
                 for i in range(k)]
        answers: list[tuple[int, dict]] = []

        def client() -> None:
            for i in range(k):
                answers.append((i, s.http("a", router, pd_serve.request_body(
                    s.s, prompt(9300 + i, N), TOKENS))))

        th = threading.Thread(target=client)
        th.start()
        try:
            while len(answers) < 2 and th.is_alive():
                time.sleep(0.05)
            s.drop("prefill-1")
            killed_after = len(answers)
        finally:
            th.join(timeout=600)
        ok = errors = 0
        for i, r in answers:
            if r["status"] == 200:
                got = json.loads(r["body"])["choices"][0]["token_ids"]
                assert got == plain[i], f"request {i}: {got} != plain run {plain[i]}"
                ok += 1
            else:
                assert r["status"] == 500 and p1 in r["body"], (
                    f"request {i}: HTTP {r['status']}: {r['body'][:300]}")
                errors += 1
        print(f"prefill-1 killed after {killed_after} of {k} answers: {ok} answered 200, equal "
              f"to the plain run; {errors} answered 500 naming {p1}")
        assert ok + errors == k and ok >= k // 2, (ok, errors)
        # marked down within its health checks: then everything goes to the first prefill
        deadline = time.monotonic() + 30
        while True:
            w = s.http("a", f"http://{a}:{ROUTER_PORT}/workers", None, timeout=10)
            down = [x["url"] for x in json.loads(w["body"])["workers"] if not x["is_healthy"]]
            if down == [p1]:
                break
            assert time.monotonic() < deadline, f"router's workers after the kill: {w['body']}"
            time.sleep(0.5)
        for i in range(2):
            since = {"prefill": len(s.lines("prefill"))}
            got = s.via(router, prompt(9400 + i, N), f"after the kill, request {i}")
            assert s.released_by(got["remote"][0], ("prefill",), since) == "prefill"

        # prefill-1 restarted in place: the same line, so the same address, ports and
        # engine id. The router marks it healthy again, and the decode, which held a
        # connection to the killed incarnation, connects to the new one afresh: each of its
        # requests pulls (``via`` fails on a failed pull, which a stale connection would be)
        restarted_at = time.monotonic()
        s._spawn("prefill-1", "a", argv, env, s.workdir)
        s.wait_health("prefill-1", "a", SECOND["http"])
        while True:
            w = s.http("a", f"http://{a}:{ROUTER_PORT}/workers", None, timeout=10)
            if all(x["is_healthy"] for x in json.loads(w["body"])["workers"]):
                break
            assert time.monotonic() < restarted_at + START_TIMEOUT, w["body"]
            time.sleep(0.5)
        back = time.monotonic() - restarted_at
        served = {p: 0 for p in prefills}
        for i in range(4):
            since = {p: len(s.lines(p)) for p in prefills}
            got = s.via(router, prompt(9500 + i, N), f"after the restart in place, request {i}")
            assert len(got["remote"]) == 1, got
            served[s.released_by(got["remote"][0], prefills, since)] += 1
        assert served["prefill-1"] >= 1, f"the restarted prefill served nothing: {served}"
        print(f"prefill-1 restarted in place (engine id {SECOND['engine_id']!r}, side channel "
              f"{SECOND['side']}): healthy to the router {back:.0f} s after its start; 4 "
              f"requests served by {served}, each pulled and equal to the plain run")
        print(f"vllm-router test: the second prefill started in {started:.0f} s, the test "
              f"took {time.monotonic() - t0:.0f} s with it (the set's start not counted)")
        passed = True
    finally:
        # the second prefill, healthy once the test passed, is left for the next test's
        # routers (one engine start less); otherwise it goes with the rest
        for role in ("router", "router-deadleg", "fake-decode",
                     *(() if passed else ("prefill-1",))):
            if role in s.procs:
                s.drop(role)


#: the two-decode test's: a second decode on host B beside the first (core 1, its own HTTP
#: and side channel ports, the router's lease), ``router-2d`` over both prefills and both
#: decodes, ``router-killd`` over the second prefill (the one with the router's lease) and both
#: decodes, the decode killed under it
SECOND_DECODE = {"http": 8201, "side": 5810}
ROUTER2D_PORT, KILLD_PORT = 8012, 8013
#: the ids vllm-router gives a request (its X-Request-Id, in vLLM's completion id ``cmpl-ID``
#: and at the head of the prefill's request id): the prefill and the decode it chose
ROUTED = re.compile(r"___prefill_addr_(\S+?)___decode_addr_(\S+?)_[0-9a-f]{32}")
HOLD_ENDED = re.compile(r"kvplan: prefill req=(\S+) (lease of \S+ s ran out|released)")


def second_decode(s: Serving) -> tuple[dict, list[str]]:
    """(environment, argv) of a second decode beside the set's, built by pd_serve as the
    first is, with its own HTTP and side channel ports and ``lease_s``."""
    setup = dataclasses.replace(
        s.s, http_ports=(s.s.http_ports[0], SECOND_DECODE["http"], s.s.http_ports[2]),
        side_ports=(s.s.side_ports[0], SECOND_DECODE["side"]),
        extra_config={**s.s.extra_config, "lease_s": ROUTER_LEASE_S})
    env, argv = pd_serve.engine_command(setup, "decode")
    return {**env, "HF_HUB_OFFLINE": "1", "NIXL_LOG_LEVEL": "WARN",
            "TORCHINDUCTOR_CACHE_DIR": str(s.workdir / f"inductor-{s.name}-decode-1"),
            "VLLM_CACHE_ROOT": str(cache_root(s.workdir, f"{s.name}-decode-1"))}, argv


def routed_to(r: dict) -> str | None:
    """The decode (``http://HOST:PORT``) a 200 from vllm-router came from, by its id."""
    if r["status"] != 200:
        return None
    rid = json.loads(r["body"])["id"]
    m = ROUTED.search(rid)
    assert m, f"the router's answer's id {rid!r} names no decode"
    return f"http://{m.group(2)}"


@pytest.mark.engines("http")
def test_dense_behind_vllm_router_two_prefills_two_decodes_a_killed_decode(sets, pool):
    """vllm-router 0.1.17 over two prefills and two decodes of the llama set, pull mode, on
    the two hosts: the set's prefill and decode, the second prefill the previous test left
    (started here when run alone), and a second decode on host B, ``decode-1``. Four engines
    on two cores: both prefills pinned to core 0 on host A, both decodes to core 1 on host B;
    they carry requests sent one at a time (the set's proxies, the routers and the clients
    share the cores unpinned).

    - requests through ``router-2d`` (round robin) reach both prefills and both decodes, each
      answer equal to the plain run, its KV pulled by the decode that served it (bytes logged
      moved there and crossing the veth, no failed transfer), its hold ended by that
      decode's CONFIRM on the prefill that served its prefill leg;
    - ``decode-1`` SIGKILLed (API server, engine core, worker) while a client sends requests
      in a row through ``router-killd`` (the second prefill, both decodes; health checks
      every 2 s, 2 failures: docs/vllm.md): killed right after an answer the surviving decode
      gave, so that the next request, which round robin sends to ``decode-1``, meets it dead.
      Every 200 equal to the plain run; every other answer a 500 naming ``decode-1`` (no
      retry to the other decode in P/D mode); the prefill's hold of each request whose
      decode leg failed ends by its lease (30 s, not by a RELEASE: the router sends none),
      logged ``lease of 30 s ran out`` no sooner than the lease after the request was sent
      and within 15 s after the lease from the router's 500, and its KV usage back to idle;
      the holds of the 200s end by their CONFIRMs (``released``);
    - once the router's health checks marked ``decode-1`` down, every request goes to the
      surviving decode and pulls its KV.

    The set stays alive (the second prefill, the second decode and the routers are this
    test's: stopped at its end)."""
    binary = router_binary()
    s = sets("llama")
    t0 = time.monotonic()  # the set's own start (if this test is its first) not counted
    a, b = netns.ADDRS["a"], netns.ADDRS["b"]
    p0, p1 = f"http://{a}:{s.s.http_ports[0]}", f"http://{a}:{SECOND['http']}"
    d0, d1 = f"http://{b}:{s.s.http_ports[1]}", f"http://{b}:{SECOND_DECODE['http']}"
    router, killd = (f"http://{a}:{p}/v1/completions" for p in (ROUTER2D_PORT, KILLD_PORT))
    prefills, decodes = ("prefill", "prefill-1"), ("decode", "decode-1")
    stop = threading.Event()
    try:
        pool.make_room(ENGINE_GIB[1])
        env, argv = second_decode(s)
        s._spawn("decode-1", "b", argv, env, s.workdir)
        reused = "prefill-1" in s.procs and s.procs["prefill-1"].poll() is None
        if not reused:  # run alone, or the previous test failed: started here
            if "prefill-1" in s.procs:
                s.drop("prefill-1")
            pool.make_room(ENGINE_GIB[1])
            penv, pargv = second_prefill(s)
            s._spawn("prefill-1", "a", pargv, penv, s.workdir)
        s.wait_health("prefill-1", "a", SECOND["http"])
        s.wait_health("decode-1", "b", SECOND_DECODE["http"])
        started = time.monotonic() - t0
        s._spawn("router-2d", "a", router_command(binary, [p0, p1], [d0, d1], ROUTER2D_PORT,
                                                  ROUTER_HEALTH), {}, s.workdir)
        s._spawn("router-killd", "a", router_command(binary, [p1], [d0, d1], KILLD_PORT,
                                                     ROUTER_HEALTH), {}, s.workdir)
        s.wait_health("router-2d", "a", ROUTER2D_PORT)
        s.wait_health("router-killd", "a", KILLD_PORT)

        # both prefills and both decodes serve, each request pulled by the decode it went to
        pairs: dict[tuple[str, str], int] = {}
        for i in range(4):
            since = {p: len(s.lines(p)) for p in prefills}
            got = s.via(router, prompt(9600 + i, N), f"two decodes, request {i}", decodes)
            assert len(got["remote"]) == 1, got
            pair = (s.released_by(got["remote"][0], prefills, since), got["decode"])
            pairs[pair] = pairs.get(pair, 0) + 1
        print(f"vllm-router over two prefills and two decodes: 4 requests, (prefill, decode) "
              f"pairs {pairs}, each pulled and equal to the plain run")
        assert {p for p, _ in pairs} == set(prefills), f"a prefill served nothing: {pairs}"
        assert {d for _, d in pairs} == set(decodes), f"a decode served nothing: {pairs}"

        # decode-1 killed while requests keep coming through router-killd. The second
        # prefill's hold ends are watched from here on, each with the moment it was seen
        since1, since_d = len(s.lines("prefill-1")), len(s.lines("decode"))
        ends: dict[str, tuple[str, float]] = {}  # by request id: how, when seen
        ends_lock = threading.Lock()

        def watch() -> None:
            while not stop.wait(0.2):
                lines = s.lines("prefill-1")[since1:]
                with ends_lock:
                    for x in lines:
                        if (m := HOLD_ENDED.search(x)) and m.group(1) not in ends:
                            ends[m.group(1)] = (m.group(2), time.monotonic())

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        idle1 = s.kv_usage("prefill-1", **{"prefill-1": ("a", SECOND["http"])})
        k = 10
        plain = [s.complete(s.url(s.s.http_ports[0]), prompt(9700 + i, N), f"plain run {i}")
                 for i in range(k)]
        answers: list[tuple[int, dict, float, float]] = []  # (i, answer, sent, answered)

        def client() -> None:
            for i in range(k):
                sent = time.monotonic()
                r = s.http("a", killd, pd_serve.request_body(s.s, prompt(9700 + i, N), TOKENS))
                answers.append((i, r, sent, time.monotonic()))

        th = threading.Thread(target=client)
        th.start()
        try:
            # right after an answer from the surviving decode: the request on its way now is
            # round robin's next, decode-1's
            while not (len(answers) >= 2 and routed_to(answers[-1][1]) == d0):
                by = [routed_to(r) for _, r, _, _ in answers]
                assert th.is_alive() and len(answers) < k - 3, (
                    f"no answer from {d0} to kill after: {by}{s.tails()}")
                time.sleep(0.02)
            killed_after, killed_at = len(answers), time.monotonic()
            s.drop("decode-1")
            # marked down within its health checks, while the client's requests keep coming
            deadline = time.monotonic() + 30
            while True:
                w = s.http("a", f"http://{a}:{KILLD_PORT}/workers", None, timeout=10)
                down = [x["url"] for x in json.loads(w["body"])["workers"]
                        if not x["is_healthy"]]
                if down == [d1]:
                    break
                assert time.monotonic() < deadline, f"router's workers after the kill: {w}"
                time.sleep(0.2)
            marked = time.monotonic() - killed_at
        finally:
            th.join(timeout=600)
        assert len(answers) == k, f"{len(answers)} of {k} answered"
        ok: list[tuple[int, str]] = []
        failed: list[int] = []
        for i, r, sent, _ in answers:
            if r["status"] == 200:
                got = json.loads(r["body"])["choices"][0]["token_ids"]
                assert got == plain[i], f"request {i}: {got} != plain run {plain[i]}"
                ok.append((i, routed_to(r)))
                # sent once the router had marked decode-1 down: the survivor's
                assert sent < killed_at + marked or ok[-1][1] == d0, (i, ok[-1])
            else:
                assert r["status"] == 500 and f"Decode request failed to {d1}/v1/completions" \
                    in r["body"], f"request {i}: HTTP {r['status']}: {r['body'][:300]}"
                assert i >= killed_after, f"request {i} failed before the kill: {r['body']}"
                assert sent < killed_at + marked, f"request {i} failed after the marking"
                failed.append(i)
        print(f"decode-1 killed after {killed_after} of {k} answers, marked down by "
              f"router-killd {marked:.1f} s after the kill: {len(ok)} answered 200, equal to the "
              f"plain run ({sum(d == d0 for _, d in ok)} by {d0}); {len(failed)} answered 500 "
              f"naming {d1}. By request:")
        for i, r, sent, _ in answers:
            print(f"  {i}: sent {sent - killed_at:+.1f} s after the kill, "
                  + (f"200 from {routed_to(r)}" if r["status"] == 200 else
                     f"{r['status']}: {r['body'][:400]}"))
        assert failed, f"no request met the killed decode: {ok}"
        assert not [x for x in s.lines("decode")[since_d:] if FAILED.search(x)]

        # then every request goes to the survivor
        later = set()
        for i in range(3):
            since = {"prefill-1": len(s.lines("prefill-1"))}
            got = s.via(killd, prompt(9800 + i, N), f"after the decode's kill, request {i}")
            assert got["decode"] == "decode" and len(got["remote"]) == 1, got
            assert s.released_by(got["remote"][0], ("prefill-1",), since) == "prefill-1"
            later.add(got["remote"][0])
        print(f"3 requests after the marking, each served by {d0}, pulled and equal to the "
              f"plain run")

        # every request of the run held by prefill-1 once (its prefill leg ran there): a
        # 200's hold ended by its CONFIRM, a failed leg's by the lease
        last = max(done for i, _, _, done in answers if i in failed)
        while True:
            with ends_lock:
                run = {r: v for r, v in ends.items() if r not in later}
            if len(run) >= k:
                break
            assert time.monotonic() < last + ROUTER_LEASE_S + 15, (
                f"prefill-1 ended {len(run)} of the run's {k} holds {ROUTER_LEASE_S + 15:g} s "
                f"after the last 500: {run}{s.tails()}")
            time.sleep(0.2)
        assert len(run) == k, run
        for i, _ in ok:
            rid = json.loads(answers[i][1]["body"])["id"]
            mine = [v[0] for r, v in run.items() if r.startswith(f"{rid}-")]
            assert mine == ["released"], f"request {i} ({rid}): {mine}"
        rest = {r: v for r, v in run.items() if not any(
            r.startswith(json.loads(answers[i][1]["body"])["id"] + "-") for i, _ in ok)}
        assert len(rest) == len(failed), (rest, failed)
        assert all(f"decode_addr_{d1[len('http://'):]}_" in r for r in rest), rest
        leased = sorted(t for how, t in rest.values() if how != "released")
        assert all(how in ("released", f"lease of {ROUTER_LEASE_S:g} s ran out")
                   for how, _ in rest.values()), rest
        # a failed leg's hold is confirmed only by a decode that pulled before it died: the
        # request on its way at the kill, the first to fail; the others' ran out
        assert len(leased) >= len(failed) - 1 and leased, (
            f"holds of the failed legs: {rest}{s.tails()}")
        times = []
        for i, seen in zip(failed[len(failed) - len(leased):], leased):
            _, _, sent, done = answers[i]
            # the hold began after the request was sent (its prefill leg ran first)
            assert seen - sent >= ROUTER_LEASE_S, (i, seen - sent)
            times.append(f"{seen - done:.1f}")
        while (usage := s.kv_usage("prefill-1", **{"prefill-1": ("a", SECOND["http"])})) \
                > idle1:
            assert time.monotonic() < last + ROUTER_LEASE_S + 25, (usage, idle1)
            time.sleep(0.5)
        print(f"killed decode: {len(leased)} of the {len(failed)} failed legs' holds on "
              f"prefill-1 ran out their lease, seen {', '.join(times)} s after the router's "
              f"500 (lease_s {ROUTER_LEASE_S:g}), {len(failed) - len(leased)} released by the "
              f"decode's CONFIRM before it died; KV usage back to {usage} (idle {idle1})")
        print(f"vllm-router two-decode test: the second decode started in {started:.0f} s "
              f"(the second prefill {'reused' if reused else 'started too'}), the test took "
              f"{time.monotonic() - t0:.0f} s with it (the set's start not counted)")
    finally:
        stop.set()
        for role in ("router-2d", "router-killd", "decode-1", "prefill-1"):
            if role in s.procs:
                s.drop(role)


#: the engines' lease_s: pd_serve sets none, so the connector's default (kvplan_nixl.vllm)
LEASE_S = float(pd_serve.kv_config(pd_serve.DOCS_ONE_HOST, "prefill")
                ["kv_connector_extra_config"].get("lease_s", 120.0))
#: seconds from the proxy's 502 within which the prefill must log its hold released
RELEASED_WITHIN = 10.0


@pytest.mark.engines("http")
def test_dense_proxy_answers_a_dead_decode_502_and_releases_the_prefills_hold_at_once(sets):
    """The decode SIGKILLed (API server, engine core, worker): a request through the pull
    proxy is answered 502 naming the decode, after the prefill ran it (its hold made: the
    proxy's RELEASE is answered YES, "a live hold ended"), and the prefill logs the hold
    released within ``RELEASED_WITHIN`` s of the answer, its KV blocks back to idle usage.

    Why this proves the RELEASE (the negative control): with the decode dead nothing else
    ends the hold, no CONFIRM and no heartbeat come, so without the proxy's RELEASE the
    prefill keeps the blocks until its lease runs out, ``LEASE_S`` (120 s) after the prefill,
    and logs ``lease of 120 s ran out`` rather than ``released``: a proxy that sent no RELEASE
    fails the time bound by over 100 s and the log check outright. Then the prefill killed
    too (kill order: a dead prefill is answered before the decode leg is tried): 502 naming
    the prefill. Kills the set: the fixture starts it anew if asked again."""
    assert LEASE_S >= 10 * RELEASED_WITHIN, (LEASE_S, RELEASED_WITHIN)
    s = sets("llama")
    deadline = time.monotonic() + 30  # the earlier tests' holds end with their CONFIRMs
    while (idle := s.kv_usage()) > 0:
        assert time.monotonic() < deadline, f"prefill KV usage {idle} with nothing held"
        time.sleep(0.5)
    s.kill("decode")
    since = {r: len(s.lines(r)) for r in ("prefill", "proxy-pull")}
    t0 = time.monotonic()
    r = s.http("a", s.url(MODES["pull"]), pd_serve.request_body(s.s, prompt(9000, N), TOKENS))
    answered = time.monotonic()
    decode = f"http://{s.s.decode.ip}:{s.s.http_ports[1]}"
    assert r["status"] == 502, f"dead decode: HTTP {r['status']}: {r['body'][:300]}{s.tails()}"
    error = json.loads(r["body"])["error"]
    assert error.startswith(f"decode {decode} failed: "), error
    # the proxy released before it answered: its line is logged by now (flushed)
    said = [m for x in s.lines("proxy-pull")[since["proxy-pull"]:]
            if (m := re.search(r"pd_proxy: decode unreachable: .*; RELEASE of prefill "
                               r"req=(\S+): (.*)$", x))]
    assert len(said) == 1, f"the proxy logged {len(said)} RELEASEs{s.tails()}"
    rid, ranks = said[0].groups()
    assert ranks == f"rank 0 at {s.s.prefill.ip}:{s.s.side_ports[0]}: YES", ranks
    released = re.compile(rf"kvplan: prefill req={re.escape(rid)} (released|lease of)")
    while not (got := [m.group(1) for x in s.lines("prefill")[since["prefill"]:]
                       if (m := released.search(x))]):
        assert time.monotonic() < answered + RELEASED_WITHIN, (
            f"prefill req={rid} not released {RELEASED_WITHIN} s after the 502{s.tails()}")
        time.sleep(0.05)
    seen = time.monotonic()  # polled: the line was logged by then
    assert got == ["released"], f"prefill req={rid}: {got}{s.tails()}"
    while (usage := s.kv_usage()) > idle:  # the freeing step's stats may trail its log line
        assert time.monotonic() < answered + RELEASED_WITHIN, (
            f"prefill KV usage {usage} > idle {idle} after req={rid} was released")
        time.sleep(0.2)
    print(f"dead decode: 502 in {answered - t0:.2f} s; prefill req={rid} released, seen "
          f"{seen - answered:.2f} s after the 502, {seen - t0:.2f} s after the request "
          f"(lease_s {LEASE_S:g}); KV usage back to {usage} (idle {idle})")
    s.kill("prefill")
    r = s.http("a", s.url(MODES["pull"]), pd_serve.request_body(s.s, prompt(9001, N), TOKENS))
    prefill = f"http://{s.s.prefill.ip}:{s.s.http_ports[0]}"
    assert r["status"] == 502, f"dead prefill: HTTP {r['status']}: {r['body'][:300]}"
    error = json.loads(r["body"])["error"]
    assert error.startswith(f"prefill {prefill} failed: "), error


@pytest.mark.engines("http")
def test_hybrid_n_groups_1_tp1_to_tp2_in_every_mode_equals_the_plain_run(sets):
    modes(sets("nemo1-tp2"), "NemotronH n_groups=1 TP1 -> TP2")


@pytest.mark.engines("http")
def test_hybrid_negative_control_straight_to_the_decode(sets):
    control(sets("nemo1-tp2"), "NemotronH n_groups=1 TP1 -> TP2")

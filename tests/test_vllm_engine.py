"""KvplanConnector inside real vLLM engines (vLLM's CPU build, 0.32.0): prefill and decode are
separate engine processes that move KV over NIXL/UCX on loopback.

Every engine is a child process of the vLLM venv's python running tests/vllm_engine.py (the
venv is built once by tests/vllm_env.py; the tests skip, saying why, where it cannot be
installed). A tiny Llama with random float32 weights (fixed seed, written locally) makes the
greedy tokens depend on the KV they decode from. The plain run of a prompt is the prefill
engine generating it alone; decode's tokens after a pull must equal it, and a decode given
another prompt's KV must not.

Engines are shared across tests (started on first use, stopped when a test needs the cores
or memory) and pinned to cores; each keeps its log under the test's temporary directory, and
a failing assertion shows the tail of every engine's log. Every process is killed on
teardown (each engine runs in its own session, killed as a group).
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests import vllm_env

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "vllm_engine.py"
MARK = "@@kvplan "
START_TIMEOUT = float(os.environ.get("KVPLAN_VLLM_START_TIMEOUT", 600))
REQUEST_TIMEOUT = 240.0


def _free_base_port(n: int) -> int:
    """A base port with ``n`` consecutive free ports after it (the side channel of each rank)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65000:
            continue
        ok = True
        for p in range(base, base + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free ports")


class Engine:
    """One vLLM engine process: requests on stdin, results on stdout, everything logged."""

    def __init__(self, name: str, py: Path, model: Path, workdir: Path, *, tp: int, cores: str,
                 policy: str = "recompute", block_size: int = 32, connector: bool = True):
        self.name, self.tp = name, tp
        self.port = _free_base_port(tp)
        self.log_path = workdir / f"{name}.log"
        env = dict(os.environ)
        env.update(
            PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", VLLM_HOST_IP="127.0.0.1",
            UCX_NET_DEVICES="lo", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
            VLLM_CPU_OMP_THREADS_BIND=cores,
            TORCHINDUCTOR_CACHE_DIR=str(workdir / f"inductor-{name}"),
            VLLM_CACHE_ROOT=str(workdir / f"vllm-cache-{name}"),
        )
        cmd = [str(py), str(SCRIPT), "serve", "--model", str(model), "--tp", str(tp),
               "--side-port", str(self.port), "--policy", policy,
               "--block-size", str(block_size), "--transfer-timeout", "20"]
        if not connector:
            cmd.append("--no-connector")
        self.log = open(self.log_path, "w")  # closed in stop()
        self.log.write(f"$ {' '.join(cmd)}\n")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
                                     start_new_session=True)
        self.results: queue.Queue = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.ready = False
        self.n = 0

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.write(line)
            self.log.flush()
            if line.startswith(MARK):
                self.results.put(json.loads(line[len(MARK):]))
        self.results.put(None)  # the process closed its stdout: it died

    def wait_ready(self) -> None:
        if not self.ready:
            r = self._get(START_TIMEOUT, "start")
            assert r.get("id") == "ready", r
            self.ready = True

    def _get(self, timeout: float, what: str) -> dict:
        try:
            r = self.results.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"engine {self.name}: no answer to {what} in {timeout:.0f} s"
                                 f"{tails()}") from None
        if r is None:
            raise AssertionError(f"engine {self.name} exited ({self.proc.poll()}) during "
                                 f"{what}{tails()}")
        return r

    def generate(self, prompt: list[int], max_tokens: int, params: dict | None = None) -> dict:
        self.wait_ready()
        self.n += 1
        rid = f"{self.name}-{self.n}"
        req = {"id": rid, "prompt": prompt, "max_tokens": max_tokens, "params": params}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        r = self._get(REQUEST_TIMEOUT, f"request {rid}")
        assert r["id"] == rid, r
        return r

    def log_lines(self, pattern: str) -> list[str]:
        self.log.flush()
        return [x for x in self.log_path.read_text().splitlines() if re.search(pattern, x)]

    def tail(self, n: int = 40) -> str:
        self.log.flush()
        lines = self.log_path.read_text().splitlines()[-n:]
        return f"\n--- {self.name} ({self.log_path}), last {len(lines)} lines ---\n" + \
            "\n".join(lines)

    def kill(self) -> None:
        """SIGKILL the engine and every process it started (its own session)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                pass
        # let its session (engine core, workers, resource tracker) finish cleaning up, then
        # kill whatever is left of it by group
        deadline = time.monotonic() + 15
        try:
            while time.monotonic() < deadline:
                os.killpg(self.proc.pid, 0)
                time.sleep(0.2)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        self.reader.join(timeout=10)
        self.log.close()


_LIVE: dict[str, Engine] = {}
#: The engines the tests use: name -> (TP size, cores it is pinned to, other options).
#: t2 (TP 2) is decode for TP1 -> TP2 and prefill for TP2 -> TP1: every engine is kv_both,
#: and one engine start fewer saves minutes on two cores. t2 is not pinned ("nobind"): pinned
#: to "0|1" its workers shared a core with p1's or d1's, and a prefill worker spinning at 100%
#: on a core (vLLM steps while a request awaits its KV read) starved the threads pinned with
#: it, its own progress thread included: UCX's connection to that rank, which needs the
#: target progressed, took 20-120 s or missed the 20 s transfer deadline (docs/vllm.md).
#: (An MLA pair would be {"mla": True, "block_size": 16}: see docs/vllm.md for why it is not
#: a test.)
SHAPES = {"p1": (1, "0", {}), "d1": (1, "1", {}), "t2": (2, "nobind", {})}


def tails() -> str:
    return "".join(e.tail() for e in _LIVE.values() if not e.log.closed)


class Pool:
    """Engines by name, started on first use; ``only(...)`` stops the others."""

    def __init__(self, py: Path, workdir: Path) -> None:
        self.py, self.workdir = py, workdir
        self.models: dict[bool, Path] = {}

    def model(self, mla: bool) -> Path:
        """The tiny Llama (or the tiny MLA model), written on first use."""
        if mla not in self.models:
            path = self.workdir / ("tiny-mla" if mla else "tiny-llama")
            cmd = [str(self.py), str(SCRIPT), "model", str(path)] + (["--mla"] if mla else [])
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
            assert r.returncode == 0, f"writing {path.name} failed:\n{r.stdout}\n{r.stderr}"
            self.models[mla] = path
        return self.models[mla]

    def only(self, *names: str) -> list[Engine]:
        # stop the others, and any of these that died (a test may kill one)
        for n in [n for n in _LIVE if n not in names or _LIVE[n].proc.poll() is not None]:
            _LIVE.pop(n).stop()
        for n in names:
            if n not in _LIVE:
                tp, cores, extra = SHAPES[n]
                extra = dict(extra)
                model = self.model(extra.pop("mla", False))
                _LIVE[n] = Engine(n, self.py, model, self.workdir, tp=tp, cores=cores, **extra)
        engines = [_LIVE[n] for n in names]
        for e in engines:  # they start together; wait for all
            e.wait_ready()
        return engines


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    try:
        py = vllm_env.ensure()
    except vllm_env.EnvUnavailable as e:
        pytest.skip(f"vLLM's CPU build cannot be installed here: {e}")
    shm = set(os.listdir(SHM)) if os.path.isdir(SHM) else set()
    p = Pool(py, tmp_path_factory.mktemp("vllm"))
    yield p
    for n in list(_LIVE):
        _LIVE.pop(n).stop()
    remove_orphan_shm(shm)


SHM = "/dev/shm"


def remove_orphan_shm(before: set[str]) -> None:
    """Remove the shared-memory files that appeared since ``before`` and no process holds.

    A SIGKILLed engine (the prefill the tests kill) cannot unlink the segments its
    multiprocessing resource tracker owned."""
    if not os.path.isdir(SHM):
        return
    new = {n for n in set(os.listdir(SHM)) - before if n.startswith(("psm_", "sem.mp-"))}
    held: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                held.update(os.path.basename(x.split()[-1]) for x in f if SHM in x)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(SHM):
                    held.add(os.path.basename(target))
        except OSError:
            continue
    for n in new - held:
        try:
            os.unlink(os.path.join(SHM, n))
        except OSError:
            pass


def prompt(seed: int, n: int = 45) -> list[int]:
    """``n`` token ids in [2, 1024) (0 and 1 are BOS/EOS), a different sequence per seed."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(2, 1024) for _ in range(n)]


def pd(p: Engine, d: Engine, ids: list[int], *, prefill_ids: list[int] | None = None) -> dict:
    """Prefill ``prefill_ids`` (default ``ids``) on ``p``, then decode ``ids`` on ``d`` with
    the params the prefill returned; the decode result."""
    pre = p.generate(prefill_ids or ids, 1, {"do_remote_decode": True})
    assert pre["error"] is None and pre["params"], pre
    assert pre["params"]["do_remote_prefill"] and pre["params"]["transfer_mode"] == "kvplan"
    out = d.generate(ids, 16, dict(pre["params"]))
    assert out["error"] is None, f"{out}{tails()}"
    return out


PULL = r"kvplan: pull req=\S+ remote="  # the line a decode worker logs per posted pull
FAILED = r"kvplan: pull req=\S+ from \S+ failed"  # ... and per pull that failed


def pd_equals_plain(p: Engine, d: Engine, ids: list[int], what: str) -> list[str]:
    """The plain run of ``ids`` on ``p``, then P -> D: decode's tokens must equal it. The
    decode workers' pull lines so far."""
    plain = p.generate(ids, 16)
    assert len(plain["tokens"]) == 16, plain
    failed = len(d.log_lines(FAILED))
    check_equal(pd(p, d, ids), plain, what)
    # equal tokens alone would also follow a failed pull (policy recompute): none may fail
    assert len(d.log_lines(FAILED)) == failed, f"{what}: a pull failed{tails()}"
    return d.log_lines(PULL)


def check_equal(got: dict, plain: dict, what: str) -> None:
    assert got["tokens"] == plain["tokens"], (
        f"{what}: decode's tokens {got['tokens']} != plain run {plain['tokens']}{tails()}")


def test_tp1_to_tp1_equals_plain_run(pool):
    p1, d1 = pool.only("p1", "d1")
    pulls = pd_equals_plain(p1, d1, prompt(1), "P TP1 -> D TP1")
    # the decode worker really pulled: its connector logged the plan it posted
    # CPU_ATTN pages move whole: 2 blocks of 32 for the 45 positions
    assert pulls and "blocks=2 tokens=[0,64)" in pulls[-1] and "prompt=45" in pulls[-1], pulls
    assert d1.log_lines(r"kvplan: rank 0 registered 2 regions \(backend CPU_ATTN, layout LBHSND")


def test_negative_control_other_prompts_kv_differs(pool):
    p1, d1 = pool.only("p1", "d1")
    ids, other = prompt(2), prompt(3)
    plain = p1.generate(ids, 16)
    got = pd(p1, d1, ids, prefill_ids=other)  # decode reads the KV of another prompt
    assert got["tokens"] != plain["tokens"], f"decode ignored the pulled KV{tails()}"


def test_prefix_cache_hit_on_decode_pulls_only_missing_blocks(pool):
    p1, d1 = pool.only("p1", "d1")
    shared = prompt(4, 64)  # two whole blocks of 32
    a, b = shared + prompt(5, 20), shared + prompt(6, 25)
    plain_b = p1.generate(b, 16)
    check_equal(pd(p1, d1, a), p1.generate(a, 16), "first request")
    before = len(d1.log_lines(PULL))
    check_equal(pd(p1, d1, b), plain_b, "second request, sharing 64 positions")
    pulls = d1.log_lines(PULL)
    assert len(pulls) == before + 1, pulls
    first, second = pulls[-2], pulls[-1]
    assert "blocks=3 tokens=[0,96)" in first, first
    assert "blocks=1 tokens=[64,96)" in second, second  # decode held 64 positions already
    nbytes = [int(re.search(r"bytes=(\d+)", x).group(1)) for x in (first, second)]
    assert nbytes[0] == 3 * nbytes[1]  # one block of three


def test_unreachable_prefill_is_recomputed(pool):
    p1, d1 = pool.only("p1", "d1")
    ids = prompt(7)
    plain = p1.generate(ids, 16)
    pre = p1.generate(ids, 1, {"do_remote_decode": True})
    params = dict(pre["params"], remote_engine_id="gone", remote_port=_free_base_port(1))
    t0 = time.monotonic()
    got = d1.generate(ids, 16, params)
    assert got["error"] is None, got
    check_equal(got, plain, "decode after a failed handshake (policy recompute)")
    assert time.monotonic() - t0 < 60
    assert d1.log_lines(r"kvplan: pull req=\S+ from gone failed \(ConnectionRefusedError")


def test_tp1_to_tp2_equals_plain_run(pool):
    p1, _, d2 = pool.only("p1", "d1", "t2")
    pulls = pd_equals_plain(p1, d2, prompt(8, 70), "P TP1 -> D TP2")
    assert {re.search(r"rank=(\d)", x).group(1) for x in pulls} == {"0", "1"}, pulls


def test_tp2_to_tp1_equals_plain_run_then_prefill_killed(pool):
    _, d1, p2 = pool.only("p1", "d1", "t2")
    pulls = pd_equals_plain(p2, d1, prompt(9, 70), "P TP2 -> D TP1")
    assert "peers=[0, 1]" in pulls[-1], pulls  # one decode rank gathers both halves
    # both prefill ranks released the request when decode's notification arrived
    deadline = time.monotonic() + 30
    while len(p2.log_lines(r"kvplan: prefill req=\S+ released by its 1 reader")) < 2:
        assert time.monotonic() < deadline, f"prefill never released its blocks{tails()}"
        time.sleep(0.5)
    # prefill dies after handing out its params: decode recovers by recomputing, no hang
    ids2 = prompt(10, 70)
    plain2 = p2.generate(ids2, 16)
    pre = p2.generate(ids2, 1, {"do_remote_decode": True})
    p2.kill()
    t0 = time.monotonic()
    got = d1.generate(ids2, 16, dict(pre["params"]))
    assert got["error"] is None, got
    check_equal(got, plain2, "decode after its prefill was killed (policy recompute)")
    assert time.monotonic() - t0 < 90
    assert d1.log_lines(r"kvplan: pull req=\S+ from \S+ failed")
    assert d1.generate(prompt(11), 4)["error"] is None  # decode still serves


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-x", "-q"]))

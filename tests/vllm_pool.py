"""Real vLLM engines for the engine tests (the ``engines`` tier: tests/conftest.py):
processes of the vLLM venv's python running tests/vllm_engine.py, started on first use, kept
for the whole session (one :class:`Pool`, the ``pool`` fixture), killed as groups at its end.

Engines are named ``MODEL-ROLE`` (``llama-p1``, ``nemo1-t2``...): MODEL picks the tiny model
(:data:`MODELS`), ROLE the TP size and cores (:data:`ROLES`), a ``-nixl`` suffix runs vLLM's
own NixlConnector instead of KvplanConnector, and other suffixes add options
(:data:`VARIANTS`: ``llama-p1-short-few``). A test names the engines it needs with
:meth:`Pool.only`; the others are *parked* (SIGSTOP: no CPU, their memory kept) rather than
stopped, so that a later test naming them again (in any file) resumes them in milliseconds
instead of starting them again for 1-3 minutes. Parked engines are stopped, least recently
used first, when memory runs short (:data:`RESERVE_GIB`). Every start of an engine keeps its
own log (``NAME.N.log`` under the pool's directory); a failing assertion shows each running
engine's last lines and the first error of its log (the root cause vLLM's "see stack trace"
points at).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

from tests import vllm_env

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "vllm_engine.py"
MARK = "@@kvplan "
START_TIMEOUT = float(os.environ.get("KVPLAN_VLLM_START_TIMEOUT", 600))
REQUEST_TIMEOUT = 240.0

#: model key -> (tests/vllm_engine.py model kind, extra `model` args, engine options)
MODELS = {
    "llama": ("llama", [], {}),
    "deep": ("llama-deep", [], {}),
    "mla": ("mla", [], {"block_size": 16, "attention_backend": "CPU_MLA"}),
    # hybrid engines take vLLM's block size: Mamba's aligned prefix caching needs blocks of
    # whole scan chunks (blocks of 32 fail in the Mamba2 kernel with chunks of 64)
    "nemo1": ("nemotron-h", ["--n-groups", "1"], {"block_size": 0}),
    "nemo2": ("nemotron-h", ["--n-groups", "2"], {"block_size": 0}),
    "gemma3": ("gemma3", [], {}),
    # a Llama of 4 KV heads with an EAGLE-3 draft of 2, speculative decoding (2 tokens)
    "eagle": ("llama-eagle3", [], {"speculative": 2}),
    # an MLA main with that draft: bfloat16, blocks of 128 (AMX_MLA beside CPU_ATTN; needs AMX)
    "mlaeagle": ("mla-eagle3", [], {"speculative": 2, "block_size": 128,
                                     "dtype": "bfloat16"}),
}
#: role -> (TP size, cores, niceness). p1/d1 are pinned to a core each; the TP 2 engine is not
#: pinned ("nobind"): pinned to "0|1" its workers shared a core with p1's or d1's, and a prefill
#: worker spinning at 100% on a core (vLLM steps every millisecond while a request awaits its KV
#: read, and its workers spin on the step queue) starved the threads pinned with it, its own
#: progress thread included (docs/vllm.md). Unpinned, its two spinning workers still took both
#: cores from the other engine and the tests: a stock TP 2 prefill with a lease of 12 s saw the
#: decode's read come 13-17 s after its answer, the decode itself taking 0.6-4 s. So the TP 2
#: engine runs at nice 10: the pinned engine and the tests come first, it takes what is left.
ROLES = {"p1": (1, "0", 0), "d1": (1, "1", 0), "t2": (2, "nobind", 10)}
#: variant -> engine options, named after the role (``llama-p1-short-few``), several allowed.
#: ``short``: leases of 3 s (heartbeats every second), handshakes and control messages of 1 s,
#: vLLM's stats log and metrics; ``few``: 40 KV blocks, so that freed blocks are soon reused;
#: ``fail``: ``kv_load_failure_policy="fail"``; ``stats``: vLLM's stats log and metrics alone;
#: ``digest``: the transfer digest on; ``soak``, ``nlease`` and ``lease12``: see below.
VARIANTS = {
    "short": {"extra": {"lease_s": 3, "handshake_timeout_s": 1}, "log_stats": True},
    "few": {"num_blocks": 40},
    "fail": {"policy": "fail"},
    "stats": {"log_stats": True},
    "digest": {"extra": {"digest": True}},
    # the soak (benchmarks/soak_vllm_pd.py): 256 KV blocks, so that prompts cycled through
    # the run are evicted from the decode's prefix cache and pulled again; ``nlease``: vLLM's
    # NixlConnector with the lease of ``short`` (its ``kv_lease_duration``, default 30 s)
    "soak": {"num_blocks": 256},
    # ``ds``: the Mamba conv state in DS order, as a NixlConnector prefill always keeps it (a
    # KvplanConnector decode reading one must hold it alike: docs/vllm.md, "Migrating a fleet")
    "ds": {"env": {"VLLM_SSM_CONV_STATE_LAYOUT": "DS"}},
    "nlease": {"extra": {"kv_lease_duration": 3}, "log_stats": True},
    # ``lease12``: vLLM's NixlConnector with a lease of 12 s, short enough that a test can
    # wait it out, long enough for a decode on two loaded cores to post its read within it
    "lease12": {"extra": {"kv_lease_duration": 12}},
    # ``fixed``: an engine id of its own, the same at every start (a restart in place)
    "fixed": {"engine_id": "prefill-fixed"},
    # ``stockt2``: a decode whose ``stock_prefills`` lists its model's ``t2-nixl-lease12``
    # engine (started first) with its TP size, ``/tp2``: a replicated model's (MLA) stock
    # prefill publishes the same rank 0 at TP 1 and 2, and only the list may vouch for rank 1
    "stockt2": {"stock_of": "t2-nixl-lease12"},
    # ``v31``: the engine runs in the venv of the previous vLLM (tests/vllm_env.py PREVIOUS),
    # the tests' own harness and this checkout's connector: one side of a rolling upgrade
    "v31": {"vllm": vllm_env.PREVIOUS},
}
#: KV blocks of an engine whose variants set none: enough for every test's prompts (up to a few
#: hundred requests of 70 tokens before the prefix cache evicts), not vLLM's 1 GiB of cache,
#: which made an engine 2.45 GiB (PSS) rather than 1.30 at TP 1, and left room for fewer
#: parked engines: those the pool had to stop then started again (CI of 2026-12-07: 2 of 46)
DEFAULT_BLOCKS = 512

#: model -> the engines its tests ask for, in about the order they ask (tests/conftest.py runs
#: a model's tests together). When a test first names an engine of a model, the pool starts
#: this set's engines beside it (:meth:`Pool.only`): a start is one core's work for 30-50 s
#: (32 CPU seconds measured at TP 1: three processes, each importing vLLM, one after the
#: other), so two cores start two at once in the time of one, where tests naming engines one
#: at a time left a core idle. An engine missing here still starts when named; the run's
#: summary names those (:data:`UNLISTED`).
SETS = {
    "llama": ("llama-p1-digest", "llama-d1-digest", "llama-p1", "llama-d1", "llama-t2",
              "llama-p1-nixl-few", "llama-t2-nixl", "llama-p1-fixed", "llama-p1-short-few",
              "llama-d1-short", "llama-d1-short-fail"),
    "nemo1": ("nemo1-p1", "nemo1-d1", "nemo1-t2", "nemo1-p1-nixl", "nemo1-t2-ds",
              "nemo1-t2-nixl", "nemo1-d1-ds"),
    "nemo2": ("nemo2-p1", "nemo2-d1", "nemo2-t2", "nemo2-p1-nixl", "nemo2-t2-ds"),
    "gemma3": ("gemma3-p1", "gemma3-d1", "gemma3-t2", "gemma3-p1-nixl"),
    "mla": ("mla-p1-nixl", "mla-d1-nixl", "mla-t2-nixl-lease12", "mla-d1-stockt2", "mla-p1",
            "mla-d1", "mla-t2"),
    "eagle": ("eagle-p1-few", "eagle-d1-few", "eagle-t2-few", "eagle-p1-nixl"),
    # not a model: the rolling-upgrade tests' engines of the previous vLLM (the group
    # "upgrade" runs right after "llama", whose 0.32 engines it reuses, still parked)
    "upgrade": ("llama-p1-v31", "llama-d1-v31", "llama-p1-nixl-v31", "llama-t2-v31"),
}


def _sources_live(name: str) -> bool:
    """Whether the engines variant ``stock_of`` of ``name`` lists are running (its
    ``stock_prefills`` is written from their ports)."""
    key, _, *rest = name.split("-")
    return all(f"{key}-{VARIANTS[v]['stock_of']}" in _LIVE for v in rest
               if "stock_of" in VARIANTS.get(v, {}))


def set_of(name: str, sets: dict[str, tuple[str, ...]]) -> str:
    """The key of the :data:`SETS` entry that starts engine ``name``: the first that lists it
    (the ``upgrade`` entry lists engines of other models' keys), else its model's."""
    return next((k for k, names in sets.items() if name in names), name.split("-")[0])


#: engines started that their model's :data:`SETS` entry lacks (each started alone)
UNLISTED: set[str] = set()
#: at most this many engines start at once (two cores: more only adds memory)
AT_ONCE = 4


#: ports :func:`free_base_port` handed out in this process (an engine binds its own seconds
#: later, after vLLM started: a second engine must not be given the same ones meanwhile)
_HANDED: set[int] = set()


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (``bind(0)`` and ``connect()`` take theirs
    from it): 32768 where the kernel does not say."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_base_port(n: int) -> int:
    """A base port with ``n`` consecutive free ports after it (the side channel of each rank),
    below the kernel's ephemeral range: an engine binds its ports seconds after this choice,
    and ephemeral ones (vLLM's, UCX's and NIXL's own sockets in the engines starting meanwhile)
    took a chosen port in that gap in CI ("side channel port ... is already in use")."""
    low, high = 20000, min(_ephemeral_low(), 65000) - n
    for _ in range(500):
        base = random.randrange(low, high)
        ports = range(base, base + n)
        if _HANDED.intersection(ports):
            continue
        try:
            for port in ports:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        _HANDED.update(ports)
        return base
    raise RuntimeError(f"no {n} consecutive free ports in [{low}, {high + n})")


def cache_root(workdir: Path, name: str) -> Path:
    """Engine ``name``'s ``VLLM_CACHE_ROOT``, its own but for ``modelinfos``, shared by all
    engines: vLLM inspects a model's class in a subprocess that imports vLLM (8-10 s of a
    core) unless that directory has its answer (written atomically, keyed by the model file's
    hash), so only the first engine of each model pays it."""
    root = workdir / f"vllm-cache-{name}"
    shared = workdir / "vllm-modelinfos"
    shared.mkdir(exist_ok=True)
    root.mkdir(exist_ok=True)
    if not (root / "modelinfos").exists():
        (root / "modelinfos").symlink_to(shared, target_is_directory=True)
    return root


#: starts of each engine name in this process (an engine's log is NAME.N.log)
STARTS: dict[str, int] = {}
_LIVE: dict[str, Engine] = {}
ERROR = re.compile(r"Traceback|Error|error:")


class Engine:
    """One vLLM engine process: requests on stdin, results on stdout, everything logged."""

    def __init__(self, name: str, py: Path, model: Path, workdir: Path, *, tp: int, cores: str,
                 policy: str = "recompute", block_size: int = 32, connector: str = "kvplan",
                 attention_backend: str | None = None, extra: dict | None = None,
                 num_blocks: int = 0, log_stats: bool = False, port: int | None = None,
                 place: tuple[str, str] | None = None, speculative: int = 0,
                 dtype: str = "float32", env: dict[str, str] | None = None, nice: int = 0,
                 engine_id: str | None = None):
        """``place``: (network namespace, its address) to run in, UCX over TCP on its veth
        (tests/netns.py: two hosts); None: this host, loopback. ``speculative``: draft tokens
        per step with the model's EAGLE-3 draft (0: none). ``env``: more environment.
        ``nice``: the engine's niceness (its processes yield the cores to the others').
        ``engine_id``: its ``kv_transfer_config.engine_id`` (None: vLLM's, new each start)."""
        # what :meth:`again` starts it with: the same engine, on the same ports
        self.args = (name, py, model, workdir)
        self.options = dict(tp=tp, cores=cores, policy=policy, block_size=block_size,
                            connector=connector, attention_backend=attention_backend,
                            extra=extra, num_blocks=num_blocks, log_stats=log_stats,
                            place=place, speculative=speculative, dtype=dtype, env=env,
                            nice=nice, engine_id=engine_id)
        self.name, self.tp = name, tp
        self.port = free_base_port(tp) if port is None else port
        STARTS[name] = STARTS.get(name, 0) + 1
        self.log_path = workdir / f"{name}.{STARTS[name]}.log"  # one per start, all kept
        more_env, env = env or {}, dict(os.environ)
        prefix, ip, dev = [], "127.0.0.1", "lo"
        if place is not None:
            from tests.netns import IFACE

            prefix, ip, dev = ["ip", "netns", "exec", place[0]], place[1], IFACE
            env["UCX_TLS"] = "tcp"  # over the veth: never shared memory or CMA
        env.update(
            PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", VLLM_HOST_IP=ip,
            UCX_NET_DEVICES=dev, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
            VLLM_CPU_OMP_THREADS_BIND=cores,
            # one inductor cache for all engines: vLLM compiles some ops even eager (MLA's
            # first request compiled C++ for 60 s per engine, and timed out in CI with three
            # engines compiling at once); kernels differ by source (threads included), so
            # engines share only identical ones
            TORCHINDUCTOR_CACHE_DIR=str(workdir / "inductor"),
            VLLM_CACHE_ROOT=str(cache_root(workdir, name)),
            VLLM_LOG_STATS_INTERVAL="1",
            **more_env,
        )
        if nice:
            prefix = ["nice", "-n", str(nice), *prefix]
        cmd = [*prefix, str(py), str(SCRIPT), "serve", "--model", str(model), "--tp", str(tp),
               "--side-port", str(self.port), "--policy", policy,
               "--block-size", str(block_size), "--transfer-timeout", "20",
               "--connector", connector]
        if place is not None:  # the side channel on the host's address
            cmd += ["--side-host", ip]
        if attention_backend:
            cmd += ["--attention-backend", attention_backend]
        if extra:
            cmd += ["--extra", json.dumps(extra)]
        if num_blocks:
            cmd += ["--num-blocks", str(num_blocks)]
        if log_stats:
            cmd += ["--log-stats"]
        if speculative:
            cmd += ["--speculative", str(speculative)]
        if dtype != "float32":
            cmd += ["--dtype", dtype]
        if engine_id:
            cmd += ["--engine-id", engine_id]
        self.log = open(self.log_path, "w")  # closed in stop()
        self.log.write(f"$ {' '.join(cmd)}\n")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
                                     start_new_session=True)
        self.results: queue.Queue = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.ready = False
        self.engine_id: str | None = None  # its kv_transfer_config.engine_id, once ready
        self.n = 0
        self.parked = False  # stopped by SIGSTOP while other tests run (Pool.only)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.write(line)
            self.log.flush()
            at = line.find(MARK)
            if at < 0:
                continue
            try:  # a worker's log line may still follow the result before its newline
                self.results.put(json.JSONDecoder().raw_decode(line, at + len(MARK))[0])
            except ValueError as e:  # never die: the waiting test fails with the line instead
                self.results.put({"id": None, "error": f"unparsable result line ({e}): "
                                                       f"{line[:300]!r}"})
        self.results.put(None)  # the process closed its stdout: it died

    def wait_ready(self) -> None:
        if not self.ready:
            r = self._get(START_TIMEOUT, "start")
            assert r.get("id") == "ready", r
            self.ready, self.engine_id = True, r.get("engine_id")

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
        return self.collect(self.submit(prompt, max_tokens, params))

    def submit(self, prompt: list[int], max_tokens: int, params: dict | None = None) -> str:
        """Send one request without waiting (:meth:`collect` its result): a push decode waits
        for a prefill the test runs meanwhile."""
        self.wait_ready()
        self.n += 1
        rid = f"{self.name}-{self.n}"
        req = {"id": rid, "prompt": prompt, "max_tokens": max_tokens, "params": params}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return rid

    def collect(self, rid: str) -> dict:
        """The result of request ``rid`` (the one :meth:`submit` sent last)."""
        r = self._get(REQUEST_TIMEOUT, f"request {rid}")
        assert r["id"] == rid, r
        return r

    def batch(self, reqs: list[dict]) -> list[dict]:
        """Run ``reqs`` (``{"prompt", "max_tokens", "params"}``) together; each result's
        ``seconds`` is when it finished, from the batch's start."""
        return self.collect_batch(self.submit_batch(reqs))

    def submit_batch(self, reqs: list[dict]) -> str:
        """Send a :meth:`batch` without waiting (:meth:`collect_batch` its results)."""
        self.wait_ready()
        self.n += 1
        rid = f"{self.name}-{self.n}"
        batch = [dict(r, id=f"{rid}.{i}") for i, r in enumerate(reqs)]
        self.proc.stdin.write(json.dumps({"id": rid, "batch": batch}) + "\n")
        self.proc.stdin.flush()
        return rid

    def collect_batch(self, rid: str) -> list[dict]:
        r = self._get(REQUEST_TIMEOUT, f"batch {rid}")
        assert r["id"] == rid and r["error"] is None, r
        return r["results"]

    def dump(self, path: Path) -> dict:
        """Every worker's KV cache now: ``{(tp rank, layer name): [B, H, N, C]}`` (float32
        numpy arrays)."""
        import numpy as np

        path.mkdir(parents=True, exist_ok=True)
        self.n += 1
        self.proc.stdin.write(json.dumps({"id": f"k{self.n}", "op": "dump",
                                          "path": str(path)}) + "\n")
        self.proc.stdin.flush()
        res = self._get(REQUEST_TIMEOUT, "dump")
        assert res["error"] is None, f"{self.name}: dump failed: {res}{tails()}"
        out = {}
        for r in res["ranks"]:
            with np.load(path / f"rank{r}.npz") as z:
                out.update({(r, k): z[k] for k in z.files})
        return out

    def drafts(self) -> list[tuple[str, list[int]]]:
        """The draft token ids the engine's drafter proposed since the last call (or its
        start), ``(request id, ids)`` per request and step, and forget them (``--speculative``
        engines)."""
        self.wait_ready()
        self.n += 1
        rid = f"{self.name}-{self.n}"
        self.proc.stdin.write(json.dumps({"id": rid, "op": "drafts"}) + "\n")
        self.proc.stdin.flush()
        r = self._get(REQUEST_TIMEOUT, f"drafts {rid}")
        assert r["error"] is None, f"{self.name}: drafts failed: {r}{tails()}"
        return [(req, ids) for req, ids in r["drafts"]]

    def metrics(self, prefix: str = "vllm:kvplan") -> dict[str, dict]:
        """The engine's metrics whose names start with ``prefix``, by name (``--log-stats``
        engines; NixlConnector's are ``vllm:nixl_*``)."""
        self.wait_ready()
        self.n += 1
        rid = f"{self.name}-{self.n}"
        self.proc.stdin.write(json.dumps({"id": rid, "op": "metrics", "prefix": prefix}) + "\n")
        self.proc.stdin.flush()
        r = self._get(REQUEST_TIMEOUT, f"metrics {rid}")
        assert r["error"] is None, r
        return {m["name"]: m for m in r["metrics"]}

    def signal(self, sig: int) -> None:
        """Send ``sig`` to every process of the engine (its session), e.g. SIGSTOP/SIGCONT."""
        os.killpg(self.proc.pid, sig)

    def log_lines(self, pattern: str, since: int = 0) -> list[str]:
        """The log's lines matching ``pattern``, from byte ``since`` on (a position taken
        with ``log_path.stat().st_size``: a loop that polls reads only what is new)."""
        self.log.flush()
        with open(self.log_path, "rb") as f:
            f.seek(since)
            text = f.read().decode(errors="replace")
        return [x for x in text.splitlines() if re.search(pattern, x)]

    def tail(self, n: int = 40) -> str:
        self.log.flush()
        lines = self.log_path.read_text().splitlines()
        first = next((i for i, x in enumerate(lines) if ERROR.search(x)
                      and "Tokenizer not available" not in x), None)
        cause = ""
        if first is not None and first < len(lines) - n:
            cause = "\n[first error]\n" + "\n".join(lines[max(0, first - 5):first + 25])
        return (f"\n--- {self.name} ({self.log_path}), last {min(n, len(lines))} lines ---\n"
                + "\n".join(lines[-n:]) + cause)

    def again(self) -> Engine:
        """A new start of this engine (stopped or killed first): the same options, engine id
        and side channel port; it waits until ready."""
        e = Engine(*self.args, port=self.port, **self.options)
        e.wait_ready()
        return e

    def kill(self) -> None:
        """SIGKILL the engine and every process it started (its own session: its workers too,
        should its first process be gone already)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
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


def tails() -> str:
    """The running engines' log tails (parked ones took no part in the test)."""
    return "".join(e.tail() for e in _LIVE.values() if not e.log.closed and not e.parked)


def failures(e: Engine, before: int) -> str:
    """An assertion message: ``e``'s failure lines after the first ``before`` of them, in
    full (a report that keeps only the message's head still says why), then every tail."""
    return "".join(f"\n  {line}" for line in e.log_lines(FAILED)[before:]) + tails()


#: MemAvailable (GiB) that must remain after a new engine starts: below it, parked engines
#: are stopped, least recently used first. An engine takes about 1.3 GiB at TP 1 and 1.8 GiB
#: at TP 2 (measured: tiny models, :data:`DEFAULT_BLOCKS`); CI machines have 24 GiB.
RESERVE_GIB = float(os.environ.get("KVPLAN_ENGINE_RESERVE_GIB", 6))
#: what one engine of a TP size is assumed to take when room is made for it (GiB): measured
#: 1.30 and 1.77 GiB (PSS) with :data:`DEFAULT_BLOCKS`, a margin for the start's peak
ENGINE_GIB = {1: 2.0, 2: 3.0}


def _gib(name: str) -> float:
    return ENGINE_GIB[ROLES[name.split("-")[1]][0]]


def mem_available_gib() -> float:
    """The kernel's estimate of memory available without swapping (``/proc/meminfo``)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return float("inf")


class Pool:
    """Engines by name (``MODEL-ROLE[-nixl]``), started on first use; ``only(...)`` parks the
    others (SIGSTOP) and resumes these."""

    def __init__(self, py: Path, workdir: Path, hosts=None,
                 sets: dict[str, tuple[str, ...]] | None = None) -> None:
        """``hosts``: a :class:`tests.netns.TwoHosts`: prefill roles (``p1``) then run on its
        host ``a``, the others on ``b``, UCX over the veth between them. ``sets``: engines
        to start beside the first one of their model a test names (:data:`SETS`; the tests'
        pool has them, a benchmark's starts only what it names)."""
        self.py, self.workdir, self.hosts = py, workdir, hosts
        self.models: dict[str, Path] = {}
        self.parked: list[str] = []  # least recently used first
        self.sets = sets
        self.model_now: str | None = None  # the model the last test that named one named
        self.started: set[str] = set()  # every name started (an extra is started once)

    def model(self, key: str) -> Path:
        """The tiny model ``key`` of :data:`MODELS`, written on first use."""
        if key not in self.models:
            kind, args, _ = MODELS[key]
            path = self.workdir / f"tiny-{key}"
            cmd = [str(self.py), str(SCRIPT), "model", str(path), "--kind", kind, *args]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
            assert r.returncode == 0, f"writing {path.name} failed:\n{r.stdout}\n{r.stderr}"
            self.models[key] = path
        return self.models[key]

    def only(self, *names: str) -> list[Engine]:
        """These engines running (started, or resumed if parked), every other one parked: a
        test gets the cores to itself. An engine that died (a test may kill one) starts
        afresh. Where the pool has :data:`SETS`, engines of the model's set not started yet
        start beside new ones (up to :data:`AT_ONCE` at a time, while memory allows), and are
        parked once ready; a test naming a model other than the last one's first stops every
        parked engine of the others (the tests of a model run together)."""
        for n in [n for n in _LIVE if _LIVE[n].proc.poll() is not None]:
            self._drop(n)
        for n in [n for n in _LIVE if n not in names and n not in self.parked]:
            self._park(n)
        models = {n.split("-")[0] for n in names}
        if self.sets is not None and models and not models & {self.model_now}:
            self.model_now = min(models)
            for n in [n for n in self.parked if n.split("-")[0] not in models]:
                self._drop(n)  # parked: killed at once
        for n in names:
            if n in self.parked:
                self.parked.remove(n)
                _LIVE[n].signal(signal.SIGCONT)
                _LIVE[n].parked = False
        new = [n for n in names if n not in _LIVE]
        if new:
            self.make_room(sum(_gib(n) for n in new))
            for n in new:
                self._start(n)
            extra = self._start_extra(new)
            for n in extra:  # they start together; wait for all (the cores to the test)
                try:
                    _LIVE[n].wait_ready()
                    self._park(n)
                except AssertionError:  # not this test's engine: started again if named
                    self._drop(n)
        engines = [_LIVE[n] for n in names]
        for e in engines:
            e.wait_ready()
        return engines

    def _start_extra(self, new: list[str]) -> list[str]:
        """Start engines of the :data:`SETS` of ``new``'s models that are not running, beside
        ``new``: as many as :data:`AT_ONCE` and memory allow (what ``new`` will take counted
        as taken). The names started."""
        if self.sets is None:
            return []
        keys = list(dict.fromkeys(set_of(n, self.sets) for n in new))  # as named, first
        for n in new:
            if n not in self.sets.get(set_of(n, self.sets), ()):
                UNLISTED.add(n)
        wanted = [n for k in keys for n in self.sets.get(k, ())
                  if n not in _LIVE and n not in self.started]
        started, taken = [], sum(_gib(n) for n in new)
        for n in wanted[:max(0, AT_ONCE - len(new))]:
            if mem_available_gib() - taken - _gib(n) < RESERVE_GIB:
                break
            if not _sources_live(n):  # a decode listing a stock prefill not started
                continue
            self._start(n)
            started.append(n)
            taken += _gib(n)
        return started

    def _start(self, name: str) -> Engine:
        assert _sources_live(name), f"{name}: start the stock prefill it lists first"
        key, role, *rest = name.split("-")
        tp, cores, nice = ROLES[role]
        opts = dict(MODELS[key][2], nice=nice, num_blocks=DEFAULT_BLOCKS)
        for v in rest:  # "nixl", or variants of VARIANTS
            opts.update({"connector": "nixl"} if v == "nixl" else VARIANTS[v])
        if "stock_of" in opts:  # the stock prefill's address and TP size, listed
            src = _LIVE[f"{key}-{opts.pop('stock_of')}"]  # started before (Pool.only: in order)
            host = src.options["place"][1] if src.options["place"] else "127.0.0.1"
            opts["extra"] = {**(opts.get("extra") or {}),
                             "stock_prefills": [f"{host}:{src.port}/tp{src.tp}"]}
        # a variant naming a vLLM version runs the engine in that version's venv (built on
        # first use, like the default one); the model files are the default venv's, read alike
        version = opts.pop("vllm", vllm_env.VLLM_VERSION)
        py = self.py if version == vllm_env.VLLM_VERSION else vllm_env.ensure(version=version)
        if self.hosts is not None:
            from tests.netns import ADDRS

            h = "a" if role == "p1" else "b"
            opts["place"] = (self.hosts.ns[h], ADDRS[h])
        self.started.add(name)
        _LIVE[name] = Engine(name, py, self.model(key), self.workdir, tp=tp, cores=cores,
                             **opts)
        return _LIVE[name]

    def _park(self, name: str) -> None:
        _LIVE[name].signal(signal.SIGSTOP)
        _LIVE[name].parked = True
        self.parked.append(name)

    def make_room(self, gib: float) -> None:
        """Stop parked engines, least recently used first, until ``gib`` more can start
        with :data:`RESERVE_GIB` left."""
        while self.parked and mem_available_gib() - gib < RESERVE_GIB:
            self._drop(self.parked[0])
            time.sleep(1)  # the kernel's count lags the processes' exit a little

    def _drop(self, name: str) -> None:
        """Stop ``name``: a parked one is killed (no test is using it, and a graceful stop
        takes 5-15 s; :func:`remove_orphan_shm` takes what it leaves at the session's end)."""
        e = _LIVE.pop(name)
        if name in self.parked:
            self.parked.remove(name)
            e.kill()
            e.reader.join(timeout=10)
            e.log.close()
        else:
            e.stop()

    def restart(self, name: str, *, kill: bool = False) -> Engine:
        """Restart running engine ``name`` in place: stopped (``kill``: SIGKILLed), then
        started again with the same options, engine id and ports; the new engine."""
        e = _LIVE[name]
        if kill:
            e.kill()
            e.reader.join(timeout=10)
            e.log.close()
        else:
            e.stop()
        _LIVE[name] = e.again()
        return _LIVE[name]

    def stop(self, *names: str) -> None:
        """Stop these engines (a hung or parked one included); the next ``only`` starts them
        afresh."""
        for n in names:
            if n in _LIVE:
                self._drop(n)

    def close(self) -> None:
        """Every engine gone, killed: nothing is checked after the last test, and a graceful
        stop takes 5-15 s an engine (:func:`remove_orphan_shm` takes what a kill leaves)."""
        # an engine a test killed (its session gone) has nothing to park: stop() reaps it
        for n in [n for n in _LIVE if n not in self.parked and _LIVE[n].proc.poll() is None]:
            self._park(n)
        self.stop(*_LIVE)


SHM = "/dev/shm"


def remove_orphan_shm(before: set[str]) -> None:
    """Remove the shared-memory files that appeared since ``before`` and no process holds.

    A SIGKILLed engine (the prefill the tests kill) cannot unlink the segments its
    multiprocessing resource tracker owned. Held is judged by inode, not name: glibc's
    ``sem_open`` maps a semaphore under a temporary name before linking it to ``sem.mp-...``,
    so its creator's maps show ``/dev/shm/sem.XXXXXX (deleted)``; judged by name, an engine
    starting beside (another test run) lost its semaphore before its workers opened it
    (``FileNotFoundError`` in ``SemLock._rebuild``, the engine dead at start)."""
    if not os.path.isdir(SHM):
        return
    new = {n for n in set(os.listdir(SHM)) - before if n.startswith(("psm_", "sem.mp-"))}
    held: set[int] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:  # "addr perms offset dev inode path"
                held.update(int(x.split()[4]) for x in f if SHM in x)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(SHM):
                    held.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
        except OSError:
            continue
    for n in new:
        try:
            if os.stat(os.path.join(SHM, n)).st_ino not in held:
                os.unlink(os.path.join(SHM, n))
        except OSError:
            pass


def shm_files() -> set[str]:
    return set(os.listdir(SHM)) if os.path.isdir(SHM) else set()


def prompt(seed: int, n: int = 45) -> list[int]:
    """``n`` token ids in [2, 1024) (0 and 1 are BOS/EOS), a different sequence per seed."""
    rng = random.Random(seed)
    return [rng.randrange(2, 1024) for _ in range(n)]


PULL = r"kvplan: pull req=\S+ remote="  # the line a decode worker logs per posted pull
FAILED = r"kvplan: pu(ll|sh) req=\S+ from \S+ failed"  # ... and per pull (or push) that failed


def pd(p: Engine, d: Engine, ids: list[int], *, prefill_ids: list[int] | None = None,
       mode: str = "kvplan") -> dict:
    """Prefill ``prefill_ids`` (default ``ids``) on ``p``, then decode ``ids`` on ``d`` with
    the params the prefill returned; the decode result."""
    pre = p.generate(prefill_ids or ids, 1, {"do_remote_decode": True})
    assert pre["error"] is None and pre["params"], f"{pre}{tails()}"
    assert pre["params"]["do_remote_prefill"] and pre["params"]["transfer_mode"] == mode, pre
    out = d.generate(ids, 16, dict(pre["params"]))
    assert out["error"] is None, f"{out}{tails()}"
    return out


PUSH_DONE = r"kvplan: push req=\S+ rank=\d+ written by prefill rank"  # a decode rank written
PUSH_REGISTERED = r"kvplan: push registration of \S+ req=\S+ key=\S+ at rank"  # prefill got it
LAYERED = r"kvplan: push req=\S+ to \S+ req=\S+ done layer-wise in"  # a prefill rank wrote


def push_params(p: Engine, key: str) -> dict:
    """A push decode's ``kv_transfer_params``: the prefill engine named, no blocks (as a
    proxy sends them before the prefill ran)."""
    return {"do_remote_prefill": True, "transfer_id": key, "remote_engine_id": p.engine_id,
            "remote_host": "127.0.0.1", "remote_port": p.port, "tp_size": p.tp}


def wait_lines(e: Engine, pattern: str, count: int, timeout: float = 60.0) -> list[str]:
    """Wait until ``e``'s log has ``count`` lines matching ``pattern``; those lines."""
    deadline = time.monotonic() + timeout
    while len(lines := e.log_lines(pattern)) < count:
        assert time.monotonic() < deadline, (f"{e.name}: {len(lines)} of {count} lines "
                                             f"{pattern!r} after {timeout:g} s{tails()}")
        time.sleep(0.05)
    return lines


def pd_push(p: Engine, d: Engine, ids: list[int], key: str, *,
            prefill_ids: list[int] | None = None, mode: str = "push") -> dict:
    """Push mode (``mode``: ``push`` or ``layerwise``): the decode of ``ids`` on ``d`` first,
    then, once every rank of ``p`` has its registration, the prefill of ``prefill_ids``
    (default ``ids``) on ``p``, which writes them; the decode result."""
    before = len(p.log_lines(PUSH_REGISTERED))
    rid = d.submit(ids, 16, push_params(p, key))
    wait_lines(p, PUSH_REGISTERED, before + p.tp)
    pre = p.generate(prefill_ids or ids, 1,
                     {"do_remote_decode": True, "transfer_mode": mode, "transfer_id": key})
    assert pre["error"] is None and pre["params"], f"{pre}{tails()}"
    assert pre["params"]["transfer_mode"] == mode and \
        pre["params"]["transfer_id"] == key, pre
    out = d.collect(rid)
    assert out["error"] is None, f"{out}{tails()}"
    return out


def push_equals_plain(p: Engine, d: Engine, ids: list[int], what: str, key: str, *,
                      mode: str = "push") -> list[str]:
    """The plain run of ``ids`` on ``p``, then a push P -> D: decode's tokens must equal it and
    every decode rank must have been written (no recompute); layer-wise, every prefill rank
    must have written it in parts from the forward (not whole after it). The decode's written
    lines."""
    plain = p.generate(ids, 16)
    failed = len(d.log_lines(FAILED))
    before = len(d.log_lines(PUSH_DONE))
    layered = len(p.log_lines(LAYERED))
    check_equal(pd_push(p, d, ids, key, mode=mode), plain, what)
    assert len(d.log_lines(FAILED)) == failed, f"{what}: a push failed{failures(d, failed)}"
    done = d.log_lines(PUSH_DONE)[before:]
    assert len(done) == d.tp, f"{what}: {len(done)} of {d.tp} decode ranks written{tails()}"
    if mode == "layerwise":  # each prefill rank wrote it, a part from a layer's hook at least
        hooked = [int(re.search(r"(\d+) from layer hooks", x).group(1))
                  for x in wait_lines(p, LAYERED, layered + p.tp, 30)[layered:]]
        assert min(hooked) >= 1, f"{what}: {hooked} parts from layer hooks{tails()}"
    return done


def check_equal(got: dict, plain: dict, what: str, *, atol: float = 1e-4) -> None:
    """Greedy tokens equal, and each token's logprob within ``atol`` (float32)."""
    assert got["tokens"] == plain["tokens"], (
        f"{what}: decode's tokens {got['tokens']} != plain run {plain['tokens']}{tails()}")
    if got.get("logprobs") and plain.get("logprobs"):
        diff = max(abs(a - b) for a, b in zip(got["logprobs"], plain["logprobs"]))
        assert diff <= atol, f"{what}: logprobs differ by {diff:.2e} (> {atol}){tails()}"


def pd_equals_plain(p: Engine, d: Engine, ids: list[int], what: str) -> list[str]:
    """The plain run of ``ids`` on ``p``, then P -> D: decode's tokens must equal it, and no
    pull may have failed (equal tokens alone would follow a recompute). The decode workers'
    pull lines so far."""
    plain = p.generate(ids, 16)
    assert len(plain["tokens"]) == 16, plain
    failed = len(d.log_lines(FAILED))
    before = len(d.log_lines(PULL))
    check_equal(pd(p, d, ids), plain, what)
    assert len(d.log_lines(FAILED)) == failed, f"{what}: a pull failed{failures(d, failed)}"
    assert len(d.log_lines(PULL)) > before, f"{what}: decode posted no pull{tails()}"
    return d.log_lines(PULL)


@contextlib.contextmanager
def engine_pool(py: Path, workdir: Path):
    """A :class:`Pool` of the vLLM venv's interpreter ``py`` (the session's ``pool`` fixture,
    tests/conftest.py): stops every engine and removes orphaned shared memory after."""
    shm = shm_files()
    pool = Pool(py, workdir, sets=SETS)
    try:
        yield pool
    finally:
        pool.close()
        remove_orphan_shm(shm)

"""Soak a P/D pair of real vLLM CPU engines under a fault schedule, KvplanConnector beside
vLLM's own NixlConnector: what a fault does to the requests around it, and what it leaves held.

One prefill and one decode engine (tests/vllm_pool.py: the tiny Llama of tests/vllm_engine.py,
TP1 -> TP1 on loopback, 256 KV blocks each, a KV lease of 3 s for either connector) serve
``--concurrency`` requests at a time for ``--minutes``, pipelined: while the decode engine pulls
and decodes one round, the prefill engine prefills the next. Meanwhile the schedule
(:data:`SCHEDULE`, fractions of the run) SIGKILLs the prefill (restarted at once, a new
process on a new port), SIGKILLs it again and restarts it **in place** (the same engine id and
ports, as an orchestrator restarts a crashed pod: the prefills run under a fixed
``engine_id``), SIGKILLs the decode (restarted on a new port), then SIGSTOPs the prefill for
the lease plus 3 s and SIGCONTs it. The same prompts, schedule and settings run for each
connector.

Every request is one prompt of :data:`MIN_LEN` to :data:`MAX_LEN` tokens from a fixed set whose
reference tokens (16, greedy) are the prefill engine's plain run before any fault. Counted per
connector (docs/reliability.md says what each means): **equal** to the reference, **wrong**
(finished, other tokens), **error** (an error result from a live engine), **lost** (on an engine
the schedule killed), **hung** (no answer ``--deadline`` s after it was sent), **recomputed**
(vLLM's scheduler recovered it from a failed KV load: equal, but not transferred), blocks
**leaked** on each engine after the drain (its ``vllm:kv_cache_usage_perc`` over its baseline,
once the lease ran out and the engine stepped), and **restarts needed** beyond the schedule's.
After each restart of the schedule it also reports the **transfers after** it: of the requests
decoded from then until the next fault, how many loaded their KV (equal to the reference and
not recomputed). A connector that never reads a restarted engine again shows 0 there, while
its answers stay equal (recomputed).

Not exercised: a link cut (on loopback there is no link to take down) and a proxy restart (the
engines are driven directly, not through examples/pd_proxy.py).

Run (serialise with other engine runs; each connector takes ``--minutes`` plus ~2 minutes)::

    flock /tmp/vllm-engines.lock nice python benchmarks/soak_vllm_pd.py --minutes 6
    python benchmarks/soak_vllm_pd.py --minutes 1.5 --connectors kvplan   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import re
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests import vllm_env  # noqa: E402  (the repo's test helpers build and drive the engines)
from tests.vllm_pool import Pool, prompt, remove_orphan_shm, shm_files  # noqa: E402

#: connector -> (prefill engine, decode engine): ``short``/``nlease``: a KV lease of 3 s
#: (KvplanConnector's ``lease_s``, NixlConnector's ``kv_lease_duration``); ``soak``: 256 blocks;
#: ``fixed``: the prefill's ``engine_id`` fixed, so that a restart in place keeps it
CONNECTORS = {
    "kvplan": ("llama-p1-short-soak-fixed", "llama-d1-short-soak"),
    "nixl": ("llama-p1-nixl-nlease-soak-fixed", "llama-d1-nixl-nlease-soak"),
}
LEASE_S = 3.0
NUM_BLOCKS = 256
STOP_S = LEASE_S + 3  # a SIGSTOP past the lease
#: a fault waits at least this long after the last restart ended (however late that makes it):
#: a restart takes about a minute on two cores, and the requests served in between are what
#: "transfers after" a restart measures
SETTLE_S = 20.0
#: (fraction of the run, action, engine role)
SCHEDULE = ((0.15, "kill", "prefill"), (0.35, "inplace", "prefill"), (0.55, "kill", "decode"),
            (0.75, "stop", "prefill"))
MIN_LEN, MAX_LEN, DECODE_TOKENS = 40, 400, 16
COUNTS = ("requests", "equal", "wrong", "error", "lost", "hung", "recomputed",
          "leaked_prefill", "leaked_decode", "restarts_scheduled", "restarts_needed")
RECOVERED = re.compile(r"Recovered from KV load failure: (\d+) request")
FAILING = re.compile(r"Failing (\d+) request\(s\) due to KV load failure")

DIED, HUNG = "died", "hung"


class Pair:
    """The live prefill and decode engines (replaced on restart, read by the fault thread)."""

    def __init__(self, pool: Pool, pname: str, dname: str) -> None:
        self.pool, self.names = pool, {"prefill": pname, "decode": dname}
        # reentrant: a restart (either thread) holds it while it starts the engines anew
        self.lock = threading.RLock()
        self.killed: set[int] = set()  # pids of the engines the schedule killed
        self.events: list[str] = []
        self.t0 = time.monotonic()
        self.restarts = {"scheduled": 0, "needed": 0}
        self.restarting = False  # the fault thread waits: no fault lands on a restart
        self.settled = time.monotonic()  # when the last restart ended
        self.engines: dict = {}
        #: after each scheduled restart: [what, counts then, counts at the next fault or the
        #: end], the counts ``(requests, equal, recomputed)`` of the run so far (:meth:`mark`)
        self.windows: list[list] = []
        self.counts = lambda: (0, 0, 0)  # set by run_connector, which keeps the tally
        self.start()

    def start(self) -> None:
        p, d = self.pool.only(self.names["prefill"], self.names["decode"])
        with self.lock:
            self.engines = {"prefill": p, "decode": d}

    def note(self, what: str) -> None:
        self.events.append(f"{time.monotonic() - self.t0:6.1f} s  {what}")
        print(f"  [{self.events[-1]}]", flush=True)

    def mark(self, what: str | None) -> None:
        """Close the open window of transfers after a restart (a fault starts, or the run
        ends), and open one after ``what`` (a scheduled restart just done; None: none)."""
        now = self.counts()
        if self.windows and self.windows[-1][2] is None:
            self.windows[-1][2] = now
        if what is not None:
            self.windows.append([what, now, None])

    def restart(self, role: str, e, why: str) -> None:
        """Restart ``role``'s engine ``e``: killed by the schedule (``why`` "died" of a pid in
        :attr:`killed`), or needed (it died on its own, or hung). Nothing if ``e`` was
        replaced meanwhile (restarted in place by the fault thread)."""
        with self.lock:
            if self.engines[role] is not e:
                return
            planned = why == DIED and e.proc.pid in self.killed
            self.restarting = True
            e.kill()  # a hung one too: Pool.only restarts the dead
            self.restarts["scheduled" if planned else "needed"] += 1
            self.note(f"{role} {'killed by the schedule' if planned else why}: restarting")
            self.start()
            self.restarting = False
            self.settled = time.monotonic()
            self.note(f"{role} restarted")
            if planned:
                self.mark(f"{role} restarted on a new port")

    def restart_in_place(self, role: str) -> None:
        """SIGKILL ``role``'s engine and start it again with the same engine id and ports
        (``Pool.restart``); the main loop's requests meanwhile meet a dead engine (lost) and
        its own restart of it waits on the lock, then finds it replaced."""
        with self.lock:
            e = self.engines[role]
            self.killed.add(e.proc.pid)
            self.restarting = True
            self.mark(None)
            self.note(f"SIGKILL {role}, restarting it in place (same engine id and ports)")
            self.engines[role] = self.pool.restart(self.names[role], kill=True)
            self.restarts["scheduled"] += 1
            self.restarting = False
            self.settled = time.monotonic()
            self.note(f"{role} restarted in place")
            self.mark(f"{role} restarted in place")

    def restart_dead(self) -> None:
        """Restart the engines that died since they were last asked for something (a fault
        between rounds)."""
        for role, e in list(self.engines.items()):
            if e.proc.poll() is not None:
                self.restart(role, e, DIED)


def faults(pair: Pair, seconds: float, stop: threading.Event) -> None:
    """The fault thread: each action of :data:`SCHEDULE` at its time, on the engine live then
    (once it is ready: a fault never lands on a restart in progress, nor within
    :data:`SETTLE_S` of one's end)."""
    for at, action, role in SCHEDULE:
        if stop.wait(max(0.0, pair.t0 + at * seconds - time.monotonic())):
            return
        while not stop.is_set():
            with pair.lock:
                e = pair.engines[role]
            if e.ready and e.proc.poll() is None and not pair.restarting \
                    and time.monotonic() >= pair.settled + SETTLE_S:
                break
            time.sleep(0.2)
        if stop.is_set():
            return
        if action == "inplace":
            pair.restart_in_place(role)
        elif action == "kill":
            pair.mark(None)
            pair.killed.add(e.proc.pid)
            pair.note(f"SIGKILL {role}")
            e.signal(signal.SIGKILL)
        else:
            pair.mark(None)
            pair.note(f"SIGSTOP {role} for {STOP_S:g} s")
            e.signal(signal.SIGSTOP)
            time.sleep(STOP_S)
            try:
                e.signal(signal.SIGCONT)
                pair.note(f"SIGCONT {role}")
            except ProcessLookupError:  # it died while stopped: the main loop restarts it
                pair.note(f"{role} gone before its SIGCONT")


def send(e, reqs: list[dict]) -> str | None:
    """Submit a batch; None if the engine is gone (its stdin closed)."""
    try:
        return e.submit_batch(reqs)
    except OSError:
        return None


def wait(e, rid: str | None, n: int, deadline: float) -> list[dict] | str:
    """The ``n`` results of batch ``rid``, :data:`DIED` or :data:`HUNG` (no answer by
    ``deadline``)."""
    if rid is None:
        return DIED
    try:
        r = e.results.get(timeout=max(0.0, deadline - time.monotonic()))
    except queue.Empty:
        return HUNG
    if r is None:
        return DIED
    if r.get("error") is not None:  # the harness' loop raised: every request of it failed
        return [{"error": r["error"]}] * n
    return r["results"]


def references(p, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's plain run on the prefill engine (before any fault), 16 at a time."""
    out = []
    for i in range(0, len(prompts), 16):
        out += [r["tokens"] for r in p.batch([{"prompt": x, "max_tokens": DECODE_TOKENS}
                                              for x in prompts[i:i + 16]])]
    return out


def used_blocks(e) -> int:
    """The engine's KV blocks held now (vLLM's usage gauge counts held blocks over all but the
    null block; a freed block kept in the prefix cache is free), after one tiny request: an
    idle engine does not step, and a lease runs out on a step."""
    e.generate(prompt(7, 8), 1)
    m = e.metrics("vllm:kv_cache_usage_perc")
    return round(m["vllm:kv_cache_usage_perc"]["value"] * (NUM_BLOCKS - 1))


class Tally:
    """The counts of one connector's run (:data:`COUNTS`)."""

    def __init__(self, refs: list[list[int]]) -> None:
        self.refs = refs
        self.c = dict.fromkeys(COUNTS, 0)
        self.wrong: list[str] = []

    def decoded(self, idx: list[int], res: list[dict] | str) -> None:
        self.c["requests"] += len(idx)
        if res == DIED:
            self.c["lost"] += len(idx)
            return
        if res == HUNG:
            self.c["hung"] += len(idx)
            return
        for i, r in zip(idx, res):
            if r.get("error") is not None or r.get("finish") not in ("length", "stop"):
                self.c["error"] += 1
            elif r["tokens"] == self.refs[i]:
                self.c["equal"] += 1
            else:
                self.c["wrong"] += 1
                self.wrong.append(f"prompt {i}: {r['tokens']} != {self.refs[i]}")

    def prefill_failed(self, n: int, res: list[dict] | str) -> None:
        """``n`` requests whose prefill leg did not give transfer params."""
        self.c["requests"] += n
        self.c[{DIED: "lost", HUNG: "hung"}.get(res, "error")] += n


def run_connector(pool: Pool, workdir: Path, name: str, args, prompts: list[list[int]]
                  ) -> tuple[dict, list[str], list[str]]:
    pname, dname = CONNECTORS[name]
    print(f"{name}: starting {pname} and {dname}", flush=True)
    pair = Pair(pool, pname, dname)
    refs = references(pair.engines["prefill"], prompts)
    base = {r: used_blocks(e) for r, e in pair.engines.items()}
    tally, rng = Tally(refs), random.Random(1)

    def counts() -> tuple[int, int, int]:
        return (tally.c["requests"], tally.c["equal"],
                log_count(workdir, dname, RECOVERED) + log_count(workdir, dname, FAILING))

    pair.counts = counts
    seconds = args.minutes * 60
    stop = threading.Event()
    pair.t0 = time.monotonic()
    thread = threading.Thread(target=faults, args=(pair, seconds, stop), daemon=True)
    thread.start()
    pending: list[tuple[int, dict]] = []  # prefilled, to decode next round
    try:
        while True:
            more = time.monotonic() < pair.t0 + seconds
            if not more and not pending:
                break
            pair.restart_dead()
            p, d = pair.engines["prefill"], pair.engines["decode"]
            deadline = time.monotonic() + args.deadline
            drid = send(d, [{"prompt": prompts[i], "max_tokens": DECODE_TOKENS, "params": q}
                            for i, q in pending]) if pending else None
            idx = [rng.randrange(len(prompts)) for _ in range(args.concurrency)] if more else []
            prid = send(p, [{"prompt": prompts[i], "max_tokens": 1,
                             "params": {"do_remote_decode": True}} for i in idx]) if idx else None
            pres = wait(p, prid, len(idx), deadline) if idx else []
            dres = wait(d, drid, len(pending), deadline) if pending else []
            if pending:
                tally.decoded([i for i, _ in pending], dres)
            pending = []
            if isinstance(pres, str):
                tally.prefill_failed(len(idx), pres)
            else:
                ok = [(i, r["params"]) for i, r in zip(idx, pres)
                      if r.get("error") is None and (r.get("params") or {}).get(
                          "do_remote_prefill")]
                if len(ok) < len(idx):
                    tally.prefill_failed(len(idx) - len(ok), "error")
                pending = ok
            # restart what died or hung, after counting (the decode first: its lost batch
            # is counted, and the prefilled requests wait for the new decode)
            for role, e, res in (("decode", d, dres), ("prefill", p, pres)):
                if isinstance(res, str):
                    pair.restart(role, e, res)
    finally:
        stop.set()
        thread.join()
    pair.restart_dead()
    pair.mark(None)
    pair.note("load stopped; draining")
    time.sleep(LEASE_S + 2)  # every hold's lease runs out
    leaked = {}
    end = time.monotonic() + args.drain
    for role, e in pair.engines.items():
        while (used := used_blocks(e)) > base[role] and time.monotonic() < end:
            time.sleep(1.0)
        leaked[role] = max(0, used - base[role])
    c = tally.c
    c["leaked_prefill"], c["leaked_decode"] = leaked["prefill"], leaked["decode"]
    c["restarts_scheduled"], c["restarts_needed"] = (pair.restarts["scheduled"],
                                                     pair.restarts["needed"])
    c["recomputed"] = log_count(workdir, dname, RECOVERED) + log_count(workdir, dname, FAILING)
    pool.stop(pname, dname)
    after = [after_restart(*w) for w in pair.windows]
    for line in after:
        print(f"  {name}: {line}", flush=True)
    return dict(connector=name, **c), pair.events + after, tally.wrong


def after_restart(what: str, then: tuple[int, int, int], until: tuple[int, int, int]) -> str:
    """One restart's window: the requests counted from ``then`` to ``until`` (each a
    ``(requests, equal, recomputed)`` of the run so far) and how many loaded their KV."""
    n, equal, recomputed = (b - a for a, b in zip(then, until))
    return (f"transfers after '{what}': {equal - recomputed} of {n} requests loaded their KV "
            f"({recomputed} recomputed) before the next fault")


def log_count(workdir: Path, name: str, pattern: re.Pattern) -> int:
    """The sum of ``pattern``'s count over every start's log of engine ``name``."""
    return sum(int(m.group(1)) for f in sorted(workdir.glob(f"{name}.*.log"))
               for m in pattern.finditer(f.read_text(errors="replace")))


def table(rows: list[dict]) -> str:
    head = "| connector | " + " | ".join(COUNTS) + " |"
    sep = "|---" * (len(COUNTS) + 1) + "|"
    return "\n".join([head, sep] + ["| " + r["connector"] + " | "
                                    + " | ".join(str(r[k]) for k in COUNTS) + " |"
                                    for r in rows])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=6.0, help="load time per connector")
    ap.add_argument("--concurrency", type=int, default=6, help="requests per round (4-8)")
    ap.add_argument("--connectors", nargs="+", default=list(CONNECTORS), choices=CONNECTORS)
    ap.add_argument("--prompts", type=int, default=160, help="distinct prompts cycled")
    ap.add_argument("--deadline", type=float, default=60.0,
                    help="seconds a round may take before its requests count as hung")
    ap.add_argument("--drain", type=float, default=30.0,
                    help="seconds, after the lease, for held blocks to come back")
    ap.add_argument("--json", type=Path, help="write the rows, events and wrong outputs here")
    ap.add_argument("--logs", type=Path, help="keep the engines' logs here (default: removed)")
    args = ap.parse_args()
    py = vllm_env.ensure()
    rng = random.Random(36)
    prompts = [prompt(36_000 + i, rng.randrange(MIN_LEN, MAX_LEN + 1))
               for i in range(args.prompts)]
    rows, out = [], {}
    shm = shm_files()
    with tempfile.TemporaryDirectory(prefix="soak-vllm-pd-") as tmp:
        workdir = args.logs or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        pool = Pool(py, workdir)
        try:
            for name in args.connectors:
                row, events, wrong = run_connector(pool, workdir, name, args, prompts)
                rows.append(row)
                out[name] = {"events": events, "wrong": wrong}
                print(table([row]), flush=True)
        finally:
            pool.close()
            remove_orphan_shm(shm)
    print(f"\n{time.strftime('%Y-%m-%d')}, {args.minutes:g} min per connector, "
          f"concurrency {args.concurrency}\n\n{table(rows)}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, **out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

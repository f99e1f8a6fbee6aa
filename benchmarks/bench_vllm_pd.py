"""P/D handover in real vLLM engines: KvplanConnector against vLLM's own NixlConnector, and
KvplanConnector's pull against its push and layer-wise push.

The same tiny Llama (tests/vllm_engine.py: 2 layers, 2 KV heads of 64, float32, blocks of 32)
is served as a prefill/decode pair of CPU engines at TP1 -> TP1 (one core each), once with each
connector, one pair at a time. For every prompt length and concurrency ``c``, rounds of ``c``
new prompts run:

1. plain: the prompts on the prefill engine, no connector involved (the reference tokens);
2. prefill: the prompts with ``do_remote_decode``, one token each (their transfer params);
3. decode: the prompts on the decode engine with those params, ``c`` at once: the KV is pulled;
4. local: the same prompts again on the decode engine, alone: now a prefix-cache hit on the
   blocks the pull wrote, so only the prompt's tail is computed.

TTFT is the decode's time to first token (from submitting the round); **handover** is a
request's decode TTFT minus its local TTFT: what the request paid for the connector (waiting for
the pull, the pull, its completion reaching the scheduler) beyond the compute of its tail. Pull
time, post time, bytes and descriptors per pull are the connector's own stats (Prometheus
histograms through vLLM's KV connector stats: ``vllm:nixl_*`` and ``vllm:kvplan_*``), as deltas
over each length and concurrency. Every decode's tokens must equal the plain run's.

A second part compares KvplanConnector's own modes on a deeper model (``llama-deep``: 16
layers, 4 KV heads of 64, 32 KiB of KV per token, so that a transfer is visible beside the
compute), TP1 -> TP1: pull, push (the prefill writes once the request finished) and layer-wise
push (each layer written from the forward), by the TTFT a proxy sees (from the first leg sent)
and the handover beyond the plain prefill's TTFT (:func:`run_modes`).

``--two-hosts``: the prefill engine in one network namespace, the decode in another, joined by
a veth pair (tests/netns.py; needs root), UCX over TCP on that link and the side channels on
the hosts' addresses: the same rows with the KV crossing a network link instead of loopback.

Run (about 9 minutes for each part; serialise with other engine runs)::

    flock /tmp/vllm-engines.lock python benchmarks/bench_vllm_pd.py
    python benchmarks/bench_vllm_pd.py --quick --check   # a smoke run; exit 1 on wrong output
    python benchmarks/bench_vllm_pd.py --connectors      # the modes part alone
    python benchmarks/bench_vllm_pd.py --two-hosts       # P and D on two hosts (veth)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests import netns, vllm_env  # noqa: E402  (the repo's test helpers build and drive the engines)
from tests.vllm_pool import (  # noqa: E402
    LAYERED,
    PUSH_REGISTERED,
    Pool,
    pd_push,
    prompt,
    push_params,
)

#: connector -> (prefill engine, decode engine, its metrics' prefix, its transfer_mode)
CONNECTORS = {
    "nixl": ("llama-p1-nixl-stats", "llama-d1-nixl-stats", "vllm:nixl_", "pull"),
    "kvplan": ("llama-p1-stats", "llama-d1-stats", "vllm:kvplan_", "kvplan"),
}
#: what we read from each connector's histograms (the names after the prefix)
HISTOGRAMS = {"pull_s": "xfer_time_seconds", "post_s": "post_time_seconds",
              "bytes": "bytes_transferred", "descriptors": "num_descriptors"}
DECODE_TOKENS = 8
#: KvplanConnector's timeline of each pull, logged by the decode worker when it reports the
#: pull to the scheduler (kvplan_nixl/vllm/worker.py; the histograms vllm:kvplan_phase_*)
TIMELINE = re.compile(r"kvplan: pull req=\S+ reported after ([\d.]+) ms: handshake ([\d.]+), "
                      r"post ([\d.]+), read ([\d.]+), confirm ([\d.]+), report ([\d.]+) ms")
PHASES = ("handover", "handshake", "post", "read", "confirm", "report")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def histograms(engine, prefix: str) -> dict[str, tuple[float, int]]:
    """(sum, count) of each of HISTOGRAMS on ``engine`` now."""
    m = engine.metrics(prefix)
    return {k: (m[prefix + n]["sum"], m[prefix + n]["count"]) if prefix + n in m else (0.0, 0)
            for k, n in HISTOGRAMS.items()}


def per_pull(before: dict, after: dict) -> dict[str, float]:
    out = {}
    for k in HISTOGRAMS:
        s, n = after[k][0] - before[k][0], after[k][1] - before[k][1]
        out[k] = s / n if n else float("nan")
    out["pulls"] = after["pull_s"][1] - before["pull_s"][1]
    return out


def timeline(engine, since: int) -> dict[str, float]:
    """p50 and p90 (seconds) of each phase of the pulls ``engine`` reported since byte
    ``since`` of its log (:data:`TIMELINE`; none for NixlConnector)."""
    got = [[float(x) / 1e3 for x in TIMELINE.search(ln).groups()]
           for ln in engine.log_lines(TIMELINE.pattern, since=since)]
    out: dict[str, float] = {"timelines": len(got)}
    for i, k in enumerate(PHASES):
        xs = [g[i] for g in got]
        out[f"t_{k}_p50"] = pct(xs, 0.5) if xs else float("nan")
        out[f"t_{k}_p90"] = pct(xs, 0.9) if xs else float("nan")
    return out


def run_connector(pool: Pool, name: str, lengths: list[int], concurrency: list[int],
                  requests: int) -> list[dict]:
    pname, dname, prefix, mode = CONNECTORS[name]
    p, d = pool.only(pname, dname)
    warm = prompt(9999, 64)  # the first pull pays the handshake: not measured
    pre = p.batch([{"prompt": warm, "max_tokens": 1, "params": {"do_remote_decode": True}}])
    d.batch([{"prompt": warm, "max_tokens": 1, "params": pre[0]["params"]}])
    rows = []
    for n in lengths:
        for c in concurrency:
            before, at = histograms(d, prefix), d.log_path.stat().st_size
            ttft, local, handover, wrong = [], [], [], 0
            for r in range(max(1, requests // c)):
                ids = [prompt(100_000 * n + 1000 * c + 10 * r + i, n) for i in range(c)]
                plain = p.batch([{"prompt": x, "max_tokens": DECODE_TOKENS} for x in ids])
                pre = p.batch([{"prompt": x, "max_tokens": 1,
                                "params": {"do_remote_decode": True}} for x in ids])
                for q in pre:
                    assert q["params"] and q["params"].get("transfer_mode") == mode, q
                dec = d.batch([{"prompt": x, "max_tokens": DECODE_TOKENS, "params": q["params"]}
                               for x, q in zip(ids, pre)])
                loc = d.batch([{"prompt": x, "max_tokens": DECODE_TOKENS} for x in ids])
                for a, b, want in zip(dec, loc, plain):
                    ttft.append(a["first"])
                    local.append(b["first"])
                    handover.append(a["first"] - b["first"])
                    wrong += a["tokens"] != want["tokens"]
            stats = per_pull(before, histograms(d, prefix))
            rows.append({"connector": name, "tokens": n, "concurrency": c,
                         "requests": len(ttft), "wrong": wrong,
                         "ttft_p50": pct(ttft, 0.5), "ttft_p90": pct(ttft, 0.9),
                         "local_p50": pct(local, 0.5),
                         "handover_p50": pct(handover, 0.5), "handover_p90": pct(handover, 0.9),
                         **stats, **timeline(d, at)})
            print(_line(rows[-1]), flush=True)
            if rows[-1]["timelines"]:
                print(_timeline_line(rows[-1]), flush=True)
    return rows


#: KvplanConnector's handover modes on the deep model (prefill engine, decode engine)
MODE_ENGINES = ("deep-p1", "deep-d1")
MODES = ("pull", "push", "layerwise")


def run_modes(pool: Pool, lengths: list[int], concurrency: list[int],
              requests: int) -> list[dict]:
    """Pull, push and layer-wise push on the deep model, as a proxy sees them.

    **client TTFT**: from the first leg's submission to the decode's first token. Pull: the
    prefill leg, then (its params back) the decode leg. Push and layer-wise: the decode leg,
    then (once every prefill rank has its registration: the order the flow needs, its wait
    counted) the prefill leg. **handover**: client TTFT minus the TTFT of a fresh prompt as
    long on the prefill engine alone, in the same round: what disaggregation cost beyond
    computing the prompt once. The reference tokens are the prefill engine's own run of each
    prompt after the legs (from its KV, in its prefix cache by then).
    """
    p, d = pool.only(*MODE_ENGINES)
    warm = prompt(9998, 64)  # connect both ways first: a handshake is not measured
    pre = p.batch([{"prompt": warm, "max_tokens": 1, "params": {"do_remote_decode": True}}])
    d.batch([{"prompt": warm, "max_tokens": 1, "params": pre[0]["params"]}])
    pd_push(p, d, prompt(9997, 64), "bench-warm")
    rows = []
    for n in lengths:
        for c in concurrency:
            for mode in MODES:
                rows.append(_mode_row(p, d, mode, n, c, requests))
                print(_mode_line(rows[-1]), flush=True)
    return rows


def _mode_row(p, d, mode: str, n: int, c: int, requests: int) -> dict:
    ttft, handover, leg, base_ttft = [], [], [], []
    wrong, layered = 0, len(p.log_lines(LAYERED))
    for r in range(max(1, requests // c)):
        seeds = [200_000 * n + 1000 * c + 10 * r + i + MODES.index(mode) * 7919
                 for i in range(c)]
        ids = [prompt(x, n) for x in seeds]  # new prompts per round and mode
        # the compute alone: as many fresh prompts as long on the prefill engine (the legs'
        # own prompts must not be in its prefix cache before the prefill leg)
        base = p.batch([{"prompt": prompt(x + 3_000_000, n), "max_tokens": 1} for x in seeds])
        keys = [f"bench-{mode}-{n}-{c}-{r}-{i}" for i in range(c)]
        if mode == "pull":
            t0 = time.perf_counter()
            pre = p.batch([{"prompt": x, "max_tokens": 1, "params": {"do_remote_decode": True}}
                           for x in ids])
            waited = time.perf_counter() - t0
            dec = d.batch([{"prompt": x, "max_tokens": DECODE_TOKENS, "params": q["params"]}
                           for x, q in zip(ids, pre)])
        else:
            at = p.log_path.stat().st_size  # read only what comes after: the log grows
            rid = d.submit_batch([{"prompt": x, "max_tokens": DECODE_TOKENS,
                                   "params": push_params(p, k)} for x, k in zip(ids, keys)])
            while len(p.log_lines(PUSH_REGISTERED, since=at)) < c * p.tp:
                time.sleep(0.002)
            pre = p.batch([{"prompt": x, "max_tokens": 1, "params": {
                "do_remote_decode": True, "transfer_mode": mode, "transfer_id": k}}
                for x, k in zip(ids, keys)])
            dec, waited = d.collect_batch(rid), 0.0
        # the reference tokens: the prefill engine continuing from its own KV of the prompts
        plain = p.batch([{"prompt": x, "max_tokens": DECODE_TOKENS} for x in ids])
        for a, b, q, want in zip(dec, base, pre, plain):
            leg.append(q["first"])
            base_ttft.append(b["first"])
            ttft.append(waited + a["first"])
            handover.append(waited + a["first"] - b["first"])
            wrong += a["tokens"] != want["tokens"]
    return {"mode": mode, "tokens": n, "concurrency": c, "requests": len(ttft), "wrong": wrong,
            "ttft_p50": pct(ttft, 0.5), "ttft_p90": pct(ttft, 0.9),
            "handover_p50": pct(handover, 0.5), "handover_p90": pct(handover, 0.9),
            "compute_p50": pct(base_ttft, 0.5), "prefill_leg_p50": pct(leg, 0.5),
            "layered": len(p.log_lines(LAYERED)) - layered}


def _mode_line(r: dict) -> str:
    ms = 1e3
    return (f"{r['mode']:>9} {r['tokens']:>4} tok c={r['concurrency']} n={r['requests']:>2}"
            f"  client TTFT p50 {r['ttft_p50'] * ms:6.1f} p90 {r['ttft_p90'] * ms:6.1f} ms"
            f"  handover p50 {r['handover_p50'] * ms:6.1f} p90 {r['handover_p90'] * ms:6.1f} ms"
            f"  (compute p50 {r['compute_p50'] * ms:6.1f}, prefill leg p50"
            f" {r['prefill_leg_p50'] * ms:6.1f} ms)"
            f"  layer-wise {r['layered']}/{r['requests']}  wrong={r['wrong']}")


def _line(r: dict) -> str:
    ms = 1e3
    return (f"{r['connector']:>6} {r['tokens']:>4} tok c={r['concurrency']} n={r['requests']:>2}"
            f"  TTFT p50 {r['ttft_p50'] * ms:6.1f} p90 {r['ttft_p90'] * ms:6.1f} ms"
            f" (local p50 {r['local_p50'] * ms:6.1f})"
            f"  handover p50 {r['handover_p50'] * ms:6.1f} p90 {r['handover_p90'] * ms:6.1f} ms"
            f"  pull {r['pull_s'] * ms:5.2f} ms post {r['post_s'] * ms:5.2f} ms"
            f"  {r['bytes'] / 1024:7.1f} KiB {r['descriptors']:6.1f} desc"
            f"  pulls={r['pulls']} wrong={r['wrong']}")


def _timeline_line(r: dict) -> str:
    return (f"{'':>6} timeline of {r['timelines']} pulls, p50 / p90 ms: "
            + ", ".join(f"{k} {r[f't_{k}_p50'] * 1e3:.2f} / {r[f't_{k}_p90'] * 1e3:.2f}"
                        for k in PHASES))


#: the quantities a ratio row compares
RATIO_KEYS = ("ttft_p50", "ttft_p90", "handover_p50", "handover_p90")


def ratios(rows: list[dict], by: str, base: str, keys: tuple[str, ...] = RATIO_KEYS
           ) -> list[dict]:
    """Each row's ``keys`` over those of the row of ``rows`` with ``row[by] == base`` and the
    same length and concurrency (KvplanConnector / NixlConnector; push / pull)."""
    ref = {(r["tokens"], r["concurrency"]): r for r in rows if r[by] == base}
    out = []
    for r in rows:
        b = ref.get((r["tokens"], r["concurrency"]))
        if r[by] == base or b is None:
            continue
        out.append({by: r[by], "tokens": r["tokens"], "concurrency": r["concurrency"],
                    **{k: r[k] / b[k] if b[k] else float("nan") for k in keys}})
    return out


def _print_ratios(title: str, rs: list[dict], by: str) -> None:
    if rs:
        print(f"\n{title}")
    for r in rs:
        print(f"  {r[by]:>9} {r['tokens']:>4} tok c={r['concurrency']}: "
              + "  ".join(f"{k} {v:.2f}" for k, v in r.items()
                          if k not in (by, "tokens", "concurrency")))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 320, 960],
                    help="prompt lengths in tokens (blocks of 32; at most 1016)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--requests", type=int, default=16,
                    help="requests per length and concurrency")
    ap.add_argument("--connectors", nargs="*", default=list(CONNECTORS), choices=CONNECTORS,
                    help="connectors to compare on the tiny model (none: skip that part)")
    ap.add_argument("--modes", action=argparse.BooleanOptionalAction, default=True,
                    help="pull vs push vs layer-wise push on the deep model")
    ap.add_argument("--mode-lengths", type=int, nargs="+", default=[320, 960])
    ap.add_argument("--quick", action="store_true", help="4 requests, two lengths")
    ap.add_argument("--check", action="store_true", help="exit 1 if any decode was wrong")
    ap.add_argument("--json", type=Path, help="write the rows and ratios here")
    ap.add_argument("--logs", type=Path, help="keep the engines' logs here (default: removed)")
    ap.add_argument("--two-hosts", action="store_true",
                    help="prefill and decode in two network namespaces joined by a veth")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.lengths, args.mode_lengths = 4, [64, 960], [960]
    py = vllm_env.ensure()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-vllm-pd-") as tmp, \
            contextlib.ExitStack() as stack:
        workdir = args.logs or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        hosts = None
        if args.two_hosts:
            if (why := netns.unavailable()) is not None:
                ap.error(f"--two-hosts: {why}")
            hosts = stack.enter_context(netns.TwoHosts())
        pool = Pool(py, workdir, hosts)
        try:
            for name in args.connectors:
                rows += run_connector(pool, name, args.lengths, args.concurrency,
                                      args.requests)
            mrows = run_modes(pool, args.mode_lengths, args.concurrency, args.requests) \
                if args.modes else []
        finally:
            pool.close()
    rs = ratios(rows, "connector", "nixl",
                (*RATIO_KEYS, "pull_s", "post_s", "bytes", "descriptors"))
    _print_ratios("KvplanConnector / NixlConnector (<= 1.0: kvplan as fast or faster)", rs,
                  "connector")
    mrs = ratios(mrows, "mode", "pull")
    _print_ratios("KvplanConnector push and layer-wise push / its pull (< 1.0: faster than "
                  "pull)", mrs, "mode")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "ratios": rs, "mode_rows": mrows,
                                         "mode_ratios": mrs}, indent=1))
    wrong = sum(r["wrong"] for r in rows + mrows)
    print(f"\n{sum(r['requests'] for r in rows + mrows)} requests, {wrong} decoded wrong")
    return 1 if args.check and wrong else 0


if __name__ == "__main__":
    sys.exit(main())

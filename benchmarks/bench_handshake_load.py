"""A busy decode's handshake in real vLLM engines (issue 46, item 4): how long a KvplanConnector
decode takes to connect a prefill it has not connected yet while it decodes other requests.

The tests' tiny Llama as a TP1 -> TP1 pair of CPU engines (tests/vllm_pool.py, the
``llama-p1-stats`` / ``llama-d1-stats`` pair of ``bench_vllm_pd.py``). For each round: the
prefill engine is restarted in place (a clean stop: its close notices make the decode forget
it, so the next pull connects afresh), ``--load`` requests are set decoding on the decode
engine (``--tokens`` each) together with one prompt that goes P -> D. Its handshake is that
pull's ``phase_handshake``: from the worker getting the load to its prefill connected and the
pull started, from the decode's timeline log line (docs/vllm.md, "Stats"); the handover beside
it is the pull's admission to its report.

Run (about a minute per round; serialise with other engine runs)::

    flock /tmp/vllm-engines.lock python benchmarks/bench_handshake_load.py --rounds 3
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.bench_vllm_pd import TIMELINE, pct  # noqa: E402
from tests import vllm_env  # noqa: E402
from tests.vllm_pool import Pool, prompt  # noqa: E402

ENGINES = ("llama-p1-stats", "llama-d1-stats")


def round_once(pool: Pool, load: int, tokens: int, seed: int, restart: bool) -> dict:
    """One fresh handshake while ``load`` requests decode; its timeline (seconds)."""
    p, d = pool.only(*ENGINES)
    if restart:
        p = pool.restart(ENGINES[0])
    ids = prompt(seed, 64)
    pre = p.batch([{"prompt": ids, "max_tokens": 1, "params": {"do_remote_decode": True}}])
    at = d.log_path.stat().st_size
    # one batch (the engine driver runs a batch at a time): the load's requests and the pull
    # are submitted together, so the pull's handshake runs while they compute and decode
    reqs = [{"prompt": prompt(seed * 10 + i, 64), "max_tokens": tokens} for i in range(load)]
    t0 = time.perf_counter()
    got = d.batch([*reqs, {"prompt": ids, "max_tokens": 1, "params": pre[0]["params"]}])[-1:]
    took = got[0]["first"]
    assert time.perf_counter() - t0 > took
    lines = d.log_lines(TIMELINE.pattern, since=at)
    assert got[0]["error"] is None and lines, (got, d.tail())
    marks = [float(x) / 1e3 for x in TIMELINE.search(lines[0]).groups()]
    return {"handover": marks[0], "handshake": marks[1], "client": took}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="fresh handshakes measured")
    ap.add_argument("--load", type=int, default=4, help="requests decoding meanwhile")
    ap.add_argument("--tokens", type=int, default=200, help="tokens each of them decodes")
    args = ap.parse_args()
    py = vllm_env.ensure()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-hs-load-") as tmp:
        pool = Pool(py, Path(tmp))
        try:
            for r in range(args.rounds):
                rows.append(round_once(pool, args.load, args.tokens, 7000 + r, restart=r > 0))
                x = rows[-1]
                print(f"round {r}: handshake {x['handshake'] * 1e3:.1f} ms, admission to "
                      f"report {x['handover'] * 1e3:.1f} ms, the pull's TTFT "
                      f"{x['client'] * 1e3:.1f} ms ({args.load} requests decoding)",
                      flush=True)
        finally:
            pool.close()
    hs = [x["handshake"] for x in rows]
    print(f"\nhandshake under load: p50 {pct(hs, 0.5) * 1e3:.1f} ms, max {max(hs) * 1e3:.1f} ms "
          f"over {len(hs)} fresh handshakes")
    return 0


if __name__ == "__main__":
    sys.exit(main())

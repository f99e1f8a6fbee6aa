"""The support table of docs/vllm.md, measured: for each model and connector, P TP1 -> D TP1,
P TP1 -> D TP2 and P TP2 -> D TP1 with real vLLM CPU engines (the venv of tests/vllm_env.py),
decode's greedy tokens against the plain run.

    python tests/vllm_matrix.py nemo1 nemo2 gemma3 --connectors kvplan nixl

Prints one markdown row per (model, connector, pair): equal or not, the first differing
token's index and the largest logprob difference over the prompts. Model keys are those of
tests/vllm_pool.py (``MODELS``). Takes 5-10 minutes per model and connector on two cores.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import vllm_env
from tests.vllm_pool import Pool, pd, prompt

PAIRS = (("p1", "d1", "TP1 -> TP1"), ("p1", "t2", "TP1 -> TP2"), ("t2", "d1", "TP2 -> TP1"))


def compare(got: dict, plain: dict) -> tuple[bool, int | None, float]:
    first = next((i for i, (a, b) in enumerate(zip(got["tokens"], plain["tokens"])) if a != b),
                 None)
    diff = max((abs(a - b) for a, b in zip(got.get("logprobs") or [],
                                            plain.get("logprobs") or [])), default=0.0)
    return first is None, first, diff


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--connectors", nargs="+", default=["kvplan", "nixl"])
    ap.add_argument("--lengths", type=int, nargs="+", default=[45, 70])
    args = ap.parse_args()
    # a timeout or kill -TERM still stops the engines (each runs in its own session)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    pool = Pool(vllm_env.ensure(), Path(tempfile.mkdtemp(prefix="kvplan-matrix-")))
    print("| model | connector | pair | prompts | equal | first differing token "
          "| max logprob diff |")
    print("|---|---|---|---|---|---|---|")
    try:
        for key in args.models:
            for conn in args.connectors:
                suffix = "-nixl" if conn == "nixl" else ""
                names = [f"{key}-{r}{suffix}" for r in ("p1", "d1", "t2")]
                eng = dict(zip(("p1", "d1", "t2"), pool.only(*names)))
                mode = "pull" if conn == "nixl" else "kvplan"
                for p, d, label in PAIRS:
                    res = []
                    for i, n in enumerate(args.lengths):
                        ids = prompt(1000 + i, n)
                        plain = eng[p].generate(ids, 16)
                        res.append(compare(pd(eng[p], eng[d], ids, mode=mode), plain))
                    ok = all(r[0] for r in res)
                    firsts = [str(r[1]) for r in res if r[1] is not None]
                    diff = max(r[2] for r in res)
                    print(f"| {key} | {conn} | {label} | {len(res)} | {'yes' if ok else 'NO'} | "
                          f"{', '.join(firsts) or '-'} | {diff:.1e} |", flush=True)
    finally:
        pool.close()


if __name__ == "__main__":
    main()

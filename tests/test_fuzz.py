"""Fuzz the trust boundary: specs, requests, metadata (forged with a recomputed checksum, with
and without a secret) and the CLI. Every probe is classified typed / ok / untyped / crash /
hang (/ trace: a refused connect that changed the endpoint) in worker subprocesses
(``tests/fuzz_probes.py``), so that a crash or a hang is observed, not suffered.

Escapes (must be zero): untyped, crash, hang, trace, and any forgery accepted under a secret.
The one category allowed to crash is ``connect-nixl`` -- forged bytes inside NIXL's own
section with no secret -- the residual risk docs/executor.md describes; it is run and its
outcome recorded, and it must not be anything but typed / ok / crash.
"""

from __future__ import annotations

import collections
import json
import os
import select
import subprocess
import sys
import time

import pytest

from tests.nixl_util import REPO, peer_env

WORKER = os.path.join(REPO, "tests", "fuzz_probes.py")
STARTUP_S = 60.0  # a worker importing NIXL on a loaded machine
PROBE_S = 10.0  # per probe, beyond the worker's own 2 s alarm: a hang inside C++


def run_probes(category: str, count: int, start: int = 0) -> dict[int, tuple[str, str]]:
    """Run probes ``[start, start + count)`` of ``category``; a worker that dies is restarted
    after the probe it died in (classified crash), one that stops answering is killed (hang)."""
    results: dict[int, tuple[str, str]] = {}
    end = start + count
    i = start
    while i < end:
        proc = subprocess.Popen(
            [sys.executable, WORKER, category, str(i), str(end - i)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=peer_env(), text=True,
        )
        current = i
        wait = STARTUP_S
        try:
            while True:
                ready, _, _ = select.select([proc.stdout], [], [], wait)
                if not ready:  # silent: hung inside a probe
                    proc.kill()
                    results[current] = ("hang", f"no answer within {wait} s")
                    break
                line = proc.stdout.readline()
                if not line:  # the worker died
                    rc = proc.wait(30)
                    if current not in results:
                        results[current] = ("crash", f"worker exited with {rc}")
                    break
                msg = json.loads(line)
                if "start" in msg:
                    current = msg["start"]
                    wait = PROBE_S
                else:
                    results[msg["i"]] = (msg["class"], msg["detail"])
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)
            proc.stdout.close()
        i = max(results, default=i - 1) + 1
    return results


def _summary(category: str, results) -> str:
    counts = collections.Counter(c for c, _ in results.values())
    return f"{category}: {len(results)} probes, " + ", ".join(
        f"{k} {v}" for k, v in sorted(counts.items()))


def _escapes(results, allowed) -> list[str]:
    return [f"probe {i}: {c} {d}" for i, (c, d) in sorted(results.items()) if c not in allowed]


@pytest.mark.parametrize(
    ("category", "count", "allowed"),
    [
        ("spec", 250, {"typed", "ok"}),
        ("request", 150, {"typed", "ok"}),
        ("decode", 250, {"typed", "ok"}),
        ("connect-signed", 60, {"typed"}),
        ("connect-header", 60, {"typed", "ok"}),
        ("connect-nixl", 40, {"typed", "ok", "crash"}),  # residual risk without a secret
    ],
)
def test_fuzz(category, count, allowed):
    t = time.perf_counter()
    results = run_probes(category, count)
    print(_summary(category, results), f"in {time.perf_counter() - t:.1f} s")
    assert sorted(results) == list(range(count))
    escapes = _escapes(results, allowed)
    assert not escapes, "\n".join(escapes[:20])
    if category in ("spec", "request", "decode", "connect-header"):
        # the probes must exercise refusals, not only mutations that happen to stay valid
        assert sum(c == "typed" for c, _ in results.values()) > count // 3


# -- the CLI: every bad input one `kvplan:` line, a non-zero exit, no traceback ----------------

def _cli_cases(tmp) -> list[tuple[str, list[str]]]:
    latin1 = tmp / "latin1.json"
    latin1.write_bytes(b'{"tp_size": 1, "regions": [], "name": "caf\xe9"}')
    deep = tmp / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    listdtype = tmp / "listdtype.json"
    listdtype.write_text(json.dumps({"tp_size": 1, "regions": [
        {"name": "a", "kind": "mla", "group": 0, "num_blocks": 4, "block_size": 16,
         "dtype": ["bfloat16"], "dim": 64}]}))
    huge = tmp / "huge.json"
    huge.write_text(json.dumps({"tp_size": 2**40, "regions": [
        {"name": "a", "kind": "mla", "group": 0, "num_blocks": 4, "block_size": 16,
         "dtype": "bfloat16", "dim": 64}]}))
    return [
        ("check non-UTF-8 file", ["check", str(latin1), str(latin1)]),
        ("check deep JSON", ["check", str(deep), str(deep)]),
        ("check list dtype", ["check", str(listdtype), str(listdtype)]),
        ("check tp 2**40", ["check", str(huge), str(huge)]),
        ("plan --num-blocks 0", ["plan", "--num-blocks", "0"]),
        ("plan --prefill-block-size 0", ["plan", "--prefill-block-size", "0"]),
        ("plan --tokens -5", ["plan", "--tokens", "-5"]),
        ("plan huge --tokens", ["plan", "--tokens", str(10**30)]),
        ("plan --prefill-tp 2**40", ["plan", "--prefill-tp", str(2**40)]),
        ("plan --slots -1", ["plan", "--slots", "-1"]),
        ("explain --block-size 0", ["explain", "--prefill", "llama-3.1-8b", "--decode",
                                    "llama-3.1-8b", "--prefill-tp", "1", "--decode-tp", "1",
                                    "--block-size", "0"]),
    ]


def _cli_class(rc: int | None, err: str) -> str:
    if rc is None:
        return "hang"
    if rc < 0:
        return "crash"
    if "Traceback" in err:
        return "untyped"
    lines = [x for x in err.splitlines() if x.strip()]
    if rc != 0 and len(lines) == 1 and lines[0].startswith("kvplan:"):
        return "typed"
    return "untyped" if rc != 0 else "accepted"  # a bad value run anyway (or defaulted)


#: CLI probes still failing because their fix belongs to issue 12a (none since main, with 12a's
#: CLI, was merged into this branch): listed here they are xfail(strict=True).
CLI_12A: set[str] = set()


@pytest.fixture(scope="module")
def cli_outcomes(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """Every CLI probe, run at once (each is a fresh interpreter)."""
    cases = _cli_cases(tmp_path_factory.mktemp("cli"))
    procs = [
        subprocess.Popen([sys.executable, "-m", "kvplan.cli", *argv], cwd=REPO,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         env=peer_env())
        for _, argv in cases
    ]
    outcome = {}
    for (name, _), p in zip(cases, procs, strict=True):
        try:
            _, err = p.communicate(timeout=60)
            outcome[name] = (_cli_class(p.returncode, err), err.strip()[-300:])
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            outcome[name] = ("hang", "")
    counts = collections.Counter(c for c, _ in outcome.values())
    print(f"cli: {len(cases)} probes, " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return outcome


CLI_NAMES = [
    "check non-UTF-8 file", "check deep JSON", "check list dtype", "check tp 2**40",
    "plan --num-blocks 0", "plan --prefill-block-size 0", "plan --tokens -5",
    "plan huge --tokens", "plan --prefill-tp 2**40", "plan --slots -1",
    "explain --block-size 0",
]


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason="fixed by issue 12a"))
     if n in CLI_12A else n for n in CLI_NAMES],
)
def test_fuzz_cli(cli_outcomes, name):
    assert sorted(cli_outcomes) == sorted(CLI_NAMES)
    cls, err = cli_outcomes[name]
    assert cls == "typed", f"{name}: {cls}: {err}"

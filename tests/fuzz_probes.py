"""Fuzz probes of the trust boundary, run by ``tests/test_fuzz.py`` in worker subprocesses.

    python tests/fuzz_probes.py CATEGORY START COUNT

Each probe is made from (category, index) alone with a seeded generator, so a result can be
reproduced by its index. The worker prints ``{"start": i}`` before probe ``i`` and one JSON line
``{"i": i, "class": ..., "detail": ...}`` after it; the harness classifies a worker that dies
mid-probe as a *crash* and one that stops printing as a *hang*. Classes a worker reports:

- ``typed``: refused with an error of kvplan / kvplan_nixl (``KVPlanError``), as it must;
- ``ok``: accepted (the mutation left a valid input);
- ``untyped``: any other exception (an escape);
- ``hang``: the probe ran past its time budget (a SIGALRM in the worker);
- ``trace``: a refused connect changed the endpoint (handles, peers or routes): an escape.

Categories: ``spec`` (EngineSpec.from_dict, then both maps and a plan when accepted),
``request`` (plan over mutated block-id lists), ``decode`` (pure metadata decode of forged
blobs, with and without a secret), ``connect-signed`` (real endpoints with a secret, forged
blobs of every kind), ``connect-header`` (no secret, forged header with a recomputed checksum),
``connect-nixl`` (no secret, forged bytes inside NIXL's own section: the residual risk).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BUDGET_S = 2.0  # per probe: anything slower is a hang (a refusal must cost milliseconds)
KEY = b"fuzz-deployment-secret"

NASTY = [None, True, False, 0, -1, 1, 2, 3, 7, 2**31, 2**62, 2**63, 2**64, 10**30, -(2**63),
         1.5, float("inf"), "", "x", "bfloat16", "attention", "state", "joint", "NHD", [], {},
         [[]], [1, [2]], {"a": 1}, "\udcff"]


def _deep(n: int) -> list:
    d: list = []
    for _ in range(n):
        d = [d]
    return d


class _Hang(BaseException):
    pass


def _alarm(*_):
    raise _Hang()


# -- mutations of JSON-like values ------------------------------------------------------------

def _paths(v, prefix=()):
    yield prefix
    if isinstance(v, dict):
        for k, x in v.items():
            yield from _paths(x, (*prefix, k))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            yield from _paths(x, (*prefix, i))


def _set(root, path, value):
    if not path:
        return value
    node = root
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return root


def mutate(doc, rng: random.Random, rounds: int = 1):
    """``doc`` with ``rounds`` random edits: a nasty value, a deleted or unknown key, a deep
    nest, a copied sibling (duplicates), or a huge number."""
    doc = copy.deepcopy(doc)  # once: a deep nest (added last) would not survive a deepcopy
    for _ in range(rounds):
        paths = list(_paths(doc))
        path = rng.choice(paths[1:] or paths)
        op = rng.random()
        if op < 0.55:
            doc = _set(doc, path, copy.deepcopy(rng.choice(NASTY)))
        elif op < 0.65 and path and isinstance(_get(doc, path[:-1]), dict):
            del _get(doc, path[:-1])[path[-1]]
        elif op < 0.72 and path and isinstance(_get(doc, path[:-1]), dict):
            _get(doc, path[:-1])["unknown_" + str(rng.randrange(9))] = 1
        elif op < 0.77:  # as deep as json.loads goes (deeper JSON fails to parse: own probe)
            doc = _set(doc, path, _deep(rng.choice([10, 100, 900])))
            break
        elif op < 0.85 and path and isinstance(_get(doc, path[:-1]), list):
            lst = _get(doc, path[:-1])
            lst.append(copy.deepcopy(lst[path[-1]]))
        else:
            doc = _set(doc, path, rng.choice([2**40, 2**61, 2**62 - 1, 2**63 - 1, 4097, 65537]))
    return doc


def _get(root, path):
    for k in path:
        root = root[k]
    return root


# -- categories --------------------------------------------------------------------------------

def _base_specs():
    from kvplan.examples import gqa_with_mla_draft, kimi_linear_like, nemotron_h_like

    return [gqa_with_mla_draft(2, layers=2, num_blocks=16).to_dict(),
            kimi_linear_like(2, layers=2, num_blocks=8).to_dict(),
            nemotron_h_like(2, pp_size=2, mamba_layers=2, num_blocks=8, num_slots=4).to_dict()]


def probe_spec(i: int) -> str:
    from kvplan import EngineSpec, pull_map, push_map

    rng = random.Random(("spec", i).__repr__())
    doc = mutate(rng.choice(_base_specs()), rng, rounds=rng.choice([1, 1, 2, 3]))
    s = EngineSpec.from_dict(doc)
    d = pull_map(s, s, 0)
    push_map(s, s, 0)
    d.plan([[0]] * s.num_groups, [[0]] * s.num_groups)
    return "ok"


def probe_request(i: int) -> str:
    from kvplan import EngineSpec, pull_map

    rng = random.Random(("request", i).__repr__())
    spec = EngineSpec.from_dict(_base_specs()[rng.randrange(2)])
    m = pull_map(spec, spec, 0)
    good = [[0, 1, 2], [3, 4]][: spec.num_groups]
    good += [[5]] * (spec.num_groups - len(good))
    doc = mutate({"v": good}, rng, rounds=rng.choice([1, 2]))
    src = doc["v"] if isinstance(doc, dict) and "v" in doc else doc  # the edit hit the wrapper
    m.plan(src, good)
    return "ok"


def _peer_info():
    from kvplan_nixl import metadata as md

    spec = __import__("kvplan").EngineSpec.from_dict(_base_specs()[0])
    n = len(spec.regions)
    agent = "prefill#1#beef"
    fake_nixl = (b"nixlSerDes|Agent" + len(agent).to_bytes(8, "little") + agent.encode() + b"|"
                 + b"\x01rest-of-nixl" * 8)
    held = spec.regions_on(1)
    return md.PeerInfo(
        engine="prefill", rank=1, agent=agent, spec=spec, mem_type="DRAM",
        bases=tuple(4096 * (i + 1) if i in held else 0 for i in range(n)),
        nbytes=tuple(spec.rank_region_nbytes(i) if i in held else 0 for i in range(n)),
        devices=(0,) * n, agent_metadata=fake_nixl,
    )


def rewrite(blob: bytes, header=None, agent_md: bytes | None = None,
            sign: bytes | None = None) -> bytes:
    """``blob`` with a new header document and/or NIXL section, its digest recomputed: sha256
    (anyone can), or an HMAC under ``sign`` (a wrong key, for the signed categories)."""
    from kvplan_nixl import metadata as md

    _, version, hlen, _ = md._FIXED.unpack_from(blob)
    h = blob[md._FIXED.size : md._FIXED.size + hlen]
    a = blob[md._FIXED.size + hlen : -32]
    if header is not None:
        try:
            h = json.dumps(header).encode()
        except (ValueError, RecursionError):
            h = b"[" * 100_000
    if agent_md is not None:
        a = agent_md
    body = md._FIXED.pack(md.MAGIC, version, len(h), len(a)) + h + a
    digest = hashlib.sha256(body).digest() if sign is None else md.mac(sign, md._MAC_METADATA,
                                                                         body)
    return body + digest


#: Tags of NIXL's serialized agent whose 8-byte length fields the targeted probes overwrite
#: with lengths that wrap NIXL's own bounds check (offset + len + 1 overflows).
NIXL_TAGS = (b"Conns", b"nixlSecElms", b"bknd", b"nixlDList")
TARGETED = 2 * len(NIXL_TAGS)


def forge_length(blob: bytes, j: int) -> bytes:
    """``blob`` with the length after NIXL tag ``j % 4`` set to ``2**64 - 1 - j`` (probe j)."""
    from kvplan_nixl import metadata as md

    _, _, hlen, _ = md._FIXED.unpack_from(blob)
    a = bytearray(blob[md._FIXED.size + hlen : -32])
    tag = NIXL_TAGS[j % len(NIXL_TAGS)]
    at = a.find(tag)
    if at >= 0:
        a[at + len(tag) : at + len(tag) + 8] = ((1 << 64) - 1 - j).to_bytes(8, "little")
    return rewrite(blob, agent_md=bytes(a))


def _forge(blob: bytes, rng: random.Random, *, nixl_only: bool = False,
           header_only: bool = False) -> bytes:
    from kvplan_nixl import metadata as md

    _, _, hlen, _ = md._FIXED.unpack_from(blob)
    header = json.loads(blob[md._FIXED.size : md._FIXED.size + hlen])
    agent_md = blob[md._FIXED.size + hlen : -32]
    kind = rng.random()
    if nixl_only or (not header_only and kind < 0.3):  # bytes of NIXL's section
        b = bytearray(agent_md)
        start = len(md._NIXL_PREFIX) + 8 + len(header["agent"]) + 1  # past the checked name
        lo = start if nixl_only else 0
        for _ in range(rng.choice([1, 1, 2, 8])):
            b[rng.randrange(lo, len(b))] = rng.randrange(256)
        if not nixl_only and rng.random() < 0.2:
            b = b[: rng.randrange(len(b))]
        return rewrite(blob, agent_md=bytes(b))
    if kind < 0.4 and not header_only:  # any byte anywhere (lengths, magic, version too)
        b = bytearray(blob)
        b[rng.randrange(len(b) - 32)] ^= 1 << rng.randrange(8)
        body = bytes(b[:-32])
        return body + hashlib.sha256(body).digest()
    return rewrite(blob, header=mutate(header, rng, rounds=rng.choice([1, 1, 2])))


def probe_decode(i: int) -> str:
    from kvplan_nixl import MetadataError
    from kvplan_nixl import metadata as md

    rng = random.Random(("decode", i).__repr__())
    info = _peer_info()
    signed = i % 2 == 1
    blob = md.encode(info, KEY if signed else None)
    forged = _forge(blob, rng)
    if signed:  # forged with a recomputed sha256, or re-signed under a wrong key
        if rng.random() < 0.5:
            forged = forged[:-32] + md.mac(b"wrong key", md._MAC_METADATA, forged[:-32])
        try:
            md.decode(forged, KEY)
        except MetadataError:
            return "typed"
        return "accepted-forgery"  # an escape: a forged blob passed the MAC
    md.decode(forged)
    return "ok"


_WORLD: dict = {}


def _world(secret):
    """One source rank and one destination rank, real NIXL endpoints (built once per worker)."""
    if "d" not in _WORLD:
        import numpy as np

        from kvplan import EngineSpec
        from kvplan_nixl import Endpoint
        from tests.nixl_util import attn, mla

        spec = EngineSpec.from_dict({"tp_size": 1, "regions": [attn(heads=4, nb=8),
                                                                mla(nb=8)]})
        bufs = {k: [np.zeros(spec.rank_region_nbytes(i), np.uint8) for i in range(2)]
                for k in ("p", "d")}
        _WORLD["p"] = Endpoint("prefill", spec, 0, bufs["p"], secret=secret)
        _WORLD["d"] = Endpoint("decode", spec, 0, bufs["d"], secret=secret)
        _WORLD["bufs"] = bufs
        _WORLD["good"] = _WORLD["p"].metadata()
    return _WORLD["p"], _WORLD["d"], _WORLD["good"]


def _state(ep):
    return ep.handles(), [(p.engine, p.rank, p.agent) for p in ep.peers()], sorted(ep._routes)


def _connect_probe(i: int, category: str, secret, **forge_kw) -> str:
    from kvplan import KVPlanError
    from kvplan_nixl import metadata as md

    rng = random.Random((category, i).__repr__())
    _, d, good = _world(secret)
    if category != "connect-header" and i < TARGETED:  # the lengths NIXL's parser trusts
        forged = forge_length(good, i)
    else:
        forged = _forge(good, rng, **forge_kw)
    if secret is not None and rng.random() < 0.5:
        forged = forged[:-32] + md.mac(b"wrong key", md._MAC_METADATA, forged[:-32])
    before = _state(d)
    try:
        d.connect(forged)
    except KVPlanError as exc:
        why = f"{type(exc).__name__}: {str(exc)[:160]}"
        return ("typed" if _state(d) == before else "trace"), why
    if secret is not None:
        return "accepted-forgery"
    for p in d.peers():  # accepted (an equivalent blob): undo, for the next probe
        d.disconnect(p.engine, p.rank)
    return "ok"


def probe_connect_signed(i: int) -> str:
    return _connect_probe(i, "connect-signed", KEY)


def probe_connect_header(i: int) -> str:
    return _connect_probe(i, "connect-header", None, header_only=True)


def probe_connect_nixl(i: int) -> str:
    return _connect_probe(i, "connect-nixl", None, nixl_only=True)


PROBES = {
    "spec": probe_spec,
    "request": probe_request,
    "decode": probe_decode,
    "connect-signed": probe_connect_signed,
    "connect-header": probe_connect_header,
    "connect-nixl": probe_connect_nixl,
}


def main(category: str, start: int, count: int) -> int:
    from kvplan import KVPlanError

    os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")
    signal.signal(signal.SIGALRM, _alarm)
    fn = PROBES[category]
    _base_specs()  # imports and set-up are not part of any probe's time budget
    if category == "connect-signed":
        _world(KEY)
    elif category.startswith("connect"):
        _world(None)
    for i in range(start, start + count):
        print(json.dumps({"start": i}), flush=True)
        signal.setitimer(signal.ITIMER_REAL, BUDGET_S)
        try:
            cls, detail = fn(i), ""
            if isinstance(cls, tuple):
                cls, detail = cls
        except _Hang:
            cls, detail = "hang", f"over {BUDGET_S} s"
        except KVPlanError as exc:
            cls, detail = "typed", f"{type(exc).__name__}: {str(exc)[:200]}"
        except Exception as exc:  # an escape: record it, keep going
            cls, detail = "untyped", f"{type(exc).__name__}: {str(exc)[:200]}"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        print(json.dumps({"i": i, "class": cls, "detail": detail}), flush=True)
    for k in ("d", "p"):
        if k in _WORLD:
            _WORLD[k].close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))

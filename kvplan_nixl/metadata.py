"""The endpoint metadata blob: what a peer needs to connect, versioned and checksummed.

Wire format (all integers big-endian)::

    magic  b"KVPLNIXL"            8 bytes, never changes
    format u16                    FORMAT_VERSION; checked right after the magic, so a peer of
                                  another version is refused by name even if the rest changed
    header u32, agent u32         lengths of the two parts below
    header                        UTF-8 JSON: engine, rank, agent name, spec, mem type (the
                                  rank's first buffer's NIXL memory type), "memory":
                                  [[buffer, type], ...] for each buffer held in another memory
                                  type (indices of ``spec.buffers``; absent when none), and
                                  "regions": [[index, base, nbytes, device], ...], one row per
                                  region the rank holds (its pipeline stage's), indices those
                                  of the whole spec; the regions of one pool repeat the pool's
                                  base and size (one allocation); "app": {name: value} (absent
                                  when empty): strings the layer above advertises and checks
                                  itself (KvplanConnector: the vLLM version), signed with the
                                  rest, never read here
    agent                         NIXL's own agent metadata (opaque but for its first field,
                                  the agent's name: see :func:`nixl_agent_name`)
    digest                        32 bytes: sha256 of everything above, or, when the endpoint
                                  has a deployment secret, HMAC-SHA256 of it under that secret

Signing changes no byte but the digest, so the format version is the same either way. A reader
with a secret accepts only a correct HMAC (and says "unsigned" when the digest is a plain
sha256); a reader without one accepts only a correct sha256, which anyone can recompute: without
a secret, peers are trusted (docs/executor.md, "Trust boundary").

Pure: no NIXL import; :func:`decode` raises :class:`~kvplan_nixl.errors.MetadataError` with a
message saying which of foreign / other version / unsigned / wrongly signed / corrupt /
inconsistent it is, and naming the peer once the header is readable. Every check is linear in
the blob's size and done before anything is handed to NIXL.

Bottom layer: owns the byte format only; it may import only the core and ``errors``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct

import attrs

from kvplan import EngineSpec, KVPlanError
from kvplan_nixl.errors import MetadataError

MAGIC = b"KVPLNIXL"
#: Bump when the header's meaning changes; peers of other versions are refused.
#: 1: one row per region of the spec (TP only). 2: rows carry the region index and list only
#: the regions of the rank's pipeline stage; pooled regions share their allocation's row.
#: 3: "memory" names the buffers held in another memory type than "mem_type" (a rank may hold
#: DRAM and VRAM buffers); a version-2 reader would have taken every buffer for "mem_type".
FORMAT_VERSION = 3
_FIXED = struct.Struct(">8sHII")
#: Every advertised buffer must end at or below this address: descriptor offsets are int64.
_ADDRESS_END = 1 << 63
_DIGEST = 32
#: Refuse headers larger than this before parsing JSON (a spec of kvplan.spec.MAX_REGIONS
#: regions is about 0.25 MiB).
MAX_HEADER_BYTES = 4 << 20
#: Refuse NIXL sections larger than this (NIXL's metadata is ~0.5 KiB plus ~50 B per allocation).
MAX_AGENT_BYTES = 16 << 20
#: The largest blob :func:`decode` can accept (what a reader of a blob off the wire may bound
#: its read by, before reading it).
MAX_BLOB_BYTES = _FIXED.size + MAX_HEADER_BYTES + MAX_AGENT_BYTES + _DIGEST
#: Separator of the fields of an agent name, ``engine#rank#nonce`` (parsed from the right).
AGENT_SEP = "#"
#: Memory types an endpoint registers (NIXL's names).
MEM_TYPES = ("DRAM", "VRAM")
#: Domain-separation prefixes: a MAC made for one kind of message is no MAC of another.
_MAC_METADATA = b"kvplan_nixl metadata\x00"
_NIXL_PREFIX = b"nixlSerDes|Agent"


def check_secret(secret: bytes | str | None) -> bytes | None:
    """The deployment secret as bytes (``None`` stays ``None``); empty or odd types refused."""
    if secret is None:
        return None
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, (bytes, bytearray)) or not secret:
        raise MetadataError(
            f"secret must be non-empty bytes or str, got {type(secret).__name__}"
            + (" (empty)" if isinstance(secret, (bytes, bytearray)) else "")
        )
    return bytes(secret)


def mac(secret: bytes, domain: bytes, data: bytes) -> bytes:
    """HMAC-SHA256 of ``data`` under ``secret``, bound to the kind of message ``domain``."""
    return hmac.new(secret, domain + data, hashlib.sha256).digest()


def agent_name(engine: str, rank: int, nonce: str) -> str:
    """The NIXL agent name of an endpoint: binds its engine and rank (``engine#rank#nonce``)."""
    return f"{engine}{AGENT_SEP}{rank}{AGENT_SEP}{nonce}"


def parse_agent_name(name: str) -> tuple[str, int] | None:
    """``(engine, rank)`` of an agent name made by :func:`agent_name`, or None."""
    parts = name.rsplit(AGENT_SEP, 2)
    if len(parts) == 3 and parts[0] and parts[1].isdigit() and parts[1].isascii() and parts[2]:
        return parts[0], int(parts[1])
    return None


def nixl_agent_name(agent_md: bytes) -> str | None:
    """The agent name NIXL's metadata blob starts with, read without NIXL, or None.

    NIXL (1.5) serializes an agent as ``nixlSerDes|`` then tagged fields, each ``tag``, its
    length as 8 little-endian bytes, the value and ``|``; the first field is ``Agent``, the
    agent's name. Only this prefix is read: the rest (connection info, registered memory) is
    NIXL's to parse, which is why a secret is needed to keep forged bytes away from it.
    """
    n = len(_NIXL_PREFIX)
    if len(agent_md) < n + 8 or agent_md[:n] != _NIXL_PREFIX:
        return None
    (size,) = struct.unpack_from("<Q", agent_md, n)
    end = n + 8 + size
    if size > 4096 or len(agent_md) < end + 1 or agent_md[end : end + 1] != b"|":
        return None
    try:
        return agent_md[n + 8 : end].decode()
    except UnicodeDecodeError:
        return None


@attrs.frozen(kw_only=True)
class PeerInfo:
    """A decoded peer: who it is, its layout, and where its regions are registered.

    ``bases``, ``nbytes`` and ``devices`` are indexed by region index of the whole spec; the
    regions the rank does not hold (other pipeline stages) have 0 everywhere, and the regions
    of one pool repeat the pool allocation's base and size.
    """

    engine: str
    rank: int
    agent: str
    spec: EngineSpec
    mem_type: str
    bases: tuple[int, ...]
    nbytes: tuple[int, ...]
    devices: tuple[int, ...]
    agent_metadata: bytes = attrs.field(repr=False)
    #: per region, the base of its V buffer when it keeps K and V apart (else 0); empty when
    #: no region does. ``bases`` then holds the K buffer's.
    v_bases: tuple[int, ...] = ()
    #: per buffer of the spec (``spec.buffers``), its NIXL memory type ("" for a buffer the
    #: rank does not hold); empty when every buffer held is in ``mem_type``.
    memory: tuple[str, ...] = ()
    #: strings the application advertises beside the layout, as sorted ``(name, value)``
    #: pairs (kvplan_nixl.vllm: ``("vllm", version)``); signed, opaque to the endpoint
    app: tuple[tuple[str, str], ...] = ()

    def buffer_mem(self, buffer: int) -> str:
        """The NIXL memory type of buffer ``buffer`` (an index of ``spec.buffers``)."""
        return self.memory[buffer] if self.memory else self.mem_type

    @property
    def held(self) -> tuple[int, ...]:
        """Indices of the regions the peer rank holds (its pipeline stage's)."""
        return self.spec.regions_on(self.rank)


def encode(info: PeerInfo, secret: bytes | str | None = None) -> bytes:
    """Serialize ``info``, signed under ``secret`` when given; :func:`decode` inverts it."""
    key = check_secret(secret)
    header = json.dumps(
        {
            "engine": info.engine,
            "rank": info.rank,
            "agent": info.agent,
            "spec": info.spec.to_dict(),
            "mem_type": info.mem_type,
            "regions": [  # what is registered: the held regions (decode checks which)
                [i, b, n, d]
                for i, (b, n, d) in enumerate(zip(info.bases, info.nbytes, info.devices,
                                                  strict=True))
                if n
            ],
            **({"v_bases": list(info.v_bases)} if any(info.v_bases) else {}),
            **({"app": dict(info.app)} if info.app else {}),
            **({"memory": other} if (other := [
                [b, m] for b, m in enumerate(info.memory) if m and m != info.mem_type
            ]) else {}),
        },
        sort_keys=True,
        separators=(",", ":"),
    ).encode()
    body = _FIXED.pack(MAGIC, FORMAT_VERSION, len(header), len(info.agent_metadata))
    body += header + info.agent_metadata
    digest = hashlib.sha256(body).digest() if key is None else mac(key, _MAC_METADATA, body)
    return body + digest


def decode(blob: bytes, secret: bytes | str | None = None) -> PeerInfo:
    """Parse and check a blob from :func:`encode` (another process, another version maybe).

    With ``secret``, only a blob signed under it is read past its digest; without, the digest
    must be the blob's sha256 (integrity only: see the module docstring).
    """
    key = check_secret(secret)
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise MetadataError(f"metadata must be bytes, got {type(blob).__name__}")
    blob = bytes(blob)
    if len(blob) < len(MAGIC) or blob[: len(MAGIC)] != MAGIC:
        raise MetadataError(
            f"not kvplan_nixl endpoint metadata: it starts with {blob[:8]!r}, expected {MAGIC!r} "
            "(pass what Endpoint.metadata() returned, not NIXL's own agent metadata)"
        )
    if len(blob) < _FIXED.size + _DIGEST:
        raise MetadataError(f"kvplan_nixl metadata truncated: {len(blob)} bytes")
    _, version, hlen, alen = _FIXED.unpack_from(blob)
    if version != FORMAT_VERSION:
        which = "an older" if version < FORMAT_VERSION else "a newer"
        raise MetadataError(
            f"kvplan_nixl metadata format version {version}, this endpoint reads version "
            f"{FORMAT_VERSION} (the peer runs {which} kvplan_nixl): upgrade or downgrade one "
            "side so both speak the same version"
        )
    size = _FIXED.size + hlen + alen + _DIGEST
    if hlen > MAX_HEADER_BYTES or alen > MAX_AGENT_BYTES or len(blob) != size:
        raise MetadataError(
            f"kvplan_nixl metadata corrupt: {len(blob)} bytes, but its lengths say "
            f"{_FIXED.size} + {hlen} + {alen} + {_DIGEST}"
        )
    body, digest = blob[:-_DIGEST], blob[-_DIGEST:]
    plain = hashlib.sha256(body).digest()
    if key is not None:
        if not hmac.compare_digest(mac(key, _MAC_METADATA, body), digest):
            if hmac.compare_digest(plain, digest):
                raise MetadataError(
                    f"kvplan_nixl metadata from {_claimed(body, hlen)} is unsigned, but this "
                    "endpoint has a secret: give the peer the deployment's secret too"
                )
            raise MetadataError(
                f"kvplan_nixl metadata from {_claimed(body, hlen)} is not signed with this "
                "endpoint's secret (forged, corrupt, or signed under another secret)"
            )
    elif not hmac.compare_digest(plain, digest):
        raise MetadataError(
            "kvplan_nixl metadata corrupt: checksum mismatch (or signed with a secret: "
            "pass the deployment's secret to this endpoint too)"
        )
    header = body[_FIXED.size : _FIXED.size + hlen]
    agent_md = body[_FIXED.size + hlen :]
    try:
        h = json.loads(header)
        engine, rank, agent, mem = h["engine"], h["rank"], h["agent"], h["mem_type"]
        raw_rows = h["regions"]
        raw_v = h.get("v_bases", [])
        raw_mem = h.get("memory", [])
        raw_app = h.get("app", {})
        spec_dict = h["spec"]
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise MetadataError(f"kvplan_nixl metadata header unreadable: {exc!r}") from None
    if (not isinstance(engine, str) or not engine or isinstance(rank, bool)
            or not isinstance(rank, int)):
        raise MetadataError(f"metadata header: bad engine {engine!r} or rank {rank!r}")
    who = f"metadata of {engine!r} rank {rank}"
    app = _app(raw_app, who)
    try:
        spec = EngineSpec.from_dict(spec_dict)
    except KVPlanError as exc:
        raise MetadataError(f"{who} carries an invalid spec: {exc}") from exc
    except (ValueError, TypeError, KeyError, RecursionError) as exc:
        raise MetadataError(f"{who} carries an unreadable spec: {exc!r}") from None
    if not 0 <= rank < spec.num_ranks:
        raise MetadataError(f"metadata of {engine!r}: rank {rank} not in [0, {spec.num_ranks})")
    if not isinstance(agent, str) or parse_agent_name(agent) != (engine, rank):
        raise MetadataError(
            f"{who}: agent name {agent!r} does not name that engine and rank (expected "
            f"'{agent_name(engine, rank, '<nonce>')}')"
        )
    if mem not in MEM_TYPES:
        raise MetadataError(f"{who}: memory type {mem!r} is not one of {list(MEM_TYPES)}")
    regions = _rows(raw_rows, who)
    held = spec.regions_on(rank)
    indices = [t[0] for t in regions]
    if indices != list(held):
        raise MetadataError(
            f"{who}: registers regions {indices}, but rank {rank} (pipeline stage "
            f"{rank // spec.tp_size}) holds regions {list(held)} of its spec"
        )
    n = len(spec.regions)
    bases, sizes, devs = [0] * n, [0] * n, [0] * n
    alloc = _allocations(spec)
    for i, base, size, dev in regions:
        want = spec.rank_region_nbytes(i)
        if size != want:
            raise MetadataError(
                f"{who}: region {spec.regions[i].name!r} registers {size} bytes, its spec "
                f"implies {want}"
            )
        a = alloc[i]
        if a != i and (base, dev) != (bases[a], devs[a]):
            raise MetadataError(
                f"{who}: regions {spec.regions[a].name!r} and {spec.regions[i].name!r} of pool "
                f"{spec.regions[i].pool!r} are registered at different addresses; a pool is one "
                "allocation"
            )
        if not (0 <= base and base + size <= _ADDRESS_END and 0 <= dev < 1 << 32):
            raise MetadataError(
                f"{who}: region {spec.regions[i].name!r} at base {base} device {dev} with "
                f"{size} bytes does not fit below 2**63 (offsets are int64)"
            )
        bases[i], sizes[i], devs[i] = base, size, dev
    v_bases = _v_bases(raw_v, n, sizes, who)
    separate = [i for i in indices if spec.regions[i].separate_kv]
    if v_bases and len(v_bases) != n:
        raise MetadataError(f"{who}: {len(v_bases)} V buffer bases for {n} regions")
    missing = [spec.regions[i].name for i in separate if not v_bases or v_bases[i] <= 0]
    if missing:
        raise MetadataError(f"{who}: regions {missing} keep K and V in separate buffers, but "
                            "the metadata carries no V buffer base for them")
    memory = _memory(raw_mem, spec, held, str(mem), who)
    _check_disjoint(spec, indices, bases, v_bases, devs,
                    [memory[b] if memory else str(mem) for b in range(len(spec.buffers))], who)
    return PeerInfo(
        engine=engine,
        rank=rank,
        agent=str(agent),
        spec=spec,
        mem_type=str(mem),
        bases=tuple(bases),
        nbytes=tuple(sizes),
        devices=tuple(devs),
        agent_metadata=agent_md,
        v_bases=v_bases,
        memory=memory,
        app=app,
    )


#: An ``app`` section holds at most this many entries of at most this many characters each:
#: a few names, never a second payload
MAX_APP_ENTRIES, MAX_APP_CHARS = 16, 128


def check_app(app: object, who: str = "metadata") -> tuple[tuple[str, str], ...]:
    """``app`` (a mapping or pairs of strings) as sorted pairs; refuses anything else, or more
    than :data:`MAX_APP_ENTRIES` entries of :data:`MAX_APP_CHARS` characters."""
    items = app.items() if isinstance(app, dict) else app
    if isinstance(items, (list, tuple, type({}.items()))) and len(items) > MAX_APP_ENTRIES:
        # counted before anything is sorted: a peer's section may be of any size
        raise MetadataError(f"{who}: app section must be at most {MAX_APP_ENTRIES} non-empty "
                            f"strings of at most {MAX_APP_CHARS} characters, got "
                            f"{len(items)} entries")
    try:
        pairs = sorted((k, v) for k, v in items)
    except (TypeError, ValueError):
        raise MetadataError(f"{who}: app section {app!r} is not name -> value strings") from None
    if len(pairs) > MAX_APP_ENTRIES or not all(
            isinstance(x, str) and 0 < len(x) <= MAX_APP_CHARS for kv in pairs for x in kv):
        raise MetadataError(f"{who}: app section must be at most {MAX_APP_ENTRIES} non-empty "
                            f"strings of at most {MAX_APP_CHARS} characters, got {app!r}"[:400])
    return tuple(pairs)


def _app(raw: object, who: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(raw, dict):
        raise MetadataError(f"{who}: app section is {type(raw).__name__}, not an object")
    return check_app(raw, who)


def _memory(raw: object, spec: EngineSpec, held: tuple[int, ...], mem: str,
            who: str) -> tuple[str, ...]:
    """The header's "memory" rows, ``[buffer, type]`` for each buffer held in another type
    than ``mem``, as one type per buffer of the spec (empty when there are none)."""
    if not isinstance(raw, list) or not all(
        isinstance(t, list) and len(t) == 2 and isinstance(t[0], int)
        and not isinstance(t[0], bool) and isinstance(t[1], str) for t in raw
    ):
        raise MetadataError(f"{who}: memory rows must be [buffer index, memory type] pairs")
    if not raw:
        return ()
    mine = {spec.buffer_of(i, s) for i in held for s in (0, 1)}
    out = [mem if b in mine else "" for b in range(len(spec.buffers))]
    seen: set[int] = set()
    for b, m in raw:
        if b not in mine:
            raise MetadataError(
                f"{who}: memory row names buffer {b}, which that rank does not hold (it holds "
                f"{sorted(mine)} of {len(spec.buffers)} buffers)")
        if m not in MEM_TYPES or m == mem or b in seen:
            what = "twice" if b in seen else f"as {m!r}"
            raise MetadataError(
                f"{who}: buffer {spec.buffers[b]!r} is listed {what}; a memory row names "
                f"one of {[t for t in MEM_TYPES if t != mem]} (other than mem_type {mem!r}), "
                "once per buffer")
        seen.add(b)
        out[b] = m
    return tuple(out)


def _check_disjoint(spec: EngineSpec, held: list[int], bases: list[int],
                    v_bases: tuple[int, ...], devs: list[int], kinds: list[str],
                    who: str) -> None:
    """Refuse buffers advertised at overlapping addresses: two buffers of a rank are two
    allocations, so one sharing another's base would make a transfer to one write the other.
    Addresses compare per (memory kind, device), ``kinds`` giving each buffer's: a DRAM and a
    VRAM buffer live in different address spaces."""
    where: dict[int, tuple[tuple[str, int], int]] = {}  # buffer -> ((kind, device), base)
    for i in held:
        sides = [(0, bases[i])] + ([(1, v_bases[i])] if spec.regions[i].separate_kv else [])
        for side, base in sides:
            b = spec.buffer_of(i, side)
            where.setdefault(b, ((kinds[b], devs[i]), base))
    spans = sorted((dev, base, base + spec.rank_buffer_nbytes(b), b)
                   for b, (dev, base) in where.items())
    last = None  # ((kind, device), end, buffer) of the span reaching furthest so far
    for dev, base, end, b in spans:
        if last is not None and last[0] == dev and base < last[1]:
            raise MetadataError(
                f"{who}: buffers {spec.buffers[last[2]]!r} and {spec.buffers[b]!r} are "
                f"advertised at overlapping addresses ({dev[0]} device {dev[1]}, base {base} "
                f"below {last[1]}); each buffer is its own allocation")
        if last is None or last[0] != dev or end > last[1]:
            last = (dev, end, b)


def _rows(raw: object, who: str) -> list[tuple[int, int, int, int]]:
    """The header's region rows, each four JSON integers (no floats, strings or booleans)."""
    if not isinstance(raw, list) or not all(
        isinstance(t, list) and len(t) == 4
        and all(isinstance(x, int) and not isinstance(x, bool) for x in t)
        for t in raw
    ):
        raise MetadataError(f"{who}: region rows must be [index, base, nbytes, device] integers")
    return [(t[0], t[1], t[2], t[3]) for t in raw]


def _claimed(body: bytes, hlen: int) -> str:
    """Who an unverified blob claims to be, for an error message only (never trusted)."""
    header = body[_FIXED.size : _FIXED.size + min(hlen, 4096)]
    for field in (b'"agent":"', b'"engine":"'):
        at = header.find(field)
        if at >= 0:
            end = header.find(b'"', at + len(field))
            if end > 0:
                name = header[at + len(field) : end].decode(errors="replace")[:80]
                return f"peer {name!r} (as it claims)"
    return "an unnamed peer"


def _allocations(spec: EngineSpec) -> list[int]:
    """Per region, the index of the first region living in the same buffer: what
    ``spec.allocation_of`` answers, in one linear pass (a spec may be big)."""
    first: dict[int, int] = {}
    return [first.setdefault(spec.buffer_of(i), i) for i in range(len(spec.regions))]


def _v_bases(raw: object, n: int, sizes: list[int], who: str) -> tuple[int, ...]:
    """The header's V buffer bases (empty, or one per region of the spec): JSON integers that
    place each V buffer inside a 64-bit address space."""
    if not isinstance(raw, list) or not all(
        isinstance(x, int) and not isinstance(x, bool) for x in raw
    ):
        raise MetadataError(f"{who}: v_bases must be a list of integers")
    if raw and len(raw) == n:
        bad = [i for i, v in enumerate(raw) if not 0 <= v <= _ADDRESS_END - sizes[i]]
        if bad:
            raise MetadataError(f"{who}: V buffer base {raw[bad[0]]} of region {bad[0]} does "
                                "not fit below 2**63 (offsets are int64)")
    return tuple(raw)

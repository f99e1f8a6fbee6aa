"""The endpoint metadata blob: what a peer needs to connect, versioned and checksummed.

Wire format (all integers big-endian)::

    magic  b"KVPLNIXL"            8 bytes, never changes
    format u16                    FORMAT_VERSION; checked right after the magic, so a peer of
                                  another version is refused by name even if the rest changed
    header u32, agent u32         lengths of the two parts below
    header                        UTF-8 JSON: engine, rank, agent name, spec, mem type, and
                                  "regions": [[index, base, nbytes, device], ...], one row per
                                  region the rank holds (its pipeline stage's), indices those
                                  of the whole spec; the regions of one pool repeat the pool's
                                  base and size (one allocation)
    agent                         NIXL's own agent metadata (opaque)
    digest                        sha256 of everything above, 32 bytes

Pure: no NIXL import; :func:`decode` raises :class:`~kvplan_nixl.errors.MetadataError` with a
message saying which of foreign / other version / corrupt / inconsistent it is.
"""

from __future__ import annotations

import hashlib
import json
import struct

import attrs

from kvplan import EngineSpec, KVPlanError
from kvplan_nixl.errors import MetadataError

MAGIC = b"KVPLNIXL"
#: Bump when the header's meaning changes; peers of other versions are refused.
#: 1: one row per region of the spec (TP only). 2: rows carry the region index and list only
#: the regions of the rank's pipeline stage; pooled regions share their allocation's row.
FORMAT_VERSION = 2
_FIXED = struct.Struct(">8sHII")
_DIGEST = 32
#: Refuse headers larger than this before parsing JSON (a spec of thousands of regions fits).
MAX_HEADER_BYTES = 16 << 20


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

    @property
    def held(self) -> tuple[int, ...]:
        """Indices of the regions the peer rank holds (its pipeline stage's)."""
        return self.spec.regions_on(self.rank)


def encode(info: PeerInfo) -> bytes:
    """Serialize ``info``; :func:`decode` inverts it."""
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
        },
        sort_keys=True,
        separators=(",", ":"),
    ).encode()
    body = _FIXED.pack(MAGIC, FORMAT_VERSION, len(header), len(info.agent_metadata))
    body += header + info.agent_metadata
    return body + hashlib.sha256(body).digest()


def decode(blob: bytes) -> PeerInfo:
    """Parse and check a blob from :func:`encode` (another process, another version maybe)."""
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
    if hlen > MAX_HEADER_BYTES or len(blob) != _FIXED.size + hlen + alen + _DIGEST:
        raise MetadataError(
            f"kvplan_nixl metadata corrupt: {len(blob)} bytes, but its lengths say "
            f"{_FIXED.size} + {hlen} + {alen} + {_DIGEST}"
        )
    body, digest = blob[:-_DIGEST], blob[-_DIGEST:]
    if hashlib.sha256(body).digest() != digest:
        raise MetadataError("kvplan_nixl metadata corrupt: checksum mismatch")
    header = body[_FIXED.size : _FIXED.size + hlen]
    agent_md = body[_FIXED.size + hlen :]
    try:
        h = json.loads(header)
        engine, rank, agent, mem = h["engine"], h["rank"], h["agent"], h["mem_type"]
        regions = [tuple(int(x) for x in t) for t in h["regions"]]
        v_bases = tuple(int(x) for x in h.get("v_bases", ()))
        spec = EngineSpec.from_dict(h["spec"])
    except KVPlanError as exc:
        raise MetadataError(f"peer metadata carries an invalid spec: {exc}") from exc
    except (ValueError, KeyError, TypeError) as exc:
        raise MetadataError(f"kvplan_nixl metadata header unreadable: {exc!r}") from exc
    if not isinstance(engine, str) or isinstance(rank, bool) or not isinstance(rank, int):
        raise MetadataError(f"metadata header: bad engine {engine!r} or rank {rank!r}")
    if not 0 <= rank < spec.num_ranks:
        raise MetadataError(f"metadata of {engine!r}: rank {rank} not in [0, {spec.num_ranks})")
    who = f"metadata of {engine!r} rank {rank}"
    if any(len(t) != 4 for t in regions):
        raise MetadataError(f"{who}: region rows must be [index, base, nbytes, device]")
    held = spec.regions_on(rank)
    indices = [t[0] for t in regions]
    if indices != list(held):
        raise MetadataError(
            f"{who}: registers regions {indices}, but rank {rank} (pipeline stage "
            f"{rank // spec.tp_size}) holds regions {list(held)} of its spec"
        )
    n = len(spec.regions)
    bases, sizes, devs = [0] * n, [0] * n, [0] * n
    for i, base, size, dev in regions:
        want = spec.rank_region_nbytes(i)
        if size != want:
            raise MetadataError(
                f"{who}: region {spec.regions[i].name!r} registers {size} bytes, its spec "
                f"implies {want}"
            )
        a = spec.allocation_of(i)
        if a != i and (base, dev) != (bases[a], devs[a]):
            raise MetadataError(
                f"{who}: regions {spec.regions[a].name!r} and {spec.regions[i].name!r} of pool "
                f"{spec.regions[i].pool!r} are registered at different addresses; a pool is one "
                "allocation"
            )
        bases[i], sizes[i], devs[i] = base, size, dev
    separate = [i for i in indices if spec.regions[i].separate_kv]
    if v_bases and len(v_bases) != n:
        raise MetadataError(f"{who}: {len(v_bases)} V buffer bases for {n} regions")
    missing = [spec.regions[i].name for i in separate if not v_bases or v_bases[i] <= 0]
    if missing:
        raise MetadataError(f"{who}: regions {missing} keep K and V in separate buffers, but "
                            "the metadata carries no V buffer base for them")
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
    )

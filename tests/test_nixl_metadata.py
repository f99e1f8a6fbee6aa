"""The metadata blob, pure (no agent): round trip and every refusal, by name."""

from __future__ import annotations

import hashlib
import json
import struct

import attrs
import pytest

from kvplan.examples import gqa_with_mla_draft
from kvplan_nixl import MetadataError
from kvplan_nixl import metadata as md

SPEC = gqa_with_mla_draft(4, layers=2, num_blocks=8)


def _info(**kw) -> md.PeerInfo:
    n = len(SPEC.regions)
    base = dict(
        engine="prefill", rank=3, agent="prefill#3#abc", spec=SPEC, mem_type="DRAM",
        bases=tuple(4096 * (i + 1) for i in range(n)),
        nbytes=tuple(SPEC.rank_region_nbytes(i) for i in range(n)),
        devices=(0,) * n, agent_metadata=b"\x00nixl-opaque\xff" * 10,
    )
    base.update(kw)
    return md.PeerInfo(**base)


def _raw(header: dict, agent: bytes = b"x", version: int = md.FORMAT_VERSION) -> bytes:
    """A well-formed blob around an arbitrary header (to reach the header checks)."""
    h = json.dumps(header).encode()
    body = struct.pack(">8sHII", md.MAGIC, version, len(h), len(agent)) + h + agent
    return body + hashlib.sha256(body).digest()


def test_roundtrip():
    info = _info()
    assert md.decode(md.encode(info)) == info


@pytest.mark.parametrize(
    ("blob", "msg"),
    [
        (b"", "not kvplan_nixl endpoint metadata"),
        (b"\x0a\x0bsome nixl agent metadata", "not kvplan_nixl endpoint metadata"),
        (md.MAGIC + b"\x00", "truncated"),
        (_raw({}, version=7), "format version 7, this endpoint reads version 1"),
        (md.encode(_info())[:-1], "corrupt"),
        (md.encode(_info()) + b"!", "corrupt"),
        (_raw({"engine": "p"}), "header unreadable"),
        (_raw({"engine": "p", "rank": 0, "agent": "a", "mem_type": "DRAM", "regions": [],
               "spec": {"tp_size": 0, "regions": []}}), "invalid spec"),
        ("text", "must be bytes"),
    ],
)
def test_refusals(blob, msg):
    with pytest.raises(MetadataError, match=msg):
        md.decode(blob)


def test_checksum_catches_any_flipped_byte():
    blob = md.encode(_info())
    for i in range(10, len(blob), max(1, len(blob) // 64)):
        bad = bytearray(blob)
        bad[i] ^= 0x40
        with pytest.raises(MetadataError):
            md.decode(bytes(bad))


def test_inconsistent_header_refused():
    sizes = list(_info().nbytes)
    sizes[1] += 2
    with pytest.raises(MetadataError, match=r"registers .* bytes, its spec implies"):
        md.decode(md.encode(_info(nbytes=tuple(sizes))))
    with pytest.raises(MetadataError, match=r"rank 4 not in \[0, 4\)"):
        md.decode(md.encode(_info(rank=4)))
    short = _info()
    with pytest.raises(MetadataError, match="registered regions for"):
        md.decode(md.encode(attrs.evolve(short, bases=short.bases[:1], nbytes=short.nbytes[:1],
                                         devices=(0,))))

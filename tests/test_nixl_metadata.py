"""The metadata blob, pure (no agent): round trip and every refusal, by name."""

from __future__ import annotations

import hashlib
import json
import struct

import attrs
import pytest

from kvplan.examples import gqa_with_mla_draft, kimi_linear_like, nemotron_h_like
from kvplan_nixl import MetadataError
from kvplan_nixl import metadata as md

SPEC = gqa_with_mla_draft(4, layers=2, num_blocks=8)


def _info(**kw) -> md.PeerInfo:
    n = len(SPEC.regions)
    base = dict(
        engine="prefill", rank=3, agent="prefill#3#abc", spec=SPEC, mem_type="DRAM",
        bases=tuple((i + 1) << 32 for i in range(n)),  # buffers never overlap
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
        (_raw({}, version=7), "format version 7, this endpoint reads version 3 .*a newer"),
        (_raw({}, version=2), "format version 2, this endpoint reads version 3 .*an older"),
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
    with pytest.raises(MetadataError, match=r"registers regions \[0\], but rank 3 \(pipeline "
                       r"stage 0\) holds regions \[0, 1, 2\]"):
        md.decode(md.encode(attrs.evolve(short, bases=short.bases[:1], nbytes=short.nbytes[:1],
                                         devices=(0,))))


# pipeline stages and pools: rows carry region indices of the whole spec
PP = nemotron_h_like(2, pp_size=2, mamba_layers=3, num_blocks=4, num_slots=2)
KIMI = kimi_linear_like(2, layers=2, num_blocks=4)


def _held_info(spec, rank, **kw) -> md.PeerInfo:
    n = len(spec.regions)
    held = spec.regions_on(rank)
    bases = [0] * n
    for i in held:
        bases[i] = (spec.allocation_of(i) + 1) << 32  # one per allocation, never overlapping
    base = dict(
        engine="prefill", rank=rank, agent=f"prefill#{rank}#abc", spec=spec, mem_type="DRAM",
        bases=tuple(bases),
        nbytes=tuple(spec.rank_region_nbytes(i) if i in held else 0 for i in range(n)),
        devices=(0,) * n, agent_metadata=b"nixl",
    )
    base.update(kw)
    return md.PeerInfo(**base)


@pytest.mark.parametrize(("spec", "rank", "held"), [(PP, 1, (0, 1)), (PP, 3, (2, 3)),
                                                    (KIMI, 1, (0, 1, 2, 3))])
def test_roundtrip_stages_and_pools(spec, rank, held):
    info = _held_info(spec, rank)
    assert info.held == held
    blob = md.encode(info)
    assert md.decode(blob) == info
    rows = json.loads(blob[md._FIXED.size:][: struct.unpack_from(">I", blob, 10)[0]])["regions"]
    assert [r[0] for r in rows] == list(held)


def test_stage_and_pool_refusals():
    other_stage = list(_held_info(PP, 3).nbytes)
    other_stage[0] = PP.rank_region_nbytes(0)  # rank 3 (stage 1) claims region 0 (stage 0)
    bases = list(_held_info(PP, 3).bases)
    bases[0] = 4096
    with pytest.raises(MetadataError, match=r"registers regions \[0, 2, 3\], but rank 3 "
                       r"\(pipeline stage 1\) holds regions \[2, 3\]"):
        md.decode(md.encode(_held_info(PP, 3, nbytes=tuple(other_stage), bases=tuple(bases))))
    split = list(_held_info(KIMI, 0).bases)
    split[1] += 64  # the KDA view of pool.0 somewhere else than its MLA view
    with pytest.raises(MetadataError, match=r"regions 'layers\.0\.mla' and 'layers\.1\.kda' "
                       r"of pool 'pool\.0' are registered at different addresses"):
        md.decode(md.encode(_held_info(KIMI, 0, bases=tuple(split))))
    with pytest.raises(MetadataError, match=r"rank 4 not in \[0, 4\)"):
        md.decode(md.encode(attrs.evolve(_held_info(PP, 3), rank=4)))

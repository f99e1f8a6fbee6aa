"""Judge byte copies between two engines with the independent oracle (tests/oracle.py).

Used by the SGLang adapter's tests for kvplan's plans and for the copies SGLang's own
connections record (tests/sglang_parity.py): both become rows ``(src_rank, src_buffer,
src_offset, dst_rank, dst_buffer, dst_offset, length)``, buffer names of each engine's
``EngineSpec.buffers``, applied in order to the oracle's source and destination buffers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from kvplan import EngineSpec, pull_map
from tests import oracle

Row = tuple[int, str, int, int, str, int, int]


def _arrays(spec: EngineSpec, bufs: Mapping, rank: int) -> dict[str, np.ndarray]:
    """One rank's buffers by name, from the oracle's ``(rank, name)`` / ``(rank, region)``
    keys."""
    out = {}
    for b, name in enumerate(spec.buffers):
        if (rank, name) in bufs:
            out[name] = bufs[(rank, name)]
            continue
        for i in spec.buffer_regions(b):
            if (rank, i) in bufs:
                out[name] = bufs[(rank, i)]
                break
    return out


def judge(src: EngineSpec, dst: EngineSpec, src_blocks: Sequence[Sequence[int]],
          dst_blocks: Sequence[Sequence[int]], rows: Iterable[Row]) -> dict:
    """Apply ``rows`` and compare every decode rank's buffers with the oracle's truth.

    Returns ``{"verdict": "exact" | "wrong", "detail": str, "writes": the largest number of
    times one destination byte was written, "bytes": bytes copied}``. A copy outside a buffer
    is wrong (it would land in another allocation).
    """
    src_d, dst_d = src.to_dict(), dst.to_dict()
    sbuf = oracle.source_buffers(src_d, seed=5)
    before = oracle.destination_buffers(dst_d, seed=6)
    got = {r: {n: a.copy() for n, a in _arrays(dst, before, r).items()}
           for r in range(dst.num_ranks)}
    count = {r: {n: np.zeros(a.size, np.int64) for n, a in got[r].items()} for r in got}
    srcs = {r: _arrays(src, sbuf, r) for r in range(src.num_ranks)}
    problems, nbytes = [], 0
    for s_rank, s_name, s_off, d_rank, d_name, d_off, length in rows:
        s, d = srcs[s_rank][s_name], got[d_rank][d_name]
        if s_off < 0 or d_off < 0 or s_off + length > s.size or d_off + length > d.size:
            problems.append(f"p{s_rank} {s_name} [{s_off}:{s_off + length}) -> d{d_rank} "
                            f"{d_name} [{d_off}:{d_off + length}) falls outside a buffer")
            continue
        d[d_off:d_off + length] = s[s_off:s_off + length]
        count[d_rank][d_name][d_off:d_off + length] += 1
        nbytes += length
    for r in range(dst.num_ranks):
        expected, _ = oracle.expected_buffers(src_d, dst_d, src_blocks, dst_blocks, r, sbuf,
                                              before)
        for name, want in expected.items():
            bad = np.flatnonzero(got[r][name] != want)
            if bad.size:
                problems.append(f"d{r} {name}: {bad.size} of {want.size} bytes wrong, first "
                                f"at {int(bad[0])}")
    writes = max((int(c.max()) for per in count.values() for c in per.values() if c.size),
                 default=0)
    return {"verdict": "wrong" if problems else "exact", "detail": "; ".join(problems[:3]),
            "writes": writes, "bytes": nbytes}


def kvplan_rows(src: EngineSpec, dst: EngineSpec, src_blocks: Sequence[Sequence[int]],
                dst_blocks: Sequence[Sequence[int]]) -> list[Row]:
    """kvplan's pull plans for every decode rank, as rows."""
    rows: list[Row] = []
    for r in range(dst.num_ranks):
        c = pull_map(src, dst, r).plan(src_blocks, dst_blocks).copies()
        rows += [(int(x["src_rank"]), src.buffers[x["src_buffer"]], int(x["src_offset"]),
                  int(x["dst_rank"]), dst.buffers[x["dst_buffer"]], int(x["dst_offset"]),
                  int(x["length"])) for x in c]
    return rows

"""Soak: 2,000 requests of random sizes through one pair of engines, pull and push alternating,
every request verified, NIXL handle counts and process memory flat at the end."""

from __future__ import annotations

import numpy as np

from kvplan import simulate
from tests.nixl_util import attn, mla, notifications, pair, spec

REQUESTS = 2000
# small blocks: the soak is about the number of requests, and the reference costs per byte
SRC = spec(2, attn("l0", heads=2, dim=32, nb=256), attn("l1", heads=2, dim=32, nb=256),
           mla(dim=64, nb=256))
DST = spec(1, attn("l0", heads=2, dim=32, nb=128, bs=32),
           attn("l1", heads=2, dim=32, nb=128, bs=32), mla(dim=64, nb=128, bs=32))
#: Growth of resident memory tolerated between request 200 and the end (allocator noise).
RSS_SLACK = 16 << 20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _byte_index(offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    starts = np.repeat(offsets - (np.cumsum(lengths) - lengths), lengths)
    return starts + np.arange(int(lengths.sum()), dtype=np.int64)


def test_soak():
    rng = np.random.default_rng(2024)
    with pair(SRC, DST) as pr:
        pr.connect("pull")
        pr.connect("push")
        ref = {k: v.copy() for k, v in pr.dst_bufs.items()}
        lists = {ep.agent_name: ep.handles() for ep in pr.endpoints}
        seen_notes = 0
        rss_warm = 0
        moved = 0
        for i in range(REQUESTS):
            if i == 200:
                rss_warm = _rss()
            n_src = int(rng.integers(1, 33))
            n_dst = int(rng.integers(max(1, n_src // 2 - 1), n_src // 2 + 2))
            sb = [rng.choice(256, n_src, replace=False)]
            db = [rng.choice(128, n_dst, replace=False)]
            mode = "pull" if i % 2 == 0 else "push"
            posted = pr.run(mode, sb, db, notify=str(i).encode(), timeout=10)
            for t in posted:
                assert t.ok
                simulate(t.plan, pr.src_bufs, ref)
                rows = t.plan.copies()
                moved += t.nbytes
                for j in range(len(DST.regions)):
                    sel = rows[rows["dst_region"] == j]
                    idx = _byte_index(sel["dst_offset"], sel["length"])
                    assert np.array_equal(pr.dst_bufs[(0, j)][idx], ref[(0, j)][idx]), (i, j)
            for ep in pr.endpoints:
                assert ep.handles()["xfer"] == 0 and ep.handles()["transfers"] == 0
            if i % 100 == 99:
                seen_notes += sum(len(ep.notifications()) for ep in pr.endpoints)
        seen_notes += len(notifications(pr.endpoints, 2 * REQUESTS - seen_notes))
        # untouched bytes too: the whole destination equals the reference
        for k, want in ref.items():
            assert np.array_equal(pr.dst_bufs[k], want)
        assert {ep.agent_name: ep.handles() for ep in pr.endpoints} == lists
        # each pull notifies both prefill ranks; each push notifies the decode rank twice
        assert seen_notes == 2 * REQUESTS
        assert moved > 0
        growth = _rss() - rss_warm
        assert growth < RSS_SLACK, f"resident memory grew {growth / 2**20:.1f} MiB"

"""Which ranks hold which heads, and which source serves each needed head (domain.md s. 2-3)."""

import pytest

from kvplan import HeadSource, head_sources, held_heads, holders


@pytest.mark.parametrize(
    ("k", "tp", "expected"),
    [
        (8, 4, [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]),
        (8, 8, [range(h, h + 1) for h in range(8)]),
        (2, 8, [range(0, 1)] * 4 + [range(1, 2)] * 4),  # replicated heads
        (1, 4, [range(0, 1)] * 4),  # a replicated region is one head every rank holds
        (4, 1, [range(0, 4)]),
    ],
)
def test_held_heads(k, tp, expected):
    assert [held_heads(k, tp, r) for r in range(tp)] == expected
    for r in range(tp):
        for h in held_heads(k, tp, r):
            assert r in holders(k, tp, h)


def test_tp_grows_reads_a_head_slice_of_one_source():
    # 8 heads, P TP2 -> D TP4: D rank r reads P rank r // 2, its own two heads.
    for r in range(4):
        assert head_sources(8, 2, 4, r) == (HeadSource(r // 2, 2 * r, 2 * r + 2),)


def test_tp_shrinks_reads_several_sources():
    # 8 heads, P TP8 -> D TP2: D rank t reads P ranks 4t .. 4t+3, one head each.
    assert head_sources(8, 8, 2, 1) == tuple(HeadSource(4 + i, 4 + i, 5 + i) for i in range(4))


def test_replicated_region_spreads_like_t_times_r_over_t():
    for big, small in [(8, 2), (2, 8), (4, 4), (16, 1), (1, 16)]:
        for t in range(small):
            assert head_sources(1, big, small, t) == (HeadSource(t * big // small, 0, 1),)


def test_replicated_heads_on_the_source_are_read_once_and_spread():
    # 2 heads on P TP8 (4 replicas each) -> D TP2: each D rank needs one head, reads one replica.
    assert head_sources(2, 8, 2, 0) == (HeadSource(0, 0, 1),)
    assert head_sources(2, 8, 2, 1) == (HeadSource(4, 1, 2),)
    # 2 heads on P TP4 -> D TP8: the four D ranks sharing head 0 split over its two replicas.
    assert [head_sources(2, 4, 8, t)[0].src_rank for t in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_heads_fewer_than_ranks_on_both_sides():
    # 4 heads, P TP8 (2 replicas) -> D TP16 (4 replicas): each source replica serves two ranks.
    loads = [head_sources(4, 8, 16, t)[0].src_rank for t in range(16)]
    assert sorted(loads) == sorted(list(range(8)) * 2)

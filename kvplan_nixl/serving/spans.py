"""Which positions and blocks a transfer of ``KvplanConnector`` covers, pull or push: pure
arithmetic on kvplan block lists (:class:`kvplan.adapters.vllm.TransferGroups`)."""

from __future__ import annotations

import numpy as np

import kvplan
from kvplan.adapters.vllm import TransferGroups


def span(groups: TransferGroups, whole: bool, start: int, end: int, src: list[np.ndarray],
         dst: list[np.ndarray]) -> tuple[int, int]:
    """The positions to copy: ``[held, end)``, rounded out to whole blocks of the token groups
    where the backend's pages move only whole (what the prefill left past the prompt in the
    last block is overwritten as decode generates)."""
    token = [g for g, k in enumerate(groups.kinds) if k != "state"]
    if not whole or not token:
        return start, end
    bs = groups.block_sizes[token[0]]
    cover = min(min(len(src[g]), len(dst[g])) * groups.block_sizes[g] for g in token)
    return start // bs * bs, max(start // bs * bs, min(-(-end // bs) * bs, cover))


def lacking(groups: TransferGroups, dst: list[np.ndarray], start: int,
            end: int) -> list[np.ndarray]:
    """Per group, the destination blocks a transfer writes: those holding positions
    ``[start, end)`` (the slot of a state group), absent ones left out."""
    out = []
    for g, ids in enumerate(dst):
        if groups.kinds[g] == "state":
            out.append(ids)
            continue
        bs = groups.block_sizes[g]
        part = ids[start // bs: -(-end // bs)]
        out.append(part[part != kvplan.ABSENT])
    return out

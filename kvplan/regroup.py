"""Regions grouped differently on the two sides: each side's block ids, per its own groups.

A region's block ids come from the list of *its* KV-cache group on each side: a lane reads the
source list of the source region's group and writes the destination list of the destination
region's group (``Lane.src_group`` / ``Lane.group``). So two engines may group the same regions
apart (vLLM groups layers by their cache spec and block size; another engine, or another
hybrid-allocator setting, groups them otherwise) and every region still finds its blocks: the
request names both sides' groups, and nothing in a plan needs the two groupings to agree.

The one request-level consistency rule: a state region moves slot ``j`` of its source list to
slot ``j`` of its destination list, so those two lists must be equally long.

Layer 1 (values): imports errors only; the request stage (plan.py) calls it.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvplan.errors import RequestError


def check_state_slots(tmap, src_lists: Sequence, dst_lists: Sequence) -> None:
    """Refuse a request whose state regions' source and destination lists differ in length,
    naming the regions and both sides' groups (raises :class:`~kvplan.RequestError`)."""
    src, dst = tmap.src, tmap.dst
    pairs: dict[tuple[int, int], list[str]] = {}  # (source group, destination group) -> names
    for r in dst.regions:
        if r.is_state:
            g_src = src.regions[src.region_index(r.name)].group
            pairs.setdefault((g_src, r.group), []).append(r.name)
    for (gs, gd), names in sorted(pairs.items()):
        ns, nd = len(src_lists[gs]), len(dst_lists[gd])
        if ns != nd:
            same = f"group {gd}" if gs == gd else f"source group {gs} / destination group {gd}"
            raise RequestError(
                f"{same} holds state slots: {ns} source slot(s) but {nd} destination slot(s) "
                f"for regions {names}; the j-th source slot goes to the j-th destination "
                "slot, so the lists must be equally long"
            )

"""Region names in the compact notation people read: ``layers.[0-60].mla x61``.

An engine has one region per layer (two for an MLA layer with an indexer), so a list of names
is read as runs of numbered names: :func:`name_set` writes one family of names
(``layers.[0-3,5-9].attn x9``), :func:`compact_names` any list, one family at a time in order
of first appearance. Used by refusals (compat.py), views and the CLI.

Layer 0: imports nothing from kvplan.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_NUMBERED = re.compile(r"^(.*?)(\d+)(\D.*|)$")


def _ranges(values: Sequence[int], limit: int = 4) -> str:
    """Sorted integers as spans ``0-3,5-9``; past ``limit`` spans, the first and last."""
    spans: list[list[int]] = []
    for v in sorted(values):
        if spans and v == spans[-1][1] + 1:
            spans[-1][1] = v
        else:
            spans.append([v, v])
    text = [f"{a}" if a == b else f"{a}-{b}" for a, b in spans]
    if len(text) > limit:
        text = [*text[: limit - 1], "…", text[-1]]
    return ",".join(text)


def name_set(names: Sequence[str], limit: int = 4) -> str:
    """A compact label for region names: ``layers.[0-3,5-9].attn x9``, or the one name."""
    names = list(dict.fromkeys(names))
    if len(names) == 1:
        return names[0]
    parts = [_NUMBERED.match(n) for n in names]
    if all(parts) and len({(m.group(1), m.group(3)) for m in parts}) == 1:  # type: ignore[union-attr]
        head, tail = parts[0].group(1), parts[0].group(3)  # type: ignore[union-attr]
        nums = [int(m.group(2)) for m in parts]  # type: ignore[union-attr]
        return f"{head}[{_ranges(nums, limit)}]{tail} x{len(names)}"
    return f"{names[0]} … {names[-1]} x{len(names)}"



def compact_names(names: Sequence[str], limit: int = 8) -> str:
    """Any list of region names, as families: ``layers.[0-60].mla x61, layers.[0-60].indexer
    x61, lm_head`` (families in order of first appearance; at most ``limit`` spans each)."""
    families: dict[tuple[str, str] | str, list[str]] = {}
    for n in dict.fromkeys(names):
        m = _NUMBERED.match(n)
        families.setdefault((m.group(1), m.group(3)) if m else n, []).append(n)
    return ", ".join(name_set(v, limit) for v in families.values())

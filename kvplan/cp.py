"""Context parallelism: which flat rank is which PCP / DCP rank, and what each holds.

vLLM orders an engine's ranks ExternalDP x DP x PP x PCP x TP (``nixl/connector.py``); one
engine spec is one DP replica, so a flat rank is ``(pp_rank * pcp_size + pcp_rank) * tp_size +
tp_rank``. Two kinds of context parallelism place tokens:

- **DCP** (decode context parallelism, ``dcp_size``): within a TP group, ``dcp_size``
  consecutive ranks holding the same heads each hold every ``dcp_size``-th run of
  ``dcp_interleave`` positions of a block id (:class:`kvplan.placement.TokenSharding`).
- **PCP** (prefill context parallelism, ``pcp_size``): vLLM 0.33 splits the queries only; every
  PCP rank all-gathers the KV and holds a full *replica* of its stage's cache
  (``v1/attention/ops/pcp.py``, ``v1/worker/block_table.py``). A pull reads each piece from one
  replica (kvplan spreads the readers over the replicas; vLLM reads replica 0); a push sends
  from replica 0 only (vLLM: only PCP rank 0 publishes and sends).
- **Sharded PCP** (vLLM 0.33 with TP 1 and ``pcp_size == dcp_size``): the PCP ranks are the DCP
  group, PCP rank ``q`` holding DCP shard ``q``; each serves its own shard.

Any other mix of PCP with DCP is refused by :func:`check_pcp` (no engine stores it).

Layer 1 (values), below :mod:`kvplan.spec`: imports errors only, and regions for a type hint.
The spec calls :func:`check_pcp` and :func:`is_pcp_sharded` with its plain sizes while it is
built; the functions of a built engine take anything with its sizes (:class:`Parallelism`, which
:class:`~kvplan.EngineSpec` is), so this module never names the spec; the planner and the
outputs call them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from kvplan.errors import SpecError

if TYPE_CHECKING:
    from kvplan.regions import RegionSpec


class Parallelism(Protocol):
    """What this module reads of an engine: how its ranks are sharded. :class:`kvplan.EngineSpec`
    is one; naming the fields here rather than the spec keeps the spec, which calls this module
    while it is built, the only one of the two importing the other."""

    tp_size: int
    pp_size: int
    pcp_size: int
    dcp_size: int
    dcp_interleave: int
    pcp_sharded: bool


def is_pcp_sharded(tp: int, pcp: int, dcp: int) -> bool:
    """True when the PCP ranks hold distinct DCP shards (vLLM 0.33's sharded PCP: TP 1,
    ``pcp == dcp``); otherwise every PCP rank holds a full replica."""
    return pcp > 1 and dcp == pcp and tp == 1


def check_pcp(tp: int, pcp: int, dcp: int) -> None:
    """Refuse PCP settings no engine stores, naming the sizes (raises :class:`SpecError`)."""
    if pcp == 1 or dcp == 1:
        return
    if tp != 1 or pcp != dcp:
        raise SpecError(
            f"pcp_size {pcp} with dcp_size {dcp} over tp_size {tp}: vLLM 0.33 stores PCP with "
            "DCP only as sharded PCP, tp_size 1 and pcp_size == dcp_size (PCP rank q holds DCP "
            "shard q); with tp_size > 1 give dcp_size alone (DCP inside the TP group) or "
            "pcp_size alone (replicas)"
        )


def tp_rank(spec: Parallelism, rank: int) -> int:
    """The TP rank of flat ``rank``."""
    return rank % spec.tp_size


def pcp_rank(spec: Parallelism, rank: int) -> int:
    """The PCP rank of flat ``rank`` (0 without PCP)."""
    return (rank // spec.tp_size) % spec.pcp_size


def dcp_rank(spec: Parallelism, rank: int) -> int:
    """The DCP rank of flat ``rank``: its PCP rank under sharded PCP, else ``tp_rank % dcp``."""
    return pcp_rank(spec, rank) if spec.pcp_sharded else tp_rank(spec, rank) % spec.dcp_size


def stage_base(spec: Parallelism, stage: int, replica: int = 0) -> int:
    """Flat rank of TP rank 0 of PCP rank ``replica`` of pipeline stage ``stage``."""
    return (stage * spec.pcp_size + replica) * spec.tp_size


def token_slice(dcp: int, interleave: int, rank: int) -> str:
    """The positions of each block id DCP rank ``rank`` of ``dcp`` holds, in words:
    ``positions 8:16 of every 32`` (offsets modulo ``dcp * interleave``)."""
    return f"positions {rank * interleave}:{(rank + 1) * interleave} of every {dcp * interleave}"


def cp_label(spec: Parallelism, rank: int, region: RegionSpec) -> str:
    """What flat ``rank`` holds of ``region`` under context parallelism, for outputs:
    ``DCP 1/2 (positions 1:2 of every 2)``, ``PCP shard 1/2 (...)``, ``PCP replica 1/4``; ""
    without it (and for state regions, which PCP replicates and DCP leaves whole)."""
    parts = []
    if spec.dcp_size > 1 and not region.is_state:
        e = dcp_rank(spec, rank)
        what = "PCP shard" if spec.pcp_sharded else "DCP"
        parts.append(f"{what} {e}/{spec.dcp_size} "
                     f"({token_slice(spec.dcp_size, spec.dcp_interleave, e)})")
    if spec.pcp_size > 1 and not spec.pcp_sharded:
        parts.append(f"PCP replica {pcp_rank(spec, rank)}/{spec.pcp_size}")
    if spec.pcp_sharded and region.is_state:
        parts.append(f"PCP replica {pcp_rank(spec, rank)}/{spec.pcp_size}")
    return ", ".join(parts)


def parallel_label(spec: Parallelism) -> str:
    """An engine's parallelism in one word for titles: ``TP2``, ``TP4 PP2``, ``TP8 DCP4``,
    ``TP2 PCP2`` (replicas), ``TP1 PCP2+DCP2`` (sharded PCP)."""
    out = f"TP{spec.tp_size}" + (f" PP{spec.pp_size}" if spec.pp_size > 1 else "")
    if spec.pcp_sharded:
        return f"{out} PCP{spec.pcp_size}+DCP{spec.dcp_size}"
    out += f" PCP{spec.pcp_size}" if spec.pcp_size > 1 else ""
    return out + (f" DCP{spec.dcp_size}" if spec.dcp_size > 1 else "")


def parallel_fields(spec: Parallelism) -> dict[str, int]:
    """``tp_size``, ``pp_size`` and, where set, ``dcp_size``/``dcp_interleave``/``pcp_size``
    (for JSON outputs)."""
    out = {"tp_size": spec.tp_size, "pp_size": spec.pp_size}
    for field in ("dcp_size", "dcp_interleave", "pcp_size"):
        if getattr(spec, field) != 1:
            out[field] = getattr(spec, field)
    return out

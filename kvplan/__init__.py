"""kvplan: plan KV-cache transfers between prefill and decode engines, exactly and purely.

The whole public API::

    src = EngineSpec.from_dict(prefill_json)          # validated, immutable engine specs
    dst = EngineSpec.from_dict(decode_json)
    tmap = pull_map(src, dst, dst_rank)               # once per handshake (or push_map)
    plan = tmap.plan(src_blocks, dst_blocks)          # once per request: numpy only
    plan = tmap.plan(src_blocks, dst_blocks, tokens=(start, end))  # exactly those positions
    plan.part(["layers.3.attn"])                      # one layer's slice (layer-wise posting)
    plan.copies()                                     # read-only structured array of byte runs
    simulate(plan, src_buffers, dst_buffers)          # reference executor over numpy buffers
    check_plan(plan)                                  # its checks, on the plan alone (PlanError)
    staged = stage(plan, chunk_bytes)                 # gather / bulk / scatter legs (staging)

Seeing plans (notebooks, ``kvplan[view]``): ``from_hf_config(config_json, tp_size=8)``,
``presets.spec("llama-3.1-70b", tp_size=8)``, ``plan.to_pandas()``, ``plan.plot()``,
``plot_rank_map(plans)``; specs, maps and plans render as HTML tables in Jupyter.

Builders of specs are functions of the adapters above the value, never methods of it:
``from_hf_config`` (a Hugging Face ``config.json``; :func:`kvplan.hf.from_hf_config`, re-exported
here; ``EngineSpec.from_hf_config`` before) and :func:`kvplan.adapters.vllm.spec_from_vllm`
(vLLM's own KV cache; ``EngineSpec.from_vllm`` before).

Layer 6 (the public names): imports the modules below it for their public names; nothing
here is needed for a method to work (docs/design.md). Nothing in the core imports this package
init's names back, except the CLI above it.
"""

from kvplan import hf, presets  # noqa: F401  (kvplan.hf: the config adapter, as before)
from kvplan.errors import (
    IncompatibleLayoutError,
    KVPlanError,
    PlanError,
    RequestError,
    SpecError,
)
from kvplan.hf import from_hf_config
from kvplan.lanes import Lane, Mode
from kvplan.layout import RankLayout, rank_layout
from kvplan.placement import (
    HeadSource,
    Placement,
    TokenSharding,
    head_sources,
    held_heads,
    holders,
)
from kvplan.plan import COPY_DTYPE, TransferPlan
from kvplan.planner import TransferMap, pull_map, push_map
from kvplan.request import ABSENT
from kvplan.simulate import check_plan, simulate
from kvplan.spec import DTYPE_SIZES, KV, EngineSpec, Kind, Layout, RegionSpec
from kvplan.staging import STAGING, Costs, Leg, StagedPlan, prefer_staged, stage
from kvplan.views import plot_rank_map, rank_map

__all__ = [
    "ABSENT",
    "COPY_DTYPE",
    "DTYPE_SIZES",
    "KV",
    "STAGING",
    "Costs",
    "EngineSpec",
    "HeadSource",
    "IncompatibleLayoutError",
    "KVPlanError",
    "Kind",
    "Lane",
    "Layout",
    "Leg",
    "Mode",
    "Placement",
    "PlanError",
    "RankLayout",
    "RegionSpec",
    "RequestError",
    "SpecError",
    "StagedPlan",
    "TokenSharding",
    "TransferMap",
    "TransferPlan",
    "check_plan",
    "from_hf_config",
    "head_sources",
    "held_heads",
    "holders",
    "plot_rank_map",
    "prefer_staged",
    "presets",
    "pull_map",
    "push_map",
    "rank_layout",
    "rank_map",
    "simulate",
    "stage",
]
__version__ = "0.1.0"

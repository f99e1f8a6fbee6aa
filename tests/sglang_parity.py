"""Run SGLang's own KV transfer code over a grid of cases and print the byte copies it makes.

Runs in the SGLang venv (tests/sglang_env.py), not the project's: ``python
tests/sglang_parity.py < cases.json > results.json``. Each case (a JSON object, see
tests/test_sglang_parity.py) is one prefill engine and one decode engine of the same model;
for each of SGLang 0.5.23's two connections (Mooncake, NIXL) this script

- builds every decode rank's manager without its constructor and asks SGLang's own
  ``CommonKVManager._resolve_rank_mapping`` which prefill ranks serve it (``common/conn.py``;
  for MLA only the target rank sends, the others are dummies, as ``_setup_bootstrap_infos``
  marks them);
- builds each of those prefill ranks' managers the same way, with ``kv_args`` as SGLang's
  ``get_contiguous_buf_infos`` fills them (per layer a K and a V entry, ``kv_item_len`` the
  bytes of one page; MLA one entry per layer) at made-up addresses, around a recording
  transfer engine (Mooncake's ``batch_transfer_sync``) or agent (NIXL's ``prep_xfer_dlist`` /
  ``make_prepped_xfer`` / ``transfer``, which refuses a descriptor outside registered memory
  and pairs of different lengths, as NIXL does);
- calls the method SGLang's transfer worker calls for that pair: ``send_kvcache`` at equal
  attention TP or for MLA, ``send_kvcache_slice`` otherwise (Mooncake: ``mooncake/conn.py``;
  NIXL: ``_prepare_payload_xfer`` then ``send_kvcache`` / ``send_kvcache_slice``,
  ``nixl/conn.py``); for Mamba2 and GDN state (``kind`` ``"mamba2"`` / ``"gdn"``: a
  ``MambaPool`` whose shape is built as ``configs/nemotron_h.py`` / ``configs/qwen3_next.py``
  build it) ``maybe_send_extra``, which calls
  ``_send_mamba_state`` at equal TP and ``_send_mamba_state_slice`` otherwise, with
  ``kv_args``' state fields as SGLang fills them from the pool; for SGLang's hybrid pool
  objects (``kind`` ``"hybrid"``: a ``HybridLinearKVPool`` around a GDN ``MambaPool``;
  ``"swapool"``: a ``SWAKVPool``) the KV as above (the full-attention sub-pool's entries,
  ``kv_layer_ids`` as ``build_kv_layer_ids`` gives them), then ``maybe_send_extra`` with the
  request's state slot or its SWA window pages (the SWA pool's own index space).

The pools are SGLang's own (``MHATokenToKVPool``, ``MLATokenToKVPool``, built on CPU, one per
engine: its ranks' pools are alike); each result carries ``pools``, what kvplan's adapter
reads of them (``face``). Printed per case and connection: ``status`` ``"ran"`` with
``rows`` (``[src_rank, src_buffer, src_offset, dst_rank, dst_buffer, dst_offset, length]``,
buffer names as kvplan's SGLang adapter names them), ``"refuses"`` (SGLang returned a
failure code, ``error`` its log line) or ``"raises"`` (``error`` and ``where``: the innermost
SGLang file:line). Judging the rows is the caller's business.
"""

from __future__ import annotations

import ast
import bisect
import concurrent.futures
import json
import logging
import os
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sglang_stubs

sglang_stubs.install()

from sglang.srt.configs import mamba_utils  # noqa: E402
from sglang.srt.disaggregation import utils  # noqa: E402
from sglang.srt.disaggregation.base.conn import StateType  # noqa: E402
from sglang.srt.disaggregation.mooncake import conn as mooncake_conn  # noqa: E402
from sglang.srt.disaggregation.nixl import conn as nixl_conn  # noqa: E402
from sglang.srt.mem_cache import memory_pool, swa_memory_pool  # noqa: E402

BACKENDS = ("mooncake", "nixl")
# What a launched server publishes and this script does not launch: the memory namespace
# (no unified memory) and vLLM-style ``warning_once`` on loggers.
mooncake_conn.get_memory = lambda: SimpleNamespace(enable_unified_memory=False)
if not hasattr(logging.Logger, "warning_once"):
    logging.Logger.warning_once = logging.Logger.warning
SITE = Path(mooncake_conn.__file__).resolve().parents[3]  # .../site-packages


def build_pool(case: dict, tp: int, stage: int = 0, pp: int = 1):
    """SGLang's own pool of one rank of an engine at attention TP ``tp``, on CPU (of PP stage
    ``stage`` of ``pp``: its share of the layers)."""
    size = (case["pages"] - 1) * case["page"]
    per = case["layers"] // pp
    common = {"size": size, "page_size": case["page"], "dtype": torch.bfloat16,
              "layer_num": per, "device": "cpu", "enable_memory_saver": False}
    if pp > 1:
        common.update(start_layer=stage * per, end_layer=(stage + 1) * per)
    if case["kind"] == "kda":  # as configs/kimi_linear.py builds it
        m = case["mamba"]
        shape = mamba_utils.KimiLinearStateShape.create(
            tp_world_size=tp, num_heads=m["heads"], head_dim=m["head_dim"],
            conv_kernel_size=m["conv_kernel"])
        return _mamba_pool(case, mamba_utils.KimiLinearCacheParams, shape)
    if case["kind"] in ("mamba2", "gdn"):
        m = case["mamba"]
        # as configs/nemotron_h.py builds it (Mamba2: no conv_shard_groups), or
        # configs/qwen3_next.py (GDN: q | k | v sharded on their own)
        key_dim, value_dim = m["n_groups"] * m["state_size"], m["heads"] * m["head_dim"]
        shape = mamba_utils.Mamba2StateShape.create(
            tp_world_size=tp, intermediate_size=m["heads"] * m["head_dim"],
            n_groups=m["n_groups"], num_heads=m["heads"], head_dim=m["head_dim"],
            state_size=m["state_size"], conv_kernel=m["conv_kernel"],
            conv_shard_groups=([key_dim, key_dim, value_dim] if case["kind"] == "gdn"
                               else None))
        return _mamba_pool(case, mamba_utils.Mamba2CacheParams, shape)
    if case["kind"] == "hybrid":  # a HybridLinearKVPool: GDN state beside full attention
        m = case["mamba"]
        key_dim, value_dim = m["n_groups"] * m["state_size"], m["heads"] * m["head_dim"]
        shape = mamba_utils.Mamba2StateShape.create(
            tp_world_size=tp, intermediate_size=value_dim, n_groups=m["n_groups"],
            num_heads=m["heads"], head_dim=m["head_dim"], state_size=m["state_size"],
            conv_kernel=m["conv_kernel"], conv_shard_groups=[key_dim, key_dim, value_dim])
        # under PP a stage holds its share of each kind of layer, at their global ids
        state_ids, full_ids = (ids[stage * len(ids) // pp:(stage + 1) * len(ids) // pp]
                               for ids in (case["state_layers"], case["full_layers"]))
        state = _mamba_pool(case, mamba_utils.Mamba2CacheParams, shape, layers=state_ids)
        return memory_pool.HybridLinearKVPool(
            size=size, dtype=torch.bfloat16, page_size=case["page"],
            head_num=max(1, case["heads"] // tp), head_dim=case["head_dim"],
            full_attention_layer_ids=full_ids, device="cpu", mamba_pool=state,
            start_layer=stage * case["layers"] // pp)
    if case["kind"] == "swapool":  # a SWAKVPool: its own SWA pool of fewer pages
        return swa_memory_pool.SWAKVPool(
            size=size, size_swa=(case["swa_pages_total"] - 1) * case["page"],
            page_size=case["page"], dtype=torch.bfloat16,
            head_num=max(1, case["heads"] // tp), head_dim=case["head_dim"],
            swa_head_num=max(1, case["swa_heads"] // tp),
            swa_attention_layer_ids=case["swa_layers"],
            full_attention_layer_ids=case["full_layers"], device="cpu",
            enable_memory_saver=False)
    if case["kind"] == "mla":
        return memory_pool.MLATokenToKVPool(kv_lora_rank=case["head_dim"] - 4,
                                            qk_rope_head_dim=4, **common)
    return memory_pool.MHATokenToKVPool(head_num=max(1, case["heads"] // tp),
                                        head_dim=case["head_dim"],
                                        v_head_dim=case.get("v_head_dim"), **common)


def _mamba_pool(case: dict, params_cls: type, shape, layers: list[int] | None = None):
    """SGLang's MambaPool of ``case``'s state layers (``layers``, else all), its params of
    ``params_cls`` (Mamba2's or Kimi-Linear's) around ``shape``: conv state bfloat16,
    temporal float32."""
    layers = list(range(case["layers"])) if layers is None else list(layers)
    params = params_cls(shape=shape, layers=layers, dtype=mamba_utils.Mamba2StateDType(
        conv=torch.bfloat16, temporal=torch.float32))
    return memory_pool.MambaPool(size=case["pages"] - 1, spec_state_size=0,
                                 cache_params=params, mamba_layer_ids=layers, device="cpu")


def entries(pool) -> list[tuple[str, list[str], list[int], list[int]]]:
    """What a pool hands its connections, as ``(what, names, lens, item_lens)``: ``"kv"``
    (``get_contiguous_buf_infos``) then, for a hybrid pool, ``"state"``
    (``get_state_buf_infos``: the Mamba pool's, or the SWA sub-pool's), named as kvplan's
    adapter names them."""
    if isinstance(pool, (memory_pool.HybridLinearKVPool, swa_memory_pool.SWAKVPool)):
        sub = (pool.mamba_pool if isinstance(pool, memory_pool.HybridLinearKVPool)
               else pool.swa_kv_pool)
        _, lens, items = pool.get_contiguous_buf_infos()
        _, slens, sitems = pool.get_state_buf_infos()
        assert pool.get_state_buf_infos() == sub.get_contiguous_buf_infos()
        return [("kv", buffer_names(pool.full_kv_pool), lens, items),
                ("state", buffer_names(sub), slens, sitems)]
    _, lens, items = pool.get_contiguous_buf_infos()
    return [("kv", buffer_names(pool), lens, items)]


def buffer_names(pool) -> list[str]:
    """The names kvplan's adapter gives the entries of ``get_contiguous_buf_infos``, after
    checking that they are the pool's K buffers then its V buffers (MLA: its latents), at
    its global layer ids (``model_layer_ids``)."""
    ptrs = pool.get_contiguous_buf_infos()[0]
    if isinstance(pool, memory_pool.MambaPool):
        ids = pool.mamba_layer_ids
        tensors = ([pool.mamba_cache.conv[0][i] for i in range(len(ids))]
                   + [pool.mamba_cache.temporal[i] for i in range(len(ids))])
        names = [f"layers.{n}.conv" for n in ids] + [f"layers.{n}.ssm" for n in ids]
        assert ptrs == [t.data_ptr() for t in tensors], "state entries are not conv then ssm"
        return names
    layers = pool.model_layer_ids
    if isinstance(pool, memory_pool.MLATokenToKVPool):
        tensors, names = pool.kv_buffer, [f"layers.{i}" for i in layers]
    else:
        tensors = list(pool.k_buffer) + list(pool.v_buffer)
        names = [f"layers.{i}.k" for i in layers] + [f"layers.{i}.v" for i in layers]
    assert ptrs == [t.data_ptr() for t in tensors], "kv_data_ptrs are not K then V"
    return names


def face(pool) -> dict:
    """What kvplan's adapter reads of a pool (``SGLangKV.from_pool``,
    ``SGLangMamba2.from_pool``), as JSON."""
    out = {"class": type(pool).__name__}
    for a in ("layer_num", "size", "page_size", "head_num", "head_dim", "v_head_dim",
              "start_layer", "kv_cache_layout", "use_hnd", "kv_lora_rank", "qk_rope_head_dim",
              "model_layer_ids", "size_swa"):
        if hasattr(pool, a):
            out[a] = getattr(pool, a)
    for a in ("full_kv_pool", "swa_kv_pool", "mamba_pool"):
        if getattr(pool, a, None) is not None:
            out[a] = face(getattr(pool, a))
    if isinstance(pool, memory_pool.HybridLinearKVPool):
        out["full_attention_layer_id_mapping"] = [
            list(x) for x in pool.full_attention_layer_id_mapping.items()]
    for a in ("k_buffer", "v_buffer", "kv_buffer"):
        if "full_kv_pool" not in out and getattr(pool, a, None) is not None:
            out[a] = [_tensor_face(t) for t in getattr(pool, a)]
    out["buf_infos"] = pool.get_contiguous_buf_infos()
    if isinstance(pool, memory_pool.MambaPool):
        out["state_dim_per_tensor"] = pool.get_state_dim_per_tensor()
        out["state_conv_shard_groups"] = pool.get_state_conv_shard_groups()
        out.update(mamba_layer_ids=pool.mamba_layer_ids, conv_slice_axis=pool.conv_slice_axis,
                   mamba_cache={"conv": [_tensor_face(t) for t in pool.mamba_cache.conv],
                                "temporal": _tensor_face(pool.mamba_cache.temporal)})
    return out


def _tensor_face(t) -> dict:
    return {"shape": list(t.shape), "dtype": str(t.dtype), "ptr": t.data_ptr()}


class Memory:
    """Each engine's pool (one per side: its ranks' pools are alike) and made-up addresses of
    every buffer of every rank, with gaps; addresses back to buffers."""

    def __init__(self, case: dict):
        self.bufs: dict[tuple[str, int], list[tuple[str, int, int]]] = {}
        self.index: list[tuple[int, str, int, str, int]] = []  # (base, side, rank, name, size)
        self.pools, self.stage_pools, self.item_lens = {}, {}, {}
        self.span: dict[tuple[str, str], tuple[int, int]] = {}  # (side, kv|state): entries
        sides = [("p", case["p"], case.get("p_pp", 1)), *decodes(case)]
        for k, (side, tp, pp) in enumerate(sides):
            base = (k + 1) << 40
            self.stage_pools[side] = [build_pool(case, tp, s, pp) for s in range(pp)]
            self.pools[side] = self.stage_pools[side][0]
            for stage, pool in enumerate(self.stage_pools[side]):
                names, lens, self.item_lens[side] = [], [], []
                for what, n, ls, items in entries(pool):
                    self.span[(side, what)] = (len(names), len(names) + len(n))
                    names, lens, self.item_lens[side] = (
                        names + n, lens + list(ls), self.item_lens[side] + list(items))
                for r in range(stage * tp, (stage + 1) * tp):  # flat ranks of the stage
                    out = []
                    for name, size in zip(names, lens):
                        out.append((name, base, size))
                        self.index.append((base, side, r, name, size))
                        base += (size + 8191) // 4096 * 4096  # a gap after every buffer
                    self.bufs[(side, r)] = out
        self.index.sort()
        self.bases = [x[0] for x in self.index]

    def _part(self, side: str, what: str | None) -> slice:
        """The entries of ``what`` (``"kv"``, ``"state"``; None: every entry)."""
        return slice(None) if what is None else slice(*self.span[(side, what)])

    def ptrs(self, side: str, rank: int, what: str | None = None) -> list[int]:
        return [b for _, b, _ in self.bufs[(side, rank)]][self._part(side, what)]

    def sizes(self, side: str, rank: int, what: str | None = None) -> list[int]:
        return [s for _, _, s in self.bufs[(side, rank)]][self._part(side, what)]

    def items(self, side: str, what: str | None = None) -> list[int]:
        return self.item_lens[side][self._part(side, what)]

    def where(self, addr: int) -> tuple[str, int, str, int]:
        """(side, rank, buffer, offset) of an address: the buffer starting at or below it."""
        k = max(0, bisect.bisect_right(self.bases, addr) - 1)
        base, side, rank, name, _ = self.index[k]
        return side, rank, name, addr - base


def kv_args(case: dict, mem: Memory, rank: int) -> SimpleNamespace:
    """A prefill rank's ``KVArgs`` as SGLang fills them from its pool (at this rank's
    made-up addresses). Under DP attention (``p_dp`` groups, the request in group
    ``p_group``) ``engine_rank`` is the rank's TP rank over every group, as
    ``disaggregation/prefill.py`` sets it (``kv_args.engine_rank = self.tp_rank``); the decode
    sets its rank within its group (``decode.py``: ``self.tp_rank % attn_tp_size``)."""
    if case["kind"] == "swa":  # the SWA layers' own MHA pool, handed over as SWA state
        return SimpleNamespace(
            engine_rank=rank, gpu_id=0, page_size=case["page"], kv_layer_ids=None,
            prefill_start_layer=0, state_types=[StateType.SWA],
            state_data_ptrs=[mem.ptrs("p", rank)], state_item_lens=[list(mem.item_lens["p"])],
            state_dim_per_tensor=[[]], state_conv_shard_groups=[[]],
            state_slice_outer_counts=[[]], state_layer_ids=[[]],
            total_kv_head_num=case["full_heads"],
            kv_head_num=max(1, case["full_heads"] // case["p"]), swa_kv_cache_layout="nhd",
            kv_data_ptrs=[], kv_item_lens=[], kv_data_lens=[], num_draft_entries=0,
            mla_compression_ratios=None)
    if case["kind"] in ("mamba2", "gdn", "kda"):
        pool = mem.pools["p"]
        return SimpleNamespace(
            engine_rank=rank, gpu_id=0, page_size=case["page"], kv_layer_ids=None,
            prefill_start_layer=0, state_types=[StateType.MAMBA],
            state_data_ptrs=[mem.ptrs("p", rank)], state_item_lens=[list(mem.item_lens["p"])],
            state_dim_per_tensor=[pool.get_state_dim_per_tensor()],
            state_conv_shard_groups=[pool.get_state_conv_shard_groups()],
            state_slice_outer_counts=[pool.get_state_slice_outer_counts()],
            state_layer_ids=[pool.get_state_layer_ids()])
    stage = rank // case["p"]
    what = "kv" if case["kind"] in COMPOSITE else None
    out = SimpleNamespace(
        kv_data_ptrs=mem.ptrs("p", rank, what), kv_data_lens=mem.sizes("p", rank, what),
        kv_item_lens=list(mem.items("p", what)), page_size=case["page"],
        total_kv_head_num=case["heads"], kv_head_num=max(1, case["heads"] // case["p"]),
        engine_rank=case.get("p_group", 0) * case["p"] + rank % case["p"],
        kv_layer_ids=kv_layer_ids(mem.stage_pools["p"][stage]), gpu_id=0,
        prefill_start_layer=start_layer(case, mem.stage_pools["p"][stage]),
        swa_kv_cache_layout="nhd", mla_compression_ratios=None, num_draft_entries=0,
        kv_data_mem_kinds=["VRAM"] * len(mem.ptrs("p", rank, what)))
    if case["kind"] in COMPOSITE:  # setup_state_kv_args: its state component
        pool = mem.stage_pools["p"][stage]
        mamba = case["kind"] == "hybrid"
        out.__dict__.update(
            state_types=[StateType.MAMBA if mamba else StateType.SWA],
            state_data_ptrs=[mem.ptrs("p", rank, "state")],
            state_item_lens=[list(mem.items("p", "state"))],
            state_dim_per_tensor=[pool.get_state_dim_per_tensor() if mamba else []],
            state_conv_shard_groups=[pool.get_state_conv_shard_groups() if mamba else []],
            state_slice_outer_counts=[pool.get_state_slice_outer_counts() if mamba else []],
            state_layer_ids=[pool.get_state_layer_ids() if mamba else []],
            is_hybrid_mla_backend=False)
    return out


def start_layer(case: dict, pool) -> int:
    """``kv_args.prefill_start_layer`` as ``disaggregation/prefill.py`` sets it
    (``_transfer_start_layer``: for a ``HybridLinearKVPool``, the full-attention layers
    before the stage's ``start_layer``). prefill.py itself does not import under the stubs,
    so that one function of it is compiled from its source."""
    global _TRANSFER_START_LAYER
    if _TRANSFER_START_LAYER is None:
        path = SITE / "srt" / "disaggregation" / "prefill.py"
        tree = ast.parse(path.read_text())
        fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef)
                  and n.name == "_transfer_start_layer")
        scope = {"HybridLinearKVPool": memory_pool.HybridLinearKVPool}
        exec(compile(ast.Module([fn], []), str(path), "exec"), scope)
        _TRANSFER_START_LAYER = scope["_transfer_start_layer"]
    config = SimpleNamespace(full_attention_layer_ids=case.get("full_layers", []))
    return _TRANSFER_START_LAYER(pool=pool, hf_text_config=config)


_TRANSFER_START_LAYER = None


COMPOSITE = ("hybrid", "swapool")  # pools of KV beside state: both are sent


def kv_layer_ids(pool) -> list[int]:
    """``kv_args.kv_layer_ids`` as ``build_kv_layer_ids`` gives them (no draft pool): a
    ``HybridLinearKVPool``'s global ids per entry, ``[]`` for other pools."""
    return utils.build_kv_layer_ids(token_to_kv_pool=pool, draft_token_to_kv_pool=None,
                                    num_draft_entries=0, num_hidden_layers=0)


def decodes(case: dict) -> list[tuple[str, int, int]]:
    """The decode engines of a case: ``("d", TP, PP)``, and ``("e", TP, 1)`` when a second
    decode engine (``d2``) pulls from the same prefill."""
    return [("d", case["d"], case.get("d_pp", 1))] + (
        [("e", case["d2"], 1)] if case.get("d2") else [])


def senders(case: dict, cls: type, dtp: int, dpp: int) -> dict[int, list[int]]:
    """Decode flat rank -> the prefill flat ranks that send it KV, by SGLang's own rank
    mapping, for a decode engine of attention TP ``dtp`` and PP ``dpp``."""
    out = {}
    mla = case["kind"] == "mla"
    p_tp, p_pp = case["p"], case.get("p_pp", 1)
    for t in range(dtp * dpp):
        m = object.__new__(cls)
        m.is_mla_backend, m.is_hybrid_mla_backend = mla, False
        m.attn_tp_size, m.attn_cp_size, m.attn_cp_rank = dtp, 1, 0
        m.pp_size, m.pp_rank, m.enable_all_cp_ranks_for_transfer = dpp, t // dtp, False
        m.kv_args = SimpleNamespace(engine_rank=t % dtp)
        info = SimpleNamespace(attn_tp_size=p_tp, attn_cp_size=1, pp_size=p_pp,
                               enable_kv_cache_sharding=False,
                               enable_dsa_cache_layer_split=False)
        m._resolve_rank_mapping(info)
        tps = [info.target_tp_rank] if mla else list(info.target_tp_ranks)
        out[t] = [pp * p_tp + r for pp in info.target_pp_ranks for r in tps]
    return out


def _pairs(case: dict, cls: type) -> list[tuple[tuple[str, int], int, int]]:
    """``((decode side, its TP), decode flat rank, prefill flat rank)`` of every sending
    pair."""
    return [((side, dtp), t, p) for side, dtp, dpp in decodes(case)
            for t, ps in senders(case, cls, dtp, dpp).items() for p in ps]


class Refused(Exception):
    """SGLang reported a failure without raising."""


class MooncakeRecorder:
    """Mooncake's transfer engine, recording every copy."""

    def __init__(self):
        self.copies: list[tuple[int, int, int]] = []

    def batch_transfer_sync(self, session_id, srcs, dsts, lengths):
        self.copies += list(zip(map(int, srcs), map(int, dsts), map(int, lengths)))
        return 0


def _manager(cls, case, mem, rank):
    m = object.__new__(cls)
    m.kv_args = kv_args(case, mem, rank)
    m.attn_tp_size, m.pp_size, m.pp_rank = case["p"], case.get("p_pp", 1), rank // case["p"]
    m.is_mla_backend = case["kind"] == "mla"
    m.is_hybrid_mla_backend = False
    return m


def run_mooncake(case: dict, mem: Memory) -> list[tuple[int, int, int]]:
    cls = mooncake_conn.MooncakeKVManager
    eng = MooncakeRecorder()
    src_pages = np.asarray(case["src_pages"], dtype=np.int32)
    dst_pages = np.asarray(case["dst_pages"], dtype=np.int32)
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        for (side, dtp), t, p in _pairs(case, cls):
            what = "kv" if case["kind"] in COMPOSITE else None
            dst_item = mem.items(side, what)[0]
            dst_ids = kv_layer_ids(mem.stage_pools[side][t // dtp]) or None
            m = _manager(cls, case, mem, p)
            m.engine = eng
            m.state_strides_validated = set()
            m.enable_custom_mem_pool, m.custom_mem_pool_type = False, None
            m.max_transfer_batch_indices = (  # as the constructor reads it
                mooncake_conn.envs.SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES.get())
            m.request_status = {}
            if case["kind"] in STATE_KINDS:  # what maybe_send_extra moves
                m.state_tp_size = case["p"]
                req = SimpleNamespace(mooncake_session_id=f"{side}{t}", room=0,
                                      dst_state_indices=[_indices(case, "dst")])
                ret = m.maybe_send_extra(req, [_indices(case, "src")], ex, _state_peer(
                    mem, side, dtp, t))
                if ret != 0:
                    raise Refused(f"p{p} -> {side}{t}: {cls.__name__} returned {ret}")
                continue
            session = f"{side}{t}"
            if m.is_mla_backend or case["p"] == dtp:
                ret = m.send_kvcache(session, src_pages, mem.ptrs(side, t, what), dst_pages,
                                     ex, dst_layer_ids=dst_ids, dst_kv_item_len=dst_item,
                                     dst_attn_tp_size=dtp)
            else:
                ret = m.send_kvcache_slice(session, src_pages, mem.ptrs(side, t, what),
                                           dst_pages, t % dtp, dtp, dst_item, ex, dst_ids)
            if ret != 0:
                raise Refused(f"p{p} -> {side}{t}: {cls.__name__} returned {ret}")
            if case["kind"] in COMPOSITE:  # then the state, as the transfer worker does
                m.state_tp_size = case["p"]
                req = SimpleNamespace(mooncake_session_id=session, room=0,
                                      dst_state_indices=[_indices(case, "dst")])
                ret = m.maybe_send_extra(req, [_indices(case, "src")], ex, _state_peer(
                    mem, side, dtp, t))
                if ret != 0:
                    raise Refused(f"p{p} -> {side}{t}: {cls.__name__} returned {ret} (state)")
    return eng.copies


STATE_KINDS = ("mamba2", "gdn", "kda", "swa")


def _indices(case: dict, side: str) -> list[int]:
    """A request's state indices: its slot (Mamba2, GDN), its pages (a plain pool's SWA
    layers) or its SWA pages (a ``SWAKVPool``'s own index space)."""
    key = {"swa": "pages", "swapool": "swa_pages"}.get(case["kind"], "slots")
    return case[f"{side}_{key}"]


def _state_peer(mem: Memory, side: str, dtp: int, t: int) -> SimpleNamespace:
    """What a decode rank registers about its state buffers."""
    pool = mem.stage_pools[side][t // dtp]
    what = "state" if (side, "state") in mem.span else None  # a hybrid pool's state part
    if isinstance(pool, memory_pool.HybridLinearKVPool):
        pool = pool.mamba_pool
    mamba = isinstance(pool, memory_pool.MambaPool)
    return SimpleNamespace(
        dst_state_data_ptrs=[mem.ptrs(side, t, what)],
        dst_state_item_lens=[list(mem.items(side, what))],
        dst_state_dim_per_tensor=[pool.get_state_dim_per_tensor() if mamba else []],
        dst_state_layer_ids=[pool.get_state_layer_ids() if mamba else []],
        dst_attn_tp_size=dtp, dst_tp_rank=t)


class NixlRecorder:
    """NIXL's agent: descriptor lists over registered memory, prepped transfers recorded."""

    def __init__(self, mem: Memory, rank: int):
        self.mem, self.rank = mem, rank
        self.dlists: list[np.ndarray] = []
        self.copies: list[tuple[int, int, int]] = []

    def prep_xfer_dlist(self, peer_name, descs, mem_kind):
        descs = np.asarray(descs, dtype=np.uint64)
        if descs.ndim == 2 and descs.shape[1] == 5:  # strided runs
            descs = nixl_conn.NixlKVManager._expand_stride_descs(descs)
        side = "p" if peer_name == "" else peer_name[0]
        rank = self.rank if side == "p" else int(peer_name[1:])
        for addr, length, _ in descs.tolist():
            s, r, name, off = self.mem.where(addr)
            size = dict((n, z) for n, _, z in self.mem.bufs[(s, r)])[name]
            if (s, r) != (side, rank) or off + length > size:
                raise RuntimeError(f"NIXL_ERR_NOT_FOUND: descriptor {addr:#x}+{length} is not "
                                   f"inside memory registered by {side}{rank}")
        self.dlists.append(descs)
        return len(self.dlists) - 1

    def get_xfer_descs(self, descs, mem_kind="VRAM"):
        return np.asarray(descs, dtype=np.uint64).reshape(-1, 3)

    def initialize_xfer(self, op, src_descs, dst_descs, peer_name, *a, **k):
        s = self.dlists[self.prep_xfer_dlist("", src_descs, "VRAM")]
        d = self.dlists[self.prep_xfer_dlist(peer_name, dst_descs, "VRAM")]
        return self._record(s, d)

    def make_prepped_xfer(self, op, src_h, src_idx, dst_h, dst_idx, *a, **k):
        s = self.dlists[src_h][np.asarray(src_idx, dtype=np.int64)]
        d = self.dlists[dst_h][np.asarray(dst_idx, dtype=np.int64)]
        return self._record(s, d)

    def _record(self, s: np.ndarray, d: np.ndarray) -> int:
        if len(s) != len(d):
            raise RuntimeError(f"NIXL_ERR_INVALID_PARAM: {len(s)} source and {len(d)} "
                               "destination descriptors")
        if (s[:, 1] != d[:, 1]).any():
            raise RuntimeError("NIXL_ERR_INVALID_PARAM: source and destination descriptor "
                               "lengths differ")
        self.copies += [(int(a_), int(b_), int(n_)) for a_, b_, n_ in
                        zip(s[:, 0].tolist(), d[:, 0].tolist(), s[:, 1].tolist())]
        return 1

    def transfer(self, handle, *a, **k):
        return "DONE"


def run_nixl(case: dict, mem: Memory) -> list[tuple[int, int, int]]:
    cls = nixl_conn.NixlKVManager
    src_pages = np.asarray(case["src_pages"], dtype=np.int32)
    dst_pages = np.asarray(case["dst_pages"], dtype=np.int32)
    by_prefill: dict[int, list[tuple[str, int, int]]] = {}
    for (side, dtp), t, p in _pairs(case, cls):
        by_prefill.setdefault(p, []).append((side, dtp, t))
    copies = []
    for p, ts in sorted(by_prefill.items()):
        m = _manager(cls, case, mem, p)
        agent = NixlRecorder(mem, p)
        m.agent, m.src_mem_kind, m._use_strided_descs = agent, "VRAM", True
        m.prep_handles, m.prep_handle_slice_src, m.prep_handles_slice_dst = {}, None, {}
        m._num_slots_src = case["pages"]
        m.decode_kv_args_table = {}
        if case["kind"] in STATE_KINDS:
            m.state_tp_size, m._state_layout_rejections, m._prepared_state_plans = (
                case["p"], {}, {})
            for side, dtp, t in ts:
                info = _state_peer(mem, side, dtp, t)
                for _ in m.maybe_send_extra(
                        f"{side}{t}", [_indices(case, "src")], info.dst_state_data_ptrs,
                        [_indices(case, "dst")], 0, dtp, t, info.dst_state_item_lens,
                        info.dst_state_dim_per_tensor, info.dst_state_layer_ids):
                    pass
            copies += agent.copies
            continue
        what = "kv" if case["kind"] in COMPOSITE else None
        for side, dtp, t in ts:  # registration: every decode peer first, as bootstrap does
            n = len(mem.ptrs(side, t, what))
            info = SimpleNamespace(
                agent_name=f"{side}{t}", decode_tp_size=dtp, decode_tp_rank=t % dtp,
                dst_kv_ptrs=mem.ptrs(side, t, what), dst_kv_item_len=mem.items(side, what)[0],
                dst_kv_item_lens=list(mem.items(side, what)),
                dst_kv_mem_kinds=["VRAM"] * n, dst_num_slots=case["pages"], gpu_id=0,
                dst_kv_layer_ids=kv_layer_ids(mem.stage_pools[side][t // dtp]) or None,
                requires_dcp_relayout=False, kv_xfer_segments=None,
                dst_homogeneous_mem_kind=None)
            m.decode_kv_args_table[info.agent_name] = info
            m._prepare_payload_xfer(info)
        for side, dtp, t in ts:
            if m.is_mla_backend or case["p"] == dtp:
                m.send_kvcache(f"{side}{t}", src_pages, mem.ptrs(side, t, what), dst_pages, 0,
                               dst_mem_kind="VRAM")
            else:
                m.send_kvcache_slice(f"{side}{t}", src_pages, dst_pages)
        if case["kind"] in COMPOSITE:  # then the state, as the transfer worker does
            m.state_tp_size, m._state_layout_rejections, m._prepared_state_plans = (
                case["p"], {}, {})
            for side, dtp, t in ts:
                info = _state_peer(mem, side, dtp, t)
                for _ in m.maybe_send_extra(
                        f"{side}{t}", [_indices(case, "src")], info.dst_state_data_ptrs,
                        [_indices(case, "dst")], 0, dtp, t, info.dst_state_item_lens,
                        info.dst_state_dim_per_tensor, info.dst_state_layer_ids):
                    pass
        copies += agent.copies
    return copies


def _where(exc: BaseException) -> str:
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if "/sglang/" in frame.filename:
            return f"{Path(frame.filename).relative_to(SITE)}:{frame.lineno}"
    return ""


class _Errors(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(f"{record.pathname.split('/sglang/')[-1]}:{record.lineno}: "
                          f"{record.getMessage()}")


def run(case: dict, backend: str) -> dict:
    """One case on one connection: its copies, or how it failed, and the pools' faces."""
    try:
        mem = Memory(case)
    except Exception as e:
        return {"status": "raises", "error": f"building the pools: {type(e).__name__}: {e}",
                "where": _where(e)}
    pools = {side: face(ps[0]) if len(ps) == 1 else [face(p) for p in ps]
             for side, ps in mem.stage_pools.items()}
    errors = _Errors()
    logging.getLogger().addHandler(errors)
    try:
        copies = (run_mooncake if backend == "mooncake" else run_nixl)(case, mem)
    except Refused as e:
        return {"status": "refuses", "error": f"{e}; {' | '.join(errors.lines)}"[:400],
                "pools": pools}
    except Exception as e:  # SGLang's own failures are what is being recorded
        return {"status": "raises", "error": f"{type(e).__name__}: {e}"[:400],
                "where": _where(e), "pools": pools}
    finally:
        logging.getLogger().removeHandler(errors)
    rows: dict[str, list] = {side: [] for side, _, _ in decodes(case)}
    for src, dst, length in copies:
        s_side, s_rank, s_name, s_off = mem.where(src)
        d_side, d_rank, d_name, d_off = mem.where(dst)
        if s_side != "p" or d_side not in rows:
            raise AssertionError(f"a copy from {s_side} into {d_side}")  # a driver bug
        rows[d_side].append([s_rank, s_name, s_off, d_rank, d_name, d_off, length])
    return {"status": "ran", "rows": rows["d"], "rows2": rows.get("e"), "pools": pools,
            "attention_ranks": attention_ranks(case)}


def attention_ranks(case: dict) -> dict[str, list]:
    """Under DP attention, SGLang's own ``compute_dp_attention_world_info`` for every TP rank
    of each side: ``[attn_tp_rank, attn_tp_size, attn_dp_rank, attn_dp_size]``."""
    from sglang.srt.layers.dp_attention import compute_dp_attention_world_info

    out = {}
    for side in ("p", "d"):
        dp = case.get(f"{side}_dp", 1)
        tp = case[side] * dp
        out[side] = [list(compute_dp_attention_world_info(r, tp, dp)) for r in range(tp)]
    return out


def _break_slicing() -> None:
    """``KVPLAN_SGLANG_PARITY_BREAK=1``: swap the source and destination head offsets of
    ``compute_head_slice_params``, so that the test can see the judge call SGLang wrong."""
    from sglang.srt.disaggregation.common import staging_buffer

    real = staging_buffer.compute_head_slice_params

    def broken(*a, **k):
        src, n, dst, n2 = real(*a, **k)
        return dst, n, src, n2

    staging_buffer.compute_head_slice_params = broken


def main() -> None:
    if os.environ.get("KVPLAN_SGLANG_PARITY_BREAK") == "1":
        _break_slicing()
    logging.disable(logging.WARNING)  # SGLang's warnings off; its errors are recorded
    cases = json.load(sys.stdin)
    out = []
    for case in cases:
        for backend in BACKENDS:
            out.append({"id": case["id"], "backend": backend, **run(case, backend)})
    json.dump({"stubbed": sorted(sglang_stubs.STUBBED), "results": out}, sys.stdout)


if __name__ == "__main__":
    main()

"""What differs between the vLLM versions KvplanConnector runs on, in one place, and the check
two engines of different versions pass at handshake (docs/vllm.md, "vLLM versions and rolling
upgrades").

A rolling upgrade runs a fleet on two vLLM versions for a while: prefills of one beside decodes
of the other. A kvplan pair moves KV by a layout both sides describe (``kvplan.EngineSpec``,
checked at ``Endpoint.connect``), not by vLLM's version, so a mixed pair is exact whenever the
versions keep the KV caches' bytes alike. What the describing code cannot see is a change *in*
a layout it names: the same backend name with another page order. So every version is listed
here with the epoch of its KV layouts (:data:`VERSIONS`); each engine advertises its vLLM
version in its signed metadata (``Endpoint(app=...)``: :func:`advertised`), and a peer is
refused by name at handshake (:func:`check_peer`, :class:`VersionRefused`) when:

- the two versions differ and either one is not listed here (nothing vouches for the pair:
  upgrade kvplan first, or run both sides on one version), or
- both are listed, with different layout epochs (a layout change: never read across).

Equal versions always pass, listed or not (the check before versions existed); a peer that
advertises no version (a kvplan of before this module) is taken as of this engine's version.

Found between 0.31.0 and 0.32.0 (diffs of the two wheels' ``vllm/``), each handled here:

- the KV caches' bytes, as far as read and run: ``CPU_ATTN`` unchanged (``cpu_attn.py``: only
  ``use_cascade_attention`` dropped; pull and push run both ways), ``cpu_mla.py`` identical;
  0.32 lets ``block_stride_alignment`` be whole kernel blocks (``kv_cache_interface.py``),
  which the spec follows from the tensors' own strides; the host-buffer permutes NixlConnector
  applies on receive (``kv_connector/utils.py``) changed, which kvplan does not use. One
  layout epoch for both. (0.31's CPU build cannot run a float32 Mamba2 model at all:
  ``causal_conv1d_fwd_kernel_impl`` has no float32 kernel there, so no hybrid pair was run.)
- NixlConnector's wire: ``NIXL_CONNECTOR_VERSION`` 13 -> 14 (``NixlAgentMetadata`` gained
  ``ple_block_len``, ``None`` for every model without a PLE short-conv state), and the
  compatibility hash includes it and ``vllm.__version__``. A stock prefill of another listed
  version publishes another hash for the same engines: :func:`stock_hashes` gives the hash of
  each listed version, from the factors vLLM hashes (:func:`_factors`, checked against vLLM's
  own function for the local version: where they differ, only the local hash is accepted).
- the connector API kvplan uses (``KVConnectorBase_V1`` and friends): 0.32 added
  ``get_loaded_kv_cache_group_ids`` and ``get_external_cache_hit_sources`` with defaults;
  kvplan overrides neither, so both versions run the same code.

No NIXL; imports vLLM only inside :func:`local_version` and :func:`stock_hashes`.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["APP_KEY", "VERSIONS", "Version", "VersionRefused", "advertised", "check_pair",
           "check_peer", "local_version", "stock_hashes"]

# a child of vLLM's logger (vllm.logger.init_logger gives the same), so that its handlers apply
logger = logging.getLogger("vllm.kvplan_nixl")

#: The name of the vLLM version in an endpoint's advertised ``app`` strings.
APP_KEY = "vllm"


@dataclass(frozen=True)
class Version:
    """One vLLM release line (``major.minor``: patch releases keep its layouts)."""

    #: the epoch of its KV caches' layouts: two lines of one epoch keep the same bytes for
    #: every backend kvplan reads (raise it for a line that changes any)
    layouts: int
    #: NixlConnector's ``NIXL_CONNECTOR_VERSION`` (a stock prefill's compatibility hash)
    nixl_connector: int


#: The vLLM lines this connector is tested on (tests/test_vllm_upgrade.py runs both sides of
#: each pair), by ``major.minor``.
VERSIONS: dict[str, Version] = {
    "0.31": Version(layouts=1, nixl_connector=13),
    "0.32": Version(layouts=1, nixl_connector=14),
}


class VersionRefused(ValueError):
    """A peer's vLLM version cannot be read across exactly; the message names both and why."""


def line(version: str) -> str:
    """``major.minor`` of a version string (``0.32.0``, ``0.32.1+cpu`` -> ``0.32``)."""
    return ".".join(version.split("+")[0].split(".")[:2])


def local_version() -> str:
    """The vLLM version this process runs (``vllm.__version__``)."""
    from vllm import __version__

    return str(__version__)


def advertised(version: str | None = None) -> dict[str, str]:
    """What an endpoint advertises (``Endpoint(app=...)``): this engine's vLLM version."""
    return {APP_KEY: version or local_version()}


def check_pair(local: str, remote: str, who: str = "the peer") -> None:
    """Raise :class:`VersionRefused` unless an engine of vLLM ``local`` may exchange KV with
    one of vLLM ``remote`` exactly (the module docstring's rule)."""
    if line(local) == line(remote):
        return
    listed = ", ".join(sorted(VERSIONS))
    mine, theirs = VERSIONS.get(line(local)), VERSIONS.get(line(remote))
    for v, known in ((remote, theirs), (local, mine)):
        if known is None:
            raise VersionRefused(
                f"{who} runs vLLM {remote}, this engine {local}: vLLM {v} is not a version "
                f"this kvplan knows ({listed}; kvplan_nixl/vllm/versions.py), so nothing "
                "vouches that their KV layouts agree; run both on one version, or upgrade "
                "kvplan on both first")
    if mine.layouts != theirs.layouts:
        raise VersionRefused(
            f"{who} runs vLLM {remote}, this engine {local}: their KV cache layouts differ "
            f"(layout epoch {theirs.layouts} vs {mine.layouts}, "
            "kvplan_nixl/vllm/versions.py), so no transfer between them can be exact; "
            "upgrade the other side too")


def check_peer(local: str) -> Any:
    """A check of a decoded peer's metadata (``kvplan_nixl.metadata.PeerInfo``) for
    :func:`kvplan_nixl.serving.handshakes.identity`: :func:`check_pair` of its advertised
    version against ``local`` (a peer advertising none passes: see the module docstring)."""
    def check(info: Any) -> None:
        remote = dict(info.app).get(APP_KEY)
        if remote is None or remote == local:
            return
        who = f"engine {info.engine!r} rank {info.rank}"
        check_pair(local, remote, who)
        # said once per handshake and rank: an operator mid-upgrade sees which pairs mix
        logger.info("kvplan: %s runs vLLM %s, this engine %s: a mixed pair, read exactly "
                    "(layout epoch %d)", who, remote, local, VERSIONS[line(local)].layouts
                    if line(local) in VERSIONS else 0)
    return check


def _factors(vllm_config: Any, backend: str, version: str, nixl_connector: int) -> dict:
    """The factors vLLM 0.31 and 0.32 hash for a NixlConnector pull decode
    (``compute_nixl_compatibility_hash`` in ``nixl/metadata.py``: the same list in both),
    with the version fields of ``version``."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import metadata as nm

    mc, cc = vllm_config.model_config, vllm_config.cache_config
    return {
        "vllm_version": version,
        "nixl_connector_version": nixl_connector,
        "model": mc.model,
        "dtype": str(mc.dtype),
        "num_kv_heads": mc.get_total_num_kv_heads(),
        "head_size": mc.get_head_size(),
        "num_hidden_layers": mc.get_total_num_hidden_layers(),
        "attn_backend_name": backend,
        "cache_dtype": str(cc.cache_dtype),
        "is_hma_enabled": not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager,
        "speculative_config": nm._get_speculative_compatibility_factors(vllm_config),
        "transfer_mode": "pull",
    }


def _hash(factors: Mapping[str, Any]) -> str:
    # vLLM's hash_factors (config/utils.py), the same in 0.31 and 0.32
    return hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()


def stock_hashes(vllm_config: Any, backend: str, *,
                 versions: Mapping[str, str] | None = None) -> dict[str, str]:
    """``{compatibility hash: vLLM version}`` a stock NixlConnector prefill of the same engine
    configuration publishes, for this process's vLLM (by vLLM's own function) and, when the
    factors here reproduce that hash, for every other listed line: the release each line was
    tested as (``versions``: ``{line: release}``, default ``x.y.0``)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        compute_nixl_compatibility_hash,
    )

    here = local_version()
    own = compute_nixl_compatibility_hash(vllm_config, backend, transfer_mode="pull")
    out = {own: here}
    mine = VERSIONS.get(line(here))
    if mine is None or _hash(_factors(vllm_config, backend, here, mine.nixl_connector)) != own:
        return out  # vLLM hashes other factors than listed here: only its own hash is known
    releases = {k: f"{k}.0" for k in VERSIONS} | dict(versions or {})
    for key, v in VERSIONS.items():
        if key != line(here) and v.layouts == mine.layouts:
            release = releases[key]
            out.setdefault(_hash(_factors(vllm_config, backend, release, v.nixl_connector)),
                           release)
    return out

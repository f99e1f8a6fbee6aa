"""What both halves of ``KvplanConnector`` read from the engine's config, read once by the
facade: the engine's identity, its side channel and the connector's extra config keys."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Settings:
    """One engine's connector settings (see the package docstring for the extra keys)."""

    engine_id: str
    host: str  # the side channel's host (``side_channel_host``, else $VLLM_HOST_IP)
    port: int  # the side channel's base port; rank r listens on port + r
    tp_size: int
    extra: dict[str, Any] = field(default_factory=dict)

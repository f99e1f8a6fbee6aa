"""Typed errors of the planning core: one root, each subclass a ValueError naming what is wrong.

Layer 0: imports nothing; every other module may raise these.
"""

from __future__ import annotations


class KVPlanError(Exception):
    """Root of every error kvplan raises on purpose."""


class SpecError(KVPlanError, ValueError):
    """An engine or region spec is malformed on its own: a missing field or a bad value."""


class IncompatibleLayoutError(KVPlanError, ValueError):
    """Two valid engine specs cannot exchange KV; the message names the region and the numbers."""


class RequestError(KVPlanError, ValueError):
    """A request's block ids do not fit the map: wrong group count, id out of range, repeated id."""


class PlanError(KVPlanError, ValueError):
    """A plan disagrees with itself or with the buffers it is applied to (``simulate``): a run
    outside its buffer, two runs writing one byte, a buffer missing or of the wrong type."""

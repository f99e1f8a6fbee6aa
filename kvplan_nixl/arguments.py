"""Checks of the public API's arguments: each returns the value to use or raises
:class:`~kvplan_nixl.errors.ArgumentError` naming the argument and the value given.

The facades (``Endpoint``, ``Stager``, ``RequestTransfer``) call them at the entry of each
public method, before anything is allocated or posted, so that a wrong type or an out-of-range
number never surfaces later as a ``TypeError`` of NIXL or torch, an ``OverflowError`` or a wait
that never ends (a ``nan`` deadline compares false with every clock reading).

A bottom-layer module: it may import only :mod:`kvplan_nixl.errors`,
:mod:`kvplan_nixl.reserved` and kvplan.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from kvplan import Mode
from kvplan_nixl.errors import ArgumentError
from kvplan_nixl.reserved import CTRL, STAGED, is_reserved

__all__ = ["check_choice", "check_int", "check_mode", "check_names", "check_notify",
           "check_progress", "check_request", "check_str", "check_timeout"]


RESERVED_TEXT = f"{CTRL!r}, {STAGED!r}"


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_timeout(name: str, value: Any, *, optional: bool = True) -> float | None:
    """A deadline in seconds: a finite non-negative real number (or None when ``optional``:
    no deadline)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        none = " or None" if optional else ""
        raise ArgumentError(f"{name} must be a number of seconds{none}, got "
                            f"{type(value).__name__} {_shown(value)}")
    if not math.isfinite(value) or value < 0:
        raise ArgumentError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
    return float(value)


def check_int(name: str, value: Any, *, low: int = 0, high: int | None = None) -> int:
    """An int (never a bool) in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentError(f"{name} must be an int, got {type(value).__name__} {_shown(value)}")
    if value < low or (high is not None and value > high):
        top = "" if high is None else f" and <= {high}"
        raise ArgumentError(f"{name} must be >= {low}{top}, got {value}")
    return value


def check_notify(value: Any) -> bytes | None:
    """A notification message: bytes (or bytearray / memoryview) as given, a str as its UTF-8
    bytes, or None (no notification). Anything else (a list of ints, a number) is refused:
    ``bytes([1, 2])`` would silently make a message of it. A message starting with a reserved
    prefix (``kvplan_nixl.reserved``: the control notices', the staged protocol's) is refused:
    the receiver never hands those to ``notifications()``."""
    if value is None:
        return None
    if isinstance(value, str):
        value = value.encode()
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise ArgumentError(f"notify must be bytes or str (or None), got "
                            f"{type(value).__name__} {_shown(value)}")
    value = bytes(value)
    if is_reserved(value):  # the receiver would route it to a protocol, never to the user
        raise ArgumentError(f"notify {_shown(value)} starts with a prefix reserved for the "
                            f"executor's own messages ({RESERVED_TEXT})")
    return value


def check_str(name: str, value: Any) -> str:
    """A non-empty str (an engine name)."""
    if not isinstance(value, str) or not value:
        raise ArgumentError(f"{name} must be a non-empty str, got {type(value).__name__} "
                            f"{_shown(value)}")
    return value


def check_names(name: str, value: Any) -> tuple[str, ...]:
    """A list or tuple of non-empty strs (NIXL backend names), as a tuple; a lone str is
    refused (it would be read as its letters)."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise ArgumentError(f"{name} must be a list of names, e.g. ['UCX'], got "
                            f"{_shown(value)}")
    return tuple(value)


def check_choice(name: str, value: Any, options: Sequence[str]) -> str:
    """One of ``options``, spelled exactly (lower case)."""
    if not isinstance(value, str) or value not in options:
        raise ArgumentError(f"{name} must be one of {', '.join(map(repr, options))}, got "
                            f"{_shown(value)}")
    return value


def check_mode(value: Any) -> Mode:
    """A :class:`kvplan.Mode` or its value, ``"pull"`` or ``"push"``."""
    if isinstance(value, Mode):
        return value
    return Mode(check_choice("mode", value, tuple(m.value for m in Mode)))


def check_progress(value: Any, method: str = "progress") -> tuple[Any, ...]:
    """``progress=`` of a wait: an iterable of objects with a ``method`` (Endpoints, Stagers)
    of this process to drive meanwhile, as a tuple."""
    try:
        others = tuple(value)
    except TypeError:
        raise ArgumentError(f"progress must be a list of Endpoints or Stagers, got "
                            f"{type(value).__name__} {_shown(value)}") from None
    odd = [o for o in others if not callable(getattr(o, method, None))]
    if odd:
        raise ArgumentError(f"progress: {_shown(odd[0])} has no {method}() to call")
    return others


def check_request(remote: Any, notify: Any, timeout: Any) -> tuple[bytes | None, float | None]:
    """The arguments every posting call shares (``read``, ``write``, ``post``, ``request``):
    ``remote`` an engine name, ``notify`` as :func:`check_notify`, ``timeout`` as
    :func:`check_timeout`; returns ``(notify, timeout)`` as the call uses them."""
    check_str("remote", remote)
    return check_notify(notify), check_timeout("timeout", timeout)

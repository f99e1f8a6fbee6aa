"""Hooks: where a value object low in the core calls code that lives above it.

Layer 0 (with ``errors``): imports nothing from kvplan. The core is built in layers that import
one way only (docs/design.md): specs and layouts, then the planner, then plans, then views,
staging, presets and the CLI. A few methods of the low values are *served* from above --
``EngineSpec.from_hf_config`` by :mod:`kvplan.hf`, ``TransferMap.plan`` by :mod:`kvplan.plan`,
``_repr_html_`` / ``to_pandas`` / ``summary`` / ``plot`` by :mod:`kvplan.views` -- so the
method calls :func:`call` with the name of the service, and the module above registers its
function with :func:`provide` when it is imported. ``import kvplan`` imports them all (and any
``import kvplan.x`` runs ``kvplan/__init__`` first), so every hook is filled before it is used.

A dict lookup per call: nothing on the request path loops through here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_SERVED: dict[str, Callable[..., Any]] = {}


def provide(name: str) -> Callable[[F], F]:
    """Decorator: ``fn`` serves the hook ``name`` (the last module to provide it wins)."""

    def register(fn: F) -> F:
        _SERVED[name] = fn
        return fn

    return register


def call(name: str, *args: Any, **kwargs: Any) -> Any:
    """Run the function serving ``name``; :class:`LookupError` if no module provided it."""
    try:
        fn = _SERVED[name]
    except KeyError:
        raise LookupError(f"kvplan hook {name!r} is not provided: import kvplan first "
                          "(its package init imports the modules that serve the hooks)") from None
    return fn(*args, **kwargs)

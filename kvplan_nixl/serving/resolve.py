"""Name resolution under a deadline, for hosts a request names (issue 45, gap e).

``socket.getaddrinfo`` takes no timeout: a name whose DNS server answers nothing holds the
calling thread for the resolver's own timeouts and retries (glibc: 5 s a try, two tries a
server, by default), whatever deadline the caller meant to keep, and a request chooses the
name. :func:`resolve` keeps the caller's deadline instead:

- a numeric address (IPv4, IPv6, with or without brackets and a ``%`` scope) is converted
  without any lookup (``AI_NUMERICHOST``): it never blocks;
- a name is resolved on a thread of a small pool of its own (:data:`WORKERS` threads), and the
  caller waits at most until its deadline (:class:`ResolveTimeout`). A lookup that outlives its
  caller keeps its thread until the resolver gives up; at most :data:`IN_FLIGHT` lookups are
  pending at once, beyond which a new name is refused at once (:class:`ResolveBusy`), so names
  that never resolve cost a bounded number of threads and never a caller's deadline;
- an answer is kept :data:`TTL_S` seconds (at most :data:`CACHED` names, the oldest dropped
  first), so the names a deployment uses ("localhost", a prefill's host name) are looked up
  once a minute, not once a handshake. A failed lookup is not kept.

Standard library only.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

__all__ = ["CACHED", "IN_FLIGHT", "TTL_S", "WORKERS", "ResolveBusy", "ResolveError",
           "ResolveTimeout", "resolve"]

#: Threads that run lookups of names (not numeric addresses).
WORKERS = 4
#: Lookups pending at most (running or queued); beyond, a new name is refused at once.
IN_FLIGHT = 16
#: Seconds an answer is kept.
TTL_S = 60.0
#: Names kept at most.
CACHED = 256

#: ``getaddrinfo``'s answer: (family, type, proto, canonname, sockaddr) tuples.
AddrInfo = tuple[int, int, int, str, tuple]


class ResolveError(OSError):
    """``host`` could not be resolved (the message says why); an ``OSError``, as
    ``getaddrinfo``'s own errors are."""

    def __init__(self, host: str, why: str) -> None:
        self.host = host
        super().__init__(f"resolving {host!r}: {why}")


class ResolveTimeout(ResolveError, TimeoutError):
    """No answer for ``host`` within the caller's deadline (the lookup may go on, on the
    resolver's thread, bounded by :data:`IN_FLIGHT`)."""


class ResolveBusy(ResolveError):
    """:data:`IN_FLIGHT` lookups are pending already (names that do not answer): refused at
    once, nothing looked up."""


_pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="kvplan-resolve")
_mu = threading.Lock()
_pending: dict[tuple[str, int], Future] = {}  # one lookup per (name, port) at a time
_cache: OrderedDict[tuple[str, int], tuple[float, AddrInfo]] = OrderedDict()


def resolve(host: str, port: int, deadline: float) -> AddrInfo:
    """The first ``getaddrinfo(host, port, type=SOCK_STREAM)`` entry, by ``deadline`` (a
    ``time.monotonic()`` reading). ``host`` may be in brackets (an IPv6 address as a request's
    ``remote_host`` may give it). Raises :class:`ResolveError` (no such name, not a valid
    name), :class:`ResolveTimeout`, :class:`ResolveBusy`."""
    name = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:  # a numeric address: no lookup, never blocks
        return socket.getaddrinfo(name, port, type=socket.SOCK_STREAM,
                                  flags=socket.AI_NUMERICHOST | socket.AI_NUMERICSERV)[0]
    except socket.gaierror:
        pass
    except (UnicodeError, ValueError) as e:
        raise ResolveError(host, str(e)) from None
    key = (name, port)
    now = time.monotonic()
    with _mu:
        hit = _cache.get(key)
        if hit is not None and now - hit[0] < TTL_S:
            return hit[1]
        fut = _pending.get(key)
        if fut is None:
            if len(_pending) >= IN_FLIGHT:
                raise ResolveBusy(host, f"{IN_FLIGHT} lookups of other names are pending "
                                  "(names that do not answer); try again later")
            fut = _pending[key] = _pool.submit(_lookup, name, port)
            fut.add_done_callback(lambda f, key=key: _done(key, f))
    try:
        return fut.result(timeout=max(0.0, deadline - time.monotonic()))
    except FutureTimeout:
        raise ResolveTimeout(host, "no answer by the deadline") from None
    except (OSError, UnicodeError, ValueError) as e:
        raise ResolveError(host, str(e)) from None


def _lookup(name: str, port: int) -> AddrInfo:
    return socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)[0]


def _done(key: tuple[str, int], fut: Future) -> None:
    """A lookup ended: no longer pending; its answer kept (a failure is not)."""
    with _mu:
        _pending.pop(key, None)
        if fut.exception() is None:
            _cache[key] = (time.monotonic(), fut.result())
            _cache.move_to_end(key)
            while len(_cache) > CACHED:
                _cache.popitem(last=False)

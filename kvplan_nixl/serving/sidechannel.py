"""The connector's TCP side channel: a prefill rank's metadata and its hold control messages.

One request per connection, so that no connection outlives one exchange::

    server -> client   KVPSC1 <nonce: 32 hex> <identity: %-quoted>\\n      (the banner)
    client -> server   MD\\n
    server -> client   <u32 big-endian length> <metadata blob>
  or
    client -> server   <VERB> <req> <generation> <readers> <nonce echoed> <client nonce> <mac>\\n
    server -> client   YES|NO|LATER <mac>\\n   or   ERR <reason>\\n

``VERB`` is ``RELEASE`` (nobody will read the request: end its hold), ``RENEW`` (a decode's
heartbeat: extend the lease), ``CONFIRM`` (the read completed: was the request held the whole
time? yes counts as the reader's release; ``readers``, 0 for RELEASE and RENEW, is how many
decode ranks read this prefill rank, so the last one's CONFIRM ends the hold), ``LEASE`` (a
RENEW that also pins the hold for ``readers`` milliseconds: a RELEASE meanwhile is deferred,
so that the decode may report a read that completed inside the pin without waiting for its
CONFIRM) or ``RETURN`` (the CONFIRM of a reader that holds a LEASE, which it returns);
``req`` is %-quoted; the answers are :class:`~kvplan_nixl.serving.holds.Verdict` values (see
:mod:`kvplan_nixl.serving.holds`). A server older than LEASE and RETURN answers them ``ERR
malformed`` (an unknown verb) and acts on nothing: :func:`lease` raises
:class:`SideChannelRejected`, and its decode waits for the CONFIRM as before.

**Under a deployment secret** every control message carries ``mac`` = HMAC-SHA256, under a key
derived from the secret, over the receiver's identity (engine and rank), the verb, request,
generation, the server's nonce of this connection and the client's nonce; the answer carries an
HMAC over the answer and the request's mac. The server's nonce is fresh per connection (16
random bytes) and valid for the one message of that connection, so the replay window is the
connection itself: a recorded message verifies on no other connection (counted ``replayed``
when it echoes another nonce, ``forged`` when its mac is wrong, ``unsigned`` without one). The
client's nonce binds the answer to its question, so a host that took the port (or a recorded
answer) cannot say yes. Whatever does not verify or parse is counted and dropped, answered
``ERR`` and never acted on. **Without a secret** peers are trusted: anyone who reaches the port
can release or renew a request (the metadata is unsigned too; see docs/executor.md, "Trust
boundary"). The metadata is served to anyone: it is public, and signed under a secret.

**Bounded**: at most ``max_connections`` open (one more is closed at once), a request line of
at most ``max_line`` bytes (a longer one closes the connection), and a deadline per connection
for the whole exchange, so one thread with one selector serves any mix of slow, silent or
hostile clients in bounded memory. The clients bound what they read too (:data:`MAX_METADATA`,
the largest blob :func:`kvplan_nixl.metadata.decode` accepts) and run under one deadline.

**A spare connection** (:class:`Spares`): a decode may open a connection and read its banner
ahead of the message it will carry, so that the LEASE on a request's critical path is one
round trip, sent from the posting thread, instead of a connect, a banner and an answer from a
pool thread (docs/vllm.md, "Reporting inside a lease"). The protocol is unchanged: the server
sees a client that waited before sending its one line, within the same deadline.

Ports: :func:`side_channel_port`. Only the standard library and kvplan_nixl below the endpoint.
"""

from __future__ import annotations

import errno
import hmac
import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from urllib.parse import quote, unquote

from kvplan_nixl.errors import ArgumentError, ExecutorError
from kvplan_nixl.metadata import MAX_BLOB_BYTES, check_secret
from kvplan_nixl.serving.holds import MAX_PIN_S, Holds, Verdict
from kvplan_nixl.serving.locks import FairLock
from kvplan_nixl.serving.resolve import resolve

__all__ = [
    "MAX_METADATA", "VERBS", "PortInUseError", "SideChannelClosed", "SideChannelError",
    "SideChannelProtocolError", "SideChannelRejected", "SideChannelServer", "SideChannelTimeout",
    "confirm", "control",
    "fetch_metadata", "lease", "server_identity", "side_channel_port",
]

#: The control verbs (LEASE and RETURN: docs/vllm.md, "Reporting inside a lease").
VERBS = ("RELEASE", "RENEW", "CONFIRM", "LEASE", "RETURN")
#: The longest pin a LEASE may ask, in milliseconds (its ``readers`` field); longer is
#: malformed.
MAX_PIN_MS = int(MAX_PIN_S * 1000)
#: The most metadata bytes a client reads (a larger length prefix is refused unread).
MAX_METADATA = MAX_BLOB_BYTES
#: Request ids longer than this (UTF-8 bytes) are refused.
MAX_REQUEST_ID = 512
_BANNER = "KVPSC1"
_NONCE = 16
_LEN = struct.Struct("!I")
_KDF = b"kvplan_nixl side channel key\x00"
_MAC_REQ = b"request\x00"
_MAC_ANS = b"answer\x00"
_SEND_CHUNK = 1 << 20


class SideChannelError(ExecutorError, ConnectionError):
    """A side channel exchange with ``host:port`` failed (refused, reset, closed early)."""

    def __init__(self, message: str, host: str, port: int) -> None:
        self.host, self.port = host, port
        super().__init__(message)


class SideChannelTimeout(SideChannelError, TimeoutError):
    """The exchange with ``host:port`` did not complete within its deadline."""


class SideChannelClosed(SideChannelError):
    """``host:port`` closed the connection before its answer was complete: the server drops a
    connection whose request came after its per-connection deadline (a client starved on a
    loaded host), one over its connection cap, and every connection when its engine stops."""


class SideChannelProtocolError(SideChannelError):
    """``host:port`` answered outside the protocol: a length above the limit, a truncated
    blob, an answer whose mac does not verify, another service on the port."""


class SideChannelRejected(SideChannelError):
    """``host:port`` refused the message (``ERR <reason>``: unsigned, forged, malformed, or
    the port serves another engine rank than the one addressed); ``reason`` is its word."""

    def __init__(self, message: str, host: str, port: int, reason: str) -> None:
        self.reason = reason
        super().__init__(message, host, port)


class PortInUseError(ExecutorError, OSError):
    """The side channel port is taken (``EADDRINUSE``); the message names the port and the
    config key to change."""

    def __init__(self, message: str, host: str, port: int) -> None:
        self.host, self.port = host, port
        super().__init__(message)
        self.errno = errno.EADDRINUSE


def side_channel_port(base: int, tp_rank: int, tp_size: int, dp_rank: int = 0) -> int:
    """The port of one worker's side channel: ``base + dp_rank * tp_size + tp_rank``.

    ``base`` is ``kv_connector_extra_config["side_channel_port"]``; every (data-parallel,
    tensor-parallel) rank of an engine gets its own port, ``dp_size * tp_size`` ports from
    ``base`` in all, so engines on one host need bases at least that far apart.
    """
    for name, v, low in (("side_channel_port", base, 1), ("tp_size", tp_size, 1),
                         ("tp_rank", tp_rank, 0), ("dp_rank", dp_rank, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ArgumentError(f"{name} must be an int >= {low}, got {v!r}")
    if tp_rank >= tp_size:
        raise ArgumentError(f"tp_rank must be < tp_size {tp_size}, got {tp_rank}")
    port = base + dp_rank * tp_size + tp_rank
    if port > 65535:
        raise ArgumentError(
            f"side_channel_port {base} + dp_rank {dp_rank} * tp_size {tp_size} + tp_rank "
            f"{tp_rank} = {port} is above 65535: choose a lower side_channel_port")
    return port


def server_identity(engine: str, tp_rank: int) -> str:
    """The identity a prefill rank's server is created with, and that its clients address:
    the engine id and the rank (every control message's mac covers it)."""
    return f"{engine}#{tp_rank}"


# -- the codec (both sides) -------------------------------------------------------------------

def _key(secret: bytes | None) -> bytes | None:
    return None if secret is None else hmac.digest(secret, _KDF, "sha256")


def _request_mac(key: bytes, identity: str, fields: list[str]) -> bytes:
    who = identity.encode()
    data = _MAC_REQ + _LEN.pack(len(who)) + who + " ".join(fields).encode()
    return hmac.digest(key, data, "sha256")


def _answer_mac(key: bytes, answer: str, request_mac: bytes) -> bytes:
    return hmac.digest(key, _MAC_ANS + answer.encode() + b" " + request_mac, "sha256")


def _is_hex(s: str, n: int) -> bool:
    return len(s) == n and all(c in "0123456789abcdef" for c in s)


def _parse_control(parts: list[str]) -> tuple[str, str, int, int] | None:
    """(verb, request, generation, readers) of a control line's fields, or None if
    malformed."""
    if len(parts) != 7 or parts[0] not in VERBS:
        return None
    verb, req_q, gen, readers, ns, nc, mac = parts
    if not (gen.isascii() and gen.isdigit() and len(gen) <= 19 and int(gen) < 1 << 63):
        return None
    if not (readers.isascii() and readers.isdigit() and len(readers) <= 6):
        return None
    # LEASE's field is its pin in ms (> 0); the others' a reader count below 10**4
    if not (0 < int(readers) <= MAX_PIN_MS if verb == "LEASE" else int(readers) < 10**4):
        return None
    if not (_is_hex(ns, 2 * _NONCE) and _is_hex(nc, 2 * _NONCE)
            and (mac == "-" or _is_hex(mac, 64))) or len(req_q) > 3 * MAX_REQUEST_ID:
        return None
    try:
        req = unquote(req_q, errors="strict")
    except UnicodeDecodeError:
        return None
    if not req or len(req.encode()) > MAX_REQUEST_ID:
        return None
    return verb, req, int(gen), int(readers)


# -- the server -------------------------------------------------------------------------------

class _Conn:
    __slots__ = ("deadline", "inbuf", "mask", "nonce", "out", "reading", "sent", "sock")

    def __init__(self, sock: socket.socket, deadline: float, nonce: bytes, out: bytes) -> None:
        self.sock, self.deadline, self.nonce = sock, deadline, nonce
        self.inbuf = bytearray()
        self.out: memoryview = memoryview(out)
        self.sent = 0
        self.mask = selectors.EVENT_READ | selectors.EVENT_WRITE
        self.reading = True  # False once the request line arrived: answer, then close


class SideChannelServer:
    """One prefill worker rank's side channel (see the module docstring), on its own thread.

    ``identity``: :func:`server_identity` of the rank. ``holds`` answers the control messages,
    called under ``lock`` (the one every user of ``holds`` takes; a new one if not given);
    without ``holds`` they are refused. ``port`` 0 picks a free port (read :attr:`port`).
    A taken port raises :class:`PortInUseError`. Use as a context manager or call
    :meth:`close`.
    """

    def __init__(self, host: str, port: int, identity: str, *, metadata: bytes = b"",
                 secret: bytes | str | None = None, holds: Holds | None = None,
                 lock: threading.Lock | FairLock | None = None, max_connections: int = 64,
                 max_line: int = 2048, deadline_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(identity, str) or not identity:
            raise ArgumentError(f"identity must be a non-empty str, got {identity!r}")
        if max_connections < 1 or max_line < 64 or not deadline_s > 0:
            raise ArgumentError("max_connections >= 1, max_line >= 64 and deadline_s > 0 "
                                f"needed, got {max_connections}, {max_line}, {deadline_s}")
        self.identity, self.holds = identity, holds
        self.lock = lock if lock is not None else threading.Lock()
        self._key = _key(check_secret(secret))
        self.max_connections, self.max_line, self.deadline_s = max_connections, max_line, \
            deadline_s
        self._clock = clock
        self._md = b""
        self.set_metadata(metadata)
        #: what happened: connections accepted / closed at once over the cap / past their
        #: deadline / with a line over max_line; messages malformed, unsigned, forged,
        #: replayed (dropped), metadata served, control messages acted on
        self.stats = dict.fromkeys(("accepted", "rejected", "timeouts", "oversized",
                                    "malformed", "unsigned", "forged", "replayed", "metadata",
                                    "control"), 0)
        self._sock = _bind(host, port)
        self.host, self.port = host, self._sock.getsockname()[1]
        self._banner = f"{_BANNER} {{}} {quote(identity, safe='')}\n"
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel = selectors.DefaultSelector()
        self._conns: dict[socket.socket, _Conn] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"kvplan-side-channel-{self.port}")
        self._thread.start()

    def set_metadata(self, blob: bytes) -> None:
        """Serve ``blob`` (``Endpoint.metadata()``) from now on."""
        if not isinstance(blob, (bytes, bytearray)) or len(blob) > MAX_METADATA:
            raise ArgumentError(f"metadata must be bytes of at most {MAX_METADATA}, got "
                                f"{type(blob).__name__} of {len(blob)}")
        self._md = _LEN.pack(len(blob)) + bytes(blob)

    @property
    def connections(self) -> int:
        """Connections open now."""
        return len(self._conns)

    def close(self) -> None:
        """Stop the thread, close every connection and the listening socket. Idempotent."""
        if self._stop:
            return
        self._stop = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout=10)
        for s in (self._sock, self._wake_r, self._wake_w):
            s.close()

    def __enter__(self) -> SideChannelServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the loop (its own thread) ------------------------------------------------------------

    def _loop(self) -> None:
        sel = self._sel
        self._sock.setblocking(False)
        sel.register(self._sock, selectors.EVENT_READ, "listen")
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        try:
            while not self._stop:
                now = self._clock()
                nearest = min((c.deadline for c in self._conns.values()), default=now + 1.0)
                for key, mask in sel.select(max(0.0, min(nearest - now, 1.0))):
                    if key.data == "listen":
                        self._accept()
                    elif key.data == "conn":
                        self._serve(self._conns[key.fileobj], mask)
                now = self._clock()
                for c in [c for c in self._conns.values() if c.deadline <= now]:
                    self.stats["timeouts"] += 1  # a slow or silent client: its slot is freed
                    self._drop(c)
        finally:
            for c in list(self._conns.values()):
                self._drop(c)
            sel.close()

    def _accept(self) -> None:
        for _ in range(64):  # then serve the others: a flood of connects cannot starve them
            try:
                sock, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # e.g. EMFILE: the connection stays in the backlog, retried
                return
            if len(self._conns) >= self.max_connections:
                self.stats["rejected"] += 1
                sock.close()
                continue
            self.stats["accepted"] += 1
            sock.setblocking(False)
            nonce = os.urandom(_NONCE)
            c = _Conn(sock, self._clock() + self.deadline_s, nonce,
                      self._banner.format(nonce.hex()).encode())
            self._conns[sock] = c
            self._sel.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, "conn")

    def _serve(self, c: _Conn, mask: int) -> None:
        try:
            if mask & selectors.EVENT_WRITE and c.sent < len(c.out):
                c.sent += c.sock.send(c.out[c.sent:c.sent + _SEND_CHUNK])
            if mask & selectors.EVENT_READ and c.reading:
                data = c.sock.recv(self.max_line + 1 - len(c.inbuf))
                if not data:
                    self._drop(c)
                    return
                c.inbuf += data
                end = c.inbuf.find(b"\n")
                if end < 0 and len(c.inbuf) >= self.max_line:
                    self.stats["oversized"] += 1  # dropped unread: memory stays bounded
                    self._drop(c)
                    return
                if end >= 0:
                    c.reading = False
                    rest = c.out[c.sent:]  # the banner's unsent tail, if any
                    c.out, c.sent = memoryview(bytes(rest) + self._answer(c, bytes(
                        c.inbuf[:end]))), 0
                    c.inbuf = bytearray()
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # reset by the peer
            self._drop(c)
            return
        if c.sent >= len(c.out) and not c.reading:
            self._drop(c)  # answered: one exchange per connection
            return
        mask = selectors.EVENT_READ if c.sent >= len(c.out) else selectors.EVENT_WRITE
        if c.reading and c.sent < len(c.out):
            mask |= selectors.EVENT_READ
        if mask != c.mask:
            c.mask = mask
            self._sel.modify(c.sock, mask, "conn")

    def _drop(self, c: _Conn) -> None:
        if self._conns.pop(c.sock, None) is not None:
            self._sel.unregister(c.sock)
            c.sock.close()

    def _answer(self, c: _Conn, line: bytes) -> bytes:
        """The answer to one request line (its verdict acted on only once it verified)."""
        try:
            parts = line.decode("ascii").rstrip("\r").split(" ")
        except UnicodeDecodeError:
            parts = []
        if parts == ["MD"]:
            self.stats["metadata"] += 1
            return self._md
        parsed = _parse_control(parts)
        if parsed is None:
            return self._refuse("malformed")
        verb, req, gen, readers = parsed
        mac = b""
        if self._key is not None:
            if parts[6] == "-":
                return self._refuse("unsigned")
            if parts[4] != c.nonce.hex():  # made for another connection: a replay
                return self._refuse("replayed")
            mac = _request_mac(self._key, self.identity, parts[:6])
            if not hmac.compare_digest(mac, bytes.fromhex(parts[6])):
                return self._refuse("forged")
        if self.holds is None:
            return b"ERR no-holds\n"
        now = self._clock()
        with self.lock:
            if verb in ("CONFIRM", "RETURN"):
                v = self.holds.verdict(req, gen, now)
                if v is not Verdict.LATER:  # LATER is asked again: not counted as refused
                    v = Verdict.YES if self.holds.confirm(
                        req, gen, now, readers, leased=verb == "RETURN") else Verdict.NO
            elif verb == "LEASE":
                v = self.holds.lease(req, gen, now, readers / 1000)
            elif verb == "RENEW":
                v = self.holds.verdict(req, gen, now)
                if v is Verdict.YES and not self.holds.renew(req, gen, now):
                    v = Verdict.NO  # released under a pin: it ends at the pin's end
            else:
                v = Verdict.YES if self.holds.release(req, gen, now) else Verdict.NO
        self.stats["control"] += 1
        tag = "-" if self._key is None else _answer_mac(self._key, v.value, mac).hex()
        return f"{v.value} {tag}\n".encode()

    def _refuse(self, why: str) -> bytes:
        self.stats[why] += 1
        return f"ERR {why}\n".encode()


def _bind(host: str, port: int) -> socket.socket:
    try:
        return socket.create_server((host, port), backlog=128)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise PortInUseError(
                f"side channel port {port} on {host} is already in use: another engine (or one "
                "still shutting down) listens there; give this engine another "
                "kv_connector_extra_config['side_channel_port'] (rank ports are base + "
                "dp_rank * tp_size + tp_rank)", host, port) from e
        if e.errno == errno.EADDRNOTAVAIL:
            raise SideChannelError(
                f"cannot listen on {host}:{port}: {host} is not an address of this host; set "
                "kv_connector_extra_config['side_channel_host'] (or VLLM_HOST_IP)",
                host, port) from e
        raise SideChannelError(f"cannot listen on {host}:{port}: {e}", host, port) from e


# -- the clients ------------------------------------------------------------------------------

class _Client:
    """One connection to ``host:port`` under one deadline for everything it does."""

    def __init__(self, host: str, port: int, timeout: float, what: str) -> None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
                or not 0 < timeout < 1e6:
            raise ArgumentError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        self.host, self.port, self.what = host, port, what
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout
        self._buf = bytearray()  # received, not consumed yet
        try:  # the name resolved under the deadline too (a request may name the host)
            family, kind, proto, _, addr = resolve(host, port, self.deadline)
            sock = socket.socket(family, kind, proto)
            try:
                sock.settimeout(max(1e-3, self.deadline - time.monotonic()))
                sock.connect(addr)
            except BaseException:
                sock.close()
                raise
            self.sock = sock
        except TimeoutError as e:  # ResolveTimeout included
            raise self._timeout("resolving or connecting") from e
        except OSError as e:
            raise SideChannelError(
                f"side channel {host}:{port} ({what}): cannot connect ({e}); is the prefill "
                "rank up, and do both engines use the same side_channel_port formula?",
                host, port) from e

    def __enter__(self) -> _Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def _timeout(self, doing: str) -> SideChannelTimeout:
        return SideChannelTimeout(f"side channel {self.host}:{self.port} ({self.what}): no "
                                  f"answer within {self.timeout:g} s ({doing})",
                                  self.host, self.port)

    def _recv_into(self, view: memoryview, doing: str) -> int:
        # Past the deadline, what already came is still taken (a non-blocking read): this
        # thread may have been held up (a busy process: the GIL) while the answer waited in
        # the socket, and that is no silent peer. Seen in CI: both ranks of a decode, busy
        # with their first step, timed out on a banner and on a CONFIRM's answer.
        self.sock.settimeout(max(0.0, self.deadline - time.monotonic()))
        try:
            n = self.sock.recv_into(view)
        except (TimeoutError, BlockingIOError) as e:
            raise self._timeout(doing) from e
        except OSError as e:
            raise SideChannelError(f"side channel {self.host}:{self.port} ({self.what}): "
                                   f"{e} ({doing})", self.host, self.port) from e
        if n == 0:
            raise SideChannelClosed(f"side channel {self.host}:{self.port} ({self.what}): "
                                   f"closed the connection ({doing})", self.host, self.port)
        return n

    def exact(self, n: int, doing: str) -> bytes:
        buf = bytearray(n)
        got = min(n, len(self._buf))
        buf[:got], self._buf = self._buf[:got], self._buf[got:]
        view = memoryview(buf)
        while got < n:
            got += self._recv_into(view[got:], doing)
        return bytes(buf)

    def line(self, limit: int, doing: str) -> str:
        """One line (without its newline) of at most ``limit`` bytes. Read in chunks: the
        server sends nothing past a line until it got our next message (or it closes), so
        what follows the newline is kept for :meth:`exact`."""
        chunk = bytearray(4096)
        while (end := self._buf.find(b"\n")) < 0:
            if len(self._buf) > limit:
                raise self.protocol(f"a line longer than {limit} bytes ({doing})")
            n = self._recv_into(memoryview(chunk), doing)
            self._buf += chunk[:n]
        if end > limit:
            raise self.protocol(f"a line longer than {limit} bytes ({doing})")
        out, self._buf = self._buf[:end], self._buf[end + 1:]
        try:
            return out.decode("ascii")
        except UnicodeDecodeError as e:
            raise self.protocol(f"a line that is not ASCII ({doing})") from e

    def send(self, data: bytes) -> None:
        self.sock.settimeout(max(1e-3, self.deadline - time.monotonic()))
        try:
            self.sock.sendall(data)
        except TimeoutError as e:
            raise self._timeout("sending") from e
        except OSError as e:
            raise SideChannelError(f"side channel {self.host}:{self.port} ({self.what}): "
                                   f"{e} (sending)", self.host, self.port) from e

    def protocol(self, what: str) -> SideChannelProtocolError:
        return SideChannelProtocolError(
            f"side channel {self.host}:{self.port} ({self.what}) answered outside the "
            f"protocol: {what}; is another service on the port?", self.host, self.port)

    def banner(self, identity: str | None) -> str:
        """The server's nonce; checks it serves ``identity`` (if given)."""
        parts = self.line(3 * 256 + 64, "reading the banner").split(" ")
        if len(parts) != 3 or parts[0] != _BANNER or not _is_hex(parts[1], 2 * _NONCE):
            raise self.protocol(f"banner {' '.join(parts)[:80]!r}")
        served = unquote(parts[2])
        if identity is not None and served != identity:
            raise SideChannelRejected(
                f"side channel {self.host}:{self.port} serves {served!r}, not {identity!r}: "
                "the engines disagree on the port formula (base + dp_rank * tp_size + tp_rank) "
                "or the params name another engine", self.host, self.port, "identity")
        return parts[1]


def fetch_metadata(host: str, port: int, *, timeout: float = 5.0,
                   limit: int = MAX_METADATA, identity: str | None = None) -> bytes:
    """A prefill rank's metadata blob, read within ``timeout`` seconds in all; a length prefix
    above ``limit`` is refused before a byte of the blob is read. ``identity``: check the
    port serves that rank (:func:`server_identity`)."""
    with _Client(host, port, timeout, "metadata") as c:
        c.banner(identity)
        c.send(b"MD\n")
        (n,) = _LEN.unpack(c.exact(_LEN.size, "reading the metadata length"))
        if n > limit:
            raise c.protocol(f"a metadata length of {n} bytes, above the limit of {limit}")
        return c.exact(n, f"reading {n} bytes of metadata")


def control(host: str, port: int, verb: str, req: str, generation: int, *, identity: str,
            secret: bytes | str | None = None, timeout: float = 5.0,
            readers: int = 0) -> Verdict:
    """Send one control message (``verb`` of :data:`VERBS`) to the rank ``identity`` at
    ``host:port`` and return its verdict, within ``timeout`` seconds. Under ``secret`` the
    message is signed and the answer checked. Raises :class:`SideChannelRejected` on ``ERR``.
    ``readers`` (CONFIRM, RETURN): decode ranks that read this prefill rank (0: not counted);
    for LEASE the pin in milliseconds (use :func:`lease`).
    """
    if verb not in VERBS:
        raise ArgumentError(f"verb must be one of {VERBS}, got {verb!r}")
    low, high = (1, MAX_PIN_MS + 1) if verb == "LEASE" else (0, 10**4)
    if isinstance(readers, bool) or not isinstance(readers, int) or not low <= readers < high:
        raise ArgumentError(f"readers must be an int in [{low}, {high}) for {verb}, got "
                            f"{readers!r}")
    if not isinstance(req, str) or not req or len(req.encode()) > MAX_REQUEST_ID:
        raise ArgumentError(f"req must be a non-empty str of at most {MAX_REQUEST_ID} bytes, "
                            f"got {req!r:.80}")
    if isinstance(generation, bool) or not isinstance(generation, int) \
            or not 0 <= generation < 1 << 63:
        raise ArgumentError(f"generation must be an int in [0, 2**63), got {generation!r}")
    with _Client(host, port, timeout, f"{verb} {req}") as c:
        nonce = c.banner(identity)
        return _ask(c, nonce, verb, req, generation, readers, identity, secret).verdict()


class _Asked:
    """A control message sent on ``client``, its answer not read yet."""

    def __init__(self, client: _Client, verb: str, req: str, key: bytes | None,
                 mac: bytes) -> None:
        self.client, self.verb, self.req, self.key, self.mac = client, verb, req, key, mac

    def verdict(self) -> Verdict:
        """Read and check the answer (raises as :func:`control`)."""
        c, verb, key = self.client, self.verb, self.key
        parts = c.line(256, f"reading the answer to {verb}").split(" ")
        if parts[0] == "ERR":
            why = parts[1] if len(parts) > 1 else "?"
            hint = {"unsigned": ": give this engine the deployment's secret too",
                    "forged": ": the engines have different secrets",
                    "no-holds": ": the rank holds no requests (is it a prefill?)"}.get(why, "")
            raise SideChannelRejected(f"side channel {c.host}:{c.port} refused {verb} "
                                      f"{self.req}: {why}{hint}", c.host, c.port, why)
        try:
            v = Verdict(parts[0])
        except ValueError:
            raise c.protocol(f"answer {' '.join(parts)[:80]!r}") from None
        if key is not None and (len(parts) != 2 or not _is_hex(parts[1], 64) or not
                                hmac.compare_digest(_answer_mac(key, v.value, self.mac),
                                                    bytes.fromhex(parts[1]))):
            raise c.protocol(f"an answer to {verb} whose mac does not verify (not the "
                             "prefill rank, or another secret)")
        return v


def _ask(c: _Client, nonce: str, verb: str, req: str, generation: int, readers: int,
         identity: str, secret: bytes | str | None) -> _Asked:
    """Send one control message on ``c``, whose banner gave ``nonce`` (signed under
    ``secret``); its answer is read by :meth:`_Asked.verdict`."""
    key = _key(check_secret(secret))
    fields = [verb, quote(req, safe=""), str(generation), str(readers), nonce,
              os.urandom(_NONCE).hex()]
    mac = b"" if key is None else _request_mac(key, identity, fields)
    c.send((" ".join([*fields, mac.hex() or "-"]) + "\n").encode())
    return _Asked(c, verb, req, key, mac)


def confirm(host: str, port: int, req: str, generation: int, *, identity: str,
            secret: bytes | str | None = None, timeout: float = 5.0,
            retry_s: float = 0.005, readers: int = 0, leased: bool = False) -> bool:
    """CONFIRM a completed read: True only on the prefill's YES. LATER (the hold has not
    reached that worker yet) is asked again every ``retry_s`` until ``timeout`` has passed
    in all, then False. Transport and protocol errors raise (a caller treats them as not
    confirmed: the pull goes to the failure policy). ``readers``: see :func:`control`.
    ``leased``: this reader holds a LEASE of the hold (sent as RETURN, which returns it)."""
    end = time.monotonic() + timeout
    while True:
        left = end - time.monotonic()
        v = control(host, port, "RETURN" if leased else "CONFIRM", req, generation,
                    identity=identity, secret=secret, timeout=max(left, 1e-3),
                    readers=readers)
        if v is not Verdict.LATER:
            return v is Verdict.YES
        if end - time.monotonic() <= retry_s:
            return False
        time.sleep(retry_s)



def _pin_ms(pin_s: float) -> int:
    ms = int(pin_s * 1000) if isinstance(pin_s, (int, float)) and pin_s == pin_s else 0
    if isinstance(pin_s, bool) or not 1 <= ms <= MAX_PIN_MS:
        raise ArgumentError(f"pin_s must be a number of seconds in [0.001, {MAX_PIN_S:g}], "
                            f"got {pin_s!r}")
    return ms


class SentLease:
    """A LEASE sent on a spare connection (:func:`send_lease`), its answer still to read:
    pass it to :func:`lease` as ``first``. ``sent``: the ``time.monotonic()`` taken just
    before it left."""

    def __init__(self, asked: _Asked, sent: float) -> None:
        self.asked, self.sent = asked, sent

    def close(self) -> None:
        """Drop it unread (its pin, if granted, runs out on the prefill)."""
        self.asked.client.sock.close()


def send_lease(spare: _Client, nonce: str, req: str, generation: int, pin_s: float, *,
               identity: str, secret: bytes | str | None = None) -> SentLease:
    """Send ``req``'s LEASE on ``spare`` (a connection from :meth:`Spares.take`, whose
    banner gave ``nonce``) now, without waiting for its answer: the caller's thread pays one
    ``send``, and the answer is read by :func:`lease` (``first``) on another thread. Errors
    raise as :func:`control`'s; the connection is closed then."""
    ms = _pin_ms(pin_s)
    sent = time.monotonic()  # before the message leaves: the pin starts after it
    try:
        return SentLease(_ask(spare, nonce, "LEASE", req, generation, ms, identity, secret),
                         sent)
    except BaseException:
        spare.sock.close()
        raise


def lease(host: str, port: int, req: str, generation: int, pin_s: float, *, identity: str,
          secret: bytes | str | None = None, timeout: float = 5.0,
          retry_s: float = 0.005, first: SentLease | None = None) -> tuple[Verdict, float]:
    """LEASE ``req``: renew its hold and pin it for ``pin_s`` seconds (rounded down to the
    millisecond). Returns the verdict and the client's ``time.monotonic()`` taken just before
    the attempt that got it was sent: a YES promises the hold until at least that time plus
    the pin, measured on the prefill's clock (the decode allows for the two clocks' rates).
    LATER is asked again every ``retry_s`` until ``timeout``, then returned. Errors raise as
    :func:`control`'s; a server older than LEASE raises :class:`SideChannelRejected` with the
    reason ``malformed``. ``first``: the same LEASE already sent on a spare connection
    (:func:`send_lease`), whose answer is read first; a spare the server closed unanswered
    (it ended its deadline, or the prefill restarted) is sent again on a new connection."""
    ms = _pin_ms(pin_s)
    end = time.monotonic() + timeout
    if first is not None:
        try:
            first.asked.client.deadline = end
            v = first.asked.verdict()
            if v is not Verdict.LATER or end - time.monotonic() <= retry_s:
                return v, first.sent
            time.sleep(retry_s)
        except SideChannelError as e:
            # closed or reset before it answered (the server dropped the spare at its
            # deadline, or the prefill restarted): it acted on nothing, so it is sent again
            if isinstance(e, (SideChannelTimeout, SideChannelRejected,
                              SideChannelProtocolError)):
                raise
        finally:
            first.close()
    while True:
        sent = time.monotonic()  # before the message leaves: the pin starts after it
        v = control(host, port, "LEASE", req, generation, identity=identity, secret=secret,
                    timeout=max(end - sent, 1e-3), readers=ms)
        if v is not Verdict.LATER or end - time.monotonic() <= retry_s:
            return v, sent
        time.sleep(retry_s)


#: A spare connection is used only this young (s): the server drops a connection silent past
#: its deadline (``deadline_s``, 5 s by default), and a spare is taken well before that.
SPARE_S = 2.0


class Spares:
    """Connections to prefill ranks opened ahead of the message they will carry, at most one
    per (host, port, identity), their banner read and checked (see the module docstring).
    Thread-safe: :meth:`fill` runs on a pool thread, :meth:`take` on the posting one.

    A spare is opened after a message to the same rank (:meth:`fill`) and taken by the next
    one within :data:`SPARE_S`; older ones are closed, unused. The server drops a spare left
    unused at its deadline (counted there as a timeout), so a decode holds at most one idle
    connection per prefill rank it talks to, for at most that long."""

    def __init__(self, max_age: float = SPARE_S, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.max_age, self._clock = max_age, clock
        self._lock = threading.Lock()
        self._spares: dict[tuple[str, int, str], tuple[_Client, str, float]] = {}
        self._closed = False

    def take(self, host: str, port: int, identity: str) -> tuple[_Client, str] | None:
        """A spare to ``identity`` at ``host:port`` and its banner's nonce, or None (none,
        or too old: closed)."""
        with self._lock:
            got = self._spares.pop((host, port, identity), None)
        if got is None:
            return None
        c, nonce, opened = got
        if self._clock() - opened > self.max_age:
            c.sock.close()
            return None
        return c, nonce

    def fill(self, host: str, port: int, identity: str, timeout: float) -> None:
        """Open a spare to ``identity`` at ``host:port`` (blocking: connect and banner,
        within ``timeout``), replacing an older one; nothing when one younger than half
        ``max_age`` is there (the several LEASEs of one step each ask for a spare). Errors
        raise as :func:`control`'s; none is kept then."""
        with self._lock:
            kept = self._spares.get((host, port, identity))
            if kept is not None and self._clock() - kept[2] < self.max_age / 2:
                return
        c = _Client(host, port, timeout, "a spare connection")
        try:
            nonce = c.banner(identity)
        except BaseException:
            c.sock.close()
            raise
        with self._lock:
            if self._closed:
                old = (c, nonce, 0.0)
            else:
                old = self._spares.pop((host, port, identity), None)
                self._spares[host, port, identity] = (c, nonce, self._clock())
        if old is not None:
            old[0].sock.close()

    def __len__(self) -> int:
        with self._lock:
            return len(self._spares)

    def close(self) -> None:
        """Close every spare; later :meth:`fill` calls keep none."""
        with self._lock:
            spares, self._spares, self._closed = list(self._spares.values()), {}, True
        for c, _, _ in spares:
            c.sock.close()

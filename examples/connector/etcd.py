"""A throw-away etcd server and a tiny client of etcd's v3 JSON gateway (urllib, no deps).

The gateway takes POSTs of JSON to ``/v3/kv/put`` and ``/v3/kv/range``, with keys and values
base64-encoded.
"""

from __future__ import annotations

import base64
import contextlib
import json
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator


class Etcd:
    """Client of one etcd server: byte keys and values, prefix reads."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def _call(self, op: str, **fields: bytes) -> dict:
        body = json.dumps({k: base64.b64encode(v).decode() for k, v in fields.items()})
        with urllib.request.urlopen(f"{self.url}/v3/kv/{op}", body.encode(), timeout=5) as r:
            return json.loads(r.read())

    def put(self, key: str, value: bytes) -> None:
        self._call("put", key=key.encode(), value=value)

    def prefix(self, prefix: str) -> dict[str, bytes]:
        """Every key under ``prefix`` (the range [prefix, prefix with its last byte + 1))."""
        p = prefix.encode()
        kvs = self._call("range", key=p, range_end=p[:-1] + bytes([p[-1] + 1])).get("kvs", [])
        return {base64.b64decode(kv["key"]).decode(): base64.b64decode(kv.get("value", ""))
                for kv in kvs}

    def wait(self, prefix: str, count: int, timeout: float = 60.0) -> dict[str, bytes]:
        """Poll until ``count`` keys lie under ``prefix`` (through a server still starting)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                if len(got := self.prefix(prefix)) >= count:
                    return got
            time.sleep(0.02)
        raise TimeoutError(f"etcd {self.url}: no {count} keys under {prefix!r}")


def _url() -> str:
    """``http://127.0.0.1:PORT``, a port free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@contextlib.contextmanager
def etcd_server() -> Iterator[str]:
    """``with etcd_server() as url:`` runs ``etcd`` on free loopback ports in a temporary data
    dir (its errors on our stderr); on exit kills it and removes the dir."""
    with tempfile.TemporaryDirectory(prefix="kvplan-etcd-") as tmp:
        client, peer = _url(), _url()
        proc = subprocess.Popen(
            ["etcd", "--name", "kvplan", "--data-dir", tmp, "--logger=zap", "--log-level=error",
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"kvplan={peer}"], stdout=subprocess.DEVNULL)
        try:
            Etcd(client).wait("/", 0, timeout=30)
            yield client
        finally:
            proc.kill()
            proc.wait()

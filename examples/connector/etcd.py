"""A throw-away etcd server and a tiny client over etcd's v3 JSON gateway (urllib, no deps).

The gateway takes POSTs of JSON to ``/v3/kv/put`` and ``/v3/kv/range``, with keys and values
base64-encoded.
"""

from __future__ import annotations

import base64
import contextlib
import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Etcd:
    """Client of one etcd server: byte keys and values, prefix reads."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def _call(self, op: str, body: dict) -> dict:
        req = urllib.request.Request(f"{self.url}/v3/kv/{op}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read())

    def put(self, key: str, value: bytes) -> None:
        self._call("put", {"key": _b64(key.encode()), "value": _b64(value)})

    def prefix(self, prefix: str) -> dict[str, bytes]:
        """Every key under ``prefix`` (the range [prefix, prefix with its last byte + 1))."""
        p = prefix.encode()
        end = p[:-1] + bytes([p[-1] + 1])
        kvs = self._call("range", {"key": _b64(p), "range_end": _b64(end)}).get("kvs", [])
        return {base64.b64decode(kv["key"]).decode(): base64.b64decode(kv.get("value", ""))
                for kv in kvs}

    def wait(self, prefix: str, count: int, timeout: float = 60.0) -> dict[str, bytes]:
        """Poll until ``count`` keys lie under ``prefix`` (through a server still starting)."""
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError):
                if len(got := self.prefix(prefix)) >= count:
                    return got
            if time.monotonic() > deadline:
                raise TimeoutError(f"etcd {self.url}: no {count} keys under {prefix!r}")
            time.sleep(0.02)


class EtcdServer:
    """``with EtcdServer() as url:`` runs etcd (``shutil.which("etcd")``) on free loopback
    ports in a temporary data dir; on exit kills it and removes the dir."""

    def __enter__(self) -> str:
        self.dir = tempfile.mkdtemp(prefix="kvplan-etcd-")
        client, peer = f"http://127.0.0.1:{_free_port()}", f"http://127.0.0.1:{_free_port()}"
        with open(f"{self.dir}/etcd.log", "wb") as log:
            self.proc = subprocess.Popen(
                ["etcd", "--name", "kvplan", "--data-dir", f"{self.dir}/data",
                 "--listen-client-urls", client, "--advertise-client-urls", client,
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", f"kvplan={peer}", "--logger", "zap", "--log-level", "warn"],
                stdout=log, stderr=subprocess.STDOUT)
        try:
            Etcd(client).wait("/", 0, timeout=30)
        except TimeoutError:
            self.proc.kill()  # the data dir stays, for its log
            raise RuntimeError(f"etcd did not start; see {self.dir}/etcd.log") from None
        return client

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

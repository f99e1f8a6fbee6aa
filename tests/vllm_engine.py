"""One vLLM engine as a child process of the real-engine tests (run by the vLLM venv's python).

``python tests/vllm_engine.py model DIR`` writes the tiny random Llama (or ``--mla``: a tiny
DeepSeek-V2-shaped model) as safetensors; ``python tests/vllm_engine.py serve --model DIR ...``
starts an engine and answers one JSON request per stdin line with one result line on stdout,
prefixed by :data:`MARK` (vLLM's own logs go to the same streams)::

    {"id": "a", "prompt": [1, 2, 3], "max_tokens": 16, "params": {...} | null}
    @@kvplan {"id": "a", "tokens": [...], "params": {...}, "finish": "length", "error": null}

``{"id": "b", "batch": [request, ...]}`` runs its requests together in one engine (each with a
``seconds`` of its own: when it finished, and a ``first``: when its first token came, both from
the batch's start), answered by one line with ``"results"``; ``{"id": "m", "op": "metrics"}``
answers the engine's Prometheus metrics whose names start with ``"prefix"`` (default
``vllm:kvplan``; ``--log-stats``) and logs vLLM's stats line now; ``{"id": "k", "op": "dump",
"path": DIR}`` writes every worker's KV cache to ``DIR/rank<r>.npz`` (:func:`dump_kv`);
``{"id": "d", "op": "drafts"}`` (``--speculative``) answers the draft token ids the drafter
proposed since the last such op, ``"drafts": [[request id, [token, ...]], ...]`` one per
request and step (rank 0's record, :func:`record_drafts`), and clears them.

The engine uses ``KvplanConnector`` (``--connector kvplan``), vLLM's own ``NixlConnector``
(``--connector nixl``, for comparison) or none. The main guard matters: vLLM
spawns its engine processes, which re-import this file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

MARK = "@@kvplan "
#: ``handshake_timeout_s`` of the tests' KvplanConnector engines (here and in
#: tests/test_vllm_http.py). CI's two cores run three engines, and NIXL progress threads that
#: spin: a metadata fetch past the default 5 s twice in a row failed a pull there (the test then
#: saw a recompute); two tries of 8 s still end within the 20 s transfer_timeout_s, which bounds
#: a handshake.
HANDSHAKE_TIMEOUT_S = 8.0


#: The tiny models the tests write (``model DIR --kind KIND``).
KINDS = ("llama", "llama-deep", "mla", "nemotron-h", "gemma3", "llama-eagle3", "mla-eagle3")


def model_config(kind: str, *, n_groups: int = 1) -> dict:
    """config.json of a tiny float32 model of ``kind`` (vocab 1024, hidden 256).

    - ``llama``: 2 layers, 4 heads, 2 KV heads of 64.
    - ``llama-deep``: 16 layers, 4 heads, 4 KV heads of 64 (32 KiB of KV per token: the
      benchmarks' model, where a transfer is visible beside the compute).
    - ``mla``: DeepSeek-V2 shape, latent 512 + 64 = 576 values per token (the only size vLLM's
      CPU_MLA backend takes, ``cpu_mla.py``, ``get_supported_head_sizes``), dense MLPs.
    - ``nemotron-h``: a Mamba2 hybrid (NemotronH), layers mamba, attention, mamba; Mamba2 of
      8 heads x 32 with ``n_groups`` B/C groups of state 16, conv kernel 4.
    - ``gemma3``: Gemma 3 text, a sliding-window layer (window 32) then a full-attention layer:
      two KV-cache groups under vLLM's hybrid manager.
    - ``llama-eagle3``: a Llama of 4 layers, 4 heads, 4 KV heads of 64; its draft
      (:func:`eagle3_config`) is written beside it.
    - ``mla-eagle3``: ``mla`` with 4 layers in bfloat16 (an MLA main model needs AMX and
      bfloat16 on vLLM's CPU build beside a CPU_ATTN draft), the same draft beside it.
    """
    common = {"hidden_size": 256, "vocab_size": 1024, "max_position_embeddings": 2048,
              "torch_dtype": "float32", "tie_word_embeddings": False,
              "bos_token_id": 0, "eos_token_id": 1}
    if kind == "mla-eagle3":
        return {**model_config("mla"), "num_hidden_layers": 4, "first_k_dense_replace": 4,
                "torch_dtype": "bfloat16"}
    if kind == "mla":
        return {**common,
                "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
                "intermediate_size": 512, "moe_intermediate_size": 128,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
                "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 32,
                "qk_rope_head_dim": 64, "v_head_dim": 32,
                # MoE fields must be present; first_k_dense_replace = layers makes every
                # layer a dense MLP, so no expert is used
                "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
                "first_k_dense_replace": 2, "moe_layer_freq": 1, "topk_method": "greedy",
                "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
                "norm_topk_prob": False, "scoring_func": "softmax",
                "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
    if kind == "nemotron-h":
        return {**common,
                "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
                "hybrid_override_pattern": "M*M", "num_hidden_layers": 3,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                "intermediate_size": 512, "mamba_num_heads": 8, "mamba_head_dim": 32,
                "n_groups": n_groups, "ssm_state_size": 16, "conv_kernel": 4, "expand": 1,
                "chunk_size": 64, "mamba_ssm_cache_dtype": "float32",
                "layer_norm_epsilon": 1e-5, "rope_theta": 10000.0, "use_bias": False,
                "mlp_hidden_act": "relu2", "residual_in_fp32": False}
    if kind == "gemma3":
        return {**common,
                "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 64, "intermediate_size": 512, "sliding_window": 32,
                "layer_types": ["sliding_attention", "full_attention"],
                "query_pre_attn_scalar": 64, "rms_norm_eps": 1e-6,
                "rope_theta": 10000.0, "rope_local_base_freq": 10000.0,
                "hidden_activation": "gelu_pytorch_tanh"}
    if kind in ("llama", "llama-deep", "llama-eagle3"):
        layers, kv_heads = {"llama": (2, 2), "llama-deep": (16, 4), "llama-eagle3": (4, 4)}[kind]
        return {**common,
                "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "intermediate_size": 512, "num_hidden_layers": layers, "num_attention_heads": 4,
                "num_key_value_heads": kv_heads, "head_dim": 64, "rms_norm_eps": 1e-6,
                "rope_theta": 10000.0, "hidden_act": "silu"}
    raise ValueError(f"model kind {kind!r} is not one of {KINDS}")


#: Where ``llama-eagle3`` writes its draft, inside the main model's directory.
DRAFT_DIR = "eagle3"


def eagle3_config() -> dict:
    """config.json of the tiny EAGLE-3 draft of ``llama-eagle3``: one Llama layer (vLLM's
    ``Eagle3LlamaForCausalLM``) of 4 heads and **2** KV heads of 64, so that its KV-cache
    layer differs from the main model's 4 KV heads."""
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
            "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 1,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
            "vocab_size": 1024, "draft_vocab_size": 1024, "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu",
            "torch_dtype": "float32", "tie_word_embeddings": False, "bos_token_id": 0,
            "eos_token_id": 1,
            # the main model's hidden states the draft takes, 3 distinct layers: vLLM's default
            # for 4 layers, (2, 4 // 2, 4 - 3), names layer 2 twice, and the draft's fc (3 x
            # hidden inputs) then fails on 2 states ("shape '[-1, 768]' is invalid")
            "eagle_aux_hidden_state_layer_ids": [1, 2, 3]}


def write_eagle3(path: str, seed: int = 4321) -> None:
    """The draft's weights by the names of EAGLE-3 checkpoints (``midlayer.*``, ``fc``,
    ``norm``, ``lm_head``; the embedding is the main model's, as vLLM shares it when absent):
    no transformers class builds this architecture."""
    import torch
    from safetensors.torch import save_file

    c = eagle3_config()
    h, i, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    shapes = {"midlayer.self_attn.q_proj.weight": (q, 2 * h),  # embeds | hidden states
              "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
              "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
              "midlayer.self_attn.o_proj.weight": (h, q),
              "midlayer.mlp.gate_proj.weight": (i, h), "midlayer.mlp.up_proj.weight": (i, h),
              "midlayer.mlp.down_proj.weight": (h, i),
              "fc.weight": (h, 3 * h), "lm_head.weight": (c["draft_vocab_size"], h)}
    norms = ("midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
             "midlayer.post_attention_layernorm.weight", "norm.weight")
    g = torch.Generator().manual_seed(seed)
    tensors = {n: (torch.randn(s, generator=g) * 0.08).contiguous() for n, s in shapes.items()}
    tensors.update({n: torch.ones(h) for n in norms})
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f, indent=1)
    save_file(tensors, os.path.join(path, "model.safetensors"))


def write_model(path: str, kind: str = "llama", *, n_groups: int = 1, seed: int = 1234) -> None:
    """A tiny model (see :func:`model_config`) with random float32 weights (fixed seed):
    config.json + model.safetensors."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(model_config(kind, n_groups=n_groups), f, indent=1)
    # The weight names and shapes are the model's own: build it on the meta device and
    # fill every parameter with seeded noise (large enough that tokens depend on the KV).
    from transformers import AutoConfig, AutoModelForCausalLM

    conf = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(conf, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, p in model.state_dict().items():
        if name.endswith("norm.weight") or "layernorm" in name:
            # Gemma's RMSNorm scales by (1 + weight): zeros there are the identity
            t = torch.zeros(p.shape) if kind == "gemma3" else torch.ones(p.shape)
        elif name.endswith("A_log"):  # Mamba's decay: A = -exp(A_log) in [-1, -e^-1]
            t = -torch.rand(p.shape, generator=g)
        elif name.endswith(("dt_bias", ".D")):
            t = torch.rand(p.shape, generator=g) * 0.5
        else:
            t = torch.randn(p.shape, generator=g) * 0.08
        tensors[name] = t.contiguous()
    save_file(tensors, os.path.join(path, "model.safetensors"))
    if kind in ("llama-eagle3", "mla-eagle3"):
        write_eagle3(os.path.join(path, DRAFT_DIR))


def serve(args: argparse.Namespace) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kw = {}
    if args.connector == "kvplan":
        extra = {"secret": args.secret, "side_channel_port": args.side_port,
                 **({"side_channel_host": args.side_host} if args.side_host else {}),
                 "transfer_timeout_s": args.transfer_timeout,
                 "push_timeout_s": args.transfer_timeout,
                 "handshake_timeout_s": HANDSHAKE_TIMEOUT_S, **json.loads(args.extra)}
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvplanConnector", kv_connector_module_path="kvplan_nixl.vllm",
            kv_role="kv_both", kv_buffer_device="cpu", engine_id=args.engine_id,
            kv_load_failure_policy=args.policy, kv_connector_extra_config=extra)
    elif args.connector == "nixl":  # vLLM's own, for comparison (its port from the env)
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(args.side_port)
        os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = args.side_host or "127.0.0.1"
        # what kvplan_nixl sets for our connector, as docs/vllm.md tells NixlConnector users:
        # no UCX EFA module, whose system libnl crashes the process at exit on an RDMA stack
        os.environ.setdefault("UCX_MODULES", "^efa")
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="NixlConnector", kv_role="kv_both", kv_buffer_device="cpu",
            engine_id=args.engine_id, kv_load_failure_policy=args.policy,
            kv_connector_extra_config=json.loads(args.extra))
    if args.attention_backend:
        kw["attention_config"] = {"backend": args.attention_backend}
    # the "dump" op sends a function to the workers (collective_rpc), which vLLM's msgpack
    # transport carries only with pickle allowed; these engines serve the tests alone
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    if args.speculative:  # the EAGLE-3 draft written beside the model (llama-eagle3)
        kw["speculative_config"] = {"method": "eagle3", "num_speculative_tokens": args.speculative,
                                    "model": os.path.join(args.model, DRAFT_DIR)}
    llm = LLM(model=args.model, skip_tokenizer_init=True, tensor_parallel_size=args.tp,
              dtype=args.dtype, block_size=args.block_size or None, max_model_len=1024,
              enable_prefix_caching=True, enforce_eager=True, seed=0,
              distributed_executor_backend="mp" if args.tp > 1 else None,
              num_gpu_blocks_override=args.num_blocks or None,
              disable_log_stats=not args.log_stats, **kw)
    if args.speculative:  # the tests compare the drafter's proposals with a plain run's
        llm.collective_rpc(record_drafts)
    cfg = llm.llm_engine.vllm_config.kv_transfer_config
    emit({"id": "ready", "engine_id": cfg.engine_id if cfg else None})

    def params(req: dict) -> SamplingParams:
        extra = {"kv_transfer_params": req["params"]} if req.get("params") else None
        return SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], ignore_eos=True,
                              extra_args=extra, logprobs=0)

    def result(rid: str, out: object) -> dict:
        c = out.outputs[0]
        lps = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs or [])]
        return {"id": rid, "tokens": list(c.token_ids), "finish": c.finish_reason,
                "logprobs": lps, "params": out.kv_transfer_params, "error": None}

    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        if req.get("op") == "exit":
            break
        t0 = time.monotonic()
        try:
            if req.get("op") == "dump":  # every worker's KV cache, to PATH/rank<r>.npz
                res = {"id": req["id"], "error": None,
                       "ranks": llm.collective_rpc(dump_kv, args=(req["path"],))}
            elif req.get("op") == "drafts":  # rank 0's record: every rank's is the same
                res = {"id": req["id"], "error": None,
                       "drafts": llm.collective_rpc(take_drafts)[0]}
            elif req.get("op") == "metrics":
                llm.llm_engine.do_log_stats()
                res = {"id": req["id"], "error": None, "metrics": [
                    dict(vars(m), kind=type(m).__name__) for m in llm.get_metrics()
                    if m.name.startswith(req.get("prefix", "vllm:kvplan"))]}
            elif "batch" in req:  # together in one engine, each timed on its own
                eng, done, first = llm.llm_engine, {}, {}
                for r in req["batch"]:
                    eng.add_request(r["id"], TokensPrompt(prompt_token_ids=r["prompt"]),
                                    params(r))
                while eng.has_unfinished_requests():
                    for out in eng.step():
                        now = round(time.monotonic() - t0, 4)
                        if out.outputs and out.outputs[0].token_ids:
                            first.setdefault(out.request_id, now)
                        if out.finished:
                            done[out.request_id] = dict(
                                result(out.request_id, out), seconds=now,
                                first=first.get(out.request_id, now))
                res = {"id": req["id"], "error": None,
                       "results": [done[r["id"]] for r in req["batch"]]}
            else:
                out = llm.generate([TokensPrompt(prompt_token_ids=req["prompt"])],
                                   params(req), use_tqdm=False)[0]
                res = result(req["id"], out)
        except Exception as e:  # reported to the test, which decides
            res = {"id": req["id"], "tokens": None, "error": f"{type(e).__name__}: {e}"}
        res["seconds"] = round(time.monotonic() - t0, 3)
        emit(res)


def dump_kv(worker: object, path: str) -> int:
    """Run on each worker (``collective_rpc``): write every attention layer's KV cache as the
    layer holds it (``[B, H, N, C]``, this rank's heads) to ``path/rank<r>.npz``; the rank."""
    import numpy as np
    from vllm.config import get_layers_from_vllm_config
    from vllm.distributed import get_tensor_model_parallel_rank
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    layers = get_layers_from_vllm_config(worker.vllm_config, AttentionLayerBase)
    out = {}
    for name, layer in layers.items():
        kv = layer.kv_cache
        kv = kv[0] if isinstance(kv, (list, tuple)) else kv
        if kv.dim() == 3:  # MLA's [B, N, C]: one latent "head", so that every layer reads alike
            kv = kv.unsqueeze(1)
        out[name] = kv.detach().cpu().float().numpy()
    rank = get_tensor_model_parallel_rank()
    np.savez(os.path.join(path, f"rank{rank}.npz"), **out)
    return rank


def record_drafts(worker: object) -> None:
    """Run on each worker (``collective_rpc``) once: record what its model runner's
    ``take_draft_token_ids`` returns, the draft token ids proposed for each request in the step
    just run (vLLM's engine core asks for them after every step that ran the model, when it
    schedules synchronously, as it always does on CPU), for :func:`take_drafts`."""
    runner = worker.model_runner
    record: list[list] = []
    take = runner.take_draft_token_ids

    def recorded():
        out = take()
        if out is not None:
            record.extend([rid, [int(t) for t in ids]]
                          for rid, ids in zip(out.req_ids, out.draft_token_ids, strict=True))
        return out

    runner.take_draft_token_ids = recorded
    runner.kvplan_drafts = record


def take_drafts(worker: object) -> list[list]:
    """Run on each worker (``collective_rpc``): the proposals :func:`record_drafts` recorded
    since the last call, ``[request id, [token, ...]]`` per request and step, cleared."""
    record = worker.model_runner.kvplan_drafts
    out = list(record)
    record.clear()
    return out


def emit(res: dict) -> None:
    """One result line in one write: the engine's worker processes log to the same pipe, and
    a line written in pieces (text, then newline) can get one of their lines in between."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (MARK + json.dumps(res) + "\n").encode())


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("model")
    m.add_argument("path")
    m.add_argument("--kind", default="llama", choices=KINDS)
    m.add_argument("--n-groups", type=int, default=1, help="nemotron-h: Mamba2 B/C groups")
    s = sub.add_parser("serve")
    s.add_argument("--model", required=True)
    s.add_argument("--tp", type=int, default=1)
    s.add_argument("--block-size", type=int, default=32, help="0: vLLM's choice")
    s.add_argument("--side-port", type=int, default=0)
    s.add_argument("--side-host", default=None,
                   help="the side channel's address (default: $VLLM_HOST_IP, 127.0.0.1)")
    s.add_argument("--secret", default="kvplan-test")
    s.add_argument("--engine-id", default=None,
                   help="kv_transfer_config.engine_id (default: vLLM's, a new one each start)")
    s.add_argument("--policy", default="recompute", choices=["recompute", "fail"])
    s.add_argument("--transfer-timeout", type=float, default=20.0)
    s.add_argument("--connector", default="kvplan", choices=["kvplan", "nixl", "none"])
    s.add_argument("--attention-backend", default=None, help="e.g. CPU_MLA")
    s.add_argument("--extra", default="{}",
                   help="JSON merged into kv_connector_extra_config (NixlConnector's: all of it)")
    s.add_argument("--num-blocks", type=int, default=0, help="KV cache blocks (0: vLLM's)")
    s.add_argument("--log-stats", action="store_true", help="vLLM's stats log and metrics")
    s.add_argument("--dtype", default="float32", help="the engine's dtype")
    s.add_argument("--speculative", type=int, default=0,
                   help="EAGLE-3 speculative decoding with this many draft tokens")
    args = ap.parse_args()
    if args.cmd == "model":
        write_model(args.path, args.kind, n_groups=args.n_groups)
    else:
        serve(args)


if __name__ == "__main__":
    main()

"""One vLLM engine as a child process of the real-engine tests (run by the vLLM venv's python).

``python tests/vllm_engine.py model DIR`` writes the tiny random Llama (or ``--mla``: a tiny
DeepSeek-V2-shaped model) as safetensors; ``python tests/vllm_engine.py serve --model DIR ...``
starts an engine and answers one JSON request per stdin line with one result line on stdout,
prefixed by :data:`MARK` (vLLM's own logs go to the same streams)::

    {"id": "a", "prompt": [1, 2, 3], "max_tokens": 16, "params": {...} | null}
    @@kvplan {"id": "a", "tokens": [...], "params": {...}, "finish": "length", "error": null}

The engine uses ``KvplanConnector`` unless ``--no-connector``. The main guard matters: vLLM
spawns its engine processes, which re-import this file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

MARK = "@@kvplan "


def write_model(path: str, *, mla: bool, seed: int = 1234) -> None:
    """A tiny model with random float32 weights (fixed seed), config.json + safetensors.

    The MLA model's latent is 512 + 64 = 576 values per token: the only size vLLM's CPU_MLA
    backend takes (``cpu_mla.py``, ``get_supported_head_sizes``), with blocks of 16."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    hidden, layers, vocab = 256, 2, 1024
    if mla:
        cfg = {
            "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
            "hidden_size": hidden, "intermediate_size": 512, "moe_intermediate_size": 128,
            "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 4,
            "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 64, "v_head_dim": 32, "vocab_size": vocab,
            # MoE fields must be present; first_k_dense_replace = layers makes every layer
            # a dense MLP, so no expert is used
            "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
            "first_k_dense_replace": layers, "moe_layer_freq": 1, "topk_method": "greedy",
            "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
            "norm_topk_prob": False, "scoring_func": "softmax",
            "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "torch_dtype": "float32", "tie_word_embeddings": False,
            "bos_token_id": 0, "eos_token_id": 1,
        }
    else:
        cfg = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": hidden, "intermediate_size": 512, "num_hidden_layers": layers,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
            "vocab_size": vocab, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "torch_dtype": "float32", "tie_word_embeddings": False,
            "bos_token_id": 0, "eos_token_id": 1, "hidden_act": "silu",
        }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    # The weight names and shapes are the model's own: build it on the meta device and
    # fill every parameter with seeded noise (large enough that tokens depend on the KV).
    from transformers import AutoConfig, AutoModelForCausalLM

    conf = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(conf, torch_dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, p in model.state_dict().items():
        if name.endswith("norm.weight") or "layernorm" in name:
            t = torch.ones(p.shape)
        else:
            t = torch.randn(p.shape, generator=g) * 0.08
        tensors[name] = t.contiguous()
    save_file(tensors, os.path.join(path, "model.safetensors"))


def serve(args: argparse.Namespace) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kw = {}
    if not args.no_connector:
        extra = {"secret": args.secret, "side_channel_port": args.side_port,
                 "transfer_timeout_s": args.transfer_timeout}
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvplanConnector", kv_connector_module_path="kvplan_nixl.vllm",
            kv_role="kv_both", kv_buffer_device="cpu",
            kv_load_failure_policy=args.policy, kv_connector_extra_config=extra)
    llm = LLM(model=args.model, skip_tokenizer_init=True, tensor_parallel_size=args.tp,
              dtype="float32", block_size=args.block_size, max_model_len=1024,
              enable_prefix_caching=True, enforce_eager=True, seed=0,
              distributed_executor_backend="mp" if args.tp > 1 else None, **kw)
    print(MARK + json.dumps({"id": "ready"}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        if req.get("op") == "exit":
            break
        extra = {"kv_transfer_params": req["params"]} if req.get("params") else None
        sp = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], ignore_eos=True,
                            extra_args=extra)
        t0 = time.monotonic()
        try:
            out = llm.generate([TokensPrompt(prompt_token_ids=req["prompt"])], sp,
                               use_tqdm=False)[0]
            c = out.outputs[0]
            res = {"id": req["id"], "tokens": list(c.token_ids), "finish": c.finish_reason,
                   "params": out.kv_transfer_params, "error": None}
        except Exception as e:  # reported to the test, which decides
            res = {"id": req["id"], "tokens": None, "error": f"{type(e).__name__}: {e}"}
        res["seconds"] = round(time.monotonic() - t0, 3)
        print(MARK + json.dumps(res), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("model")
    m.add_argument("path")
    m.add_argument("--mla", action="store_true")
    s = sub.add_parser("serve")
    s.add_argument("--model", required=True)
    s.add_argument("--tp", type=int, default=1)
    s.add_argument("--block-size", type=int, default=32)
    s.add_argument("--side-port", type=int, default=0)
    s.add_argument("--secret", default="kvplan-test")
    s.add_argument("--policy", default="recompute", choices=["recompute", "fail"])
    s.add_argument("--transfer-timeout", type=float, default=20.0)
    s.add_argument("--no-connector", action="store_true")
    args = ap.parse_args()
    if args.cmd == "model":
        write_model(args.path, mla=args.mla)
    else:
        serve(args)


if __name__ == "__main__":
    main()

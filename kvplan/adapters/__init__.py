"""Engine adapters: build a :class:`kvplan.EngineSpec` from what a serving engine allocated.

Pure like the rest of ``kvplan``: an adapter reads the engine's tensors only through
``.shape``, ``.stride()``, ``.dtype``, ``.element_size()`` and ``.data_ptr()`` and its config
objects through their attributes, so it never imports the engine (or torch).

- :mod:`kvplan.adapters.vllm`: vLLM's V1 KV cache (``register_kv_caches`` tensors and the
  ``KVCacheConfig``), ``spec_from_vllm``.
- :mod:`kvplan.adapters.vllm_nixl`: a stock vLLM NixlConnector prefill's spec and buffer
  addresses from the ``NixlAgentMetadata`` it publishes, ``prefill_from_nixl``.
- :mod:`kvplan.adapters.sglang`: SGLang's token pools (``MHATokenToKVPool``, V heads of
  their own size included, ``MLATokenToKVPool``) read into ``SGLangKV`` values,
  ``spec_from_sglang``; Mamba2 / GDN / KDA state read from its ``MambaPool``
  (``SGLangMamba2.from_pool``, ``spec_from_sglang_mamba2``) and both in one spec
  (``spec_from_sglang_hybrid``, pipeline stages included), a ``HybridLinearKVPool`` read
  by both; a ``SWAKVPool``'s full and sliding-window sub-pools (``SGLangKV.from_swa_pool``,
  ``spec_from_sglang_swa``: two groups, two page index spaces); DP attention's groups
  (``sglang_attention_rank``).

Layer 5 (adapters, beside hf): imports the values below (spec, regions, layout, errors); no
value imports an adapter back.
"""

"""The serving protocol kvplan peers speak, engine-neutral: what a connector needs beyond the
executor to serve disaggregated requests between engines that both run kvplan.

Layer: between the executor (``kvplan_nixl``, ``kvplan_nixl.staged``), which it imports, and
an engine's connector (``kvplan_nixl.vllm``), which imports it. No module here imports an
engine (vLLM, torch): a connector for another engine builds on the same modules.

- :mod:`.sidechannel`: the TCP side channel (a rank's metadata, authenticated hold control
  messages), bounded on both ends; :mod:`.addresses`: which addresses it may bind and advertise;
- :mod:`.holds`: a prefill's hold table, so that no request is served from freed KV;
- :mod:`.handshakes`: peers' metadata fetched and their ranks connected off the engine step,
  on the bounded, host-fair pools of :mod:`.host_pools`;
- :mod:`.pushes`: push mode's words and tables; :mod:`.pull_digests`: the pull digest's words;
- :mod:`.transfer_params`: a request's ``kv_transfer_params``, checked where they enter;
  :mod:`.settings`: the connector's config keys, read once;
- :mod:`.loads`: one decode request's load, as the scheduler decided it; :mod:`.outcomes`:
  which loads failed, seen from the scheduler;
- a worker rank's parts that move requests, on the state it offers them (:mod:`.rank`):
  :mod:`.pulls` (a decode's reads; each pull's state and lease in :mod:`.pull_state`),
  :mod:`.push_io` (a prefill's writes, a decode's receipts), :mod:`.control` (both sides of
  the hold protocol: HOLD / LEASE / RENEW / CONFIRM / RELEASE), :mod:`.restarts` (a prefill
  restarted in place), the transfer digest's checks (:mod:`.push_digests`,
  :mod:`.pull_digest_io`) and the spans both read and write (:mod:`.spans`).

The modules log on ``logging.getLogger(__name__)``; an engine's connector decides where those
lines go (vLLM's: ``kvplan_nixl.vllm`` hands them to vLLM's own logger).

This ``__init__`` imports nothing, so importing one module does not import the others.
"""

"""The prefill's layer-wise hooks, run on the forward's thread: open a step's layer-wise pushes
before the forward, post each layer's writes as the forward computes it, and what is left after
it (the writes themselves are :class:`kvplan_nixl.serving.push_io.Writes`').

Functions of a :class:`~kvplan_nixl.vllm.worker.Worker`, kept apart from it because they run on
another thread than its step and its progress loop, and take the worker's lock only around each
``Writes`` call.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from vllm.logger import init_logger

if TYPE_CHECKING:
    from kvplan_nixl.serving.pushes import PushSend
    from kvplan_nixl.vllm.worker import Worker

logger = init_logger("vllm.kvplan_nixl")


def begin(w: Worker, layered: list[PushSend]) -> None:
    """Before the forward: open the layer-wise pushes of the requests it computes.

    A proxy sends both legs at once, and the decode's registration leaves from its
    ``start_load_kv``, which vLLM 0.32 calls after the decode's own step: it often arrives
    a few ms after this forward would start. So the forward waits, at most
    ``layerwise_wait_s``, until every request's registration is in and its decode engine
    connected (the progress thread takes both meanwhile); a request still lacking one is
    pushed whole after it finished."""
    if w.writes is None:
        return
    t0 = time.monotonic()
    deadline = t0 + w.layer_wait
    while True:
        with w.lock:
            now = time.monotonic()
            if now >= deadline or all(w.writes.ready(s, now) for s in layered):
                if now - t0 > 0.001:
                    logger.info("kvplan: %d layer-wise request(s) waited %.4f s for their "
                                "registration before the forward", len(layered), now - t0)
                w.writes.begin(layered, now)
                return
        time.sleep(0.0005)


def save(w: Worker, name: str) -> None:
    """The forward wrote layer ``name``'s KV: post its writes (layer-wise pushes)."""
    if w.writes is None or not w.writes.open:
        return
    if w.cuda:  # the kernels that wrote it may still run: NIXL must read what they wrote
        torch.cuda.current_stream().synchronize()
    with w.lock:
        w.writes.save_layer(name)


def end(w: Worker) -> None:
    """The forward is over: post what is left of this step's layer-wise pushes."""
    if w.writes is None or not w.writes.open:
        return
    if w.cuda:
        torch.cuda.current_stream().synchronize()
    with w.lock:
        w.writes.end_layers(time.monotonic())

"""kvplan_nixl/serving/loads.py without vLLM: a decode request's load is a frozen value whose
block lists are tuples and whose prefill connector is a :class:`Peer`, never a string."""

from __future__ import annotations

import pickle

import attrs
import pytest

from kvplan_nixl.serving.loads import Load
from kvplan_nixl.serving.transfer_params import Peer


def _load(**kw) -> Load:
    args = dict(req_id="d-1", remote_req="p-1", engine="pre", host="10.0.0.1", port=5700,
                remote_tp=2, remote_ids=[[1, 2], [3]], remote_first=[0, 4],
                local_ids=[[7, 8], [9]], start=0, end=32, parked=True)
    return Load(**{**args, **kw})


def test_lists_given_are_kept_as_tuples():
    load = _load()
    assert load.remote_ids == ((1, 2), (3,)) and load.local_ids == ((7, 8), (9,))
    assert load.remote_first == (0, 4) and load.peer is Peer.KVPLAN
    given = [[1, 2]]
    load = _load(remote_ids=given, remote_first=[0])
    given[0].append(5)  # the caller's list changes; the load does not
    assert load.remote_ids == ((1, 2),)


def test_a_load_never_changes_a_new_one_is_made():
    load = _load()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        load.parked = False
    released = attrs.evolve(load, local_ids=(), parked=False)
    assert load.parked and load.local_ids and not released.parked and released.local_ids == ()
    assert released.req_id == load.req_id


def test_the_peer_is_a_peer_and_survives_pickling():
    with pytest.raises(TypeError, match="peer"):
        _load(peer="nixl")
    load = _load(peer=Peer.NIXL)
    back = pickle.loads(pickle.dumps(load))  # the scheduler's metadata crosses processes
    assert back == load and back.peer is Peer.NIXL and hash(back) == hash(load)

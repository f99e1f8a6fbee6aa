"""Progress a person sees: the demo fills its buffers in chunks, reporting each (one numpy call
over GiBs held the GIL and froze the spinner for seconds), and a step's parts update its text."""

from __future__ import annotations

import time

import numpy as np

import kvplan.cli.progress as progress
import kvplan_nixl.cli as cli
from kvplan.examples import llama3_70b


def test_demo_buffers_fill_in_chunks_and_report_each(monkeypatch):
    monkeypatch.setattr(cli, "FILL_CHUNK", 1 << 16)
    spec = llama3_70b(2, num_blocks=8)
    seen = []
    bufs = cli._buffers(spec, 0, 0xEE, np.random.default_rng(0), seen.append)
    total = sum(spec.rank_buffer_nbytes(a) for a in bufs)
    assert sum(seen) == total and max(seen) <= 1 << 16
    assert len(seen) >= total // (1 << 16)
    assert all((np.asarray(b) == 0xEE).all() for b in bufs.values())
    rnd = cli._buffers(spec, 0, None, np.random.default_rng(0))
    assert all(np.asarray(b).std() > 50 for b in rnd.values())  # random bytes, every chunk


def test_a_step_prints_nothing_without_a_terminal(capsys, monkeypatch):
    """Progress lines in a log start midway and mean nothing there: off a terminal, none."""
    monkeypatch.delenv("KVPLAN_PROGRESS", raising=False)  # stderr is not a terminal here
    assert not progress.enabled()
    with progress.step("counting") as update:
        update("part 1 of 2")
        time.sleep(0.05)
        update("part 2 of 2")
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("KVPLAN_PROGRESS", "1")  # asked for: shown even in a log
    assert progress.enabled()
    monkeypatch.setenv("KVPLAN_PROGRESS", "0")
    assert not progress.enabled()

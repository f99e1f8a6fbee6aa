"""Progress a person sees: the demo fills its buffers in chunks, reporting each (one numpy call
over GiBs held the GIL and froze the spinner for seconds), and a step's parts update its text."""

from __future__ import annotations

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


def test_a_step_reports_its_parts_as_lines_only_when_long(capsys, monkeypatch):
    monkeypatch.delenv("KVPLAN_PROGRESS", raising=False)  # stderr is not a terminal here
    monkeypatch.setattr(progress, "LOG_AFTER", 0.0)
    with progress.step("counting", log=True) as update:
        update("part 1 of 2")
        update("part 2 of 2")
    err = capsys.readouterr().err.splitlines()
    assert [e.split(" (")[0] for e in err] == ["counting: part 1 of 2", "counting: part 2 of 2"]
    with progress.step("quiet") as update:  # log=False: a pipe sees nothing
        update("part")
    monkeypatch.setattr(progress, "LOG_AFTER", 3600.0)
    with progress.step("short", log=True) as update:  # shorter than LOG_AFTER: nothing
        update("part")
    assert capsys.readouterr().err == ""

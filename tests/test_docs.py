"""Every fenced code block of README.md and docs/*.md runs as written, so the docs never rot.

The convention (also in README.md, "Docs that run"):

- ```python blocks run in order, per file, in one namespace (one fresh interpreter per file),
  from the repository root, with this checkout first on the path.
- ```bash blocks each run as written with ``bash -e`` (no pipefail, as in a user's shell)
  from the repository root and must exit 0 within a minute or two; scratch files go to /tmp.
- ```text (output, sketches), ```json and ```toml blocks are shown, not run; a fence without
  a language is refused, so that every block says what it is.
- A block that must not run here (it installs packages, or takes minutes) is preceded, on the
  line right above its fence, by ``<!-- docs-test: skip: REASON -->``. Use it sparingly.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = {"python", "bash"}
SHOWN = {"text", "json", "toml"}
SKIP = re.compile(r"^<!--\s*docs-test:\s*skip:\s*(\S.*?)\s*-->$")
FENCE = re.compile(r"^(\s*)(```+|~~~+)(.*)$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    skip: str | None  # the reason, when marked

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of one Markdown file (CommonMark fences, possibly indented in lists)."""
    out: list[Block] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = m.group(1), m.group(2), m.group(3).strip()
        j = i + 1
        while j < len(lines) and not (lines[j].strip().startswith(fence)
                                      and lines[j].strip().strip(fence[0]) == ""):
            j += 1
        body = [ln[len(indent):] if ln.startswith(indent) else ln for ln in lines[i + 1:j]]
        above = lines[i - 1].strip() if i else ""
        skip = SKIP.match(above)
        out.append(Block(path, i + 1, info.split()[0] if info else "", "\n".join(body) + "\n",
                         skip.group(1) if skip else None))
        i = j + 1
    return out


ALL = [b for f in FILES for b in blocks(f)]


def _env() -> dict[str, str]:
    bindir = str(Path(sys.executable).parent)  # `python`, `kvplan` of this environment
    return {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg", "KVPLAN_PROGRESS": "0",
            "OPENBLAS_NUM_THREADS": "1", "COLUMNS": "120"}


def test_every_block_says_what_it_is():
    bad = [f"{b.id} ({b.lang or 'no language'})" for b in ALL if b.lang not in RUN | SHOWN]
    assert not bad, ("fence each block as python / bash (run) or text / json / toml (shown): "
                     + ", ".join(bad))
    # installs, the two test tiers and long runs only (README.md holds three of them)
    assert len([b for b in ALL if b.skip]) <= 9, "docs-test: skip is for installs and long runs"


@pytest.mark.parametrize("path", [f for f in FILES
                                  if any(b.lang == "python" and not b.skip for b in blocks(f))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run_in_order(path):
    runnable = [b for b in blocks(path) if b.lang == "python" and not b.skip]
    driver = textwrap.dedent("""
        import sys
        ns = {"__name__": "__main__"}
        for where, code in BLOCKS:
            exec(compile(code, where, "exec"), ns)
    """).replace("BLOCKS", repr([(b.id, b.code) for b in runnable]))
    r = subprocess.run([sys.executable, "-c", driver], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"a python block of {path.name} failed:\n{r.stderr[-3000:]}"


@pytest.mark.parametrize("block", [b for b in ALL if b.lang == "bash" and not b.skip],
                         ids=lambda b: b.id)
def test_bash_block_runs(block):
    r = subprocess.run(["bash", "-e", "-c", block.code], cwd=ROOT,
                       env=_env(), capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, (f"{block.id} exited {r.returncode}:\n{block.code}\n"
                               f"stdout: {r.stdout[-2000:]}\nstderr: {r.stderr[-2000:]}")


def test_skip_markers_name_a_reason_and_sit_on_a_fence():
    for f in FILES:
        lines = f.read_text(encoding="utf-8").splitlines()
        for k, ln in enumerate(lines):
            if ln.lstrip().startswith("<!--") and "docs-test" in ln:
                where = f"{f.name}:{k + 1}"
                assert SKIP.match(ln.strip()), f"{where}: write <!-- docs-test: skip: WHY -->"
                nxt = lines[k + 1] if k + 1 < len(lines) else ""
                assert FENCE.match(nxt), f"{where}: the marker must sit right above a fence"


def test_docs_stand_on_their_own():
    """No pointer to files outside the repository; every relative link resolves."""
    for f in FILES:
        text = f.read_text(encoding="utf-8")
        for bad in ("shared/docs", "domain.md", "nixl-on-cpu.md", "style.md"):
            assert bad not in text, f"{f.name} points at {bad}, which is not in the repository"
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
            assert (f.parent / target).exists(), f"{f.name}: broken link {target}"


RENDERED = re.compile(r"^<!--\s*examples/pd_serve\.py((?:\s+\S+)*?)\s*-->$")
#: the blocks docs/vllm.md must show: those two the tests run (two hosts: the defaults; one
#: host: ``DOCS_ONE_HOST``) and the stock NixlConnector prefill a migration starts from
REQUIRED = ("", "--prefill-ip 127.0.0.1 --decode-ip 127.0.0.1 --iface lo",
            "--prefill-ip 127.0.0.1 --decode-ip 127.0.0.1 --iface lo --stock-prefill")


def test_serving_command_blocks_are_the_ones_the_tests_run():
    """docs/vllm.md's command blocks are examples/pd_serve.py's output for the arguments their
    marker names (``<!-- examples/pd_serve.py ARGS -->``), the module tests/test_vllm_http.py
    starts its engines and proxies with: one source."""
    from examples import pd_serve

    path = ROOT / "docs" / "vllm.md"
    lines = path.read_text(encoding="utf-8").splitlines()
    found = {}
    for b in blocks(path):
        m = RENDERED.match(lines[b.line - 2].strip()) if b.line >= 2 else None
        if m:
            found[" ".join(m.group(1).split())] = b
    assert set(REQUIRED) <= found.keys(), f"marked blocks {sorted(found)}, want {REQUIRED}"
    for args, b in found.items():
        want = pd_serve.printed(shlex.split(args))
        assert b.code == want, (f"{b.id} differs from `python examples/pd_serve.py {args}`'s "
                                f"output; paste it:\n{want}")
    assert found[REQUIRED[0]].code == pd_serve.render(pd_serve.DOCS_TWO_HOSTS, two_hosts=True)
    assert found[REQUIRED[1]].code == pd_serve.render(pd_serve.DOCS_ONE_HOST, two_hosts=False)
    printed = subprocess.run([sys.executable, "examples/pd_serve.py"], cwd=ROOT, env=_env(),
                             capture_output=True, text=True, timeout=60)
    assert printed.returncode == 0 and printed.stdout == found[""].code, printed.stderr

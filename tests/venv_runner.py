"""Scripts run in another venv's interpreter without paying its imports each time.

The engine tier runs about 25 short scripts in the vLLM venv (the connector's code around real
NIXL agents, no engine): each fresh interpreter spent about 10 CPU seconds importing torch and
vLLM before its first line, 4 minutes of the tier on two cores. Here one interpreter of that
venv imports them once (:data:`PRELOAD`) and forks a child per script: the child starts with
those modules loaded, runs the script as ``__main__`` and exits as an interpreter does (its
non-daemon threads joined, its ``atexit`` handlers run), in a session of its own so that a
timeout kills what it started. Nothing else is shared: the parent never runs a script, opens no
agent and starts no thread of its own, so each child is what a fresh interpreter would be after
those imports.

Run as a program, this file is the server (``python tests/venv_runner.py MODULE...``): it reads
one JSON request a line (``script``, ``out`` and ``err`` paths) and answers ``{"pid": N}`` when
the child started, then ``{"rc": N}`` when it ended. :func:`run` is the client the tests call.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: what the server imports before its first fork: the modules every script of the vLLM venv
#: pays for (about 10 CPU seconds of its 10-15); the project's own modules are not among them
#: (a script sees them imported fresh, as a connector would)
PRELOAD = ("torch", "vllm", "vllm.config",
           "vllm.distributed.kv_transfer.kv_connector.v1.base", "vllm.v1.request")

#: interpreter path -> its server process
_SERVERS: dict[str, subprocess.Popen] = {}


def _server(py: Path) -> subprocess.Popen:
    key = str(py)
    proc = _SERVERS.get(key)
    if proc is None or proc.poll() is not None:
        proc = subprocess.Popen([key, str(Path(__file__).resolve()), *PRELOAD],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, cwd=REPO,
                                env=dict(os.environ, PYTHONPATH=str(REPO)))
        line = proc.stdout.readline()
        if line.strip() != "ready":
            proc.kill()
            raise RuntimeError(f"{key} {Path(__file__).name}: no server ({line!r})")
        _SERVERS[key] = proc
    return proc


def run(py: Path, script: str, timeout: float = 300.0) -> tuple[int, str, str]:
    """Run ``script`` as ``python -c`` would, by the venv interpreter ``py``: (exit status,
    stdout, stderr). Past ``timeout`` its session is killed and the status is -9."""
    proc = _server(py)
    with tempfile.TemporaryDirectory(prefix="kvplan-run-") as tmp:
        out, err = Path(tmp, "out"), Path(tmp, "err")
        proc.stdin.write(json.dumps({"script": script, "out": str(out), "err": str(err)}) + "\n")
        proc.stdin.flush()
        pid = json.loads(proc.stdout.readline())["pid"]
        timer = _Killer(pid, timeout)
        try:
            rc = json.loads(proc.stdout.readline())["rc"]
        finally:
            timer.cancel()
        return rc, out.read_text(errors="replace"), err.read_text(errors="replace")


class _Killer:
    """Kill session ``pid`` after ``timeout`` seconds unless cancelled first."""

    def __init__(self, pid: int, timeout: float) -> None:
        import threading

        self.timer = threading.Timer(timeout, self._kill, (pid,))
        self.timer.daemon = True
        self.timer.start()

    @staticmethod
    def _kill(pid: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)

    def cancel(self) -> None:
        self.timer.cancel()


@atexit.register
def _close() -> None:
    for proc in _SERVERS.values():
        with contextlib.suppress(OSError):
            proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _serve(modules: list[str]) -> None:
    for name in modules:
        __import__(name)
    protocol = sys.stdout
    print("ready", file=protocol, flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(req)  # never returns: the interpreter exits from there
        print(json.dumps({"pid": pid}), file=protocol, flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), file=protocol,
              flush=True)


def _child(req: dict) -> None:
    os.setsid()
    for fd, path in ((1, req["out"]), (2, req["err"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the server's requests are not the script's input
    os.close(null)
    sys.stdin = open(0, closefd=False)
    sys.argv = ["-c"]
    code: int | str | None = 0
    try:
        exec(compile(req["script"], "<string>", "exec"), {"__name__": "__main__",
                                                         "__builtins__": __builtins__})
    except SystemExit as e:
        code = e.code
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    # leave as an interpreter does: SystemExit unwinds past the server's loop, then Python
    # joins the script's non-daemon threads and runs its atexit handlers
    raise SystemExit(code)


if __name__ == "__main__":
    _serve(sys.argv[1:])

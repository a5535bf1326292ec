"""A fork server for tests whose child processes would each import torch (seconds apiece).

``ForkServer`` starts one Python process that imports torch, graphpass, the model corpus and
safetensors, and nothing more: it runs no torch op (GNU OpenMP's pool, once used, hangs a forked
child) and starts no graphpass service. Each ``spawn(code, *args)`` forks it; the child runs
``code`` as ``python -c code *args`` would: in ``__main__``, with its ``sys.argv``, ending as that
interpreter would (exit status, traceback of an uncaught exception, threading shutdown, atexit
handlers: it really leaves the server's script), with stdin from /dev/null and stdout / stderr
written to files. The child is a fresh process to what it runs: no thread, no handler, no graphpass state but
what importing leaves, as in a new interpreter.

It is the suite's one fork server: tests take it through the module-scoped ``forks`` fixture of
tests/conftest.py (the async capture's saving processes, the offload fault children, the golden
plugin's inner pytest runs).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_SERVER = textwrap.dedent("""
    import json, os, signal, sys, time
    import torch, graphpass, safetensors.torch
    from graphpass.models.corpus import build

    def serve():
        requests, replies = os.fdopen(os.dup(0), "r"), os.fdopen(os.dup(1), "w")
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(2, 1)
        children = set()
        for line in requests:
            req = json.loads(line)
            if req["op"] == "spawn":
                pid = os.fork()
                if pid == 0:  # the child leaves the loop and runs the code as the main script
                    requests.close(); replies.close()
                    if req["session"]:
                        os.setsid()
                    for fd, path in ((1, req["out"]), (2, req["err"])):
                        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644); os.dup2(f, fd); os.close(f)
                    return req
                children.add(pid)
                reply = {"pid": pid}
            else:
                reply = {"rc": None}
                deadline = time.monotonic() + req["timeout"]
                while True:
                    done, status = os.waitpid(req["pid"], os.WNOHANG)
                    if done:
                        children.discard(done)
                        reply = {"rc": os.waitstatus_to_exitcode(status)}
                        break
                    if time.monotonic() >= deadline:
                        break
                    time.sleep(0.02)
            replies.write(json.dumps(reply) + "\\n"); replies.flush()
        for pid in children:
            os.kill(pid, signal.SIGKILL); os.waitpid(pid, 0)
        sys.exit(0)

    # only the child returns: it runs the code in __main__ and ends as `python -c code` would
    # (exit status, traceback, threading shutdown, atexit handlers)
    _req = serve()
    sys.argv = ["-c", *_req["args"]]
    _code = compile(_req["code"], "<string>", "exec")
    for _name in [n for n in globals() if not n.startswith("__")]:
        if _name != "_code":
            del globals()[_name]
    exec(_code)
""")


class ForkedChild:
    """A child of the fork server, used like ``subprocess.Popen`` (its output lands in files)."""

    def __init__(self, server: "ForkServer", pid: int, out: Path, err: Path):
        self.server, self.pid, self.out, self.err = server, pid, out, err
        self.returncode = None

    def wait(self, timeout: float) -> int:
        if self.returncode is None:
            rc = self.server._ask(op="wait", pid=self.pid, timeout=timeout)["rc"]
            if rc is None:
                raise subprocess.TimeoutExpired(f"forked child {self.pid}", timeout)
            self.returncode = rc
        return self.returncode

    def poll(self):
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def stdout(self) -> str:
        return self.out.read_text(errors="replace") if self.out.exists() else ""

    def stderr(self) -> str:
        return self.err.read_text(errors="replace") if self.err.exists() else ""

    def readline(self, timeout: float = 120, line: int = 0) -> str:
        """Line ``line`` (0: the first) the child writes to stdout, once written whole (flushed), or
        what there is of it if the child ends or the time runs out first."""
        deadline = time.monotonic() + timeout
        while True:
            lines = self.stdout().split("\n")
            if len(lines) > line + 1:
                return lines[line] + "\n"
            if self.poll() is not None or time.monotonic() >= deadline:
                lines = self.stdout().split("\n")
                return lines[line] if len(lines) > line else ""
            time.sleep(0.02)


class ForkServer:
    """One process that imports torch once and forks a child per ``spawn`` (see the module doc)."""

    def __init__(self, folder: Path):
        self.folder, self.count = Path(folder), 0
        self.log = open(self.folder / "server.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            cwd=ROOT,
        )

    def _ask(self, **request) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the fork server died: " + (self.folder / "server.log").read_text()[-3000:])
        return json.loads(line)

    def spawn(self, code: str, *args, new_session: bool = False) -> ForkedChild:
        """Fork a child running ``code`` with ``args`` (in a session of its own with ``new_session``)."""
        self.count += 1
        out, err = self.folder / f"{self.count}.out", self.folder / f"{self.count}.err"
        pid = self._ask(
            op="spawn", code=code, args=[str(a) for a in args], out=str(out), err=str(err), session=new_session
        )["pid"]
        return ForkedChild(self, pid, out, err)

    def run(self, code: str, *args, timeout: float):
        """(returncode, or "hang" for a child killed past ``timeout``; stdout; stderr)."""
        child = self.spawn(code, *args)
        try:
            rc = child.wait(timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(60)
            rc = "hang"
        return rc, child.stdout(), child.stderr()

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(60)
        self.proc.stdout.close()
        self.log.close()

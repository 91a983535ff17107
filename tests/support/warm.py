"""A warm interpreter for the session's toy jobs (:class:`fixtures.Jobs`): a Python
subprocess that imports the pipeline once, then forks a child per job. Each child is a
fresh copy of the warm state (nothing a job does reaches the next one) that runs a
``python -c`` script with its arguments, in its working directory, its stdout and
stderr in files, and exits as ``python -c`` would (an uncaught exception: its traceback
on stderr, exit status 1). A toy job then costs its stages, not the ~3 s of CPU that
importing torch, Hydra and the stages takes a fresh interpreter.

Protocol, one JSON line each way: the request ``{"script", "args", "cwd", "stdout",
"stderr"}``; the answers ``{"pid"}`` when the child has started, then ``{"rc"}``, its
exit status (negative: killed by that signal), and ``"cpu"``, the CPU seconds it used
(user + system, its own children's included once they were waited for), when it has
ended. One job at a time.
The warm process starts no thread before it forks (importing torch starts none).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

#: The warm process: ``python -c SERVER <module>...`` imports the modules, then serves.
SERVER = """
import importlib, json, os, sys

def job(req):
    os.chdir(req["cwd"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(out, fd)
        os.close(out)
    sys.argv = ["-c", *req["args"]]
    exec(compile(req["script"], "<string>", "exec"), {"__name__": "__main__"})

for name in sys.argv[1:]:
    importlib.import_module(name)
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        job(req)
        sys.exit(0)
    print(json.dumps({"pid": pid}), flush=True)
    _, status, usage = os.wait4(pid, 0)
    print(json.dumps({"rc": os.waitstatus_to_exitcode(status),
                      "cpu": usage.ru_utime + usage.ru_stime}), flush=True)
"""


@dataclass
class Outcome:
    """How a job in the warm interpreter ended."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    cpu_s: float | None = None  # user + system CPU seconds of the job (None: killed)


class WarmPython:
    """One warm interpreter with ``env`` that has imported ``modules``; runs one job at a
    time (:meth:`run`)."""

    def __init__(self, env: dict[str, str], modules: list[str]) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="warm-python-")
        self._log = Path(self._tmp.name) / "server.stderr"
        with open(self._log, "w") as log:
            self._proc = subprocess.Popen([sys.executable, "-c", SERVER, *modules],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=log, env=env, text=True)
        self._pid: int | None = None  # the running job's process
        self._lock = threading.Lock()

    def run(self, script: str, args: list[str], cwd: Path, timeout: float) -> Outcome:
        """Run ``python -c script *args`` in ``cwd`` as a fork of the warm state; its
        outcome. A job still running after ``timeout`` seconds is killed."""
        out, err = Path(self._tmp.name) / "job.stdout", Path(self._tmp.name) / "job.stderr"
        request = {"script": script, "args": args, "cwd": str(cwd), "stdout": str(out),
                   "stderr": str(err)}
        assert self._proc.stdin is not None and self._proc.stdout is not None
        try:
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            self._proc.wait()
            raise RuntimeError(self._ended()) from None
        with self._lock:
            self._pid = self._answer()["pid"]
        timed_out = threading.Event()

        def kill() -> None:
            timed_out.set()
            self.kill_job()

        timer = threading.Timer(timeout, kill)
        timer.start()
        try:
            answer = self._answer()
            returncode, cpu = answer["rc"], answer.get("cpu")
        finally:
            timer.cancel()
            with self._lock:
                self._pid = None
        return Outcome(returncode, out.read_text(), err.read_text(), timed_out.is_set(), cpu)

    def _answer(self) -> dict:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            self._proc.wait()
            raise RuntimeError(self._ended())
        return json.loads(line)

    def _ended(self) -> str:
        return (f"the warm interpreter ended (exit {self._proc.returncode}):\n"
                f"{self._log.read_text()[-4000:]}")

    def kill_job(self) -> None:
        """Kill the running job, if any (the warm process reports its end)."""
        with self._lock:
            if self._pid is not None:
                try:
                    os.kill(self._pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass  # it ended meanwhile: its exit status is on the way

    def close(self) -> None:
        """Kill the running job, end the warm process, remove its files."""
        self.kill_job()
        if self._proc.stdin is not None:
            try:
                self._proc.stdin.close()
            except BrokenPipeError:
                pass  # the warm process has ended already
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._tmp.cleanup()

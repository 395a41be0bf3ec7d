"""Trainer pods started by forking a process that has already imported torch (a zygote).

Every trainer pod of the test kubelet is ``python -m kiln_trainer ...``; a fresh interpreter
spends most of its start importing torch and the libraries under it (measured: 2-3 CPU-s of a
pod's 3-4). The zygote imports those third-party libraries once, never Kiln's own modules
(they read the pod's environment when imported), then forks one child per pod: the child
takes the pod's environment, working directory, log and a session of its own, and runs the
trainer's ``__main__`` as ``python -m`` would. The zygote reaps its children and reports their
exit codes; `Zygote.start_pod` returns a `Process` that the kubelet uses as it would a Popen.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# What `kiln_trainer.loop` imports beyond Kiln: loaded once, shared by every child.
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.optim", "torch.utils.data",
           "numpy", "sympy", "pydantic", "yaml", "minio", "networkx", "safetensors.torch",
           "prometheus_client")
MODULE = "kiln_trainer"
ENABLE_ENV = "KUBESIM_FORK_TRAINERS"
_MESSAGE_BYTES = 1 << 20


def runs(command: Sequence[str]) -> bool:
    """Whether the zygote can start `command`: ``python -m kiln_trainer ...``."""
    return (len(command) >= 3 and Path(command[0]).name.startswith("python")
            and list(command[1:3]) == ["-m", MODULE])


class Process:
    """A pod's process, forked by the zygote: what the kubelet reads of a Popen."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self._zygote, self.pid = zygote, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            code = self._zygote.wait_exit(self.pid, timeout)
            if code is None:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            self.returncode = code
        return self.returncode


class Zygote:
    """The zygote process and the thread that reads its answers (one per test process)."""

    def __init__(self) -> None:
        self._socket, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        tests = str(Path(__file__).resolve().parents[1])  # where `kubesim` is found
        env = {**os.environ, "OMP_NUM_THREADS": "1",  # as every pod of the kubelet has it
               "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
        self._process = subprocess.Popen(
            [sys.executable, "-m", "kubesim.zygote", str(theirs.fileno())], env=env,
            pass_fds=(theirs.fileno(),), start_new_session=True)
        theirs.close()
        self._lock = threading.Condition()
        self._started: dict[int, int] = {}  # request id -> pid
        self._exits: dict[int, int] = {}  # pid -> exit code (negative: the signal)
        self._requests = 0
        self._gone = False
        self._reader = threading.Thread(target=self._read, name="kubesim-zygote", daemon=True)
        self._reader.start()

    def start_pod(self, command: Sequence[str], *, cwd: Path, env: dict[str, str],
                  log: io.BufferedWriter) -> Process:
        """Fork a child that runs `command` (`runs` must hold) with stdout and stderr to `log`."""
        with self._lock:
            self._requests += 1
            request = self._requests
            message = json.dumps({"id": request, "args": list(command[3:]), "cwd": str(cwd),
                                  "env": env}).encode()
            socket.send_fds(self._socket, [message], [log.fileno()])
            while request not in self._started:
                if self._gone:
                    raise RuntimeError("the zygote exited")
                self._lock.wait(1.0)
            return Process(self, self._started.pop(request))

    def exit_code(self, pid: int) -> int | None:
        with self._lock:
            if pid not in self._exits and self._gone:
                raise RuntimeError(f"the zygote exited before pid {pid}")
            return self._exits.get(pid)

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        with self._lock:
            self._lock.wait_for(lambda: pid in self._exits or self._gone, timeout)
            return self.exit_code(pid)

    def close(self) -> None:
        with contextlib.suppress(OSError):  # the zygote exits on end of file; children go on
            self._socket.shutdown(socket.SHUT_RDWR)
        self._process.wait(timeout=30)
        self._reader.join(timeout=30)
        self._socket.close()

    def _read(self) -> None:
        while True:
            try:
                data = self._socket.recv(_MESSAGE_BYTES)
            except OSError:
                data = b""
            with self._lock:
                if not data:
                    self._gone = True
                    self._lock.notify_all()
                    return
                answer = json.loads(data)
                if "started" in answer:
                    self._started[answer["started"]] = answer["pid"]
                else:
                    self._exits[answer["exited"]] = answer["code"]
                self._lock.notify_all()


_shared: Zygote | None = None
_shared_lock = threading.Lock()


def shared() -> Zygote:
    """This test process's zygote, started on first use."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = Zygote()
            atexit.register(_shared.close)
        return _shared


def enabled() -> bool:
    """Whether kubelets fork trainer pods (`ENABLE_ENV`: set it to 0 to start each as a new
    interpreter, e.g. to rule the zygote out when a pod misbehaves)."""
    return os.environ.get(ENABLE_ENV, "1") != "0"


def _serve(channel: socket.socket) -> None:
    """The zygote's loop: one thread (forking is safe), requests in, pids and exits out."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        readable, _, _ = select.select([channel], [], [], 0.05)
        if readable:
            message, fds, _, _ = socket.recv_fds(channel, _MESSAGE_BYTES, 1)
            if not message:
                return
            request = json.loads(message)
            ready, confirm = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(ready)
                _child(channel, request, fds[0], confirm)
            os.close(confirm)
            os.read(ready, 1)  # its own session exists: the kubelet may signal its group
            os.close(ready)
            os.close(fds[0])
            channel.send(json.dumps({"started": request["id"], "pid": pid}).encode())
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            code = os.waitstatus_to_exitcode(status)
            channel.send(json.dumps({"exited": pid, "code": code}).encode())


def _child(channel: socket.socket, request: dict[str, Any], log: int, confirm: int) -> None:
    """In the forked child: become the pod's process, run the trainer, never return."""
    code = 1
    try:
        channel.close()
        os.setsid()
        os.write(confirm, b"x")
        os.close(confirm)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        for fd in (null, log):
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
        sys.stdout = io.TextIOWrapper(open(1, "wb", buffering=0 if unbuffered else -1,  # noqa: SIM115
                                           closefd=False),
                                      write_through=unbuffered, encoding="utf-8")
        sys.stderr = io.TextIOWrapper(open(2, "wb", closefd=False),  # noqa: SIM115
                                      line_buffering=True, encoding="utf-8",
                                      errors="backslashreplace")
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [request["cwd"], *extra, *_BASE_PATH]
        sys.argv = [MODULE, *request["args"]]
        runpy.run_module(MODULE, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - a pod's crash: its traceback goes to its log
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


_BASE_PATH: list[str] = []

if __name__ == "__main__":
    import importlib

    # The interpreter's own path, without this script's folder or the test process's PYTHONPATH.
    inherited = {p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    _BASE_PATH[:] = [p for p in sys.path[1:] if p not in inherited]
    for name in PRELOAD:
        importlib.import_module(name)
    _serve(socket.socket(fileno=int(sys.argv[1])))

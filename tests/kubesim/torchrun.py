"""torchrun's agent as the test kubelet runs it: real, but its trainer workers forked.

A pod's ``python -m torch.distributed.run ARGS`` runs as ``python .../torchrun.py ARGS``: torch's
own agent, whose ``python -u -m kiln_trainer`` workers the kubelet forks from its zygote
(`Forker`, asked over the Unix socket `SOCKET_ENV` names), as it starts one-process trainers.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where it forks: the agent imports nothing of Kiln's
    from kiln.local import zygote

SOCKET_ENV = "KUBESIM_FORK_SOCKET"
AGENT = Path(__file__).resolve()
_MESSAGE_BYTES = 1 << 18


def is_torchrun(command: list[str]) -> bool:
    """Whether `command` is ``python -m torch.distributed.run ...``."""
    return command[1:3] == ["-m", "torch.distributed.run"]


def agent_command(command: list[str], env: dict[str, str], forker: Forker
                  ) -> tuple[list[str], dict[str, str]]:
    """The command and environment that run torchrun `command` with `forker`'s workers."""
    return [command[0], str(AGENT), *command[3:]], {**env, SOCKET_ENV: str(forker.path)}


class Forker:
    """Forks an agent's workers from the zygote: per connection, a start request (command,
    environment, working directory; stdin, stdout, stderr as fds) answered with the pid (or
    none: the agent starts it itself), then waits answered with the exit code."""

    def __init__(self) -> None:
        self._folder = Path(tempfile.mkdtemp(prefix="kubesim-"))  # a short path: 108 bytes
        self.path = self._folder / "fork.sock"
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._server.bind(str(self.path))
        self._server.listen()
        threading.Thread(target=self._accept, name="kubesim-forker", daemon=True).start()

    def close(self) -> None:
        self._server.shutdown(socket.SHUT_RDWR)
        self._server.close()
        shutil.rmtree(self._folder, ignore_errors=True)

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(connection,), daemon=True,
                             name="kubesim-forked-worker").start()

    def _serve(self, connection: socket.socket) -> None:
        with connection:
            message, fds, _, _ = socket.recv_fds(connection, _MESSAGE_BYTES, 3)
            try:
                process = _fork(json.loads(message), fds) if len(fds) == 3 else None
            finally:
                for fd in fds:
                    os.close(fd)
            with contextlib.suppress(OSError):  # the agent was killed: its workers go on
                connection.send(json.dumps({"pid": process and process.pid}).encode())
                while process is not None and (request := connection.recv(_MESSAGE_BYTES)):
                    try:
                        code: int | None = process.wait(json.loads(request)["timeout"])
                    except subprocess.TimeoutExpired:
                        code = None
                    connection.send(json.dumps({"code": code}).encode())


def _fork(request: dict[str, Any], fds: list[int]) -> zygote.Process | None:
    """``python -u -m kiln_trainer ARGS`` forked from the zygote as a new session (as torch
    starts workers), unbuffered as ``-u`` makes it; None where it cannot be."""
    from kiln.local import zygote

    command, env = request["command"], request["env"]
    if command[1:4] != ["-u", "-m", zygote.MODULE]:
        return None
    return zygote.start([command[0], *command[2:]], env={**env, "PYTHONUNBUFFERED": "1"},
                        cwd=request["cwd"], stdin=fds[0], stdout=fds[1], stderr=fds[2],
                        new_session=True)


class ForkedWorker:
    """A worker the kubelet forked, read and signalled as the `subprocess.Popen` torch keeps."""

    def __init__(self, connection: socket.socket, pid: int) -> None:
        self._connection, self.pid = connection, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self._wait(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._wait(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        return code

    def _wait(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            self._connection.send(json.dumps({"timeout": timeout}).encode())
            self.returncode = json.loads(self._connection.recv(_MESSAGE_BYTES))["code"]
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _forked(path: str, args: tuple[str, ...], env: dict[str, str], stdout: Any, stderr: Any
            ) -> ForkedWorker | None:
    """Ask the kubelet (at `path`) to fork the worker `args` with the streams Popen would give
    it; None when it does not."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fds = [0, stdout.fileno() if stdout else 1, stderr.fileno() if stderr else 2]
    message = json.dumps({"command": list(args), "env": env, "cwd": os.getcwd()}).encode()
    try:
        connection.connect(path)
        socket.send_fds(connection, [message], fds)
        pid = json.loads(connection.recv(_MESSAGE_BYTES) or b"{}").get("pid")
    except OSError:
        pid = None
    if pid is None:
        connection.close()
        return None
    return ForkedWorker(connection, pid)


def _main() -> None:
    # the kubelet's modules (this script's folder) are no part of the agent's path
    sys.path[:] = [p for p in sys.path if Path(p).resolve() != AGENT.parent]
    from torch.distributed.elastic.multiprocessing.subprocess_handler import (
        subprocess_handler,
    )

    handler = subprocess_handler.SubprocessHandler
    popen = handler._popen
    path = os.environ.pop(SOCKET_ENV)  # the workers' environment is the agent's, as torchrun's

    def forked_or_popen(self: Any, args: tuple[str, ...], env: dict[str, str]) -> Any:
        return _forked(path, args, env, self._stdout, self._stderr) or popen(self, args, env)

    handler._popen = forked_or_popen  # type: ignore[method-assign]
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    _main()

"""Trainer processes started as the test kubelet starts a pod's: ``python -m kiln_trainer`` forked
from this process's zygote (torch imported once), torchrun's agent with its workers forked the
same way, anything else (or everything, under ``KILN_FORK_TRAINERS=0``) as a process of its own.
"""

from __future__ import annotations

import dataclasses
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

from kubesim import torchrun

from kiln.local import zygote

_lock = threading.Lock()
_forker: torchrun.Forker | None = None  # this process's, for tests outside a kubelet


def start(command: list[str], *, env: dict[str, str], cwd: str | Path | None, stdout: int,
          stderr: int, new_session: bool = False, fork: bool = True,
          forker: Callable[[], torchrun.Forker] | None = None,
          ) -> subprocess.Popen[bytes] | zygote.Process:
    """Start `command` with the file descriptors `stdout` and `stderr`, forked where it can be
    (`fork`); `forker` gives the torchrun agent's fork server (default: this process's)."""
    where = None if cwd is None else str(cwd)
    if fork:
        forked = zygote.start(command, env=env, cwd=where, stdout=stdout, stderr=stderr,
                              new_session=new_session)
        if forked is not None:
            return forked
        if torchrun.is_torchrun(command):
            command, env = torchrun.agent_command(command, env, (forker or shared_forker)())
    return subprocess.Popen(command, cwd=where, env=env, stdout=stdout, stderr=stderr,
                            start_new_session=new_session)


def shared_forker() -> torchrun.Forker:
    """This process's torchrun fork server, started on first use (it ends with the process)."""
    global _forker
    with _lock:
        if _forker is None:
            _forker = torchrun.Forker()
        return _forker


@dataclasses.dataclass
class Trainer:
    """A started trainer whose standard streams go to files: read them once it has ended."""

    process: subprocess.Popen[bytes] | zygote.Process
    stdout: Path
    stderr: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.poll()

    def poll(self) -> int | None:
        return self.process.poll()

    def send_signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def terminate(self) -> None:
        self.process.terminate()

    def wait(self, timeout: float | None = None) -> int:
        return self.process.wait(timeout)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Wait for the end (`subprocess.TimeoutExpired` past `timeout`); stdout and stderr."""
        self.process.wait(timeout)
        return self.output()

    def output(self) -> tuple[str, str]:
        """What it wrote so far to stdout and stderr."""
        return (self.stdout.read_text(encoding="utf-8", errors="replace"),
                self.stderr.read_text(encoding="utf-8", errors="replace"))


def run(command: list[str], *, env: dict[str, str], logs: Path, cwd: str | Path | None = None,
        new_session: bool = False) -> Trainer:
    """`start` with stdout and stderr to ``<logs>.stdout`` and ``<logs>.stderr``."""
    out, err = logs.with_suffix(".stdout"), logs.with_suffix(".stderr")
    with out.open("wb") as stdout, err.open("wb") as stderr:
        process = start(command, env=env, cwd=cwd, stdout=stdout.fileno(),
                        stderr=stderr.fileno(), new_session=new_session)
    return Trainer(process, out, err)

"""A user's training script run as Kiln runs it: the container environment the operator's pod or
`kiln run` gives it, the events it writes, and a SIGTERM (a node drain) once it has evaluated its
first epoch. Shared by the own-loop, Hugging Face and Lightning script tests.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from kiln import contract


def container_env(tmp_path: Path, job_file: Path, code: Path,
                  extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """What the operator's pod or `kiln run` gives the trainer container (`contract.Env`), with
    the script's folder `code` importable (the image or `kiln run` does that) and the zoo,
    checkpoints and termination log under `tmp_path`."""
    (tmp_path / "termination-log").touch()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": str(code),
           contract.Env.JOB_FILE.value: str(job_file),
           contract.Env.ZOO.value: str(tmp_path / "zoo"),
           contract.Env.CHECKPOINTS.value: str(tmp_path / "checkpoints"),
           contract.Env.TERMINATION_LOG.value: str(tmp_path / "termination-log"),
           **(extra or {})}
    env.pop(contract.Env.JOB.value, None)
    return env


def events(stdout: str) -> list[contract.Event]:
    return [e for e in map(contract.from_line, stdout.splitlines()) if e is not None]


def infos(written: list[contract.Event]) -> list[str]:
    return [e.message for e in written if isinstance(e, contract.Info)]


def evaluations(written: list[contract.Event]) -> list[contract.Progress]:
    return [e for e in written if isinstance(e, contract.Progress) and e.evaluated]


def stop_after_first_evaluation(command: Sequence[str], *, cwd: Path, env: Mapping[str, str],
                                timeout: float) -> None:
    """Run `command` and send it SIGTERM when it reports its first evaluated epoch.

    Asserts that it exits with 128 + SIGTERM and that its last event says it stopped.
    """
    process = subprocess.Popen(list(command), cwd=cwd, env=dict(env), stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True)
    assert process.stdout is not None
    for line in process.stdout:  # a resume starts after the epoch evaluated
        event = contract.from_line(line)
        if isinstance(event, contract.Progress) and event.evaluated:
            break
    process.send_signal(signal.SIGTERM)
    rest, _ = process.communicate(timeout=timeout)
    assert process.returncode == 128 + signal.SIGTERM, rest[-2000:]
    stopped = [e.message for e in map(contract.from_line, rest.splitlines())
               if isinstance(e, contract.Info)]
    assert stopped and stopped[-1].startswith(contract.STOPPED_PREFIX), rest[-2000:]

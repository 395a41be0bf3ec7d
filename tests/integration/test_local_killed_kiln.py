"""A `kiln run` or `kiln sweep run` killed outright (SIGKILL, as the out-of-memory killer kills):
its trainer, forked from the zygote or a new interpreter, is sent SIGTERM by the kernel, so it
checkpoints and stops instead of training on unwatched while the sweep's state says Running.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubesim import client

from kiln import api, contract
from kiln.zoo import records, store

pytestmark = [pytest.mark.process, pytest.mark.training,
              pytest.mark.skipif(sys.platform != "linux",
                                 reason="the kernel's parent-death signal is Linux's")]

KILN = [sys.executable, "-m", "kiln.cli"]
DEADLINE_SECONDS = 180.0  # kiln and its trainer starting on a busy machine
STOP_SECONDS = 60.0  # a stopped trainer ends one 0.1 s step and writes a small checkpoint
PR_SET_CHILD_SUBREAPER = 36

# Training steps that sleep: epochs of seconds at little CPU, so the trainer is mid-training
# when kiln dies and, unstopped, would train on for an hour.
PROBE = '''
import json, os, time
from pathlib import Path

import torch


class Slow(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and x.shape[0] > 1:  # past the one-sample probe
            time.sleep(0.1)
        return self.fc(x.flatten(1))


def build() -> Slow:
    here = Path(__file__).parent
    seen = {"pid": os.getpid(), "ppid": os.getppid()}
    (here / "seen.tmp").write_text(json.dumps(seen), encoding="utf-8")
    (here / "seen.tmp").replace(here / "seen.json")  # whole when the test sees the name
    return Slow()
'''

SPEC: dict[str, Any] = {
    "model": {"entrypoint": "probe:build", "task": "classification", "inputShape": [1, 8, 8]},
    "dataset": {"name": "digits"},
    "training": {"epochs": 1000, "batchSize": 64, "optimizer": {"name": "adam", "lr": 0.01}},
    "freezing": {"enabled": False},  # no reference process beside the trainer
}


@pytest.fixture
def orphans() -> Iterator[None]:
    """This process as the subreaper of what kiln leaves: its trainer's exit code comes here
    (from the kernel, as to init) once its parent is gone."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, ctypes.c_ulong(1)) == 0
    try:
        yield
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, ctypes.c_ulong(0))


def _env(fork: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           contract.Env.FORK_TRAINERS: fork}
    for name in ("KILN_ZOO", "PYTHONPATH", contract.Env.STOP_WITH_PARENT):
        env.pop(name, None)
    return env


def _exit_code(pid: int, left: set[int], *, timeout: float, what: str) -> int:
    """`pid`'s exit code, reaped here once its parent has gone (`orphans`); it leaves `left`."""

    def ended() -> tuple[int] | None:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # its parent's still (the zygote, until it ends)
            return None
        return (os.waitstatus_to_exitcode(status),) if done else None

    code: tuple[int] = client.wait_until(ended, timeout_seconds=timeout, what=what,
                                         poll_seconds=0.1)
    left.discard(pid)  # reaped: its pid may be another process's now
    return code[0]


def _kill_mid_training(folder: Path, args: list[str], *, fork: str) -> tuple[Path, int]:
    """Start ``kiln ARGS`` in `folder`, SIGKILL it once its trainer has checkpointed an epoch,
    and check that the trainer (and its zygote) end; the checkpoint and the trainer's code."""
    out = open(folder / "kiln.out", "w", encoding="utf-8")  # noqa: SIM115 (closed below)
    # its output to a file: the zygote holds kiln's stderr, a pipe's end would never come
    process = subprocess.Popen([*KILN, *args, "--zoo", "zoo"], cwd=folder, env=_env(fork),
                               stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                               start_new_session=True)
    seen = folder / "seen.json"
    left: set[int] = set()  # the trainer and zygote while they are not reaped
    try:
        def checkpointed() -> Path | None:
            assert process.poll() is None, (folder / "kiln.out").read_text(encoding="utf-8")
            found = sorted((folder / "zoo" / "checkpoints").rglob("checkpoint.pt"))
            return found[0] if found and seen.exists() else None

        checkpoint = client.wait_until(checkpointed, timeout_seconds=DEADLINE_SECONDS,
                                       what="the trainer's first epoch's checkpoint")
        written = checkpoint.stat().st_mtime_ns
        trainer = json.loads(seen.read_text(encoding="utf-8"))
        left |= {trainer["pid"], *([trainer["ppid"]] if fork == "1" else [])}
        assert (trainer["ppid"] != process.pid) is (fork == "1")  # forked: the zygote's child
        os.kill(process.pid, signal.SIGKILL)  # kiln alone, as the out-of-memory killer does
        assert process.wait(timeout=STOP_SECONDS) == -signal.SIGKILL
        code = _exit_code(trainer["pid"], left, timeout=STOP_SECONDS,
                          what="the trainer to stop")
        if fork == "1":
            assert _exit_code(trainer["ppid"], left, timeout=STOP_SECONDS,
                              what="the zygote to end") == 0
        assert checkpoint.stat().st_mtime_ns > written  # written again on the way out
        return checkpoint, code
    finally:
        out.close()
        if process.poll() is None:
            process.kill()
            process.wait()
        for pid in left:  # what a failed check leaves: killed, and reaped here
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass


@pytest.mark.parametrize("fork", ["1", "0"], ids=["forked", "new-interpreter"])
def test_a_killed_kiln_run_stops_its_trainer_which_checkpoints(
        tmp_path: Path, fork: str, orphans: None) -> None:
    (tmp_path / "probe.py").write_text(PROBE, encoding="utf-8")
    doc = {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob",
           "metadata": {"name": "stray"}, "spec": SPEC}
    (tmp_path / "stray.yaml").write_text(yaml.safe_dump(doc), encoding="utf-8")
    checkpoint, code = _kill_mid_training(tmp_path, ["run", "stray.yaml"], fork=fork)
    assert code == 128 + signal.SIGTERM  # stopped by the signal, after its checkpoint
    assert checkpoint.parent.name == "stray"
    assert records.list_records(store.DirStore(tmp_path / "zoo")) == []  # never finished


def test_a_killed_sweep_run_stops_its_trial_which_a_rerun_would_resume(
        tmp_path: Path, orphans: None) -> None:
    (tmp_path / "probe.py").write_text(PROBE, encoding="utf-8")
    doc = {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSweep",
           "metadata": {"name": "killed"},
           "spec": {"template": SPEC, "warmStart": "independent", "maxTrials": 1,
                    "parallelTrials": 1,
                    "parameters": [{"path": "training.optimizer.lr",
                                    "float": {"min": 0.005, "max": 0.02}}]}}
    (tmp_path / "killed.yaml").write_text(yaml.safe_dump(doc), encoding="utf-8")
    _, code = _kill_mid_training(tmp_path, ["sweep", "run", "killed.yaml"], fork="1")
    assert code == 128 + signal.SIGTERM
    state = json.loads((tmp_path / ".kiln" / "runs" / "killed.sweep.json").read_text("utf-8"))
    (trial,) = api.sweep.parse_sweep(state).status.history  # type: ignore[union-attr]
    assert trial.state is api.sweep.TrialState.RUNNING  # as it stopped: resumed by a rerun
    assert records.list_records(store.DirStore(tmp_path / "zoo")) == []

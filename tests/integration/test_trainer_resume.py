"""The trainer as a process: killed after a checkpoint, it resumes; SIGTERM checkpoints.

Runs ``python -m kiln_trainer`` on scikit-learn's digits with a small CNN, forked as the test
kubelet forks a pod's (`trainerproc`: a real process, torch imported once). Trainers get
OMP_NUM_THREADS=1: tiny models train fastest on one thread, and a shared 2-core machine
otherwise slows to a crawl from spinning OpenMP workers.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import trainerproc
import yaml

POLL_SECONDS = 0.01
START_DEADLINE_SECONDS = 120.0  # importing torch on a loaded machine takes a while


def _write_job(path: Path, name: str, *, epochs: int) -> Path:
    job = {
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name},
        "spec": {
            "model": {"architecture": "small_cnn", "args": {"depth": 3, "width": 16},
                      "inputShape": [1, 8, 8]},
            "dataset": {"name": "digits"},
            "training": {"epochs": epochs, "batchSize": 32,
                         "optimizer": {"name": "adam", "lr": 0.005, "weightDecay": 0.0}},
            "freezing": {"enabled": False},  # no reference process beside each trainer
        },
    }
    path.write_text(yaml.safe_dump(job), encoding="utf-8")
    return path


def _start(job: Path, checkpoints: Path, logs: Path) -> trainerproc.Trainer:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("KILN_ZOO", None)
    return trainerproc.run(
        [sys.executable, "-m", "kiln_trainer", "--job", str(job), "--checkpoint-dir",
         str(checkpoints)], env=env, logs=logs)


def _wait_for(path: Path, process: trainerproc.Trainer) -> None:
    deadline = time.monotonic() + START_DEADLINE_SECONDS
    while not path.exists():
        assert process.poll() is None, f"trainer exited early: {process.communicate()[1][-2000:]}"
        assert time.monotonic() < deadline, f"no checkpoint at {path}"
        time.sleep(POLL_SECONDS)


def _events(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def test_a_killed_trainer_resumes_from_its_checkpoint_and_finishes(tmp_path: Path) -> None:
    job = _write_job(tmp_path / "job.yaml", "digits-resume", epochs=12)
    checkpoints = tmp_path / "checkpoints"
    saved = checkpoints / "default" / "digits-resume" / "checkpoint.pt"

    first = _start(job, checkpoints, tmp_path / "first")
    _wait_for(saved, first)
    first.send_signal(signal.SIGKILL)
    stdout, _ = first.communicate(timeout=60)
    assert first.returncode == -signal.SIGKILL
    assert not any(e["event"] == "result" for e in _events(stdout))

    second = _start(job, checkpoints, tmp_path / "second")
    stdout, stderr = second.communicate(timeout=300)
    assert second.returncode == 0, stderr[-3000:]
    lines = _events(stdout)
    result = lines[-1]
    assert result["event"] == "result", stdout[-2000:]
    assert result["resumed_from_epoch"] >= 1
    assert result["epochs_run"] == 12
    assert any(e["event"] == "info" and e["message"].startswith("resumed") for e in lines)
    assert not saved.exists()  # a finished job leaves no checkpoint behind


def test_sigterm_saves_a_checkpoint_and_exits_143(tmp_path: Path) -> None:
    job = _write_job(tmp_path / "job.yaml", "digits-term", epochs=200)
    checkpoints = tmp_path / "checkpoints"
    saved = checkpoints / "default" / "digits-term" / "checkpoint.pt"

    process = _start(job, checkpoints, tmp_path / "trainer")
    _wait_for(saved, process)
    first_checkpoint_ns = saved.stat().st_mtime_ns
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    lines = _events(stdout)
    assert lines[-1]["event"] == "info" and "checkpoint saved" in lines[-1]["message"]
    assert not any(e["event"] == "result" for e in lines)
    assert saved.stat().st_mtime_ns >= first_checkpoint_ns
    assert "Traceback" not in stderr

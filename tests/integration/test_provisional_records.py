"""Provisional zoo records: a sweep's second job warm-starts from the first while it trains,
and the first job's final record then replaces its provisional one under the same id.

The first job's trainer runs as a process (``python -m kiln_trainer``) on scikit-learn's
digits with a directory zoo, paused (SIGSTOP) once its provisional record is visible, so the
second job, trained in this process (`kiln_trainer.loop.main`), deterministically decides
while the first is still training.
"""

from __future__ import annotations

import io
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import trainerproc
import yaml

from kiln.api import jobfile
from kiln.zoo import records, store
from kiln_trainer import loop

# Listing while a record is replaced or deleted skips it with a warning: expected here.
pytestmark = pytest.mark.filterwarnings("ignore::kiln.zoo.records.SkippedRecordWarning")
POLL_SECONDS = 0.05
START_DEADLINE_SECONDS = 180.0  # importing torch on a loaded machine takes a while


def _job(path: Path, name: str, *, epochs: int) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name},
        "spec": {
            "model": {"architecture": "small_cnn", "args": {"depth": 2, "width": 8},
                      "inputShape": [1, 8, 8]},
            "dataset": {"name": "digits"},
            "training": {"epochs": epochs, "batchSize": 64,
                         "optimizer": {"name": "adam", "lr": 0.01, "weightDecay": 0.0}},
            "zoo": {"provisionalEveryEvaluations": 1},
            "freezing": {"enabled": False},  # no reference process beside each run
        }}), encoding="utf-8")
    return path


def _trainer(job: Path, zoo: Path) -> trainerproc.Trainer:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return trainerproc.run([sys.executable, "-m", "kiln_trainer", "--job", str(job), "--zoo",
                            str(zoo)], env=env, logs=job.with_suffix(""))


def _train_here(job: Path, zoo: Path) -> dict[str, Any]:
    """Train `job` in this process (torch is imported already: no start-up cost)."""
    return loop.main(jobfile.load_jobs(job)[0], zoo_uri=str(zoo), out=io.StringIO(),
                     termination_log=None)


def _provisional(zoo: store.DirStore) -> list[records.ZooRecord]:
    return [r for r in records.list_records(zoo) if r.provisional]


def _pause_with_provisional_record(process: trainerproc.Trainer,
                                   zoo: store.DirStore) -> records.ZooRecord:
    """SIGSTOP the trainer at a moment its provisional record is whole and visible."""
    deadline = time.monotonic() + START_DEADLINE_SECONDS
    while time.monotonic() < deadline:
        assert process.poll() is None, f"trainer exited: {process.communicate()[1][-2000:]}"
        if _provisional(zoo):
            process.send_signal(signal.SIGSTOP)
            found = _provisional(zoo)  # it may have been mid-replacement when stopped
            if found:
                return records.verify_record(zoo, found[0].id)
            process.send_signal(signal.SIGCONT)
        time.sleep(POLL_SECONDS)  # integration: polling a process
    raise AssertionError("no provisional record appeared")


def test_second_job_warm_starts_from_the_first_jobs_provisional_record(tmp_path: Path) -> None:
    zoo_dir = tmp_path / "zoo"
    zoo = store.DirStore(zoo_dir)
    first = _trainer(_job(tmp_path / "a.yaml", "sweep-a", epochs=300), zoo_dir)
    try:
        provisional = _pause_with_provisional_record(first, zoo)
        second = _train_here(_job(tmp_path / "b.yaml", "sweep-b", epochs=1), zoo_dir)
    finally:
        first.send_signal(signal.SIGCONT)
        first.send_signal(signal.SIGTERM)  # checkpoints, keeping its provisional record's id
        first.communicate(timeout=120)
    assert second["parent"] == provisional.id
    assert "provisional record" in second["warm_start"]
    assert provisional.job_name == "sweep-a"

    # The first job resumes with fewer epochs than it has done: it finishes at once, and its
    # final record takes the provisional one's place, so the second job's parent stays valid.
    final = _train_here(_job(tmp_path / "a.yaml", "sweep-a", epochs=1), zoo_dir)
    assert final["zoo_model"] == provisional.id
    record = records.verify_record(zoo, provisional.id)
    assert not record.provisional
    assert records.read_record(zoo, second["zoo_model"]).parent == provisional.id
    assert _provisional(zoo) == []

"""A full short training run as a process (forked as the test kubelet forks a pod's): digits to
>= 0.9 accuracy, registered in the zoo."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import trainerproc
import yaml

from kiln.zoo import records, store


def test_short_digits_run_reaches_target_and_registers_in_the_zoo(tmp_path: Path) -> None:
    job = {
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": "digits-full", "namespace": "team-a"},
        "spec": {
            "model": {"architecture": "small_resnet", "args": {"width": 8},
                      "inputShape": [1, 8, 8]},
            "dataset": {"name": "digits"},
            "training": {"epochs": 4, "batchSize": 64,
                         "optimizer": {"name": "adam", "lr": 0.01, "weightDecay": 0.0}},
            "target": {"metric": "validation_accuracy", "value": 0.9, "stopAtTarget": False},
            "freezing": {"enabled": False},  # no reference process beside the trainer
        },
    }
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job), encoding="utf-8")
    zoo_dir = tmp_path / "zoo"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # see test_trainer_resume's docstring
    done = trainerproc.run(
        [sys.executable, "-m", "kiln_trainer", "--job", str(job_file), "--zoo", str(zoo_dir)],
        env=env, logs=tmp_path / "trainer")
    stdout, stderr = done.communicate(timeout=300)
    assert done.returncode == 0, stderr[-3000:]
    lines = [json.loads(line) for line in stdout.splitlines()]
    result = lines[-1]
    assert result["event"] == "result"
    assert result["validation_accuracy"] >= 0.9
    assert result["target_reached"] and result["time_to_target_seconds"] is not None
    assert result["epochs_run"] == 4 and result["resumed_from_epoch"] == 0
    zoo = store.DirStore(zoo_dir)
    record = records.verify_record(zoo, result["zoo_model"])
    assert record.metric_name == "validation_accuracy"
    assert record.metric_value == result["metric"]
    assert record.samples_per_second and record.samples_per_second > 0
    assert record.job_spec["model"]["architecture"] == "small_resnet"
    assert records.load_graph(zoo, record)["input_shape"] == [1, 8, 8]
    assert zoo.list_keys("checkpoints/team-a/") == []

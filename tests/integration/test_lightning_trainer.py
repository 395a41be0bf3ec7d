"""A PyTorch Lightning script with Kiln's callback (examples/lightning/train_lightning.py), run
as `kiln run` and a pod run it: it reports progress and evaluations, freezes its front layers,
stops at its target, registers in the zoo, a deeper variant warm-starts from it, and it
checkpoints on SIGTERM and resumes with the epochs left.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import clirun
import pytest
import scriptrun
import yaml

from kiln import contract
from kiln.zoo import records, store

# the scripts import lightning, not this process (every pytest-xdist worker imports this module)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                reason="the lightning extra is not installed")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lightning"
JOB = EXAMPLE / "digits-lightning.yaml"
DEADLINE_SECONDS = 300.0
STEPS_PER_EPOCH = 23  # 1437 training samples / 64


def _job(tmp_path: Path, name: str, **spec: Any) -> Path:
    doc = yaml.safe_load(JOB.read_text(encoding="utf-8"))
    doc["metadata"]["name"] = name
    for section, values in spec.items():
        doc["spec"].setdefault(section, {}).update(values)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return path


def _kiln_run(tmp_path: Path, job_file: Path) -> clirun.Done:
    # a job file outside the example's folder finds train_lightning.py on the user's PYTHONPATH
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": str(EXAMPLE)}
    env.pop(contract.Env.ZOO.value, None)
    return clirun.kiln("run", str(job_file), "--zoo", "zoo", "--slots", "1", "-o", "json",
                       cwd=tmp_path, env=env)


@pytest.mark.training
def test_kiln_run_runs_the_lightning_example_and_a_deeper_variant_warm_starts_from_it(
        tmp_path: Path) -> None:
    first = _kiln_run(tmp_path, JOB)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    (result,) = json.loads(first.stdout)  # the result the script's callback reported
    history = [json.loads(line) for line in (tmp_path / ".kiln" / "runs" /
               "digits-lightning.metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [h["epoch"] for h in history] == list(range(1, len(history) + 1))  # one per epoch
    assert [h["step"] for h in history] == [STEPS_PER_EPOCH * h["epoch"] for h in history]
    assert history[-1]["validation_accuracy"] == result["validation_accuracy"]
    assert result["target_reached"] and result["epochs_run"] == len(history) < 6  # stopped
    assert result["freezing"] is not None and history[-1]["modules"] == 4
    assert result["zoo_model"] and result["parent"] is None

    # one epoch: the child's warm start is what is checked, not its accuracy
    deeper = _job(tmp_path, "digits-lightning-deeper", model={"args": {"depth": 3}},
                  training={"epochs": 1})
    second = _kiln_run(tmp_path, deeper)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    saved = sorted(records.list_records(store.DirStore(tmp_path / "zoo")),
                   key=lambda r: r.created_time)
    assert [r.job_name for r in saved] == ["digits-lightning", "digits-lightning-deeper"]
    assert saved[0].id == result["zoo_model"] and saved[0].entrypoint == "train_lightning:Digits"
    assert saved[0].parent is None and saved[1].parent == saved[0].id
    assert saved[1].similarity is not None and 0.3 < saved[1].similarity < 1.0


@pytest.mark.training
def test_a_lightning_script_checkpoints_on_sigterm_and_resumes_the_epochs_left(
        tmp_path: Path) -> None:
    epochs = 10  # 230 steps: far more than any machine trains between two lines read
    job = _job(tmp_path, "pl-stop", training={"epochs": epochs}, freezing={"enabled": False},
               target={"value": 0.999, "stopAtTarget": False})
    scriptrun.stop_after_first_evaluation([sys.executable, "-m", "train_lightning"],
                                           cwd=tmp_path,
                                           env=scriptrun.container_env(tmp_path, job, EXAMPLE),
                                           timeout=DEADLINE_SECONDS)
    assert (tmp_path / "checkpoints" / "default" / "pl-stop" / "checkpoint.pt").exists()

    done = subprocess.run([sys.executable, "-m", "train_lightning"], cwd=tmp_path,
                          env=scriptrun.container_env(tmp_path, job, EXAMPLE),
                          capture_output=True, text=True, timeout=DEADLINE_SECONDS, check=False)
    assert done.returncode == contract.EXIT_OK, done.stderr[-3000:]
    events = scriptrun.events(done.stdout)
    result = events[-1]
    assert isinstance(result, contract.Result), done.stdout[-2000:]
    infos = scriptrun.infos(events)
    assert any(m.startswith("resumed from") for m in infos), infos
    resumed = result.resumed_from_epoch
    assert resumed is not None and 1 <= resumed < epochs
    # Lightning trained the epochs left, each validated once; steps of an epoch cut short by
    # the signal (when it landed within one, not at its end) count too
    assert [e.epoch for e in scriptrun.evaluations(events)] == list(range(resumed + 1, epochs + 1))
    assert result.epochs_run == epochs and result.steps >= epochs * STEPS_PER_EPOCH
    assert not (tmp_path / "checkpoints" / "default" / "pl-stop" / "checkpoint.pt").exists()

"""A Hugging Face `Trainer` script with Kiln's callback (examples/hf/train_hf.py), run as a pod
or `kiln run` runs it: it reports progress and evaluations the contract's reader parses, freezes
its front layers, registers in the zoo, a deeper variant warm-starts from it under `kiln run`,
and it checkpoints on SIGTERM and resumes with the epochs left.
"""

from __future__ import annotations

import importlib.util
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

# the scripts import transformers, not this process (every pytest-xdist worker imports this module)
pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(name) is None for name in ("transformers", "accelerate")),
    reason="the hf extra is not installed")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf"
JOB = EXAMPLE / "bert-digits-trainer.yaml"
DEADLINE_SECONDS = 300.0
STEPS_PER_EPOCH = 23  # 1437 training samples / 64
# Every probe a decision and any plasticity converged: the front layers freeze within an epoch.
FORCED_FREEZING = {"checkEverySteps": 1, "window": 3, "patience": 1, "tolerance": 10,
                   "peakFraction": 1, "reference": "fp32"}
# A one-layer BERT a quarter as wide: an epoch costs a tenth, for tests that need no accuracy.
TINY = {"num_labels": 10, "num_hidden_layers": 1, "hidden_size": 16, "num_attention_heads": 2,
        "intermediate_size": 32, "vocab_size": 18}


def _job(tmp_path: Path, name: str, **spec: Any) -> Path:
    """The example's job file, renamed, with `spec`'s sections updated."""
    doc = yaml.safe_load(JOB.read_text(encoding="utf-8"))
    doc["metadata"]["name"] = name
    for section, values in spec.items():
        doc["spec"].setdefault(section, {}).update(values)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return path


def _run(tmp_path: Path, job_file: Path) -> tuple[list[contract.Event], contract.Result]:
    done = subprocess.run([sys.executable, "-m", "train_hf"], cwd=tmp_path,
                          env=scriptrun.container_env(tmp_path, job_file, EXAMPLE),
                          capture_output=True, text=True, timeout=DEADLINE_SECONDS, check=False)
    assert done.returncode == contract.EXIT_OK, done.stderr[-3000:]
    events = scriptrun.events(done.stdout)
    assert isinstance(events[-1], contract.Result), done.stdout[-2000:]
    return events, events[-1]


def _kiln_run(tmp_path: Path, job_file: Path) -> clirun.Done:
    # a job file outside the example's folder finds train_hf.py on the user's PYTHONPATH
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": str(EXAMPLE)}
    env.pop(contract.Env.ZOO.value, None)
    return clirun.kiln("run", str(job_file), "--zoo", "zoo", "--slots", "1", cwd=tmp_path, env=env)


@pytest.mark.training
def test_an_hf_trainer_script_reports_freezes_registers_and_a_deeper_variant_warm_starts_from_it(
        tmp_path: Path) -> None:
    """The example's script run as a pod runs it, then a deeper variant under `kiln run` with
    the same zoo: one parent serves both checks (they were two tests, each training one)."""
    # two layers (the five modules the policy sees) of TINY's width: accuracy is not checked
    job = _job(tmp_path, "hf-a", training={"epochs": 3}, freezing=FORCED_FREEZING,
               target={"value": 0.99, "stopAtTarget": False},
               model={"args": {**TINY, "num_hidden_layers": 2}})
    events, result = _run(tmp_path, job)
    evaluations = scriptrun.evaluations(events)  # one per epoch, with the Trainer's eval metrics
    assert [e.epoch for e in evaluations] == [1, 2, 3]
    assert all(e.steps_per_epoch == STEPS_PER_EPOCH for e in evaluations)
    assert evaluations[-1].validation_accuracy == result.validation_accuracy
    assert evaluations[-1].validation_loss == result.validation_loss
    infos = scriptrun.infos(events)
    assert infos[0].startswith("Cold start"), infos
    assert any(m.startswith("freezing: 5 modules") for m in infos), infos
    assert any(m.startswith("froze model.bert.embeddings") for m in infos), infos
    assert result.freezing is not None
    assert "model.bert.embeddings" in result.freezing["frozen"], result.freezing
    assert evaluations[-1].frozen_modules  # the progress line says how much is frozen
    assert result.steps == 3 * STEPS_PER_EPOCH and result.epochs_run == 3
    assert result.zoo_model and result.parent is None
    termination = contract.read_termination_message(
        (tmp_path / "termination-log").read_text(encoding="utf-8"))
    assert isinstance(termination, contract.Result) and termination.zoo_model == result.zoo_model
    (record,) = records.list_records(store.DirStore(tmp_path / "zoo"))
    assert record.id == result.zoo_model and record.entrypoint == "train_hf:classifier"
    assert not (tmp_path / "checkpoints" / "default" / "hf-a" / "checkpoint.pt").exists()

    # one epoch, freezing off: the warm start is what is checked here
    deeper = _job(tmp_path, "bert-digits-deeper", training={"epochs": 1},
                  freezing={"enabled": False}, model={"args": {**TINY, "num_hidden_layers": 3}})
    second = _kiln_run(tmp_path, deeper)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    saved = sorted(records.list_records(store.DirStore(tmp_path / "zoo")),
                   key=lambda r: r.created_time)
    assert [r.job_name for r in saved] == ["hf-a", "bert-digits-deeper"]
    assert saved[1].parent == record.id
    assert saved[1].similarity is not None and 0.3 < saved[1].similarity < 1.0
    assert "Warm start from" in second.stdout and "Kiln results" in second.stdout


@pytest.mark.training
def test_an_hf_trainer_script_checkpoints_on_sigterm_and_resumes_the_epochs_left(
        tmp_path: Path) -> None:
    epochs = 10  # 230 steps: far more than any machine trains between two lines read
    job = _job(tmp_path, "hf-stop", training={"epochs": epochs}, freezing={"enabled": False},
               target={"value": 0.99, "stopAtTarget": False}, model={"args": TINY})
    scriptrun.stop_after_first_evaluation([sys.executable, "-m", "train_hf"], cwd=tmp_path,
                                           env=scriptrun.container_env(tmp_path, job, EXAMPLE),
                                           timeout=DEADLINE_SECONDS)
    assert (tmp_path / "checkpoints" / "default" / "hf-stop" / "checkpoint.pt").exists()

    events, result = _run(tmp_path, job)
    infos = scriptrun.infos(events)
    assert any(m.startswith("resumed from") for m in infos), infos
    resumed = result.resumed_from_epoch
    assert resumed is not None and 1 <= resumed < epochs
    # the Trainer trained the epochs left, each evaluated once; the stopped steps count too
    assert [e.epoch for e in scriptrun.evaluations(events)] == list(range(resumed + 1, epochs + 1))
    assert result.epochs_run == epochs and result.steps > epochs * STEPS_PER_EPOCH
    assert not (tmp_path / "checkpoints" / "default" / "hf-stop" / "checkpoint.pt").exists()

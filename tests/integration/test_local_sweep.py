"""`kiln sweep run` as a user runs it: real trainer processes on the bundled digits, a search
that prunes a hopeless trial, chained warm starts (the sweep's best model kept over a closer,
weaker one), the leaderboard and the sweep's document, and a Ctrl-C mid-sweep that a rerun
resumes without losing or repeating a trial.

Tiny trials (an 8x8 CNN, one or two epochs, one thread): each trainer start costs seconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import clirun
import pytest
import waitfor
import yaml

from kiln import api
from kiln.zoo import records, store

pytestmark = [pytest.mark.process, pytest.mark.training]

KILN = [sys.executable, "-m", "kiln.cli"]
DEADLINE_SECONDS = 240.0


def _doc(name: str, *, parameters: list[dict[str, Any]], warm: str, epochs: int = 1,
         dataset: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    template = {
        "model": {"architecture": "small_cnn", "args": {"depth": 2, "width": 8},
                  "inputShape": [1, 8, 8]},
        "dataset": dataset or {"name": "digits"},
        "training": {"epochs": epochs, "batchSize": 64, "seed": 0,
                     "optimizer": {"name": "adam", "lr": 0.01, "weightDecay": 0.0}},
        "freezing": {"enabled": False},  # no reference process beside each trainer
    }
    return {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSweep",
            "metadata": {"name": name},
            "spec": {"template": template, "parameters": parameters, "warmStart": warm, **spec}}


def _sweep(path: Path, name: str, **how: Any) -> Path:
    path.write_text(yaml.safe_dump(_doc(name, **how)), encoding="utf-8")
    return path


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}
    env.pop("KILN_ZOO", None)
    return env


def _state(cwd: Path, name: str) -> api.sweep.TrainingSweep:
    doc = json.loads((cwd / ".kiln" / "runs" / f"{name}.sweep.json").read_text(encoding="utf-8"))
    return api.sweep.parse_sweep(doc)


def _zoo(cwd: Path) -> dict[str, records.ZooRecord]:
    return {r.id: r for r in records.list_records(store.DirStore(cwd / "zoo"))}


def _seed_drawing(values: list[dict[str, Any]], spec: dict[str, Any]) -> int:
    """The first random-search seed whose first two trials get `values` in that order."""
    from kiln import sweep

    for seed in range(100):
        search = sweep.Search(api.sweep.parse_sweep(_doc(
            "probe", warm="independent", epochs=2, algorithm={"name": "random", "seed": seed},
            **spec)).spec)
        if [search.ask(), search.ask()] == values:
            return seed
    raise AssertionError(f"no seed below 100 draws {values} in order")


def test_asha_prunes_the_hopeless_trial_and_independent_trials_start_cold(
        tmp_path: Path) -> None:
    # One trial at a time: a sane learning rate, then one too small to learn anything in an
    # epoch. Its first evaluation is far behind the first trial's at the same epoch, so
    # successive halving stops it there. The sampler's seed fixes that order.
    lrs = [0.01, 1e-6]
    spec = {"parameters": [{"path": "training.optimizer.lr", "categorical": lrs}],
            "maxTrials": 2, "parallelTrials": 1,
            "earlyStopping": {"name": "asha", "minEpochs": 1, "reductionFactor": 2}}
    file = _sweep(tmp_path / "lr.yaml", "lr", warm="independent", epochs=2,
                  algorithm={"name": "random", "seed": _seed_drawing(
                      [{"training.optimizer.lr": lr} for lr in lrs], spec)}, **spec)
    done = clirun.kiln("sweep", "run", str(file), "--zoo", "zoo", "-o", "json", cwd=tmp_path,
                       env=_env())
    assert done.returncode == 0, done.stderr
    swept = api.sweep.parse_sweep(json.loads(done.stdout))  # stdout: the document alone
    assert swept.status is not None and swept.status.phase is api.sweep.SweepPhase.SUCCEEDED
    good, bad = swept.status.history
    assert (good.name, bad.name) == ("lr-t0", "lr-t1")
    assert [t.params for t in (good, bad)] == [{"training.optimizer.lr": 0.01},
                                               {"training.optimizer.lr": 1e-6}]
    assert good.state is api.sweep.TrialState.SUCCEEDED
    assert [e[0] for e in good.evaluations] == [1, 2]
    assert bad.state is api.sweep.TrialState.PRUNED, bad
    assert bad.pruned_at is not None and bad.pruned_at.epoch == 1
    assert bad.pruned_at.value < good.evaluations[0][1]
    assert bad.pruned_at.against  # what it was compared with, in words
    assert len(bad.evaluations) == 1  # stopped at the rung, not trained on
    counts = swept.status.trials
    assert (counts.total, counts.succeeded, counts.pruned, counts.failed) == (2, 1, 1, 0)
    # Independent: no trial warm-started, nor did its zoo record name a parent.
    zoo = _zoo(tmp_path)
    assert good.parent is None and bad.parent is None
    assert good.zoo_model in zoo and zoo[good.zoo_model].parent is None
    assert zoo[good.zoo_model].job_name == "lr-t0"
    best = swept.status.best
    assert best is not None and (best.trial, best.zoo_model) == ("lr-t0", good.zoo_model)
    assert "lr-t1: pruning at epoch 1" in done.stderr
    # the state kept here is the same document, and `kiln sweep show` reads it by name
    assert _state(tmp_path, "lr") == swept
    shown = clirun.kiln("sweep", "show", "lr", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    rows = {line.split()[0]: line for line in shown.stdout.splitlines()
            if line.startswith("lr-t")}
    assert "Succeeded" in rows["lr-t0"] and "Pruned" in rows["lr-t1"]
    assert f"best zoo model: {good.zoo_model}" in shown.stdout


def test_chain_trials_warm_start_from_the_sweeps_own_best_model(tmp_path: Path) -> None:
    file = _sweep(tmp_path / "chain.yaml", "chain", warm="chain",
                  parameters=[{"path": "training.optimizer.lr",
                               "float": {"min": 0.005, "max": 0.02, "log": True}}],
                  maxTrials=2, parallelTrials=1)
    done = clirun.kiln("sweep", "run", str(file), "--zoo", "zoo", cwd=tmp_path, env=_env())
    assert done.returncode == 0, done.stderr
    first, second = _state(tmp_path, "chain").status.history  # type: ignore[union-attr]
    for t in (first, second):
        assert t.state is api.sweep.TrialState.SUCCEEDED
        assert 0.005 <= t.params["training.optimizer.lr"] <= 0.02
    zoo = _zoo(tmp_path)
    assert first.parent is None  # an empty zoo: the first trial is cold
    assert second.parent == first.zoo_model and first.zoo_model in zoo
    # same architecture: pruned (were it) only against trials that fine-tuned their own kind
    assert (first.similarity, second.similarity) == (None, 1.0)
    assert zoo[second.zoo_model].parent == first.zoo_model  # type: ignore[index]
    # the table and summary on stdout (a pipe: plain lines)
    assert "best zoo model:" in done.stdout and "wall time:" in done.stdout
    assert f"warm: {first.zoo_model}" in done.stdout
    plotted = clirun.kiln("plot", "--sweep", "chain", "--out", "trials.png", cwd=tmp_path)
    assert plotted.returncode == 0, plotted.stderr
    assert (tmp_path / "trials.png").stat().st_size > 0


def test_a_chained_trial_takes_the_sweeps_best_model_over_a_closer_weaker_one(
        tmp_path: Path) -> None:
    # The zoo already holds the second trial's own architecture, trained on 600 images for two
    # epochs: the policy picks it (the same architecture) and it beats a cold start. The first
    # trial's narrower model, widened so that it computes the same function, starts clearly
    # lower, and the guard keeps it.
    weak = _doc("weak", parameters=[], warm="independent")["spec"]["template"]
    weak["model"]["args"]["width"] = 16
    weak["dataset"] = {"name": "digits", "maxSamples": 600}
    weak["training"]["epochs"] = 2
    job = tmp_path / "weak.yaml"
    job.write_text(yaml.safe_dump({"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob",
                                   "metadata": {"name": "weak"}, "spec": weak}),
                   encoding="utf-8")
    ran = clirun.kiln("run", str(job), "--zoo", "zoo", cwd=tmp_path, env=_env())
    assert ran.returncode == 0, ran.stderr
    (weak_id,) = _zoo(tmp_path)
    widths = [8, 16]
    spec = {"parameters": [{"path": "model.args.width", "categorical": widths}],
            "maxTrials": 2, "parallelTrials": 1}
    file = _sweep(tmp_path / "best.yaml", "best", warm="chain", epochs=2,
                  algorithm={"name": "random", "seed": _seed_drawing(
                      [{"model.args.width": w} for w in widths], spec)}, **spec)
    done = clirun.kiln("sweep", "run", str(file), "--zoo", "zoo", cwd=tmp_path, env=_env())
    assert done.returncode == 0, done.stderr
    first, second = _state(tmp_path, "best").status.history  # type: ignore[union-attr]
    assert [t.params for t in (first, second)] == [{"model.args.width": w} for w in widths]
    assert second.parent == first.zoo_model and second.similarity is not None
    assert second.similarity < 1.0  # not the same architecture: the weak model was closer
    assert f"candidate {weak_id} (similarity 1.00) passed the guard, not kept: " in done.stdout


# A dataset that holds its trainer while a file exists, so the test, not the machine's speed,
# decides when the sweep is interrupted: with its first trial running.
HELD_DIGITS = '''\
import pathlib
import time

import torch
from sklearn.datasets import load_digits
from torch.utils.data import TensorDataset


def digits(hold):
    hold = pathlib.Path(hold)
    if hold.exists():
        hold.with_suffix(".reached").touch()
        while hold.exists():
            time.sleep(0.05)
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(y)
    return TensorDataset(x[:1400], y[:1400]), TensorDataset(x[1400:], y[1400:])
'''


def _interrupted(tmp_path: Path, name: str, *, trials: int) -> tuple[Path, str, str]:
    """Sweep `name` (one trial at a time) Ctrl-C'd while its first trainer loads its data:
    (its file, stdout, stderr)."""
    (tmp_path / "held_digits.py").write_text(HELD_DIGITS, encoding="utf-8")
    hold = tmp_path / "hold"
    hold.touch()
    file = _sweep(tmp_path / f"{name}.yaml", name, warm="independent",
                  dataset={"entrypoint": "held_digits:digits", "args": {"hold": str(hold)}},
                  parameters=[{"path": "training.optimizer.lr",
                               "float": {"min": 0.005, "max": 0.02}}],
                  maxTrials=trials, parallelTrials=1)
    process = subprocess.Popen([*KILN, "sweep", "run", str(file), "--zoo", "zoo"],
                               cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    waitfor.file_from(process, hold.with_suffix(".reached"), timeout=DEADLINE_SECONDS,
                      what="the first trial's trainer loading its data")
    os.killpg(process.pid, signal.SIGINT)  # Ctrl-C
    hold.unlink()
    out, err = process.communicate(timeout=DEADLINE_SECONDS)
    assert process.returncode == 130, err
    return file, out, err


def test_ctrl_c_mid_sweep_keeps_the_running_trial_and_a_rerun_resumes_it(
        tmp_path: Path) -> None:
    file, out, err = _interrupted(tmp_path, "resume", trials=2)
    assert "`kiln sweep run` again resumes it" in out + err
    (held,) = _state(tmp_path, "resume").status.history  # type: ignore[union-attr]
    assert (held.name, held.state) == ("resume-t0", api.sweep.TrialState.RUNNING)

    done = clirun.kiln("sweep", "run", str(file), "--zoo", "zoo", "-o", "json", cwd=tmp_path,
                       env=_env())
    assert done.returncode == 0, done.stderr
    history = api.sweep.parse_sweep(json.loads(done.stdout)).status.history  # type: ignore[union-attr]
    assert [t.name for t in history] == ["resume-t0", "resume-t1"]
    assert history[0].params == held.params  # the same trial, not a new draw
    assert all(t.state is api.sweep.TrialState.SUCCEEDED for t in history)
    said = out + err + done.stderr
    assert said.count("resume-t0: training") == 1 and said.count("resume-t0: resuming") == 1
    assert said.count("resume-t1: training") == 1
    assert sorted(r.job_name for r in _zoo(tmp_path).values()) == ["resume-t0", "resume-t1"]


def test_a_trial_that_finished_unwatched_is_taken_from_its_record_not_trained_again(
        tmp_path: Path) -> None:
    # A killed `kiln sweep run` can leave a trainer that finishes and registers its final
    # record while the state still says Running: the rerun records it from that record.
    file = _sweep(tmp_path / "one.yaml", "one", warm="independent",
                  parameters=[{"path": "training.optimizer.lr",
                               "float": {"min": 0.005, "max": 0.02}}],
                  maxTrials=1, parallelTrials=1)
    first = clirun.kiln("sweep", "run", str(file), "--zoo", "zoo", "-o", "json", cwd=tmp_path,
                        env=_env())
    assert first.returncode == 0, first.stderr
    (done,) = api.sweep.parse_sweep(json.loads(first.stdout)).status.history  # type: ignore[union-attr]
    assert done.state is api.sweep.TrialState.SUCCEEDED and done.zoo_model
    path = tmp_path / ".kiln" / "runs" / "one.sweep.json"
    doc = json.loads(path.read_text(encoding="utf-8"))
    trial = doc["status"]["history"][0]
    trial["state"] = "Running"
    for key in ("metric", "zooModel"):
        trial.pop(key, None)
    path.write_text(json.dumps(doc), encoding="utf-8")
    again = clirun.kiln("sweep", "run", str(file), "--zoo", "zoo", "-o", "json", cwd=tmp_path,
                        env=_env())
    assert again.returncode == 0, again.stderr
    assert "one-t0: had finished while no sweep run watched it: succeeded" in again.stderr
    assert "one-t0: resuming" not in again.stderr
    (taken,) = api.sweep.parse_sweep(json.loads(again.stdout)).status.history  # type: ignore[union-attr]
    assert taken.state is api.sweep.TrialState.SUCCEEDED
    assert (taken.zoo_model, taken.metric) == (done.zoo_model, pytest.approx(done.metric))
    assert sorted(r.job_name for r in _zoo(tmp_path).values()) == ["one-t0"]


def test_a_damaged_trial_file_is_made_again_and_the_trial_resumes(tmp_path: Path) -> None:
    file, _, _ = _interrupted(tmp_path, "damaged", trials=1)
    trial_file = tmp_path / ".kiln" / "runs" / "damaged-t0.json"
    trial_file.write_text("garbage{", encoding="utf-8")
    done = clirun.kiln("sweep", "run", str(file), "--zoo", "zoo", "-o", "json", cwd=tmp_path,
                       env=_env())
    assert done.returncode == 0, done.stderr
    assert "damaged-t0.json: unreadable (" in done.stderr and "damaged-t0: resuming" in done.stderr
    (trial,) = api.sweep.parse_sweep(json.loads(done.stdout)).status.history  # type: ignore[union-attr]
    assert trial.state is api.sweep.TrialState.SUCCEEDED


# An own command standing in for a trainer: one evaluation and a result, both reporting
# ACCURACY (and no loss), as a user's loop may.
REPORTING_TRAINER = '''\
import json
import sys

from kiln import contract

accuracy = float(sys.argv[1])
progress = contract.Progress(
    epoch=1, epochs=2, step=1, steps_per_epoch=1, train_loss=1.0,
    validation_accuracy=accuracy, validation_loss=None, samples_per_second=None,
    eta_seconds=None, elapsed_seconds=1.0, evaluated=True)
result = contract.Result(
    metric_name="validation_accuracy", metric=accuracy, validation_accuracy=accuracy,
    validation_loss=None, wall_seconds=1.0, time_to_target_seconds=None, target_reached=True,
    epochs_run=2, steps=2, samples_per_second=None, zoo_model=None, resumed_from_epoch=0)
for event in (progress, result):
    print(json.dumps({"event": event.KIND, **event.to_json()}), flush=True)
'''


def _reporting_sweep(tmp_path: Path, name: str, accuracy: float, **spec: Any) -> Path:
    script = tmp_path / "trainer.py"
    script.write_text(REPORTING_TRAINER, encoding="utf-8")
    doc = _doc(name, warm="independent", epochs=2,
               parameters=[{"path": "training.optimizer.lr", "float": {"min": 0.005, "max": 0.02}}],
               maxTrials=2, parallelTrials=1, **spec)
    doc["spec"]["template"]["template"] = {"command": ["python", str(script), str(accuracy)]}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return path


@pytest.mark.parametrize("objective", [{"target": 0.9}, {}])
def test_an_accuracy_reported_as_a_percentage_neither_reaches_the_target_nor_ranks_a_trial(
        tmp_path: Path, objective: dict[str, Any]) -> None:
    file = _reporting_sweep(tmp_path, "percent", 95.0, objective=objective)
    done = clirun.kiln("sweep", "run", str(file), "-o", "json", cwd=tmp_path, env=_env())
    assert done.returncode == 1, done.stderr
    assert "percent-t0: epoch 1: reported validation_accuracy 95.0, ignored: an accuracy is " \
           "a fraction in [0, 1] (got 95.0); write 0.91, not 91" in done.stderr, done.stderr
    swept = api.sweep.parse_sweep(json.loads(done.stdout))
    assert swept.status is not None and swept.status.best is None
    assert [t.state for t in swept.status.history] == [api.sweep.TrialState.SUCCEEDED] * 2
    assert all(t.metric is None and not t.evaluations for t in swept.status.history)
    failed = next(c for c in swept.status.conditions if c.type.value == "Failed")
    assert failed.reason == "ObjectiveNotReported"
    assert "none that succeeded reported validation_accuracy" in failed.message


def test_a_sweep_whose_trainer_never_reports_the_objective_fails_saying_so(
        tmp_path: Path) -> None:
    file = _reporting_sweep(tmp_path, "noloss", 0.5, objective={"metric": "validation_loss"})
    done = clirun.kiln("sweep", "run", str(file), cwd=tmp_path, env=_env())
    assert done.returncode == 1, done.stderr
    assert "phase: Failed: All 2 trials ended and none that succeeded reported " \
           "validation_loss, the objective" in done.stdout
    assert "set spec.objective.metric to one it reports" in done.stdout

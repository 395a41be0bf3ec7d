"""MLflow tracking against a real tracking server (`mlflow server`, sqlite store, started once for
the module): `kiln run` of a cold parent and its warm-started child with MLFLOW_TRACKING_URI
set logs each job's settings, per-evaluation metrics at their steps, the warm-start decision
and the outcome; an own loop's run that is stopped continues its MLflow run when resumed, and
ends it FAILED with the reason when it diverges."""

from __future__ import annotations

import io
import json
import math
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import clirun
import pytest
import torch
import yaml
from kubesim import client as kubesim_client

from kiln import api, contract
from kiln.local import runner
from kiln.zoo import records, store
from kiln_trainer import jobcontext, mlflow_tracking

pytestmark = pytest.mark.xdist_group(__name__)  # one worker, one server

SERVER_START_SECONDS = 180.0  # its first start creates the database's tables: slow when loaded
EXPERIMENT = "kiln-tests"


@pytest.fixture(scope="module")
def tracking_uri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("mlflow")
    port = kubesim_client.free_port()
    # One worker and no job runner (MLflow's GenAI jobs): a 2-core machine runs the tests too.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with open(folder / "server.log", "w", encoding="utf-8") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port",
             str(port), "--workers", "1", "--backend-store-uri",
             f"sqlite:///{folder / 'mlflow.db'}", "--default-artifact-root",
             str(folder / "artifacts")],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        def healthy() -> bool:
            if server.poll() is not None:
                raise AssertionError(f"mlflow server exited with {server.returncode}: "
                                     + (folder / "server.log").read_text()[-3000:])
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=5):
                    return True
            except (urllib.error.URLError, OSError):
                return False

        kubesim_client.wait_until(
            healthy, timeout_seconds=SERVER_START_SECONDS, what="the mlflow server to answer",
            poll_seconds=0.5, details=lambda: (folder / "server.log").read_text()[-3000:])
        yield uri
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # uvicorn's worker is in its process group
        server.wait(timeout=60)


def _client(uri: str) -> Any:
    from mlflow import MlflowClient  # imported here: every pytest-xdist worker collects this module

    return MlflowClient(tracking_uri=uri)


def _runs(uri: str) -> dict[str, Any]:
    mlflow_client = _client(uri)
    experiment = mlflow_client.get_experiment_by_name(EXPERIMENT)
    assert experiment is not None, "no run created the experiment"
    return {run.info.run_name: run for run in mlflow_client.search_runs(
        [experiment.experiment_id])}


def _job(path: Path, name: str, epochs: int) -> Path:
    doc = {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name},
           "spec": {"model": {"architecture": "small_cnn", "args": {"depth": 2, "width": 8},
                              "inputShape": [1, 8, 8]},
                    "dataset": {"name": "digits", "maxSamples": 400},
                    "training": {"epochs": epochs, "batchSize": 64,
                                 "optimizer": {"name": "adam", "lr": 0.01, "weightDecay": 0.0}},
                    "freezing": {"enabled": False}}}
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return path


def test_kiln_run_logs_params_metrics_per_evaluation_and_the_warm_start_decision(
        tracking_uri: str, tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MLFLOW_TRACKING_URI": tracking_uri,
           "MLFLOW_EXPERIMENT_NAME": EXPERIMENT}
    env.pop("KILN_ZOO", None)
    done = clirun.kiln("run", str(_job(tmp_path / "parent.yaml", "mlflow-parent", 1)),
                       str(_job(tmp_path / "child.yaml", "mlflow-child", 2)), "--zoo", "zoo",
                       "--slots", "1", cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    saved = {r.job_name: r for r in records.list_records(store.DirStore(tmp_path / "zoo"))}
    assert saved["mlflow-child"].parent == saved["mlflow-parent"].id

    runs = _runs(tracking_uri)
    parent, child = runs["mlflow-parent"], runs["mlflow-child"]
    for run, name in ((parent, "mlflow-parent"), (child, "mlflow-child")):
        assert run.info.status == "FINISHED"
        tags = run.data.tags
        assert tags["kiln.outcome"] == "succeeded" and tags["kiln.job"] == name
        assert tags["kiln.zoo_model"] == saved[name].id
    # the job's settings, flattened
    params = child.data.params
    assert params["training.epochs"] == "2" and params["training.optimizer.lr"] == "0.01"
    assert params["model.architecture"] == "small_cnn" and params["model.args.width"] == "8"
    assert params["dataset.maxSamples"] == "400" and params["freezing.enabled"] == "false"
    # one point per evaluation, at the step it was taken, with the values the run reported
    history = runner.read_history(tmp_path / ".kiln" / "runs" / "mlflow-child.metrics.jsonl")
    child_id = child.info.run_id
    logged = _client(tracking_uri).get_metric_history(child_id, "validation_accuracy")
    assert [(m.step, m.value) for m in logged] == [
        (line["step"], pytest.approx(line["validation_accuracy"])) for line in history]
    assert len(logged) == 2 and logged[0].step < logged[1].step
    losses = _client(tracking_uri).get_metric_history(child_id, "validation_loss")
    assert [m.step for m in losses] == [line["step"] for line in history]
    # the warm-start decision: the child took the parent; the parent found nothing to take
    tags = child.data.tags
    assert tags["kiln.warm_start.outcome"] == "warm"
    assert tags["kiln.warm_start.accepted"] == "true"
    assert tags["kiln.warm_start.parent"] == saved["mlflow-parent"].id
    assert float(tags["kiln.warm_start.similarity"]) == pytest.approx(1.0)
    assert saved["mlflow-parent"].id in tags["kiln.warm_start.reason"]
    decision = json.loads(Path(_client(tracking_uri).download_artifacts(
        child_id, mlflow_tracking.WARM_START_ARTIFACT, str(tmp_path))).read_text())
    assert decision["parent"] == saved["mlflow-parent"].id and decision["matched_tensors"] > 0
    cold = parent.data.tags
    assert cold["kiln.warm_start.outcome"].startswith("cold")
    assert cold["kiln.warm_start.accepted"] == "false" and "kiln.warm_start.parent" not in cold


def _context(tmp_path: Path) -> jobcontext.JobContext:
    job = {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob",
           "metadata": {"name": "mlflow-own"},
           "spec": {"model": {"architecture": "small_cnn", "inputShape": [1, 8, 8]},
                    "training": {"epochs": 3, "device": "cpu"}}}
    env = {contract.Env.JOB.value: json.dumps(job),
           contract.Env.CHECKPOINTS.value: str(tmp_path / "checkpoints")}
    return jobcontext.job_context(environ=env, out=io.StringIO(), handle_signals=False)


def _train(ctx: jobcontext.JobContext, model: torch.nn.Module, loss: float | None = None) -> None:
    """One step's bookkeeping (the weights' update is no concern here)."""
    value = model(torch.randn(8, 4)).square().mean() if loss is None else torch.tensor(loss)
    ctx.trained(value, samples=8)


def test_an_own_loop_continues_its_run_after_a_stop_and_ends_it_failed_when_it_diverges(
        tracking_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", EXPERIMENT)
    model = torch.nn.Linear(4, 2)
    first = _context(tmp_path)
    first.warm_start(model)
    first.resume(model, torch.optim.SGD(model.parameters(), lr=0.1), steps_per_epoch=1)
    _train(first, model)
    first.evaluated(accuracy=0.25, loss=1.5)
    with pytest.raises(jobcontext.Interrupted):
        first.interrupt()  # a stop signal's path: checkpoint, then stop
    first.close()
    run_id = first.state.mlflow_run_id
    assert run_id is not None
    stopped = _client(tracking_uri).get_run(run_id)
    assert stopped.info.status == "KILLED" and stopped.data.tags["kiln.outcome"] == "stopped"
    assert stopped.data.tags["kiln.warm_start.outcome"] == "cold_empty"  # no zoo

    second = _context(tmp_path)
    second.warm_start(model)
    assert second.resume(model, torch.optim.SGD(model.parameters(), lr=0.1),
                         steps_per_epoch=1) == 1
    assert second.state.mlflow_run_id == run_id  # the checkpoint's run, continued
    assert _client(tracking_uri).get_run(run_id).info.status == "RUNNING"
    _train(second, model)
    second.evaluated(accuracy=0.5, loss=1.0)
    with pytest.raises(SystemExit) as exited:
        _train(second, model, loss=math.nan)
    assert exited.value.code == contract.EXIT_INVALID
    ended = _client(tracking_uri).get_run(run_id)
    assert ended.info.status == "FAILED" and ended.data.tags["kiln.outcome"] == "failed"
    assert "training diverged" in ended.data.tags["kiln.failure"]
    points = _client(tracking_uri).get_metric_history(run_id, "validation_accuracy")
    assert [(p.step, p.value) for p in points] == [(1, 0.25), (2, 0.5)]  # one run, both starts


def test_freezing_events_are_a_metric_at_their_step_a_tag_and_a_json_artifact(
        tracking_uri: str, tmp_path: Path) -> None:
    job = api.parse_job({"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob",
                         "metadata": {"name": "mlflow-frozen"},
                         "spec": {"model": {"architecture": "small_cnn",
                                            "inputShape": [1, 8, 8]}}})
    cold = api.WarmStartDecision(outcome=api.WarmStartOutcome.COLD_EMPTY, reason="empty zoo")
    tracker = mlflow_tracking.open_run(
        {"MLFLOW_TRACKING_URI": tracking_uri, "MLFLOW_EXPERIMENT_NAME": EXPERIMENT}, job,
        run_id=None, decision=cold)
    assert tracker is not None
    events = [{"kind": "froze", "modules": ["stem"], "step": 12, "boundary": 1,
               "reason": "plasticity converged"},
              {"kind": "froze", "modules": ["block1"], "step": 30, "boundary": 2,
               "reason": "plasticity converged"}]
    tracker.freezing(events[:1], ["stem"], boundary=1, step=12)
    tracker.freezing(events, ["stem", "block1"], boundary=2, step=30)
    mlflow_client = _client(tracking_uri)
    points = mlflow_client.get_metric_history(tracker.run_id, "frozen_modules")
    assert [(p.step, p.value) for p in points] == [(12, 1.0), (30, 2.0)]
    run = mlflow_client.get_run(tracker.run_id)
    assert run.data.tags["kiln.freezing.frozen"] == "stem, block1"
    saved = mlflow_client.download_artifacts(tracker.run_id, mlflow_tracking.FREEZING_ARTIFACT,
                                             str(tmp_path))
    assert json.loads(Path(saved).read_text()) == {"events": events}

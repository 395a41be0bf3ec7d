"""`kiln_trainer.mlflow_tracking` without a server: off unless MLFLOW_TRACKING_URI is set, a job
that asks for MLflow without the library fails before any work naming the extra, and params
are the spec's settings flattened. (A real tracking server: tests/integration.)"""

from __future__ import annotations

import io
import json
import socket
import sys
import threading
from pathlib import Path

import pytest

from kiln import api, contract
from kiln_trainer import jobcontext, mlflow_tracking, runtime

JOB = {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "tracked"},
       "spec": {"model": {"architecture": "small_cnn", "args": {"width": 8},
                          "inputShape": [1, 8, 8]},
                "training": {"epochs": 2, "device": "cpu"}}}


def test_tracking_is_off_without_the_variable() -> None:
    assert not mlflow_tracking.enabled({})
    assert not mlflow_tracking.enabled({"MLFLOW_TRACKING_URI": "  "})


def test_asking_for_mlflow_without_the_library_names_the_extra(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if not installed
    with pytest.raises(runtime.ConfigError, match=r"kiln-operator\[mlflow\]"):
        mlflow_tracking.enabled({"MLFLOW_TRACKING_URI": "http://127.0.0.1:5000"})
    # an own loop's context exits as the trainer does, before training anything
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    env = {contract.Env.JOB.value: json.dumps(JOB),
           contract.Env.CHECKPOINTS.value: str(tmp_path / "checkpoints")}
    with pytest.raises(SystemExit) as exited:
        jobcontext.job_context(environ=env, out=io.StringIO(), handle_signals=False)
    assert exited.value.code == contract.EXIT_INVALID
    said = capsys.readouterr().err
    assert "MLFLOW_TRACKING_URI is set but the mlflow library is missing" in said
    assert "pip install mlflow-skinny" in said and "unset MLFLOW_TRACKING_URI" in said


def test_params_are_the_spec_settings_flattened_with_lists_as_json() -> None:
    wire = api.to_wire(api.parse_job(JOB).spec)
    params = dict(mlflow_tracking._flatten({"model": wire["model"],
                                            "training": wire["training"]}))
    assert params["model.architecture"] == "small_cnn" and params["model.args.width"] == "8"
    assert params["model.inputShape"] == "[1, 8, 8]" and params["training.epochs"] == "2"
    assert all(len(v) <= 6000 for v in params.values())
    long = dict(mlflow_tracking._flatten({"x": "y" * 7000}))
    assert len(long["x"]) == 6000 and long["x"].endswith("…")


COLD = api.WarmStartDecision(outcome=api.WarmStartOutcome.COLD_EMPTY, reason="empty zoo")


@pytest.fixture
def http_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """open_run sets MLflow's HTTP variables in the process environment: undone after."""
    for key in mlflow_tracking.HTTP_DEFAULTS:
        monkeypatch.delenv(key, raising=False)


@pytest.mark.process  # importing mlflow runs `uname`
def test_a_malformed_tracking_uri_warns_naming_the_variable_and_training_goes_on(
        http_defaults: None, caplog: pytest.LogCaptureFixture) -> None:
    tracker = mlflow_tracking.open_run({"MLFLOW_TRACKING_URI": "foo://bar"},
                                       api.parse_job(JOB), run_id=None, decision=COLD)
    assert tracker is None
    assert "MLFLOW_TRACKING_URI=foo://bar" in caplog.text
    assert "training continues without MLflow" in caplog.text


@pytest.mark.process  # importing mlflow runs `uname`
def test_a_tracking_server_answering_garbage_is_given_up_after_a_few_tries(
        http_defaults: None, caplog: pytest.LogCaptureFixture) -> None:
    """MLflow's own default retries a request 7 times over minutes; the trainer's stop at 3."""
    listener = socket.create_server(("127.0.0.1", 0))
    connections = []

    def answer() -> None:
        while True:
            try:
                peer, _ = listener.accept()
            except OSError:  # closed: the test is over
                return
            connections.append(peer)
            with peer:
                peer.recv(65536)
                peer.sendall(b"not http at all\r\n\r\n")

    threading.Thread(target=answer, daemon=True).start()
    try:
        uri = f"http://127.0.0.1:{listener.getsockname()[1]}"
        tracker = mlflow_tracking.open_run({"MLFLOW_TRACKING_URI": uri}, api.parse_job(JOB),
                                           run_id=None, decision=COLD)
    finally:
        listener.close()
    assert tracker is None
    assert f"MLFLOW_TRACKING_URI={uri}" in caplog.text
    assert 1 <= len(connections) <= 1 + int(
        mlflow_tracking.HTTP_DEFAULTS["MLFLOW_HTTP_REQUEST_MAX_RETRIES"])


@pytest.mark.process  # importing mlflow runs `uname`
def test_an_experiment_id_naming_no_experiment_warns_naming_the_variable_and_the_fix(
        http_defaults: None, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    environ = {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
               "MLFLOW_EXPERIMENT_ID": "999"}
    tracker = mlflow_tracking.open_run(environ, api.parse_job(JOB), run_id=None,
                                       decision=COLD)
    assert tracker is None
    assert "MLFLOW_EXPERIMENT_ID=999 names no experiment" in caplog.text
    assert "unset it to log to MLFLOW_EXPERIMENT_NAME" in caplog.text

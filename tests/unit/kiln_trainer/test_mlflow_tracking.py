"""`kiln_trainer.mlflow_tracking` without a server: off unless MLFLOW_TRACKING_URI is set, a job
that asks for MLflow without the library fails before any work naming the extra, and params
are the spec's settings flattened. (A real tracking server: tests/integration.)"""

from __future__ import annotations

import io
import json
import sys
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

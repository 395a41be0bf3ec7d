"""Optional MLflow tracking, on when ``MLFLOW_TRACKING_URI`` is set: the job's settings as
params, each evaluation as step-indexed metrics, the warm-start decision and freezing events as
tags and JSON artifacts, and the outcome as the run's status, through `mlflow.MlflowClient`
(the `kiln-operator[mlflow]` extra). A failing tracking server only warns: training goes on.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from kiln import api
from kiln_trainer import runtime

_log = logging.getLogger(__name__)

TRACKING_URI = "MLFLOW_TRACKING_URI"  # MLflow's own variables, read as MLflow's tools read them
EXPERIMENT_ID = "MLFLOW_EXPERIMENT_ID"
EXPERIMENT_NAME = "MLFLOW_EXPERIMENT_NAME"
DEFAULT_EXPERIMENT = "kiln"
# The spec sections that decide what is trained, logged as params (``training.optimizer.lr``).
PARAM_SECTIONS = ("model", "dataset", "training", "target", "warmStart", "freezing")
# Evaluation values (`tracking.RunState.history` keys) logged as metrics at their step.
METRICS = ("train_loss", "validation_loss", "validation_accuracy", "samples_per_second",
           "frozen_modules", "elapsed_seconds")
WARM_START_ARTIFACT = "kiln/warm_start.json"
FREEZING_ARTIFACT = "kiln/freezing.json"
_PARAM_VALUE_LIMIT = 6000  # MLflow refuses longer param values
_BATCH = 100  # params or tags per log_batch request, MLflow's limit
# MLflow's HTTP client retries a request for minutes by default (7 tries, growing backoff, 120 s
# each); a trainer must not stall that long on a tracker that is down. A user's own setting wins.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
                 "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT": "15"}


def enabled(environ: Mapping[str, str]) -> bool:
    """Whether the trainer's environment asks for MLflow tracking.

    Raises:
        runtime.ConfigError: it does, but the mlflow library is not installed.
    """
    if not environ.get(TRACKING_URI, "").strip():
        return False
    try:
        import mlflow  # noqa: F401  # lazily: a trainer without the extra never imports it
    except ImportError as exc:
        raise runtime.ConfigError(
            f"{TRACKING_URI} is set but the mlflow library is missing ({exc}); install "
            "'kiln-operator[mlflow]' (pip install mlflow-skinny) in the trainer's environment, "
            f"or unset {TRACKING_URI} to train without MLflow") from None
    return True


class Tracker:
    """One job's MLflow run. Every call is guarded: the first failure warns, names the run and
    turns tracking off, so a tracking server that goes away never stops training.

    Args:
        client: an `mlflow.MlflowClient` for the tracking server.
        run_id: the run logged to.
    """

    def __init__(self, client: Any, run_id: str) -> None:
        self.client, self.run_id = client, run_id
        self.live = True

    def evaluation(self, values: Mapping[str, Any], *, step: int) -> None:
        """Log an evaluation's numbers (keys of `METRICS`; None ones skipped) at `step`."""
        self._metrics({k: values.get(k) for k in METRICS}, step=step)

    def warm_start(self, decision: api.WarmStartDecision) -> None:
        """The warm-start decision as ``kiln.warm_start.*`` tags and a JSON artifact: outcome,
        parent, similarity, whether a parent's weights were accepted, and why."""
        tags = {"kiln.warm_start.outcome": decision.outcome.value,
                "kiln.warm_start.accepted": str(decision.parent is not None).lower(),
                "kiln.warm_start.reason": decision.reason}
        if decision.parent is not None:
            tags["kiln.warm_start.parent"] = decision.parent
        if decision.similarity is not None:
            tags["kiln.warm_start.similarity"] = f"{decision.similarity:.6g}"
        self._call("log the warm-start decision", lambda: self._tags(tags))
        self._call("log the warm-start decision", lambda: self.client.log_dict(
            self.run_id, decision.model_dump(mode="json"), WARM_START_ARTIFACT))

    def freezing(self, events: Sequence[Mapping[str, Any]], frozen: Sequence[str], *,
                 boundary: int, step: int) -> None:
        """A frozen-boundary change: the boundary as the ``frozen_modules`` metric at `step`,
        the frozen modules as a tag, every event so far in `FREEZING_ARTIFACT`."""
        self._metrics({"frozen_modules": boundary}, step=step)
        self._call("log a freezing event", lambda: self._tags(
            {"kiln.freezing.frozen": ", ".join(frozen) or "none"}))
        self._call("log a freezing event", lambda: self.client.log_dict(
            self.run_id, {"events": list(events)}, FREEZING_ARTIFACT))

    def succeeded(self, result: Mapping[str, Any]) -> None:
        """End the run FINISHED with the job's result (`contract.Result.to_json()`)."""
        tags = {"kiln.outcome": "succeeded",
                "kiln.target_reached": str(bool(result.get("target_reached"))).lower()}
        if result.get("zoo_model"):
            tags["kiln.zoo_model"] = str(result["zoo_model"])
        numbers = {key: result.get(key) for key in (
            "wall_seconds", "time_to_target_seconds", "epochs_run")}
        freezing = result.get("freezing") or {}
        numbers["backward_flops_skipped"] = freezing.get("backward_flops_skipped")
        self._metrics(numbers, step=int(result.get("steps") or 0))
        self._end("FINISHED", tags)

    def stopped(self, where: str) -> None:
        """End the run KILLED: the job was stopped with a checkpoint (a restart resumes it and
        its MLflow run)."""
        self._end("KILLED", {"kiln.outcome": "stopped", "kiln.checkpoint": where})

    def failed(self, message: str) -> None:
        """End the run FAILED, saying why."""
        self._end("FAILED", {"kiln.outcome": "failed",
                             "kiln.failure": message[:_PARAM_VALUE_LIMIT]})

    def _end(self, status: str, tags: Mapping[str, str]) -> None:
        self._call("end the run", lambda: self._tags(tags))
        with contextlib.redirect_stdout(sys.stderr):  # its "View run" lines: stdout is events
            self._call("end the run", lambda: self.client.set_terminated(self.run_id, status))
        self.live = False  # ended: a later close logs nothing

    def _metrics(self, values: Mapping[str, Any], *, step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, float(value), now, step) for key, value in values.items()
                   if isinstance(value, int | float) and not isinstance(value, bool)]
        if metrics:
            self._call("log metrics", lambda: self.client.log_batch(self.run_id,
                                                                     metrics=metrics))

    def _tags(self, tags: Mapping[str, str]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(k, v[:_PARAM_VALUE_LIMIT]) for k, v in tags.items()]
        for chunk in _chunks(items):
            self.client.log_batch(self.run_id, tags=chunk)

    def _call(self, what: str, call: Callable[[], object]) -> None:
        if not self.live:
            return
        try:
            call()
        except Exception as exc:  # noqa: BLE001  # MLflow's and its HTTP stack's: never fatal
            self.live = False
            _log.warning("MLflow: could not %s in run %s (%s); MLflow tracking is off for the "
                         "rest of this run, training continues", what, self.run_id, exc)


def open_run(environ: Mapping[str, str], job: api.TrainingJob, *, run_id: str | None,
             decision: api.WarmStartDecision) -> Tracker | None:
    """The job's MLflow run, with its params, tags and warm-start decision logged; None (with a
    warning) when the tracking server cannot be reached or refuses.

    A restarted job continues `run_id` (its checkpoint's) when the server still has it;
    otherwise a new run named after the job starts in ``$MLFLOW_EXPERIMENT_ID``, else the
    experiment ``$MLFLOW_EXPERIMENT_NAME`` (default `DEFAULT_EXPERIMENT`, created when missing).
    Call only after `enabled` said yes.
    """
    from mlflow import MlflowClient
    from mlflow.entities import Param

    uri = environ[TRACKING_URI].strip()
    for key, value in HTTP_DEFAULTS.items():  # MLflow reads them from the process environment
        os.environ.setdefault(key, environ.get(key, value))
    try:
        client = MlflowClient(tracking_uri=uri)  # refuses a malformed URI: a warning too
        if run_id is not None and _has_run(client, run_id):
            client.update_run(run_id, status="RUNNING")
            _log.info("MLflow: continuing run %s at %s", run_id, uri)
            tracker = Tracker(client, run_id)
        else:
            experiment = _experiment(client, environ)
            run = client.create_run(experiment, run_name=job.name, tags={
                "kiln.job": job.name, "kiln.namespace": job.namespace,
                "kiln.architecture": job.spec.model.label})
            tracker = Tracker(client, run.info.run_id)
            wire = api.to_wire(job.spec)
            params = [Param(key, value) for key, value in _flatten(
                {s: wire[s] for s in PARAM_SECTIONS if wire.get(s) is not None})]
            for chunk in _chunks(params):
                client.log_batch(tracker.run_id, params=chunk)
            _log.info("MLflow: run %s in experiment %s at %s", tracker.run_id, experiment, uri)
    except Exception as exc:  # noqa: BLE001  # MLflow's and its HTTP stack's: never fatal
        _log.warning("MLflow: cannot start a run at %s=%s (%s); check the tracking server and "
                     "its address; training continues without MLflow", TRACKING_URI, uri, exc)
        return None
    tracker.warm_start(decision)
    return tracker


def _has_run(client: Any, run_id: str) -> bool:
    from mlflow.exceptions import MlflowException

    try:
        client.get_run(run_id)
    except MlflowException as exc:
        if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
            return False
        raise
    return True


def _experiment(client: Any, environ: Mapping[str, str]) -> str:
    """The experiment id to log to, creating a named experiment the first time."""
    from mlflow.exceptions import MlflowException

    if environ.get(EXPERIMENT_ID, "").strip():
        wanted = environ[EXPERIMENT_ID].strip()
        try:
            return str(client.get_experiment(wanted).experiment_id)
        except MlflowException as exc:
            if exc.error_code not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                raise
            raise ValueError(
                f"{EXPERIMENT_ID}={wanted} names no experiment there; set it to an existing "
                f"experiment's id, or unset it to log to {EXPERIMENT_NAME} (default "
                f"{DEFAULT_EXPERIMENT!r}, created when missing)") from None
    name = environ.get(EXPERIMENT_NAME, "").strip() or DEFAULT_EXPERIMENT
    found = client.get_experiment_by_name(name)
    if found is not None:
        return str(found.experiment_id)
    try:
        return str(client.create_experiment(name))
    except MlflowException:  # another job created it just now
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return str(found.experiment_id)


def _flatten(value: Any, prefix: str = "") -> Iterator[tuple[str, str]]:
    """(dotted key, text) of every leaf of a wire document; lists as JSON. Values longer than
    MLflow takes are cut, ending in an ellipsis."""
    if isinstance(value, Mapping) and value:
        for key, inner in value.items():
            yield from _flatten(inner, f"{prefix}.{key}" if prefix else str(key))
        return
    text = value if isinstance(value, str) else json.dumps(value)
    if len(text) > _PARAM_VALUE_LIMIT:
        text = text[:_PARAM_VALUE_LIMIT - 1] + "…"
    yield prefix, text


def _chunks(items: Sequence[Any]) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), _BATCH):
        yield items[start:start + _BATCH]

"""`Client(local=True)`: jobs trained here by `kiln run`'s runner, kept as TrainingJob objects.

Each run's trainer result becomes the status a cluster job would have (phase, conditions,
warm start, progress, result), so `kiln.cluster.views` reads both alike.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from kiln import api, contract
from kiln.cluster.errors import ClusterError
from kiln.local import runner

NAMESPACE = "local"


class LocalRuns:
    """The jobs this process trained, by name, with their trainer logs in `work_dir`."""

    def __init__(self, *, zoo_uri: str, work_dir: Path | None) -> None:
        self.zoo_uri = zoo_uri
        self.work_dir = work_dir or runner.default_work_dir()
        self._objects: dict[str, dict[str, Any]] = {}

    def run(self, docs: Sequence[api.TrainingJob | api.sweep.TrainingSweep]
            ) -> list[dict[str, Any]]:
        """Train each job in order; a failed trainer makes its job Failed, the next still runs.

        Raises:
            ClusterError: a TrainingSweep (run those with `kiln sweep run`).
        """
        if sweeps := [d.name for d in docs if isinstance(d, api.sweep.TrainingSweep)]:
            raise ClusterError(f"{', '.join(sweeps)}: a TrainingSweep runs here with "
                                      "`kiln sweep run FILE`; Client(local=True) trains jobs")
        console = Console(stderr=True)
        done = []
        for job in docs:
            assert isinstance(job, api.TrainingJob)
            started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            try:
                outcome = runner.run_jobs([job], zoo_uri=self.zoo_uri, work_dir=self.work_dir,
                                          console=console)[0]
                status = _succeeded(outcome.result)
            except runner.TrainerFailed as exc:
                status = _failed(str(exc))
            self._objects[job.name] = {
                "apiVersion": api.API_VERSION, "kind": api.KIND,
                "metadata": {"name": job.name, "namespace": NAMESPACE,
                             "creationTimestamp": started},
                "spec": api.to_wire(job.spec), "status": status}
            done.append({"kind": api.KIND, "name": job.name, "namespace": NAMESPACE,
                         "action": str(status["phase"]).lower()})
        return done

    def objects(self) -> list[dict[str, Any]]:
        return list(self._objects.values())

    def object(self, name: str) -> dict[str, Any]:
        if name not in self._objects:
            known = ", ".join(self._objects) or "none yet"
            raise ClusterError(f"no local job {name} in this client (jobs: {known}); "
                                      "submit its file first")
        return self._objects[name]

    def log(self, name: str) -> Iterator[str]:
        self.object(name)
        with open(self.work_dir / f"{name}.log", encoding="utf-8", errors="replace") as lines:
            for line in lines:
                yield line.rstrip("\n")

    def forget(self, name: str) -> dict[str, Any]:
        self.object(name)
        del self._objects[name]
        return {"kind": api.KIND, "name": name, "namespace": NAMESPACE, "action": "deleted"}


def _succeeded(result_json: dict[str, Any]) -> dict[str, Any]:
    result = contract.Result.from_json(result_json)
    frozen = max((e.get("boundary", 0) for e in (result.freezing or {}).get("events", [])),
                 default=0)
    status: dict[str, Any] = {
        "phase": api.Phase.SUCCEEDED.value,
        "conditions": [{"type": "Succeeded", "status": "True", "reason": "Trained",
                        "message": f"trained {result.epochs_run} epochs here"}],
        "progress": _dropped_nones({"epoch": result.epochs_run, "step": result.steps,
                                    "validationAccuracy": result.validation_accuracy,
                                    "validationLoss": result.validation_loss,
                                    "samplesPerSecond": result.samples_per_second,
                                    "frozenModules": frozen}),
        "result": _dropped_nones({"metric": result.metric,
                                  "validationAccuracy": result.validation_accuracy,
                                  "validationLoss": result.validation_loss,
                                  "zooModel": result.zoo_model,
                                  "wallSeconds": result.wall_seconds,
                                  "timeToTargetSeconds": result.time_to_target_seconds}),
    }
    if result.warm_start_decision is not None:
        status["warmStart"] = api.to_wire(result.warm_start_decision)
    return status


def _failed(message: str) -> dict[str, Any]:
    return {"phase": api.Phase.FAILED.value,
            "conditions": [{"type": "Failed", "status": "True", "reason": "TrainerFailed",
                            "message": message.splitlines()[0]}]}


def _dropped_nones(values: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in values.items() if value is not None}

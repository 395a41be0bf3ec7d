"""Small helpers for operator scenarios: tiny jobs, waiting for status, reading events.

`tiny_job` trains in seconds on one CPU thread (a small CNN on 8x8 digits, freezing off,
OMP_NUM_THREADS=1 in the pod); `wait_job` polls until a predicate on the job holds;
`checkpointed` and `trainer_progress` are conditions for a `kubelet.Hold` or `kubelet.Fault`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kiln import api, contract
from kiln.controller import progress
from kiln.zoo import records, store
from kubesim import client, emulator, kubelet, operator_process

JOB_SECONDS = 240.0  # a tiny job on a loaded 2-core machine: mostly importing torch
# A budget no trainer finishes: for a job that the test stops (deletes, or fails by its
# deadline) and that must be training until then, however fast the machine.
ENDLESS_EPOCHS = 100_000


@dataclasses.dataclass(frozen=True)
class Zoo:
    """The session's zoo: an S3 bucket on the moto server."""

    uri: str
    endpoint: str
    access_key: str
    secret_key: str
    store: store.ObjectStore

    @property
    def operator_env(self) -> dict[str, str]:
        return {contract.Env.ZOO_ACCESS_KEY: self.access_key, contract.Env.ZOO_SECRET_KEY: self.secret_key}


def tiny_job(name: str, *, epochs: int = 2, max_samples: int | None = 400, width: int = 8,
             run_policy: dict[str, Any] | None = None, dataset: dict[str, Any] | None = None,
             model: dict[str, Any] | None = None) -> dict[str, Any]:
    """A TrainingJob document that trains in a few seconds."""
    ds: dict[str, Any] = dataset or {"name": "digits"}
    if max_samples is not None and "maxSamples" not in ds and dataset is None:
        ds = {**ds, "maxSamples": max_samples}
    return {
        "apiVersion": "kiln.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": name, "labels": {"kueue.x-k8s.io/queue-name": "e2e"}},
        "spec": {
            "model": model or {"architecture": "small_cnn", "args": {"depth": 2, "width": width},
                               "inputShape": [1, 8, 8]},
            "dataset": ds,
            "training": {"epochs": epochs, "batchSize": 32,
                         "optimizer": {"name": "adam", "lr": 0.005, "weightDecay": 0.0}},
            "freezing": {"enabled": False},
            "runPolicy": run_policy or {},
            "template": {"env": [{"name": "OMP_NUM_THREADS", "value": "1"}]},
        },
    }


def checkpointed(zoo: Zoo, namespace: str, name: str) -> Callable[[kubelet.RunningPod], bool]:
    """A condition on a pod: job `namespace/name` has a checkpoint in the zoo (any uid: the
    job's namespace holds no other job of its name)."""
    folder = f"{records.CHECKPOINTS_PREFIX}{namespace}/{name}/"
    return lambda _pod: bool(zoo.store.list_keys(folder))


def trainer_progress(pod: kubelet.RunningPod) -> dict[str, Any]:
    """What the operator would read into status.progress from the pod's trainer now, by its
    own parser ({} while the trainer publishes nothing)."""
    try:
        found = progress.parse(pod.metrics(), epochs=ENDLESS_EPOCHS)
    except ValueError:
        return {}
    return {} if found is None else api.to_wire(found)


def with_changes(doc: dict[str, Any], **spec: Any) -> dict[str, Any]:
    """A copy of `doc` with top-level spec sections replaced."""
    copied = copy.deepcopy(doc)
    copied["spec"].update(spec)
    return copied


def condition(job: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    """The job's condition of `type_`, or None."""
    for found in ((job or {}).get("status") or {}).get("conditions") or []:
        if found.get("type") == type_:
            return dict(found)
    return None


def phase(job: dict[str, Any] | None) -> str | None:
    return ((job or {}).get("status") or {}).get("phase")


def wait_job(cluster: emulator.Emulator, namespace: str, name: str,
             predicate: Callable[[dict[str, Any]], bool], *, what: str,
             timeout_seconds: float = JOB_SECONDS,
             details: Callable[[], str] | None = None) -> dict[str, Any]:
    """Poll the job until `predicate(job)` holds; returns the job then.

    Raises:
        AssertionError: timed out (the message shows the job's status and `details()`).
    """

    def check() -> dict[str, Any] | None:
        job = cluster.client.job(namespace, name)
        return job if job is not None and predicate(job) else None

    def explain() -> str:
        job = cluster.client.job(namespace, name)
        shown = json.dumps((job or {}).get("status"), indent=1) if job else "(job is gone)"
        return f"status: {shown}" + (f"\n{details()}" if details else "")

    return client.wait_until(check, timeout_seconds=timeout_seconds,
                               what=f"{namespace}/{name}: {what}", details=explain)


def wait_phase(cluster: emulator.Emulator, namespace: str, name: str, wanted: str, *,
               timeout_seconds: float = JOB_SECONDS,
               details: Callable[[], str] | None = None) -> dict[str, Any]:
    """Wait for the job's phase to be `wanted`."""
    return wait_job(cluster, namespace, name, lambda job: phase(job) == wanted,
                    what=f"phase {wanted}", timeout_seconds=timeout_seconds, details=details)


def events(cluster: emulator.Emulator, namespace: str, name: str) -> list[dict[str, Any]]:
    """Events the operator posted about a job (from the request log: the emulator's
    storage of events is not relied upon)."""
    found = []
    for request in cluster.requests:
        if (request.resource == "events" and request.action == "CREATE"
                and request.namespace == namespace and isinstance(request.body, dict)
                and (request.body.get("involvedObject") or {}).get("name") == name):
            found.append(request.body)
    return found


def wait_event(cluster: emulator.Emulator, namespace: str, name: str, reason: str, *,
               timeout_seconds: float = 30.0) -> dict[str, Any]:
    """Wait for an event with `reason` about the job (posted right after its status write)."""

    def find() -> dict[str, Any] | None:
        return next((e for e in events(cluster, namespace, name) if e["reason"] == reason), None)

    return client.wait_until(find, timeout_seconds=timeout_seconds,
                               what=f"a {reason} event about {namespace}/{name}",
                               details=lambda: str(event_reasons(cluster, namespace, name)))


def event_reasons(cluster: emulator.Emulator, namespace: str, name: str) -> list[str]:
    return [e["reason"] for e in events(cluster, namespace, name)]


def pod_creations(cluster: emulator.Emulator, namespace: str, job_name: str) -> list[str]:
    """Names of the pods created for a job, in order, from the request log."""
    names = []
    for request in cluster.requests:
        if (request.resource == "pods" and request.action == "CREATE"
                and request.namespace == namespace and isinstance(request.body, dict)):
            labels = (request.body.get("metadata") or {}).get("labels") or {}
            if labels.get("kiln.dev/job-name") == job_name:
                names.append(str(request.body["metadata"]["name"]))
    return names


def termination_result(cluster: emulator.Emulator, namespace: str, pod: str) -> dict[str, Any]:
    """The trainer's result from a finished pod's termination message ({} when none)."""
    found = cluster.client.get(client.Client.pods_path(namespace, pod)) or {}
    for container in (found.get("status") or {}).get("containerStatuses") or []:
        message = ((container.get("state") or {}).get("terminated") or {}).get("message")
        if message:
            try:
                decoded = json.loads(message)
            except ValueError:
                return {}
            return decoded if isinstance(decoded, dict) else {}
    return {}


@contextlib.contextmanager
def operated(cluster: emulator.Emulator, workdir: Path, *, env: dict[str, str],
             args: list[str]) -> Iterator[tuple[kubelet.Kubelet, operator_process.OperatorProcess]]:
    """A test kubelet and the real operator (`args`) on a test's own `cluster`; both stop on
    exit, and anything the kubelet could not do fails the test."""
    node = kubelet.Kubelet(cluster.url, workdir / "kubelet")
    node.start()
    running = operator_process.OperatorProcess(cluster, workdir / "operator", env=env, args=args)
    try:
        running.start()
        yield node, running
    finally:
        running.stop()
        node.stop()
    assert not node.errors, node.errors

"""Runtimes under the real operator: a job naming a ClusterTrainingRuntime runs on its pod
settings as admission resolved them; a job overriding a locked field, or naming no runtime
that exists, fails with a condition that says so."""

from __future__ import annotations

import uuid
from typing import Any

from kubesim import emulator, operator_process, scenario

from kiln import api

TOLERATION = {"key": "example.com/team", "operator": "Exists", "effect": "NoSchedule"}


def _runtime(kind: str, name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": api.API_VERSION, "kind": kind, "metadata": {"name": name},
            "spec": spec}


def _path(kind: str, name: str, namespace: str = "") -> str:
    plural = (api.runtime.CLUSTER_RUNTIME_PLURAL if kind == api.runtime.CLUSTER_RUNTIME_KIND
              else api.runtime.RUNTIME_PLURAL)
    where = f"/namespaces/{namespace}" if namespace else ""
    return f"/apis/{api.GROUP}/{api.VERSION}{where}/{plural}" + (f"/{name}" if name else "")


def _job(name: str, ref: dict[str, str], **spec: Any) -> dict[str, Any]:
    tiny = scenario.tiny_job(name)["spec"]
    return {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": name},
            "spec": {"runtimeRef": ref, "model": tiny["model"], "dataset": tiny["dataset"],
                     "training": tiny["training"], "freezing": tiny["freezing"], **spec}}


def _created_pod(cluster: emulator.Emulator, namespace: str, pod: str) -> dict[str, Any]:
    """The pod body the operator sent, from the request log."""
    for request in cluster.requests:
        if (request.resource == "pods" and request.action == "CREATE"
                and request.namespace == namespace and isinstance(request.body, dict)
                and request.body["metadata"]["name"] == pod):
            return request.body
    raise AssertionError(f"pod {pod} was never created")


def test_a_job_naming_a_cluster_runtime_runs_on_its_settings_as_admitted(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess, namespace: str,
) -> None:
    runtime = f"team-{uuid.uuid4().hex[:6]}"  # cluster-scoped: one name per test
    kind = api.runtime.CLUSTER_RUNTIME_KIND
    cluster.client.create(_path(kind, ""), _runtime(kind, runtime, template={
        "env": [{"name": "OMP_NUM_THREADS", "value": "1"}, {"name": "TEAM", "value": "vision"}],
        "tolerations": [TOLERATION], "labels": {"example.com/team": "vision"}}))
    name = "on-runtime"
    # Created suspended: admitted (its runtime resolved) but no pod until resumed, so the
    # runtime's later edit lands between admission and the pod.
    cluster.client.create_job(namespace, _job(name, {"name": runtime},
                                              runPolicy={"suspend": True}))
    suspended = scenario.wait_phase(cluster, namespace, name, "Suspended",
                                    details=operator.log_tail)
    recorded = suspended["status"]["runtime"]
    assert (recorded["kind"], recorded["name"]) == (kind, runtime)
    cluster.client.patch(_path(kind, runtime), {"spec": {"template": {
        "env": [{"name": "TEAM", "value": "edited-later"}]}}})
    cluster.client.patch(cluster.client.jobs_path(namespace, name),
                         {"spec": {"runPolicy": {"suspend": False}}})
    scenario.wait_phase(cluster, namespace, name, "Succeeded", details=operator.log_tail)

    pod = _created_pod(cluster, namespace, f"{name}-trainer-0")
    (trainer,) = [c for c in pod["spec"]["containers"] if c["name"] == "trainer"]
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert env["TEAM"] == "vision" and env["OMP_NUM_THREADS"] == "1"
    assert TOLERATION in pod["spec"]["tolerations"]
    assert pod["metadata"]["labels"]["example.com/team"] == "vision"


def test_a_job_overriding_a_locked_field_is_refused_naming_it(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess, namespace: str,
) -> None:
    kind = api.runtime.RUNTIME_KIND
    cluster.client.create(_path(kind, "", namespace), _runtime(
        kind, "locked", template={"podSecurityContext": {"runAsNonRoot": True}},
        locked=["podSecurityContext"]))
    name = "overrides"
    cluster.client.create_job(namespace, _job(
        name, {"kind": kind, "name": "locked"},
        template={"podSecurityContext": {"runAsUser": 0}}))
    failed = scenario.wait_phase(cluster, namespace, name, "Failed", details=operator.log_tail)
    condition = scenario.condition(failed, "Failed")
    assert condition["reason"] == "InvalidSpec"
    assert ("spec.template.podSecurityContext: locked by TrainingRuntime locked"
            in condition["message"])
    assert scenario.pod_creations(cluster, namespace, name) == []


def test_a_job_naming_a_missing_runtime_fails_saying_so(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess, namespace: str,
) -> None:
    name = "nowhere"
    cluster.client.create_job(namespace, _job(name, {"name": "no-such-runtime"}))
    failed = scenario.wait_phase(cluster, namespace, name, "Failed", details=operator.log_tail)
    condition = scenario.condition(failed, "Failed")
    assert condition["reason"] == "RuntimeNotFound"
    assert "ClusterTrainingRuntime 'no-such-runtime' not found" in condition["message"]
    assert scenario.pod_creations(cluster, namespace, name) == []


def test_a_job_admitted_on_a_runtime_runs_on_it_after_the_runtime_is_deleted(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess, namespace: str,
) -> None:
    kind = api.runtime.RUNTIME_KIND
    cluster.client.create(_path(kind, "", namespace), _runtime(
        kind, "gone", template={"env": [{"name": "TEAM", "value": "recorded"}]}))
    name = "orphaned"
    # Held suspended after admission (the runtime recorded), so the deletion lands before
    # the pod exists.
    cluster.client.create_job(namespace, _job(name, {"kind": kind, "name": "gone"},
                                              runPolicy={"suspend": True}))
    suspended = scenario.wait_phase(cluster, namespace, name, "Suspended",
                                    details=operator.log_tail)
    assert suspended["status"]["runtime"]["name"] == "gone"
    cluster.client.delete(_path(kind, "gone", namespace))
    cluster.client.patch(cluster.client.jobs_path(namespace, name),
                         {"spec": {"runPolicy": {"suspend": False}}})
    scenario.wait_phase(cluster, namespace, name, "Succeeded", details=operator.log_tail)
    pod = _created_pod(cluster, namespace, f"{name}-trainer-0")
    (trainer,) = [c for c in pod["spec"]["containers"] if c["name"] == "trainer"]
    assert {"name": "TEAM", "value": "recorded"} in trainer["env"]

"""Kueue admits, Kiln places within the admission: the real operator with ``--kueue``.

No Kueue runs here. The test plays Kueue's part on the emulator: it serves Kueue's Workload and
ResourceFlavor kinds, and patches a Workload's status as Kueue's scheduler would (QuotaReserved
and Admitted with status.admission naming a flavor; Evicted), with waitForPodsReady on: it
evicts with PodsReadyTimeout a Workload whose PodsReady is not True when it looks. It serves
one Workload API version, v1beta2 (Kueue's current; one operator for two tests) or v1beta1
(older releases; a briefer run): the operator discovers which and speaks it. Everything Kiln
does is real: the operator process, its Workload, its pods run by the test kubelet, the zoo
checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kmock
import pytest
from kubesim import client, emulator, kubelet, operator_process, scenario, usage

from kiln.controller import kueue, rbac
from kiln.zoo import records


def _kueue_resources(version: str) -> dict[str, kmock.ResourceInfo]:
    """Kueue's Workload and ResourceFlavor kinds, served in API `version` only."""
    verbs = {"get", "list", "watch", "create", "patch", "update", "delete"}
    return {
        f"{kueue.GROUP}/{version}/{kueue.WORKLOADS}": kmock.ResourceInfo(
            kind="Workload", singular="workload", namespaced=True, subresources={"status"},
            verbs=verbs),
        f"{kueue.GROUP}/{version}/resourceflavors": kmock.ResourceInfo(
            kind="ResourceFlavor", singular="resourceflavor", namespaced=False, verbs=verbs),
    }

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own-model"
POOL_LABEL = "e2e.kiln.dev/pool"
FLAVOR = "on-demand"


def _workloads(cluster: emulator.Emulator, namespace: str) -> list[dict[str, Any]]:
    return [w for version in kueue.VERSIONS
            for w in cluster.objects(f"{kueue.GROUP}/{version}/{kueue.WORKLOADS}")
            if w["metadata"].get("namespace") == namespace]


def _workload_condition(workload: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in workload.get("status", {}).get("conditions") or []
                 if c["type"] == type_), {})


def _set_conditions(workload: dict[str, Any], **statuses: tuple[str, str]) -> list[Any]:
    """The Workload's conditions with `statuses` (type -> (status, reason)) set, as Kueue's
    scheduler writes them."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    conditions = [c for c in copy.deepcopy(workload.get("status", {}).get("conditions") or [])
                  if c["type"] not in statuses]
    for type_, (value, reason) in statuses.items():
        conditions.append({"type": type_, "status": value, "reason": reason,
                           "message": f"{type_} by the test playing Kueue",
                           "lastTransitionTime": now})
    return conditions


def _admit(cluster: emulator.Emulator, workload: dict[str, Any]) -> None:
    """What Kueue's scheduler writes when it admits the Workload to flavor FLAVOR."""
    path = f"/apis/{workload['apiVersion']}/namespaces/{workload['metadata']['namespace']}" \
           f"/workloads/{workload['metadata']['name']}/status"
    cluster.client.patch(path, {"status": {
        "conditions": _set_conditions(workload, QuotaReserved=("True", "QuotaReserved"),
                                      Admitted=("True", "Admitted"),
                                      Evicted=("False", "QuotaReserved")),
        "admission": {"clusterQueue": "e2e-cq", "podSetAssignments": [{
            "name": kueue.POD_SET, "count": 1, "flavors": {"cpu": FLAVOR},
            "resourceUsage": {"cpu": "1"}}]}}})


def _evict(cluster: emulator.Emulator, workload: dict[str, Any], reason: str) -> None:
    """What Kueue writes when it evicts the Workload: Preempted (a higher-priority Workload
    needs the quota) or PodsReadyTimeout (waitForPodsReady's timeout passed without
    PodsReady=True)."""
    path = f"/apis/{workload['apiVersion']}/namespaces/{workload['metadata']['namespace']}" \
           f"/workloads/{workload['metadata']['name']}/status"
    cluster.client.patch(path, {"status": {
        "conditions": _set_conditions(workload, Evicted=("True", reason))}})


def _wait_pods_ready(cluster: emulator.Emulator, namespace: str, wanted: tuple[str, str],
                     details: Any) -> dict[str, Any]:
    """The job's Workload once its PodsReady condition is (status, reason) `wanted`."""
    return client.wait_until(
        lambda: next((w for w in _workloads(cluster, namespace)
                      if (_workload_condition(w, "PodsReady").get("status"),
                          _workload_condition(w, "PodsReady").get("reason")) == wanted), None),
        timeout_seconds=60, what=f"the Workload's PodsReady to be {wanted}", details=details)


@dataclasses.dataclass(frozen=True)
class Kueue:
    """An emulator serving Kueue's kinds in one API version, its kubelet, and the operator
    with ``--kueue``."""

    cluster: emulator.Emulator
    node: kubelet.Kubelet
    operator: operator_process.OperatorProcess
    version: str

    def namespace(self, zoo_secret: tuple[str, dict[str, str]]) -> str:
        """A fresh namespace holding the zoo-credentials Secret."""
        name = f"kueue-{uuid.uuid4().hex[:6]}"
        self.cluster.client.create_secret(name, *zoo_secret)
        return name


@contextlib.contextmanager
def _kueue(version: str, zoo: scenario.Zoo, operator_args: list[str],
           workdir: Path) -> Iterator[Kueue]:
    """Kueue's kinds served in `version` only, two pools (`_two_pools`), the operator; once it
    has stopped, every API call it made must be granted by Kiln's RBAC rules with Kueue's."""
    with emulator.Emulator(extra_resources=_kueue_resources(version)) as cluster:
        _two_pools(cluster, version)
        with scenario.operated(cluster, workdir, env=zoo.operator_env,
                               args=[*operator_args, "--kueue"]) as (node, operator):
            yield Kueue(cluster, node, operator, version)
        _check_rbac(cluster)


def _check_rbac(cluster: emulator.Emulator) -> None:
    calls = usage.api_calls(cluster.requests)
    granted = rbac.triples(rbac.RULES + rbac.KUEUE_RULES)
    assert usage.rbac_pairs(calls) <= granted, sorted(usage.rbac_pairs(calls) - granted)


@pytest.fixture(scope="module")
def current_kueue(zoo: scenario.Zoo, operator_args: list[str],
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kueue]:
    """Kueue's current Workload API version, shared by this module's tests (a namespace each)."""
    with _kueue(kueue.VERSIONS[0], zoo, operator_args,
                tmp_path_factory.mktemp("kueue")) as running:
        yield running


# The tests on `current_kueue` run on one xdist worker, which builds it once.
@pytest.mark.xdist_group(__name__)
def test_kueue_admits_and_evicts_while_kiln_places_within_the_admission(
    current_kueue: Kueue, zoo: scenario.Zoo, zoo_secret: tuple[str, dict[str, str]],
) -> None:
    k = current_kueue
    _run(k.cluster, k.node, k.operator, zoo, k.namespace(zoo_secret), k.version)
    _check_rbac(k.cluster)  # so far; the fixture checks the rest once the operator stops


@pytest.mark.parametrize("version", kueue.VERSIONS[1:])
def test_kiln_speaks_an_older_workload_api_through_admission_eviction_and_finish(
    zoo: scenario.Zoo, operator_args: list[str], zoo_secret: tuple[str, dict[str, str]],
    tmp_path: Path, version: str,
) -> None:
    # What differs between versions is only where the operator reads and writes Workloads:
    # each kind of call it makes on them (create, watch, PodsReady, release, Finished) once.
    with _kueue(version, zoo, operator_args, tmp_path) as k:
        _run_briefly(k.cluster, k.node, k.operator, k.namespace(zoo_secret), version)


def _two_pools(cluster: emulator.Emulator, version: str) -> None:
    """Two nodes: the planner's first choice is node a; flavor FLAVOR allows only node b."""
    for node, pool in (("cpu-node-a", "spot"), ("cpu-node-b", FLAVOR)):
        cluster.client.create_node(node)
        cluster.client.patch(f"/api/v1/nodes/{node}",
                             {"metadata": {"labels": {POOL_LABEL: pool}}})
    cluster.client.create(f"/apis/{kueue.GROUP}/{version}/resourceflavors", {
        "apiVersion": f"{kueue.GROUP}/{version}", "kind": "ResourceFlavor",
        "metadata": {"name": FLAVOR}, "spec": {"nodeLabels": {POOL_LABEL: FLAVOR}}})


@pytest.mark.xdist_group(__name__)
def test_an_own_models_profiling_pod_runs_only_within_kueues_admission(
    current_kueue: Kueue, zoo_secret: tuple[str, dict[str, str]],
) -> None:
    cluster, operator = current_kueue.cluster, current_kueue.operator
    namespace, name = current_kueue.namespace(zoo_secret), "mixer-kueue"
    job = scenario.tiny_job(name, model={
        "entrypoint": "mynets.mixer:mixer", "args": {"dim": 8, "depth": 1},
        "task": "classification", "inputShape": [1, 8, 8]})
    job["spec"]["template"]["env"].append({"name": "PYTHONPATH", "value": str(EXAMPLE)})

    def details() -> str:
        return f"workloads: {_workloads(cluster, namespace)}\n" + str(operator.log_tail())

    cluster.client.create_job(namespace, job)
    # Before Kueue reserves quota: a Workload, the job waits to be profiled, no pod.
    (workload,) = client.wait_until(lambda: _workloads(cluster, namespace),
                                    timeout_seconds=30, what="the job's Workload",
                                    details=details)
    waiting = scenario.wait_job(
        cluster, namespace, name,
        lambda job: (scenario.condition(job, "Profiled") or {}).get("reason")
        == "WaitingForKueueAdmission", what="profiling waiting for Kueue",
        details=details)
    assert scenario.condition(waiting, "Profiled")["status"] == "Unknown"
    assert scenario.pod_creations(cluster, namespace, name) == []

    # Admitted: profiled on the admitted flavor's node, then it runs there.
    _admit(cluster, workload)
    done = scenario.wait_phase(cluster, namespace, name, "Succeeded", details=details)
    assert scenario.condition(done, "Profiled")["reason"] == "ModelProfiled"
    assert scenario.pod_creations(cluster, namespace, name) == [
        f"{name}-profile", f"{name}-trainer-0"]
    profile_pod = cluster.client.get(f"/api/v1/namespaces/{namespace}/pods/{name}-profile")
    assert profile_pod is not None and profile_pod["spec"]["nodeName"] == "cpu-node-b"
    assert done["status"]["placement"]["node"] == "cpu-node-b"
    assert len(_workloads(cluster, namespace)) == 1  # one Workload: the job's
    _check_rbac(cluster)  # so far; the fixture checks the rest once the operator stops


def _details(cluster: emulator.Emulator, operator: operator_process.OperatorProcess,
             namespace: str) -> Callable[[], str]:
    """What a timed-out wait shows: the namespace's pods and Workloads, the operator's log."""

    def details() -> str:
        shown = [(p["metadata"]["name"], p.get("spec", {}).get("nodeName"),
                  p.get("status", {}).get("phase")) for p in cluster.client.pods(namespace)]
        return f"pods: {shown}\nworkloads: {_workloads(cluster, namespace)}\n" + str(
            operator.log_tail())

    return details


def _run_briefly(cluster: emulator.Emulator, node: kubelet.Kubelet,
                 operator: operator_process.OperatorProcess, namespace: str,
                 version: str) -> None:
    """The Workload's whole life in `version` at the least cost: its first trainer is held
    from its start (it never trains) until Kueue preempts it; the second runs a tiny job."""
    name = "digits-kueue"
    details = _details(cluster, operator, namespace)
    node.hold(kubelet.Hold(namespace, f"{name}-trainer-0"))
    cluster.client.create_job(namespace, scenario.tiny_job(name))
    waiting = scenario.wait_job(
        cluster, namespace, name,
        lambda job: (scenario.condition(job, "Queued") or {}).get("reason")
        == "WaitingForKueueAdmission", what="waiting for Kueue admission",
        details=details)
    (workload,) = client.wait_until(lambda: _workloads(cluster, namespace), timeout_seconds=30,
                                    what="the job's Workload")
    assert workload["apiVersion"] == f"{kueue.GROUP}/{version}"  # the version served
    assert workload["metadata"]["name"] == kueue.workload_name(
        name, waiting["metadata"]["uid"])
    assert workload["spec"]["queueName"] == "e2e"
    assert scenario.pod_creations(cluster, namespace, name) == []

    _admit(cluster, workload)
    _wait_pods_ready(cluster, namespace, ("True", "Started"), details)
    (pod,) = cluster.client.pods(namespace, name)
    assert pod["spec"]["nodeName"] == "cpu-node-b"
    assert scenario.wait_event(cluster, namespace, name, "AdmittedByKueue")["type"] == "Normal"
    _evict(cluster, _workloads(cluster, namespace)[0], "Preempted")
    released = _released(cluster, namespace, name, "Preempted", details)
    assert _workload_condition(released, "Requeued")["status"] == "True"

    _admit(cluster, released)
    done = scenario.wait_phase(cluster, namespace, name, "Succeeded", details=details)
    assert done["status"]["attempts"] == 2 and done["status"].get("restarts", 0) == 0
    assert done["status"]["placement"]["node"] == "cpu-node-b"
    finished = client.wait_until(
        lambda: next((w for w in _workloads(cluster, namespace)
                      if _workload_condition(w, "Finished").get("status") == "True"), None),
        timeout_seconds=30, what="the Workload to be marked Finished")
    assert _workload_condition(finished, "Finished")["reason"] == "Succeeded"
    assert finished["apiVersion"] == f"{kueue.GROUP}/{version}"
    assert len(_workloads(cluster, namespace)) == 1


def _run(cluster: emulator.Emulator, node: kubelet.Kubelet,
         operator: operator_process.OperatorProcess, zoo: scenario.Zoo, namespace: str,
         version: str) -> None:
    name, plain = "digits-kueue", "digits-plain"
    details = _details(cluster, operator, namespace)

    # Held once it has a checkpoint, until the eviction stops it; 30 epochs are far more than
    # it trains between two of the kubelet's checks.
    node.hold(kubelet.Hold(namespace, f"{name}-trainer-0",
                           when=scenario.checkpointed(zoo, namespace, name)))
    cluster.client.create_job(namespace, scenario.tiny_job(name, epochs=30, max_samples=None))
    unlabelled = scenario.tiny_job(plain)
    unlabelled["metadata"]["labels"] = {}
    cluster.client.create_job(namespace, unlabelled)

    # Unadmitted: queued for Kueue with a Workload, no pod, while the unlabelled job starts.
    waiting = scenario.wait_job(
        cluster, namespace, name,
        lambda job: (scenario.condition(job, "Queued") or {}).get("reason")
        == "WaitingForKueueAdmission", what="waiting for Kueue admission",
        details=details)
    assert scenario.phase(waiting) == "Queued"
    (workload,) = client.wait_until(lambda: _workloads(cluster, namespace), timeout_seconds=30,
                                    what="the job's Workload")
    assert workload["apiVersion"] == f"{kueue.GROUP}/{version}"  # the version served
    assert workload["metadata"]["name"] == kueue.workload_name(
        name, waiting["metadata"]["uid"])
    assert workload["metadata"]["ownerReferences"][0]["kind"] == "TrainingJob"
    assert workload["spec"]["queueName"] == "e2e"
    (pod_set,) = workload["spec"]["podSets"]
    assert (pod_set["name"], pod_set["count"]) == (kueue.POD_SET, 1)
    scenario.wait_job(cluster, namespace, plain,
                      lambda job: bool(cluster.client.pods(namespace, plain)),
                      what="the unlabelled job's pod", details=details)
    assert scenario.pod_creations(cluster, namespace, name) == []
    assert (scenario.condition(cluster.client.job(namespace, name), "Queued") or {}).get(
        "reason") == "WaitingForKueueAdmission"

    # Admitted to a flavor whose node labels allow node b only.
    _admit(cluster, workload)
    checkpoint = records.checkpoint_key(namespace, name, waiting["metadata"]["uid"])
    running = scenario.wait_job(
        cluster, namespace, name,
        lambda job: scenario.phase(job) == "Running" and zoo.store.exists(checkpoint),
        what="running with a checkpoint", details=details)
    assert running["status"]["placement"]["node"] == "cpu-node-b"
    (pod,) = cluster.client.pods(namespace, name)
    assert pod["spec"]["nodeName"] == "cpu-node-b"
    assert not any(k.startswith("kueue.x-k8s.io/") for k in pod["metadata"]["labels"])
    assert scenario.wait_event(cluster, namespace, name, "AdmittedByKueue")["type"] == "Normal"
    # Its trainer pod is Ready: Kiln says so, so waitForPodsReady has no cause to evict it.
    _wait_pods_ready(cluster, namespace, ("True", "Started"), details)

    # Evicted anyway, as Kueue does for PodsReadyTimeout (e.g. PodsReady came too late): the
    # trainer stops with its checkpoint, the job waits again, the admission goes back to Kueue,
    # which decides when to requeue it.
    _evict(cluster, _workloads(cluster, namespace)[0], "PodsReadyTimeout")
    released = _released(cluster, namespace, name, "PodsReadyTimeout", details)
    assert _workload_condition(released, "Requeued")["status"] == "False"
    assert zoo.store.exists(checkpoint)
    assert scenario.pod_creations(cluster, namespace, name) == [f"{name}-trainer-0"]

    # Admitted again: a new trainer resumes (held as it starts), its PodsReady is written
    # anew; then preempted: Kueue requeues it at once.
    node.hold(kubelet.Hold(namespace, f"{name}-trainer-1"))
    _admit(cluster, released)
    _wait_pods_ready(cluster, namespace, ("True", "Started"), details)
    _evict(cluster, _workloads(cluster, namespace)[0], "Preempted")
    released = _released(cluster, namespace, name, "Preempted", details)
    assert _workload_condition(released, "Requeued")["status"] == "True"

    # Admitted again: it resumes from its checkpoint, ends, and its Workload is Finished.
    _admit(cluster, released)
    done = scenario.wait_phase(cluster, namespace, name, "Succeeded", details=details)
    assert done["status"]["attempts"] == 3 and done["status"].get("restarts", 0) == 0
    assert scenario.termination_result(cluster, namespace, f"{name}-trainer-2")[
        "resumed_from_epoch"] >= 1
    finished = client.wait_until(
        lambda: next((w for w in _workloads(cluster, namespace)
                      if _workload_condition(w, "Finished").get("status") == "True"), None),
        timeout_seconds=30, what="the Workload to be marked Finished")
    assert _workload_condition(finished, "Finished")["reason"] == "Succeeded"

    # The unlabelled job ran as ever: no Workload of its own.
    scenario.wait_phase(cluster, namespace, plain, "Succeeded", details=details)
    assert len(_workloads(cluster, namespace)) == 1


def _released(cluster: emulator.Emulator, namespace: str, name: str, reason: str,
              details: Any) -> dict[str, Any]:
    """After Kueue evicted the job's Workload for `reason`: the job is queued again with its
    pods deleted, and then the Workload has no admission and PodsReady=False."""
    evicted = scenario.wait_job(
        cluster, namespace, name,
        lambda job: (scenario.condition(job, "Queued") or {}).get("reason") == "EvictedByKueue"
        and reason in scenario.condition(job, "Queued")["message"],
        what=f"requeued by the eviction ({reason})", details=details)
    assert scenario.phase(evicted) == "Queued"
    client.wait_until(lambda: not cluster.client.pods(namespace, name), timeout_seconds=60,
                      what="the evicted trainer pod to be deleted", details=details)
    released: dict[str, Any] = client.wait_until(
        lambda: next((w for w in _workloads(cluster, namespace)
                      if _workload_condition(w, "QuotaReserved").get("status") == "False"),
                     None), timeout_seconds=30, what="the admission to be cleared",
        details=details)
    assert not released["status"].get("admission")
    assert _workload_condition(released, "Requeued")["reason"] == reason
    assert (_workload_condition(released, "PodsReady")["status"],
            _workload_condition(released, "PodsReady")["reason"]) == ("False", "WaitForStart")
    return released

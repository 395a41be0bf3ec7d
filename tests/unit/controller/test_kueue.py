"""The pure side of the Kueue integration: the Workload Kiln builds, how it reads Kueue's
admission, and the status patches it writes back."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kiln import api
from kiln.controller import gates, jobs, kueue, placement_loop, pods, profiling, settings
from kiln.warmstart import select


def _job(labels: dict[str, str] | None = None, **spec: Any
         ) -> tuple[dict[str, Any], api.TrainingJob]:
    doc = {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob",
           "metadata": {"name": "digits", "namespace": "team-a", "uid": "u-1",
                        "labels": {"kueue.x-k8s.io/queue-name": "gpu"} if labels is None
                        else labels},
           "spec": {"model": {"architecture": "small_cnn", "inputShape": [1, 8, 8]}, **spec}}
    return doc, api.parse_job(doc)


def _workload(*conditions: tuple[str, str, str], **assigned: Any) -> dict[str, Any]:
    status: dict[str, Any] = {"conditions": [
        {"type": t, "status": s, "reason": r, "message": f"{t} {r}",
         "lastTransitionTime": "2026-01-01T00:00:00Z"} for t, s, r in conditions]}
    if assigned:
        status["admission"] = {"clusterQueue": "cq", "podSetAssignments": [
            {"name": kueue.POD_SET, "count": 1, **assigned}]}
    return {"metadata": {"name": "trainingjob-digits-abcde", "namespace": "team-a",
                         "resourceVersion": "7", "generation": 1,
                         "ownerReferences": [{"apiVersion": "kiln.dev/v1alpha1",
                                              "kind": "TrainingJob", "name": "digits",
                                              "uid": "u-1", "controller": True}]},
            "status": status}


ADMITTED = (("QuotaReserved", "True", "QuotaReserved"), ("Admitted", "True", "Admitted"))


def test_the_workload_asks_for_one_trainer_pod_with_the_jobs_gpus_cpu_and_priority() -> None:
    owner, job = _job(resources={"gpus": 4},
                      template={"resources": {"limits": {"memory": "8Gi"},
                                              "requests": {"cpu": "6"}},
                                "nodeSelector": {"zone": "a"}})
    workload = kueue.build_workload(
        owner, job, gpus=4, image="kiln/trainer:test",
        priority=kueue.Priority("high", kueue.POD_PRIORITY_SOURCE, 1000), active=True,
        version="v1beta1")
    meta, spec = workload["metadata"], workload["spec"]
    assert workload["apiVersion"] == "kueue.x-k8s.io/v1beta1" and workload["kind"] == "Workload"
    assert meta["name"] == kueue.workload_name("digits", "u-1")
    assert meta["namespace"] == "team-a" and meta["labels"][kueue.JOB_UID_LABEL] == "u-1"
    assert meta["ownerReferences"] == [{
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "name": "digits", "uid": "u-1",
        "controller": True, "blockOwnerDeletion": True}]
    assert spec["queueName"] == "gpu" and spec["active"] is True
    assert (spec["priorityClassName"], spec["priority"], spec["priorityClassSource"]) == (
        "high", 1000, "scheduling.k8s.io/priorityclass")
    (pod_set,) = spec["podSets"]
    assert (pod_set["name"], pod_set["count"]) == ("trainer", 1)
    pod_spec = pod_set["template"]["spec"]
    assert pod_spec["containers"][0]["resources"]["requests"] == {
        "memory": "8Gi", "cpu": "6", pods.GPU_RESOURCE: "4"}
    assert pod_spec["nodeSelector"] == {"zone": "a"}


# The JSON field names of Kueue's Workload API types, as its Go types define them (Kueue's
# apis/kueue/v1beta1 and apis/kueue/v1beta2 packages, workload_types.go, release 0.19): the
# Workload, its spec, a pod set, v1beta2's priority class reference, the status, and the
# conditions (Kubernetes' metav1.Condition).
WORKLOAD_FIELDS = {"apiVersion", "kind", "metadata", "spec", "status"}
SPEC_FIELDS = {
    "v1beta1": {"podSets", "queueName", "priorityClassName", "priority", "priorityClassSource",
                "active", "maximumExecutionTimeSeconds"},
    "v1beta2": {"podSets", "queueName", "priorityClassRef", "priority", "active",
                "maximumExecutionTimeSeconds", "preemptionGates"},
}
POD_SET_FIELDS = {"name", "template", "count", "minCount", "topologyRequest"}
PRIORITY_CLASS_REF_FIELDS = {"group", "kind", "name"}
# The kinds each group allows in a priorityClassRef (its CEL rules).
PRIORITY_CLASS_REF_KINDS = {"scheduling.k8s.io": "PriorityClass",
                            "kueue.x-k8s.io": "WorkloadPriorityClass"}
STATUS_FIELDS = {
    "v1beta1": {"conditions", "admission", "requeueState", "reclaimablePods", "admissionChecks",
                "resourceRequests", "accumulatedPastExexcutionTimeSeconds", "schedulingStats",
                "nominatedClusterNames", "clusterName", "unhealthyNodes"},
    "v1beta2": {"conditions", "admission", "requeueState", "reclaimablePods", "admissionChecks",
                "resourceRequests", "accumulatedPastExecutionTimeSeconds", "schedulingStats",
                "nominatedClusterNames", "clusterName", "unhealthyNodes", "preemptionGates"},
}
CONDITION_FIELDS = {"type", "status", "observedGeneration", "lastTransitionTime", "reason",
                    "message"}
CONDITION_REQUIRED = CONDITION_FIELDS - {"observedGeneration"}


@pytest.mark.parametrize("version", kueue.VERSIONS)
@pytest.mark.parametrize("source", [None, kueue.POD_PRIORITY_SOURCE,
                                    kueue.WORKLOAD_PRIORITY_SOURCE])
def test_the_workload_has_exactly_the_fields_of_its_api_version(version: str,
                                                                source: str | None) -> None:
    owner, job = _job(resources={"gpus": 2, "nodes": 2},
                      template={"tolerations": [{"key": "gpu", "operator": "Exists"}],
                                "affinity": {"nodeAffinity": {}}, "nodeSelector": {"a": "b"},
                                "priorityClassName": "high"})
    priority = None if source is None else kueue.Priority("high", source, 1000)
    workload = kueue.build_workload(owner, job, gpus=2, image="kiln/trainer:test",
                                    priority=priority, active=True, version=version)
    assert workload["apiVersion"] == f"kueue.x-k8s.io/{version}"
    assert set(workload) <= WORKLOAD_FIELDS
    spec = workload["spec"]
    assert {"podSets", "queueName", "active"} <= set(spec) <= SPEC_FIELDS[version]
    for pod_set in spec["podSets"]:
        assert {"name", "count"} <= set(pod_set) <= POD_SET_FIELDS
        assert api.pod_schema_problems(pod_set["template"], "V1PodTemplateSpec", "template") == []
    if source is None:
        assert not {"priorityClassRef", "priorityClassName", "priorityClassSource",
                    "priority"} & set(spec)
    elif version == "v1beta2":
        ref = spec["priorityClassRef"]
        assert set(ref) == PRIORITY_CLASS_REF_FIELDS and ref["name"] == "high"
        assert PRIORITY_CLASS_REF_KINDS[ref["group"]] == ref["kind"]
        assert ref["kind"] == ("PriorityClass" if source == kueue.POD_PRIORITY_SOURCE
                               else "WorkloadPriorityClass")
        assert spec["priority"] == 1000  # required with priorityClassRef (its CEL rule)
        assert "priorityClassName" not in spec and "priorityClassSource" not in spec
    else:
        assert (spec["priorityClassName"], spec["priorityClassSource"], spec["priority"]) == (
            "high", source, 1000)
        assert "priorityClassRef" not in spec


@pytest.mark.parametrize("version", kueue.VERSIONS)
def test_the_status_patches_have_only_fields_of_either_api_version(version: str) -> None:
    admitted = _workload(*ADMITTED, flavors={"cpu": "f"})
    evicted = _workload(*ADMITTED, ("Evicted", "True", "Preempted"), flavors={"cpu": "f"})
    patches = [kueue.pods_ready_patch(admitted, ready=True, now=1.0),
               kueue.release_patch(evicted, now=1.0),
               kueue.finish_patch(admitted, succeeded=True, message="", now=1.0)]
    for patch in patches:
        assert patch is not None and set(patch) <= {"metadata", "status"}
        assert set(patch["status"]) <= STATUS_FIELDS[version]
        for condition in patch["status"]["conditions"]:
            assert CONDITION_REQUIRED <= set(condition) <= CONDITION_FIELDS


@pytest.mark.parametrize(("served", "setting", "version", "warns"), [
    pytest.param(["v1beta1", "v1beta2"], kueue.AUTO, "v1beta2", False, id="both-served"),
    pytest.param(["v1beta1"], kueue.AUTO, "v1beta1", False, id="older-kueue"),
    pytest.param(["v1beta2"], kueue.AUTO, "v1beta2", False, id="v1beta1-removed"),
    pytest.param([], kueue.AUTO, "v1beta2", True, id="no-kueue"),
    pytest.param(["v1beta1", "v1beta2"], "v1beta1", "v1beta1", False, id="forced"),
    pytest.param(["v1beta2"], "v1beta1", "v1beta1", True, id="forced-not-served"),
])
def test_kiln_speaks_the_newest_workload_api_the_server_serves(
        served: list[str], setting: str, version: str, warns: bool) -> None:
    chosen, warning = kueue.choose_version(served, setting)
    assert chosen == version and bool(warning) is warns


def test_the_gate_speaks_the_version_it_was_given() -> None:
    gate = kueue.Kueue(client=None, jobs=None, placement=None,  # type: ignore[arg-type]
                       options=settings.Options(kueue=True, kueue_api_version="v1beta1"),
                       clock=lambda: 0.0)
    assert gate.paths.workloads("a") == "/apis/kueue.x-k8s.io/v1beta1/namespaces/a/workloads"
    assert gate.paths.flavor("f") == "/apis/kueue.x-k8s.io/v1beta1/resourceflavors/f"


def test_workload_names_are_deterministic_per_job_and_fit_an_object_name() -> None:
    assert kueue.workload_name("digits", "u-1") == kueue.workload_name("digits", "u-1")
    assert kueue.workload_name("digits", "u-1") != kueue.workload_name("digits", "u-2")
    assert kueue.workload_name("digits", "u-1").startswith("trainingjob-digits-")
    assert len(kueue.workload_name("x" * 253, "u-1")) <= 253


@pytest.mark.parametrize(("conditions", "assigned", "state"), [
    pytest.param((), {}, kueue.State.PENDING, id="new"),
    pytest.param(ADMITTED[:1], {"flavors": {"cpu": "f"}}, kueue.State.PENDING,
                 id="quota-reserved-awaiting-admission-checks"),
    pytest.param(ADMITTED, {"flavors": {"cpu": "f"}}, kueue.State.ADMITTED, id="admitted"),
    pytest.param((*ADMITTED, ("Evicted", "True", "Preempted")), {"flavors": {"cpu": "f"}},
                 kueue.State.EVICTED, id="evicted"),
    pytest.param((*ADMITTED, ("Evicted", "False", "QuotaReserved")), {"flavors": {"cpu": "f"}},
                 kueue.State.ADMITTED, id="admitted-again-after-an-eviction"),
    pytest.param((("Finished", "True", "Succeeded"),), {}, kueue.State.FINISHED, id="finished"),
])
def test_state_of_reads_kueues_conditions(conditions: tuple[tuple[str, str, str], ...],
                                          assigned: dict[str, Any],
                                          state: kueue.State) -> None:
    assert kueue.state_of(_workload(*conditions, **assigned)) is state


def test_a_multi_node_job_asks_for_one_pod_per_node_as_its_gpu_resource() -> None:
    owner, job = _job(resources={"gpus": 8, "nodes": 2})
    workload = kueue.build_workload(owner, job, gpus=8, image="kiln/trainer:test",
                                    priority=None, active=True, gpu_resource="amd.com/gpu")
    (pod_set,) = workload["spec"]["podSets"]
    assert pod_set["count"] == 2
    assert pod_set["template"]["spec"]["containers"][0]["resources"]["requests"] == {
        "amd.com/gpu": "4"}
    # Kueue's resourceUsage totals the pod set: the grant is the job's 8 GPUs.
    admitted = _workload(*ADMITTED, flavors={"amd.com/gpu": "mi300"}, count=2,
                         resourceUsage={"amd.com/gpu": "8"})
    assert kueue.grant_of(admitted, {"mi300": {}}, ("amd.com/gpu",)).gpus == 8


def test_the_grant_is_the_admitted_flavors_node_labels_and_gpus() -> None:
    workload = _workload(*ADMITTED, flavors={"cpu": "on-demand", pods.GPU_RESOURCE: "a100"},
                         resourceUsage={"cpu": "8", pods.GPU_RESOURCE: "4"})
    grant = kueue.grant_of(workload, {"a100": {"gpu": "a100"}, "on-demand": {"pool": "od"}})
    assert grant == placement_loop.Grant(node_labels=(("gpu", "a100"), ("pool", "od")), gpus=4)
    assert grant.allows({"metadata": {"labels": {"gpu": "a100", "pool": "od", "x": "y"}}})
    assert not grant.allows({"metadata": {"labels": {"gpu": "a100", "pool": "spot"}}})
    cpu_only = kueue.grant_of(_workload(*ADMITTED, flavors={"cpu": "f"}), {"f": {}})
    assert cpu_only.gpus is None and cpu_only.allows({"metadata": {}})


def test_release_after_a_preemption_clears_the_admission_and_requeues() -> None:
    workload = _workload(*ADMITTED, ("Evicted", "True", "Preempted"), flavors={"cpu": "f"})
    patch = kueue.release_patch(workload, now=1_800_000_000.0)
    assert patch["metadata"] == {"resourceVersion": "7"}
    assert patch["status"]["admission"] is None
    by_type = {c["type"]: c for c in patch["status"]["conditions"]}
    assert (by_type["QuotaReserved"]["status"], by_type["QuotaReserved"]["reason"]) == (
        "False", "Pending")
    assert (by_type["Admitted"]["status"], by_type["Admitted"]["reason"]) == (
        "False", "NoReservation")
    assert (by_type["Requeued"]["status"], by_type["Requeued"]["reason"]) == ("True", "Preempted")
    assert by_type["Evicted"]["status"] == "True"  # Kueue resets it when it admits again
    assert kueue.state_of({**workload, "status": patch["status"]}) is kueue.State.EVICTED


def test_release_after_deactivation_leaves_requeueing_to_kueue() -> None:
    workload = _workload(*ADMITTED, ("Evicted", "True", "InactiveWorkload"), flavors={"cpu": "f"})
    by_type = {c["type"]: c for c in kueue.release_patch(workload, now=1.0)["status"]["conditions"]}
    assert by_type["Requeued"]["status"] == "False"


def _pods_ready(workload: dict[str, Any]) -> tuple[str, str] | None:
    found = next((c for c in workload["status"]["conditions"] if c["type"] == "PodsReady"),
                 None)
    return None if found is None else (found["status"], found["reason"])


def test_pods_ready_moves_as_kueues_job_reconciler_moves_it() -> None:
    workload = _workload(*ADMITTED, flavors={"cpu": "f"})
    steps = [(False, ("False", "WaitForStart")), (True, ("True", "Started")),
             (False, ("False", "WaitForRecovery")), (False, ("False", "WaitForRecovery")),
             (True, ("True", "Recovered")), (False, ("False", "WaitForRecovery"))]
    for ready, wanted in steps:
        patch = kueue.pods_ready_patch(workload, ready=ready, now=1_800_000_000.0)
        if patch is None:  # written already: nothing to send
            assert _pods_ready(workload) == wanted
            continue
        assert patch["metadata"] == {"resourceVersion": "7"}
        assert set(patch["status"]) == {"conditions"}  # a merge patch: the admission stays
        workload = {**workload, "status": {**workload["status"], **patch["status"]}}
        assert _pods_ready(workload) == wanted
    assert kueue.state_of(workload) is kueue.State.ADMITTED  # PodsReady changes nothing else


def test_pods_ready_is_false_for_a_workload_without_admission() -> None:
    assert kueue.pods_ready(_workload(), ready=True)[:2] == (False, "WaitForStart")
    evicted = _workload(*ADMITTED, ("Evicted", "True", "PodsReadyTimeout"),
                        ("PodsReady", "False", "WaitForStart"), flavors={"cpu": "f"})
    patch = kueue.release_patch(evicted, now=1.0)
    by_type = {c["type"]: c for c in patch["status"]["conditions"]}
    assert (by_type["PodsReady"]["status"], by_type["PodsReady"]["reason"]) == (
        "False", "WaitForStart")
    # Kueue decides when a Workload evicted for PodsReadyTimeout comes back (its backoff).
    assert (by_type["Requeued"]["status"], by_type["Requeued"]["reason"]) == (
        "False", "PodsReadyTimeout")


def _pod(attempt: int, *, ready: bool = True, phase: str = "Running",
         deleting: bool = False) -> pods.PodState:
    return pods.PodState(
        name=f"digits-trainer-{attempt}", job="digits", attempt=attempt, phase=phase,
        node="n", pod_ip=None, devices=1, device="gpu", parallelism="single",
        estimated_seconds=0.0, started=None, exit_code=None, container_reason=None, message="",
        metrics_port=None, deleting=deleting, ready=ready)


@pytest.mark.parametrize(("placement", "current", "ready"), [
    pytest.param({"node": "n"}, [_pod(0)], True, id="one-ready"),
    pytest.param({"node": "n"}, [_pod(0, ready=False)], False, id="one-not-ready"),
    pytest.param({"node": "n"}, [], False, id="not-created-yet"),
    pytest.param({"node": "n"}, [_pod(0, deleting=True)], False, id="terminating"),
    pytest.param({"node": "n"}, [_pod(0, ready=False, phase="Succeeded")], True,
                 id="succeeded"),
    pytest.param({"node": "a", "nodes": ["a", "b"]}, [_pod(0)], False, id="gang-missing-one"),
    pytest.param({"node": "a", "nodes": ["a", "b"]}, [_pod(0), _pod(0, ready=False)], False,
                 id="gang-one-not-ready"),
    pytest.param({"node": "a", "nodes": ["a", "b"]}, [_pod(0), _pod(0)], True,
                 id="gang-all-ready"),
])
def test_the_gang_is_ready_when_every_pod_of_its_placement_is(
        placement: dict[str, Any], current: list[pods.PodState], ready: bool) -> None:
    st = {"attempts": 1, "placement": placement,
          "conditions": [{"type": "Running", "status": "True"}]}
    assert kueue.gang_ready(st, current) is ready


def test_a_job_waiting_for_kueue_again_has_no_ready_gang() -> None:
    st = {"attempts": 1, "placement": {"node": "n"},
          "conditions": [{"type": "Queued", "status": "True", "reason": "EvictedByKueue"}]}
    assert not kueue.gang_ready(st, [_pod(0)])


def test_finish_marks_the_workload_finished_with_the_jobs_outcome() -> None:
    workload = _workload(*ADMITTED, flavors={"cpu": "f"})
    patch = kueue.finish_patch(workload, succeeded=False, message="Backoff limit reached.",
                               now=1.0)
    finished = next(c for c in patch["status"]["conditions"] if c["type"] == "Finished")
    assert (finished["status"], finished["reason"], finished["message"]) == (
        "True", "Failed", "Backoff limit reached.")
    assert kueue.state_of({**workload, "status": patch["status"]}) is kueue.State.FINISHED


def test_only_labelled_jobs_under_kueue_are_held_until_granted() -> None:
    on: gates.Gate = kueue.Kueue(client=None, jobs=None, placement=None,  # type: ignore[arg-type]
                                 options=settings.Options(kueue=True), clock=lambda: 0.0)
    off: gates.Gate = gates.Open()
    _, labelled = _job()
    _, plain = _job(labels={})
    entry = placement_loop.Queued(
        ref=jobs.JobRef("team-a", "digits"), job=labelled,
        warm_start=select.cold_start(api.WarmStartOutcome.COLD_EMPTY, "cold"), since=0.0)
    assert on.holds(entry) and on.manages(labelled)
    assert not on.holds(dataclasses.replace(entry, grant=placement_loop.Grant()))
    assert not off.holds(entry) and not off.manages(labelled)
    assert not on.holds(dataclasses.replace(entry, job=plain)) and not on.manages(plain)
    assert on.waiting(plain, "u-1") is None and off.waiting(labelled, "u-1") is None
    reason, message = on.waiting(labelled, "u-1") or (None, "")
    assert reason == api.Reason.WAITING_FOR_KUEUE
    assert kueue.workload_name("digits", "u-1") in message
    assert kueue.owner_of(_workload()) == jobs.JobRef("team-a", "digits")


def test_under_kueue_trainer_pods_do_not_carry_the_queue_label() -> None:
    owner, job = _job()
    launch = pods.Launch(node="n", devices=1, parallelism="single", device="cpu",
                         warm_start=select.cold_start(api.WarmStartOutcome.COLD_EMPTY, "cold"),
                         estimated_seconds=1.0, started=1.0)
    plain = settings.pod_settings(settings.Options())
    managed = settings.pod_settings(settings.Options(kueue=True))
    labels = pods.build_pod(owner, job, attempt=0, launch=launch, settings=plain)[
        "metadata"]["labels"]
    assert labels[kueue.QUEUE_LABEL] == "gpu"
    labels = pods.build_pod(owner, job, attempt=0, launch=launch, settings=managed)[
        "metadata"]["labels"]
    assert kueue.QUEUE_LABEL not in labels


def _profiled(reason: str, status: str = "Unknown") -> dict[str, Any]:
    """A job's status with its Profiled condition."""
    return {"conditions": [{"type": "Profiled", "status": status, "reason": reason,
                            "message": reason, "lastTransitionTime": "2026-01-01T00:00:00Z"}]}


WAITS = _profiled(api.Reason.WAITING_FOR_KUEUE.value)


@pytest.mark.parametrize(("workload", "allowed"), [
    pytest.param(_workload(), False, id="new"),
    pytest.param(_workload(ADMITTED[0], flavors={"cpu": "f"}), False,
                 id="quota-reserved-awaiting-admission-checks"),
    pytest.param(_workload(*ADMITTED, ("Evicted", "True", "Preempted"), flavors={"cpu": "f"}),
                 False, id="evicted"),
    pytest.param(_workload(("Finished", "True", "Succeeded")), False, id="finished"),
    pytest.param(_workload(*ADMITTED), False, id="conditions-without-an-admission"),
    pytest.param(_workload(*ADMITTED, flavors={"cpu": "f"}), True, id="admitted"),
])
def test_a_profiling_pod_is_made_only_once_kueue_admitted_its_jobs_workload(
        workload: dict[str, Any], allowed: bool) -> None:
    assert kueue.may_profile(WAITS, workload) is allowed


@pytest.mark.parametrize("st", [
    pytest.param({}, id="not-admitted-by-kiln-yet"),
    pytest.param(_profiled(api.Reason.PROFILING.value), id="its-pod-runs-already"),
    pytest.param(_profiled(api.Reason.MODEL_PROFILED.value, "True"), id="profiled"),
    pytest.param({**WAITS, "conditions": [*WAITS["conditions"], {
        "type": "Failed", "status": "True", "reason": "InvalidSpec", "message": "",
        "lastTransitionTime": "2026-01-01T00:00:00Z"}]}, id="failed"),
])
def test_an_admitted_workload_starts_no_profiling_pod_the_job_does_not_wait_for(
        st: dict[str, Any]) -> None:
    assert not kueue.may_profile(st, _workload(*ADMITTED, flavors={"cpu": "f"}))


def test_profiling_waits_for_quota_or_runs_never_both() -> None:
    running = _profiled(api.Reason.PROFILING.value)
    assert profiling.waits_for_quota(WAITS) and not profiling.running(WAITS)
    assert profiling.running(running) and not profiling.waits_for_quota(running)
    done = _profiled(api.Reason.MODEL_PROFILED.value, "True")
    assert not profiling.running(done) and not profiling.waits_for_quota(done)


def test_the_profiling_pod_stays_within_the_grant_when_it_holds_no_device() -> None:
    owner, job = _job()
    pod = profiling.build_pod(owner, job, profiling.Device(None, "cpu", 0),
                              settings=settings.pod_settings(settings.Options()),
                              timeout_seconds=60, now=0.0, node_labels={"pool": "od"})
    assert pod["spec"]["nodeSelector"]["pool"] == "od"


def test_a_suspended_job_is_not_profiled_while_its_workload_is_still_admitted() -> None:
    suspended = {"conditions": [*WAITS["conditions"], {
        "type": "Suspended", "status": "True", "reason": "SuspendedByUser", "message": "",
        "lastTransitionTime": "2026-01-01T00:00:00Z"}]}
    assert not kueue.may_profile(suspended, _workload(*ADMITTED, flavors={"cpu": "f"}))

"""The profiling pod of a user-code model: its device, its manifest, reading its report, and
the placement estimate it feeds."""

from __future__ import annotations

import math
from typing import Any

import pytest

from kiln import api, contract
from kiln.controller import cluster, pods, profiling
from kiln.controller import settings as operator_settings
from kiln.placement import estimate

SETTINGS = operator_settings.pod_settings(operator_settings.Options(
    default_image="kiln/trainer:test", zoo_uri="s3://zoo", zoo_endpoint="minio:9000",
    zoo_secret="zoo-creds", zoo_pod_access="credentials"))


def _job(gpus: int | None = None, **template: Any) -> tuple[dict[str, Any], api.TrainingJob]:
    spec: dict[str, Any] = {
        "model": {"entrypoint": "mynets.mixer:mixer", "args": {"dim": 8},
                  "task": "classification", "inputShape": [1, 8, 8]},
        "training": {"batchSize": 32, "epochs": 3}}
    if gpus is not None:
        spec["resources"] = {"gpus": gpus}
    if template:
        spec["template"] = template
    doc = {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob",
           "metadata": {"name": "mixer", "namespace": "team-a", "uid": "u-1"}, "spec": spec}
    return doc, api.parse_job(doc)


def _node(name: str, gpus: int) -> dict[str, Any]:
    return {"metadata": {"name": name}, "status": {"allocatable": {"nvidia.com/gpu": str(gpus)}}}


def _trainer(job: str, node: str, devices: int) -> dict[str, Any]:
    return {"metadata": {"name": f"{job}-trainer-0", "namespace": "team-a",
                         "labels": {api.JOB_NAME_LABEL: job, api.ATTEMPT_LABEL: "0"},
                         "annotations": {pods.NODE_ANNOTATION: node,
                                         pods.GPUS_ANNOTATION: str(devices),
                                         pods.DEVICE_ANNOTATION: "gpu"}},
            "spec": {"nodeName": node}, "status": {"phase": "Running"}}


def test_only_models_from_user_code_are_profiled() -> None:
    _, job = _job()
    registry = api.parse_job({"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob",
                              "metadata": {"name": "cnn"},
                              "spec": {"model": {"architecture": "small_cnn",
                                                 "inputShape": [1, 8, 8]}}})
    assert profiling.needed(job) and not profiling.needed(registry)


def test_the_pod_borrows_a_gpu_on_the_node_with_the_most_free_and_the_planner_sees_it() -> None:
    _, job = _job()
    nodes = [_node("gpu-a", 2), _node("gpu-b", 4)]
    busy = [_trainer("other", "gpu-b", 3)]  # gpu-b: 1 free; gpu-a: 2 free
    device = profiling.choose_device(cluster.pools(nodes, busy, cpu_slots=1, now=0.0), job)
    assert device == profiling.Device("gpu-a", "gpu", 1)

    owner, _ = _job()
    pod = profiling.build_pod(owner, job, device, settings=SETTINGS, timeout_seconds=300,
                              now=5.0)
    pod["metadata"]["namespace"] = "team-a"
    pod["spec"]["nodeName"] = "gpu-a"
    pod["status"] = {"phase": "Running"}
    pools = cluster.pools(nodes, [*busy, pod], cpu_slots=1, now=10.0)
    assert pools.free_devices(cluster.GPU_POOL, "gpu-a") == 1


def test_with_no_free_device_the_pod_holds_nothing_and_is_not_pinned() -> None:
    owner, job = _job()
    nodes = [_node("gpu-a", 1)]
    device = profiling.choose_device(
        cluster.pools(nodes, [_trainer("other", "gpu-a", 1)], cpu_slots=1, now=0.0), job)
    assert device == profiling.Device(None, "cpu", 0)
    pod = profiling.build_pod(owner, job, device, settings=SETTINGS, timeout_seconds=300,
                              now=0.0)
    assert "affinity" not in pod["spec"]
    assert "nvidia.com/gpu" not in pod["spec"]["containers"][0]["resources"].get("limits", {})
    pod["metadata"]["namespace"] = "team-a"
    pod["spec"]["nodeName"] = "gpu-a"
    pod["status"] = {"phase": "Running"}
    pools = cluster.pools(nodes, [pod], cpu_slots=1, now=0.0)
    assert pools.free_devices(cluster.GPU_POOL, "gpu-a") == 1  # it holds no GPU


def test_the_pods_gpu_counts_against_its_namespaces_quota() -> None:
    _, job = _job()
    pools = cluster.pools([_node("gpu-a", 4)], [_trainer("other", "gpu-a", 1)], cpu_slots=1,
                          now=0.0)
    assert pools.held_gpus("team-a") == 1 and pools.held_gpus("team-b") == 0
    assert profiling.choose_device(pools, job, gpus_left=1) == profiling.Device(
        "gpu-a", "gpu", 1)
    # Its namespace holds all its quota allows: no GPU, though 3 are free.
    assert profiling.choose_device(pools, job, gpus_left=0) == profiling.Device(None, "cpu", 0)


def test_a_cpu_only_job_profiles_on_a_cpu_slot() -> None:
    _, job = _job(gpus=0)
    nodes = [{"metadata": {"name": "cpu-1"}, "status": {}}, _node("gpu-a", 1)]
    device = profiling.choose_device(cluster.pools(nodes, [], cpu_slots=2, now=0.0), job)
    assert device == profiling.Device("cpu-1", "cpu", 1)


def test_the_pod_runs_the_profiling_step_in_the_jobs_image_with_its_mounts() -> None:
    owner, job = _job(image="team/own:1", command=["python", "train.py"], args=["--fast"],
                      volumes=[{"name": "data", "emptyDir": {}}],
                      volumeMounts=[{"name": "data", "mountPath": "/data"}])
    pod = profiling.build_pod(owner, job, profiling.Device("gpu-a", "gpu", 1),
                              settings=SETTINGS, timeout_seconds=120.5, now=0.0)
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["name"] == "mixer-profile"
    assert meta["labels"][profiling.ROLE_LABEL] == profiling.ROLE
    assert api.ATTEMPT_LABEL not in meta["labels"]
    assert profiling.is_profiling_pod(pod)
    assert spec["activeDeadlineSeconds"] == 120
    container = spec["containers"][0]
    assert container["image"] == "team/own:1"
    assert container["command"] == ["python", "-m", "kiln_trainer", "--profile"]
    assert "args" not in container  # the own command's args are not the profiling step's
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert {"name": "data", "mountPath": "/data"} in container["volumeMounts"]
    names = {e["name"] for e in container["env"]}
    assert "KILN_JOB" in names and "KILN_WARM_START" not in names  # it decides


def _profile(**changes: Any) -> contract.Profile:
    values: dict[str, Any] = {
        "parameters": 12_345, "flops_per_sample": 2.5e6, "graph_nodes": 9, "untraceable": None,
        "device": "cuda:NVIDIA H200", "batch_size": 32, "step_seconds": 0.004,
        "step_status": "ok", "warm_start_decision": None, "zoo_key": "profiles/team-a/mixer.json"}
    return contract.Profile(**{**values, **changes})


def test_the_report_round_trips_through_the_termination_message_and_status() -> None:
    report = _profile()
    message = contract.termination_message(report).decode()
    state = pods.pod_state({"metadata": {"name": "mixer-profile"}, "status": {
        "phase": "Succeeded", "containerStatuses": [{"name": "trainer", "state": {
            "terminated": {"exitCode": 0, "message": message}}}]}})
    assert profiling.read(state) == report
    wire = api.to_wire(profiling.to_status(report))  # as status.profile holds it
    measured = profiling.measurement(api.ProfileStatus.model_validate(wire))
    assert measured == estimate.ModelMeasurement(
        parameters=12_345, flops_per_sample=2.5e6, device_type="cuda:NVIDIA H200",
        batch_size=32, step_seconds=0.004)
    assert "12,345 parameters" in profiling.summary(report, "mixer-profile")
    assert "4.0 ms per step at batch 32 on cuda:NVIDIA H200" in profiling.summary(
        report, "mixer-profile")


def test_a_malformed_report_is_an_error_naming_the_field() -> None:
    bad_decision = _profile(warm_start_decision={"outcome": "warm", "parent": 7})
    for report, field in ((_profile(parameters="12345"), "'parameters'"),
                          (bad_decision, ("'warm_start_decision.parent': input should be a "
                                          "valid string; got int 7"))):
        state = pods.pod_state({"metadata": {"name": "mixer-profile"}, "status": {
            "phase": "Succeeded", "containerStatuses": [{"name": "trainer", "state": {
                "terminated": {"exitCode": 0,
                               "message": contract.to_line(report)}}}]}})
        with pytest.raises(ValueError, match=field):
            profiling.read(state)


def test_an_untraceable_or_unmeasured_model_reads_as_such() -> None:
    report = _profile(graph_nodes=None, untraceable="torch.fx: data-dependent control flow",
                      step_seconds=None, step_status="oom")
    text = profiling.summary(report, "p")
    assert "no graph (torch.fx: data-dependent control flow" in text
    assert "batch 32 does not fit one device" in text
    measured = profiling.measurement(profiling.to_status(report))
    assert measured is not None and measured.out_of_memory and measured.step_seconds is None
    assert profiling.measurement(None) is None


def test_the_measured_step_replaces_the_nominal_estimate_on_its_device_kind() -> None:
    _, job = _job()
    nominal = estimate.configs(job, zoo=None, profile_cache=None, max_gpus=1,
                               device_type="cuda")
    measured = estimate.ModelMeasurement(parameters=12_345, flops_per_sample=2.5e6,
                                         device_type="cuda:NVIDIA H200", batch_size=32,
                                         step_seconds=0.25)
    profiled = estimate.configs(job, zoo=None, profile_cache=None, max_gpus=1,
                                device_type="cuda", measured=measured)
    assert [c.source for c in profiled] == ["profile"]
    work = estimate.workload(job)
    device = estimate.device_model("cuda")
    assert math.isclose(profiled[0].seconds, estimate.job_seconds(work, 0.25, device))
    assert profiled[0].seconds != nominal[0].seconds
    # Timed on a CPU: on GPUs only its FLOPs count.
    on_cpu = estimate.configs(job, zoo=None, profile_cache=None, max_gpus=1,
                              device_type="cuda",
                              measured=estimate.ModelMeasurement(12_345, 2.5e6, "cpu", 32, 0.25))
    assert [c.source for c in on_cpu] == ["flops"]
    # Out of memory at the whole batch on one device: single is infeasible, DDP may fit.
    oom = estimate.ModelMeasurement(12_345, 2.5e6, "cuda:X", 32, None, out_of_memory=True)
    split = estimate.configs(job, zoo=None, profile_cache=None, max_gpus=2, device_type="cuda",
                             measured=oom)
    assert [(c.parallelism, c.gpus) for c in split] == [("ddp", 2)]

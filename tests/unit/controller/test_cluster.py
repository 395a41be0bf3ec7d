"""Device pools from nodes and pods (kiln.controller.cluster, pure)."""

from __future__ import annotations

from typing import Any

from kiln import api
from kiln.controller import cluster, pods


def _node(name: str, gpus: int = 0, *, ready: bool = True) -> dict[str, Any]:
    allocatable = {"cpu": "8"} | ({"nvidia.com/gpu": str(gpus)} if gpus else {})
    return {"metadata": {"name": name}, "status": {"allocatable": allocatable, "conditions": [
        {"type": "Ready", "status": "True" if ready else "False"}]}}


def _kiln_pod(name: str, job: str, node: str, devices: int, *, phase: str = "Running",
              device: str = "gpu") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "labels": {
        api.JOB_NAME_LABEL: job, api.ATTEMPT_LABEL: "0"}, "annotations": {
        pods.NODE_ANNOTATION: node, pods.GPUS_ANNOTATION: str(devices),
        pods.DEVICE_ANNOTATION: device, pods.PARALLELISM_ANNOTATION: "ddp",
        pods.ESTIMATED_SECONDS_ANNOTATION: "100", pods.STARTED_ANNOTATION: "1000"}},
        "status": {"phase": phase}}


def test_gpu_nodes_lose_the_gpus_other_workloads_request() -> None:
    other = {"metadata": {"name": "x", "namespace": "ns"}, "spec": {"nodeName": "g1",
             "containers": [{"resources": {"limits": {"nvidia.com/gpu": "3"}}}]},
             "status": {"phase": "Running"}}
    found = cluster.pools([_node("g1", 8), _node("g2", 4, ready=False)], [other], cpu_slots=1,
                          now=1050.0)
    assert [(n.name, n.gpus) for n in found.nodes["gpu"]] == [("g1", 5)]


def test_kiln_pods_are_running_jobs_holding_their_devices() -> None:
    found = cluster.pools([_node("g1", 8)], [
        _kiln_pod("a-trainer-0", "a", "g1", 4),
        _kiln_pod("b-trainer-0", "b", "g1", 2, phase="Succeeded")], cpu_slots=1, now=1050.0)
    assert [(r.job, r.gpus, r.remaining_seconds) for r in found.running["gpu"]] == [
        ("ns/a", 4, 50.0)]
    assert found.free_devices("gpu", "g1") == 4


def test_a_cpu_only_cluster_has_slots() -> None:
    found = cluster.pools([_node("c1"), _node("c2")],
                          [_kiln_pod("a-trainer-0", "a", "c1", 1, device="cpu")], cpu_slots=2,
                          now=0.0, eta_seconds={"ns/a": 30.0})
    assert [(n.name, n.gpus) for n in found.nodes["cpu"]] == [("c1", 2), ("c2", 2)]
    assert found.running["cpu"][0].remaining_seconds == 30.0
    assert found.free_devices("cpu", "c1") == 1
    assert found.pool_for(wants_gpus=True) == "cpu"


def test_a_gpu_type_keeps_only_nodes_labelled_with_it() -> None:
    a100 = _node("a100-1", 8)
    a100["metadata"]["labels"] = {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}
    t4 = _node("t4-1", 4)
    t4["metadata"]["labels"] = {"nvidia.com/gpu.product": "Tesla-T4"}
    wanted = cluster.GpuType("NVIDIA-A100-SXM4-80GB")
    found = cluster.pools([a100, t4, _node("unlabelled", 2), _node("c1")], [], cpu_slots=1,
                          now=0.0, gpu_type=wanted)
    assert [n.name for n in found.nodes["gpu"]] == ["a100-1"]
    assert [n.name for n in found.nodes["cpu"]] == ["c1"]  # other GPU nodes join no pool
    assert len(cluster.pools([a100, t4], [], cpu_slots=1, now=0.0).nodes["gpu"]) == 2


def test_configured_gpu_resources_make_gpu_nodes_and_name_what_their_pods_ask_for() -> None:
    def node(name: str, allocatable: dict[str, str]) -> dict[str, Any]:
        return {"metadata": {"name": name}, "status": {"allocatable": {"cpu": "8", **allocatable}}}

    nodes = [node("amd", {"amd.com/gpu": "4"}), node("mig", {"nvidia.com/mig-1g.10gb": "7"}),
             node("nv", {"nvidia.com/gpu": "2"}), node("cpu", {})]
    other = {"metadata": {"name": "x", "namespace": "ns"}, "spec": {"nodeName": "mig",
             "containers": [{"resources": {"limits": {"nvidia.com/mig-1g.10gb": "3"}}}]},
             "status": {"phase": "Running"}}
    found = cluster.pools(nodes, [other], cpu_slots=1, now=0.0, gpu_resources=(
        "nvidia.com/gpu", "nvidia.com/mig-1g.10gb", "amd.com/gpu"))
    assert [(n.name, n.gpus) for n in found.nodes["gpu"]] == [("amd", 4), ("mig", 4), ("nv", 2)]
    assert found.gpu_resource == {"amd": "amd.com/gpu", "mig": "nvidia.com/mig-1g.10gb",
                                  "nv": "nvidia.com/gpu"}
    # By default only nvidia.com/gpu counts: the others are CPU nodes.
    default = cluster.pools(nodes, [], cpu_slots=1, now=0.0)
    assert [n.name for n in default.nodes["gpu"]] == ["nv"]
    assert [n.name for n in default.nodes["cpu"]] == ["amd", "cpu", "mig"]


def test_a_job_only_counts_the_pools_of_nodes_it_may_use() -> None:
    found = cluster.pools([_node("g1", 4), _node("c1")], [], cpu_slots=1, now=0.0)
    assert found.pool_for(True) == "gpu"
    assert found.pool_for(True, among=frozenset({"c1"})) == "cpu"
    assert found.pool_for(False, among=frozenset({"g1"})) == "gpu"
    assert found.pool_for(True, among=frozenset()) is None

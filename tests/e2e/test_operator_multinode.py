"""Multi-node jobs under the real operator: a job needing more GPUs than one node has runs as a
gang of trainer pods, one per node, joined by torchrun's c10d rendezvous; a killed pod restarts
the whole gang, which resumes from its checkpoint and registers one model.

A cluster of its own: two nodes with 2 GPUs each (no GPU runs here: each pod's 2 trainer
processes fall back to the CPU and gloo), so 4 GPUs fit only across both nodes.
"""

from __future__ import annotations

import re
import signal
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubesim import client, emulator, kubelet, operator_process, scenario, usage

from kiln.controller import gang, pods
from kiln.zoo import records

pytestmark = pytest.mark.xdist_group(__name__)  # one worker builds its module fixtures

NODES = ("gpu-node-a", "gpu-node-b")
GPUS_PER_NODE = 2
START_TIMEOUT_SECONDS = 10  # the test kubelet starts a pod it can schedule at once
# The killed gang's budget: far more epochs left after its first checkpoint than it trains
# between two of the kubelet's checks (every poll), so the kill lands mid-run.
EPOCHS = 12


@pytest.fixture(scope="module")
def gang_cluster(api_calls: set[Any]) -> Iterator[emulator.Emulator]:
    with emulator.Emulator() as running:
        for node in NODES:
            running.client.create_node(node, gpus=GPUS_PER_NODE)
        yield running
        api_calls |= usage.api_calls(running.requests)


@pytest.fixture(scope="module")
def gang_operated(gang_cluster: emulator.Emulator, zoo: scenario.Zoo, operator_args: list[str],
                  tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[tuple[kubelet.Kubelet, operator_process.OperatorProcess]]:
    with scenario.operated(gang_cluster, tmp_path_factory.mktemp("gang"), env=zoo.operator_env,
                           args=[*operator_args, "--no-profile-unmeasured",
                                 "--pod-start-timeout-seconds", str(START_TIMEOUT_SECONDS)]
                           ) as running:
        yield running  # the estimate needs no profile


@pytest.fixture
def gang_namespace(gang_cluster: emulator.Emulator,
                   zoo_secret: tuple[str, dict[str, str]]) -> str:
    name = f"gang-{uuid.uuid4().hex[:8]}"
    gang_cluster.client.create_secret(name, *zoo_secret)
    return name


def _gang_job(name: str, resources: dict[str, Any], *, epochs: int) -> dict[str, Any]:
    doc = scenario.tiny_job(name, epochs=epochs)
    doc["spec"]["resources"] = resources
    return doc


def _created_pods(cluster: emulator.Emulator, namespace: str) -> dict[str, dict[str, Any]]:
    """The pods the operator created in `namespace`, as it sent them (cleanPodPolicy may have
    deleted them since)."""
    return {r.body["metadata"]["name"]: r.body for r in cluster.requests
            if r.resource == "pods" and r.action == "CREATE" and r.namespace == namespace}


def _ranks(log: str) -> set[int]:
    """Global ranks of 4 that a pod's log says it ran (the trainer logs "rank R of W")."""
    return {int(r) for r in re.findall(r"rank (\d+) of 4 \(ddp", log)}


def test_a_two_node_gang_runs_restarts_together_when_a_pod_dies_and_registers_once(
    gang_cluster: emulator.Emulator,
    gang_operated: tuple[kubelet.Kubelet, operator_process.OperatorProcess],
    zoo: scenario.Zoo, gang_namespace: str,
) -> None:
    gang_kubelet, gang_operator = gang_operated
    # One job covers both the gang's layout and its restart: each multi-node job here costs a
    # rendezvous of four processes per attempt, so one job with a fault is the cheapest check.
    name, ns = "digits-gang", gang_namespace
    # Kill the second node's trainer of the first attempt once a checkpoint exists (the
    # fault is looked up when a pod starts).
    checkpointed = scenario.checkpointed(zoo, ns, name)
    fault = gang_kubelet.inject(kubelet.Fault(
        job=name, signal=signal.SIGKILL, attempts=frozenset({0}),
        when=lambda pod: pod.name.endswith("-1") and checkpointed(pod), check_every_seconds=0.0))
    gang_cluster.client.create_job(ns, _gang_job(name, {"gpus": 4, "nodes": 2}, epochs=EPOCHS))
    done = scenario.wait_phase(gang_cluster, ns, name, "Succeeded",
                               details=gang_operator.log_tail)

    assert fault.hits == [f"{name}-trainer-0-1"]
    assert done["status"]["restarts"] == 1 and done["status"]["attempts"] == 2
    # The gang restarted together: both pods of attempt 0 deleted, both of attempt 1 created.
    assert scenario.pod_creations(gang_cluster, ns, name) == [
        f"{name}-trainer-0", f"{name}-trainer-0-1", f"{name}-trainer-1", f"{name}-trainer-1-1"]
    deleted = {r.name for r in gang_cluster.requests if r.resource == "pods"
               and r.action == "DELETE" and r.namespace == ns}
    assert {f"{name}-trainer-0", f"{name}-trainer-0-1"} <= deleted
    assert scenario.wait_event(gang_cluster, ns, name, "TrainerExited")["type"] == "Warning"
    placement = done["status"]["placement"]
    assert sorted(placement["nodes"]) == sorted(NODES) and placement["gpus"] == 4
    leader, worker = f"{name}-trainer-1", f"{name}-trainer-1-1"
    created = _created_pods(gang_cluster, ns)
    # One pod per planned node, each with its rank and DNS name, under one headless Service.
    assert [pods.planned_node(created[p]) for p in (leader, worker)] == placement["nodes"]
    assert [pods.rank_of(created[p]) for p in (leader, worker)] == [0, 1]
    assert {created[p]["spec"]["subdomain"] for p in (leader, worker)} == {
        gang.service_name(name)}
    service = gang_cluster.client.get(f"/api/v1/namespaces/{ns}/services/"
                                      f"{gang.service_name(name)}")
    assert service is not None and service["spec"]["clusterIP"] == "None"
    # All four ranks trained together: two per pod, rank 0 (which reports) in the first.
    assert _ranks(gang_kubelet.pod_log(ns, leader)) == {0, 1}
    assert _ranks(gang_kubelet.pod_log(ns, worker)) == {2, 3}
    result = scenario.termination_result(gang_cluster, ns, leader)
    assert result["resumed_from_epoch"] >= 1 and result["epochs_run"] == EPOCHS
    assert done["status"]["result"]["zooModel"] == result["zoo_model"]
    assert [r.id for r in records.list_records(zoo.store)
            if r.job_name == name] == [result["zoo_model"]]  # registered once, by rank 0
    client.wait_until(lambda: all(
        p["status"].get("phase") in ("Succeeded", "Failed") or p["metadata"].get(
            "deletionTimestamp") for p in gang_cluster.client.pods(ns, name)),
        timeout_seconds=60, what="no trainer of the job left running")


def test_a_gang_whose_second_pod_never_schedules_fails_at_the_start_timeout_and_lets_go(
    gang_cluster: emulator.Emulator,
    gang_operated: tuple[kubelet.Kubelet, operator_process.OperatorProcess],
    gang_namespace: str,
) -> None:
    gang_kubelet, gang_operator = gang_operated
    name, ns = "digits-half-gang", gang_namespace
    stuck = f"{name}-trainer-0-1"
    gang_kubelet.unschedulable_pods.add(f"{ns}/{stuck}")  # rank 1: no node takes it
    try:
        gang_cluster.client.create_job(ns, _gang_job(name, {"gpus": 4, "nodes": 2}, epochs=4))
        # Rank 0 starts and waits in the rendezvous: the job runs, as its pod says.
        scenario.wait_event(gang_cluster, ns, name, "TrainerStarted", timeout_seconds=120)
        failed = scenario.wait_phase(gang_cluster, ns, name, "Failed",
                                     details=gang_operator.log_tail)
    finally:
        gang_kubelet.unschedulable_pods.discard(f"{ns}/{stuck}")
    reason = scenario.condition(failed, "Failed") or {}
    assert reason["reason"] == "PodStartTimeout"
    assert f"Trainer pod {stuck} was not running {START_TIMEOUT_SECONDS} s" in reason["message"]
    assert "cannot be scheduled" in reason["message"]
    assert "starts all its 2 pods or none" in reason["message"]
    # Both pods go (the stuck one, and rank 0 by cleanPodPolicy Running): the 4 GPUs are free.
    client.wait_until(lambda: gang_cluster.client.pods(ns, name) == [], timeout_seconds=60,
                      what="the gang's pods to be deleted", details=gang_operator.log_tail)
    assert scenario.pod_creations(gang_cluster, ns, name) == [f"{name}-trainer-0", stuck]

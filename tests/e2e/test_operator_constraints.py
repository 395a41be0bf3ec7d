"""Scheduling constraints under the real operator: placement honours nodeSelector and taints.

A cluster of its own: a plain CPU node, and a GPU node labelled pool=ml and tainted
dedicated=ml:NoSchedule whose GPUs are ``amd.com/gpu`` (the operator runs with
``--gpu-resource nvidia.com/gpu --gpu-resource amd.com/gpu``; no GPU runs here, the trainer falls
back to the CPU). A job that tolerates the taint runs on the GPU node and its pod asks for
amd.com/gpu; one that does not is held (the plain node lacks its label); one whose nodeSelector
matches no node never gets a pod, nor one whose CPU request fits no node. The held jobs stay
Queued, saying why.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubesim import emulator, operator_process, scenario, usage

PLAIN = "plain-node"
ML = "ml-gpu-node"
ZOO_SECRET = "kiln-zoo"
TAINT = {"key": "dedicated", "value": "ml", "effect": "NoSchedule"}
OPERATOR_ARGS = [
    "--placement-interval-seconds", "1", "--housekeeping-interval-seconds", "0.5",
    "--no-placement-use-milp", "--zoo-refresh-seconds", "0",
    "--termination-grace-seconds", "30", "--zoo-retry-delay-seconds", "0.5",
    "--zoo-request-attempts", "1", "--no-resize", "--no-profile-unmeasured",
    "--gpu-resource", "nvidia.com/gpu", "--gpu-resource", "amd.com/gpu",
]


def _node(name: str, *, labels: dict[str, str], taints: list[dict[str, str]],
          allocatable: dict[str, str]) -> dict[str, Any]:
    allocatable = {"cpu": "4", "memory": "8Gi", "pods": "110", **allocatable}
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **labels}},
            "spec": {"taints": taints},
            "status": {"allocatable": allocatable, "capacity": dict(allocatable),
                       "conditions": [{"type": "Ready", "status": "True"}]}}


@pytest.fixture(scope="module")
def constrained_cluster(api_calls: set[Any]) -> Iterator[emulator.Emulator]:
    with emulator.Emulator() as running:
        running.client.create("/api/v1/nodes", _node(PLAIN, labels={}, taints=[],
                                                     allocatable={}))
        running.client.create("/api/v1/nodes", _node(ML, labels={"pool": "ml"}, taints=[TAINT],
                                                     allocatable={"amd.com/gpu": "1"}))
        yield running
        api_calls |= usage.api_calls(running.requests)


@pytest.fixture(scope="module")
def constrained_operator(constrained_cluster: emulator.Emulator, zoo: scenario.Zoo,
                         tmp_path_factory: pytest.TempPathFactory
                         ) -> Iterator[operator_process.OperatorProcess]:
    with scenario.operated(
            constrained_cluster, tmp_path_factory.mktemp("constraints"), env=zoo.operator_env,
            args=["--zoo-uri", zoo.uri, "--zoo-endpoint", zoo.endpoint, "--zoo-secret",
                  ZOO_SECRET, *OPERATOR_ARGS]) as (_, running):
        yield running


def _job(name: str, **template: Any) -> dict[str, Any]:
    job = scenario.tiny_job(name, epochs=1, max_samples=200)
    job["spec"]["warmStart"] = {"enabled": False}
    job["spec"]["zoo"] = {"register": False}
    job["spec"]["template"].update(template)
    return job


def _held(cluster: emulator.Emulator, namespace: str, name: str) -> dict[str, Any]:
    """The job once it is Queued with Placed=False/NoFeasibleConfig; returns that condition."""
    job = scenario.wait_job(
        cluster, namespace, name,
        lambda doc: (scenario.condition(doc, "Placed") or {}).get("reason")
        == "NoFeasibleConfig", what="held with NoFeasibleConfig")
    assert scenario.phase(job) == "Queued", job["status"]
    placed = scenario.condition(job, "Placed")
    assert placed is not None
    return placed


def test_jobs_run_only_where_their_selector_and_tolerations_allow(
        constrained_cluster: emulator.Emulator, zoo: scenario.Zoo,
        constrained_operator: operator_process.OperatorProcess) -> None:
    cluster = constrained_cluster
    namespace = f"e2e-{uuid.uuid4().hex[:8]}"
    cluster.client.create_secret(namespace, ZOO_SECRET, {
        "accessKey": zoo.access_key, "secretKey": zoo.secret_key})
    toleration = {"key": "dedicated", "operator": "Equal", "value": "ml",
                  "effect": "NoSchedule"}
    cluster.client.create_job(namespace, _job("no-match", nodeSelector={"gpu": "a100"}))
    cluster.client.create_job(namespace, _job("untolerated", nodeSelector={"pool": "ml"}))
    cluster.client.create_job(namespace, _job("tolerated", nodeSelector={"pool": "ml"},
                                              tolerations=[toleration],
                                              resources={"requests": {"cpu": "1"}}))
    cluster.client.create_job(namespace, _job("too-big", tolerations=[toleration],
                                              resources={"requests": {"cpu": "16"}}))

    no_match = _held(cluster, namespace, "no-match")["message"]
    assert f"2 nodes do not match nodeSelector gpu=a100 ({ML}, {PLAIN})" in no_match, no_match
    untolerated = _held(cluster, namespace, "untolerated")["message"]
    assert f"1 node does not match nodeSelector pool=ml ({PLAIN})" in untolerated, untolerated
    assert f"1 node has taint dedicated=ml:NoSchedule not tolerated ({ML})" in untolerated
    event = scenario.wait_event(cluster, namespace, "untolerated", "NoFeasibleConfig")
    assert event["type"] == "Warning" and "not tolerated" in event["message"], event
    too_big = _held(cluster, namespace, "too-big")["message"]
    # (how much is free on the ML node depends on whether "tolerated" runs there yet)
    assert "too little cpu free for its request 16" in too_big, too_big
    assert f"({PLAIN})" in too_big and f"({ML})" in too_big or f"({ML}, {PLAIN})" in too_big

    done = scenario.wait_phase(cluster, namespace, "tolerated", "Succeeded",
                               details=constrained_operator.log_tail)
    assert done["status"]["placement"]["node"] == ML, done["status"]
    pod = cluster.client.get(cluster.client.pods_path(namespace, "tolerated-trainer-0")) or {}
    limits = pod["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {"amd.com/gpu": "1"}, limits  # the resource the node offers
    assert pod["spec"]["tolerations"] == [toleration]

    # It ran to the end meanwhile; the held jobs never got a pod and are still queued.
    for name in ("no-match", "untolerated", "too-big"):
        assert scenario.pod_creations(cluster, namespace, name) == [], name
        job = cluster.client.job(namespace, name)
        assert scenario.phase(job) == "Queued", job

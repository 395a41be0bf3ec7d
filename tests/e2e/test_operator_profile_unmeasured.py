"""Profiling on the cluster under the real operator: a built-in model with no measurement on the
cluster's GPU type is profiled once on a GPU of that type; a second job of the same model and
batch reuses that profile and starts without a profiling pod.

A cluster of its own: one node with 2 GPUs labelled with a GPU product (no GPU runs here, the
pods fall back to the CPU).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubesim import emulator, operator_process, scenario, usage

from kiln import api

NODE = "typed-gpu-node"
PRODUCT = "NVIDIA-A100-SXM4-40GB"
ZOO_SECRET = "kiln-zoo"
OPERATOR_ARGS = [
    "--placement-interval-seconds", "1", "--housekeeping-interval-seconds", "0.5",
    "--no-placement-use-milp", "--zoo-refresh-seconds", "0",
    "--termination-grace-seconds", "30", "--zoo-retry-delay-seconds", "0.5",
    "--zoo-request-attempts", "1", "--no-resize",
]


@pytest.fixture(scope="module")
def typed_cluster(api_calls: set[Any]) -> Iterator[emulator.Emulator]:
    with emulator.Emulator() as running:
        allocatable = {"cpu": "2", "memory": "8Gi", "pods": "110", "nvidia.com/gpu": "2"}
        running.client.create("/api/v1/nodes", {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": NODE, "labels": {"kubernetes.io/hostname": NODE,
                                                  "nvidia.com/gpu.product": PRODUCT}},
            "status": {"allocatable": allocatable, "capacity": dict(allocatable),
                       "conditions": [{"type": "Ready", "status": "True"}]}})
        yield running
        api_calls |= usage.api_calls(running.requests)


@pytest.fixture(scope="module")
def typed_operator(typed_cluster: emulator.Emulator, zoo: scenario.Zoo,
                   tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[operator_process.OperatorProcess]:
    with scenario.operated(
            typed_cluster, tmp_path_factory.mktemp("typed"), env=zoo.operator_env,
            args=["--zoo-uri", zoo.uri, "--zoo-endpoint", zoo.endpoint, "--zoo-secret",
                  ZOO_SECRET, *OPERATOR_ARGS]) as (_, running):
        yield running


def test_a_builtin_model_is_profiled_once_per_gpu_type(
    typed_cluster: emulator.Emulator, typed_operator: operator_process.OperatorProcess,
    zoo: scenario.Zoo,
) -> None:
    namespace = f"e2e-{uuid.uuid4().hex[:8]}"
    typed_cluster.client.create_secret(namespace, ZOO_SECRET,
                                       {"accessKey": zoo.access_key,
                                        "secretKey": zoo.secret_key})
    typed_cluster.client.create_job(namespace, scenario.tiny_job("first", width=6))
    first = scenario.wait_phase(typed_cluster, namespace, "first", "Succeeded",
                                details=typed_operator.log_tail)
    api.TrainingJobStatus.model_validate(first["status"])
    profiled = scenario.condition(first, "Profiled")
    assert profiled is not None and (profiled["status"], profiled["reason"]) == (
        "True", "ModelProfiled")
    assert "first-profile" in profiled["message"]
    assert first["status"]["profile"]["parameters"] > 0
    assert first["status"]["profile"]["batchSize"] == 32
    assert scenario.pod_creations(typed_cluster, namespace, "first") == [
        "first-profile", "first-trainer-0"]
    profile_pod = next(r.body for r in typed_cluster.requests
                       if r.resource == "pods" and r.action == "CREATE"
                       and isinstance(r.body, dict)
                       and r.body["metadata"]["name"] == "first-profile")
    annotations = profile_pod["metadata"]["annotations"]
    assert annotations["kiln.dev/profile-device-type"] == f"cuda:{PRODUCT}"

    typed_cluster.client.create_job(namespace, scenario.tiny_job("second", width=6))
    second = scenario.wait_phase(typed_cluster, namespace, "second", "Succeeded",
                                 details=typed_operator.log_tail)
    reused = scenario.condition(second, "Profiled")
    assert reused is not None and (reused["status"], reused["reason"]) == (
        "True", "ModelProfiled")
    assert "Reused the profile" in reused["message"]
    assert second["status"]["profile"] == first["status"]["profile"]
    assert scenario.pod_creations(typed_cluster, namespace, "second") == ["second-trainer-0"]

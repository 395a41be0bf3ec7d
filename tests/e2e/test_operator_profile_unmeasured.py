"""Profiling on the cluster under the real operator: a built-in model with no measurement on the
cluster's GPU type is profiled once on a GPU of that type; a second job of the same model and
batch in the same namespace reuses that profile and starts without a profiling pod. A profile
measured in one namespace's image never decides another's, an out-of-memory one is measured
again, and a profiling pod's GPU counts against its namespace's quota.

A cluster of its own: one node with 2 GPUs labelled with a GPU product (no GPU runs here, the
pods fall back to the CPU). A job's own `kiln_trainer` on its PYTHONPATH stands in for an image
that reports what it likes, or holds its profiling pod until the test lets it go.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubesim import client, emulator, operator_process, scenario, usage

from kiln import api

pytestmark = pytest.mark.xdist_group(__name__)  # one worker builds its module fixtures

NODE = "typed-gpu-node"
PRODUCT = "NVIDIA-A100-SXM4-40GB"
ZOO_SECRET = "kiln-zoo"
QUOTA_NAMESPACE = f"e2e-quota-{uuid.uuid4().hex[:8]}"
OPERATOR_ARGS = [
    "--placement-interval-seconds", "1", "--housekeeping-interval-seconds", "0.5",
    "--no-placement-use-milp", "--zoo-refresh-seconds", "0",
    "--termination-grace-seconds", "30", "--zoo-retry-delay-seconds", "0.5",
    "--zoo-request-attempts", "1", "--no-resize",
    "--namespace-gpu-quota", f"{QUOTA_NAMESPACE}=1",
]
# `python -m kiln_trainer --profile` in an image of the user's: it waits for HOLD_FILE (when
# set), then reports a profile whose step ran out of memory (STEP_STATUS=oom) or took 10 ms.
OWN_PROFILER = '''\
import os
import pathlib
import time

from kiln import contract

hold = os.environ.get("HOLD_FILE")
while hold and not pathlib.Path(hold).exists():
    time.sleep(0.2)
oom = os.environ["STEP_STATUS"] == "oom"
profile = contract.Profile(
    parameters=1000, flops_per_sample=2e6, graph_nodes=3, untraceable=None,
    device="cuda:NVIDIA A100-SXM4-40GB", batch_size=32, step_seconds=None if oom else 0.01,
    step_status=os.environ["STEP_STATUS"], step_detail="CUDA out of memory" if oom else "")
log = os.environ.get(contract.Env.TERMINATION_LOG, contract.TERMINATION_LOG_PATH)
pathlib.Path(log).write_bytes(contract.termination_message(profile))
'''


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


def _namespace(cluster: emulator.Emulator, zoo: scenario.Zoo, name: str | None = None) -> str:
    namespace = name or f"e2e-{uuid.uuid4().hex[:8]}"
    cluster.client.create_secret(namespace, ZOO_SECRET, {"accessKey": zoo.access_key,
                                                         "secretKey": zoo.secret_key})
    return namespace


def _own_profiler_job(name: str, width: int, code: Path, **env: str) -> dict[str, Any]:
    """A suspended job of a built-in model (profiled, never trained) in an image whose
    `kiln_trainer` is `OWN_PROFILER`."""
    (code / "kiln_trainer").mkdir(exist_ok=True)
    (code / "kiln_trainer" / "__init__.py").write_text("", encoding="utf-8")
    (code / "kiln_trainer" / "__main__.py").write_text(OWN_PROFILER, encoding="utf-8")
    job = scenario.tiny_job(name, width=width, run_policy={"suspend": True})
    job["spec"]["template"] = {"env": [{"name": "PYTHONPATH", "value": str(code)},
                                       *({"name": k, "value": v} for k, v in env.items())]}
    return job


def _profiled(cluster: emulator.Emulator, namespace: str, name: str,
              operator: operator_process.OperatorProcess) -> dict[str, Any]:
    """Wait for the job's Profiled=True; return that condition."""
    done = scenario.wait_job(
        cluster, namespace, name,
        lambda job: (scenario.condition(job, "Profiled") or {}).get("status") == "True",
        what="Profiled=True", details=operator.log_tail)
    return scenario.condition(done, "Profiled") or {}


def test_an_out_of_memory_profile_from_one_namespaces_image_decides_for_no_other_job(
    typed_cluster: emulator.Emulator, typed_operator: operator_process.OperatorProcess,
    zoo: scenario.Zoo, tmp_path: Path,
) -> None:
    poisoner, other = _namespace(typed_cluster, zoo), _namespace(typed_cluster, zoo)
    typed_cluster.client.create_job(poisoner, _own_profiler_job(
        "oom-report", 11, tmp_path, STEP_STATUS="oom"))
    _profiled(typed_cluster, poisoner, "oom-report", typed_operator)
    assert typed_cluster.client.job(poisoner, "oom-report")["status"]["profile"][  # type: ignore[index]
        "stepStatus"] == "oom"  # its own profile says so

    # Another namespace's job of the same model and batch is measured in its own pod.
    typed_cluster.client.create_job(other, scenario.tiny_job(
        "same-model", width=11, run_policy={"suspend": True}))
    measured = _profiled(typed_cluster, other, "same-model", typed_operator)
    assert "same-model-profile" in measured["message"], measured
    assert scenario.pod_creations(typed_cluster, other, "same-model") == ["same-model-profile"]
    # A later job of the poisoner's namespace measures again: out of memory is not kept.
    typed_cluster.client.create_job(poisoner, scenario.tiny_job(
        "same-model-again", width=11, run_policy={"suspend": True}))
    again = _profiled(typed_cluster, poisoner, "same-model-again", typed_operator)
    assert "same-model-again-profile" in again["message"], again
    for namespace, name in ((poisoner, "oom-report"), (other, "same-model"),
                            (poisoner, "same-model-again")):
        typed_cluster.client.delete(typed_cluster.client.jobs_path(namespace, name))


def test_a_profiling_pods_gpu_counts_against_its_namespaces_quota(
    typed_cluster: emulator.Emulator, typed_operator: operator_process.OperatorProcess,
    zoo: scenario.Zoo, tmp_path: Path,
) -> None:
    namespace = _namespace(typed_cluster, zoo, QUOTA_NAMESPACE)  # its quota: 1 GPU
    release = tmp_path / "release"
    typed_cluster.client.create_job(namespace, _own_profiler_job(
        "holds-a-gpu", 12, tmp_path, STEP_STATUS="ok", HOLD_FILE=str(release)))
    try:
        client.wait_until(lambda: any(
            p["metadata"]["name"] == "holds-a-gpu-profile"
            and (p.get("status") or {}).get("phase") == "Running"
            for p in typed_cluster.client.pods(namespace)), timeout_seconds=scenario.JOB_SECONDS,
            what="the first profiling pod to run", details=typed_operator.log_tail)
        # A second job needing a profile on the same GPU type, while the node has a free GPU.
        typed_cluster.client.create_job(namespace, scenario.tiny_job(
            "wants-a-gpu", width=13, run_policy={"suspend": True}))
        scenario.wait_phase(typed_cluster, namespace, "wants-a-gpu", "Suspended",
                            details=typed_operator.log_tail)
        held = {r.body["metadata"]["name"]: int(
                    r.body["spec"]["containers"][0]["resources"].get("limits", {}).get(
                        "nvidia.com/gpu", 0))
                for r in typed_cluster.requests
                if r.resource == "pods" and r.action == "CREATE" and r.namespace == namespace
                and isinstance(r.body, dict)}
        assert held == {"holds-a-gpu-profile": 1}, held
        profiled = scenario.condition(typed_cluster.client.job(namespace, "wants-a-gpu"),
                                      "Profiled")
        assert profiled is None  # no profiling pod: it is placed on its estimate
    finally:
        release.write_text("")
    _profiled(typed_cluster, namespace, "holds-a-gpu", typed_operator)
    for name in ("holds-a-gpu", "wants-a-gpu"):
        typed_cluster.client.delete(typed_cluster.client.jobs_path(namespace, name))

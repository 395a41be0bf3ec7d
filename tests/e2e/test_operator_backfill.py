"""Backfilling under the real operator: a short job starts at once on the free GPUs while a
4-GPU job waits for its reserved start. One node with 4 GPUs of its own (the trainers run on
the CPU); a Kiln job holds 2, its trainer held by the test kubelet (`kubelet.Hold`) until the
test releases it, so no verdict depends on how fast anything trains.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubesim import client, emulator, kubelet, operator_process, scenario, usage

NODE = "gpu-node-1"
ZOO_SECRET = "kiln-zoo"
OPERATOR_ARGS = [
    "--placement-interval-seconds", "1", "--housekeeping-interval-seconds", "0.5",
    "--zoo-refresh-seconds", "0", "--termination-grace-seconds", "30",
    "--zoo-retry-delay-seconds", "0.5", "--zoo-request-attempts", "1", "--no-resize",
    "--no-profile-unmeasured",
]


@pytest.fixture(scope="module")
def backfill_cluster(api_calls: set[Any]) -> Iterator[emulator.Emulator]:
    with emulator.Emulator() as running:
        running.client.create_node(NODE, gpus=4, cpu="8")
        yield running
        api_calls |= usage.api_calls(running.requests)


@pytest.fixture(scope="module")
def backfill_operator(backfill_cluster: emulator.Emulator, zoo: scenario.Zoo,
                      tmp_path_factory: pytest.TempPathFactory
                      ) -> Iterator[tuple[kubelet.Kubelet, operator_process.OperatorProcess]]:
    with scenario.operated(
            backfill_cluster, tmp_path_factory.mktemp("backfill"), env=zoo.operator_env,
            args=["--zoo-uri", zoo.uri, "--zoo-endpoint", zoo.endpoint, "--zoo-secret",
                  ZOO_SECRET, *OPERATOR_ARGS]) as running:
        yield running


def _job(name: str, gpus: int | None, *, epochs: int = 1) -> dict[str, Any]:
    job: dict[str, Any] = scenario.tiny_job(name, epochs=epochs, max_samples=200)
    # Met at the first evaluation: each job trains one epoch, whatever its estimate counts.
    job["spec"]["target"] = {"metric": "validation_loss", "value": 1000.0}
    job["spec"]["warmStart"] = {"enabled": False}
    job["spec"]["zoo"] = {"register": False}
    if gpus is not None:
        job["spec"]["resources"] = {"gpus": gpus}
    return job


def test_a_short_job_starts_at_once_on_free_gpus_while_a_4_gpu_job_waits(
        backfill_cluster: emulator.Emulator, zoo: scenario.Zoo,
        backfill_operator: tuple[kubelet.Kubelet, operator_process.OperatorProcess]) -> None:
    node_kubelet, operator = backfill_operator
    cluster = backfill_cluster
    namespace = f"e2e-{uuid.uuid4().hex[:8]}"
    cluster.client.create_secret(namespace, ZOO_SECRET, {
        "accessKey": zoo.access_key, "secretKey": zoo.secret_key})
    hold = node_kubelet.hold(kubelet.Hold(namespace, "holder-trainer-0"))
    # Many epochs: its estimate, not the hold, keeps the 4-GPU job's reserved start later
    # than the short job's end (the planner counts epochs; the target ends it after one).
    cluster.client.create_job(namespace, _job("holder", 2, epochs=100))
    client.wait_until(hold.held.is_set, timeout_seconds=scenario.JOB_SECONDS,
                      what="the 2-GPU holder to be running (held)", details=operator.log_tail)

    cluster.client.create_job(namespace, _job("wide", 4))  # needs all 4: waits for the holder
    cluster.client.create_job(namespace, _job("short", None))  # the planner picks its GPUs
    short = scenario.wait_phase(cluster, namespace, "short", "Succeeded",
                                details=operator.log_tail)
    assert short["status"]["placement"]["node"] == NODE
    assert short["status"]["placement"]["gpus"] <= 2, short["status"]["placement"]
    # The short job ran to the end on the free GPUs while the holder kept 2: the 4-GPU job
    # never got a pod meanwhile, and it is still queued.
    assert scenario.pod_creations(cluster, namespace, "wide") == []
    assert scenario.phase(cluster.client.job(namespace, "wide")) == "Queued"

    hold.release()
    for name in ("holder", "wide"):
        done = scenario.wait_phase(cluster, namespace, name, "Succeeded",
                                   details=operator.log_tail)
        assert done["status"]["placement"]["node"] == NODE
    assert cluster.client.job(namespace, "wide")["status"]["placement"]["gpus"] == 4

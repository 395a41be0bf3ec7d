"""Moving running jobs under the real operator: a job grows into a GPU another workload freed,
by checkpoint-restart, resumes from its checkpoint and succeeds; when two more GPUs free up
right after, the minimum interval between moves holds it where it is. A job on both GPUs of
a node shrinks to one so that a short job that arrives starts at once.

Clusters of their own (one node; no GPU runs here, the trainers fall back to the CPU) and a
zoo bucket of its own, holding one record that makes the jobs' runtime estimates scale with
GPUs (its recorded throughput is slow) but that warm start never picks (another modality).
Operators of their own, for the resize settings. The test kubelet holds each trainer
(`kubelet.Hold`) while the operator decides, so no verdict depends on how fast it trains.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from kubesim import client, emulator, kubelet, operator_process, scenario, usage

from kiln import api
from kiln.warmstart import decision, graph
from kiln.zoo import records, store

NODE = "gpu-node-1"
# Far more than a trainer runs between two checks of the kubelet (a hold's), and an ETA that
# pays a 0.01 s restart on a machine many times faster than this one.
EPOCHS = 20
ZOO_SECRET = "kiln-zoo"
# The session operator's short intervals (conftest), and moves that pay after a 0.01 s restart.
OPERATOR_ARGS = [
    "--placement-interval-seconds", "1", "--housekeeping-interval-seconds", "0.5",
    "--no-placement-use-milp", "--zoo-refresh-seconds", "0",
    "--termination-grace-seconds", "30", "--zoo-retry-delay-seconds", "0.5",
    "--zoo-request-attempts", "1",
    "--resize-min-gain", "2", "--resize-min-interval-seconds", "3600",
    "--resize-restart-seconds", "0.01",
    "--resize-grow-price", "0",  # the GPUs it grows into are free: no one else is waiting
    "--no-profile-unmeasured",  # the zoo record alone shapes the estimate here
]
SHRINK_NODE = "gpu-node-2"
# Makespan puts a job alone on every free GPU (its fastest config). Shrinking pays after a
# 0.01 s restart, and the interval holds the shrunk job where it is once the short job ends.
SHRINK_ARGS = [*OPERATOR_ARGS, "--placement-objective", "makespan"]


@pytest.fixture(scope="module")
def gpu_zoo(s3_server: Any) -> scenario.Zoo:
    bucket = f"kiln-resize-{uuid.uuid4().hex[:12]}"
    zoo = store.S3Store(f"http://{s3_server.endpoint}", bucket,
                        access_key=s3_server.access_key, secret_key=s3_server.secret_key)
    return scenario.Zoo(uri=f"s3://{bucket}", endpoint=f"http://{s3_server.endpoint}",
                        access_key=s3_server.access_key, secret_key=s3_server.secret_key,
                        store=zoo)


@contextlib.contextmanager
def _cluster(node: str, gpus: int, api_calls: set[Any]) -> Iterator[emulator.Emulator]:
    with emulator.Emulator() as running:
        running.client.create_node(node, gpus=gpus)
        yield running
        api_calls |= usage.api_calls(running.requests)


@contextlib.contextmanager
def _operator(cluster: emulator.Emulator, zoo: scenario.Zoo, folder: pytest.TempPathFactory,
              name: str, args: list[str]
              ) -> Iterator[tuple[operator_process.OperatorProcess, kubelet.Kubelet]]:
    node_kubelet = kubelet.Kubelet(cluster.url, folder.mktemp(f"{name}-kubelet"))
    node_kubelet.start()
    running = operator_process.OperatorProcess(
        cluster, folder.mktemp(f"{name}-operator"), env=zoo.operator_env,
        args=["--zoo-uri", zoo.uri, "--zoo-endpoint", zoo.endpoint, "--zoo-secret", ZOO_SECRET,
              *args])
    running.start()
    yield running, node_kubelet
    running.stop()
    node_kubelet.stop()
    assert not node_kubelet.errors, node_kubelet.errors


@pytest.fixture(scope="module")
def gpu_cluster(api_calls: set[Any]) -> Iterator[emulator.Emulator]:
    with _cluster(NODE, 4, api_calls) as running:
        yield running


@pytest.fixture(scope="module")
def gpu_operator(gpu_cluster: emulator.Emulator, gpu_zoo: scenario.Zoo,
                 tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[tuple[operator_process.OperatorProcess, kubelet.Kubelet]]:
    with _operator(gpu_cluster, gpu_zoo, tmp_path_factory, "resize", OPERATOR_ARGS) as pair:
        yield pair


@pytest.fixture(scope="module")
def shrink_cluster(api_calls: set[Any]) -> Iterator[emulator.Emulator]:
    with _cluster(SHRINK_NODE, 2, api_calls) as running:
        yield running


@pytest.fixture(scope="module")
def shrink_operator(shrink_cluster: emulator.Emulator, gpu_zoo: scenario.Zoo,
                    tmp_path_factory: pytest.TempPathFactory
                    ) -> Iterator[tuple[operator_process.OperatorProcess, kubelet.Kubelet]]:
    with _operator(shrink_cluster, gpu_zoo, tmp_path_factory, "shrink", SHRINK_ARGS) as pair:
        yield pair


def _slow_record(zoo: store.ObjectStore, job: dict[str, Any]) -> None:
    """A zoo record of the job's model at 10 samples/s: a step is compute-bound, so 2 GPUs
    run it in about half the time (the estimate's shape; the trainer's ETA sets the level)."""
    model = job["spec"]["model"]
    record = records.ZooRecord(
        id=records.new_id("small_cnn"), architecture="small_cnn", args=model["args"],
        input_shape=tuple(model["inputShape"]), modality="text", task="classification",
        dataset="digits", metric_name="validation_accuracy", metric_value=0.5,
        samples_per_second=10.0, num_params=1000, created_time="2024-01-01T00:00:00Z",
        job_name="slow", job_spec={"spec": {"training": {"batchSize": 32}}})
    spec = api.ModelSpec(architecture="small_cnn", args=model["args"],
                         input_shape=model["inputShape"])
    records.write_record(zoo, record, {"w": torch.zeros(1)},
                         graph.to_json(decision.model_graph(spec)))


def _foreign_pod(cluster: emulator.Emulator, namespace: str, name: str, gpus: int) -> str:
    """A pod Kiln does not own holding `gpus` GPUs of the node."""
    cluster.client.create(cluster.client.pods_path(namespace), {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace},
        "spec": {"nodeName": NODE, "terminationGracePeriodSeconds": 1, "containers": [{
            "name": "sleep", "image": "busybox", "command": [
                "python", "-c", "import time; time.sleep(600)"],
            "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}],
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [{
                    "key": "kubernetes.io/hostname", "operator": "In",
                    "values": [NODE]}]}]}}}}})
    return name


def _placement_rounds(cluster: emulator.Emulator, since: float) -> int:
    """How many times the operator listed the nodes after `since` (`time.monotonic()`): each
    placement round starts so, and no job is admitted meanwhile here."""
    return sum(1 for r in cluster.requests if r.seconds > since and r.action == "LIST"
               and r.resource == "nodes" and r.user_agent.startswith(usage.OPERATOR_USER_AGENTS))


def test_a_running_job_grows_once_resumes_from_its_checkpoint_and_does_not_flap(
    gpu_cluster: emulator.Emulator, gpu_zoo: scenario.Zoo,
    gpu_operator: tuple[operator_process.OperatorProcess, kubelet.Kubelet],
) -> None:
    operator, node_kubelet = gpu_operator
    namespace = f"e2e-{uuid.uuid4().hex[:8]}"
    gpu_cluster.client.create_secret(namespace, ZOO_SECRET, {
        "accessKey": gpu_zoo.access_key, "secretKey": gpu_zoo.secret_key})
    name = "digits-grow"
    job = scenario.tiny_job(name, epochs=EPOCHS, max_samples=None)
    _slow_record(gpu_zoo.store, job)
    # Each trainer is held once it has a checkpoint and an ETA to show: the first while the
    # operator decides to move it, the second while it decides not to move it again.
    checkpointed = scenario.checkpointed(gpu_zoo, namespace, name)

    def shows_eta(pod: kubelet.RunningPod) -> bool:
        return bool(scenario.trainer_progress(pod).get("etaSeconds"))

    first = node_kubelet.hold(kubelet.Hold(
        namespace, f"{name}-trainer-0", when=lambda pod: checkpointed(pod) and shows_eta(pod)))
    second = node_kubelet.hold(kubelet.Hold(namespace, f"{name}-trainer-1", when=shows_eta))
    one = _foreign_pod(gpu_cluster, namespace, "one-gpu-user", 1)
    two = _foreign_pod(gpu_cluster, namespace, "two-gpu-user", 2)
    gpu_cluster.client.create_job(namespace, job)
    client.wait_until(first.held.is_set, timeout_seconds=scenario.JOB_SECONDS,
                      what="the first trainer to be held", details=operator.log_tail)
    running = scenario.wait_job(
        gpu_cluster, namespace, name,
        lambda doc: scenario.phase(doc) == "Running"
        and bool(doc["status"].get("progress", {}).get("etaSeconds")),
        what="running on 1 GPU with an ETA", details=operator.log_tail)
    assert running["status"]["placement"]["gpus"] == 1

    gpu_cluster.client.delete(gpu_cluster.client.pods_path(namespace, one))
    grown = scenario.wait_job(
        gpu_cluster, namespace, name, lambda doc: scenario.phase(doc) == "Running"
        and doc["status"]["attempts"] == 2, what="running again after the move",
        details=operator.log_tail)
    assert grown["status"]["placement"]["gpus"] == 2, operator.log_tail()
    client.wait_until(second.held.is_set, timeout_seconds=scenario.JOB_SECONDS,
                      what="the second trainer to be held", details=operator.log_tail)
    # Two more GPUs: growing to 4 would pay too, but the job moved less than an hour ago. The
    # operator reads the held trainer's ETA with them free, then plans a whole round.
    gpu_cluster.client.delete(gpu_cluster.client.pods_path(namespace, two))
    client.wait_until(lambda: gpu_cluster.client.get(
        gpu_cluster.client.pods_path(namespace, two)) is None, timeout_seconds=60,
        what="the two GPUs to be free")
    freed = time.monotonic()
    read = client.wait_until(lambda: next((t for t in second.reads if t > freed), None),
                             timeout_seconds=60, what="the operator to read the held ETA",
                             details=operator.log_tail)
    client.wait_until(lambda: _placement_rounds(gpu_cluster, read) >= 2, timeout_seconds=60,
                      what="a placement round after that read", details=operator.log_tail)
    second.release()
    done = scenario.wait_phase(gpu_cluster, namespace, name, "Succeeded",
                               details=operator.log_tail)
    placement = done["status"]["placement"]
    assert (placement["node"], placement["gpus"], placement["parallelism"]) == (
        NODE, 2, "ddp"), operator.log_tail()
    assert done["status"]["attempts"] == 2 and done["status"].get("restarts", 0) == 0
    moved = json.loads(done["metadata"]["annotations"]["kiln.dev/resized"])
    assert (moved["from"]["gpus"], moved["to"]["gpus"]) == (1, 2) and moved["gainSeconds"] > 0
    events = [e for e in gpu_cluster.client.list(f"/api/v1/namespaces/{namespace}/events")
              if e.get("reason") == "Resized"]
    assert len(events) == 1, events  # moved once
    assert "from 1 to 2 device(s)" in events[0]["message"]
    assert scenario.pod_creations(gpu_cluster, namespace, name) == [
        f"{name}-trainer-0", f"{name}-trainer-1"]
    result = scenario.termination_result(gpu_cluster, namespace, f"{name}-trainer-1")
    assert result["resumed_from_epoch"] >= 1 and result["epochs_run"] == EPOCHS


def test_a_running_job_shrinks_so_that_a_short_job_that_arrives_starts_at_once(
    shrink_cluster: emulator.Emulator, gpu_zoo: scenario.Zoo,
    shrink_operator: tuple[operator_process.OperatorProcess, kubelet.Kubelet],
) -> None:
    operator, node_kubelet = shrink_operator
    namespace = f"e2e-{uuid.uuid4().hex[:8]}"
    shrink_cluster.client.create_secret(namespace, ZOO_SECRET, {
        "accessKey": gpu_zoo.access_key, "secretKey": gpu_zoo.secret_key})
    long, short = "digits-long", "digits-short"
    job = scenario.tiny_job(long, epochs=EPOCHS, max_samples=None)
    _slow_record(gpu_zoo.store, job)
    checkpointed = scenario.checkpointed(gpu_zoo, namespace, long)

    def shows_eta(pod: kubelet.RunningPod) -> bool:
        return bool(scenario.trainer_progress(pod).get("etaSeconds"))

    # The long job's trainer is held with a checkpoint and an ETA while the short job arrives
    # and the operator decides; its second trainer is held from its start until the short job
    # is done, so the long job cannot end first, however fast this machine trains.
    first = node_kubelet.hold(kubelet.Hold(
        namespace, f"{long}-trainer-0", when=lambda pod: checkpointed(pod) and shows_eta(pod)))
    second = node_kubelet.hold(kubelet.Hold(namespace, f"{long}-trainer-1"))
    shrink_cluster.client.create_job(namespace, job)
    client.wait_until(first.held.is_set, timeout_seconds=scenario.JOB_SECONDS,
                      what="the long job's trainer to be held", details=operator.log_tail)
    running = scenario.wait_job(
        shrink_cluster, namespace, long,
        lambda doc: scenario.phase(doc) == "Running"
        and bool(doc["status"].get("progress", {}).get("etaSeconds")),
        what="the long job running on both GPUs with an ETA", details=operator.log_tail)
    assert running["status"]["placement"]["gpus"] == 2, operator.log_tail()

    # Both GPUs are taken: the short 1-GPU job waits for the long one to end unless it shrinks.
    short_job = scenario.tiny_job(short)
    short_job["spec"]["resources"] = {"gpus": 1}
    shrink_cluster.client.create_job(namespace, short_job)
    done = scenario.wait_phase(shrink_cluster, namespace, short, "Succeeded",
                               details=operator.log_tail)
    assert done["status"]["placement"]["gpus"] == 1
    shrunk = scenario.wait_job(shrink_cluster, namespace, long,
                               lambda doc: doc["status"].get("attempts") == 2,
                               what="the long job's second attempt", details=operator.log_tail)
    assert scenario.phase(shrunk) != "Succeeded"  # the short job ran while it was running
    assert (shrunk["status"]["placement"]["gpus"], shrunk["status"]["placement"]["node"]) == (
        1, SHRINK_NODE)
    moved = json.loads(shrunk["metadata"]["annotations"]["kiln.dev/resized"])
    # predicted to lower the total completion time: the gain is net of the long job's loss
    assert (moved["from"]["gpus"], moved["to"]["gpus"]) == (2, 1) and moved["gainSeconds"] > 0
    events = [e for e in shrink_cluster.client.list(f"/api/v1/namespaces/{namespace}/events")
              if e.get("reason") == "Resized"]
    assert len(events) == 1 and "Resized (shrink) from 2 to 1 device(s)" in events[0]["message"]

    second.release()
    finished = scenario.wait_phase(shrink_cluster, namespace, long, "Succeeded",
                                   details=operator.log_tail)
    assert finished["status"]["attempts"] == 2 and finished["status"].get("restarts", 0) == 0
    assert finished["status"]["placement"]["gpus"] == 1  # no grow back: the interval holds it
    result = scenario.termination_result(shrink_cluster, namespace, f"{long}-trainer-1")
    assert result["resumed_from_epoch"] >= 1 and result["epochs_run"] == EPOCHS

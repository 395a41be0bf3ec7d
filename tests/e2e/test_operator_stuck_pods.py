"""A trainer or profiling pod that never starts: its waiting reason reaches the job, then the
start timeout fails the job and deletes the pod.

Runs its own emulator, test kubelet and operator (with a short ``--pod-start-timeout-seconds``);
the test kubelet never pulls an image whose name contains ``unpullable``.
"""

from __future__ import annotations

import uuid
from pathlib import Path

from kubesim import client, emulator, kubelet, operator_process, scenario, usage

START_TIMEOUT_SECONDS = 6  # several of the kubelet's ErrImagePull/ImagePullBackOff cycles


def test_an_unpullable_image_is_reported_once_and_fails_the_job_after_the_start_timeout(
    zoo: scenario.Zoo, operator_args: list[str], zoo_secret: tuple[str, dict[str, str]],
    api_calls: set[usage.ApiCall], tmp_path: Path,
) -> None:
    namespace, name = f"e2e-{uuid.uuid4().hex[:8]}", "digits-no-image"
    image = f"registry.example/kiln-{kubelet.UNPULLABLE}:0.1"
    job = scenario.tiny_job(name)
    job["spec"]["template"]["image"] = image
    # A model from user code: its profiling pod, in the same image, is the first to be stuck.
    profiled = scenario.tiny_job("mixer-no-image", model={
        "entrypoint": "mynets.mixer:mixer", "args": {"dim": 8, "depth": 1},
        "task": "classification", "inputShape": [1, 8, 8]})
    profiled["spec"]["template"]["image"] = image
    with emulator.Emulator() as cluster:
        cluster.client.create_node("cpu-node-1")
        cluster.client.create_secret(namespace, *zoo_secret)
        node = kubelet.Kubelet(cluster.url, tmp_path / "kubelet")
        node.start()
        operator = operator_process.OperatorProcess(
            cluster, tmp_path / "operator", env=zoo.operator_env,
            args=[*operator_args, "--pod-start-timeout-seconds", str(START_TIMEOUT_SECONDS)])
        try:
            operator.start()
            cluster.client.create_job(namespace, job)
            cluster.client.create_job(namespace, profiled)
            pending = scenario.wait_job(
                cluster, namespace, name,
                lambda j: (scenario.condition(j, "Running") or {}).get("reason") == "PodPending",
                what="Running=False/PodPending", details=operator.log_tail)
            running = scenario.condition(pending, "Running") or {}
            assert running["status"] == "False"
            assert image in running["message"] and "ImagePull" in running["message"]
            event = scenario.wait_event(cluster, namespace, name, "PodPending")
            assert event["type"] == "Warning" and image in event["message"]

            failed = scenario.wait_phase(cluster, namespace, name, "Failed",
                                         details=operator.log_tail)
            reason = scenario.condition(failed, "Failed") or {}
            assert reason["reason"] == "PodStartTimeout"
            assert image in reason["message"] and "ImagePull" in reason["message"]
            assert f"{START_TIMEOUT_SECONDS} s" in reason["message"]
            client.wait_until(lambda: cluster.client.pods(namespace, name) == [],
                              timeout_seconds=30, what="the pending pod to be deleted")
            # The kubelet alternated ErrImagePull and ImagePullBackOff meanwhile: one problem.
            assert scenario.event_reasons(cluster, namespace, name).count("PodPending") == 1
            assert scenario.wait_event(cluster, namespace, name, "PodStartTimeout")["type"] \
                == "Warning"

            stuck = scenario.wait_phase(cluster, namespace, "mixer-no-image", "Failed",
                                        details=operator.log_tail)
            profiling = scenario.condition(stuck, "Profiled") or {}
            assert (profiling["status"], profiling["reason"]) == ("False", "PodStartTimeout")
            reason = scenario.condition(stuck, "Failed") or {}
            assert reason["reason"] == "PodStartTimeout"
            assert "Profiling pod mixer-no-image-profile" in reason["message"]
            assert image in reason["message"]
            warned = scenario.wait_event(cluster, namespace, "mixer-no-image", "PodPending")
            assert warned["type"] == "Warning" and image in warned["message"]
            assert scenario.pod_creations(cluster, namespace, "mixer-no-image") == [
                "mixer-no-image-profile"]  # no trainer pod was ever made
        finally:
            operator.stop()
            node.stop()
        api_calls |= usage.api_calls(cluster.requests)
    assert not node.errors, node.errors

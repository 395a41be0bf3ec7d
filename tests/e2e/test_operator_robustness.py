"""Robustness: an operator restarted mid-job, and a zoo outage."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubesim import client, emulator, kubelet, operator_process, scenario, usage


def test_an_operator_killed_mid_job_restarts_without_duplicate_pods(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess,
    node_kubelet: kubelet.Kubelet, namespace: str,
) -> None:
    name = "digits-survivor"
    # Both trainers are held from their start: each is running while the test acts.
    survivor = node_kubelet.hold(kubelet.Hold(namespace, f"{name}-trainer-0"))
    node_kubelet.hold(kubelet.Hold(namespace, "digits-waiting-trainer-0"))
    cluster.client.create_job(namespace, scenario.tiny_job(name))
    cluster.client.create_job(namespace, scenario.tiny_job(
        "digits-waiting", run_policy={"suspend": True}))
    running = scenario.wait_phase(cluster, namespace, name, "Running", details=operator.log_tail)
    scenario.wait_phase(cluster, namespace, "digits-waiting", "Suspended")

    operator.kill()
    operator.start()
    survivor.release()  # once the restarted operator watches, with the trainer still running
    done = scenario.wait_phase(cluster, namespace, name, "Succeeded", details=operator.log_tail)
    assert scenario.pod_creations(cluster, namespace, name) == [f"{name}-trainer-0"]
    assert done["status"]["attempts"] == 1
    assert (scenario.condition(done, "Created")["lastTransitionTime"]
            == scenario.condition(running, "Created")["lastTransitionTime"])
    # The restarted operator still acts on the other job: resuming it starts its trainer.
    cluster.client.patch(cluster.client.jobs_path(namespace, "digits-waiting"),
                         {"spec": {"runPolicy": {"suspend": False}}})
    scenario.wait_phase(cluster, namespace, "digits-waiting", "Running",
                        details=operator.log_tail)
    assert scenario.pod_creations(cluster, namespace, "digits-waiting") == [
        "digits-waiting-trainer-0"]
    cluster.client.delete(cluster.client.jobs_path(namespace, "digits-waiting"))
    client.wait_until(lambda: cluster.client.pods(namespace, "digits-waiting") == [],
                        timeout_seconds=30, what="the deleted job's pod to be deleted")


@pytest.fixture
def outage_cluster(api_calls: set[usage.ApiCall], tmp_path: Path
                   ) -> Iterator[tuple[emulator.Emulator, operator_process.OperatorProcess]]:
    """A second cluster whose operator's zoo endpoint answers nothing (a closed port)."""
    with emulator.Emulator() as cluster:
        cluster.client.create_node("cpu-node-1")
        dead = f"http://127.0.0.1:{client.free_port()}"
        operator = operator_process.OperatorProcess(
            cluster, tmp_path, env={"KILN_ZOO_ACCESS_KEY": "k", "KILN_ZOO_SECRET_KEY": "s"},
            args=["--zoo-uri", f"s3://kiln-{uuid.uuid4().hex[:8]}", "--zoo-endpoint", dead,
                  "--zoo-retry-limit", "3", "--zoo-retry-delay-seconds", "0.5",
                  "--zoo-request-attempts", "1", "--placement-interval-seconds", "1",
                  "--no-placement-use-milp"])
        operator.start()
        try:
            yield cluster, operator
        finally:
            operator.stop()
            api_calls |= usage.api_calls(cluster.requests)


def test_a_zoo_outage_is_reported_retried_and_then_cold_started(
    outage_cluster: tuple[emulator.Emulator, operator_process.OperatorProcess],
) -> None:
    cluster, operator = outage_cluster
    cluster.client.create_job("team-a", scenario.tiny_job("digits-no-zoo"))
    waiting = scenario.wait_job(
        cluster, "team-a", "digits-no-zoo",
        lambda job: (scenario.condition(job, "WarmStarted") or {}).get("reason")
        == "ZooUnavailable", what="WarmStarted=False/ZooUnavailable", details=operator.log_tail)
    assert "The model zoo is unreachable" in scenario.condition(waiting, "WarmStarted")["message"]

    queued = scenario.wait_phase(cluster, "team-a", "digits-no-zoo", "Queued",
                                 details=operator.log_tail)
    cold = scenario.condition(queued, "WarmStarted")
    assert (cold["status"], cold["reason"]) == ("False", "ColdStart")
    assert "unreachable after 3 attempts" in cold["message"]
    warnings = [e for e in scenario.events(cluster, "team-a", "digits-no-zoo")
                if e["reason"] == "ZooUnavailable"]
    assert len(warnings) == 2 and all(e["type"] == "Warning" for e in warnings)
    # Each attempt in turn (the condition said the same, but the test may read it late).
    messages = [e["message"] for e in warnings]
    assert "attempt 1 of 3" in messages[0] and "attempt 2 of 3" in messages[1], messages

    pod = client.wait_until(lambda: cluster.client.pods("team-a", "digits-no-zoo"),
                              timeout_seconds=30, what="the cold-started job's pod")[0]
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert json.loads(env["KILN_WARM_START"])["parent"] is None
    exposition = operator.metrics()
    assert 'kiln_warm_start_total{outcome="zoo_unavailable"} 1.0' in exposition
    assert "kiln_zoo_unavailable_total 2.0" in exposition


def test_a_model_too_large_to_admit_fails_at_once_and_does_not_hold_up_others(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess, namespace: str,
) -> None:
    # Every field is in range, but 13,000 layers would take minutes to build and trace.
    poison = scenario.tiny_job("digits-abyss", model={
        "architecture": "small_cnn", "args": {"depth": 13_000, "width": 8},
        "inputShape": [1, 8, 8]})
    cluster.client.create_job(namespace, poison)
    cluster.client.create_job(namespace, scenario.tiny_job("digits-ordinary"))

    failed = scenario.wait_phase(cluster, namespace, "digits-abyss", "Failed",
                                 details=operator.log_tail)
    reason = scenario.condition(failed, "Failed")
    assert reason is not None and reason["reason"] == "InvalidSpec"
    assert "spec.model.args.depth: the model would have 13,000 layers" in reason["message"]
    scenario.wait_phase(cluster, namespace, "digits-ordinary", "Succeeded",
                        details=operator.log_tail)
    assert "UnexpectedError" not in scenario.event_reasons(cluster, namespace, "digits-abyss")

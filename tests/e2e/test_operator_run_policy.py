"""runPolicy under the real operator: suspend and resume, the active deadline, the TTL."""

from __future__ import annotations

from typing import Any

from kubesim import client, emulator, kubelet, operator_process, scenario

from kiln.zoo import records


def test_suspend_stops_the_trainer_with_a_checkpoint_and_resume_continues_from_it(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess,
    node_kubelet: kubelet.Kubelet, zoo: scenario.Zoo, namespace: str,
) -> None:
    name = "digits-pause"
    # 30 epochs (~0.5 s each): the suspension lands long before the end.
    cluster.client.create_job(namespace, scenario.tiny_job(name, epochs=30, max_samples=None))
    checkpoint = f"checkpoints/{namespace}/{name}/checkpoint.pt"
    running = scenario.wait_job(
        cluster, namespace, name,
        lambda job: scenario.phase(job) == "Running" and zoo.store.exists(checkpoint)
        and bool(job["status"].get("progress", {}).get("step")),
        what="running with a checkpoint and progress read from its metrics",
        details=operator.log_tail)
    progress = running["status"]["progress"]
    assert 1 <= progress["epoch"] <= 30 and progress["samplesPerSecond"] > 0

    cluster.client.patch(cluster.client.jobs_path(namespace, name),
                         {"spec": {"runPolicy": {"suspend": True}}})
    suspended = scenario.wait_phase(cluster, namespace, name, "Suspended",
                                    details=operator.log_tail)
    assert scenario.condition(suspended, "Suspended")["reason"] == "SuspendedByUser"
    client.wait_until(lambda: not cluster.client.pods(namespace, name) or all(
        p["status"].get("phase") in ("Succeeded", "Failed")
        for p in cluster.client.pods(namespace, name)), timeout_seconds=30,
        what="the running trainer pod to be deleted")
    assert "startTime" not in suspended["status"]

    cluster.client.patch(cluster.client.jobs_path(namespace, name),
                         {"spec": {"runPolicy": {"suspend": False}}})
    done = scenario.wait_phase(cluster, namespace, name, "Succeeded", details=operator.log_tail)
    resumed = scenario.condition(done, "Suspended")
    assert (resumed["status"], resumed["reason"]) == ("False", "Resumed")
    assert done["status"]["attempts"] == 2
    assert done["status"].get("restarts", 0) == 0
    assert scenario.pod_creations(cluster, namespace, name) == [
        f"{name}-trainer-0", f"{name}-trainer-1"]
    result = scenario.termination_result(cluster, namespace, f"{name}-trainer-1")
    assert result["resumed_from_epoch"] >= 1
    assert result["epochs_run"] == 30


def test_a_job_created_suspended_waits_until_resumed(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess, namespace: str,
) -> None:
    cluster.client.create_job(namespace, scenario.tiny_job(
        "digits-later", run_policy={"suspend": True}))
    scenario.wait_phase(cluster, namespace, "digits-later", "Suspended",
                        details=operator.log_tail)
    assert scenario.pod_creations(cluster, namespace, "digits-later") == []
    cluster.client.delete(cluster.client.jobs_path(namespace, "digits-later"))
    client.wait_until(lambda: cluster.client.job(namespace, "digits-later") is None,
                        timeout_seconds=30, what="the job to be deleted")


def test_a_job_past_its_active_deadline_fails_and_its_trainer_is_stopped(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess, namespace: str,
) -> None:
    name = "digits-late"
    cluster.client.create_job(namespace, scenario.tiny_job(
        name, epochs=200, max_samples=None, run_policy={"activeDeadlineSeconds": 3}))
    failed = scenario.wait_phase(cluster, namespace, name, "Failed", details=operator.log_tail)
    reason = scenario.condition(failed, "Failed")
    assert reason["reason"] == "DeadlineExceeded"
    assert "activeDeadlineSeconds 3 s" in reason["message"]
    # cleanPodPolicy Running (the default): the running trainer pod is deleted.
    client.wait_until(lambda: cluster.client.pods(namespace, name) == [], timeout_seconds=30,
                        what="the trainer pod to be deleted")
    assert scenario.wait_event(cluster, namespace, name, "DeadlineExceeded")["type"] == "Warning"


def _stopped_pod(cluster: emulator.Emulator, namespace: str, name: str) -> dict[str, Any]:
    """Wait until the kubelet reports the pod Failed (its trainer stopped); the pod stays."""

    def stopped() -> dict[str, Any] | None:
        pod = cluster.client.get(client.Client.pods_path(namespace, name))
        return pod if pod is not None and pod["status"].get("phase") == "Failed" else None

    return client.wait_until(stopped, timeout_seconds=60, what=f"pod {name} to be stopped")


def test_a_deadline_stops_the_trainer_of_a_pod_that_clean_pod_policy_none_keeps(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess, zoo: scenario.Zoo,
    namespace: str,
) -> None:
    name = "digits-late-kept"
    cluster.client.create_job(namespace, scenario.tiny_job(
        name, epochs=200, max_samples=None,
        run_policy={"activeDeadlineSeconds": 3, "cleanPodPolicy": "None"}))
    failed = scenario.wait_phase(cluster, namespace, name, "Failed", details=operator.log_tail)
    assert scenario.condition(failed, "Failed")["reason"] == "DeadlineExceeded"
    # The pod object stays for its log; its trainer was stopped through the kubelet.
    pod = _stopped_pod(cluster, namespace, f"{name}-trainer-0")
    assert pod["status"]["reason"] == "DeadlineExceeded"
    assert pod["spec"]["activeDeadlineSeconds"] == 1
    (trainer,) = pod["status"]["containerStatuses"]
    assert trainer["state"]["terminated"]["exitCode"] == 143  # SIGTERM: checkpoint and exit
    assert "epochs_run" not in scenario.termination_result(cluster, namespace, f"{name}-trainer-0")
    assert name not in {r.job_name for r in records.list_records(zoo.store)}


def test_a_model_registered_after_its_job_failed_is_deleted_from_the_zoo(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess, zoo: scenario.Zoo,
    namespace: str, zoo_secret: tuple[str, dict[str, str]],
) -> None:
    # Two jobs of one name: in `namespace` it fails by its deadline (pod kept, trainer
    # stopped); in `other` it succeeds and registers a model. The second's result then reaches
    # the first's pod, as when a trainer registers just before the stop arrives.
    name, other = "digits-late-model", f"{namespace}-b"
    cluster.client.create_secret(other, *zoo_secret)
    cluster.client.create_job(namespace, scenario.tiny_job(
        name, epochs=200, max_samples=None,
        run_policy={"activeDeadlineSeconds": 3, "cleanPodPolicy": "None"}))
    cluster.client.create_job(other, scenario.tiny_job(name))
    scenario.wait_phase(cluster, namespace, name, "Failed", details=operator.log_tail)
    pod = _stopped_pod(cluster, namespace, f"{name}-trainer-0")
    done = scenario.wait_phase(cluster, other, name, "Succeeded", details=operator.log_tail)
    model = done["status"]["result"]["zooModel"]
    assert zoo.store.exists(f"{records.record_prefix(model)}{records.META_NAME}")
    finished = cluster.client.get(client.Client.pods_path(other, f"{name}-trainer-0")) or {}
    terminated = finished["status"]["containerStatuses"][0]["state"]["terminated"]

    (trainer,) = pod["status"]["containerStatuses"]
    cluster.client.patch(client.Client.pods_path(namespace, f"{name}-trainer-0") + "/status", {
        "status": {"containerStatuses": [{**trainer, "state": {"terminated": terminated}}]}})
    event = scenario.wait_event(cluster, namespace, name, "ModelDiscarded")
    assert model in event["message"] and event["type"] == "Normal"
    assert zoo.store.list_keys(records.record_prefix(model)) == []
    assert scenario.phase(cluster.client.job(namespace, name)) == "Failed"


def test_a_finished_job_is_deleted_after_its_ttl(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess, namespace: str,
) -> None:
    job = scenario.tiny_job("digits-ttl", run_policy={"ttlSecondsAfterFinished": 1},
                            model={"architecture": "small_cnn", "inputShape": [1, 4, 4]})
    cluster.client.create_job(namespace, job)
    client.wait_until(lambda: cluster.client.job(namespace, "digits-ttl") is None,
                        timeout_seconds=60, what="the failed job to be deleted after its TTL",
                        details=operator.log_tail)
    deleted = [r for r in cluster.requests
               if r.action == "DELETE" and r.resource == "trainingjobs"
               and r.name == "digits-ttl" and r.user_agent.startswith("kiln-operator")]
    assert len(deleted) == 1

"""runPolicy under the real operator: suspend and resume, the active deadline, the TTL."""

from __future__ import annotations

from kubesim import client, emulator, kubelet, operator_process, scenario


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

"""runPolicy under the real operator: suspend and resume, the active deadline, the TTL."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kubesim import client, emulator, kubelet, operator_process, scenario

from kiln.zoo import records


def test_suspend_stops_the_trainer_with_a_checkpoint_and_resume_continues_from_it(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess,
    node_kubelet: kubelet.Kubelet, zoo: scenario.Zoo, namespace: str,
) -> None:
    name = "digits-pause"
    # Held once it has a checkpoint and progress to show, until the suspension stops it; 30
    # epochs are far more than it trains between two of the kubelet's checks.
    checkpointed = scenario.checkpointed(zoo, namespace, name)
    node_kubelet.hold(kubelet.Hold(
        namespace, f"{name}-trainer-0",
        when=lambda pod: checkpointed(pod) and bool(scenario.trainer_progress(pod).get("step"))))
    created = cluster.client.create_job(namespace, scenario.tiny_job(name, epochs=30,
                                                                     max_samples=None))
    checkpoint = records.checkpoint_key(namespace, name, created["metadata"]["uid"])
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
        name, epochs=scenario.ENDLESS_EPOCHS, max_samples=None,
        run_policy={"activeDeadlineSeconds": 3}))
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
        name, epochs=scenario.ENDLESS_EPOCHS, max_samples=None,
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


# A trainer that keeps running while its pod terminates (SIGTERM ignored; it says so by
# creating argv[2]) until the test creates argv[1]; once that exists, a trainer reports a
# result at once.
HELD = '''\
import os, pathlib, signal, sys, time
from kiln import contract
release = sys.argv[1]
if os.path.exists(release):
    result = contract.Result(
        metric_name="validation_accuracy", metric=0.5, validation_accuracy=0.5,
        validation_loss=1.0, wall_seconds=1.0, time_to_target_seconds=None,
        target_reached=False, epochs_run=1, steps=1, samples_per_second=1.0, zoo_model=None,
        resumed_from_epoch=0, warm_start="none")
    pathlib.Path(os.environ[contract.Env.TERMINATION_LOG]).write_bytes(
        contract.termination_message(result))
    sys.exit(0)
signal.signal(signal.SIGTERM, lambda *_: None)
pathlib.Path(sys.argv[2]).touch()
while not os.path.exists(release):
    time.sleep(0.05)
sys.exit(143)
'''


def test_a_resumed_job_starts_its_new_trainer_only_once_the_old_one_has_stopped(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess,
    node_kubelet: kubelet.Kubelet, namespace: str, tmp_path: Path,
) -> None:
    name, release, holding = "held-resume", tmp_path / "release", tmp_path / "holding"
    job = scenario.tiny_job(name)
    job["spec"]["template"]["command"] = ["python", "-c", HELD, str(release), str(holding)]
    cluster.client.create_job(namespace, job)
    client.wait_until(holding.exists, timeout_seconds=scenario.JOB_SECONDS,
                      what="the first trainer to hold", details=operator.log_tail)
    old = client.Client.pods_path(namespace, f"{name}-trainer-0")

    cluster.client.patch(cluster.client.jobs_path(namespace, name),
                         {"spec": {"runPolicy": {"suspend": True}}})
    scenario.wait_phase(cluster, namespace, name, "Suspended", details=operator.log_tail)
    client.wait_until(lambda: (cluster.client.get(old) or {}).get("metadata", {}).get(
        "deletionTimestamp"), timeout_seconds=30, what="the old trainer pod to terminate")
    cluster.client.patch(cluster.client.jobs_path(namespace, name),
                         {"spec": {"runPolicy": {"suspend": False}}})

    def new_trainer_or_wait() -> bool:
        new = cluster.client.get(client.Client.pods_path(namespace, f"{name}-trainer-1"))
        if new is not None:
            return (new.get("status") or {}).get("phase") == "Running"
        placed = scenario.condition(cluster.client.job(namespace, name), "Placed") or {}
        return "once the pods before it have stopped" in str(placed.get("message"))

    # The old trainer still runs (its pod Terminating) until released here.
    client.wait_until(new_trainer_or_wait, timeout_seconds=60, details=operator.log_tail,
                      what="a new trainer, or the job waiting for the old one")
    release.touch()
    done = scenario.wait_phase(cluster, namespace, name, "Succeeded", details=operator.log_tail)
    assert [o for o in node_kubelet.overlaps if o.startswith(f"{namespace}/")] == []
    assert scenario.pod_creations(cluster, namespace, name) == [
        f"{name}-trainer-0", f"{name}-trainer-1"]
    assert done["status"]["attempts"] == 2 and done["status"].get("restarts", 0) == 0
    removed = [r.seconds for r in cluster.requests if r.action == "DELETE"
               and r.name == f"{name}-trainer-0" and r.user_agent == kubelet.KUBELET_USER_AGENT]
    created = [r.seconds for r in cluster.requests if r.action == "CREATE"
               and r.resource == "pods" and r.namespace == namespace
               and (r.body or {}).get("metadata", {}).get("name") == f"{name}-trainer-1"]
    assert removed and created and removed[-1] < created[0]


def test_a_disrupted_pod_resumes_from_its_checkpoint_without_spending_the_backoff_limit(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess,
    node_kubelet: kubelet.Kubelet, zoo: scenario.Zoo, namespace: str,
) -> None:
    name = "digits-evicted"
    # Held once it has a checkpoint, until the eviction stops it; backoffLimit 0: a trainer
    # exit that counted would fail the job.
    node_kubelet.hold(kubelet.Hold(namespace, f"{name}-trainer-0",
                                   when=scenario.checkpointed(zoo, namespace, name)))
    created = cluster.client.create_job(namespace, scenario.tiny_job(
        name, epochs=30, max_samples=None, run_policy={"backoffLimit": 0}))
    checkpoint = records.checkpoint_key(namespace, name, created["metadata"]["uid"])
    scenario.wait_job(
        cluster, namespace, name,
        lambda job: scenario.phase(job) == "Running" and zoo.store.exists(checkpoint),
        what="running with a checkpoint", details=operator.log_tail)

    # What the Eviction API (and a node drain) does: DisruptionTarget on the pod, then a
    # graceful deletion; the trainer checkpoints on SIGTERM and exits 143.
    pod = client.Client.pods_path(namespace, f"{name}-trainer-0")
    conditions = [*((cluster.client.get(pod) or {}).get("status") or {}).get("conditions", []),
                  {"type": "DisruptionTarget", "status": "True",
                   "reason": "EvictionByEvictionAPI", "message": "Eviction API: evicting"}]
    cluster.client.patch(pod + "/status", {"status": {"conditions": conditions}})
    cluster.client.delete(pod)

    disrupted = scenario.wait_event(cluster, namespace, name, "PodDisrupted")
    assert disrupted["type"] == "Warning"
    assert "EvictionByEvictionAPI" in disrupted["message"]
    done = scenario.wait_phase(cluster, namespace, name, "Succeeded", details=operator.log_tail)
    assert done["status"].get("restarts", 0) == 0  # what backoffLimit counts
    assert done["status"]["attempts"] == 2
    assert "BackoffLimitExceeded" not in scenario.event_reasons(cluster, namespace, name)
    assert scenario.pod_creations(cluster, namespace, name) == [
        f"{name}-trainer-0", f"{name}-trainer-1"]
    assert scenario.termination_result(cluster, namespace, f"{name}-trainer-1")[
        "resumed_from_epoch"] >= 1

"""A TrainingJob's life under the real operator: success and warm start, invalid specs, exits.

The operator runs as ``python -m kiln.controller`` against kmock's emulator; the test kubelet
runs the trainer pods as local processes (kubesim). Jobs are tiny (a small CNN on 8x8 digits).
"""

from __future__ import annotations

import json
import re
import signal

from kubesim import client, emulator, kubelet, operator_process, scenario

from kiln import api
from kiln.zoo import records


def test_a_job_succeeds_registers_its_model_and_a_second_job_warm_starts_from_it(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess, zoo: scenario.Zoo,
    namespace: str,
) -> None:
    # Long enough to beat a fresh model clearly, or the warm-start guard refuses it as a parent.
    cluster.client.create_job(namespace, scenario.tiny_job("digits-first", epochs=6))
    first = scenario.wait_phase(cluster, namespace, "digits-first", "Succeeded",
                                details=operator.log_tail)
    # Every status field the operator writes is declared (a structural schema prunes the rest).
    api.TrainingJobStatus.model_validate(first["status"])
    model = first["status"]["result"]["zooModel"]
    assert records.read_record(zoo.store, model).job_name == "digits-first"
    assert scenario.condition(first, "WarmStarted")["reason"] == "ColdStart"
    assert first["status"]["placement"] == first["status"]["placement"] | {
        "node": "cpu-node-1", "gpus": 0, "parallelism": "single"}

    cluster.client.create_job(namespace, scenario.tiny_job("digits-second", width=12))
    second = scenario.wait_phase(cluster, namespace, "digits-second", "Succeeded",
                                 details=operator.log_tail)
    api.TrainingJobStatus.model_validate(second["status"])
    warm = second["status"]["warmStart"]
    assert warm["parent"] == model
    assert 0.0 < warm["similarity"] <= 1.0
    started = scenario.condition(second, "WarmStarted")
    assert (started["status"], started["reason"]) == ("True", "ParentSelected")
    assert second["status"]["result"]["zooModel"] != model
    scenario.wait_event(cluster, namespace, "digits-second", "TrainingCompleted")
    assert {"ParentSelected", "Planned", "TrainerStarted", "TrainingCompleted"} <= set(
        scenario.event_reasons(cluster, namespace, "digits-second"))

    pod = cluster.client.pods(namespace, "digits-second")[0]
    assert pod["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "e2e"
    assert pod["metadata"]["ownerReferences"][0]["name"] == "digits-second"
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    decided = json.loads(env["KILN_WARM_START"]["value"])
    assert (decided["parent"], decided["outcome"]) == (model, "warm")
    assert decided["similarity"] == warm["similarity"]
    # presigned zoo access, the default: URLs from the job's Secret, no zoo credential
    assert env["KILN_ZOO"]["value"].startswith("presigned:")
    assert not {"KILN_ZOO_ACCESS_KEY", "KILN_ZOO_SECRET_KEY"} & set(env)

    exposition = operator.metrics()
    assert re.search(rf'kiln_jobs{{job_namespace="{namespace}",phase="Succeeded"}} 2\.0',
                     exposition)
    assert re.search(r'kiln_warm_start_total{outcome="warm"} [1-9]', exposition)
    assert re.search(r'kiln_build_info{python="[^"]+",version="[^"]+"} 1\.0', exposition)
    assert re.search(r"kiln_placement_solve_seconds_count{solver=\"\w+\"} [1-9]", exposition)
    assert re.search(r"kiln_queue_wait_seconds_count [1-9]", exposition)
    assert re.search(r"kiln_zoo_query_seconds_count [1-9]", exposition)
    assert operator.healthz_status() == 200


def test_an_invalid_spec_fails_with_every_problem_named_and_a_warning_event(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess, namespace: str,
) -> None:
    job = scenario.tiny_job("digits-invalid", model={
        "architecture": "small_cnn", "inputShape": [1, 4, 4]})
    cluster.client.create_job(namespace, job)
    failed = scenario.wait_phase(cluster, namespace, "digits-invalid", "Failed",
                                 details=operator.log_tail)
    reason = scenario.condition(failed, "Failed")
    assert reason["reason"] == "InvalidSpec"
    assert "spec.model.inputShape" in reason["message"]
    event = scenario.wait_event(cluster, namespace, "digits-invalid", "InvalidSpec")
    assert event["type"] == "Warning"
    assert "spec.model.inputShape" in event["message"]
    assert scenario.pod_creations(cluster, namespace, "digits-invalid") == []


def test_an_unknown_architecture_is_named_with_the_closest_one(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess, namespace: str,
) -> None:
    job = scenario.tiny_job("digits-typo", model={"architecture": "small_cnnn",
                                                  "inputShape": [1, 8, 8]})
    cluster.client.create_job(namespace, job)
    failed = scenario.wait_phase(cluster, namespace, "digits-typo", "Failed",
                                 details=operator.log_tail)
    message = scenario.condition(failed, "Failed")["message"]
    assert "spec.model.architecture" in message and "small_cnn" in message


def test_a_trainer_killed_with_a_retryable_code_resumes_from_its_checkpoint(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess,
    node_kubelet: kubelet.Kubelet, zoo: scenario.Zoo, namespace: str,
) -> None:
    # Killed at the kubelet's first check (every poll) after its first checkpoint: of its 20
    # epochs, far more are left than any trainer runs between two checks.
    fault = node_kubelet.inject(kubelet.Fault(  # looked up when the pod starts
        job="digits-killed", signal=signal.SIGKILL, attempts=frozenset({0}),
        when=scenario.checkpointed(zoo, namespace, "digits-killed"), check_every_seconds=0.0))
    cluster.client.create_job(namespace, scenario.tiny_job(
        "digits-killed", epochs=20, max_samples=None))
    done = scenario.wait_phase(cluster, namespace, "digits-killed", "Succeeded",
                               details=operator.log_tail)
    assert fault.hits == ["digits-killed-trainer-0"]
    assert (done["status"]["restarts"], done["status"]["attempts"]) == (1, 2)
    restarting = scenario.condition(done, "Restarting")
    assert (restarting["status"], restarting["reason"]) == ("False", "TrainerStarted")
    exited = scenario.wait_event(cluster, namespace, "digits-killed", "TrainerExited")
    assert "exit code 137" in exited["message"] and exited["type"] == "Warning"
    resumed = scenario.termination_result(cluster, namespace, "digits-killed-trainer-1")
    assert resumed["resumed_from_epoch"] >= 1
    assert resumed["epochs_run"] == 20


def test_a_permanent_exit_code_fails_the_job_at_once(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess, namespace: str,
) -> None:
    job = scenario.tiny_job("images-missing", dataset={
        "name": "imagefolder", "path": "/nonexistent/kiln-e2e-images"},
        model={"architecture": "small_cnn", "args": {"depth": 2, "width": 8},
               "inputShape": [3, 8, 8]})
    job["spec"]["runPolicy"] = {"backoffLimit": 3}
    cluster.client.create_job(namespace, job)
    failed = scenario.wait_phase(cluster, namespace, "images-missing", "Failed",
                                 details=operator.log_tail)
    reason = scenario.condition(failed, "Failed")
    assert reason["reason"] == "PermanentError"
    assert "exit code 2" in reason["message"]
    assert "/nonexistent/kiln-e2e-images" in reason["message"]
    assert failed["status"].get("restarts", 0) == 0
    assert scenario.pod_creations(cluster, namespace, "images-missing") == [
        "images-missing-trainer-0"]


def test_retryable_exits_beyond_the_backoff_limit_fail_the_job(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess,
    node_kubelet: kubelet.Kubelet, namespace: str,
) -> None:
    fault = node_kubelet.inject(kubelet.Fault(job="digits-flaky", signal=signal.SIGKILL,
                                              container_reason="OOMKilled",
                                              check_every_seconds=0.0))
    cluster.client.create_job(namespace, scenario.tiny_job(
        "digits-flaky", run_policy={"backoffLimit": 1}))
    failed = scenario.wait_phase(cluster, namespace, "digits-flaky", "Failed",
                                 details=operator.log_tail)
    reason = scenario.condition(failed, "Failed")
    assert reason["reason"] == "BackoffLimitExceeded"
    assert "OOMKilled" in reason["message"]
    assert failed["status"]["restarts"] == 1
    assert fault.hits == ["digits-flaky-trainer-0", "digits-flaky-trainer-1"]
    assert scenario.pod_creations(cluster, namespace, "digits-flaky") == [
        "digits-flaky-trainer-0", "digits-flaky-trainer-1"]


def test_a_job_created_again_under_a_deleted_jobs_name_trains_afresh(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess, zoo: scenario.Zoo,
    namespace: str,
) -> None:
    name = "digits-again"
    folder = f"{records.CHECKPOINTS_PREFIX}{namespace}/{name}/"
    # Still training, long after its first checkpoint, when it is deleted: it never ends.
    first = cluster.client.create_job(namespace, scenario.tiny_job(
        name, epochs=scenario.ENDLESS_EPOCHS, max_samples=None))
    scenario.wait_job(cluster, namespace, name,
                      lambda job: scenario.phase(job) == "Running"
                      and bool(zoo.store.list_keys(folder)),
                      what="running with a checkpoint", details=operator.log_tail)
    cluster.client.delete(cluster.client.jobs_path(namespace, name))
    client.wait_until(lambda: cluster.client.job(namespace, name) is None
                      and not cluster.client.pods(namespace, name), timeout_seconds=60,
                      what="the job and its pods to be gone", details=operator.log_tail)

    # The same name again, with other data: a new object is a new job.
    cluster.client.create_job(namespace, scenario.tiny_job(name, epochs=2))
    done = scenario.wait_phase(cluster, namespace, name, "Succeeded", details=operator.log_tail)
    result = scenario.termination_result(cluster, namespace, f"{name}-trainer-0")
    assert result["resumed_from_epoch"] == 0 and result["epochs_run"] == 2
    assert done["status"]["attempts"] == 1
    # Nothing of the deleted job is left to resume: its checkpoint went with its last pod.
    old = records.checkpoint_key(namespace, name, first["metadata"]["uid"])
    client.wait_until(lambda: not zoo.store.exists(old), timeout_seconds=30,
                      what="the deleted job's checkpoint to be deleted",
                      details=operator.log_tail)
    assert zoo.store.list_keys(folder) == []


def test_a_pod_refused_by_a_resource_quota_is_reported_and_created_once_the_quota_allows(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess, namespace: str,
) -> None:
    name = "digits-quota"
    refusal = cluster.refuse_pods(emulator.QuotaRefusal(
        namespace, quota="gpu-quota", resource="requests.nvidia.com/gpu"))
    try:
        cluster.client.create_job(namespace, scenario.tiny_job(name))
        refused = scenario.wait_job(
            cluster, namespace, name,
            lambda job: (scenario.condition(job, "Running") or {}).get("reason")
            == "FailedCreate", what="Running=False/FailedCreate", details=operator.log_tail)
        running = scenario.condition(refused, "Running") or {}
        assert running["status"] == "False"
        assert "exceeded quota: gpu-quota" in running["message"]
        assert f"{name}-trainer-0" in running["message"]
        event = scenario.wait_event(cluster, namespace, name, "FailedCreate")
        assert event["type"] == "Warning" and "gpu-quota" in event["message"]
        client.wait_until(lambda: len(refusal.refused) >= 2, timeout_seconds=60,
                          what="the refused pod to be tried again", details=operator.log_tail)
    finally:
        cluster.allow_pods(refusal)
    done = scenario.wait_phase(cluster, namespace, name, "Succeeded", details=operator.log_tail)
    assert done["status"]["attempts"] == 1 and done["status"].get("restarts", 0) == 0
    assert set(scenario.pod_creations(cluster, namespace, name)) == {f"{name}-trainer-0"}
    assert (scenario.condition(done, "Running") or {})["reason"] == "TrainingCompleted"

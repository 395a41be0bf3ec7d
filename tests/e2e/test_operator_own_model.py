"""A model from user code under the real operator: admission never imports it; a profiling pod
in the job's image measures it and decides its warm start before placement, and the operator
records both (status.profile, status.warmStart) and places the job with the measurement.

The test kubelet runs the pods as local processes; the job's own env puts the example package on
PYTHONPATH, as an image that installs it would.
"""

from __future__ import annotations

import json
from pathlib import Path

from kubesim import client, emulator, kubelet, operator_process, scenario

from kiln import api
from kiln.zoo import records

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own-model"


def _mixer_job(name: str, *, dim: int, depth: int, epochs: int = 2,
               max_samples: int | None = 400) -> dict[str, object]:
    doc = scenario.tiny_job(name, epochs=epochs, max_samples=max_samples, model={
        "entrypoint": "mynets.mixer:mixer", "args": {"dim": dim, "depth": depth},
        "task": "classification", "inputShape": [1, 8, 8]})
    doc["spec"]["template"] = {"env": [{"name": "OMP_NUM_THREADS", "value": "1"},  # type: ignore[index]
                                       {"name": "PYTHONPATH", "value": str(EXAMPLE)}]}
    return doc


def test_an_entrypoint_job_is_profiled_and_warm_started_before_placement(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess,
    node_kubelet: kubelet.Kubelet, zoo: scenario.Zoo, namespace: str,
) -> None:
    # Long enough to beat a fresh model clearly, or the warm-start guard refuses it as a parent.
    cluster.client.create_job(namespace, _mixer_job("mixer-first", dim=16, depth=1, epochs=5))
    first = scenario.wait_phase(cluster, namespace, "mixer-first", "Succeeded",
                                details=operator.log_tail)
    api.TrainingJobStatus.model_validate(first["status"])
    profiled = scenario.condition(first, "Profiled")
    assert profiled is not None and (profiled["status"], profiled["reason"]) == (
        "True", "ModelProfiled")
    assert "mixer-first-profile" in profiled["message"]
    profile = first["status"]["profile"]
    assert profile["parameters"] > 0 and profile["flopsPerSample"] > 0
    assert profile["graphNodes"] > 0 and profile["stepStatus"] == "ok"
    assert profile["stepSeconds"] > 0 and profile["batchSize"] == 32
    assert profile["device"] == "cpu"
    stored = json.loads(zoo.store.get_bytes(profile["zooKey"]))
    assert stored["graph"]["nodes"]
    cold = scenario.condition(first, "WarmStarted")
    assert cold is not None and (cold["status"], cold["reason"]) == ("False", "ColdStart")
    assert scenario.pod_creations(cluster, namespace, "mixer-first") == [
        "mixer-first-profile", "mixer-first-trainer-0"]
    model = first["status"]["result"]["zooModel"]
    record = records.read_record(zoo.store, model)
    assert (record.entrypoint, record.architecture) == ("mynets.mixer:mixer", None)

    # Held once its metrics show a step, until the operator has read them; of its 10 epochs of
    # all 1,797 digits, far more are left then than a trainer runs between two checks.
    trainer = node_kubelet.hold(kubelet.Hold(
        namespace, "mixer-bigger-trainer-0",
        when=lambda pod: bool(scenario.trainer_progress(pod).get("step"))))
    cluster.client.create_job(namespace, _mixer_job("mixer-bigger", dim=24, depth=2, epochs=10,
                                                    max_samples=None))
    queued = scenario.wait_job(
        cluster, namespace, "mixer-bigger",
        lambda job: scenario.condition(job, "WarmStarted") is not None,
        what="the warm-start decision recorded before placement", details=operator.log_tail)
    assert queued["status"]["warmStart"]["parent"] == model
    client.wait_until(trainer.held.is_set, timeout_seconds=scenario.JOB_SECONDS,
                      what="the trainer to be held", details=operator.log_tail)
    running = scenario.wait_job(
        cluster, namespace, "mixer-bigger",
        lambda job: scenario.phase(job) == "Running"
        and bool(((job.get("status") or {}).get("progress") or {}).get("step")),
        what="progress read from the trainer's metrics", details=operator.log_tail)
    assert running["status"]["progress"]["samplesPerSecond"] > 0
    trainer.release()
    second = scenario.wait_phase(cluster, namespace, "mixer-bigger", "Succeeded",
                                 details=operator.log_tail)
    api.TrainingJobStatus.model_validate(second["status"])
    warm = second["status"]["warmStart"]
    assert warm["parent"] == model and warm["outcome"] == "warm"
    assert 0.3 <= warm["similarity"] <= 1.0
    assert 0 < warm["matchedTensors"] <= warm["totalTensors"]
    started = scenario.condition(second, "WarmStarted")
    assert started is not None
    assert (started["status"], started["reason"]) == ("True", "ParentSelected")
    assert records.read_record(zoo.store, second["status"]["result"]["zooModel"]).parent == model

    trainer = next(p for p in cluster.client.pods(namespace, "mixer-bigger")
               if p["metadata"]["name"] == "mixer-bigger-trainer-0")
    env = {e["name"]: e for e in trainer["spec"]["containers"][0]["env"]}
    passed = json.loads(env["KILN_WARM_START"]["value"])  # decided once, in the profiling pod
    assert (passed["outcome"], passed["parent"]) == ("warm", model)


def test_an_entrypoint_that_raises_fails_the_job_at_once_naming_the_users_line(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess, zoo: scenario.Zoo,
    namespace: str, tmp_path: Path,
) -> None:
    (tmp_path / "brokennet.py").write_text(
        "def build(**args):\n    raise ValueError(f'depth must be even (got {args})')\n",
        encoding="utf-8")
    job = _mixer_job("mixer-broken", dim=8, depth=1)
    job["spec"]["model"]["entrypoint"] = "brokennet:build"  # type: ignore[index]
    job["spec"]["template"]["env"][1]["value"] = str(tmp_path)  # type: ignore[index]
    job["spec"]["runPolicy"] = {"backoffLimit": 3}  # type: ignore[index]
    before = {r.id for r in records.list_records(zoo.store)}
    cluster.client.create_job(namespace, job)
    failed = scenario.wait_phase(cluster, namespace, "mixer-broken", "Failed",
                                 details=operator.log_tail)
    reason = scenario.condition(failed, "Failed")
    assert reason is not None and reason["reason"] == "InvalidSpec"
    assert "profiling pod mixer-broken-profile" in reason["message"]
    assert "spec.model.entrypoint: brokennet:build" in reason["message"]
    assert "brokennet.py, line 2, in build" in reason["message"]
    assert failed["status"].get("restarts", 0) == 0
    assert scenario.pod_creations(cluster, namespace, "mixer-broken") == [
        "mixer-broken-profile"]
    event = scenario.wait_event(cluster, namespace, "mixer-broken", "InvalidSpec")
    assert "brokennet.py, line 2" in event["message"]
    assert before <= {r.id for r in records.list_records(zoo.store)}  # nothing lost


def test_suspending_a_job_while_it_profiles_keeps_the_measurement_and_resumes_placed(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess,
    node_kubelet: kubelet.Kubelet, namespace: str,
) -> None:
    # The profiling pod is held from its start until the suspension is recorded.
    profiling = node_kubelet.hold(kubelet.Hold(namespace, "mixer-pause-profile"))
    cluster.client.create_job(namespace, _mixer_job("mixer-pause", dim=8, depth=1))
    scenario.wait_job(
        cluster, namespace, "mixer-pause",
        lambda job: (scenario.condition(job, "Profiled") or {}).get("status") == "Unknown",
        what="Profiled=Unknown while its pod runs", details=operator.log_tail)
    cluster.client.patch(cluster.client.jobs_path(namespace, "mixer-pause"),
                         {"spec": {"runPolicy": {"suspend": True}}})
    scenario.wait_job(
        cluster, namespace, "mixer-pause",
        lambda job: (scenario.condition(job, "Suspended") or {}).get("status") == "True",
        what="the suspension recorded", details=operator.log_tail)
    profiling.release()
    paused = scenario.wait_job(
        cluster, namespace, "mixer-pause",
        lambda job: (scenario.condition(job, "Profiled") or {}).get("status") == "True",
        what="the profile recorded while suspended", details=operator.log_tail)
    assert scenario.condition(paused, "Suspended")["status"] == "True"  # type: ignore[index]
    assert paused["status"]["profile"]["stepStatus"] == "ok"
    assert scenario.condition(paused, "Queued") is None  # not placed while suspended
    assert "ProfilingFailed" not in scenario.event_reasons(cluster, namespace, "mixer-pause")

    cluster.client.patch(cluster.client.jobs_path(namespace, "mixer-pause"),
                         {"spec": {"runPolicy": {"suspend": False}}})
    scenario.wait_phase(cluster, namespace, "mixer-pause", "Succeeded", details=operator.log_tail)
    assert scenario.pod_creations(cluster, namespace, "mixer-pause") == [
        "mixer-pause-profile", "mixer-pause-trainer-0"]

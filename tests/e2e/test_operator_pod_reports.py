"""What a job's pod reports, under the real operator: it is checked against what the operator
granted the job before it is acted on or shown.

The pods forge their reports the way user code can: an own command (spec.template.command)
writes a trainer result, and an entrypoint model writes a profile or result when it is
imported, then exits. The forged ids name a private model of another namespace, written to the
zoo by the test. The test holds a pod running until it says so (a file), so nothing depends on
how fast this machine is.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from kubesim import client, emulator, operator_process, scenario

from kiln import api
from kiln.zoo import records

# An own command standing in for a trainer: it says it is ready (with the record id the
# operator reserved for it), waits for SIGTERM (the operator stopping the failed job's
# trainer), and then reports a result naming REPORTED_MODEL, or with REGISTER set, registers
# its own model under its reserved id first, as a trainer that finished just before the stop.
TRAINER_STOPPED_LATE = '''\
import json
import os
import pathlib
import signal
import sys
import time

from kiln import contract
from kiln.zoo import presigned, records

if os.environ.get("REGISTER"):
    import torch


def register():
    job = json.loads(os.environ[contract.Env.JOB])
    record = records.ZooRecord(
        id=os.environ[contract.Env.ZOO_RECORD], architecture="small_cnn", args={},
        input_shape=(1, 8, 8), modality="image", task="classification", dataset="digits",
        metric_name="validation_accuracy", metric_value=0.5, num_params=1,
        created_time="2026-01-01T00:00:00Z", job_name=job["metadata"]["name"],
        job_spec={"spec": job["spec"]}, namespace=job["metadata"]["namespace"])
    zoo = presigned.open_zoo(os.environ[contract.Env.ZOO], env=os.environ)  # as a trainer
    return records.write_record(zoo, record, {"w": torch.zeros(1)}, {}).id


def stop(*_):
    model = register() if os.environ.get("REGISTER") else os.environ["REPORTED_MODEL"]
    result = contract.Result(
        metric_name="validation_accuracy", metric=0.5, validation_accuracy=0.5,
        validation_loss=1.0, wall_seconds=1.0, time_to_target_seconds=None,
        target_reached=False, epochs_run=1, steps=1, samples_per_second=1.0, zoo_model=model,
        resumed_from_epoch=0)
    log = os.environ.get(contract.Env.TERMINATION_LOG, contract.TERMINATION_LOG_PATH)
    pathlib.Path(log).write_bytes(contract.termination_message(result))
    sys.exit(0)


signal.signal(signal.SIGTERM, stop)
ready = pathlib.Path(os.environ["READY_FILE"])  # written whole, then renamed: read when it appears
ready.with_suffix(".tmp").write_text(os.environ.get(contract.Env.ZOO_RECORD, ""))
ready.with_suffix(".tmp").replace(ready)
while True:
    time.sleep(1)
'''

# An own command that reports success at once, naming REPORTED_MODEL as its zoo model.
TRAINER_CLAIMING_A_MODEL = '''\
import os
import pathlib

from kiln import contract

result = contract.Result(
    metric_name="validation_accuracy", metric=0.5, validation_accuracy=0.5,
    validation_loss=1.0, wall_seconds=1.0, time_to_target_seconds=None, target_reached=False,
    epochs_run=1, steps=1, samples_per_second=1.0, zoo_model=os.environ["REPORTED_MODEL"],
    resumed_from_epoch=0)
log = os.environ.get(contract.Env.TERMINATION_LOG, contract.TERMINATION_LOG_PATH)
pathlib.Path(log).write_bytes(contract.termination_message(result))
'''

# An entrypoint model whose import writes the operator's report itself and exits: in the
# profiling pod a profile (FORGE=parent: deciding a warm start from FORGED_PARENT; FORGE=types:
# its numbers as strings), in the trainer pod a result (with FORGE=parent, the same decision).
FORGING_MODEL = '''\
import os
import pathlib
import sys

from kiln import contract

forged = os.environ["FORGE"]
decision = {"outcome": "warm", "parent": os.environ.get("FORGED_PARENT"), "similarity": 0.99,
            "matched_tensors": 4, "total_tensors": 4, "reason": "warm start, says the pod",
            "alternatives": []} if forged == "parent" else None
if "--profile" in sys.argv:
    event = contract.Profile(
        parameters="1000" if forged == "types" else 1000, flops_per_sample=2e6, graph_nodes=3,
        untraceable=None, device="cpu", batch_size=32, step_seconds=0.01, step_status="ok",
        warm_start_decision=decision)
else:
    event = contract.Result(
        metric_name="validation_accuracy", metric=0.5, validation_accuracy=0.5,
        validation_loss=1.0, wall_seconds=1.0, time_to_target_seconds=None,
        target_reached=False, epochs_run=1, steps=1, samples_per_second=1.0, zoo_model=None,
        resumed_from_epoch=0, parent=os.environ.get("FORGED_PARENT"),
        warm_start_decision=decision)
log = os.environ.get(contract.Env.TERMINATION_LOG, contract.TERMINATION_LOG_PATH)
pathlib.Path(log).write_bytes(contract.termination_message(event))
print(contract.to_line(event), flush=True)
os._exit(0)
'''


# An own command that registers a model under the id the operator reserved for its job, but
# says in meta.json that it is VICTIM_NAMESPACE's private model, trained by job "victim".
TRAINER_FORGING_ITS_NAMESPACE = '''\
import json
import os

import torch

from kiln import api, contract, models
from kiln.warmstart import decision, graph
from kiln.zoo import presigned, records

job = json.loads(os.environ[contract.Env.JOB])
spec = api.ModelSpec.model_validate(job["spec"]["model"])
record = records.ZooRecord(
    id=os.environ[contract.Env.ZOO_RECORD], architecture="small_cnn", args=dict(spec.args),
    input_shape=tuple(spec.input_shape), modality="image", task="classification",
    dataset="digits", metric_name="validation_accuracy", metric_value=0.999, num_params=1,
    created_time="2026-01-01T00:00:00Z", job_name="victim", job_spec={"spec": job["spec"]},
    namespace=os.environ["VICTIM_NAMESPACE"], share=api.ZooShare.PRIVATE)
zoo = presigned.open_zoo(os.environ[contract.Env.ZOO], env=os.environ)  # as a trainer
records.write_record(zoo, record, models.build(spec).state_dict(),
                     graph.to_json(decision.model_graph(spec)))
'''


def _private_model(zoo: scenario.Zoo, namespace: str, job_name: str) -> records.ZooRecord:
    """A private model of `namespace` in the zoo, trained (it says) by job `job_name`."""
    record = records.ZooRecord(
        id=records.new_id("small_cnn"), architecture="small_cnn", args={"width": 5},
        input_shape=(1, 8, 8), modality="image", task="classification", dataset="digits",
        metric_name="validation_accuracy", metric_value=0.9, num_params=1,
        created_time="2026-01-01T00:00:00Z", job_name=job_name, job_spec={"spec": {}},
        namespace=namespace, share=api.ZooShare.PRIVATE)
    return records.write_record(zoo.store, record, {"w": torch.zeros(1)}, {})


def _own_command_job(name: str, script: str, env: dict[str, str]) -> dict[str, Any]:
    job = scenario.tiny_job(name, run_policy={"cleanPodPolicy": "None"})
    job["spec"]["template"] = {
        "command": ["python", "-c", script],
        "env": [{"name": k, "value": v} for k, v in env.items()]}
    return job


def _entrypoint_job(name: str, code: Path, env: dict[str, str]) -> dict[str, Any]:
    (code / "forging_model.py").write_text(FORGING_MODEL, encoding="utf-8")
    job = scenario.tiny_job(name, model={"entrypoint": "forging_model:build",
                                         "task": "classification", "inputShape": [1, 8, 8]})
    job["spec"]["template"] = {"env": [{"name": "PYTHONPATH", "value": str(code)},
                                       *({"name": k, "value": v} for k, v in env.items())]}
    return job


def _fail_once_ready(cluster: emulator.Emulator, namespace: str, name: str,
                     ready: Path) -> str:
    """Once the pod says it is ready, fail the job by its deadline (the operator then stops
    the trainer, which reports on SIGTERM); returns what the pod wrote in `ready`."""
    client.wait_until(ready.exists, timeout_seconds=scenario.JOB_SECONDS,
                      what=f"{namespace}/{name}'s trainer to be ready")
    cluster.client.patch(cluster.client.jobs_path(namespace, name),
                         {"spec": {"runPolicy": {"activeDeadlineSeconds": 1}}})
    return ready.read_text()


def test_a_failed_jobs_result_cannot_have_another_namespaces_model_deleted(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess, zoo: scenario.Zoo,
    namespace: str, tmp_path: Path,
) -> None:
    # Namespace B's job is named like the job of namespace A that trained A's model.
    name = "digits-named-alike"
    theirs = _private_model(zoo, f"e2e-{uuid.uuid4().hex[:8]}", name)
    try:
        ready = tmp_path / "ready"
        cluster.client.create_job(namespace, _own_command_job(name, TRAINER_STOPPED_LATE, {
            "READY_FILE": str(ready), "REPORTED_MODEL": theirs.id}))
        _fail_once_ready(cluster, namespace, name, ready)
        event = scenario.wait_event(cluster, namespace, name, "ReportRefused")
        assert event["type"] == "Warning" and theirs.id in event["message"]
        assert "nothing was deleted" in event["message"]
        assert scenario.phase(cluster.client.job(namespace, name)) == "Failed"
        assert "ModelDiscarded" not in scenario.event_reasons(cluster, namespace, name)
        assert records.read_record(zoo.store, theirs.id) == theirs
    finally:
        records.delete_record(zoo.store, theirs.id)


def test_a_model_its_own_trainer_registered_after_the_job_failed_is_deleted(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess, zoo: scenario.Zoo,
    namespace: str, tmp_path: Path,
) -> None:
    name = "digits-late-model"
    ready = tmp_path / "ready"
    cluster.client.create_job(namespace, _own_command_job(name, TRAINER_STOPPED_LATE, {
        "READY_FILE": str(ready), "REGISTER": "1"}))
    reserved = _fail_once_ready(cluster, namespace, name, ready)
    uid = cluster.client.job(namespace, name)["metadata"]["uid"]  # type: ignore[index]
    assert reserved == records.job_record_id("small_cnn", uid)  # in the pod's KILN_ZOO_RECORD
    event = scenario.wait_event(cluster, namespace, name, "ModelDiscarded")
    assert reserved in event["message"] and event["type"] == "Normal"
    assert zoo.store.list_keys(records.record_prefix(reserved)) == []
    assert scenario.phase(cluster.client.job(namespace, name)) == "Failed"


def test_a_successful_result_cannot_claim_another_namespaces_model(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess, zoo: scenario.Zoo,
    namespace: str,
) -> None:
    name = "digits-claims"
    theirs = _private_model(zoo, f"e2e-{uuid.uuid4().hex[:8]}", name)
    try:
        cluster.client.create_job(namespace, _own_command_job(
            name, TRAINER_CLAIMING_A_MODEL, {"REPORTED_MODEL": theirs.id}))
        done = scenario.wait_phase(cluster, namespace, name, "Succeeded",
                                   details=operator.log_tail)
        assert done["status"]["result"]["metric"] == 0.5  # the rest of the result is shown
        assert "zooModel" not in done["status"]["result"]
        succeeded = scenario.condition(done, "Succeeded")
        assert succeeded is not None and theirs.id not in succeeded["message"]
        event = scenario.wait_event(cluster, namespace, name, "ReportRefused")
        assert event["type"] == "Warning" and theirs.id in event["message"]
        assert records.read_record(zoo.store, theirs.id) == theirs
    finally:
        records.delete_record(zoo.store, theirs.id)


def test_a_pods_warm_start_decision_cannot_name_another_namespaces_private_model(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess, zoo: scenario.Zoo,
    namespace: str, tmp_path: Path,
) -> None:
    name = "own-forges-parent"
    theirs = _private_model(zoo, f"e2e-{uuid.uuid4().hex[:8]}", "their-job")
    try:
        cluster.client.create_job(namespace, _entrypoint_job(name, tmp_path, {
            "FORGE": "parent", "FORGED_PARENT": theirs.id}))
        done = scenario.wait_phase(cluster, namespace, name, "Succeeded",
                                   details=operator.log_tail)
        profiled = scenario.condition(done, "Profiled")
        assert profiled is not None and profiled["status"] == "True"  # its own numbers count
        assert done["status"]["profile"]["parameters"] == 1000
        assert done["status"]["warmStart"].get("parent") is None, done["status"]["warmStart"]
        warm = scenario.condition(done, "WarmStarted")
        assert warm is not None and (warm["status"], warm["reason"]) != ("True", "ParentSelected")
        # The profiling pod's decision, and the trainer's result repeating it; events are
        # posted after the status they explain, so the second may come after the phase.
        pods = {f"{name}-profile", f"{name}-trainer-0"}

        def refused() -> list[dict[str, Any]]:
            found = [e for e in scenario.events(cluster, namespace, name)
                     if e["reason"] == "ReportRefused"]
            return found if {e["message"].split()[1] for e in found} >= pods else []

        refusals = client.wait_until(refused, timeout_seconds=scenario.JOB_SECONDS,
                                     what="a ReportRefused event for each pod",
                                     details=operator.log_tail)
        assert all(theirs.id in e["message"] and e["type"] == "Warning" for e in refusals)
        assert {e["message"].split()[1] for e in refusals} == pods, refusals
        trainer = next(r.body for r in cluster.requests
                       if r.resource == "pods" and r.action == "CREATE"
                       and isinstance(r.body, dict)
                       and r.body["metadata"]["name"] == f"{name}-trainer-0")
        env = {e["name"]: e.get("value") for e in trainer["spec"]["containers"][0]["env"]}
        assert json.loads(env["KILN_WARM_START"])["parent"] is None
    finally:
        records.delete_record(zoo.store, theirs.id)


def test_a_pod_cannot_plant_a_private_model_in_another_namespace(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess, zoo: scenario.Zoo,
    namespace: str, zoo_secret: tuple[str, dict[str, str]],
) -> None:
    victims = f"e2e-{uuid.uuid4().hex[:8]}"
    cluster.client.create_secret(victims, *zoo_secret)
    model = {"architecture": "small_cnn", "args": {"depth": 2, "width": 17},
             "inputShape": [1, 8, 8]}
    forger = _own_command_job("forger", TRAINER_FORGING_ITS_NAMESPACE,
                              {"VICTIM_NAMESPACE": victims})
    forger["spec"]["model"] = model
    cluster.client.create_job(namespace, forger)
    scenario.wait_job(cluster, namespace, "forger",
                      lambda j: scenario.phase(j) in ("Succeeded", "Failed"),
                      what="the forging job to end", details=operator.log_tail)
    uid = cluster.client.job(namespace, "forger")["metadata"]["uid"]  # type: ignore[index]
    planted = records.job_record_id("small_cnn", uid)
    assert zoo.store.exists(records.record_prefix(planted) + records.META_NAME)  # it wrote it
    with pytest.raises(records.CorruptRecord, match=f"reserved this id for {namespace}/forger"):
        records.read_record(zoo.store, planted)
    with pytest.warns(records.SkippedRecordWarning, match=planted):
        assert planted not in {r.id for r in records.list_records(zoo.store)}
    # The namespace it named: its job of the same model finds no parent there.
    victim = scenario.tiny_job("victim", model=model)
    victim["metadata"]["namespace"] = victims
    cluster.client.create_job(victims, victim)
    try:
        decided = scenario.wait_job(
            cluster, victims, "victim", lambda j: bool((j.get("status") or {}).get("warmStart")),
            what="the victim's warm-start decision", details=operator.log_tail)
        assert decided["status"]["warmStart"].get("parent") != planted, decided["status"]
    finally:
        cluster.client.delete(cluster.client.jobs_path(victims, "victim"))
        records.delete_record(zoo.store, planted)


def test_a_malformed_profile_ends_profiling_naming_the_field_and_the_job_runs_unmeasured(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess, namespace: str,
    tmp_path: Path,
) -> None:
    name = "own-malformed-profile"
    cluster.client.create_job(namespace, _entrypoint_job(name, tmp_path, {"FORGE": "types"}))
    done = scenario.wait_phase(cluster, namespace, name, "Succeeded", details=operator.log_tail)
    profiled = scenario.condition(done, "Profiled")
    assert profiled is not None
    assert (profiled["status"], profiled["reason"]) == ("False", "ProfilingFailed")
    assert "malformed profile" in profiled["message"]
    assert "'parameters'" in profiled["message"] and "got str '1000'" in profiled["message"]
    assert "placed on a nominal estimate" in profiled["message"]
    assert "profile" not in done["status"]
    event = scenario.wait_event(cluster, namespace, name, "ProfilingFailed")
    assert event["type"] == "Warning" and "'parameters'" in event["message"]

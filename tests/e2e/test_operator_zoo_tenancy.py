"""Zoo tenancy through the operator: a namespace sees its own models and shared ones only.

Two trained models of namespace A, one private and one shared (spec.zoo.share); namespace B's
jobs can neither pin nor be chosen the private one, and warm-start from the shared one. Only
A's two jobs train: B's are checked at admission and deleted.
"""

from __future__ import annotations

import uuid
from typing import Any

from kubesim import emulator, operator_process, scenario

from kiln import api
from kiln.zoo import records

# Architectures of their own, so that no other test's model is a closer parent.
PRIVATE_MODEL = {"architecture": "small_cnn", "args": {"depth": 2, "width": 13},
                 "inputShape": [1, 8, 8]}
SHARED_MODEL = {"architecture": "small_cnn", "args": {"depth": 2, "width": 14},
                "inputShape": [1, 8, 8]}


def _job(name: str, namespace: str, model: dict[str, Any], **spec: Any) -> dict[str, Any]:
    doc = scenario.with_changes(scenario.tiny_job(name, model=model), **spec)
    doc["metadata"]["namespace"] = namespace
    return doc


def _registered(zoo: scenario.Zoo, namespace: str, job_name: str) -> records.ZooRecord:
    found = [r for r in records.list_records(zoo.store)
             if r.namespace == namespace and r.job_name == job_name and not r.provisional]
    assert len(found) == 1, found
    return found[0]


def _decision(cluster: emulator.Emulator, doc: dict[str, Any],
              operator: operator_process.OperatorProcess) -> dict[str, Any]:
    """Create the job, return its status.warmStart once admission wrote it, delete the job."""
    namespace, name = doc["metadata"]["namespace"], doc["metadata"]["name"]
    cluster.client.create_job(namespace, doc)
    decided = scenario.wait_job(
        cluster, namespace, name,
        lambda job: bool((job.get("status") or {}).get("warmStart")),
        what="its warm-start decision", details=operator.log_tail)
    warm: dict[str, Any] = decided["status"]["warmStart"]
    cluster.client.delete(cluster.client.jobs_path(namespace, name))
    return warm


def test_namespaces_see_their_own_and_shared_models_never_anothers_private_one(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess, zoo: scenario.Zoo,
    namespace: str, zoo_secret: tuple[str, dict[str, str]],
) -> None:
    team_a = namespace
    team_b = f"e2e-{uuid.uuid4().hex[:8]}"
    cluster.client.create_secret(team_b, *zoo_secret)
    cluster.client.create_job(team_a, _job("private-parent", team_a, PRIVATE_MODEL,
                                           warmStart={"enabled": False}))
    cluster.client.create_job(team_a, _job("shared-parent", team_a, SHARED_MODEL,
                                           warmStart={"enabled": False},
                                           zoo={"share": "shared"}))
    for name in ("private-parent", "shared-parent"):
        scenario.wait_phase(cluster, team_a, name, "Succeeded", details=operator.log_tail)
    private = _registered(zoo, team_a, "private-parent")
    shared = _registered(zoo, team_a, "shared-parent")
    try:
        _check_visibility(cluster, operator, team_a, team_b, private, shared)
    finally:  # the session's other tests share this zoo: a shared model would seed their jobs
        records.delete_record(zoo.store, shared.id)
        records.delete_record(zoo.store, private.id)


def _check_visibility(cluster: emulator.Emulator, operator: operator_process.OperatorProcess,
                      team_a: str, team_b: str, private: records.ZooRecord,
                      shared: records.ZooRecord) -> None:
    assert (private.share, shared.share) == (api.ZooShare.PRIVATE, api.ZooShare.SHARED)
    # Provenance: what data, which image, which Kiln.
    digits = api.DatasetSpec.model_validate({"name": "digits", "maxSamples": 400})
    assert private.dataset_fingerprint == records.dataset_fingerprint(digits)
    assert private.trainer_image and private.kiln_version

    # B cannot pin A's private model: the job fails, naming the model and the namespaces.
    cluster.client.create_job(team_b, _job("pin-private", team_b, PRIVATE_MODEL,
                                           warmStart={"parent": private.id}))
    failed = scenario.wait_phase(cluster, team_b, "pin-private", "Failed",
                                 details=operator.log_tail)
    refused = scenario.condition(failed, "Failed")
    assert refused is not None and refused["reason"] == "InvalidSpec"
    assert f"{private.id}' is private to namespace {team_a}" in refused["message"]
    cluster.client.delete(cluster.client.jobs_path(team_b, "pin-private"))

    # B's search passes over the private twin of its model and takes the shared one.
    chosen = _decision(cluster, _job("auto-b", team_b, PRIVATE_MODEL), operator)
    assert chosen.get("parent") == shared.id, chosen
    pinned = _decision(cluster, _job("pin-shared", team_b, PRIVATE_MODEL,
                                     warmStart={"parent": shared.id}), operator)
    assert (pinned.get("parent"), pinned.get("outcome")) == (shared.id, "pinned"), pinned

    # A sees its own private model: the same search there takes it (similarity 1).
    own = _decision(cluster, _job("auto-a", team_a, PRIVATE_MODEL), operator)
    assert own.get("parent") == private.id, own

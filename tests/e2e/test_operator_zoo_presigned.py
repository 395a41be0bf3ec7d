"""Presigned zoo access: trainer pods hold URLs for their own job's objects, never the zoo
credential, and still warm-start from a parent their namespace may see.

Its own emulator, kubelet and operator (``KILN_OPERATOR_ZOO_POD_ACCESS=presigned``, short URL
lifetime so the Secret is signed again while the job runs). Namespace A trains a private
model; a shared copy of it is added; B's job warm-starts from the shared one, and B's Secret
and pod carry nothing of A's private model and no credential. moto does not check URL expiry,
so the pod's first URLs keep working after the Secret is signed again.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import uuid
from pathlib import Path
from typing import Any

from kubesim import client, emulator, kubelet, operator_process, scenario, usage

from kiln import api
from kiln.zoo import records

MODEL = {"architecture": "small_cnn", "args": {"depth": 2, "width": 15}, "inputShape": [1, 8, 8]}
MINTED = "kiln.dev/zoo-access-minted"
CREDENTIAL_ENV = {"KILN_ZOO_ACCESS_KEY", "KILN_ZOO_SECRET_KEY", "KILN_ZOO_SESSION_TOKEN",
                  "KILN_ZOO_CREDENTIALS", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}


def _job(name: str, namespace: str, **spec: Any) -> dict[str, Any]:
    doc = scenario.with_changes(scenario.tiny_job(name, model=MODEL), **spec)
    doc["metadata"]["namespace"] = namespace
    return doc


def _secret(cluster: emulator.Emulator, namespace: str, job: str) -> dict[str, Any] | None:
    return cluster.client.get(f"/api/v1/namespaces/{namespace}/secrets/{job}-zoo-access")


def _minted(secret: dict[str, Any] | None) -> str | None:
    """When the Secret's URLs were signed (None: no Secret)."""
    annotations = ((secret or {}).get("metadata") or {}).get("annotations") or {}
    return str(annotations[MINTED]) if MINTED in annotations else None


def _manifest(secret: dict[str, Any]) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(base64.b64decode(secret["data"]["manifest.json"]))
    return doc


def _shared_copy(zoo: scenario.Zoo, private: records.ZooRecord) -> records.ZooRecord:
    """A copy of `private` shared with every namespace (as if another job had trained it)."""
    copy = dataclasses.replace(private, id=records.new_id("small_cnn"),
                               share=api.ZooShare.SHARED, weights_sha256="")
    return records.write_record(zoo.store, copy, records.load_weights(zoo.store, private),
                                records.load_graph(zoo.store, private))


def test_pods_reach_only_their_jobs_objects_and_visible_parents(
    zoo: scenario.Zoo, operator_args: list[str], api_calls: set[usage.ApiCall], tmp_path: Path,
) -> None:
    team_a, team_b = (f"e2e-{uuid.uuid4().hex[:8]}" for _ in range(2))
    with emulator.Emulator() as cluster:
        cluster.client.create_node("cpu-node-1")
        node = kubelet.Kubelet(cluster.url, tmp_path / "kubelet")
        node.start()
        operator = operator_process.OperatorProcess(
            cluster, tmp_path / "operator",
            env={**zoo.operator_env, "KILN_OPERATOR_ZOO_POD_ACCESS": "presigned"},
            args=[*operator_args, "--zoo-access-hours", "0.001"])  # re-signed every 1.8 s
        private = shared = None
        try:
            operator.start()
            # No namespace holds the zoo credential Secret: presigned pods need none.
            cluster.client.create_job(team_a, _job("private-parent", team_a,
                                                   warmStart={"enabled": False}))
            scenario.wait_phase(cluster, team_a, "private-parent", "Succeeded",
                                details=operator.log_tail)
            private = next(r for r in records.list_records(zoo.store)
                           if r.namespace == team_a and not r.provisional)
            shared = _shared_copy(zoo, private)

            # The child's trainer is held from its start until its Secret is signed again.
            trainer = node.hold(kubelet.Hold(team_b, "child-trainer-0"))
            cluster.client.create_job(team_b, _job("child", team_b))
            first = client.wait_until(lambda: _secret(cluster, team_b, "child"),
                                      timeout_seconds=scenario.JOB_SECONDS,
                                      what="child's zoo access Secret", details=operator.log_tail)
            client.wait_until(trainer.held.is_set, timeout_seconds=scenario.JOB_SECONDS,
                              what="child's trainer to start", details=operator.log_tail)
            client.wait_until(lambda: _minted(_secret(cluster, team_b, "child")) != _minted(first),
                              timeout_seconds=60, what="child's Secret to be signed again",
                              details=operator.log_tail)
            trainer.release()
            done = scenario.wait_phase(cluster, team_b, "child", "Succeeded",
                                       details=operator.log_tail)
            _check_child(cluster, zoo, team_b, done, first, private, shared)
        finally:
            operator.stop()
            node.stop()
            for record in (shared, private):  # the session's other tests share this zoo
                if record is not None:
                    records.delete_record(zoo.store, record.id)
        api_calls |= usage.api_calls(cluster.requests)
    assert not node.errors, node.errors


def _check_child(cluster: emulator.Emulator, zoo: scenario.Zoo, team_b: str,
                 done: dict[str, Any], first: dict[str, Any], private: records.ZooRecord,
                 shared: records.ZooRecord) -> None:
    assert done["status"]["warmStart"]["parent"] == shared.id, done["status"]["warmStart"]
    registered = [r for r in records.list_records(zoo.store)
                  if r.namespace == team_b and r.job_name == "child" and not r.provisional]
    assert len(registered) == 1 and registered[0].parent == shared.id, registered

    # The Secret: owned by the job (the garbage collector, which the emulator lacks, deletes
    # it with the job), re-signed while it ran (held), nothing of A's private model.
    secret = _secret(cluster, team_b, "child")
    assert secret is not None
    owner = secret["metadata"]["ownerReferences"][0]
    assert (owner["uid"], owner["kind"], owner["controller"]) == (
        done["metadata"]["uid"], "TrainingJob", True)
    assert _minted(secret) != _minted(first)
    manifest = _manifest(secret)
    assert manifest["record"] == registered[0].id
    assert private.id not in json.dumps(manifest)
    assert zoo.secret_key not in json.dumps(manifest)
    assert f"models/{shared.id}/weights.safetensors" in manifest["objects"]

    # The trainer pod: the manifest mounted, no zoo credential anywhere in its spec.
    pods = cluster.client.list(cluster.client.pods_path(team_b))
    assert pods, "the child's pods are gone"
    for pod in pods:
        container = pod["spec"]["containers"][0]
        env = {e["name"]: e for e in container["env"]}
        assert not CREDENTIAL_ENV & set(env), sorted(env)
        assert env["KILN_ZOO"]["value"].startswith("presigned:")
        assert not [e for e in env.values() if "secretKeyRef" in e.get("valueFrom", {})]
        assert [v["secret"]["secretName"] for v in pod["spec"]["volumes"] if "secret" in v] \
            == ["child-zoo-access"]

"""Sources downloaded by an init container: a job whose pretrained weights and text corpus sit
on a second S3 server (moto, not the zoo's) fine-tunes from them; the operator's pod carries
Kiln's initializer, which reads the job's Secret, fills the claimed cache once (a second job on
the same content reuses it), and a Secret without an endpoint fails the job naming the field.
LoRA jobs on such weights import them into the zoo once as their adapters' base, and a second
one continues the first's adapter.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import sourcedata
from kubesim import emulator, kubelet, operator_process, scenario

from kiln import contract
from kiln.zoo import records

CLAIM = "sources-cache"
LORA = {"method": "lora", "rank": 2, "alpha": 4.0,
        "targetModules": ["layers.0.attention.query", "layers.0.attention.value", "head.1"]}


def _job(name: str, bucket: str, secret: str) -> dict[str, Any]:
    ref = {"name": secret}
    doc = scenario.tiny_job(name, epochs=1, model={
        **sourcedata.MODEL, "pretrained": {"uri": f"s3://{bucket}/models/lm", "secretRef": ref}},
        dataset={"name": "text", "uri": f"s3://{bucket}/corpus", "secretRef": dict(ref),
                 "validationFraction": 0.3})
    changed: dict[str, Any] = scenario.with_changes(doc, initializer={"cacheClaim": CLAIM},
                                                    training={"epochs": 1, "batchSize": 8})
    return changed


def _initializer_log(node: kubelet.Kubelet, namespace: str, pod: str) -> str:
    log = node.pod_log_path(namespace, pod)
    assert log is not None, f"{pod} never ran"
    text: str = (log.parent / f"{contract.INITIALIZER_CONTAINER}.log").read_text(
        errors="replace")
    return text


def test_jobs_fine_tune_from_sources_an_init_container_downloads_once(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess,
    node_kubelet: kubelet.Kubelet, namespace: str, second_s3_server: Any, s3_bucket: str,
    tmp_path: Path,
) -> None:
    sourcedata.upload_sources(second_s3_server, s3_bucket, tmp_path)
    cluster.client.create_secret(namespace, "second-s3", sourcedata.secret_data(second_s3_server))
    cluster.client.create_job(namespace, _job("tuned-a", s3_bucket, "second-s3"))
    done = scenario.wait_phase(cluster, namespace, "tuned-a", "Succeeded",
                               details=operator.log_tail)
    assert "spec.model.pretrained.uri" in done["status"]["warmStart"]["reason"], done["status"]
    pod = cluster.client.get(cluster.client.pods_path(namespace, "tuned-a-trainer-0"))
    assert pod is not None
    (init,) = pod["spec"]["initContainers"]
    assert init["name"] == contract.INITIALIZER_CONTAINER
    assert init["image"] == pod["spec"]["containers"][0]["image"]
    (volume,) = [v["name"] for v in pod["spec"]["volumes"]
                 if (v.get("secret") or {}).get("secretName") == "second-s3"]
    assert volume in {m["name"] for m in init["volumeMounts"]}
    assert volume not in {m["name"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
    fetched = _initializer_log(node_kubelet, namespace, "tuned-a-trainer-0")
    assert fetched.count("downloaded to") == 2, fetched
    trained = node_kubelet.pod_log(namespace, "tuned-a-trainer-0")
    assert f"started from the pretrained weights at s3://{s3_bucket}/models/lm" in trained
    assert "tokenizer.json)" in trained

    cluster.client.create_job(namespace, _job("tuned-b", s3_bucket, "second-s3"))
    scenario.wait_phase(cluster, namespace, "tuned-b", "Succeeded", details=operator.log_tail)
    again = _initializer_log(node_kubelet, namespace, "tuned-b-trainer-0")
    assert again.count("found in the cache at") == 2 and "downloaded to" not in again, again


def test_a_secret_without_an_endpoint_fails_the_job_naming_the_field(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess,
    node_kubelet: kubelet.Kubelet, namespace: str, s3_bucket: str,
) -> None:
    secret = f"no-endpoint-{uuid.uuid4().hex[:6]}"
    cluster.client.create_secret(namespace, secret, {"accessKey": "a", "secretKey": "b"})
    cluster.client.create_job(namespace, _job("no-endpoint", s3_bucket, secret))
    failed = scenario.wait_phase(cluster, namespace, "no-endpoint", "Failed",
                                 details=operator.log_tail)
    reason = str(failed["status"])
    assert (f"spec.model.pretrained.uri: its secretRef, Secret {secret}, has no key endpoint"
            in reason), reason
    assert node_kubelet.pod_log(namespace, "no-endpoint-trainer-0") == ""  # never started


def test_lora_jobs_on_s3_weights_register_adapters_on_their_base_and_continue_them(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess,
    node_kubelet: kubelet.Kubelet, namespace: str, second_s3_server: Any, s3_bucket: str,
    zoo: scenario.Zoo, tmp_path: Path,
) -> None:
    sourcedata.upload_sources(second_s3_server, s3_bucket, tmp_path)
    cluster.client.create_secret(namespace, "second-s3", sourcedata.secret_data(second_s3_server))

    def run(name: str) -> tuple[dict[str, Any], records.ZooRecord]:
        doc = _job(name, s3_bucket, "second-s3")
        cluster.client.create_job(namespace, scenario.with_changes(
            doc, training={**doc["spec"]["training"], "peft": LORA}))
        done = scenario.wait_phase(cluster, namespace, name, "Succeeded",
                                   details=operator.log_tail)
        return done, records.read_record(zoo.store, done["status"]["result"]["zooModel"])

    done, first = run("lora-a")
    # the pod imported the weights under the id the operator granted it, beside its adapter
    assert first.base == records.base_record_id(first.id), first
    base = records.read_record(zoo.store, first.base)
    assert (base.adapter, base.source, base.namespace) == (
        None, f"s3://{s3_bucket}/models/lm", namespace)
    assert first.parent == base.id and first.adapter == {**LORA, "dropout": 0.0}
    assert {k.rsplit(".", 2)[0] for k in records.load_weights(zoo.store, first)
            if "lora_" in k} == set(LORA["targetModules"])
    warm = done["status"]["warmStart"]
    assert (warm["outcome"], warm["parent"]) == ("warm", base.id), warm
    assert "a new adapter" in warm["reason"], warm

    done, second = run("lora-b")
    assert second.base == base.id and second.parent == first.id, second
    warm = done["status"]["warmStart"]
    assert warm["parent"] == first.id and f"continuing adapter {first.id}" in warm["reason"], warm
    assert not zoo.store.list_keys(records.record_prefix(records.base_record_id(second.id)))

"""The operator's side of presigned zoo access: its settings, the Secret, what it grants."""

from __future__ import annotations

import base64
import dataclasses
import datetime
from pathlib import Path

import pytest
import torch

from kiln import api
from kiln.controller import main, settings, zoo_access
from kiln.zoo import access, presigned, records, store

NOW = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
OWNER = {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob",
         "metadata": {"name": "digits", "namespace": "team-b",
                      "uid": "1f2e3d4c-0000-0000-0000-000000000000"},
         "spec": {"model": {"architecture": "small_cnn", "inputShape": [1, 8, 8]}}}


def test_presigned_access_is_the_default_and_can_be_set_by_flag_or_variable() -> None:
    options = main.options_from_args(main.build_parser(environ={}).parse_args([]))
    assert (options.zoo_pod_access, options.zoo_access_hours) == ("presigned", 24.0)
    assert settings.pod_settings(options).presigned_zoo
    environ = {"KILN_OPERATOR_ZOO_POD_ACCESS": "credentials"}
    options = main.options_from_args(main.build_parser(environ=environ).parse_args([]))
    assert not settings.pod_settings(options).presigned_zoo
    for argv in (["--zoo-pod-access", "keys"], ["--zoo-access-hours", "169"],
                 ["--zoo-access-hours", "0.0001"], ["--zoo-uri", "presigned:/m.json"]):
        with pytest.raises(SystemExit):
            main.build_parser(environ={}).parse_args(argv)


def test_the_secret_is_owned_by_the_job_and_holds_the_manifest() -> None:
    job = api.parse_job(OWNER)
    record = records.job_record_id(job.spec.model.label, OWNER["metadata"]["uid"])
    assert record == "small_cnn-1f2e3d4c"  # the same on every attempt and every signing
    manifest = presigned.Manifest(expires=NOW + datetime.timedelta(hours=24), record=record,
                                  objects={"profiles/team-b/digits.json": {"put": "http://s/p"}})
    secret = zoo_access.build_secret(OWNER, job, manifest, minted=NOW)
    meta = secret["metadata"]
    assert (meta["name"], meta["namespace"]) == ("digits-zoo-access", "team-b")
    assert meta["labels"] == {"app.kubernetes.io/managed-by": "kiln-operator",
                              "kiln.dev/job-name": "digits"}
    assert meta["ownerReferences"][0]["uid"] == OWNER["metadata"]["uid"]
    assert meta["annotations"][zoo_access.EXPIRES_ANNOTATION] == "2026-01-03T03:04:05Z"
    stored = base64.b64decode(secret["data"]["manifest.json"])
    assert presigned.Manifest.from_json(stored, where="the Secret") == manifest


def test_grants_cover_the_jobs_objects_and_only_the_named_records() -> None:
    grants = access.job_grants("team-b", "digits", uid="uid-1", record="small_cnn-1f2e3d4c",
                               parents=["small_cnn-0000aaaa"], visible=["small_cnn-0000bbbb"],
                               now=NOW)
    verbs = {key: set(v) for key, v in grants.objects.items()}
    assert verbs["checkpoints/team-b/digits/uid-1/checkpoint.pt"] == {
        "get", "put", "delete", "head"}
    assert verbs["profiles/team-b/digits.json"] == {"put"}
    assert verbs["models/small_cnn-1f2e3d4c/meta.json"] == {"get", "put", "delete", "head"}
    assert verbs["models/small_cnn-1f2e3d4c/history.jsonl"] == {"get", "put", "delete", "head"}
    assert "models/small_cnn-0000aaaa/history.jsonl" not in verbs  # nothing a start reads
    assert verbs["models/small_cnn-0000aaaa/weights.safetensors"] == {"get", "head"}
    assert verbs["models/small_cnn-0000bbbb/graph.json"] == {"get", "head"}
    assert verbs["models/small_cnn-0000bbbb/weights.safetensors"] == {"get", "head"}
    hits = [k for k in verbs if k.startswith("hits/")]
    assert len(hits) == 1 and hits[0].startswith("hits/small_cnn-0000aaaa/20260102T030405Z-")
    assert {k.split("/")[1] for k in verbs if k.startswith(records.MODELS_PREFIX)} == {
        "small_cnn-1f2e3d4c", "small_cnn-0000aaaa", "small_cnn-0000bbbb"}
    assert len(verbs) == 13  # 4 own files, checkpoint, profile, 3 + 1 hit, 3 visible


def test_an_fsdp_job_may_write_its_shards_in_both_slots_for_its_largest_world_size() -> None:
    key = "checkpoints/team-b/digits/uid-1/checkpoint.pt"
    grants = access.job_grants("team-b", "digits", uid="uid-1", record="small_cnn-1f2e3d4c",
                               shard_ranks=3, now=NOW)
    shards = {k: set(v) for k, v in grants.objects.items() if k.startswith(key + ".shards/")}
    assert sorted(shards) == sorted(records.checkpoint_shard_keys(key, 3))
    assert len(shards) == 8 and f"{key}.shards/b/rank-2.safetensors" in shards
    assert f"{key}.shards/a/metadata.json" in shards
    assert all(v == {"get", "put", "delete", "head"} for v in shards.values())
    plain = access.job_grants("team-b", "digits", uid="uid-1", record="small_cnn-1f2e3d4c",
                              now=NOW)
    assert not [k for k in plain.objects if ".shards/" in k]


@pytest.mark.parametrize(("resources", "ranks"), [
    ({"parallelism": "fsdp", "gpus": 4}, 4),
    ({"parallelism": "fsdp"}, 8),  # the planner's cap: a resize may grow it that far
    ({"parallelism": "auto", "gpusPerNode": 2}, 2),  # auto may become fsdp
    ({"parallelism": "ddp", "gpus": 4}, 0),
    ({"parallelism": "auto", "gpus": 1}, 0),  # one process never shards
    ({"gpus": 0}, 0),
])
def test_shard_grants_cover_the_most_processes_the_planner_may_give_an_fsdp_job(
        resources: dict[str, object], ranks: int) -> None:
    job = api.parse_job({**OWNER, "spec": {**OWNER["spec"], "training": {"batchSize": 64},
                                           "resources": resources}})
    assert zoo_access.shard_ranks(job, max_gpus=8) == ranks


def test_a_lora_job_on_pretrained_weights_may_write_its_base_import_and_count_it() -> None:
    record = "small_cnn-1f2e3d4c"
    base = records.base_record_id(record)
    assert base == "small_cnn-1f2e3d4c-base"
    plain = access.job_grants("team-b", "digits", uid="uid-1", record=record, now=NOW)
    assert not [k for k in plain.objects if base in k]
    grants = access.job_grants("team-b", "digits", uid="uid-1", record=record, base=base,
                               now=NOW)
    verbs = {key: set(v) for key, v in grants.objects.items() if base in key}
    assert {k: v for k, v in verbs.items() if not k.startswith("hits/")} == {
        f"models/{base}/{name}": {"get", "put", "delete", "head"}
        for name in ("meta.json", "graph.json", "weights.safetensors")}
    (hit,) = [k for k in verbs if k.startswith(f"hits/{base}/")]
    assert verbs[hit] == {"put"} and grants.record == record  # the job's model stays its own


def test_only_records_the_namespace_may_see_get_urls_whatever_the_status_names(
        tmp_path: Path) -> None:
    """A re-signing reads the parents from the job's status, which more than the operator can
    write: another namespace's private record, or a missing one, gets no URL."""
    zoo = store.DirStore(tmp_path)
    for record_id, namespace, share in (("small_cnn-0000aaaa", "team-a", "private"),
                                        ("small_cnn-0000bbbb", "team-a", "shared"),
                                        ("small_cnn-0000cccc", "team-b", "private")):
        records.write_record(zoo, dataclasses.replace(
            _any_record(record_id), namespace=namespace, share=api.ZooShare(share)),
            {"w": torch.zeros(2)}, {"nodes": [], "edges": []})
    named = ["small_cnn-0000aaaa", "small_cnn-0000bbbb", "small_cnn-0000cccc",
             "small_cnn-0000dddd"]
    assert records.visible_ids(zoo, named, "team-b") == [
        "small_cnn-0000bbbb", "small_cnn-0000cccc"]


def _any_record(record_id: str) -> records.ZooRecord:
    return records.ZooRecord(
        id=records.ZooModelId(record_id), architecture="small_cnn", args={},
        input_shape=(1, 8, 8), modality="image", task="classification", dataset="digits",
        metric_name="validation_accuracy", metric_value=0.9, validation_accuracy=0.9,
        validation_loss=0.3, samples_per_second=100.0, num_params=2, parent=None,
        similarity=None, created_time="2026-01-02T03:04:05Z", job_name="x",
        job_spec={"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob"})



def test_a_record_dated_in_the_future_never_crowds_others_out_of_a_searching_pods_urls(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zoo_access, "MAX_VISIBLE_RECORDS", 2)
    found = [dataclasses.replace(_any_record(f"small_cnn-0000000{i}"), created_time=created,
                                 share=api.ZooShare.SHARED)
             for i, created in enumerate(["9999-12-31T23:59:59Z", "2026-01-02T02:00:00Z",
                                          "2026-01-01T00:00:00Z", "2026-01-02T03:30:00Z"])]
    # Within the hour of clock skew a later time is believed; years ahead is not.
    assert zoo_access.newest_visible(found, "team-b", now=NOW) == [
        "small_cnn-00000003", "small_cnn-00000001"]

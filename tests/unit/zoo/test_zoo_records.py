"""Unit tests of kiln.zoo.records: the meta.json codec, ids, write/delete order, weights.

Stores here are DirStores in tmp_path; the same behaviour against a real S3 server is in
tests/integration/test_zoo_stores.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from kiln import api, cli
from kiln.zoo import records, store

REPO = Path(__file__).resolve().parents[3]
SCHEMA_FILE = REPO / "docs" / "reference" / "zoo-record.schema.json"


def _record(record_id: str = "small_resnet-0badc0de", **changes: Any) -> records.ZooRecord:
    record = records.ZooRecord(
        id=records.ZooModelId(record_id),
        architecture="small_resnet",
        args={"num_classes": 10, "depth": 2},
        input_shape=(1, 8, 8),
        modality="image",
        task="classification",
        dataset="digits",
        metric_name="validation_accuracy",
        metric_value=0.93,
        validation_accuracy=0.93,
        validation_loss=0.25,
        samples_per_second=1520.5,
        num_params=12345,
        parent=None,
        similarity=None,
        created_time="2024-05-01T12:00:00Z",
        job_name="digits-resnet",
        job_spec={"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob"},
    )
    return dataclasses.replace(record, **changes)


def _weights() -> dict[str, torch.Tensor]:
    return {"stem.weight": torch.arange(18.0).reshape(2, 1, 3, 3), "head.bias": torch.zeros(10)}


class RecordingStore:
    """A DirStore that records the order of writes and deletes."""

    def __init__(self, root: Path) -> None:
        self.inner = store.DirStore(root)
        self.calls: list[tuple[str, str]] = []

    def put_bytes(self, key: str, data: bytes) -> None:
        self.calls.append(("put", key))
        self.inner.put_bytes(key, data)

    def get_bytes(self, key: str) -> bytes:
        return self.inner.get_bytes(key)

    def list_keys(self, prefix: str) -> list[str]:
        return self.inner.list_keys(prefix)

    def delete(self, key: str) -> None:
        self.calls.append(("delete", key))
        self.inner.delete(key)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def describe(self) -> str:
        return "recording " + self.inner.describe()


def _meta(record: records.ZooRecord) -> dict[str, Any]:
    return dict(json.loads(dataclasses.replace(record, weights_sha256="ab" * 32).to_json()))


# ----------------------------------------------------------------------------------------------
# meta.json


def test_meta_json_round_trips_every_field() -> None:
    record = _record(weights_sha256="0f" * 32, parent="resnet-12345678", similarity=0.7)
    assert records.ZooRecord.from_json(record.to_json()) == record


def test_meta_json_carries_the_oldest_schema_version_that_reads_it() -> None:
    assert json.loads(_record().to_json())["schema_version"] == 3  # private: older Kiln refuses
    shared = _record(share=api.ZooShare.SHARED)
    assert json.loads(shared.to_json())["schema_version"] == 1
    entrypoint = dataclasses.replace(shared, architecture=None,
                                     entrypoint="mynets.mixer:build_mixer")
    assert json.loads(entrypoint.to_json())["schema_version"] == 2


def test_an_entrypoint_record_with_provenance_round_trips() -> None:
    record = _record(architecture=None, entrypoint="hf.models:gpt2_lm", weights_sha256="0f" * 32,
                     source="/data/gpt2/model.safetensors", license="MIT", job_spec={})
    assert records.ZooRecord.from_json(record.to_json()) == record
    assert record.builder == "hf.models:gpt2_lm"


def test_a_version_1_record_without_the_new_fields_still_loads() -> None:
    doc = _meta(_record())
    for name in ("entrypoint", "source", "license"):
        del doc[name]
    doc["schema_version"] = 1
    loaded = records.ZooRecord.from_json(json.dumps(doc))
    assert loaded.architecture == "small_resnet" and loaded.builder == "small_resnet"
    assert (loaded.entrypoint, loaded.source, loaded.license) == (None, None, None)


# meta.json exactly as Kiln wrote it before records were validated by pydantic and had tenancy.
_OLD_META = """{
  "schema_version": 1,
  "id": "small_resnet-1234abcd",
  "architecture": "small_resnet",
  "args": {"num_classes": 10},
  "input_shape": [1, 8, 8],
  "modality": "image",
  "task": "classification",
  "dataset": "digits",
  "metric_name": "validation_accuracy",
  "metric_value": 0.9,
  "validation_accuracy": 0.9,
  "validation_loss": 0.3,
  "samples_per_second": null,
  "num_params": 1000,
  "parent": null,
  "similarity": null,
  "created_time": "2024-05-01T12:00:00Z",
  "weights_sha256": "%s",
  "job_name": "digits",
  "job_spec": {"spec": {}}
}
""" % ("ab" * 32)


def test_an_old_format_meta_json_reads_as_a_shared_record_of_the_default_namespace() -> None:
    old = records.ZooRecord.from_json(_OLD_META)
    assert (old.id, old.input_shape, old.metric_value) == ("small_resnet-1234abcd", (1, 8, 8), 0.9)
    assert (old.namespace, old.share) == ("default", api.ZooShare.SHARED)
    assert old.visible_to("team-a") and old.visible_to("default")
    assert (old.dataset_fingerprint, old.kiln_version, old.entrypoint) == (None, None, None)
    assert old.content_fingerprint is None and old.data_fingerprint is None


@pytest.mark.parametrize(("dataset", "content", "data"), [
    pytest.param("spec-0123456789abcdef", None, "spec:0123456789abcdef", id="spec-hash"),
    pytest.param("digits-v2", None, "user:digits-v2", id="users-own"),
    pytest.param("spec-0123456789abcdef", "content:sha256:" + "ab" * 32,
                 "content:sha256:" + "ab" * 32, id="content"),
])
def test_a_record_says_what_its_model_was_trained_on_with_the_kind(
        dataset: str, content: str | None, data: str) -> None:
    # Records from before content fingerprints hold only the spec's: they read with its kind.
    meta = json.loads(_OLD_META) | {"dataset_fingerprint": dataset, "content_fingerprint": content}
    record = records.ZooRecord.from_json(json.dumps(meta))
    assert record.data_fingerprint == data
    again = records.ZooRecord.from_json(record.to_json())
    assert (again.dataset_fingerprint, again.content_fingerprint) == (dataset, content)


def test_a_content_fingerprint_without_its_kind_is_refused() -> None:
    meta = json.loads(_OLD_META) | {"content_fingerprint": "ab" * 32}
    with pytest.raises(records.CorruptRecord, match="'content_fingerprint': expected "
                       "content:sha256:, sample:sha256: and 64 hex digits"):
        records.ZooRecord.from_json(json.dumps(meta))


def test_a_private_record_is_visible_to_its_own_namespace_only() -> None:
    record = _record(namespace="team-a")
    assert record.share is api.ZooShare.PRIVATE
    assert record.visible_to("team-a") and not record.visible_to("team-b")
    shared = dataclasses.replace(record, share=api.ZooShare.SHARED)
    assert shared.visible_to("team-b")
    again = records.ZooRecord.from_json(json.dumps(_meta(shared)))
    assert (again.namespace, again.share) == ("team-a", api.ZooShare.SHARED)


def test_the_committed_json_schema_is_current() -> None:
    committed = json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))
    assert committed == records.json_schema(), (
        f"{SCHEMA_FILE} is stale: run `kiln crd --write` in the repository root to regenerate it")


def test_kiln_crd_writes_the_json_schema(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "docs" / "reference").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["crd", "--write"]) == 0
    written = tmp_path / "docs" / "reference" / "zoo-record.schema.json"
    assert json.loads(written.read_text(encoding="utf-8")) == records.json_schema()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        pytest.param({"architecture": None}, "neither 'architecture' nor 'entrypoint'",
                     id="neither"),
        pytest.param({"entrypoint": "mynets:build"}, "both 'architecture' ('small_resnet') and "
                     "'entrypoint' ('mynets:build') are set", id="both"),
    ],
)
def test_a_record_needs_exactly_one_of_architecture_and_entrypoint(
    change: dict[str, Any], message: str
) -> None:
    doc = _meta(_record()) | change
    with pytest.raises(records.CorruptRecord) as caught:
        records.ZooRecord.from_json(json.dumps(doc), record_id="small_resnet-0badc0de")
    assert str(caught.value).startswith("zoo record small_resnet-0badc0de: meta.json: ")
    assert message in str(caught.value) and caught.value.field == "entrypoint"
    with pytest.raises(ValueError, match=re.escape(message)):
        _record(**change)


def test_an_entrypoint_record_can_be_written_and_read_back(tmp_path: Path) -> None:
    zoo = store.DirStore(tmp_path)
    record = _record("gpt2_lm-0000abcd", architecture=None, entrypoint="hf.models:gpt2_lm",
                     source="weights.safetensors", license="Apache-2.0")
    records.write_record(zoo, record, _weights(), {"nodes": []})
    assert records.verify_record(zoo, "gpt2_lm-0000abcd").entrypoint == "hf.models:gpt2_lm"
    assert [r.id for r in records.list_records(zoo)] == ["gpt2_lm-0000abcd"]


def test_new_ids_for_an_entrypoint_use_the_callable_name() -> None:
    assert re.fullmatch(r"build_mixer-[0-9a-f]{8}", records.new_id("mynets.mixer:build_mixer"))


def test_the_exported_json_schema_describes_every_record_field() -> None:
    fields = [f.name for f in dataclasses.fields(records.ZooRecord)]
    schema = records.json_schema()
    assert list(schema["properties"]) == ["schema_version", *fields]
    jsonschema.validate(json.loads(_record(weights_sha256="0f" * 32).to_json()), schema)


def test_meta_json_ignores_fields_it_does_not_know() -> None:
    doc = _meta(_record()) | {"added_later": [1, 2]}
    assert records.ZooRecord.from_json(json.dumps(doc)).id == "small_resnet-0badc0de"


@pytest.mark.parametrize(
    ("change", "field", "message"),
    [
        pytest.param({"num_params": "12"}, "num_params", "should be a valid integer; got "
                     "str ('12')", id="string-count"),
        pytest.param({"num_params": True}, "num_params", "got bool", id="bool-count"),
        pytest.param({"metric_value": None}, "metric_value", "should be a valid number; got NoneType",
                     id="null-metric"),
        pytest.param({"input_shape": []}, "input_shape", "at least 1 item", id="empty-shape"),
        pytest.param({"input_shape": [1, 0, 8]}, "input_shape", "[1]: Input should be greater than or equal to 1", id="zero-dim"),
        pytest.param({"args": [1]}, "args", "should be an object", id="args-list"),
        pytest.param({"created_time": "yesterday"}, "created_time", "RFC 3339", id="time"),
        pytest.param({"weights_sha256": "xyz"}, "weights_sha256", "SHA-256", id="sha"),
        pytest.param({"parent": "../etc"}, "parent", "zoo model id", id="parent-id"),
        pytest.param({"job_spec": "{}"}, "job_spec", "should be an object", id="spec-string"),
        pytest.param({"metric_value": float("nan")}, "metric_value", "should be a finite number",
                     id="nan-metric"),
        pytest.param({"validation_loss": float("inf")}, "validation_loss",
                     "should be a finite number", id="infinite-loss"),
        pytest.param({"num_params": 10**40}, "num_params", "less than or equal to 10000000000000",
                     id="absurd-count"),
        pytest.param({"architecture": None, "entrypoint": "not an entrypoint"}, "entrypoint",
                     "expected an entrypoint such as mypackage.models:build_net", id="entrypoint"),
        pytest.param({"license": 3}, "license", "should be a valid string", id="license"),
        pytest.param({"namespace": "Team_A"}, "namespace", "expected a Kubernetes namespace",
                     id="namespace"),
        pytest.param({"share": "everyone"}, "share", "'private' or 'shared'", id="share"),
    ],
)
def test_meta_json_field_of_the_wrong_type_names_record_and_field(
    change: dict[str, Any], field: str, message: str
) -> None:
    doc = _meta(_record()) | change
    with pytest.raises(records.CorruptRecord) as caught:
        records.ZooRecord.from_json(json.dumps(doc), record_id="small_resnet-0badc0de")
    assert caught.value.field == field
    assert caught.value.record_id == "small_resnet-0badc0de"
    text = str(caught.value)
    assert text.startswith(f"zoo record small_resnet-0badc0de: meta.json field {field!r}")
    assert message in text


def test_meta_json_missing_a_field_names_it() -> None:
    doc = _meta(_record())
    del doc["dataset"]
    with pytest.raises(records.CorruptRecord, match="field 'dataset' is missing"):
        records.ZooRecord.from_json(json.dumps(doc), record_id="x-1")


def test_meta_json_from_a_newer_kiln_asks_for_an_upgrade() -> None:
    doc = _meta(_record()) | {"schema_version": records.SCHEMA_VERSION + 1}
    with pytest.raises(records.CorruptRecord, match="upgrade Kiln"):
        records.ZooRecord.from_json(json.dumps(doc))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param("{not json", "not valid JSON", id="syntax"),
        pytest.param(b"\xff\xfe", "not valid JSON", id="binary"),
        pytest.param("[1, 2]", "holds list, not an object", id="list"),
        pytest.param("{}", "schema_version", id="no-version"),
        pytest.param("[" * 100_000 + "]" * 100_000, "nested too deeply", id="deep-nesting"),
        pytest.param('{"num_params": 1' + "0" * 5000 + "}", "not usable JSON", id="huge-integer"),
    ],
)
def test_unparsable_meta_json_is_a_corrupt_record(text: str | bytes, message: str) -> None:
    with pytest.raises(records.CorruptRecord, match=message):
        records.ZooRecord.from_json(text, record_id="x-1")


# ----------------------------------------------------------------------------------------------
# ids and keys


def test_new_ids_are_the_architecture_and_eight_hex_digits() -> None:
    ids = {records.new_id("small_resnet") for _ in range(50)}
    assert len(ids) == 50
    assert all(re.fullmatch(r"small_resnet-[0-9a-f]{8}", i) for i in ids)


def test_new_ids_turn_odd_architecture_names_into_safe_ones() -> None:
    made = records.new_id("ViT/B 16")
    assert re.fullmatch(r"vit_b_16-[0-9a-f]{8}", made)
    assert records.check_id(made) == made


@pytest.mark.parametrize("bad", ["", "../x", "a/b", ".hidden", "x" * 129])
def test_ids_that_cannot_name_a_folder_are_rejected(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid zoo model id"):
        records.check_id(bad)


def test_checkpoints_live_under_namespace_job_and_the_jobs_uid() -> None:
    key = records.checkpoint_key("team-a", "digits-resnet", "5f0c2b1e-aaaa")
    assert key == "checkpoints/team-a/digits-resnet/5f0c2b1e-aaaa/checkpoint.pt"
    # a job created again under its name is a new job: another uid, another checkpoint
    assert records.checkpoint_key("team-a", "digits-resnet", "0d9e8f7a-bbbb") != key
    # a job of `kiln run` has no uid: a rerun of the same file finds its checkpoint
    assert records.checkpoint_key("team-a", "digits-resnet", None) == (
        "checkpoints/team-a/digits-resnet/checkpoint.pt")
    with pytest.raises(ValueError):
        records.checkpoint_key("team-a", "../x", None)
    with pytest.raises(ValueError, match="uid"):
        records.checkpoint_key("team-a", "digits-resnet", "a/b")


# ----------------------------------------------------------------------------------------------
# writing and deleting


def test_writing_puts_weights_then_graph_then_meta_json_last(tmp_path: Path) -> None:
    zoo = RecordingStore(tmp_path)
    records.write_record(zoo, _record(), _weights(), {"nodes": []})
    prefix = "models/small_resnet-0badc0de/"
    assert zoo.calls == [
        ("put", prefix + "weights.safetensors"),
        ("put", prefix + "graph.json"),
        ("put", prefix + "meta.json"),
    ]


def test_a_history_is_written_before_meta_json_and_read_back_in_step_order(
        tmp_path: Path) -> None:
    zoo = RecordingStore(tmp_path)
    history = [{"step": 20, "validation_accuracy": 0.75}, {"step": 10, "validation_accuracy": 0.5}]
    written = records.write_record(zoo, _record(), _weights(), {"nodes": []}, history=history)
    prefix = "models/small_resnet-0badc0de/"
    assert [key for _, key in zoo.calls][-2:] == [prefix + "history.jsonl", prefix + "meta.json"]
    zoo.inner.put_bytes(prefix + "history.jsonl", zoo.get_bytes(prefix + "history.jsonl")
                        + b'{"step": 30, "valid')  # a torn line is skipped
    assert records.read_history(zoo, written) == sorted(history, key=lambda h: h["step"])
    records.delete_record(zoo, written.id)
    assert zoo.list_keys("") == []  # the history goes with the record
    without = records.write_record(zoo, _record(), _weights(), {})
    with pytest.raises(store.ObjectNotFound):
        records.read_history(zoo, without)


def test_writing_fills_in_the_weights_checksum(tmp_path: Path) -> None:
    zoo = store.DirStore(tmp_path)
    written = records.write_record(zoo, _record(), _weights(), {})
    assert re.fullmatch(r"[0-9a-f]{64}", written.weights_sha256)
    assert records.read_record(zoo, "small_resnet-0badc0de") == written


def test_writing_refuses_a_checksum_that_does_not_match_the_weights(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not match"):
        records.write_record(
            store.DirStore(tmp_path), _record(weights_sha256="00" * 32), _weights(), {}
        )


def test_writing_never_overwrites_an_existing_record(tmp_path: Path) -> None:
    zoo = store.DirStore(tmp_path)
    records.write_record(zoo, _record(), _weights(), {})
    with pytest.raises(ValueError, match="already exists"):
        records.write_record(zoo, _record(), _weights(), {})


def test_a_record_with_a_bad_field_cannot_even_be_made() -> None:
    with pytest.raises(ValueError, match="created_time\n.*RFC 3339"):
        _record(created_time="last tuesday")


def test_writing_refuses_a_graph_that_is_not_json(tmp_path: Path) -> None:
    zoo = store.DirStore(tmp_path)
    with pytest.raises(ValueError, match="graph is not JSON-serializable"):
        records.write_record(zoo, _record(), _weights(), {"nodes": {1, 2}})
    assert zoo.list_keys("") == []


def test_tied_and_non_contiguous_weights_are_stored_as_separate_tensors(tmp_path: Path) -> None:
    zoo = store.DirStore(tmp_path)
    embedding = torch.randn(5, 3)
    weights = {"embed.weight": embedding, "head.weight": embedding, "t": embedding.t()}
    written = records.write_record(zoo, _record(), weights, {})
    loaded = records.load_weights(zoo, written)
    assert torch.equal(loaded["embed.weight"], embedding)
    assert torch.equal(loaded["head.weight"], embedding)
    assert torch.equal(loaded["t"], embedding.t())


def test_weights_keep_their_dtypes(tmp_path: Path) -> None:
    zoo = store.DirStore(tmp_path)
    weights = {"w": torch.ones(2, dtype=torch.float16), "n": torch.tensor(7, dtype=torch.int64)}
    loaded = records.load_weights(zoo, records.write_record(zoo, _record(), weights, {}))
    assert loaded["w"].dtype == torch.float16
    assert loaded["n"].item() == 7


def test_deleting_removes_meta_json_first(tmp_path: Path) -> None:
    zoo = RecordingStore(tmp_path)
    records.write_record(zoo, _record(), _weights(), {})
    zoo.calls.clear()
    records.delete_record(zoo, "small_resnet-0badc0de")
    assert zoo.calls[0] == ("delete", "models/small_resnet-0badc0de/meta.json")
    assert zoo.list_keys("") == []


def test_deleting_a_missing_record_is_not_an_error(tmp_path: Path) -> None:
    records.delete_record(store.DirStore(tmp_path), "none-12345678")


def test_reading_a_record_whose_meta_json_names_another_id_fails(tmp_path: Path) -> None:
    zoo = store.DirStore(tmp_path)
    written = records.write_record(zoo, _record(), _weights(), {})
    zoo.put_bytes("models/copy-11111111/meta.json", written.to_json().encode())
    with pytest.raises(records.CorruptRecord, match="says id 'small_resnet-0badc0de'"):
        records.read_record(zoo, "copy-11111111")


def test_a_record_naming_another_job_than_its_ids_claim_is_refused_everywhere(
        tmp_path: Path) -> None:
    # The operator reserved two ids: one for team-a/forger, whose pod wrote a record there
    # naming team-b's job (private to team-b), and one for team-a/honest.
    zoo = store.DirStore(tmp_path)
    records.write_claim(zoo, "small_resnet-0badc0de", "team-a", "forger")
    records.write_claim(zoo, "small_resnet-600dc0de", "team-a", "honest")
    records.write_record(zoo, _record(namespace="team-b", job_name="victim",
                                      share=api.ZooShare.PRIVATE), _weights(), {})
    records.write_record(zoo, _record("small_resnet-600dc0de", namespace="team-a",
                                      job_name="honest"), _weights(), {})
    records.write_record(zoo, _record("small_resnet-00000000"), _weights(), {})  # no claim
    with pytest.raises(records.CorruptRecord, match="reserved this id for team-a/forger") as e:
        records.read_record(zoo, "small_resnet-0badc0de")
    assert e.value.field == "namespace" and "kiln zoo rm small_resnet-0badc0de" in str(e.value)
    with pytest.warns(records.SkippedRecordWarning, match="small_resnet-0badc0de .* skipped"):
        listed = records.list_records(zoo)
    assert [r.id for r in listed] == ["small_resnet-00000000", "small_resnet-600dc0de"]
    assert not any(r.visible_to("team-b") and r.namespace == "team-b" for r in listed)


def test_reading_a_missing_record_is_object_not_found(tmp_path: Path) -> None:
    with pytest.raises(store.ObjectNotFound, match="models/none-12345678/meta.json"):
        records.read_record(store.DirStore(tmp_path), "none-12345678")


def test_a_graph_that_is_not_an_object_is_corrupt(tmp_path: Path) -> None:
    zoo = store.DirStore(tmp_path)
    written = records.write_record(zoo, _record(), _weights(), {})
    zoo.put_bytes("models/small_resnet-0badc0de/graph.json", b"[1]")
    with pytest.raises(records.CorruptRecord, match="graph.json holds list"):
        records.load_graph(zoo, written)


def test_weights_with_a_good_checksum_but_bad_format_are_corrupt(tmp_path: Path) -> None:
    zoo = store.DirStore(tmp_path)
    written = records.write_record(zoo, _record(), _weights(), {})
    garbage = b"not safetensors at all"
    zoo.put_bytes("models/small_resnet-0badc0de/weights.safetensors", garbage)
    forged = dataclasses.replace(written, weights_sha256=hashlib.sha256(garbage).hexdigest())
    with pytest.raises(records.CorruptRecord, match="not valid safetensors"):
        records.load_weights(zoo, forged)


def test_listing_skips_folders_whose_names_are_not_ids(tmp_path: Path) -> None:
    zoo = store.DirStore(tmp_path)
    records.write_record(zoo, _record(), _weights(), {})
    for name in ("meta.json", "weights.safetensors", "graph.json"):
        zoo.put_bytes(f"models/-bad/{name}", b"{}")
    with pytest.warns(records.SkippedRecordWarning,
                      match="zoo record -bad .* skipped: its folder name is no record id .*"
                            "delete models/-bad/ from the store itself"):
        listed = records.list_records(zoo)
    assert [r.id for r in listed] == ["small_resnet-0badc0de"]


def test_listing_skips_a_record_whose_meta_json_or_graph_is_nested_too_deeply(
    tmp_path: Path,
) -> None:
    zoo = store.DirStore(tmp_path)
    records.write_record(zoo, _record(), _weights(), {})
    deep = ("[" * 100_000 + "]" * 100_000).encode()
    for name in ("weights.safetensors", "graph.json"):
        zoo.put_bytes(f"models/deep-1/{name}", b"{}")
    zoo.put_bytes("models/deep-1/meta.json", deep)
    with pytest.warns(records.SkippedRecordWarning, match="deep-1 .* nested too deeply"):
        listed = records.list_records(zoo)
    assert [r.id for r in listed] == ["small_resnet-0badc0de"]
    zoo.put_bytes("models/small_resnet-0badc0de/graph.json", deep)
    with pytest.raises(records.CorruptRecord, match="graph.json is nested too deeply"):
        records.load_graph(zoo, listed[0])


def test_the_dataset_fingerprint_names_the_uri_and_keeps_older_specs_fingerprints() -> None:
    def spec(**fields: Any) -> api.DatasetSpec:
        return api.DatasetSpec.model_validate({"name": "text", **fields})

    assert records.dataset_fingerprint(spec(path="/data/books")) == "spec-8b64de85c929a738"
    assert records.dataset_fingerprint(spec(uri="s3://corpora/books")) != \
        records.dataset_fingerprint(spec(uri="s3://corpora/news"))


class _FullDisk(RecordingStore):
    """A DirStore whose disk fills up at the `fail_at`-th write."""

    def __init__(self, root: Path, fail_at: str) -> None:
        super().__init__(root)
        self.fail_at = fail_at

    def put_bytes(self, key: str, data: bytes) -> None:
        if key.endswith(self.fail_at):
            raise store.StoreUnavailable(f"cannot write {key!r}: No space left on device")
        super().put_bytes(key, data)


@pytest.mark.parametrize("fail_at", ["graph.json", "history.jsonl", "meta.json"])
def test_a_write_that_fails_midway_leaves_no_half_written_record_behind(
        tmp_path: Path, fail_at: str) -> None:
    zoo = _FullDisk(tmp_path, fail_at)
    with pytest.raises(store.StoreUnavailable, match="No space left"):
        records.write_record(zoo, _record(), _weights(), {"nodes": []}, history=[{"step": 1}])
    assert zoo.list_keys("") == []  # not a skipped, unreadable record in every later listing
    zoo.fail_at = "never"
    rec = records.write_record(zoo, _record(), _weights(), {"nodes": []}, history=[])
    assert records.read_history(zoo, rec) == []  # an empty history is still written
    assert [r.id for r in records.list_records(zoo)] == ["small_resnet-0badc0de"]


def test_an_id_claimed_for_one_job_is_never_claimed_for_another(tmp_path: Path) -> None:
    # Two job uids alike in the 8 hex digits an id takes: the second job gets no claim.
    zoo = store.DirStore(tmp_path)
    records.write_claim(zoo, "small_cnn-1f2e3d4c", "team-a", "first")
    records.write_claim(zoo, "small_cnn-1f2e3d4c", "team-a", "first")  # its own again: fine
    with pytest.raises(records.IdTaken, match="reserved for team-a/first already; delete job "
                                              "team-b/second and create it again"):
        records.write_claim(zoo, "small_cnn-1f2e3d4c", "team-b", "second")
    assert records.claims_of(zoo, "small_cnn-1f2e3d4c") == {("team-a", "first")}

"""kiln.zoo against both stores: a DirStore in tmp_path and an S3Store on a real S3 server.

The S3 server is moto's, started as a subprocess by the `s3_server` fixture (tests/conftest.py);
the `minio` SDK talks to it over HTTP. Every test gets a fresh directory or bucket.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln.zoo import records, store


@pytest.fixture(params=["dir", "s3", "s3-prefix"])
def zoo(request: pytest.FixtureRequest, tmp_path: Path) -> store.ObjectStore:
    """The store under test: a directory, a bucket, or a prefix inside a bucket."""
    if request.param == "dir":
        return store.DirStore(tmp_path / "zoo")
    server = request.getfixturevalue("s3_server")
    bucket = request.getfixturevalue("s3_bucket")
    return store.S3Store(
        server.endpoint, bucket, access_key=server.access_key, secret_key=server.secret_key,
        prefix="team-a/zoo" if request.param == "s3-prefix" else "",
        retry=store.RetryPolicy(attempts=3, first_backoff_seconds=0.2),
    )


def _record(record_id: str, **changes: Any) -> records.ZooRecord:
    record = records.ZooRecord(
        id=records.ZooModelId(record_id),
        architecture="small_resnet",
        args={"num_classes": 10},
        input_shape=(1, 8, 8),
        modality="image",
        task="classification",
        dataset="digits",
        metric_name="validation_accuracy",
        metric_value=0.9,
        validation_accuracy=0.9,
        validation_loss=0.3,
        samples_per_second=800.0,
        num_params=1234,
        created_time="2024-05-01T12:00:00+00:00",
        job_name="digits-resnet",
        job_spec={"kind": "TrainingJob"},
    )
    return dataclasses.replace(record, **changes)


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "stem.weight": torch.randn(4, 1, 3, 3, generator=generator),
        "bn.num_batches_tracked": torch.tensor(5),
        "head.bias": torch.randn(10, generator=generator),
    }


def _graph() -> dict[str, Any]:
    return {"nodes": [{"name": "stem", "op": "Conv2d"}], "edges": []}


def _assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


# ----------------------------------------------------------------------------------------------
# objects


def test_objects_round_trip(zoo: store.ObjectStore) -> None:
    zoo.put_bytes("models/a/weights.safetensors", b"\x00\x01binary\xff")
    zoo.put_bytes("top.json", b"{}")
    assert zoo.get_bytes("models/a/weights.safetensors") == b"\x00\x01binary\xff"
    assert zoo.get_bytes("top.json") == b"{}"


def test_putting_again_replaces_the_object(zoo: store.ObjectStore) -> None:
    zoo.put_bytes("k", b"first")
    zoo.put_bytes("k", b"second, longer")
    assert zoo.get_bytes("k") == b"second, longer"


def test_objects_larger_than_one_upload_part_round_trip(zoo: store.ObjectStore) -> None:
    data = os.urandom(12 * 1024 * 1024)  # minio's SDK switches to multipart above 5 MiB
    zoo.put_bytes("models/big/weights.safetensors", data)
    assert zoo.get_bytes("models/big/weights.safetensors") == data
    assert zoo.list_keys("models/big/") == ["models/big/weights.safetensors"]


def test_empty_objects_are_objects(zoo: store.ObjectStore) -> None:
    zoo.put_bytes("empty", b"")
    assert zoo.exists("empty")
    assert zoo.get_bytes("empty") == b""


def test_listing_matches_a_plain_string_prefix_sorted(zoo: store.ObjectStore) -> None:
    for key in ("models/b/meta.json", "models/a/meta.json", "models/ab/graph.json",
                "checkpoints/ns/job/checkpoint.pt", "modelsx"):
        zoo.put_bytes(key, b"x")
    assert zoo.list_keys("models/") == [
        "models/a/meta.json", "models/ab/graph.json", "models/b/meta.json"
    ]
    assert zoo.list_keys("models/a") == ["models/a/meta.json", "models/ab/graph.json"]
    assert zoo.list_keys("models") == [
        "models/a/meta.json", "models/ab/graph.json", "models/b/meta.json", "modelsx"
    ]
    assert len(zoo.list_keys("")) == 5
    assert zoo.list_keys("nothing/") == []


def test_exists_and_delete(zoo: store.ObjectStore) -> None:
    zoo.put_bytes("models/a/meta.json", b"{}")
    assert zoo.exists("models/a/meta.json")
    assert not zoo.exists("models/a/graph.json")
    zoo.delete("models/a/meta.json")
    assert not zoo.exists("models/a/meta.json")
    assert zoo.list_keys("") == []
    zoo.delete("models/a/meta.json")  # deleting again is fine


def test_a_missing_object_is_object_not_found_naming_the_key(zoo: store.ObjectStore) -> None:
    with pytest.raises(store.ObjectNotFound) as caught:
        zoo.get_bytes("models/none/meta.json")
    assert caught.value.key == "models/none/meta.json"
    assert zoo.describe() in str(caught.value)


@pytest.mark.parametrize("key", ["../escape", "/abs", "a//b", "a/../b"])
def test_unsafe_keys_are_rejected(zoo: store.ObjectStore, key: str) -> None:
    with pytest.raises(ValueError, match="key"):
        zoo.put_bytes(key, b"x")


# ----------------------------------------------------------------------------------------------
# records


def test_records_are_written_read_and_listed(zoo: store.ObjectStore) -> None:
    first = records.write_record(zoo, _record("small_resnet-00000001"), _weights(1), _graph())
    second = records.write_record(
        zoo, _record("small_resnet-00000002", parent=first.id, similarity=0.8), _weights(2), {}
    )
    assert records.read_record(zoo, first.id) == first
    assert records.list_records(zoo) == [first, second]
    _assert_same_weights(records.load_weights(zoo, first), _weights(1))
    assert records.load_graph(zoo, first) == _graph()
    assert records.verify_record(zoo, second.id) == second


def test_a_record_without_meta_json_is_skipped_with_a_warning(zoo: store.ObjectStore) -> None:
    kept = records.write_record(zoo, _record("small_resnet-00000001"), _weights(), _graph())
    half = "small_resnet-0000000f"
    zoo.put_bytes(f"models/{half}/weights.safetensors", b"partial")
    with pytest.warns(records.SkippedRecordWarning, match=f"{half} .*no meta.json") as caught:
        assert records.list_records(zoo) == [kept]
    assert len(caught) == 1


def test_unparsable_meta_json_is_skipped_with_a_warning(zoo: store.ObjectStore) -> None:
    bad = records.write_record(zoo, _record("small_resnet-00000001"), _weights(), _graph())
    zoo.put_bytes(f"models/{bad.id}/meta.json", b'{"schema_version": 1, "id": ')
    with pytest.warns(records.SkippedRecordWarning, match=f"{bad.id} .*not valid JSON"):
        assert records.list_records(zoo) == []
    with pytest.raises(records.CorruptRecord, match=bad.id):
        records.read_record(zoo, bad.id)


def test_a_record_without_weights_is_skipped_with_a_warning(zoo: store.ObjectStore) -> None:
    broken = records.write_record(zoo, _record("small_resnet-00000001"), _weights(), _graph())
    zoo.delete(f"models/{broken.id}/weights.safetensors")
    with pytest.warns(records.SkippedRecordWarning, match=f"{broken.id} .*weights.safetensors"):
        assert records.list_records(zoo) == []
    with pytest.raises(records.CorruptRecord, match="weights.safetensors is missing"):
        records.load_weights(zoo, broken)


def test_corrupted_weights_fail_their_checksum(zoo: store.ObjectStore) -> None:
    record = records.write_record(zoo, _record("small_resnet-00000001"), _weights(), _graph())
    key = f"models/{record.id}/weights.safetensors"
    data = bytearray(zoo.get_bytes(key))
    data[-1] ^= 0xFF  # one flipped bit in the last tensor
    zoo.put_bytes(key, bytes(data))
    assert records.list_records(zoo) == [record]  # checksums are checked lazily
    with pytest.raises(records.CorruptRecord, match=f"zoo record {record.id}: .*sha256") as caught:
        records.load_weights(zoo, record)
    assert caught.value.field == "weights_sha256"
    with pytest.raises(records.CorruptRecord, match=record.id):
        records.verify_record(zoo, record.id)


def test_a_deleted_record_is_gone(zoo: store.ObjectStore) -> None:
    gone = records.write_record(zoo, _record("small_resnet-00000001"), _weights(), _graph())
    kept = records.write_record(zoo, _record("small_resnet-00000002"), _weights(), _graph())
    records.delete_record(zoo, gone.id)
    assert records.list_records(zoo) == [kept]
    assert zoo.list_keys(f"models/{gone.id}/") == []
    with pytest.raises(store.ObjectNotFound):
        records.read_record(zoo, gone.id)


# ----------------------------------------------------------------------------------------------
# S3 only


def test_an_s3_uri_opens_the_bucket_with_environment_credentials(
    s3_server: Any, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KILN_ZOO_ENDPOINT", f"http://{s3_server.endpoint}")
    monkeypatch.setenv("KILN_ZOO_ACCESS_KEY", s3_server.access_key)
    monkeypatch.setenv("KILN_ZOO_SECRET_KEY", s3_server.secret_key)
    opened = store.open_store(f"s3://{s3_bucket}/zoo")
    opened.put_bytes("models/x/meta.json", b"{}")
    direct = store.S3Store(
        s3_server.endpoint, s3_bucket, access_key=s3_server.access_key,
        secret_key=s3_server.secret_key,
    )
    assert direct.list_keys("") == ["zoo/models/x/meta.json"]


def test_a_second_s3_store_uses_the_bucket_the_first_created(s3_server: Any, s3_bucket: str) -> None:
    def open_one() -> store.S3Store:
        return store.S3Store(
            s3_server.endpoint, s3_bucket, access_key=s3_server.access_key,
            secret_key=s3_server.secret_key, region="us-east-1",
        )

    first, second = open_one(), open_one()
    assert first.list_keys("") == [] and second.list_keys("") == []
    first.put_bytes("k", b"v")
    assert second.get_bytes("k") == b"v"

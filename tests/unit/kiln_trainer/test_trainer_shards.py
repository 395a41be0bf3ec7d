"""Sharded checkpoints in one process: Kiln's DCP storage over a DirStore and over S3, damaged
objects, the alternating slots and a save that crashed half-way."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import parallel_harness as harness  # tests/ is on sys.path (pytest pythonpath)
import pytest
import safetensors.torch
import torch

from kiln.zoo import presigned, records, store
from kiln_trainer import checkpoint, tracking
from kiln_trainer.distributed import parallel

KEY = "ns/job/checkpoint.pt"


def _trained(steps: int) -> tuple[torch.nn.Module, harness.Training]:
    torch.set_num_threads(1)
    job = harness.make_job()
    model = harness.build_model(job)
    run = harness.start_training(job, model.parameters())
    harness.train(parallel.Context(), job, model, run, until_step=steps)
    return model, run


def _save(where: checkpoint.Location, model: torch.nn.Module, run: harness.Training,
          previous: dict[str, Any] | None = None, *, main: bool = True) -> dict[str, Any]:
    """One sharded save as `JobContext.checkpoint` makes it: shards, main object, old slot."""
    state = checkpoint.capture(run.state, tracking.Clock(), harness.make_job(), model,
                               run.optimizer, run.scheduler, sharded=True, previous=previous)
    checkpoint.save_shards(where, state, model, run.optimizer)
    if main:
        checkpoint.save_checkpoint(where, state)
        checkpoint.drop_previous_shards(where, previous, state)
    return state


def _resumed(where: checkpoint.Location) -> tuple[torch.nn.Module, harness.Training]:
    saved = checkpoint.load_checkpoint(where)
    assert saved is not None
    job = harness.make_job()
    model = harness.build_model(job)
    run = harness.start_training(job, model.parameters())
    run.state = checkpoint.restore(saved, job, model, run.optimizer, run.scheduler,
                                   location=where)
    return model, run


def _assert_same(a: torch.nn.Module, run_a: harness.Training, b: torch.nn.Module,
                 run_b: harness.Training) -> None:
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                 b.state_dict().values(), strict=True))
    moments_a, moments_b = run_a.optimizer.state_dict(), run_b.optimizer.state_dict()
    for index, values in moments_a["state"].items():
        assert all(torch.equal(values[k], moments_b["state"][index][k]) for k in values)
    assert ((run_a.state.step, run_a.state.epoch_batch)
            == (run_b.state.step, run_b.state.epoch_batch))


def _round_trip(zoo: store.ObjectStore) -> None:
    model, run = _trained(3)
    where = checkpoint.Location(zoo, KEY)
    state = _save(where, model, run)
    assert state[checkpoint.SHARDS_KEY]["slot"] == "a" and checkpoint.MODEL_KEY not in state
    shard = zoo.get_bytes(records.checkpoint_shard_key(KEY, "a", 0))
    tensors = safetensors.torch.load(shard)  # plain safetensors, no pickle for the tensors
    assert tensors and all(t.dtype in (torch.float32, torch.int64, torch.uint8)
                           for t in tensors.values())
    metadata = json.loads(zoo.get_bytes(records.checkpoint_shard_key(KEY, "a", None)))
    assert metadata["tensors"]["model.head.2.weight"]["size"] == [10, 8]
    loaded = checkpoint.load_checkpoint(where)
    assert loaded is not None and loaded[checkpoint.FORMAT_KEY] == 2
    resumed, resumed_run = _resumed(where)
    _assert_same(model, run, resumed, resumed_run)
    # both go on identically: moments, step counters and the schedule came back
    harness.train(parallel.Context(), harness.make_job(), model, run, until_step=5)
    harness.train(parallel.Context(), harness.make_job(), resumed, resumed_run, until_step=5)
    _assert_same(model, run, resumed, resumed_run)
    checkpoint.delete_checkpoint(where)  # a finished job's: the main object and every shard
    assert zoo.list_keys("ns/") == []


def test_sharded_checkpoint_round_trips_through_kiln_storage_on_a_directory(
        tmp_path: Path) -> None:
    _round_trip(store.DirStore(tmp_path))


def test_sharded_checkpoint_round_trips_through_kiln_storage_on_s3(s3_server: Any,
                                                                   s3_bucket: str) -> None:
    _round_trip(store.S3Store(s3_server.endpoint, s3_bucket, access_key=s3_server.access_key,
                              secret_key=s3_server.secret_key, region="us-east-1"))


def test_a_damaged_or_missing_shard_or_metadata_is_an_error_naming_the_object(
        tmp_path: Path) -> None:
    model, run = _trained(1)
    zoo = store.DirStore(tmp_path)
    where = checkpoint.Location(zoo, KEY)
    _save(where, model, run)
    shard, meta = (records.checkpoint_shard_key(KEY, "a", rank) for rank in (0, None))
    good_shard, good_meta = zoo.get_bytes(shard), zoo.get_bytes(meta)
    for key, data in ((shard, good_shard[:100]), (shard, None), (meta, b"{not json"),
                      (meta, None)):
        if data is None:
            zoo.delete(key)
        else:
            zoo.put_bytes(key, data)
        with pytest.raises(checkpoint.CheckpointError) as failed:
            _resumed(where)
        assert key in str(failed.value) and "delete it to train from scratch" in str(failed.value)
        zoo.put_bytes(shard, good_shard)
        zoo.put_bytes(meta, good_meta)
    _resumed(where)  # restored objects load again


def test_slots_alternate_and_a_save_that_crashed_leaves_the_previous_checkpoint(
        tmp_path: Path) -> None:
    zoo = store.DirStore(tmp_path)
    where = checkpoint.Location(zoo, KEY)
    model, run = _trained(2)
    first = _save(where, model, run)
    harness.train(parallel.Context(), harness.make_job(), model, run, until_step=3)
    second = _save(where, model, run, first)
    assert [s[checkpoint.SHARDS_KEY]["slot"] for s in (first, second)] == ["a", "b"]
    assert not zoo.list_keys(f"{KEY}.shards/a/")  # the old slot went once b was current
    expected = _resumed(where)
    # the third save writes slot a, then dies before its main object: b stays current
    harness.train(parallel.Context(), harness.make_job(), model, run, until_step=4)
    third = _save(where, model, run, second, main=False)
    assert third[checkpoint.SHARDS_KEY]["slot"] == "a" and zoo.list_keys(f"{KEY}.shards/a/")
    resumed, resumed_run = _resumed(where)
    assert resumed_run.state.step == 3
    _assert_same(*expected, resumed, resumed_run)
    # objects of another save in the current slot are refused, not mixed in
    zoo.put_bytes(records.checkpoint_shard_key(KEY, "b", 0),
                  zoo.get_bytes(records.checkpoint_shard_key(KEY, "a", 0)))
    with pytest.raises(checkpoint.CheckpointError, match="a save was interrupted"):
        _resumed(where)


def test_delete_checkpoint_removes_the_main_object_and_both_slots(tmp_path: Path) -> None:
    zoo = store.DirStore(tmp_path)
    where = checkpoint.Location(zoo, KEY)
    model, run = _trained(1)
    first = _save(where, model, run)
    _save(where, model, run, first, main=False)  # an interrupted save's leftovers in slot b
    # a rank a larger world size left in slot b, and slot a's metadata naming absurd ranks:
    # every object is found by listing, none by counting (which would never end)
    zoo.put_bytes(records.checkpoint_shard_key(KEY, "b", 7), b"left by W=8")
    meta = records.checkpoint_shard_key(KEY, "a", None)
    zoo.put_bytes(meta, zoo.get_bytes(meta).replace(b', 0, "', b', 1000000000000, "'))
    assert len(zoo.list_keys("ns/")) == 6
    checkpoint.delete_checkpoint(where)
    assert zoo.list_keys("ns/") == []


def test_dropping_the_previous_slot_removes_what_a_larger_world_size_left(
        tmp_path: Path) -> None:
    zoo = store.DirStore(tmp_path)
    where = checkpoint.Location(zoo, KEY)
    model, run = _trained(1)
    first = _save(where, model, run)
    zoo.put_bytes(records.checkpoint_shard_key(KEY, "a", 2), b"left by W=3")
    _save(where, model, run, first)
    assert zoo.list_keys(f"{KEY}.shards/a/") == []


def _metadata_cases(good: dict[str, Any]) -> list[tuple[str, bytes]]:
    """Damaged metadata: each must be refused naming the object, none may load."""
    def changed(change: Any) -> bytes:
        data = json.loads(json.dumps(good))
        change(data)
        return json.dumps(data).encode()

    def chunks(data: dict[str, Any]) -> list[Any]:
        return data["tensors"]["model.head.2.weight"]["chunks"]  # type: ignore[no-any-return]

    return [
        ("a negative rank", changed(lambda d: [e.__setitem__(3, -1) for e in d["storage"]])),
        ("an infinite rank", changed(lambda d: d["storage"][0].__setitem__(3, float("inf")))),
        ("a fractional rank", changed(lambda d: d["storage"][0].__setitem__(3, 0.5))),
        ("a name not a string", changed(lambda d: d["storage"][0].__setitem__(4, 3))),
        # DCP itself would leave these tensors as they were: wrong weights, silently
        ("a tensor without chunks", changed(lambda d: chunks(d).clear())),
        ("a chunk outside its tensor", changed(lambda d: chunks(d)[0].__setitem__(0, [-1, 0]))),
        ("a chunk of other dimensions", changed(lambda d: chunks(d)[0].__setitem__(0, [0]))),
        ("a size beyond torch", changed(
            lambda d: d["tensors"]["model.head.2.weight"].__setitem__("size", [2**70, 8]))),
        ("a chunk stored nowhere", changed(lambda d: d.__setitem__("storage", d["storage"][1:]))),
        ("a list", b"[]"),
        ("nested too deep", b"[" * 100_000 + b"]" * 100_000),
    ]


def test_hostile_shard_metadata_is_refused_naming_the_object(tmp_path: Path) -> None:
    zoo = store.DirStore(tmp_path)
    where = checkpoint.Location(zoo, KEY)
    model, run = _trained(1)
    _save(where, model, run)
    meta = records.checkpoint_shard_key(KEY, "a", None)
    good = zoo.get_bytes(meta)
    for case, data in _metadata_cases(json.loads(good)):
        zoo.put_bytes(meta, data)
        with pytest.raises(checkpoint.CheckpointError) as failed:
            _resumed(where)
        assert f"{meta} in {zoo.describe()} is not shard metadata" in str(failed.value), case
    zoo.put_bytes(meta, good)
    _assert_same(model, run, *_resumed(where))


def test_a_shard_under_another_ranks_key_is_refused(tmp_path: Path) -> None:
    """Objects of one save moved between ranks carry the right save id, and often the right
    shapes: the rank each object was written by is checked too."""
    zoo = store.DirStore(tmp_path)
    where = checkpoint.Location(zoo, KEY)
    model, run = _trained(1)
    _save(where, model, run)
    meta = records.checkpoint_shard_key(KEY, "a", None)
    data = json.loads(zoo.get_bytes(meta))
    for entry in data["storage"]:
        entry[3] = 1  # as if rank 1 had written everything
    zoo.put_bytes(meta, json.dumps(data).encode())
    moved = records.checkpoint_shard_key(KEY, "a", 1)
    zoo.put_bytes(moved, zoo.get_bytes(records.checkpoint_shard_key(KEY, "a", 0)))
    with pytest.raises(checkpoint.CheckpointError, match="holds rank 0's shard, not rank 1's"):
        _resumed(where)


def test_a_main_object_naming_no_valid_slot_is_refused(tmp_path: Path) -> None:
    zoo = store.DirStore(tmp_path)
    where = checkpoint.Location(zoo, KEY)
    model, run = _trained(1)
    state = _save(where, model, run)
    for shards in ("a", {**state[checkpoint.SHARDS_KEY], "slot": "../x"},
                   {**state[checkpoint.SHARDS_KEY], "ranks": "2"}):
        checkpoint.save_checkpoint(where, {**state, checkpoint.SHARDS_KEY: shards})
        with pytest.raises(checkpoint.CheckpointError, match=f"{KEY} .* names its shards as"):
            checkpoint.load_checkpoint(where)


def test_the_operator_deletes_a_deleted_jobs_shards_with_its_checkpoint(tmp_path: Path) -> None:
    zoo = store.DirStore(tmp_path)
    key = records.checkpoint_key("team-b", "digits", "uid-1")
    model, run = _trained(1)
    _save(checkpoint.Location(zoo, key), model, run)
    zoo.put_bytes("checkpoints/team-b/digits/uid-2/checkpoint.pt", b"another job's")
    records.delete_checkpoint(zoo, key)
    assert zoo.list_keys("checkpoints/") == ["checkpoints/team-b/digits/uid-2/checkpoint.pt"]


def test_shard_keys_sit_beside_the_main_object_in_two_slots() -> None:
    key = records.checkpoint_key("team-b", "digits", "uid-1")
    assert records.checkpoint_shard_key(key, "b", 3) == (
        "checkpoints/team-b/digits/uid-1/checkpoint.pt.shards/b/rank-3.safetensors")
    assert records.checkpoint_shard_keys(key, 2) == [
        f"{key}.shards/{slot}/{name}" for slot in "ab"
        for name in ("metadata.json", "rank-0.safetensors", "rank-1.safetensors")]
    with pytest.raises(ValueError, match="slot"):
        records.checkpoint_shard_key(key, "c", 0)


class _GrantsNoShards(store.DirStore):
    """A presigned pod's view when its grants stop below the ranks used: no shard object."""

    def put_bytes(self, key: str, data: bytes) -> None:
        if ".safetensors" in key:
            raise presigned.NotGranted(f"zoo object {key!r}: this pod may not put it")
        super().put_bytes(key, data)

    def get_bytes(self, key: str) -> bytes:
        if ".safetensors" in key:
            raise presigned.NotGranted(f"zoo object {key!r}: this pod may not get it")
        return super().get_bytes(key)


def test_shards_beyond_the_pods_grants_fail_naming_the_grants_not_the_checkpoint(
        tmp_path: Path) -> None:
    model, run = _trained(1)
    refused = checkpoint.Location(_GrantsNoShards(tmp_path), KEY)
    with pytest.raises(presigned.NotGranted, match=r"may not put it\. A sharded checkpoint .* "
                       "--max-gpus-per-job: run the job with at most that many processes"):
        _save(refused, model, run)
    _save(checkpoint.Location(store.DirStore(tmp_path), KEY), model, run)
    with pytest.raises(presigned.NotGranted, match="may not get it.* raise that cap to at least 1"):
        _resumed(refused)  # a grant problem: not a damaged checkpoint (CheckpointError)

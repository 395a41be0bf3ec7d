"""kiln_trainer.checkpoint: round trips under weights_only, RNG state, locations, mismatches."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from kiln import api
from kiln.zoo import store
from kiln_trainer import checkpoint


def _job(name: str = "digits-a", namespace: str | None = None) -> api.TrainingJob:
    metadata = {"name": name, **({"namespace": namespace} if namespace else {})}
    return api.parse_job({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": metadata,
        "spec": {"model": {"architecture": "small_cnn", "inputShape": [1, 8, 8]}},
    })


def test_model_optimizer_and_rng_round_trip_with_weights_only(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    where = checkpoint.Location(store.DirStore(tmp_path), "ns/job/checkpoint.pt")
    size = checkpoint.save_checkpoint(where, {
        checkpoint.MODEL_KEY: model.state_dict(),
        checkpoint.OPTIMIZER_KEY: optimizer.state_dict(),
        checkpoint.RNG_KEY: checkpoint.rng_state(),
        checkpoint.EPOCH_KEY: 3,
        checkpoint.TTT_KEY: None,
        checkpoint.HISTORY_KEY: [{"step": 10, "validation_accuracy": 0.5, "train_loss": None}],
    })
    loaded = checkpoint.load_checkpoint(where)
    assert loaded is not None and size == (tmp_path / "ns/job/checkpoint.pt").stat().st_size
    assert loaded[checkpoint.EPOCH_KEY] == 3 and loaded[checkpoint.TTT_KEY] is None
    assert loaded[checkpoint.HISTORY_KEY][0]["validation_accuracy"] == 0.5
    for key, tensor in model.state_dict().items():
        assert torch.equal(loaded[checkpoint.MODEL_KEY][key], tensor)
    restored = torch.optim.Adam(model.parameters(), lr=0.01)
    restored.load_state_dict(loaded[checkpoint.OPTIMIZER_KEY])
    assert restored.state_dict()["state"][0]["step"] == optimizer.state_dict()["state"][0]["step"]


def test_rng_state_restores_python_numpy_and_torch_streams(tmp_path: Path) -> None:
    where = checkpoint.Location(store.DirStore(tmp_path), "rng.pt")
    checkpoint.save_checkpoint(where, {checkpoint.RNG_KEY: checkpoint.rng_state()})
    expected = (random.random(), float(np.random.rand()), float(torch.rand(())))
    loaded = checkpoint.load_checkpoint(where)
    assert loaded is not None
    checkpoint.set_rng_state(loaded[checkpoint.RNG_KEY])
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == expected


def test_missing_checkpoint_loads_as_none(tmp_path: Path) -> None:
    assert checkpoint.load_checkpoint(checkpoint.Location(store.DirStore(tmp_path), "x.pt")) is None


def test_a_foreign_pickle_is_refused_with_the_key_and_fix(tmp_path: Path) -> None:
    where = checkpoint.Location(store.DirStore(tmp_path), "bad/checkpoint.pt")
    store.DirStore(tmp_path).put_bytes(where.key, b"not a checkpoint at all")
    with pytest.raises(checkpoint.CheckpointError, match="bad/checkpoint.pt.*delete it"):
        checkpoint.load_checkpoint(where)


def test_a_checkpoint_of_another_format_version_is_refused(tmp_path: Path) -> None:
    import io

    where = checkpoint.Location(store.DirStore(tmp_path), "old.pt")
    buffer = io.BytesIO()
    torch.save({checkpoint.FORMAT_KEY: 99}, buffer)
    store.DirStore(tmp_path).put_bytes(where.key, buffer.getvalue())
    with pytest.raises(checkpoint.CheckpointError, match="format 99"):
        checkpoint.load_checkpoint(where)


def test_delete_removes_the_checkpoint_and_tolerates_absence(tmp_path: Path) -> None:
    where = checkpoint.Location(store.DirStore(tmp_path), "a/checkpoint.pt")
    checkpoint.save_checkpoint(where, {checkpoint.EPOCH_KEY: 1})
    checkpoint.delete_checkpoint(where)
    checkpoint.delete_checkpoint(where)
    assert checkpoint.load_checkpoint(where) is None


def test_location_prefers_the_directory_then_the_zoo_then_the_local_default(
    tmp_path: Path,
) -> None:
    zoo = store.DirStore(tmp_path / "zoo")
    job = _job(namespace="team-a")
    in_dir = checkpoint.locate(job, checkpoint_dir=tmp_path / "ckpt", zoo=zoo)
    in_zoo = checkpoint.locate(job, checkpoint_dir=None, zoo=zoo)
    local = checkpoint.locate(_job(), checkpoint_dir=None, zoo=None)
    assert in_dir.key == "team-a/digits-a/checkpoint.pt"
    assert in_dir.store.describe() != zoo.describe()
    assert in_zoo.store is zoo and in_zoo.key == "checkpoints/team-a/digits-a/checkpoint.pt"
    assert local.key == "default/digits-a/checkpoint.pt"
    assert str(checkpoint.DEFAULT_DIR) in local.store.describe()


def test_spec_differences_name_each_changed_field() -> None:
    saved = api.to_wire(_job().spec)
    changed = _job().spec.model_copy(update={"training": api.TrainingSpec(epochs=7)})
    lines = checkpoint.spec_differences(saved, api.to_wire(changed))
    assert lines == ["spec.training.epochs: checkpoint 30, job 7"]
    assert checkpoint.spec_differences(saved, saved) == []

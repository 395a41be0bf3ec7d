"""kiln_trainer.checkpoint: round trips under weights_only, RNG state, locations, mismatches,
and what parallel runs add (writer parallelism, per-rank RNG, older checkpoints)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import numpy as np
import parallel_harness as harness  # tests/ is on sys.path (pytest pythonpath)
import pytest
import torch

from kiln import api
from kiln.zoo import store
from kiln_trainer import checkpoint, tracking
from kiln_trainer.distributed import parallel


def _job(name: str = "digits-a", namespace: str | None = None,
         uid: str | None = None) -> api.TrainingJob:
    metadata = {"name": name, **({"namespace": namespace} if namespace else {}),
                **({"uid": uid} if uid else {})}
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


def test_a_job_of_the_operator_keeps_its_checkpoint_under_its_uid(tmp_path: Path) -> None:
    zoo = store.DirStore(tmp_path / "zoo")
    job = _job(namespace="team-a", uid="5f0c2b1e-aaaa")
    again = _job(namespace="team-a", uid="0d9e8f7a-bbbb")  # created again under its name
    where = checkpoint.locate(job, checkpoint_dir=None, zoo=zoo)
    assert where.key == "checkpoints/team-a/digits-a/5f0c2b1e-aaaa/checkpoint.pt"
    assert checkpoint.locate(job, checkpoint_dir=tmp_path / "ckpt", zoo=zoo).key == (
        "team-a/digits-a/5f0c2b1e-aaaa/checkpoint.pt")
    checkpoint.save_checkpoint(where, {checkpoint.EPOCH_KEY: 3})
    assert checkpoint.load_checkpoint(checkpoint.locate(again, checkpoint_dir=None,
                                                        zoo=zoo)) is None


def _unreachable_zoo(waits: list[float]) -> checkpoint.Location:
    """A zoo checkpoint location on a closed local port; `waits` records every retry."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    zoo = store.S3Store(f"127.0.0.1:{port}", "zoo", access_key=None, secret_key=None,
                        retry=store.RetryPolicy(attempts=2), sleep=waits.append)
    return checkpoint.Location(zoo, "checkpoints/default/digits-a/checkpoint.pt")


@pytest.mark.parametrize("resume", [True, False])
def test_an_unreachable_zoo_moves_the_checkpoint_to_the_fallback(
    tmp_path: Path, resume: bool
) -> None:
    waits: list[float] = []
    fallback = checkpoint.Location(store.DirStore(tmp_path), "default/digits-a/checkpoint.pt")
    where, saved = checkpoint.open_location(_unreachable_zoo(waits), fallback=fallback,
                                            resume=resume)
    assert (where, saved) == (fallback, None) and waits  # the zoo was tried first


def test_a_checkpoint_at_the_fallback_wins_without_contacting_the_zoo(tmp_path: Path) -> None:
    waits: list[float] = []
    fallback = checkpoint.Location(store.DirStore(tmp_path), "default/digits-a/checkpoint.pt")
    checkpoint.save_checkpoint(fallback, {checkpoint.EPOCH_KEY: 2})
    where, saved = checkpoint.open_location(_unreachable_zoo(waits), fallback=fallback,
                                            resume=True)
    assert where == fallback and saved is not None and saved[checkpoint.EPOCH_KEY] == 2
    assert waits == []


def test_without_a_fallback_an_unreachable_zoo_is_an_error() -> None:
    with pytest.raises(store.StoreUnavailable, match="is unavailable"):
        checkpoint.open_location(_unreachable_zoo([]), fallback=None, resume=True)


def test_spec_differences_name_each_changed_field() -> None:
    saved = api.to_wire(_job().spec)
    changed = _job().spec.model_copy(update={"training": api.TrainingSpec(epochs=7)})
    lines = checkpoint.spec_differences(saved, api.to_wire(changed))
    assert lines == ["spec.training.epochs: checkpoint 30, job 7"]
    assert checkpoint.spec_differences(saved, saved) == []


# ----------------------------------------------------------------------------------------------
# parallel runs: which parallelism wrote it, every rank's RNG, older checkpoints


def _captured(tmp_path: Path) -> tuple[dict[str, object], torch.nn.Module]:
    """A checkpoint of a miniature run after 3 steps (one process), and its model."""
    torch.set_num_threads(1)
    job = harness.make_job()
    model = harness.build_model(job)
    run = harness.start_training(job, model.parameters())
    harness.train(parallel.Context(), job, model, run, until_step=3)
    snapshot = checkpoint.capture(run.state, tracking.Clock(), job, model, run.optimizer,
                                  run.scheduler)
    where = checkpoint.Location(store.DirStore(tmp_path), "mini.pt")
    checkpoint.save_checkpoint(where, snapshot)
    loaded = checkpoint.load_checkpoint(where)
    assert loaded is not None
    return loaded, model


def test_capture_records_the_writers_parallelism_world_size_and_every_ranks_rng(
    tmp_path: Path,
) -> None:
    saved, _ = _captured(tmp_path)
    assert saved[checkpoint.PARALLELISM_KEY] == "single" and saved[checkpoint.WORLD_SIZE_KEY] == 1
    rank_rngs = saved[checkpoint.RANK_RNG_KEY]
    assert len(rank_rngs) == 1
    assert torch.equal(rank_rngs[0]["torch"], saved[checkpoint.RNG_KEY]["torch"])


def test_a_checkpoint_from_before_parallel_runs_restores_as_a_single_process_one(
    tmp_path: Path,
) -> None:
    saved, model = _captured(tmp_path)
    for key in (checkpoint.PARALLELISM_KEY, checkpoint.WORLD_SIZE_KEY, checkpoint.RANK_RNG_KEY):
        del saved[key]
    job = harness.make_job()
    fresh = harness.build_model(job)
    run = harness.start_training(job, fresh.parameters())
    state = checkpoint.restore(saved, job, fresh, run.optimizer, run.scheduler)
    assert (state.step, state.epochs_done, state.epoch_batch) == (3, 0, 3)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(),
                                                 model.state_dict().values(), strict=True))


def test_ranks_take_their_own_rng_when_the_world_size_is_unchanged_else_derived_streams() -> None:
    def draws() -> tuple[float, float, float]:
        return random.random(), float(np.random.rand()), float(torch.rand(()))

    states = []
    for seed in (1, 2):
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        states.append(checkpoint.rng_state())
    saved = {checkpoint.RNG_KEY: states[0], checkpoint.RANK_RNG_KEY: states}
    checkpoint.set_rng_state(states[1])
    own = draws()
    checkpoint.set_rank_rng_state(saved, rank=1, world_size=2)
    assert draws() == own
    checkpoint.set_rng_state(states[0])
    first = draws()
    streams = []
    for rank in range(3):  # 3 ranks resume a checkpoint written by 2
        checkpoint.set_rank_rng_state(saved, rank=rank, world_size=3)
        streams.append(draws())
    assert streams[0] == first and len(set(streams)) == 3
    checkpoint.set_rank_rng_state(saved, rank=2, world_size=3)
    assert draws() == streams[2]  # derived deterministically

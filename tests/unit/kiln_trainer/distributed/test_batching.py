"""kiln_trainer.distributed.batching: seeded global batches, their shards per rank, indices, eval ranges."""

from __future__ import annotations

import pytest
import torch
from torch.utils import data as torch_data

from kiln_trainer.distributed import batching


def _numbered(n: int) -> torch_data.TensorDataset:
    """Sample i is (tensor([i]), i): inputs name their own index."""
    return torch_data.TensorDataset(torch.arange(n).unsqueeze(1), torch.arange(n))


def _targets(loader: torch_data.DataLoader[object]) -> list[list[int]]:
    return [batch[1].tolist() for batch in loader]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_the_ranks_shards_of_every_global_batch_are_its_contiguous_parts_in_rank_order(
    world: int,
) -> None:
    dataset = _numbered(40)
    shards = [_targets(batching.train_batches(dataset, batch_size=8, seed=1, epoch=2,
                                              shard=(rank, world))) for rank in range(world)]
    expected = batching.global_batches(40, batch_size=8, seed=1, epoch=2, world_size=world)
    joined = [[index for rank in range(world) for index in shards[rank][i]]
              for i in range(len(expected))]
    assert joined == expected
    assert all(len(batch) == 8 // world for shard in shards for batch in shard)


def test_one_process_trains_on_whole_global_batches_in_order() -> None:
    dataset = _numbered(30)
    expected = batching.global_batches(30, batch_size=7, seed=5, epoch=0)
    assert _targets(batching.train_batches(dataset, batch_size=7, seed=5, epoch=0)) == expected


def test_a_resumed_rank_starts_at_the_same_global_batch_for_any_world_size() -> None:
    dataset = _numbered(40)
    expected = batching.global_batches(40, batch_size=8, seed=0, epoch=1)[3:]
    for world in (1, 2):
        got = _targets(batching.train_batches(dataset, batch_size=8, seed=0, epoch=1,
                                              start_batch=3, shard=(world - 1, world)))
        assert got == [batch[8 // world * (world - 1):] for batch in expected]


def test_batches_with_indices_carry_each_samples_index_in_the_dataset() -> None:
    dataset = _numbered(12)
    for inputs, targets, indices in batching.train_batches(
            dataset, batch_size=4, seed=0, epoch=0, shard=(1, 2), with_indices=True):
        assert indices.dtype == torch.long and indices.tolist() == inputs[:, 0].tolist()
        assert targets.tolist() == indices.tolist()


@pytest.mark.parametrize(("world", "steps", "trailing"), [
    pytest.param(1, 3, [5], id="one-process-keeps-5"),
    pytest.param(2, 3, [3, 2], id="two-ranks-keep-3-and-2"),
    pytest.param(4, 2, None, id="four-ranks-would-get-fewer-than-2-each"),
])
def test_a_short_trailing_batch_is_split_evenly_or_dropped_when_a_rank_would_lack_samples(
    world: int, steps: int, trailing: list[int] | None
) -> None:
    dataset = _numbered(21)  # global batches of 8, 8 and 5
    assert batching.steps_per_epoch(dataset, batch_size=8, world_size=world) == steps
    last = [_targets(batching.train_batches(dataset, batch_size=8, seed=0, epoch=0,
                                            shard=(rank, world)))[-1] for rank in range(world)]
    if trailing is None:
        assert [len(batch) for batch in last] == [2] * world
    else:
        assert [len(batch) for batch in last] == trailing


def test_a_trailing_batch_of_one_is_still_dropped_for_one_process() -> None:
    assert batching.steps_per_epoch(_numbered(9), batch_size=4) == 2
    assert batching.steps_per_epoch(_numbered(9), batch_size=1) == 9


@pytest.mark.parametrize(("kwargs", "match"), [
    pytest.param({"batch_size": 6, "shard": (0, 4)}, "batchSize: 6 is not a multiple of the 4",
                 id="indivisible"),
    pytest.param({"batch_size": 4, "shard": (2, 2)}, r"shard \(2, 2\)", id="rank-out-of-range"),
    pytest.param({"batch_size": 8, "shard": (0, 8)}, "3 samples, fewer than the 8 processes",
                 id="split-too-small"),
])
def test_impossible_shards_are_refused(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        batching.train_batches(_numbered(3), seed=0, epoch=0, **kwargs)  # type: ignore[arg-type]


def test_validation_ranges_of_the_ranks_cover_the_split_once_in_order() -> None:
    dataset = _numbered(11)
    parts = [_targets(batching.eval_batches(dataset, batch_size=2, shard=(rank, 3)))
             for rank in range(3)]
    assert [[i for batch in part for i in batch] for part in parts] == [
        [0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10]]
    assert [len(part) for part in parts] == [2, 2, 2]
    assert batching.shard_bounds(10, (2, 4)) == (6, 8)

"""Mini-batch order: seeded global batches, each sharded across the data-parallel ranks.

A position (epoch, global batch index) means the same for every world size W, so a checkpoint
written by 2 processes resumes in 1 or 4 at the same place. Shapes: indices LongTensor[b], b =
B/W. Never a DistributedSampler: its padding repeats samples and its positions depend on W.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import data as torch_data

Shard = tuple[int, int]  # (rank, world size)


def steps_per_epoch(
    dataset: torch_data.Dataset[Any], *, batch_size: int, world_size: int = 1
) -> int:
    """Optimizer steps in one epoch of `dataset` (a trailing batch may be dropped: `_drops_last`).

    Args:
        dataset: the train split.
        batch_size: global batch size B in samples.
        world_size: data-parallel processes W.
    """
    n = len(dataset)  # type: ignore[arg-type]
    steps = -(-n // batch_size)
    return steps - 1 if _drops_last(n, batch_size, world_size) else steps


def global_batches(
    n: int, *, batch_size: int, seed: int, epoch: int, world_size: int = 1
) -> list[list[int]]:
    """The global batches of epoch `epoch`: lists of dataset indices, in training order.

    Epoch e is a permutation of the N samples seeded by (seed, e); global batch i holds
    positions [i*B, (i+1)*B) of it. A trailing batch too small to give every rank its share is
    dropped (`_drops_last`).

    Args:
        n: samples in the train split.
        batch_size: global batch size B.
        seed: ``spec.training.seed``.
        epoch: 0-based epoch index.
        world_size: data-parallel processes W.
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(n, generator=generator).tolist()
    batches = [order[i : i + batch_size] for i in range(0, n, batch_size)]
    return batches[:-1] if _drops_last(n, batch_size, world_size) else batches


def shard_bounds(size: int, shard: Shard) -> tuple[int, int]:
    """[start, stop) of `shard`'s contiguous part of `size` items; parts differ by at most one.

    Example: 10 items over 4 ranks are split 3, 3, 2, 2; rank 2 gets [6, 8).
    """
    rank, world = shard
    per_rank, extra = divmod(size, world)
    start = rank * per_rank + min(rank, extra)
    return start, start + per_rank + (1 if rank < extra else 0)


def check_shard(shard: Shard, *, batch_size: int | None = None) -> None:
    """Refuse an impossible shard, or a global batch that W ranks cannot split evenly.

    Raises:
        ValueError: world size < 1, rank outside [0, W), or batch_size not a multiple of W.
            (`parallel.Context.local_batch_size` gives the user-facing message.)
    """
    rank, world = shard
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"shard {shard}: need world size >= 1 and 0 <= rank < world size")
    if batch_size is not None and batch_size % world:
        raise ValueError(f"spec.training.batchSize: {batch_size} is not a multiple of the "
                         f"{world} data-parallel processes")


def train_batches(
    dataset: torch_data.Dataset[Any],
    *,
    batch_size: int,
    seed: int,
    epoch: int,
    start_batch: int = 0,
    num_workers: int = 0,
    shard: Shard = (0, 1),
    with_indices: bool = False,
) -> torch_data.DataLoader[Any]:
    """Shuffled mini-batches of epoch `epoch` for one rank, from global batch `start_batch` on.

    The order depends only on (seed, epoch), so a resumed run sees the same batches. Rank r
    trains on the contiguous slice [r*B/W, (r+1)*B/W) of every global batch (B must be a
    multiple of W), so the W ranks together see exactly the samples one process sees, in the
    same steps.

    Args:
        dataset: the train split.
        batch_size: global batch size B (``spec.training.batchSize``).
        seed: ``spec.training.seed``.
        epoch: 0-based epoch index.
        start_batch: global batches of this epoch already trained (skipped; same for every W).
        num_workers: DataLoader worker processes (0: load in the training process).
        shard: (rank, world size W) of this process; (0, 1) for one process.
        with_indices: also yield each sample's index in `dataset` (for activation caches).

    Returns:
        A DataLoader yielding (inputs, targets), or (inputs, targets, indices LongTensor[b])
        with `with_indices`, where b = B/W (less on a trailing batch).

    Raises:
        ValueError: a bad shard, B not a multiple of W, or a split smaller than W samples.
    """
    check_shard(shard, batch_size=batch_size)
    rank, world = shard
    n = len(dataset)  # type: ignore[arg-type]
    if n < world:
        raise ValueError(f"the train split has {n} samples, fewer than the {world} processes")
    batches = global_batches(n, batch_size=batch_size, seed=seed, epoch=epoch,
                             world_size=world)
    local = [batch[slice(*shard_bounds(len(batch), shard))] for batch in batches[start_batch:]]
    # The loader's generator seeds worker processes (augmentation in workers): rank 0 keeps the
    # single-process seed; the other ranks get their own, so their augmentations differ.
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch + 7_919 * rank)
    if rank == 0:
        torch.randperm(n, generator=generator)  # the state a single process leaves it in
    source: torch_data.Dataset[Any] = _WithIndices(dataset) if with_indices else dataset
    return torch_data.DataLoader(
        source, batch_sampler=local, num_workers=num_workers, generator=generator
    )


def eval_batches(
    dataset: torch_data.Dataset[Any],
    *,
    batch_size: int,
    num_workers: int = 0,
    shard: Shard = (0, 1),
) -> torch_data.DataLoader[Any]:
    """Mini-batches of `dataset` in a fixed order: every sample of this rank's part once.

    Args:
        dataset: the validation split.
        batch_size: samples per batch (local).
        num_workers: DataLoader worker processes.
        shard: (rank, W): this rank takes the contiguous range `shard_bounds(N, shard)` of the
            split. Ranks may get batches of different sizes and counts, so only a forward
            without collectives (the unwrapped model) may run on them; FSDP evaluates the whole
            split on every rank (`parallel.Context.eval_shard`).

    Raises:
        ValueError: a bad shard.
    """
    check_shard(shard)
    if shard[1] > 1:
        start, stop = shard_bounds(len(dataset), shard)  # type: ignore[arg-type]
        dataset = torch_data.Subset(dataset, range(start, stop))
    return torch_data.DataLoader(
        dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers
    )


def _drops_last(n: int, batch_size: int, world_size: int) -> bool:
    # A short last batch of R samples (when N > B) is split as evenly as possible (shards
    # differ by at most one sample) and kept only when every rank gets at least min(2, B/W)
    # samples, i.e. R >= W * min(2, B/W): BatchNorm cannot train on one sample. For W = 1 this
    # drops a trailing batch of one sample when B > 1. So `steps_per_epoch` depends on W only
    # when 2 <= R < 2W. On an uneven trailing batch, DDP's mean of per-rank mean gradients
    # weights the samples of the smaller shards slightly more than one process would
    # (relative error below W/R).
    trailing = n % batch_size
    return n > batch_size and 0 < trailing < world_size * min(2, batch_size // world_size)


class _WithIndices(torch_data.Dataset[tuple[Any, Any, int]]):
    """(input, target) samples of a dataset, with the sample's index appended."""

    def __init__(self, dataset: torch_data.Dataset[Any]) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> tuple[Any, Any, int]:
        inputs, target = self.dataset[index]
        return inputs, target, index

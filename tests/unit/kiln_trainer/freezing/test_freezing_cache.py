"""Tests for kiln_trainer.freezing.cache: the fp16 activation cache and the prefetcher."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from kiln import models
from kiln_trainer.freezing import cache, partition

FP16_TOLERANCE = {"atol": 1e-3, "rtol": 1e-3}


def batches(count: int, size: int = 4) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """`count` batches of (inputs Tensor[B, 3], targets LongTensor[B], indices LongTensor[B])."""
    torch.manual_seed(0)
    return [
        (torch.randn(size, 3), torch.randint(0, 2, (size,)), torch.arange(i * size, (i + 1) * size))
        for i in range(count)
    ]


def test_put_then_get_returns_the_activations_within_fp16_precision() -> None:
    activations = torch.randn(4, 2, 3, 3)
    with cache.ActivationCache(10, memory_limit_bytes=1 << 20) as store:
        store.put(torch.tensor([7, 2, 5, 0]), activations)
        got = store.get(torch.tensor([2, 0]))
        assert store.location == "memory"
        assert store.bytes == 10 * 2 * 3 * 3 * 2
    assert got is not None and got.dtype == torch.float32
    assert torch.allclose(got, activations[[1, 3]], **FP16_TOLERANCE)


def test_get_is_none_unless_every_index_is_present() -> None:
    store = cache.ActivationCache(10, memory_limit_bytes=1 << 20)
    assert store.get(torch.tensor([0])) is None  # nothing stored yet
    assert store.bytes == 0
    store.put(torch.tensor([0, 1]), torch.ones(2, 3))
    assert store.get(torch.tensor([1, 2])) is None
    assert store.get(torch.tensor([1, 0])) is not None


def test_invalidate_forgets_every_entry_and_allows_a_new_shape() -> None:
    store = cache.ActivationCache(4, memory_limit_bytes=1 << 20)
    store.put(torch.tensor([0, 1]), torch.ones(2, 3))
    with pytest.raises(ValueError, match="invalidate"):
        store.put(torch.tensor([2]), torch.ones(1, 5))
    store.invalidate()
    assert store.generation == 1
    assert store.get(torch.tensor([0])) is None
    store.put(torch.tensor([2]), torch.full((1, 5), 2.0))  # a deeper boundary: another shape
    assert torch.equal(store.get(torch.tensor([2])), torch.full((1, 5), 2.0))


def test_put_rejects_indices_out_of_range_and_mismatched_batches() -> None:
    store = cache.ActivationCache(4, memory_limit_bytes=1 << 20)
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        store.put(torch.tensor([4]), torch.ones(1, 3))
    with pytest.raises(ValueError, match="must match"):
        store.put(torch.tensor([0, 1]), torch.ones(1, 3))
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.get(torch.tensor([0]))


def test_a_table_past_the_memory_limit_goes_to_a_memmap_file_deleted_on_close(
    tmp_path: pathlib.Path,
) -> None:
    activations = torch.randn(6, 4, 2)
    indices = torch.tensor([5, 4, 3, 2, 1, 0])
    in_memory = cache.ActivationCache(6, memory_limit_bytes=6 * 4 * 2 * 2)
    on_disk = cache.ActivationCache(6, memory_limit_bytes=6 * 4 * 2 * 2 - 1, directory=tmp_path)
    for store in (in_memory, on_disk):
        store.put(indices, activations)
    assert in_memory.location == "memory" and in_memory.path is None
    assert on_disk.location == "disk" and on_disk.bytes == in_memory.bytes
    path = on_disk.path
    assert path is not None and path.is_file() and tmp_path in path.parents
    got_disk, got_memory = on_disk.get(indices[:3]), in_memory.get(indices[:3])
    assert got_disk is not None and got_memory is not None
    assert torch.equal(got_disk, got_memory)
    assert torch.allclose(got_disk, activations[:3], **FP16_TOLERANCE)
    on_disk.close()
    on_disk.close()  # idempotent
    assert not path.exists() and list(tmp_path.iterdir()) == []


def test_prefetcher_yields_the_source_batches_in_order() -> None:
    source = batches(5)
    with cache.Prefetcher(iter(source), None, depth=2) as prefetcher:
        served = list(prefetcher)
    assert len(served) == 5
    for (inputs, cached, targets, indices), (x, y, i) in zip(served, source):
        assert cached is None
        assert inputs is x and targets is y and indices is i


def test_prefetcher_serves_cached_activations_instead_of_inputs() -> None:
    source = batches(3)
    store = cache.ActivationCache(12, memory_limit_bytes=1 << 20)
    store.put(source[1][2], torch.ones(4, 2))  # only the second batch is cached
    with cache.Prefetcher(iter(source), store) as prefetcher:
        served = list(prefetcher)
    assert [inputs is None for inputs, *_ in served] == [False, True, False]
    assert torch.equal(served[1][1], torch.ones(4, 2))
    assert served[0][1] is None and served[2][1] is None


def test_prefetcher_serves_inputs_for_batches_read_before_an_invalidate() -> None:
    source = batches(1)
    store = cache.ActivationCache(4, memory_limit_bytes=1 << 20)
    store.put(source[0][2], torch.ones(4, 2))
    prefetcher = cache.Prefetcher(iter(source), store)
    store.invalidate()  # whether or not the batch was read ahead already
    inputs, cached, _, _ = next(prefetcher)
    assert cached is None and inputs is source[0][0]
    prefetcher.close()


def test_prefetcher_reraises_an_exception_of_the_source() -> None:
    def failing() -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        yield from batches(2)
        raise OSError("disk read failed")

    prefetcher = cache.Prefetcher(failing(), None)
    assert next(prefetcher)[0] is not None
    assert next(prefetcher)[0] is not None
    with pytest.raises(OSError, match="disk read failed"):
        next(prefetcher)
    with pytest.raises(StopIteration):
        next(prefetcher)


def test_prefetcher_close_stops_reading_an_endless_source() -> None:
    def endless() -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        while True:
            yield from batches(1)

    prefetcher = cache.Prefetcher(endless(), None, depth=1)
    next(prefetcher)
    prefetcher.close()
    assert not prefetcher._thread.is_alive()
    with pytest.raises(StopIteration):
        next(prefetcher)


def test_prefetcher_rejects_a_depth_below_one() -> None:
    with pytest.raises(ValueError, match="depth"):
        cache.Prefetcher(iter([]), None, depth=0)


def test_suffix_loss_from_cached_activations_equals_the_uncached_loss() -> None:
    torch.manual_seed(0)
    model = models.get_model("small_cnn", input_shape=(1, 8, 8))
    images, targets, indices = torch.randn(6, 1, 8, 8), torch.randint(0, 10, (6,)), torch.arange(6)
    split = partition.Partition.of(model, images[:1]).split(2)  # stem and blocks.0 frozen
    assert split is not None
    model.train()
    split.prefix.eval()
    with torch.no_grad():
        boundary = split.prefix(images)
    uncached = F.cross_entropy(split.suffix(boundary), targets)
    store = cache.ActivationCache(6, memory_limit_bytes=1 << 20)
    store.put(indices, boundary)
    with cache.Prefetcher(iter([(images, targets, indices)]), store) as prefetcher:
        inputs, cached, served_targets, _ = next(prefetcher)
    assert inputs is None and cached is not None
    cached_loss = F.cross_entropy(split.suffix(cached), served_targets)
    assert torch.allclose(cached_loss, uncached, atol=1e-3)
    assert torch.allclose(uncached, F.cross_entropy(model(images), targets))

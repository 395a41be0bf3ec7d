"""The activation cache across boundary moves, and the training loop reading it ahead.

A deeper freeze advances the cached outputs through the newly frozen blocks (the cache keeps
them); the loop serves cached batches through a `cache.Prefetcher` and trains as it does
without a cache, up to fp16 rounding. The Freezers here run no reference process (main=False):
the tests move the boundary by hand.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from kiln import api, models
from kiln_trainer import data, loop
from kiln_trainer.distributed import batching
from kiln_trainer.freezing import cache, controller

SPEC = api.ModelSpec.model_validate(
    {"architecture": "small_cnn", "inputShape": [1, 8, 8], "args": {"depth": 3, "width": 8}}
)
# fp16 storage (relative error about 5e-4), compounded through one block
FP16_TOLERANCE = {"atol": 5e-3, "rtol": 5e-3}


@pytest.fixture(scope="module")
def splits() -> data.Splits:
    spec = api.DatasetSpec.model_validate({"name": "digits", "maxSamples": 256})
    return data.load(spec, input_shape=[1, 8, 8], seed=0)


def _freezer(splits: data.Splits, *, cached: bool, memory: int = 1 << 30) -> tuple[
        nn.Module, torch.optim.Optimizer, controller.Freezer]:
    torch.manual_seed(0)
    model = models.build(SPEC)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    settings = controller.Settings(check_every_steps=10_000, probe_batch_size=8, cache=cached,
                                   cache_memory_bytes=memory)
    probe = controller.probe_batch(splits.validation, 8)  # type: ignore[arg-type]
    freezer = controller.Freezer(model, SPEC, probe, settings, optimizer=optimizer,
                                 num_samples=len(splits.train), main=False)  # type: ignore[arg-type]
    return model, optimizer, freezer


def _all(splits: data.Splits) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = torch.stack([splits.train[i][0] for i in range(len(splits.train))])  # type: ignore[arg-type]
    return inputs, torch.arange(len(splits.train))  # type: ignore[arg-type]


def test_bridge_maps_the_shallower_boundary_to_the_deeper_one_exactly(splits) -> None:
    model, _, freezer = _freezer(splits, cached=False)
    model.eval()
    inputs, _ = _all(splits)
    shallow, deep = freezer.partition.split(1), freezer.partition.split(2)
    bridge = freezer.partition.bridge(1, 2)
    assert shallow is not None and deep is not None and bridge is not None
    with torch.no_grad():
        torch.testing.assert_close(bridge(shallow.prefix(inputs)), deep.prefix(inputs),
                                   rtol=0, atol=0)
    with pytest.raises(ValueError, match="k must be in"):
        freezer.partition.bridge(2, 2)


@pytest.mark.parametrize("memory", [1 << 30, 0], ids=["memory", "memmap"])
def test_a_deeper_freeze_keeps_the_cache_advanced_through_the_new_block(
        splits, memory: int) -> None:
    model, optimizer, freezer = _freezer(splits, cached=True, memory=memory)
    with freezer:
        store = freezer.cache
        assert store is not None
        inputs, indices = _all(splits)
        freezer.set_boundary(1, 0, "by hand")
        model.train()
        freezer.train_mode()
        freezer.prefix(inputs, indices)  # fills the cache at block 1's boundary
        old_path, generation = store.path, store.generation
        # a training step moves block 2 (and its BatchNorm statistics) before it freezes
        loss = freezer.trainable_module()(freezer.prefix(inputs, indices)).logsumexp(1).mean()
        loss.backward()
        optimizer.step()

        freezer.set_boundary(2, 1, "by hand")

        assert store.generation == generation + 1
        advanced = store.get(indices)
        assert advanced is not None, "the deeper freeze kept every entry"
        assert old_path is None or not old_path.exists(), "the old table's file is deleted"
        deep = freezer.partition.split(2)
        assert deep is not None
        model.eval()
        with torch.no_grad():
            fresh = deep.prefix(inputs)
        torch.testing.assert_close(advanced, fresh, **FP16_TOLERANCE)
        assert freezer.prefix(inputs, indices).shape == fresh.shape

        freezer.set_boundary(0, 2, "unfrozen")
        assert store.get(indices) is None, "unfreezing forgets the entries"


def test_follow_without_a_bridge_forgets_and_restores_nothing() -> None:
    store = cache.ActivationCache(4, memory_limit_bytes=1 << 20)
    store.put(torch.arange(4), torch.ones(4, 3))
    assert cache.follow(store, None) == 0
    assert store.get(torch.arange(4)) is None
    store.put(torch.arange(4), torch.ones(4, 3))
    layer = nn.Sequential(nn.Linear(3, 2), nn.Dropout(0.9)).train()
    assert cache.follow(store, layer) == 4
    assert layer.training, "the bridge's modes are restored"
    got = store.get(torch.arange(4))
    assert got is not None and got.shape == (4, 2)
    with torch.no_grad():  # eval mode: dropout off
        torch.testing.assert_close(got, layer[0](torch.ones(4, 3)), atol=1e-3, rtol=1e-3)


def test_prefetcher_keeps_fp16_on_the_host_and_casts_to_the_compute_dtype() -> None:
    store = cache.ActivationCache(8, memory_limit_bytes=1 << 20)
    store.put(torch.arange(8), torch.full((8, 3), 1.5))
    assert store.get(torch.arange(2), dtype=torch.float16).dtype == torch.float16  # type: ignore[union-attr]
    source = [(torch.zeros(4, 5), torch.zeros(4), torch.arange(4)),
              (torch.zeros(4, 5), torch.zeros(4), torch.arange(4, 8))]
    with cache.Prefetcher(iter(source), store, device=torch.device("cpu"),
                          dtype=torch.float64) as reader:
        served = list(reader)
    assert [s[0] for s in served] == [None, None]
    assert all(s[1] is not None and s[1].dtype == torch.float64 for s in served)


class _Counting:
    """Passes a Prefetcher's batches on, counting those served from the cache."""

    def __init__(self, batches: Iterator[Any]) -> None:
        self.batches, self.cached = batches, 0

    def __iter__(self) -> Iterator[Any]:
        for batch in self.batches:
            self.cached += batch[1] is not None
            yield batch


def _train(splits: data.Splits, *, cached: bool) -> tuple[list[float], int, int]:
    """Per-epoch mean losses over 4 epochs (block 1 frozen from the start, block 2 after the
    first epoch), the batches served from the cache and the steps after the first epoch."""
    _model, optimizer, freezer = _freezer(splits, cached=cached)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    losses, served, later = [], 0, 0
    with freezer:
        freezer.set_boundary(1, 0, "by hand")
        for epoch in range(4):
            batches: Iterator[Any] = iter(batching.train_batches(
                splits.train, batch_size=32, seed=0, epoch=epoch, with_indices=True))
            reader = None
            if freezer.cache is not None:
                reader = cache.Prefetcher(batches, freezer.cache, device=torch.device("cpu"))
                batches = iter(counting := _Counting(reader))
            stats = loop.train_one_epoch(
                freezer.trainable_module(), batches, optimizer=optimizer, scheduler=scheduler,
                device=torch.device("cpu"), freezer=freezer, first_step=epoch * 8)
            if reader is not None:
                reader.close()
                served += counting.cached
            losses.append(stats.loss_sum / stats.steps)
            later += stats.steps if epoch else 0
            if epoch == 0:
                freezer.set_boundary(2, stats.steps, "by hand")
    return losses, served, later


def test_the_loop_with_the_prefetched_cache_trains_as_without_it(splits) -> None:
    plain, none_served, _ = _train(splits, cached=False)
    cached, served, later = _train(splits, cached=True)
    assert none_served == 0
    assert served == later, "after the advance every batch of epochs 2-4 comes from the cache"
    assert plain[-1] < plain[0], "the loss falls"
    torch.testing.assert_close(torch.tensor(cached), torch.tensor(plain), atol=2e-3, rtol=2e-3)


@pytest.mark.process
def test_the_default_recipe_serves_cached_batches_after_a_freeze(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    served: list[bool] = []

    class Recording(cache.Prefetcher):
        def __next__(self) -> cache.Served:
            batch = super().__next__()
            served.append(batch[1] is not None)
            return batch

    monkeypatch.setattr(cache, "Prefetcher", Recording)
    propose = controller.Freezer.propose

    def scheduled(self: controller.Freezer, step: int, **kwargs: Any) -> int:
        """The policy's own bookkeeping, but one more block frozen every epoch (10 steps)."""
        propose(self, step, **kwargs)
        return min(2, step // 10)

    monkeypatch.setattr(controller.Freezer, "propose", scheduled)
    job = api.parse_job({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "cached"},
        "spec": {
            "model": SPEC.model_dump(by_alias=True, exclude_none=True),
            "dataset": {"name": "digits", "maxSamples": 400},
            "training": {"epochs": 4, "batchSize": 32, "seed": 5,
                         "optimizer": {"name": "adam", "lr": 0.005, "weightDecay": 0.0}},
            "freezing": {"checkEverySteps": 5, "reference": "fp32"},
        },
    })
    out = io.StringIO()
    result = loop.main(job, out=out, termination_log=None, checkpoint_dir=tmp_path)
    infos = [json.loads(line).get("message", "") for line in out.getvalue().splitlines()]
    assert any("activation cache on" in message for message in infos), infos
    assert result["freezing"]["frozen"] == ["stem", "blocks.0"], infos
    assert served[-10:] == [True] * 10, "the last epoch's batches came from the cache"
    assert math.isfinite(result["validation_loss"])

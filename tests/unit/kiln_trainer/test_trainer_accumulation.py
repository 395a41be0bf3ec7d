"""spec.training.gradientAccumulationSteps in the default recipe: batches of 8 accumulated 4 at
a time train the weights that batches of 32 train, on the same data order, with the schedule,
progress and resume counted in optimizer steps.

A tiny `vit` (LayerNorm, no BatchNorm, no dropout): its loss is a per-sample mean, so four
quarter batches weighted by their share add up to the gradient of the whole batch.
"""

from __future__ import annotations

import io
import json
import threading
from pathlib import Path
from typing import Any

import pydantic
import pytest
import torch

from kiln import api
from kiln.zoo import records, store
from kiln_trainer import checkpoint, jobcontext, loop

TOLERANCE = 1e-5  # float32 sums in another order, over 20 steps



def _job(batch_size: int, accumulation: int | None) -> api.TrainingJob:
    training: dict[str, Any] = {
        "epochs": 2, "batchSize": batch_size, "seed": 3,
        # SGD: Adam would blow up the rounding noise of the attention key bias, whose exact
        # gradient is zero (softmax ignores a shift shared by all keys), into full steps
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "lrSchedule": {"name": "cosine", "warmupEpochs": 1}}  # the rate moves every step
    if accumulation is not None:
        training["gradientAccumulationSteps"] = accumulation
    return api.parse_job({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": "vit-accumulation"},
        "spec": {
            "model": {"architecture": "vit", "inputShape": [1, 8, 8],
                      "args": {"depth": 2, "width": 16, "heads": 2, "patch_size": 4}},
            # 300 train samples: the epoch's last step holds 12 (8 + 4 when accumulated)
            "dataset": {"name": "digits", "maxSamples": 375},
            "training": training,
            "warmStart": {"enabled": False},
            "freezing": {"enabled": False},
        },
    })


def _run(job: api.TrainingJob, directory: Path,
         **kwargs: Any) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, torch.Tensor]]:
    """The result, the events and the final weights (the zoo record's)."""
    out = io.StringIO()
    try:
        result = loop.main(job, out=out, termination_log=None, zoo_uri=str(directory / "zoo"),
                           checkpoint_dir=directory / "checkpoints", **kwargs)
    finally:
        lines = [json.loads(line) for line in out.getvalue().splitlines()]
    zoo = store.DirStore(directory / "zoo")
    (record,) = records.list_records(zoo)
    return result, lines, records.load_weights(zoo, record)


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def test_accumulating_4_batches_of_8_trains_what_batches_of_32_train(tmp_path: Path) -> None:
    whole, whole_lines, whole_weights = _run(_job(32, None), tmp_path / "whole")
    accumulated, lines, weights = _run(_job(8, 4), tmp_path / "accumulated")
    assert whole["steps"] == accumulated["steps"] == 2 * 10  # optimizer steps, not batches
    assert _max_difference(whole_weights, weights) < TOLERANCE
    assert accumulated["validation_loss"] == pytest.approx(whole["validation_loss"], abs=1e-4)
    for events in (lines, whole_lines):  # the evaluations' reports count optimizer steps
        evaluated = [e for e in events if e["event"] == "progress" and e["evaluated"]]
        assert [(e["step"], e["steps_per_epoch"]) for e in evaluated] == [(10, 10), (20, 10)]
    # without accumulation the same batches of 8 take four times the steps
    plain, _, plain_weights = _run(_job(8, 1), tmp_path / "plain")
    assert plain["steps"] == 2 * 38 and _max_difference(whole_weights, plain_weights) > 1e-3


def test_an_accumulated_run_resumes_mid_epoch_to_the_uninterrupted_weights(
        tmp_path: Path) -> None:
    _, _, straight = _run(_job(8, 4), tmp_path / "straight")
    stop = threading.Event()
    stop.set()  # stop after the first optimizer step
    with pytest.raises(jobcontext.Interrupted):
        _run(_job(8, 4), tmp_path / "stopped", stop=stop)
    saved = checkpoint.load_checkpoint(checkpoint.locate(
        _job(8, 4), checkpoint_dir=tmp_path / "stopped" / "checkpoints", zoo=None))
    assert saved is not None
    assert (saved[checkpoint.STEP_KEY], saved[checkpoint.EPOCH_BATCH_KEY]) == (1, 1)
    assert saved[checkpoint.SAMPLES_KEY] == 32
    resumed, _, weights = _run(_job(8, 4), tmp_path / "stopped")
    assert resumed["steps"] == 20
    assert _max_difference(straight, weights) < TOLERANCE


def test_the_field_defaults_to_1_and_rejects_0_by_name() -> None:
    assert _job(32, None).spec.training.gradient_accumulation_steps == 1
    with pytest.raises((api.InvalidSpec, pydantic.ValidationError),
                       match="gradientAccumulationSteps"):
        _job(8, 0)


def test_ddp_synchronises_gradients_once_per_optimizer_step(tmp_path: Path) -> None:
    """One gloo process: DDP's communication hook runs on a step's last batch only."""
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 3))
        reductions: list[int] = []

        def count(bucket: Any) -> torch.futures.Future[torch.Tensor]:
            reductions.append(bucket.index())
            future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            future.set_result(bucket.buffer())  # one rank: the sum is its own gradient
            return future

        # a lambda: DDP checks a hook's annotations, which are strings in this module
        model.register_comm_hook(None, lambda state, bucket: count(bucket))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        batches = [(torch.randn(2, 4), torch.randint(3, (2,))) for _ in range(10)]
        stats = loop.train_one_epoch(model, iter(batches), optimizer=optimizer,
                                     scheduler=scheduler, device=torch.device("cpu"),
                                     accumulation=4)
    finally:
        torch.distributed.destroy_process_group()
    assert (stats.steps, stats.samples) == (3, 20)  # 4 + 4 + the epoch's last 2
    assert len(reductions) == 3 and scheduler.last_epoch == 3


def test_fsdp_accumulates_with_gradient_sync_off_until_the_last_batch(tmp_path: Path) -> None:
    """One gloo process, FSDP2: 3 batches of 4 per step train what batches of 12 train."""
    from torch.distributed import fsdp

    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    generator = torch.Generator().manual_seed(1)
    inputs, targets = torch.randn(24, 4, generator=generator), torch.randint(3, (24,))
    syncs: list[bool] = []

    def train(accumulation: int, batch_size: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        fsdp.fully_shard(model)
        switch = getattr(model, "set_requires_gradient_sync")  # noqa: B009  # FSDPModule's

        def record(requires: bool, **kwargs: Any) -> None:
            syncs.append(requires)
            switch(requires, **kwargs)

        setattr(model, "set_requires_gradient_sync", record)  # noqa: B010  # a spy
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        batches = [(inputs[i:i + batch_size], targets[i:i + batch_size])
                   for i in range(0, 24, batch_size)]
        stats = loop.train_one_epoch(model, iter(batches), optimizer=optimizer,
                                     scheduler=scheduler, device=torch.device("cpu"),
                                     accumulation=accumulation)
        assert stats.steps == 2
        return {k: v.full_tensor() for k, v in model.state_dict().items()}

    try:
        accumulated, whole = train(3, 4), train(1, 12)
    finally:
        torch.distributed.destroy_process_group()
    assert _max_difference(accumulated, whole) < TOLERANCE
    assert syncs == [False, True] * 4  # per step: off for batches 1 and 2, back on after each

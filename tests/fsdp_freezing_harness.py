"""A rank's side of freezing under FSDP2: the Freezer's prefix frozen inside the sharded model.

Spawned by `parallel_harness.run_ranks` (the children import this module by name).
"""

from __future__ import annotations

import time
from typing import Any

import parallel_harness as harness
import torch

from kiln_trainer import loop
from kiln_trainer.distributed import batching, parallel
from kiln_trainer.freezing import controller

EPOCHS, FREEZE_AFTER_EPOCH = 6, 2


def freeze_under_fsdp(ctx: parallel.Context) -> dict[str, Any]:
    """Train small_cnn sharded by FSDP2 through `loop.train_one_epoch`, freeze its stem after
    `FREEZE_AFTER_EPOCH` epochs, and keep training.

    Returns the per-epoch mean losses (all ranks), what the split and the re-wrap gave, and
    this rank's shards of the stem's parameters after each epoch from the freeze on.
    """
    job = harness.make_job()
    raw = harness.build_model(job)
    wrapped = ctx.wrap(raw)  # sharded in place
    optimizer = torch.optim.SGD(raw.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    dataset = harness.make_dataset()
    settings = controller.Settings(check_every_steps=10_000, probe_batch_size=4)
    freezer = controller.Freezer(raw, None, dataset.tensors[0][:4], settings,
                                 optimizer=optimizer, agree=ctx.broadcast_int, main=False)
    losses, stem_shards, trainable_is_wrapped = [], [], None
    with freezer:
        for epoch in range(EPOCHS):
            if epoch == FREEZE_AFTER_EPOCH:
                freezer.set_boundary(1, epoch * 5, "by hand")
                trainable_is_wrapped = freezer.trainable_module() is wrapped
                wrapped = ctx.rewrap(wrapped, freezer.trainable_module())
            batches = iter(batching.train_batches(
                dataset, batch_size=harness.BATCH_SIZE, seed=3, epoch=epoch, shard=ctx.shard,
                with_indices=True))
            stats = loop.train_one_epoch(
                wrapped, batches, optimizer=optimizer, scheduler=scheduler,
                device=torch.device("cpu"), freezer=freezer, first_step=epoch * 5, ctx=ctx)
            losses.append(ctx.all_reduce_mean(stats.loss_sum / stats.steps))
            if epoch >= FREEZE_AFTER_EPOCH:
                stem_shards.append({name: parameter.detach().to_local().clone()
                                    for name, parameter in raw.stem.named_parameters()})
        split_reason = freezer.partition.split_reason(1)
    return {"losses": losses, "stem_shards": stem_shards, "split_reason": split_reason,
            "trainable_is_wrapped": trainable_is_wrapped,
            "stem_grads_none": all(p.grad is None for p in raw.stem.parameters())}


def both_under_fsdp(ctx: parallel.Context) -> dict[str, Any]:
    """`freeze_under_fsdp`, then `policy_under_fsdp`, in the same ranks: one start-up of the
    processes and their process group serves both (each builds its own model and optimizer)."""
    return {"by_hand": freeze_under_fsdp(ctx), "policy": policy_under_fsdp(ctx)}


# Permissive knobs of the real policy: every probe's answer counts, one cycle of three decides.
POLICY_SETTINGS = controller.Settings(check_every_steps=1, window=3, tolerance=10.0,
                                      peak_fraction=1.0, patience=1, probe_batch_size=4,
                                      max_frozen_fraction=0.5, reference="fp32")
POLICY_MAX_EPOCHS, POLICY_EPOCHS_AFTER = 400, 10


def _let_the_reference_answer(freezer: controller.Freezer) -> None:
    """Rank 0 waits for its reference worker's unanswered probe (the other rank waits at the
    next collective): training never waits for it, so on a busy machine hundreds of steps
    would pass before the first answer; this way the steps to a decision do not depend on the
    machine's speed."""
    worker, deadline = freezer.worker, time.monotonic() + REFERENCE_ANSWER_SECONDS
    while worker is not None and worker.alive and not worker.ready:
        if not worker.wait(max(0.0, deadline - time.monotonic())):
            raise AssertionError(f"no answer from the reference in {REFERENCE_ANSWER_SECONDS} s")


REFERENCE_ANSWER_SECONDS = 120.0


def policy_under_fsdp(ctx: parallel.Context) -> dict[str, Any]:
    """Train small_cnn sharded by FSDP2 with the policy deciding (rank 0's reference process,
    every rank in the probes and refreshes) until a frozen prefix held for
    `POLICY_EPOCHS_AFTER` epochs (at most `POLICY_MAX_EPOCHS` epochs in all).

    Returns the epochs' mean losses (all ranks; an epoch ends early at a boundary change) and
    the index of the first epoch after the last change, this rank's boundary events, and its
    shards of the frozen parameters after each epoch from the last change on.
    """
    job = harness.make_job()
    raw = harness.build_model(job)
    wrapped = ctx.wrap(raw)  # sharded in place
    optimizer = torch.optim.SGD(raw.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    dataset = harness.make_dataset()
    freezer = controller.Freezer(raw, job.spec.model, dataset.tensors[0][:4], POLICY_SETTINGS,
                                 optimizer=optimizer, agree=ctx.broadcast_int, main=ctx.is_main)
    losses, frozen_shards, steps, frozen_from = [], [], 0, None
    with freezer:
        for epoch in range(POLICY_MAX_EPOCHS):
            batches = iter(batching.train_batches(
                dataset, batch_size=harness.BATCH_SIZE, seed=3, epoch=epoch, shard=ctx.shard,
                with_indices=True))
            stats = loop.train_one_epoch(
                wrapped, batches, optimizer=optimizer, scheduler=scheduler,
                device=torch.device("cpu"), freezer=freezer, first_step=steps, ctx=ctx)
            steps += stats.steps
            losses.append(ctx.all_reduce_mean(stats.loss_sum / stats.steps))
            if stats.boundary_event is not None:  # the same on every rank: rank 0's, agreed
                wrapped = ctx.rewrap(wrapped, freezer.trainable_module())
                frozen_from, frozen_shards = len(losses) if freezer.boundary else None, []
            if frozen_from is not None:
                frozen = set(map(id, freezer.partition.params(freezer.boundary)))
                frozen_shards.append({name: p.detach().to_local().clone()
                                      for name, p in raw.named_parameters() if id(p) in frozen})
            if frozen_from is not None and len(losses) - frozen_from >= POLICY_EPOCHS_AFTER:
                break
            _let_the_reference_answer(freezer)
        grads = [p.grad for p in freezer.partition.params(freezer.boundary)]
    return {"losses": losses, "frozen_from": frozen_from, "steps": steps,
            "events": [(e.kind, e.modules, e.step, e.boundary) for e in freezer.events],
            "frozen_shards": frozen_shards, "frozen_grads_none": all(g is None for g in grads)}

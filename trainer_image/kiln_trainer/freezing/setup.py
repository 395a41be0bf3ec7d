"""Layer freezing in the default loop: the job's `Freezer`, or why there is none."""

from __future__ import annotations

import torch
from torch import nn

from kiln import api
from kiln_trainer import data, events
from kiln_trainer.distributed import parallel
from kiln_trainer.freezing import controller, partition


def start(
    job: api.TrainingJob,
    raw_model: nn.Module,
    splits: data.Splits,
    optimizer: torch.optim.Optimizer,
    steps_per_epoch: int,
    emit: events.EventWriter,
    ctx: parallel.Context | None = None,
) -> controller.Freezer | None:
    """The job's `Freezer`, or None, said in an info event: freezing disabled, an FSDP run (its
    parameters are sharded in place, so no frozen prefix can be split off), a run too short
    for a decision, or a model that cannot be partitioned (it then trains unfrozen). Under
    DDP rank 0 decides (and runs the reference process); the other ranks follow its boundary.
    """
    spec, ctx = job.spec, ctx or parallel.Context()
    if not spec.freezing.enabled:
        return None
    if ctx.parallelism == "fsdp":
        emit.info("freezing off: FSDP shards the parameters in place, so no frozen prefix can "
                  "be split off its sharded model (use ddp, or set spec.freezing.enabled false)")
        return None
    settings = controller.Settings.from_job(spec, steps_per_epoch=steps_per_epoch)
    first_decision = max(settings.bootstrap_steps,
                         settings.check_every_steps * settings.window * settings.patience)
    if first_decision >= spec.training.epochs * steps_per_epoch:
        emit.info(f"freezing off: the run is too short ({spec.training.epochs * steps_per_epoch} "
                  f"steps) for a decision, which needs {first_decision} (lower "
                  "spec.freezing.checkEverySteps, window or patience to freeze sooner)")
        return None
    device = next(raw_model.parameters()).device
    probe = controller.probe_batch(splits.validation,  # type: ignore[arg-type]
                                 settings.probe_batch_size).to(device)
    try:
        freezer = controller.Freezer(raw_model, spec.model, probe, settings, optimizer=optimizer,
                                   num_samples=len(splits.train),  # type: ignore[arg-type]
                                   agree=ctx.broadcast_int, main=ctx.is_main)
    except partition.Unpartitionable as exc:
        emit.info(f"freezing off: {exc}")
        return None
    cache = "on" if freezer.cache is not None else (
        "off (inputs are augmented at random)" if spec.freezing.cache == api.CacheMode.AUTO
        else "off")
    emit.info(f"freezing: {len(freezer.partition.blocks)} modules "
              f"({', '.join(freezer.partition.blocks)}), probe every "
              f"{settings.check_every_steps} steps, at most {freezer.max_frozen} frozen, "
              f"activation cache {cache}")
    return freezer

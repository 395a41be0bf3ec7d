"""Layer freezing in a training loop (Kiln's or your own): the job's `Freezer`, or why there is
none."""

from __future__ import annotations

from collections.abc import Collection

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
    copied: Collection[str] = (),
) -> controller.Freezer | None:
    """The job's `Freezer`, or None, said in an info event: freezing disabled, a run too short
    for a decision, or a model that cannot be partitioned (it then trains unfrozen). Under DDP
    and FSDP rank 0 decides (and runs the reference process); the other ranks follow its
    boundary, and under FSDP take part in its probes and reference refreshes. Call it after
    FSDP has sharded `raw_model`. `copied`: the state_dict keys a fresh start's warm start
    copied unchanged (the same on every rank; `Freezer.start_from_transfer`).
    """
    spec, ctx = job.spec, ctx or parallel.Context()
    if not spec.freezing.enabled:
        return None
    settings = _settings(job, steps_per_epoch, emit)
    if settings is None:
        return None
    device = next(raw_model.parameters()).device
    probe = controller.probe_batch(splits.validation,  # type: ignore[arg-type]
                                 settings.probe_batch_size).to(device)
    return _started(job, raw_model, spec.model, probe, settings, optimizer, emit,
                    num_samples=len(splits.train), ctx=ctx,  # type: ignore[arg-type]
                    copied=copied)


def start_for_model(
    job: api.TrainingJob,
    model: nn.Module,
    probe: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    steps_per_epoch: int,
    emit: events.EventWriter,
    copied: Collection[str] = (),
) -> controller.Freezer | None:
    """The `Freezer` of an own loop's `model`, or None, said in an info event as for `start`.

    The reference process starts from a copy of `model` itself (no registry, no entrypoint).

    Args:
        job: the job (its spec.freezing and epoch budget).
        model: the unwrapped training model, on its device.
        probe: Tensor[b, ...] fixed validation inputs, b >= 2 (spec.freezing.probeBatchSize
            of them are used).
        optimizer: whose state of re-activated parameters is cleared on unfreeze.
        steps_per_epoch: optimizer steps in one epoch.
        emit: where the info event goes.
        copied: the state_dict keys a fresh start's warm start copied unchanged.
    """
    spec = job.spec
    if not spec.freezing.enabled:
        return None
    settings = _settings(job, steps_per_epoch, emit)
    if settings is None:
        return None
    probe = probe[:settings.probe_batch_size].to(next(model.parameters()).device)
    return _started(job, model, None, probe, settings, optimizer, emit, num_samples=0,
                    ctx=parallel.Context(), copied=copied)


def _settings(job: api.TrainingJob, steps_per_epoch: int,
              emit: events.EventWriter) -> controller.Settings | None:
    """The freezing knobs, or None (said in an info event) when the run is too short."""
    spec = job.spec
    settings = controller.Settings.from_job(spec, steps_per_epoch=steps_per_epoch)
    first_decision = max(settings.bootstrap_steps,
                         settings.check_every_steps * settings.window * settings.patience)
    if first_decision >= spec.training.epochs * steps_per_epoch:
        emit.info(f"freezing off: the run is too short ({spec.training.epochs * steps_per_epoch} "
                  f"steps) for a decision, which needs {first_decision} (lower "
                  "spec.freezing.checkEverySteps, window or patience to freeze sooner)")
        return None
    return settings


def _started(job: api.TrainingJob, model: nn.Module, model_spec: api.ModelSpec | None,
             probe: torch.Tensor, settings: controller.Settings,
             optimizer: torch.optim.Optimizer, emit: events.EventWriter, *, num_samples: int,
             ctx: parallel.Context, copied: Collection[str]) -> controller.Freezer | None:
    """The started `Freezer`, announced (and what it makes of the warm start's copies); None
    (announced) for a model without blocks."""
    try:
        freezer = controller.Freezer(model, model_spec, probe, settings, optimizer=optimizer,
                                     num_samples=num_samples, agree=ctx.broadcast_int,
                                     main=ctx.is_main)
    except partition.Unpartitionable as exc:
        emit.info(f"freezing off: {exc}")
        return None
    cache = "on" if freezer.cache is not None else (
        "off (FSDP: the sharded model is never split)" if freezer.sharded and num_samples
        else "off (inputs are augmented at random)"
        if job.spec.freezing.cache == api.CacheMode.AUTO and num_samples else "off")
    every = settings.check_every_steps
    test = (f"gradient norms compared every {settings.window * every} steps"
            if freezer.gradients is not None else
            f"probe every {every} steps ({2 * every} later in each learning-rate phase)")
    emit.info(f"freezing: {len(freezer.partition.blocks)} modules "
              f"({', '.join(freezer.partition.blocks)}), {test}, at most "
              f"{freezer.max_frozen} frozen, activation cache {cache}")
    transfer = freezer.start_from_transfer(copied)
    if transfer is not None:
        emit.info(transfer)
    return freezer

"""The default training recipe: `main(job)` reads top to bottom (STYLE.md B6).

seed -> check the job -> device -> data -> model -> warm start (or the checkpoint's weights) ->
optimizer and schedule (damped first epochs when warm) -> resume from the checkpoint -> per epoch: `train_one_epoch`, `evaluate` (also every ``evalEverySteps``),
report, checkpoint -> stop at the target (``stopAtTarget``) or when the epochs run out ->
register the model in the zoo -> emit the result.

Clocks. The *training clock* starts after data and model setup and runs across restarts (the
elapsed seconds travel in the checkpoint); checkpoint writes, zoo registration and setup are
excluded, evaluation is included. Time-to-target is the training clock when the validation
metric first meets the target (accuracy >= value, or loss <= value). Throughput counts only
the training steps (forward, backward, optimizer).

Schedule. The learning rate changes every optimizer step (`kiln_trainer.optim`).

Shapes: B batch; images Tensor[B, C, H, W] -> logits Tensor[B, K]; text LongTensor[B, T] ->
logits Tensor[B, T, V]. Loss and accuracy flatten the leading dimensions, so for language
models they are per token (mean cross-entropy in nats, next-byte accuracy).

Callers: `kiln_trainer.cli` (``python -m kiln_trainer``); users as ``kiln_trainer.run``.
Warm start (`kiln_trainer.warm`) seeds the fresh model before training; a resumed run takes its
weights, and the warm-start record, from the checkpoint instead.

Freezing (`kiln_trainer.freezing`, Egeria): unless ``spec.freezing.enabled`` is false, a
`freezing.controller.Freezer` watches the blocks' plasticity and freezes a front prefix; the
training step runs ``trainable(freezer.prefix(inputs))``, so the frozen prefix runs without
gradients (or not at all, from the activation cache). A stretch of training ends at a boundary
change so that the caller can re-wrap the trainable module.

Non-goals (for now): DDP/FSDP wrapping slots in where marked.
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from kiln import api, models
from kiln.warmstart import graph, plan
from kiln.zoo import records
from kiln.zoo import store as zoo_store
from kiln_trainer import checkpoint, data, events, metrics, optim, runtime, tracking, warm
from kiln_trainer.freezing import controller as freezing
from kiln_trainer.freezing import partition as partitions

_log = logging.getLogger(__name__)

# Progress lines (and metric updates) come at least this often during long epochs.
PROGRESS_INTERVAL_SECONDS = 5.0

ConfigError = runtime.ConfigError  # importable from here, as before the split


class Interrupted(Exception):
    """Training stopped on request (a signal) after saving a checkpoint."""


def main(
    job: api.TrainingJob,
    *,
    zoo_uri: str | None = None,
    metrics_port: int = 0,
    register: bool = True,
    checkpoint_dir: str | Path | None = None,
    resume: bool = True,
    stop: threading.Event | None = None,
    parent: str | None = None,
    out: TextIO = sys.stdout,
    termination_log: Path | None = events.TERMINATION_LOG,
    init_state: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Train `job` to its target or epoch budget and register the model.

    Args:
        job: the validated TrainingJob.
        zoo_uri: zoo store (path, file:// or s3://); None: no registration, local checkpoints.
        metrics_port: Prometheus endpoint port; 0 serves none.
        register: False skips zoo registration even when the job asks for it.
        checkpoint_dir: keep checkpoints in this directory instead of the zoo store.
        resume: False ignores (and overwrites) an existing checkpoint.
        stop: when set (by a signal handler), save a checkpoint and raise `Interrupted`.
        parent: warm-start parent decided upstream (a zoo id, or "none"); None: decide here.
        out: where the JSON-lines protocol goes (`kiln_trainer.events`).
        termination_log: file that also receives the result, when it exists.
        init_state: initial weights chosen by the caller (e.g. a name-and-shape copy, what
            Hugging Face's ``ignore_mismatched_sizes`` gives): unless a checkpoint is resumed,
            loaded into the fresh model with ``strict=False`` (unknown names are ignored; shapes
            must match) instead of warm start (no parent, no learning-rate damping).

    Returns:
        The result fields (`events.Result.to_json()`), also emitted as the last line of `out`.

    Raises:
        api.InvalidSpec: the job fails `models.check_job` or the model does not fit the data.
        data.DatasetError: the dataset cannot be loaded (missing path, empty, too short).
        checkpoint.CheckpointError: an unreadable checkpoint, or one for another model.
        ConfigError: CUDA requested but absent, or the metrics port cannot be bound.
        Interrupted: `stop` was set; a checkpoint was saved first.
        zoo_store.StoreUnavailable: the zoo or checkpoint store failed (after retries).
    """
    spec, emit = job.spec, events.EventWriter(out, termination_log=termination_log)
    runtime.seed_everything(spec.training.seed)
    problems = models.check_job(job)
    if problems:
        raise api.InvalidSpec(problems, source=f"job {job.name}")
    device = runtime.pick_device(spec)

    splits = data.load(spec.dataset, input_shape=spec.model.input_shape,
                       seed=spec.dataset.split_seed)
    batch_size, epochs = spec.training.batch_size, spec.training.epochs
    steps_per_epoch = data.steps_per_epoch(splits.train, batch_size=batch_size)
    workers = 0 if splits.in_memory or device.type == "cpu" else min(4, os.cpu_count() or 1)
    _log.info("%s: %d train / %d validation samples, %d steps per epoch, device %s",
              splits.description, len(splits.train), len(splits.validation),  # type: ignore[arg-type]
              steps_per_epoch, device)

    raw_model = models.build(spec.model)
    zoo = zoo_store.open_store(zoo_uri) if zoo_uri else None
    location = checkpoint.locate(job, checkpoint_dir=checkpoint_dir, zoo=zoo)
    saved = checkpoint.load_checkpoint(location, map_location=device) if resume else None
    if saved is not None and saved.get(checkpoint.WARM_START_KEY):  # weights come from it
        warm_start = warm.WarmStart.from_json(saved[checkpoint.WARM_START_KEY])
    elif init_state is not None and saved is None:
        raw_model.load_state_dict(init_state, strict=False)
        warm_start = warm.WarmStart(None, None, None, None, None, 1.0, "init_state", (
            f"no warm start: {len(init_state)} initial tensors given by the caller"))
    else:
        warm_start = warm.warm_start(job, raw_model, zoo, parent=parent)
    emit.info(warm_start.message())
    raw_model = raw_model.to(device)
    runtime.check_outputs(raw_model, splits, device)
    validate = functools.partial(evaluate, raw_model, splits, batch_size=batch_size,
                                 device=device, num_workers=workers)

    optimizer = optim.build_optimizer(raw_model.parameters(), spec.training.optimizer)
    scheduler = optim.build_schedule(optimizer, spec.training, steps_per_epoch=steps_per_epoch,
                                     damping=warm_start.lr_damping)
    state, resumed_from = tracking.RunState(warm_start=warm_start.to_json()), 0
    if saved is not None:
        state = checkpoint.restore(saved, job, raw_model, optimizer, scheduler)
        state.warm_start = warm_start.to_json()
        resumed_from = state.epochs_done
        emit.info(f"resumed from {location.describe()} at epoch {state.epochs_done} "
                  f"+ {state.epoch_batch} batches, step {state.step}")
    freezer = start_freezing(job, raw_model, splits, optimizer, steps_per_epoch, emit)
    if freezer is not None and saved is not None and saved.get(freezing.CHECKPOINT_KEY):
        freezer.load_state_dict(saved[freezing.CHECKPOINT_KEY], step=state.step)
        if freezer.boundary:
            emit.info(f"kept the frozen prefix {', '.join(freezer.frozen_modules)}")
    model = freezer.trainable_module() if freezer else raw_model  # DDP/FSDP wrapping goes here
    clock = tracking.Clock(offset_seconds=float(saved[checkpoint.ELAPSED_KEY]) if saved else 0.0)
    checkpointer = functools.partial(save, location, clock, state, job, raw_model, optimizer,
                                     scheduler, freezer)

    gauges = metrics.MetricsReporter(job=job.name, namespace=job.metadata.namespace)
    gauges.record_training(samples=state.samples, steps=state.step, train_loss=None,
                           samples_per_second=0.0)
    runtime.serve_metrics(gauges, metrics_port)
    report = tracking.Reporter(emit, gauges, clock, state, epochs=epochs,
                               steps_per_epoch=steps_per_epoch, freezer=freezer)
    eval_every = spec.training.eval_every_steps
    try:
        while not finished(state, spec):
            batches = iter(data.train_batches(
                splits.train, batch_size=batch_size, seed=spec.training.seed,
                epoch=state.epochs_done, start_batch=state.epoch_batch, num_workers=workers,
                with_indices=freezer is not None))
            while state.epoch_batch < steps_per_epoch and not finished(state, spec):
                left = steps_per_epoch - state.epoch_batch
                stats = train_one_epoch(
                    model, batches, optimizer=optimizer, scheduler=scheduler, device=device,
                    grad_clip_norm=spec.training.grad_clip_norm,
                    max_steps=min(left, eval_every - state.step % eval_every) if eval_every
                    else left, max_seconds=PROGRESS_INTERVAL_SECONDS, stop=stop,
                    freezer=freezer, first_step=state.step)
                state.advance(stats, steps_per_epoch=steps_per_epoch)
                if stats.boundary_event is not None:
                    assert freezer is not None
                    report.freezing(stats.boundary_event)
                    model = freezer.trainable_module()  # DDP: re-wrap here
                eval_due = eval_every is not None and state.step % eval_every == 0
                epoch_over = state.epoch_batch >= steps_per_epoch
                report.training(stats, announce=not (eval_due or epoch_over))  # eval reports
                if stop is not None and stop.is_set():
                    checkpointer()
                    emit.info(f"stopped on request at epoch {state.epochs_done + 1}, step "
                              f"{state.step}; checkpoint saved to {location.describe()}")
                    raise Interrupted(location.describe())
                if eval_due and not epoch_over:
                    report.evaluation(validate(), spec.target)
            if state.epoch_batch >= steps_per_epoch:
                state.epochs_done, state.epoch_batch = state.epochs_done + 1, 0
            if not state.evaluated_now():
                report.evaluation(validate(), spec.target)
            checkpointer()
    finally:
        gauges.close()
        if freezer is not None:
            freezer.close()

    if not state.evaluated_now():  # a resumed run that had already finished training
        report.evaluation(validate(), spec.target)
    wall_seconds, final = clock.seconds(), state.history[-1]
    zoo_model = None
    if register and spec.zoo.register_model and zoo is not None:
        zoo_model = register_model(zoo, job, raw_model, state, final, warm_start)
        if zoo_model:
            emit.info(f"registered zoo model {zoo_model} in {zoo.describe()}")
    checkpoint.delete_checkpoint(location)  # finished: a rerun of this job trains afresh
    result = events.Result(
        metric_name=metric_name(spec), metric=final[metric_name(spec)],
        validation_accuracy=final["validation_accuracy"],
        validation_loss=final["validation_loss"], wall_seconds=wall_seconds,
        time_to_target_seconds=state.time_to_target_seconds,
        target_reached=state.time_to_target_seconds is not None,
        epochs_run=state.epochs_done + (1 if state.epoch_batch else 0), steps=state.step,
        samples_per_second=state.samples_per_second(), zoo_model=zoo_model,
        resumed_from_epoch=resumed_from, parent=warm_start.parent,
        similarity=warm_start.similarity, warm_start=warm_start.reason,
        freezing=freezer.summary() if freezer is not None else None)
    emit.result(result)
    return result.to_json()


def train_one_epoch(
    model: nn.Module,
    batches: Iterator[Any],
    *,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    device: torch.device,
    grad_clip_norm: float | None = None,
    max_steps: int | None = None,
    max_seconds: float | None = None,
    stop: threading.Event | None = None,
    freezer: freezing.Freezer | None = None,
    first_step: int = 0,
) -> tracking.StepStats:
    """Train on the epoch's next batches: until they run out, `max_steps` (evalEverySteps),
    `max_seconds` (a progress report is due) or `stop` is set.

    Args:
        model: the (possibly wrapped) model, put in train mode here.
        batches: iterator of (inputs, targets) from `data.train_batches`.
        optimizer: steps once per batch.
        scheduler: steps once per batch, after the optimizer.
        device: where the batches go.
        grad_clip_norm: clip the global gradient 2-norm to this, or None.
        max_steps: at most this many steps.
        max_seconds: return after the step that crosses this many seconds.
        stop: return after the current step once set.
        freezer: layer freezing; batches then carry dataset indices (inputs, targets, indices),
            and the stretch ends after a step that moved the frozen boundary.
        first_step: optimizer steps taken before this call (the freezer's step count).

    Returns:
        Steps, samples, summed per-batch mean loss and seconds of this call.
    """
    model.train()
    if freezer is not None:
        freezer.train_mode()
    start, steps, samples, loss_sum = time.perf_counter(), 0, 0, torch.zeros((), device=device)
    event = None
    for batch in batches:
        began = time.perf_counter()
        inputs, targets = batch[0].to(device, non_blocking=True), batch[1].to(device)
        if freezer is not None:  # the frozen prefix runs without gradients, or is cached
            inputs = freezer.prefix(inputs, batch[2] if len(batch) > 2 else None)
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, -2), targets.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        if grad_clip_norm is not None:
            nn.utils.clip_grad_norm_(model.parameters(), grad_clip_norm)
        optimizer.step()
        scheduler.step()
        loss_sum += loss.detach()
        steps, samples = steps + 1, samples + len(targets)
        if freezer is not None:
            event = freezer.after_step(first_step + steps, lr=optimizer.param_groups[0]["lr"],
                                       seconds=time.perf_counter() - began)
            if event is not None:  # the caller re-wraps the new trainable module
                break
        if max_steps is not None and steps >= max_steps:
            break
        if stop is not None and stop.is_set():
            break
        if max_seconds is not None and time.perf_counter() - start >= max_seconds:
            break
    return tracking.StepStats(steps, samples, float(loss_sum), time.perf_counter() - start,
                              boundary_event=event)


def evaluate(
    model: nn.Module,
    splits: data.Splits,
    *,
    batch_size: int,
    device: torch.device,
    num_workers: int = 0,
) -> tracking.Evaluation:
    """Accuracy and mean cross-entropy on the validation split (per token for LMs)."""
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    loader = data.eval_batches(splits.validation, batch_size=2 * batch_size,
                               num_workers=num_workers)
    with torch.inference_mode():
        for inputs, targets in loader:
            logits = model(inputs.to(device)).flatten(0, -2)
            targets = targets.to(device).flatten()
            loss_sum += float(F.cross_entropy(logits, targets, reduction="sum"))
            correct += int((logits.argmax(-1) == targets).sum())
            count += len(targets)
    model.train()
    return tracking.Evaluation(accuracy=correct / count, loss=loss_sum / count)


# ----------------------------------------------------------------------------------------------
# the recipe's helpers, in the order main uses them


def save(
    location: checkpoint.Location,
    clock: tracking.Clock,
    state: tracking.RunState,
    job: api.TrainingJob,
    raw_model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    freezer: freezing.Freezer | None = None,
) -> None:
    """Write the checkpoint of the current position (with the frozen prefix, if any); its I/O
    is kept off the training clock."""
    with clock.paused():
        saved = checkpoint.capture(state, clock, job, raw_model, optimizer, scheduler)
        if freezer is not None:
            saved[freezing.CHECKPOINT_KEY] = freezer.state_dict()
        size = checkpoint.save_checkpoint(location, saved)
    _log.info("checkpoint: %d bytes to %s", size, location.describe())


def start_freezing(
    job: api.TrainingJob,
    raw_model: nn.Module,
    splits: data.Splits,
    optimizer: torch.optim.Optimizer,
    steps_per_epoch: int,
    emit: events.EventWriter,
) -> freezing.Freezer | None:
    """The job's `Freezer`, or None when freezing is off or the model cannot be partitioned
    (then it trains unfrozen, and says so)."""
    spec = job.spec
    if not spec.freezing.enabled:
        return None
    settings = freezing.Settings.from_job(spec, steps_per_epoch=steps_per_epoch)
    first_decision = max(settings.bootstrap_steps,
                         settings.check_every_steps * settings.window * settings.patience)
    if first_decision >= spec.training.epochs * steps_per_epoch:
        emit.info(f"freezing off: the run is too short ({spec.training.epochs * steps_per_epoch} "
                  f"steps) for a decision, which needs {first_decision} (lower "
                  "spec.freezing.checkEverySteps, window or patience to freeze sooner)")
        return None
    device = next(raw_model.parameters()).device
    probe = freezing.probe_batch(splits.validation, settings.probe_batch_size).to(device)
    try:
        freezer = freezing.Freezer(raw_model, spec.model, probe, settings, optimizer=optimizer,
                                   num_samples=len(splits.train))  # type: ignore[arg-type]
    except partitions.Unpartitionable as exc:
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


def metric_name(spec: api.TrainingJobSpec) -> str:
    """The target's metric, or validation_accuracy for a job without a target."""
    return spec.target.metric.value if spec.target else api.TargetMetric.VALIDATION_ACCURACY.value


def finished(state: tracking.RunState, spec: api.TrainingJobSpec) -> bool:
    """The epochs ran out, or the target was met and the job stops there."""
    stop_at_target = spec.target is not None and spec.target.stop_at_target
    return state.epochs_done >= spec.training.epochs or (
        stop_at_target and state.time_to_target_seconds is not None)


def register_model(
    zoo: zoo_store.ObjectStore,
    job: api.TrainingJob,
    raw_model: nn.Module,
    state: tracking.RunState,
    final: dict[str, Any],
    warm_start: warm.WarmStart,
) -> records.ZooModelId | None:
    """Write the trained model to the zoo; None (with a warning) when its metric is not finite.

    Raises:
        zoo_store.StoreUnavailable: the store failed (the checkpoint is kept, so a rerun only
            redoes this).
    """
    spec, name = job.spec, metric_name(job.spec)
    value = final[name]
    if value is None or not np.isfinite(value):
        _log.warning("not registering: final %s is %s (training diverged?)", name, value)
        return None
    info = models.get_info(spec.model.architecture)
    record = records.ZooRecord(
        id=records.new_id(spec.model.architecture), architecture=spec.model.architecture,
        args=dict(spec.model.args), input_shape=tuple(spec.model.input_shape),
        modality=info.modality.value, task=info.task.value, dataset=spec.dataset.name.value,
        metric_name=name, metric_value=float(value),
        validation_accuracy=final["validation_accuracy"],
        validation_loss=final["validation_loss"],
        samples_per_second=state.samples_per_second(),
        num_params=sum(p.numel() for p in raw_model.parameters()),
        created_time=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        job_name=job.name, job_spec=api.to_wire(spec), parent=warm_start.parent,
        similarity=warm_start.similarity)
    try:
        architecture = graph.to_json(plan.child_graph(spec.model))
    except graph.GraphError as exc:  # kept, but no later job can match against it
        _log.warning("registering without an architecture graph: %s", exc)
        architecture = {"untraceable": str(exc)}
    return records.write_record(zoo, record, raw_model.state_dict(), architecture).id

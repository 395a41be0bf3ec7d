"""The default training recipe: `main(job)` reads top to bottom.

seed -> device and parallel context -> data -> model -> warm start (or the checkpoint's
weights) -> FSDP wrap -> optimizer and schedule -> resume -> freezer -> DDP wrap -> per epoch
`train_one_epoch`, `evaluate`, report, checkpoint -> register the model in the zoo -> result.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn
from torch.nn import functional as F

from kiln import api, contract, models
from kiln.models import entrypoints
from kiln.warmstart import select
from kiln.zoo import store as zoo_store
from kiln_trainer import (
    board,
    checkpoint,
    data,
    events,
    metrics,
    optim,
    precision,
    registration,
    runtime,
    tracking,
    warm,
)
from kiln_trainer.distributed import batching, parallel, replicas
from kiln_trainer.freezing import cache as activation_cache
from kiln_trainer.freezing import controller as freezing
from kiln_trainer.freezing import setup as freezing_setup

_log = logging.getLogger(__name__)

# Progress lines (and metric updates) come at least this often during long epochs.
PROGRESS_INTERVAL_SECONDS = 5.0


class Interrupted(Exception):
    """Training stopped on request (a signal) after saving a checkpoint."""


class Diverged(runtime.ConfigError):
    """The training loss or the validation loss became NaN or infinite; nothing was saved."""


def main(
    job: api.TrainingJob,
    *,
    zoo_uri: str | None = None,
    metrics_port: int = 0,
    register: bool = True,
    checkpoint_dir: str | Path | None = None,
    resume: bool = True,
    stop: threading.Event | None = None,
    warm_decision: select.Decision | None = None,
    out: TextIO = sys.stdout,
    termination_log: Path | None = events.TERMINATION_LOG,
    init_state: Mapping[str, torch.Tensor] | None = None,
    parallelism: str = "auto",
) -> dict[str, Any]:
    """Train `job` to its target or epoch budget and register the model.

    Args:
        job: the validated TrainingJob.
        zoo_uri: zoo store (path, file:// or s3://); None: no registration, local checkpoints.
        metrics_port: Prometheus endpoint port; 0 serves none (always none on ranks > 0).
        register: False skips zoo registration even when the job asks for it.
        checkpoint_dir: keep checkpoints in this directory instead of the zoo store.
        resume: False ignores (and overwrites) an existing checkpoint.
        stop: when set (by a signal handler), save a checkpoint and raise `Interrupted`.
        warm_decision: the warm-start decision made upstream, final; None: decide here.
        out: where the JSON-lines protocol goes (`kiln_trainer.events`); rank 0 only.
        termination_log: file that also receives the result, when it exists; rank 0 only.
        init_state: initial weights chosen by the caller (e.g. a name-and-shape copy, what
            Hugging Face's ``ignore_mismatched_sizes`` gives): unless a checkpoint is resumed,
            loaded into the fresh model with ``strict=False`` (unknown names are ignored; shapes
            must match) instead of warm start (no parent, no learning-rate damping).
        parallelism: single, ddp, fsdp, or auto (``spec.resources.parallelism``; when that is
            auto too, ddp under torchrun with W > 1 processes, else single).

    Returns:
        The result fields (`contract.Result.to_json()`), also emitted as the last line of `out`
        (rank 0's; the other ranks return theirs, which differ only in their own clocks).

    Raises:
        api.InvalidSpec: the job fails `models.check_job` or the model does not fit the data.
        data.DatasetError: the dataset cannot be loaded (missing path, empty, too short).
        checkpoint.CheckpointError: an unreadable checkpoint, one for another model, or one
            that only some ranks can see.
        runtime.ConfigError: CUDA requested but absent, the metrics port cannot be bound, a bad
            torchrun environment, or a batch size the ranks cannot share.
        Interrupted: `stop` was set (on any rank); a checkpoint was saved first.
        Diverged: the training or validation loss became NaN or infinite; the last good
            checkpoint is kept and no diverged weights are saved or registered.
        zoo_store.StoreUnavailable: the zoo or checkpoint store failed (after retries); a
            cold-starting run checkpoints locally instead of in an unreachable zoo, and a failed
            registration names where the finished checkpoint is kept for a rerun to register.
    """
    spec = job.spec
    runtime.seed_everything(spec.training.seed)
    problems = models.check_job(job)
    if problems:
        raise api.InvalidSpec(problems, source=f"job {job.name}")
    device = runtime.pick_device(spec)
    requested = parallelism if parallelism != "auto" else spec.resources.parallelism.value
    # Under torchrun every rank runs `main`; with one process every collective is the identity.
    # Rank 0 alone warm-starts and writes events, metrics, checkpoints and the zoo record.
    ctx = parallel.setup(requested, device.type)
    cleanup = contextlib.ExitStack()  # what the run holds: process group, files, processes
    cleanup.callback(ctx.shutdown)
    try:
        if not ctx.is_main:  # rank 0 alone speaks the stdout protocol and the termination log
            out = cleanup.enter_context(open(os.devnull, "w"))  # noqa: SIM115
            termination_log = None
        emit = events.EventWriter(out, termination_log=termination_log)
        batch_size, epochs = spec.training.batch_size, spec.training.epochs
        ctx.local_batch_size(batch_size)  # B must split evenly over the ranks: fail early

        splits = data.load(spec.dataset, input_shape=spec.model.input_shape,
                           seed=spec.dataset.split_seed, model=spec.model)
        steps_per_epoch = batching.steps_per_epoch(splits.train, batch_size=batch_size,
                                                   world_size=ctx.world_size)
        workers = 0 if splits.in_memory or device.type == "cpu" else min(4, os.cpu_count() or 1)
        _log.info("%s: %d train / %d validation samples, %d steps per epoch, device %s",
                  splits.description, len(splits.train), len(splits.validation),  # type: ignore[arg-type]
                  steps_per_epoch, device)

        raw_model = models.build(spec.model)
        zoo = zoo_store.open_store(zoo_uri) if zoo_uri else None
        primary = checkpoint.locate(job, checkpoint_dir=checkpoint_dir, zoo=zoo)
        # The zoo is needed only when used: a run that starts cold keeps its checkpoints
        # locally while a zoo meant to hold them is unreachable.
        zoo_optional = init_state is not None or not warm.needs_zoo(job, warm_decision)
        fallback = (checkpoint.locate(job, checkpoint_dir=None, zoo=None)
                    if zoo is not None and checkpoint_dir is None and zoo_optional else None)
        location, saved = checkpoint.open_location(primary, fallback=fallback, resume=resume,
                                                   map_location=device)
        if len(set(ctx.gather_objects(saved is not None))) > 1:
            raise checkpoint.CheckpointError(
                f"only some of the {ctx.world_size} ranks found the checkpoint "
                f"{location.describe()}; put it in a store every rank reads (the zoo, or a "
                "shared --checkpoint-dir)")
        if saved is not None and saved.get(checkpoint.WARM_START_KEY):  # weights come from it
            warm_start = warm.WarmStart.from_json(saved[checkpoint.WARM_START_KEY])
        elif init_state is not None and saved is None:
            raw_model.load_state_dict(init_state, strict=False)
            warm_start = warm.WarmStart(None, None, None, None, None, 1.0, "init_state", (
                f"no warm start: {len(init_state)} initial tensors given by the caller"))
        else:  # rank 0 applies the decision and guards it; the weights reach the others below
            chosen = (warm.warm_start(job, raw_model, zoo, decided=warm_decision,
                                      probe=_probe(job, warm_decision, splits, device),
                                      data_fingerprint=splits.fingerprint)
                      if ctx.is_main else None)
            if chosen is not None:
                registration.record_parent_hit(zoo, chosen)
            warm_start = warm.WarmStart.from_json(ctx.broadcast_object(
                chosen.to_json() if chosen is not None else None))
        emit.info(warm_start.message() + (" (when the job first started; its weights now come "
                                          "from the checkpoint)" if saved is not None else ""))
        if saved is not None:
            checkpoint.restore_model(saved, job, raw_model)  # before wrapping: any writer's W
        raw_model = raw_model.to(device)
        ctx.broadcast_weights(raw_model)  # rank 0's (warm-started) weights on every rank
        if spec.model.entrypoint is not None:  # user code: its own shapes, its own lines
            entrypoints.check_forward(
                raw_model, splits.validation[0][0].to(device), entrypoint=spec.model.entrypoint,
                language_model=models.task_of(spec.model) is models.Task.LANGUAGE_MODELING)
        runtime.check_outputs(raw_model, splits, device)
        model = ctx.wrap(raw_model) if ctx.parallelism == "fsdp" else raw_model  # in place
        amp = precision.MixedPrecision(spec.training.precision, device,
                                       sharded=ctx.parallelism == "fsdp")
        if (note := amp.device_note()) is not None:
            emit.info(note)

        if not any(p.requires_grad for p in raw_model.parameters()):
            field = ("spec.model.entrypoint" if spec.model.entrypoint is not None
                     else "spec.model.architecture")
            built = spec.model.entrypoint or spec.model.architecture
            raise api.InvalidSpec([(f"{field}: the model {built} has no trainable parameters; "
                                    "give it at least one nn.Parameter with requires_grad")],
                                  source=f"job {job.name}")
        optimizer = optim.build_optimizer(raw_model.parameters(), spec.training.optimizer)
        scheduler = optim.build_schedule(optimizer, spec.training,
                                         steps_per_epoch=steps_per_epoch,
                                         damping=warm_start.lr_damping)
        state, resumed_from = tracking.RunState(warm_start=warm_start.to_json()), 0
        if saved is not None:
            state = checkpoint.restore_training(saved, job, optimizer, scheduler, ctx=ctx,
                                                wrapped=model)
            state.warm_start = warm_start.to_json()
            amp.load_state_dict(saved.get(precision.CHECKPOINT_KEY))
            resumed_from = state.epochs_done
            emit.info(f"resumed from {location.describe()} at epoch {state.epochs_done} "
                      f"+ {state.epoch_batch} batches, step {state.step}")
        freezer = freezing_setup.start(job, raw_model, splits, optimizer, steps_per_epoch,
                                       emit, ctx)
        if freezer is not None:
            cleanup.callback(freezer.close)
            if saved is not None and saved.get(freezing.CHECKPOINT_KEY):
                freezer.load_state_dict(saved[freezing.CHECKPOINT_KEY], step=state.step)
                if freezer.boundary:
                    emit.info(f"kept the frozen prefix {', '.join(freezer.frozen_modules)}")
        if ctx.parallelism != "fsdp":  # DDP after freezing: its reducer takes trainable ones
            trainable = freezer.trainable_module() if freezer is not None else raw_model
            model = replicas.describe(ctx.wrap(trainable), state.step)
        if ctx.rank and saved is None:  # same init everywhere; now each rank its own stream
            runtime.seed_everything(spec.training.seed + 1_000_003 * ctx.rank)
        # The training clock starts here, after setup, and runs across restarts; checkpoint
        # writes and zoo registration are excluded, evaluation is included. Time-to-target is
        # its reading when the validation metric first meets the target.
        clock = tracking.Clock(offset_seconds=float(saved[checkpoint.ELAPSED_KEY]) if saved
                               else 0.0)
        checkpointer = functools.partial(save, location, clock, state, job, raw_model, optimizer,
                                         scheduler, freezer, ctx, amp=amp)
        validate = functools.partial(evaluate, raw_model, splits,
                                     batch_size=batch_size, device=device,
                                     num_workers=workers, ctx=ctx,
                                     amp=amp)  # FSDP: sharded in place

        def register_provisional() -> None:
            """The best weights so far as the job's provisional zoo record, when due."""
            if not (register and zoo is not None and registration.provisional_due(spec, state)):
                return
            weights = ctx.full_state_dict(model, raw_model)  # collective under FSDP
            if ctx.is_main:
                state.zoo_record_id = registration.register_provisional(
                    zoo, job, raw_model, state, warm_start, weights=weights,
                    content_fingerprint=splits.fingerprint)

        gauges = metrics.MetricsReporter(job=job.name, namespace=job.metadata.namespace)
        cleanup.callback(gauges.close)
        gauges.record_training(samples=state.samples, steps=state.step, train_loss=None,
                               samples_per_second=0.0)
        gauges.record_warm_start(warm_start.decision_fields())
        runtime.serve_metrics(gauges, metrics_port if ctx.is_main else 0)
        tensorboard = board.open_board(os.environ, job.name, step=state.step) \
            if ctx.is_main else None
        if tensorboard is not None:
            cleanup.callback(tensorboard.close)
        report = tracking.Reporter(emit, gauges, clock, state, epochs=epochs,
                                   steps_per_epoch=steps_per_epoch, freezer=freezer,
                                   tensorboard=tensorboard)
        eval_every = spec.training.eval_every_steps
        while not state.finished(spec):
            batches: Iterator[Any] = iter(batching.train_batches(
                splits.train, batch_size=batch_size, seed=spec.training.seed,
                epoch=state.epochs_done, start_batch=state.epoch_batch, num_workers=workers,
                shard=ctx.shard, with_indices=freezer is not None))
            if freezer is not None and freezer.cache is not None:  # cache reads run ahead
                batches = cleanup.enter_context(activation_cache.Prefetcher(
                    batches, freezer.cache, device=device,
                    dtype=next(raw_model.parameters()).dtype))
            while state.epoch_batch < steps_per_epoch and not state.finished(spec):
                left = steps_per_epoch - state.epoch_batch
                stats = train_one_epoch(
                    model, batches, optimizer=optimizer, scheduler=scheduler, device=device,
                    grad_clip_norm=spec.training.grad_clip_norm,
                    max_steps=min(left, eval_every - state.step % eval_every) if eval_every
                    else left, max_seconds=PROGRESS_INTERVAL_SECONDS, stop=stop,
                    freezer=freezer, first_step=state.step, ctx=ctx, amp=amp)
                loss_sum, samples, stops = ctx.all_reduce_sum(  # global numbers, any rank's stop
                    [stats.loss_sum, stats.samples, float(stop is not None and stop.is_set())])
                if not math.isfinite(loss_sum):  # read once per stretch; before any checkpoint
                    firsts = [s for s in ctx.gather_objects(stats.first_nonfinite_step) if s]
                    check_finite("the loss", loss_sum, step=min(firsts, default=state.step + 1),
                                 location=location)
                stats = dataclasses.replace(stats, loss_sum=loss_sum / ctx.world_size,
                                            samples=int(samples))
                state.advance(stats, steps_per_epoch=steps_per_epoch)
                if stats.boundary_event is not None:
                    assert freezer is not None
                    report.freezing(stats.boundary_event)
                    model = replicas.describe(ctx.rewrap(model, freezer.trainable_module()),
                                              state.step)  # DDP: frozen ones leave the reducer
                eval_due = eval_every is not None and state.step % eval_every == 0
                epoch_over = state.epoch_batch >= steps_per_epoch
                report.training(stats, announce=not (eval_due or epoch_over))  # eval reports
                if stops:
                    checkpointer(model)
                    emit.info(f"{contract.STOPPED_PREFIX} at epoch {state.epochs_done + 1}, step "
                              f"{state.step}; checkpoint saved to {location.describe()}")
                    raise Interrupted(location.describe())
                if eval_due and not epoch_over:
                    report.evaluation(finite(validate(), state.step, location), spec.target)
                    register_provisional()
            if isinstance(batches, activation_cache.Prefetcher):
                batches.close()  # its thread ends with the epoch
            if state.epoch_batch >= steps_per_epoch:
                state.epochs_done, state.epoch_batch = state.epochs_done + 1, 0
            if not state.evaluated_now():
                report.evaluation(finite(validate(), state.step, location), spec.target)
                register_provisional()
            checkpointer(model)  # after the provisional record: it keeps that record's id

        if not state.evaluated_now():  # a resumed run that had already finished training
            report.evaluation(finite(validate(), state.step, location), spec.target)
        wall_seconds, final = clock.seconds(), state.history[-1]
        zoo_model = None
        if register and spec.zoo.register_model and zoo is not None:
            weights = ctx.full_state_dict(model, raw_model)  # collective under FSDP
            unavailable = None
            if ctx.is_main:
                try:
                    zoo_model = registration.register_model(
                        zoo, job, raw_model, state, final, warm_start, weights=weights,
                        record_id=state.zoo_record_id,  # replaces the provisional record
                        content_fingerprint=splits.fingerprint)
                except zoo_store.StoreUnavailable as exc:  # the other ranks wait to hear
                    unavailable = str(exc)
            zoo_model, unavailable = ctx.broadcast_object((zoo_model, unavailable))
            if unavailable is not None:  # the finished checkpoint stays: a rerun registers it
                raise zoo_store.StoreUnavailable(
                    "registration failed: zoo unavailable; the model is kept at "
                    f"{location.describe()}; rerun the job once the zoo is reachable to register "
                    f"it without retraining ({unavailable})")
            if zoo_model:
                emit.info(f"registered zoo model {zoo_model} in {zoo.describe()}")
        ctx.barrier()  # every rank is done with the checkpoint
        if ctx.is_main:
            checkpoint.delete_checkpoint(location)  # finished: a rerun of this job trains afresh
            if location is not primary and zoo_model:  # the zoo is back: drop what it still holds
                try:
                    checkpoint.delete_checkpoint(primary)
                except zoo_store.StoreUnavailable as exc:
                    _log.warning("could not delete the older checkpoint %s: %s",
                                 primary.describe(), exc)
        result = contract.Result(
            metric_name=registration.metric_name(spec),
            metric=final[registration.metric_name(spec)],
            validation_accuracy=final["validation_accuracy"],
            validation_loss=final["validation_loss"], wall_seconds=wall_seconds,
            time_to_target_seconds=state.time_to_target_seconds,
            target_reached=state.time_to_target_seconds is not None,
            epochs_run=state.epochs_done + (1 if state.epoch_batch else 0), steps=state.step,
            samples_per_second=state.samples_per_second(), zoo_model=zoo_model,
            resumed_from_epoch=resumed_from, parent=warm_start.parent,
            similarity=warm_start.similarity, warm_start=warm_start.reason,
            freezing=freezer.summary() if freezer is not None else None,
            warm_start_decision=warm_start.decision_fields())
        emit.result(result)
        return result.to_json()
    finally:
        cleanup.close()


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
    ctx: parallel.Context | None = None,
    amp: precision.MixedPrecision | None = None,
) -> tracking.StepStats:
    """Train on the epoch's next batches: until they run out, `max_steps` (evalEverySteps),
    `max_seconds` (a progress report is due), `stop` is set, or the frozen boundary moved.

    Every rank leaves after the same step: each step ends with one `parallel.Context.agree`
    (any rank's stop or time budget, rank 0's freezing proposal); with one process it is the
    identity, with no collective and no device synchronisation.

    Args:
        model: the (possibly wrapped) trainable module, put in train mode here.
        batches: iterator of (inputs, targets) from `batching.train_batches`, or of what a
            `cache.Prefetcher` over them serves (the cached prefix outputs, on `device`).
        optimizer: steps once per batch.
        scheduler: steps once per batch, after the optimizer.
        device: where the batches go.
        grad_clip_norm: clip the global gradient 2-norm to this, or None.
        max_steps: at most this many steps.
        max_seconds: return after the step that crosses this many seconds (on any rank).
        stop: return after the current step once set (on any rank).
        freezer: layer freezing; batches then carry dataset indices (inputs, targets, indices),
            and the stretch ends after a step that moved the frozen boundary.
        first_step: optimizer steps taken before this call (the freezer's step count).
        ctx: the parallel context (default: one process).
        amp: autocast for the forward pass and loss, loss scaling (default: fp32, neither).

    Returns:
        This rank's steps, samples, summed per-batch mean loss and seconds, the boundary
        change that ended the stretch (if any; the caller re-wraps), and the first step whose
        loss was not finite (if any; counted on the device, read only then).
    """
    ctx = ctx or parallel.Context()
    amp = amp or precision.MixedPrecision(api.Precision.FP32, device)
    model.train()
    if freezer is not None:
        freezer.train_mode()
    start, steps, samples, loss_sum = time.perf_counter(), 0, 0, torch.zeros((), device=device)
    event = None
    clean = torch.ones((), dtype=torch.bool, device=device)  # no NaN/inf loss yet: no sync
    clean_steps = torch.zeros((), dtype=torch.int64, device=device)
    for batch in batches:
        began = time.perf_counter()
        inputs, cached, targets, indices = _parts(batch)
        targets = targets.to(device)
        with amp.autocast():
            if cached is not None:  # the prefetcher read the frozen prefix's outputs
                inputs = cached
            else:
                assert inputs is not None
                inputs = inputs.to(device, non_blocking=True)
                if freezer is not None:  # the frozen prefix runs without gradients, or is cached
                    inputs = freezer.prefix(inputs, indices)
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, -2), targets.flatten())
        optimizer.zero_grad(set_to_none=True)
        amp.backward(loss)
        if grad_clip_norm is not None:
            amp.unscale(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), grad_clip_norm)
        amp.step(optimizer)
        scheduler.step()
        loss_sum += loss.detach()
        clean &= torch.isfinite(loss.detach())
        clean_steps += clean
        steps, samples = steps + 1, samples + len(targets)
        proposal = freezer.propose(first_step + steps, lr=optimizer.param_groups[0]["lr"],
                                   seconds=time.perf_counter() - began) if freezer else 0
        time_up = max_seconds is not None and time.perf_counter() - start >= max_seconds
        halt, boundary = ctx.agree(stop=time_up or (stop is not None and stop.is_set()),
                                   decision=proposal)
        if freezer is not None:
            event = freezer.apply(boundary, first_step + steps)
        if halt or event is not None or (max_steps is not None and steps >= max_steps):
            break
    total = float(loss_sum)
    return tracking.StepStats(steps, samples, total, time.perf_counter() - start,
                              boundary_event=event, first_nonfinite_step=(
                                  None if math.isfinite(total)
                                  else first_step + int(clean_steps) + 1))


def _parts(batch: Sequence[Any]) -> tuple[torch.Tensor | None, torch.Tensor | None,
                                          torch.Tensor, torch.Tensor | None]:
    """(inputs, cached prefix outputs, targets, dataset indices) of a training batch: one of
    `batching.train_batches` (inputs, targets[, indices]) or of a `cache.Prefetcher`
    (inputs or None, cached or None, targets, indices)."""
    if len(batch) == 4:
        return batch[0], batch[1], batch[2], batch[3]
    return batch[0], None, batch[1], batch[2] if len(batch) > 2 else None


def evaluate(
    model: nn.Module,
    splits: data.Splits,
    *,
    batch_size: int,
    device: torch.device,
    num_workers: int = 0,
    ctx: parallel.Context | None = None,
    wrapped: nn.Module | None = None,
    amp: precision.MixedPrecision | None = None,
) -> tracking.Evaluation:
    """Accuracy and mean cross-entropy on the validation split (per token for LMs).

    Runs under ``torch.inference_mode()``. Under DDP each rank evaluates its contiguous range of
    the split with the unwrapped model (rank 0's BatchNorm statistics copied first,
    `parallel.Context.prepare_eval`) and the sums are added over the ranks; under FSDP every
    rank runs the whole split through the sharded model, whose forward is collective. Images
    Tensor[B, C, H, W] give logits Tensor[B, K]; text LongTensor[B, T] gives Tensor[B, T, V];
    loss and accuracy flatten the leading dimensions (per token: nats, next-byte accuracy).

    Args:
        model: the unwrapped model (`raw_model`); left in train mode afterwards.
        splits: the data; its validation split is evaluated once, in a fixed order.
        batch_size: the global training batch size B; evaluation batches hold 2B samples.
        device: where the batches go.
        num_workers: DataLoader worker processes.
        ctx: the parallel context (default: one process). With W > 1 this call is collective.
        wrapped: the DDP or FSDP wrapper of `model` (default `model`; FSDP evaluates through it).
        amp: autocast for the forward pass, as in training (default: fp32); the loss and
            accuracy are computed in fp32.

    Returns:
        The same numbers on every rank.
    """
    ctx = ctx or parallel.Context()
    module = ctx.prepare_eval(model if wrapped is None else wrapped, model)
    module.eval()
    loss_sum, correct, count = 0.0, 0, 0
    loader = batching.eval_batches(splits.validation, batch_size=2 * batch_size,
                               num_workers=num_workers, shard=ctx.eval_shard)
    amp = amp or precision.MixedPrecision(api.Precision.FP32, device)
    with torch.inference_mode():
        for inputs, targets in loader:
            with amp.autocast():
                logits = module(inputs.to(device)).flatten(0, -2).float()
            targets = targets.to(device).flatten()
            loss_sum += float(F.cross_entropy(logits, targets, reduction="sum"))
            correct += int((logits.argmax(-1) == targets).sum())
            count += len(targets)
    module.train()
    total_loss, total_correct, total_count = ctx.sum_eval_shards([loss_sum, correct, count])
    return tracking.Evaluation(accuracy=total_correct / total_count,
                               loss=total_loss / total_count)


# ----------------------------------------------------------------------------------------------
# the recipe's helpers, in the order main uses them


def _probe(job: api.TrainingJob, decided: select.Decision | None, splits: data.Splits,
           device: torch.device) -> warm.Probe | None:
    """The warm-start guard's probe: the training split's first samples, scored with the
    loop's loss (and accuracy, for classification); None when no parent will be loaded."""
    if decided.parent_id is None if decided is not None else not job.spec.warm_start.enabled:
        return None
    classification = models.task_of(job.spec.model) is models.Task.CLASSIFICATION
    return warm.training_probe(splits.train, accuracy=classification, device=device)


def check_finite(what: str, value: float, *, step: int, location: checkpoint.Location) -> None:
    """Stop a diverged run before its weights are saved or registered.

    Raises:
        Diverged: `value` (first seen at optimizer step `step`) is NaN or infinite.
    """
    if math.isfinite(value):
        return
    raise Diverged(
        f"training diverged: {what} became {value} at step {step}; lower "
        "spec.training.optimizer.lr, check the model's outputs and the data for NaN; no "
        "checkpoint of the diverged weights was written (a rerun resumes from the last good "
        "one, if any: delete "
        f"{location.describe()} or pass --no-resume to the trainer to start afresh)")


def finite(evaluation: tracking.Evaluation, step: int,
           location: checkpoint.Location) -> tracking.Evaluation:
    """`evaluation` (at optimizer step `step`), once its loss is known to be finite.

    Raises:
        Diverged: the validation loss is NaN or infinite.
    """
    check_finite("the validation loss", evaluation.loss, step=step, location=location)
    return evaluation


def save(
    location: checkpoint.Location,
    clock: tracking.Clock,
    state: tracking.RunState,
    job: api.TrainingJob,
    raw_model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    freezer: freezing.Freezer | None,
    ctx: parallel.Context,
    wrapped: nn.Module,
    *,
    amp: precision.MixedPrecision | None = None,
) -> None:
    """Write the checkpoint of the current position (with the frozen prefix and the fp16
    gradient scaler, if any); its I/O is kept off the training clock. Collective: every rank
    calls it, rank 0 writes. Under DDP it also checks that the replicas still hold identical
    weights (a warning if not)."""
    with clock.paused():
        saved = checkpoint.capture(state, clock, job, raw_model, optimizer, scheduler, ctx=ctx,
                                   wrapped=wrapped)
        if freezer is not None:
            saved[freezing.CHECKPOINT_KEY] = freezer.state_dict()
        if amp is not None and amp.scaler is not None:
            saved[precision.CHECKPOINT_KEY] = amp.state_dict()
        replicas.check(ctx, raw_model, state.step)
        if ctx.is_main:
            size = checkpoint.save_checkpoint(location, saved)
            _log.info("checkpoint: %d bytes to %s", size, location.describe())
        ctx.barrier()

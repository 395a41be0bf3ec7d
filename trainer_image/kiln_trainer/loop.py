"""The default training recipe: `main(job)` reads top to bottom, on the run object own loops
get too (`jobcontext.JobContext`).

seed -> device and parallel context -> data -> model -> warm start -> FSDP wrap -> optimizer
and schedule -> resume -> freezer -> DDP wrap -> per epoch stretches of `train_one_epoch`,
`evaluate`, report, checkpoint -> register the model in the zoo -> result.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn
from torch.nn import functional as F

from kiln import api, contract, models
from kiln.models import entrypoints
from kiln_trainer import (
    checkpoint,
    data,
    events,
    jobcontext,
    optim,
    precision,
    runtime,
    tracking,
    warm,
)
from kiln_trainer.distributed import batching, parallel, replicas
from kiln_trainer.freezing import cache as activation_cache
from kiln_trainer.freezing import controller as freezing

_log = logging.getLogger(__name__)


def main(
    job: api.TrainingJob,
    *,
    zoo_uri: str | None = None,
    metrics_port: int = 0,
    register: bool = True,
    checkpoint_dir: str | Path | None = None,
    resume: bool = True,
    stop: threading.Event | None = None,
    warm_decision: api.WarmStartDecision | None = None,
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
        stop: when set (by a signal handler), save a checkpoint and raise
            `jobcontext.Interrupted`.
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
        jobcontext.Interrupted: `stop` was set (on any rank); a checkpoint was saved first.
        jobcontext.Diverged: the training or validation loss became NaN or infinite; the last
            good checkpoint is kept and no diverged weights are saved or registered.
        zoo_store.StoreUnavailable: the zoo or checkpoint store failed (after retries); a
            cold-starting run checkpoints locally instead of in an unreachable zoo, and a failed
            registration names where the finished checkpoint is kept for a rerun to register.
    """
    args = contract.TrainerArgs(
        zoo=zoo_uri, metrics_port=metrics_port, register=register, resume=resume,
        checkpoint_dir=None if checkpoint_dir is None else str(checkpoint_dir),
        parallelism=parallelism)
    run = jobcontext.JobContext(job, args, out=out, termination_log=termination_log,
                                handle_signals=False, own_loop=False, stop=stop,
                                decided=warm_decision, init_state=init_state)
    with contextlib.ExitStack() as cleanup:  # what the run holds: process group, files, processes
        cleanup.callback(run.close)
        spec, ctx, device = job.spec, run.parallel, run.device
        ctx.local_batch_size(spec.training.batch_size)  # B must split evenly over the ranks
        splits = data.load(spec.dataset, input_shape=spec.model.input_shape,
                           seed=spec.dataset.split_seed, model=spec.model)
        steps_per_epoch = -(-batching.steps_per_epoch(  # optimizer steps: groups of batches
            splits.train, batch_size=spec.training.batch_size, world_size=ctx.world_size)
            // spec.training.gradient_accumulation_steps)
        workers = 0 if splits.in_memory or device.type == "cpu" else min(4, os.cpu_count() or 1)
        _log.info("%s: %d train / %d validation samples, %d steps per epoch, device %s",
                  splits.description, len(splits.train), len(splits.validation),  # type: ignore[arg-type]
                  steps_per_epoch, device)

        raw_model = models.build(spec.model)
        warm.load_pretrained(job, raw_model, os.environ)  # before warm start judges it
        run.data_fingerprint = splits.fingerprint
        # rank 0 applies the decision and guards it; the weights reach the others below
        warm_start = run.warm_start(raw_model, _probe(job, run.decided, splits, device)
                                    if ctx.is_main else None, measure=functools.partial(
                                        _measure, splits=splits, batch_size=spec.training.batch_size,
                                        device=device, amp=run.amp))
        raw_model = raw_model.to(device)
        ctx.broadcast_weights(raw_model)  # rank 0's (warm-started) weights on every rank
        _check_model(job, raw_model, splits, device)
        model = run.wrap(raw_model) if ctx.parallelism == "fsdp" else raw_model  # in place
        optimizer = optim.build_optimizer(raw_model.parameters(), spec.training.optimizer)
        scheduler = optim.build_schedule(optimizer, spec.training,
                                         steps_per_epoch=steps_per_epoch,
                                         damping=functools.partial(
                                             warm.lr_damping, warm_start,
                                             steps_per_epoch=steps_per_epoch,
                                             total_steps=spec.training.epochs * steps_per_epoch))
        run.resume(raw_model, optimizer, steps_per_epoch=steps_per_epoch, scheduler=scheduler)
        freezer = run.freezer(raw_model, splits)
        if ctx.parallelism != "fsdp":  # DDP after freezing: its reducer takes trainable ones
            model = run.wrap(freezer.trainable_module() if freezer is not None else raw_model)
        recipe = _Recipe(run, splits, raw_model, optimizer, scheduler, freezer, steps_per_epoch,
                         workers, validate=functools.partial(
                             evaluate, raw_model, splits, batch_size=spec.training.batch_size,
                             device=device, num_workers=workers, ctx=ctx,
                             amp=run.amp))  # FSDP: sharded in place
        while not run.state.finished(spec):
            model = recipe.epoch(model, cleanup)
        if not run.state.evaluated_now():  # a resumed run that had already finished training
            recipe.evaluate()
        return run.finish(raw_model).to_json()
    raise AssertionError("unreachable")  # for mypy: the ExitStack swallows no exception


@dataclasses.dataclass(frozen=True)
class _Recipe:
    """The default recipe's epochs, once set up: stretches of `train_one_epoch` between
    progress reports, evaluations, checkpoints and stops."""

    run: jobcontext.JobContext
    splits: data.Splits
    raw_model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    freezer: freezing.Freezer | None
    steps_per_epoch: int
    workers: int
    validate: Callable[[], tracking.Evaluation]

    def epoch(self, model: nn.Module, cleanup: contextlib.ExitStack) -> nn.Module:
        """Train the rest of the current epoch, evaluate and checkpoint; the (re)wrapped
        model to train on."""
        run, state, spec = self.run, self.run.state, self.run.job.spec
        batches: Iterator[Any] = iter(batching.train_batches(
            self.splits.train, batch_size=spec.training.batch_size, seed=spec.training.seed,
            epoch=state.epochs_done, num_workers=self.workers,
            start_batch=state.epoch_batch * spec.training.gradient_accumulation_steps,
            shard=run.parallel.shard, with_indices=self.freezer is not None))
        if self.freezer is not None and self.freezer.cache is not None:  # cache reads run ahead
            batches = cleanup.enter_context(activation_cache.Prefetcher(
                batches, self.freezer.cache, device=run.device,
                dtype=next(self.raw_model.parameters()).dtype))
        while state.epoch_batch < self.steps_per_epoch and not state.finished(spec):
            model = self.stretch(model, batches)
        if isinstance(batches, activation_cache.Prefetcher):
            batches.close()  # its thread ends with the epoch
        if state.epoch_batch >= self.steps_per_epoch:
            state.epochs_done, state.epoch_batch = state.epochs_done + 1, 0
        if not state.evaluated_now():
            self.evaluate()
        run.checkpoint()  # after the provisional record: it keeps that record's id
        return model

    def stretch(self, model: nn.Module, batches: Iterator[Any]) -> nn.Module:
        """Train until a progress report, an evaluation or the epoch's end is due, or a stop
        was asked for (then checkpoint and raise `jobcontext.Interrupted`)."""
        run, state, ctx = self.run, self.run.state, self.run.parallel
        spec, eval_every = run.job.spec, run.job.spec.training.eval_every_steps
        left = self.steps_per_epoch - state.epoch_batch
        stats = train_one_epoch(
            model, batches, optimizer=self.optimizer, scheduler=self.scheduler,
            device=run.device, grad_clip_norm=spec.training.grad_clip_norm,
            max_steps=min(left, eval_every - state.step % eval_every) if eval_every else left,
            max_seconds=jobcontext.PROGRESS_INTERVAL_SECONDS, stop=run.stop,
            freezer=self.freezer, first_step=state.step, ctx=ctx, amp=run.amp,
            accumulation=spec.training.gradient_accumulation_steps)
        loss_sum, samples, stops = ctx.all_reduce_sum(  # global numbers, any rank's stop
            [stats.loss_sum, stats.samples, float(run.stop.is_set())])
        if not math.isfinite(loss_sum):  # read once per stretch; before any checkpoint
            firsts = [s for s in ctx.gather_objects(stats.first_nonfinite_step) if s]
            jobcontext.check_finite("the loss", loss_sum, step=min(firsts, default=state.step + 1),
                                    location=run.location)
        stats = dataclasses.replace(stats, loss_sum=loss_sum / ctx.world_size,
                                    samples=int(samples))
        state.advance(stats, steps_per_epoch=self.steps_per_epoch)
        if stats.boundary_event is not None:
            assert self.freezer is not None
            run.reporter.freezing(stats.boundary_event)
            model = replicas.describe(ctx.rewrap(model, self.freezer.trainable_module()),
                                      state.step)  # DDP: frozen ones leave the reducer
        eval_due = eval_every is not None and state.step % eval_every == 0
        epoch_over = state.epoch_batch >= self.steps_per_epoch
        run.reporter.training(stats, announce=not (eval_due or epoch_over))  # eval reports
        if stops:
            run.interrupt()
        if eval_due and not epoch_over:
            self.evaluate()
        return model

    def evaluate(self) -> None:
        """Evaluate the current weights and record it (`jobcontext.JobContext.evaluated`)."""
        run = self.run
        evaluation = finite(self.validate(), run.state.step, run.location)
        run.evaluated(accuracy=evaluation.accuracy, loss=evaluation.loss, epoch_end=False)


def _check_model(job: api.TrainingJob, raw_model: nn.Module, splits: data.Splits,
                 device: torch.device) -> None:
    """Refuse a model whose outputs do not fit the data, or that has nothing to train.

    Raises:
        api.InvalidSpec: naming the field and the fix.
        models.EntrypointError: an entrypoint model's forward fails on a sample.
    """
    spec = job.spec
    if spec.model.entrypoint is not None:  # user code: its own shapes, its own lines
        entrypoints.check_forward(
            raw_model, splits.validation[0][0].to(device), entrypoint=spec.model.entrypoint,
            language_model=models.task_of(spec.model) is models.Task.LANGUAGE_MODELING)
    runtime.check_outputs(raw_model, splits, device)
    if not any(p.requires_grad for p in raw_model.parameters()):
        field = ("spec.model.entrypoint" if spec.model.entrypoint is not None
                 else "spec.model.architecture")
        built = spec.model.entrypoint or spec.model.architecture
        raise api.InvalidSpec([(f"{field}: the model {built} has no trainable parameters; "
                                "give it at least one nn.Parameter with requires_grad")],
                              source=f"job {job.name}")


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
    accumulation: int = 1,
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
        optimizer: steps once per `accumulation` batches.
        scheduler: steps once per optimizer step, after the optimizer.
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
        accumulation: batches whose gradients add up before each optimizer step
            (``spec.training.gradientAccumulationSteps``; the epoch's last step may take
            fewer). Each batch's loss counts by its share of the step's samples, so the step
            computes the gradient of one batch that many times larger; DDP and FSDP
            synchronise gradients on the step's last batch only.

    Returns:
        This rank's optimizer steps, samples, summed per-step mean loss and seconds, the boundary
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
    batches = iter(batches)  # islice must resume one iterator, not restart an iterable
    while group := list(itertools.islice(batches, accumulation)):
        began = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        sizes = [len(_parts(batch)[2]) for batch in group]
        loss = torch.zeros((), device=device)
        for i, batch in enumerate(group):
            share = sizes[i] / sum(sizes)
            with contextlib.nullcontext() if i == len(group) - 1 else _no_sync(model):
                part = _batch_loss(model, batch, device=device, freezer=freezer, amp=amp)
                amp.backward(part * share)
            loss += part.detach() * share
        if grad_clip_norm is not None:
            amp.unscale(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), grad_clip_norm)
        amp.step(optimizer)
        scheduler.step()
        loss_sum += loss.detach()
        clean &= torch.isfinite(loss.detach())
        clean_steps += clean
        steps, samples = steps + 1, samples + sum(sizes)
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


def _batch_loss(model: nn.Module, batch: Sequence[Any], *, device: torch.device,
                freezer: freezing.Freezer | None,
                amp: precision.MixedPrecision) -> torch.Tensor:
    """The mean cross-entropy of `model` on one training batch (see `_parts`), with autograd."""
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
        loss: torch.Tensor = F.cross_entropy(logits.flatten(0, -2), targets.flatten())
    return loss


def _no_sync(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """Keep a backward's gradients local (DDP's ``no_sync``, FSDP2's gradient sync off), for
    every batch of an accumulated step but the last; nothing to do for a plain module."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return model.no_sync()
    if callable(getattr(model, "set_requires_gradient_sync", None)):  # FSDP2's FSDPModule
        return _gradient_sync_off(model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _gradient_sync_off(model: Any) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


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


def _probe(job: api.TrainingJob, decided: api.WarmStartDecision | None, splits: data.Splits,
           device: torch.device) -> warm.Probe | None:
    """The warm-start guard's probe: the training split's first samples, scored with the
    loop's loss (and accuracy, for classification), enough for a batch per probe step; None
    when no parent will be loaded."""
    if decided.parent is None if decided is not None else not job.spec.warm_start.enabled:
        return None
    classification = models.task_of(job.spec.model) is models.Task.CLASSIFICATION
    return warm.training_probe(
        splits.train, accuracy=classification, device=device,
        train_samples=job.spec.warm_start.probe_steps * job.spec.training.batch_size)


def _measure(model: nn.Module, *, splits: data.Splits, batch_size: int, device: torch.device,
             amp: precision.MixedPrecision) -> tuple[float, float]:
    """(accuracy, loss) of `model` on the validation split, on rank 0 alone: the metric of
    pretrained weights a LoRA job imports as its base (the model stays on `device`)."""
    evaluation = evaluate(model.to(device), splits, batch_size=batch_size, device=device,
                          amp=amp)
    return evaluation.accuracy, evaluation.loss


def finite(evaluation: tracking.Evaluation, step: int,
           location: checkpoint.Location) -> tracking.Evaluation:
    """`evaluation` (at optimizer step `step`), once its loss is known to be finite.

    Raises:
        jobcontext.Diverged: the validation loss is NaN or infinite.
    """
    jobcontext.check_finite("the validation loss", evaluation.loss, step=step, location=location)
    return evaluation

"""Kiln inside your own training loop: the job's context, and the few calls that give the loop
warm start, layer freezing, mixed precision, progress, checkpoints and the zoo.

`job_context()` reads the environment `kiln.contract` defines (set by the operator's pod and by
`kiln run`); the events it writes are those of Kiln's own loop, so status and results match.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn, TextIO

import torch
from torch import nn

from kiln import api, contract, models
from kiln.warmstart import decision
from kiln.zoo import store as zoo_store
from kiln_trainer import (
    board,
    checkpoint,
    cli,
    events,
    loop,
    metrics,
    precision,
    registration,
    runtime,
    tracking,
    warm,
)
from kiln_trainer.freezing import controller as freezing
from kiln_trainer.freezing import setup as freezing_setup

USER_STATE_KEY = "user"  # the `extra` dict an own loop keeps in its checkpoint
_OWN_OPTIMIZER = "own"  # OPTIMIZER_NAME_KEY of an own loop's checkpoint


def job_context(
    job_file: str | Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    out: TextIO | None = None,
    handle_signals: bool = True,
) -> JobContext:
    """The running job's context, from the environment `kiln.contract` defines.

    Under `kiln run` and in the operator's pods the job, zoo, checkpoint directory, metrics
    port and warm-start decision come from ``KILN_*`` variables; standalone, pass the job file.

    Args:
        job_file: a TrainingJob file; default ``$KILN_JOB_FILE``, else the job in ``$KILN_JOB``.
        environ: the environment to read (default `os.environ`).
        out: where the JSON-lines events go (default stdout, as Kiln's trainer).
        handle_signals: on SIGTERM/SIGINT, checkpoint at the next `JobContext.trained` and exit
            128 + the signal, as Kiln's trainer does (only from the main thread).

    Exits (`SystemExit`) with `contract.EXIT_INVALID`, the message on stderr and in the
    termination log, as Kiln's trainer does, when no job is given, the job is invalid (the
    message names the field), CUDA is requested but absent, or the metrics port is taken; so
    the operator fails the job at once instead of retrying it. Every call below exits the same
    way on what the user must fix, and with `contract.EXIT_STORE_UNAVAILABLE` (the operator
    retries) when the zoo or checkpoint store cannot be reached.
    """
    environ = os.environ if environ is None else environ
    out = sys.stdout if out is None else out
    with _exit_as_trainer(events.EventWriter(out)):
        args = contract.parse_trainer_args([], environ)
        job = cli.load_job(str(job_file) if job_file else args.job_file,
                           environ.get(contract.Env.JOB))
        return JobContext(job, args, out=out, handle_signals=handle_signals)
    raise AssertionError("unreachable")  # for mypy: _exit_as_trainer re-raises or exits


@contextlib.contextmanager
def _exit_as_trainer(emit: events.EventWriter) -> Iterator[None]:
    """End the process as Kiln's trainer would: what the user must fix exits
    `contract.EXIT_INVALID` (permanent), an unreachable store `contract.EXIT_STORE_UNAVAILABLE`
    (retried; the checkpoint is kept); the message on stderr and in the termination log."""
    try:
        yield
    except (api.InvalidSpec, runtime.ConfigError, checkpoint.CheckpointError,
            decision.ApplyError) as exc:
        _exit(emit, str(exc), contract.EXIT_INVALID)
    except zoo_store.StoreUnavailable as exc:
        _exit(emit, f"store unavailable: {exc}", contract.EXIT_STORE_UNAVAILABLE)


def _unwrapped(model: nn.Module) -> nn.Module:
    """The module inside a ``torch.compile`` (``_orig_mod``) or DDP/FSDP (``module``) wrapper."""
    for attribute in ("_orig_mod", "module"):
        inner = getattr(model, attribute, None)
        if isinstance(inner, nn.Module):
            model = inner
    return model


def _exit(emit: events.EventWriter, message: str, code: int) -> NoReturn:
    print(f"kiln_trainer: error: {message}", file=sys.stderr)
    emit.failure(message)
    raise SystemExit(code) from None


class JobContext:
    """One run of a job in an own loop: call, in this order,

    * `warm_start(model)` once, on the freshly built model;
    * `resume(model, optimizer, steps_per_epoch=...)` once: it returns the epoch to start at;
    * optionally `freezer(model, probe)`;
    * per optimizer step `trained(loss, samples=...)`; train under ``amp`` (`precision`);
    * per evaluation `evaluated(accuracy=..., loss=...)`, which says when the run is done;
      then `checkpoint()`;
    * `finish(model)` once, at the end, with the model given to `resume`: it registers the
      model and writes the result; no call but `close` may follow.

    A checkpoint taken mid-epoch (on a stop signal) resumes at the start of that epoch.
    Single process only (no data parallelism).

    Attributes:
        job: the TrainingJob; ``job.spec.training`` holds epochs, batch size, seed, precision.
        device: where to train (``spec.training.device``; CUDA when present for auto).
        amp: autocast and, for fp16, loss scaling (``spec.training.precision``).
        zoo: the zoo store, or None.
        emit: the event writer (`info` for a sentence the user should see).
    """

    def __init__(self, job: api.TrainingJob, args: contract.TrainerArgs, *, out: TextIO,
                 termination_log: Path | None = events.TERMINATION_LOG,
                 handle_signals: bool = True) -> None:
        spec = job.spec
        problems = models.check_job(job)  # what `kiln validate` and the operator check
        if problems:
            raise api.InvalidSpec(problems, source=f"job {job.name}")
        self.job, self.args = job, args
        runtime.seed_everything(spec.training.seed)
        self.device = runtime.pick_device(spec)
        self.amp = precision.MixedPrecision(spec.training.precision, self.device)
        self.zoo = zoo_store.open_store(args.zoo) if args.zoo else None
        self.location = checkpoint.locate(job, checkpoint_dir=args.checkpoint_dir, zoo=self.zoo)
        self.emit = events.EventWriter(out, termination_log=termination_log)
        if (note := self.amp.device_note()) is not None:
            self.emit.info(note)
        self.gauges = metrics.MetricsReporter(job=job.name, namespace=job.metadata.namespace)
        runtime.serve_metrics(self.gauges, args.metrics_port)
        self.state = tracking.RunState()
        self.clock = tracking.Clock()
        self.warm: warm.WarmStart | None = None
        self._freezer: freezing.Freezer | None = None
        self._model: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self._extra: dict[str, Any] = {}
        self._reporter: tracking.Reporter | None = None
        self._board: board.Board | None = None  # TensorBoard, when KILN_TENSORBOARD_DIR is set
        self._finished = False
        # steps, samples, loss sum and seconds since the last progress report
        self._stretch: list[float] = [0, 0, 0.0, 0.0]
        self._last_step_seconds = time.perf_counter()
        self._saved = (checkpoint.load_checkpoint(self.location, map_location=self.device)
                       if args.resume else None)
        self.stop, self._signals = threading.Event(), list[int]()
        self._previous_handlers: dict[int, Any] = {}
        if handle_signals and threading.current_thread() is threading.main_thread():
            self._previous_handlers = {signum: signal.signal(signum, self._on_signal)
                                       for signum in contract.STOP_SIGNALS}

    # -- setup ----------------------------------------------------------------------------

    def warm_start(
        self,
        model: nn.Module,
        probe: tuple[torch.Tensor, torch.Tensor] | None = None,
        loss_fn: warm.LossFn = warm.cross_entropy,
    ) -> warm.WarmStart:
        """Seed `model` (freshly built, any nn.Module) from its zoo parent, in place.

        Uses the decision passed by the operator or `kiln run` (``$KILN_WARM_START``), else
        decides once here (``spec.warmStart``); a run resuming from a checkpoint keeps the
        record of its first start, and its weights come from the checkpoint in `resume`.

        With a `probe`, Kiln's guard applies: the warm weights are kept only if their mean
        `loss_fn` on the probe is at most `warm.MAX_LOSS_RATIO` times the cold model's; else
        the decision's alternative parents are tried, then `model` keeps its cold weights.

        Args:
            model: the freshly built model (evaluated where it is).
            probe: (inputs, targets) a fixed batch of TRAINING data, e.g. its first 256
                samples; None: no guard.
            loss_fn: (outputs, targets) -> mean loss, your loop's (default: cross-entropy over
                the flattened leading dimensions, as Kiln's loop).

        Returns:
            What happened: the parent, similarity, transferred tensors, and a sentence.

        Exits with `contract.EXIT_INVALID` (as `job_context`) when a pinned parent is not in
        the zoo, ``$KILN_WARM_START`` is not a decision, or the decided parent can no longer
        be loaded or transformed.
        """
        if self._saved is not None and self._saved.get(checkpoint.WARM_START_KEY):
            self.warm = warm.WarmStart.from_json(self._saved[checkpoint.WARM_START_KEY])
        else:
            with _exit_as_trainer(self.emit):
                self.warm = warm.warm_start(
                    self.job, model, self.zoo, decided=warm.parse_decision(self.args.warm_start),
                    probe=None if probe is None else warm.Probe(probe[0], probe[1], loss=loss_fn))
            registration.record_parent_hit(self.zoo, self.warm)
        self.state.warm_start = self.warm.to_json()
        self.gauges.record_warm_start(self.warm.decision_fields())
        self.emit.info(self.warm.message())
        return self.warm

    def resume(self, model: nn.Module, optimizer: torch.optim.Optimizer, *,
               steps_per_epoch: int,
               scheduler: torch.optim.lr_scheduler.LRScheduler | None = None) -> int:
        """Load the job's checkpoint, if any, into `model`, `optimizer` (and `scheduler`), and
        start the training clock.

        Args:
            model: the model after `warm_start`.
            optimizer: its optimizer (your choice; ``spec.training.optimizer`` is advisory).
            steps_per_epoch: optimizer steps per epoch (progress and freezing cadence).
            scheduler: a learning-rate schedule to checkpoint with them, if any.

        Returns:
            Epochs already done: start your epoch loop there (0 on a fresh start).

        Exits with `contract.EXIT_INVALID` (as `job_context`) when the checkpoint was written
        for another model.
        """
        self._model, self._optimizer, self._scheduler = model, optimizer, scheduler
        saved = self._saved
        if saved is not None:
            with _exit_as_trainer(self.emit):
                checkpoint.restore_model(saved, self.job, model)
            optimizer.load_state_dict(saved[checkpoint.OPTIMIZER_KEY])
            if scheduler is not None and saved.get(checkpoint.SCHEDULER_KEY):
                scheduler.load_state_dict(saved[checkpoint.SCHEDULER_KEY])
            self.amp.load_state_dict(saved.get(precision.CHECKPOINT_KEY))
            checkpoint.set_rng_state(saved[checkpoint.RNG_KEY])
            self._extra = dict(saved.get(USER_STATE_KEY) or {})
            self.state = tracking.RunState(
                epochs_done=int(saved[checkpoint.EPOCH_KEY]),
                step=int(saved[checkpoint.STEP_KEY]), samples=int(saved[checkpoint.SAMPLES_KEY]),
                train_seconds=float(saved[checkpoint.TRAIN_SECONDS_KEY]),
                time_to_target_seconds=saved[checkpoint.TTT_KEY],
                history=list(saved[checkpoint.HISTORY_KEY]), warm_start=self.state.warm_start)
            self.emit.info(f"resumed from {self.location.describe()} at epoch "
                           f"{self.state.epochs_done}, step {self.state.step}")
        self.clock = tracking.Clock(offset_seconds=float(saved[checkpoint.ELAPSED_KEY])
                                    if saved is not None else 0.0)
        if self._board is None:
            self._board = board.open_board(os.environ, self.job.name, step=self.state.step)
        self._reporter = tracking.Reporter(
            self.emit, self.gauges, self.clock, self.state,
            epochs=self.job.spec.training.epochs, steps_per_epoch=steps_per_epoch,
            tensorboard=self._board)
        self.gauges.record_training(samples=self.state.samples, steps=self.state.step,
                                    train_loss=None, samples_per_second=0.0)
        self._last_step_seconds = time.perf_counter()
        return self.state.epochs_done

    def freezer(self, model: nn.Module, probe: torch.Tensor) -> freezing.Freezer | None:
        """Egeria's layer freezing for `model` (``spec.freezing``), after `resume`.

        The reference process starts from a copy of `model` itself. `trained` then drives the
        freezer; frozen blocks stop receiving gradients, so backward ends at the boundary.

        Args:
            model: the model being trained.
            probe: Tensor[b, ...] fixed validation inputs (b >= 2).

        Returns:
            The freezer, or None (freezing off, the run too short, or no blocks; said in an
            info event).

        Raises:
            RuntimeError: called before `resume`.
        """
        if self._reporter is None or self._optimizer is None:
            raise RuntimeError("call JobContext.resume(...) before JobContext.freezer(...)")
        self._freezer = freezing_setup.start_for_model(
            self.job, model, probe, self._optimizer, self._reporter.steps_per_epoch, self.emit)
        if self._freezer is not None:
            self._reporter.freezer = self._freezer
            if self._saved is not None and self._saved.get(freezing.CHECKPOINT_KEY):
                self._freezer.load_state_dict(self._saved[freezing.CHECKPOINT_KEY],
                                              step=self.state.step)
        return self._freezer

    # -- per step and per evaluation -------------------------------------------------------

    def trained(self, loss: torch.Tensor | float, *, samples: int) -> None:
        """Count one optimizer step on `samples` samples with training loss `loss`.

        Drives the freezer, reports progress every few seconds, and on a stop signal saves a
        checkpoint and exits the process with 128 + the signal. A NaN or infinite `loss` exits
        with `contract.EXIT_INVALID` (as `job_context`), saying the training diverged; the last
        checkpoint is kept.

        Raises:
            RuntimeError: called before `resume`, or after `finish`.
        """
        reporter = self._started()
        value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        with _exit_as_trainer(self.emit):
            loop.check_finite("the loss", value, step=self.state.step + 1,
                              location=self.location)
        now = time.perf_counter()
        seconds, self._last_step_seconds = now - self._last_step_seconds, now
        state = self.state
        state.step, state.epoch_batch = state.step + 1, state.epoch_batch + 1
        state.samples, state.train_seconds = state.samples + samples, state.train_seconds + seconds
        steps, count, loss_sum, stretch_seconds = self._stretch
        self._stretch = [steps + 1, count + samples, loss_sum + value, stretch_seconds + seconds]
        if self._freezer is not None and self._optimizer is not None:
            event = self._freezer.after_step(state.step, lr=self._optimizer.param_groups[0]["lr"],
                                             seconds=seconds)
            if event is not None:
                reporter.freezing(event)
        if self.stop.is_set():
            self.checkpoint()
            self.emit.info(f"{contract.STOPPED_PREFIX} at epoch {state.epochs_done + 1}, step "
                           f"{state.step}; checkpoint saved to {self.location.describe()}")
            self.close()
            raise SystemExit(128 + (self._signals[0] if self._signals else signal.SIGTERM))
        if self._stretch[3] >= loop.PROGRESS_INTERVAL_SECONDS:
            self._report_training(announce=True)

    def evaluated(self, *, accuracy: float, loss: float, epoch_end: bool = True) -> bool:
        """Record a validation result (accuracy in [0, 1], mean loss in nats).

        Args:
            accuracy: validation accuracy.
            loss: mean validation loss.
            epoch_end: whether this evaluation closes an epoch (counts it).

        Returns:
            Whether the run is done: the epoch budget is spent, or the target was met and
            ``spec.target.stopAtTarget`` holds.

        Raises:
            RuntimeError: called before `resume`, before any `trained` step, or after `finish`.
            ValueError: `accuracy` is not in [0, 1], or `loss` is negative, NaN or infinite.
        """
        reporter = self._started()
        if self.state.step == 0:
            raise RuntimeError("call JobContext.trained(loss, samples=...) after each optimizer "
                               "step: train first, then JobContext.evaluated(...)")
        if not 0.0 <= float(accuracy) <= 1.0:  # also refuses NaN
            raise ValueError(f"evaluated(accuracy={accuracy}): accuracy must be a fraction in "
                             "[0, 1] (correct / total), not a percentage")
        if not (math.isfinite(float(loss)) and float(loss) >= 0.0):
            raise ValueError(f"evaluated(loss={loss}): loss must be a finite mean loss >= 0 "
                             "(nats); a NaN or infinite one means the training diverged: lower "
                             "the learning rate")
        self._report_training(announce=False)
        if epoch_end:
            self.state.epochs_done, self.state.epoch_batch = self.state.epochs_done + 1, 0
        reporter.evaluation(tracking.Evaluation(accuracy=float(accuracy), loss=float(loss)),
                            self.job.spec.target)
        return self.state.finished(self.job.spec)

    def checkpoint(self, extra: Mapping[str, Any] | None = None) -> None:
        """Save model, optimizer, schedule, scaler, freezer, RNGs and position (off the clock).

        Args:
            extra: your own values to keep (tensors, numbers, strings, lists, dicts); `extra`
                returns them after a resume.
        """
        self._started()
        assert self._model is not None and self._optimizer is not None
        if extra is not None:
            self._extra = dict(extra)
        state = self.state
        with self.clock.paused():
            saved: dict[str, Any] = {
                checkpoint.MODEL_KEY: self._model.state_dict(),
                checkpoint.OPTIMIZER_KEY: self._optimizer.state_dict(),
                checkpoint.OPTIMIZER_NAME_KEY: _OWN_OPTIMIZER,
                checkpoint.SCHEDULER_KEY: (self._scheduler.state_dict()
                                           if self._scheduler is not None else None),
                checkpoint.RNG_KEY: checkpoint.rng_state(),
                checkpoint.EPOCH_KEY: state.epochs_done,
                checkpoint.EPOCH_BATCH_KEY: 0,  # an own loop restarts its epoch
                checkpoint.STEP_KEY: state.step, checkpoint.SAMPLES_KEY: state.samples,
                checkpoint.TRAIN_SECONDS_KEY: state.train_seconds,
                checkpoint.ELAPSED_KEY: self.clock.seconds(),
                checkpoint.TTT_KEY: state.time_to_target_seconds,
                checkpoint.HISTORY_KEY: state.history,
                checkpoint.SPEC_KEY: api.to_wire(self.job.spec),
                checkpoint.WARM_START_KEY: state.warm_start,
                precision.CHECKPOINT_KEY: self.amp.state_dict(),
                USER_STATE_KEY: self._extra,
            }
            if self._freezer is not None:
                saved[freezing.CHECKPOINT_KEY] = self._freezer.state_dict()
            with _exit_as_trainer(self.emit):
                checkpoint.save_checkpoint(self.location, saved)

    @property
    def extra(self) -> dict[str, Any]:
        """The `extra` values of the last `checkpoint` (after a resume: the saved ones)."""
        return self._extra

    # -- the end -----------------------------------------------------------------------------

    def finish(self, model: nn.Module) -> contract.Result:
        """Register `model` in the zoo (when the job asks), drop the checkpoint, write the result
        (stdout and the termination message) and close the context.

        Raises:
            RuntimeError: no `evaluated` call yet (the result needs a validation metric), or
                `finish` was already called.
            ValueError: `model` is not the model given to `resume` (either may be a DDP or
                ``torch.compile`` wrapper of the other).
        """
        if self._finished:
            raise RuntimeError("JobContext.finish(...) was already called: the model is "
                               "registered and the result written once per run")
        if self._model is not None and _unwrapped(model) is not _unwrapped(self._model):
            raise ValueError("finish(model): not the model given to JobContext.resume(model, "
                             "...); pass that model, whose weights were trained and checkpointed")
        self._report_training(announce=False)
        spec, state = self.job.spec, self.state
        if not state.history:
            raise RuntimeError("call JobContext.evaluated(accuracy=..., loss=...) before "
                               "JobContext.finish(...): the result needs a validation metric")
        final = state.history[-1]
        warm_start = self.warm or warm.WarmStart(None, None, None, None, None, 1.0, "cold",
                                                 "cold start: warm_start was not called")
        zoo_model = None
        with _exit_as_trainer(self.emit):
            if self.args.register and spec.zoo.register_model and self.zoo is not None:
                zoo_model = registration.register_model(self.zoo, self.job, model, state, final,
                                                        warm_start)
                if zoo_model:
                    self.emit.info(f"registered zoo model {zoo_model} in {self.zoo.describe()}")
            checkpoint.delete_checkpoint(self.location)
        name = registration.metric_name(spec)
        result = contract.Result(
            metric_name=name, metric=final[name],
            validation_accuracy=final["validation_accuracy"],
            validation_loss=final["validation_loss"], wall_seconds=self.clock.seconds(),
            time_to_target_seconds=state.time_to_target_seconds,
            target_reached=state.time_to_target_seconds is not None,
            epochs_run=state.epochs_done, steps=state.step,
            samples_per_second=state.samples_per_second(), zoo_model=zoo_model,
            resumed_from_epoch=int(self._saved[checkpoint.EPOCH_KEY]) if self._saved else 0,
            parent=warm_start.parent, similarity=warm_start.similarity,
            warm_start=warm_start.reason,
            freezing=self._freezer.summary() if self._freezer is not None else None,
            warm_start_decision=warm_start.decision_fields())
        self.emit.result(result)
        self._finished = True
        self.close()
        return result

    def close(self) -> None:
        """Stop the freezer's reference process and the metrics endpoint, close the TensorBoard
        log, and give the stop signals back to their previous handlers (idempotent)."""
        if self._freezer is not None:
            self._freezer.close()
        if self._board is not None:
            self._board.close()
            self._board = None
        self.gauges.close()
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers = {}

    # -- helpers -------------------------------------------------------------------------------

    def _started(self) -> tracking.Reporter:
        if self._finished:
            raise RuntimeError("JobContext.finish(...) ended this run: no call may follow it")
        if self._reporter is None:
            raise RuntimeError("call JobContext.resume(model, optimizer, steps_per_epoch=...) "
                               "before training")
        return self._reporter

    def _report_training(self, *, announce: bool) -> None:
        steps, samples, loss_sum, seconds = self._stretch
        if steps and self._reporter is not None:
            self._reporter.training(tracking.StepStats(int(steps), int(samples), loss_sum,
                                                       seconds), announce=announce)
        self._stretch = [0, 0, 0.0, 0.0]

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self._signals.append(signum)
        self.stop.set()

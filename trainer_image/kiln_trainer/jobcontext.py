"""The run object both training loops are written on: Kiln's default recipe (`loop.main`) and
your own loop, which gets it from `job_context()`.

Warm start, resume, checkpoints, freezing, evaluation bookkeeping, registration and the result
exist once, here; `job_context()` reads the environment `kiln.contract` defines.
"""

from __future__ import annotations

import contextlib
import logging
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
from kiln.zoo import presigned, records
from kiln.zoo import store as zoo_store
from kiln_trainer import (
    board,
    checkpoint,
    data,
    events,
    metrics,
    mlflow_tracking,
    precision,
    registration,
    runtime,
    tracking,
    warm,
)
from kiln_trainer.distributed import parallel, replicas
from kiln_trainer.freezing import controller as freezing
from kiln_trainer.freezing import setup as freezing_setup

_log = logging.getLogger(__name__)

# Progress lines (and metric updates) come at least this often during long epochs.
PROGRESS_INTERVAL_SECONDS = 5.0
OWN_OPTIMIZER = "own"  # OPTIMIZER_NAME_KEY of an own loop's checkpoint: its optimizer is its own


class Interrupted(Exception):
    """Training stopped on request (a signal) after saving a checkpoint."""


class Diverged(runtime.ConfigError):
    """The training loss or the validation loss became NaN or infinite; nothing was saved."""


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
        job = runtime.load_job(str(job_file) if job_file else args.job_file,
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


def _exit(emit: events.EventWriter, message: str, code: int) -> NoReturn:
    print(f"kiln_trainer: error: {message}", file=sys.stderr)
    emit.failure(message)
    raise SystemExit(code) from None


def _failure(error: BaseException | None) -> str:
    """Why a run ended without a result, in a sentence: the error (what an own loop's exit
    stood for), or that it was closed before `JobContext.finish`."""
    if isinstance(error, SystemExit) and error.__context__ is not None:
        error = error.__context__  # `_exit_as_trainer` turned it into the exit
    if error is None:
        return "closed before JobContext.finish(...)"
    return str(error) or type(error).__name__


def _unwrapped(model: nn.Module) -> nn.Module:
    """The module inside DDP (``module``) and ``torch.compile`` (``_orig_mod``) wrappers."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel):
            model = model.module
        elif isinstance(inner := getattr(model, "_orig_mod", None), nn.Module):
            model = inner
        else:
            return model


class JobContext:
    """One run of a job. An own loop calls, in this order,

    * `warm_start(model)` once, on the freshly built model;
    * under torchrun with several processes, `wrap(model)` and train through the wrapper (DDP);
    * `resume(model, optimizer, steps_per_epoch=...)` once: it returns the epoch to start at;
    * optionally `freezer(model, probe)`;
    * per optimizer step `trained(loss, samples=...)`; train under ``amp`` (`precision`);
    * per evaluation `evaluated(accuracy=..., loss=...)`, which says when the run is done;
      then `checkpoint()`;
    * `finish(model)` once, at the end, with the model given to `resume`: it registers the
      model and writes the result; no call but `close` may follow.

    A checkpoint an own loop took mid-epoch (on a stop signal) resumes at the start of that
    epoch. Under DDP every rank makes every call; rank 0 alone writes events, checkpoints and
    the zoo record. Kiln's default recipe (`loop.main`) makes the same calls (``own_loop=False``).

    Attributes:
        job: the TrainingJob; ``job.spec.training`` holds epochs, batch size, seed, precision.
        device: where to train (``spec.training.device``; CUDA when present for auto).
        parallel: this process's place among the ranks (one process outside torchrun).
        amp: autocast and, for fp16, loss scaling (``spec.training.precision``).
        zoo: the zoo store, or None.
        emit: the event writer (`info` for a sentence the user should see).
        state: the run's position and history (`tracking.RunState`).
        stop: set by a stop signal: checkpoint and stop after the current step.
        data_fingerprint: what Kiln's recipe loaded (`data.Splits.fingerprint`), kept in the zoo
            record; None for an own loop's own data.
    """

    def __init__(self, job: api.TrainingJob, args: contract.TrainerArgs, *, out: TextIO,
                 termination_log: Path | None = events.TERMINATION_LOG,
                 handle_signals: bool = True, own_loop: bool = True,
                 stop: threading.Event | None = None, decided: api.WarmStartDecision | None = None,
                 init_state: Mapping[str, torch.Tensor] | None = None) -> None:
        """Set the run up: seeds, device, process group, zoo, checkpoint, metrics endpoint.

        Args:
            job: the job; checked as `kiln validate` and the operator check it.
            args: the trainer's settings (`contract.parse_trainer_args`).
            out: where rank 0's JSON-lines events go.
            termination_log: rank 0's termination message file, when it exists.
            handle_signals: install SIGTERM/SIGINT handlers that set `stop` (main thread only).
            own_loop: an own loop's run: what the user must fix exits the process, the
                optimizer is the loop's own, and a resumed epoch starts over; False for Kiln's
                recipe, whose calls raise and whose epochs continue mid-way.
            stop: the event a stop request sets (default: a new one).
            decided: the warm-start decision made upstream; default ``args.warm_start``'s.
            init_state: initial weights chosen by the caller, loaded by `warm_start` with
                ``strict=False`` instead of a parent when no checkpoint is resumed.

        Raises:
            api.InvalidSpec, runtime.ConfigError, checkpoint.CheckpointError,
            zoo_store.StoreUnavailable: as `loop.main` says.
        """
        self.job, self.args, self.own_loop = job, args, own_loop
        self._resources = contextlib.ExitStack()  # process group, files, processes, endpoint
        self._previous_handlers: dict[int, Any] = {}
        self._tracker: mlflow_tracking.Tracker | None = None  # the MLflow run, from `resume`
        try:
            self._set_up(out, termination_log, decided, init_state)
        except BaseException:
            self.close()
            raise
        self.stop = stop if stop is not None else threading.Event()
        self._signals = list[int]()
        if handle_signals and threading.current_thread() is threading.main_thread():
            self._previous_handlers = {signum: signal.signal(signum, self._on_signal)
                                       for signum in contract.STOP_SIGNALS}

    def _set_up(self, out: TextIO, termination_log: Path | None,
                decided: api.WarmStartDecision | None,
                init_state: Mapping[str, torch.Tensor] | None) -> None:
        job, spec, args = self.job, self.job.spec, self.args
        problems = models.check_job(job)  # what `kiln validate` and the operator check
        if problems:
            raise api.InvalidSpec(problems, source=f"job {job.name}")
        runtime.seed_everything(spec.training.seed)
        self.device = runtime.pick_device(spec)
        requested = (args.parallelism if args.parallelism != api.Parallelism.AUTO.value
                     else spec.resources.parallelism.value)
        # Under torchrun every rank runs the loop; with one process every collective is the
        # identity. Rank 0 alone warm-starts and writes events, metrics, checkpoints, records.
        self.parallel = parallel.setup(requested, self.device.type)
        self._resources.callback(self.parallel.shutdown)
        if self.own_loop and self.parallel.parallelism == "fsdp":
            raise runtime.ConfigError(
                "spec.resources.parallelism: fsdp shards the model inside Kiln's own loop; an "
                "own loop trains as one process or under ddp (set ddp, or auto)")
        if not self.parallel.is_main:  # rank 0 alone speaks the stdout protocol
            out = self._resources.enter_context(open(os.devnull, "w"))  # noqa: SIM115
            termination_log = None
        self.emit = events.EventWriter(out, termination_log=termination_log)
        if requested in ("ddp", "fsdp") and not self.parallel.distributed:
            # said on the console, not only in the log: the user asked for several processes
            self.emit.info(f"{requested} with one process: training as a single process "
                           "(several come from torchrun --nproc-per-node N, or from a plan "
                           "that gives the job several devices)")
        # checked now: a job asking for MLflow without the library fails before any work
        self._mlflow = self.parallel.is_main and mlflow_tracking.enabled(os.environ)
        self.amp = precision.MixedPrecision(spec.training.precision, self.device,
                                            sharded=self.parallel.parallelism == "fsdp")
        if (note := self.amp.device_note()) is not None:
            self.emit.info(note)
        self.zoo = presigned.open_zoo(args.zoo) if args.zoo else None
        self.decided = decided if decided is not None else warm.parse_decision(args.warm_start)
        self._init_state = init_state
        self._primary = checkpoint.locate(job, checkpoint_dir=args.checkpoint_dir, zoo=self.zoo)
        # The zoo is needed only when used: a run that starts cold keeps its checkpoints
        # locally while a zoo meant to hold them is unreachable.
        zoo_optional = init_state is not None or not warm.needs_zoo(job, self.decided)
        fallback = (checkpoint.locate(job, checkpoint_dir=None, zoo=None)
                    if self.zoo is not None and args.checkpoint_dir is None and zoo_optional
                    else None)
        self.location, self._saved = checkpoint.open_location(
            self._primary, fallback=fallback, resume=args.resume, map_location=self.device)
        if len(set(self.parallel.gather_objects(self._saved is not None))) > 1:
            raise checkpoint.CheckpointError(
                f"only some of the {self.parallel.world_size} ranks found the checkpoint "
                f"{self.location.describe()}; put it in a store every rank reads (the zoo, or "
                "a shared --checkpoint-dir)")
        self.gauges = metrics.MetricsReporter(job=job.name, namespace=job.metadata.namespace)
        self._resources.callback(self.gauges.close)
        runtime.serve_metrics(self.gauges, args.metrics_port if self.parallel.is_main else 0)
        self.state = tracking.RunState()
        self.clock = tracking.Clock()
        self.warm: api.WarmStartDecision | None = None
        self.lora_base: str | None = None  # a LoRA job's base record (`warm.lora_start`)
        self.data_fingerprint: str | None = None
        self.resumed_from = 0  # epochs done when this process started
        self._freezer: freezing.Freezer | None = None
        self._copied: list[str] = []  # keys a fresh warm start copied unchanged (for freezing)
        self._model: nn.Module | None = None  # unwrapped
        self._sharded: nn.Module | None = None  # the FSDP-sharded model (Kiln's recipe)
        self._optimizer: torch.optim.Optimizer | None = None
        self._scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self._extra: dict[str, Any] = {}
        # the shards of the checkpoint at `location` (slot, ranks): the next save uses the other
        self._written: dict[str, Any] = {checkpoint.SHARDS_KEY: (self._saved or {}).get(
            checkpoint.SHARDS_KEY)}
        self._reporter: tracking.Reporter | None = None
        self._finished = False
        # steps, samples, loss sum and seconds since the last progress report (`trained`)
        self._stretch: list[float] = [0, 0, 0.0, 0.0]
        self._last_step_seconds = time.perf_counter()

    # -- setup ----------------------------------------------------------------------------

    def warm_start(
        self,
        model: nn.Module,
        probe: tuple[torch.Tensor, torch.Tensor] | warm.Probe | None = None,
        loss_fn: warm.LossFn = warm.cross_entropy,
        *,
        measure: warm.Measure | None = None,
    ) -> api.WarmStartDecision:
        """Seed `model` (freshly built, any nn.Module) from its zoo parent, in place.

        Uses the decision passed by the operator or `kiln run` (``$KILN_WARM_START``), else
        decides once here (``spec.warmStart``); a run resuming from a checkpoint keeps the
        record of its first start, and its weights come from the checkpoint in `resume`.
        Under DDP rank 0 alone loads the parent; `wrap` gives every rank its weights.

        With a `probe`, Kiln's guard applies: the warm weights are kept only if their mean
        `loss_fn` on the probe is at most `warm.MAX_LOSS_RATIO` times the cold model's; else
        the decision's alternative parents are tried, then `model` keeps its cold weights.
        A LoRA job (``spec.training.peft``) instead loads its pinned base, wraps `model`'s
        target modules with adapters in place (`warm.lora_start`), and has no guard; on
        ``spec.model.pretrained.uri`` (loaded into `model` already) rank 0 finds those
        weights' zoo record, importing them once with their `measure`d metric, and the best
        adapter on it, and tells the other ranks.

        Args:
            model: the freshly built model (evaluated where it is).
            probe: (inputs, targets) a fixed batch of TRAINING data, e.g. its first 256
                samples, or a `warm.Probe`; None: no guard.
            loss_fn: (outputs, targets) -> mean loss, your loop's (default: cross-entropy over
                the flattened leading dimensions, as Kiln's loop).
            measure: (model) -> (validation accuracy, validation loss), for a LoRA job on
                pretrained weights that imports them (Kiln's loop passes its evaluation).

        Returns:
            What happened: the parent, similarity, transferred tensors, and a sentence.

        Exits with `contract.EXIT_INVALID` (as `job_context`) when a pinned parent is not in
        the zoo, ``$KILN_WARM_START`` is not a decision, or the decided parent can no longer
        be loaded or transformed.
        """
        saved = self._saved
        if self.job.spec.training.peft is not None:  # its base, then the adapters
            main = self.parallel.is_main
            with self._failing():
                record, base = warm.lora_start(self.job, model, self.zoo, main=main,
                                               load=saved is None and main, measure=measure)
            if saved is None and main:
                registration.record_parent_hit(self.zoo, record)
            decided, self.lora_base = self.parallel.broadcast_object(
                (record.model_dump(mode="json"), base))
            record = api.WarmStartDecision.model_validate(decided)
        elif saved is not None and saved.get(checkpoint.WARM_START_KEY):  # weights come from it
            record = api.WarmStartDecision.model_validate(saved[checkpoint.WARM_START_KEY])
        elif self._init_state is not None and saved is None:
            model.load_state_dict(self._init_state, strict=False)
            record = api.WarmStartDecision(outcome=api.WarmStartOutcome.INIT_STATE, reason=(
                f"no warm start: {len(self._init_state)} initial tensors given by the caller"))
        else:  # rank 0 applies the decision and guards it
            chosen, copied = None, set[str]()
            if self.parallel.is_main:
                guard = (warm.Probe(probe[0], probe[1], loss=loss_fn)
                         if isinstance(probe, tuple) else probe)
                with self._failing():
                    chosen = warm.warm_start(self.job, model, self.zoo, decided=self.decided,
                                             probe=guard, data_fingerprint=self.data_fingerprint,
                                             copied=copied)
                registration.record_parent_hit(self.zoo, chosen)
            # every rank's freezer starts from the same copied prefix
            decided, self._copied = self.parallel.broadcast_object(
                (chosen.model_dump(mode="json") if chosen is not None else None, sorted(copied)))
            record = api.WarmStartDecision.model_validate(decided)
        self.warm = record
        self.state.warm_start = record.model_dump(mode="json")
        self.gauges.record_warm_start(record)
        self.emit.info(warm.message(record) + (" (when the job first started; its weights now "
                                               "come from the checkpoint)" if saved is not None
                                               else ""), warm_start_decision=record)
        return record

    def wrap(self, model: nn.Module) -> nn.Module:
        """The module to train under this run's parallelism: `model` itself with one process,
        a DDP wrapper under torchrun with several (it copies rank 0's weights to every rank),
        or, in Kiln's recipe, `model` sharded in place by FSDP.

        Train through what it returns; give `resume`, `freezer` and `finish` the model itself.
        """
        wrapped = replicas.describe(self.parallel.wrap(model), self.state.step)
        if self.parallel.parallelism == "fsdp":
            self._sharded = wrapped
        return wrapped

    def resume(self, model: nn.Module, optimizer: torch.optim.Optimizer, *,
               steps_per_epoch: int,
               scheduler: torch.optim.lr_scheduler.LRScheduler | None = None) -> int:
        """Load the job's checkpoint, if any, into `model`, `optimizer` (and `scheduler`), and
        start the training clock.

        Args:
            model: the model after `warm_start` (not a DDP wrapper of it).
            optimizer: its optimizer (your choice; ``spec.training.optimizer`` is advisory).
            steps_per_epoch: optimizer steps per epoch (progress and freezing cadence).
            scheduler: a learning-rate schedule to checkpoint with them, if any.

        Returns:
            Epochs already done: start your epoch loop there (0 on a fresh start).

        Exits with `contract.EXIT_INVALID` (as `job_context`) when the checkpoint was written
        for another model.
        """
        self._model, self._optimizer, self._scheduler = _unwrapped(model), optimizer, scheduler
        saved = self._saved
        if saved is not None:
            with self._failing():
                checkpoint.restore_model(saved, self.job, self._model, ctx=self.parallel,
                                         wrapped=self._sharded)
                checkpoint.restore_shards(saved, self.location, self.job, self._model,
                                          optimizer, wrapped=self._sharded,
                                          optimizer_name=self._optimizer_name())
                state = checkpoint.restore_training(
                    saved, self.job, optimizer, scheduler, ctx=self.parallel,
                    wrapped=self._sharded, optimizer_name=self._optimizer_name())
            self.amp.load_state_dict(saved.get(precision.CHECKPOINT_KEY))
            self._extra = dict(saved.get(checkpoint.USER_KEY) or {})
            if self.own_loop:  # it starts the interrupted epoch over
                state.epoch_batch = 0
            if self.warm is not None:
                state.warm_start = self.warm.model_dump(mode="json")
            self.state = state
            batches = f" + {state.epoch_batch} batches" if state.epoch_batch else ""
            self.emit.info(f"resumed from {self.location.describe()} at epoch "
                           f"{state.epochs_done}{batches}, step {state.step}")
        elif self.parallel.rank:  # same initial weights everywhere; now each rank its own stream
            runtime.seed_everything(self.job.spec.training.seed + 1_000_003 * self.parallel.rank)
        self.resumed_from = self.state.epochs_done
        # The training clock starts here, after setup, and runs across restarts; checkpoint
        # writes, freezer set-up and zoo registration are excluded, evaluation is included.
        # Time-to-target is its reading when the validation metric first meets the target.
        self.clock = tracking.Clock(offset_seconds=float(saved[checkpoint.ELAPSED_KEY])
                                    if saved is not None else 0.0)
        tensorboard = None
        if self.parallel.is_main and self._reporter is None:
            tensorboard = board.open_board(os.environ, self.job.name, step=self.state.step)
            if tensorboard is not None:
                self._resources.callback(tensorboard.close)
        if self._mlflow and self._tracker is None:
            self._tracker = mlflow_tracking.open_run(
                os.environ, self.job, run_id=self.state.mlflow_run_id, decision=self._record())
            if self._tracker is not None:  # kept in checkpoints: a restart continues the run
                self.state.mlflow_run_id = self._tracker.run_id
        self._reporter = tracking.Reporter(
            self.emit, self.gauges, self.clock, self.state,
            epochs=self.job.spec.training.epochs, steps_per_epoch=steps_per_epoch,
            freezer=self._freezer, tensorboard=tensorboard, mlflow=self._tracker)
        self.gauges.record_training(samples=self.state.samples, steps=self.state.step,
                                    train_loss=None, samples_per_second=0.0)
        self._last_step_seconds = time.perf_counter()
        return self.state.epochs_done

    def freezer(self, model: nn.Module,
                probe: torch.Tensor | data.Splits) -> freezing.Freezer | None:
        """Egeria's layer freezing for `model` (``spec.freezing``), after `resume`.

        The reference process starts from a copy of `model` itself. `trained` then drives the
        freezer; frozen blocks stop receiving gradients, so backward ends at the boundary. On a
        fresh start, the front blocks `warm_start` copied unchanged from the parent start
        frozen or may freeze early (``spec.freezing.transferred``).

        Args:
            model: the model being trained.
            probe: Tensor[b, ...] fixed validation inputs (b >= 2); Kiln's recipe passes the
                splits it loaded (probe from the validation split, activation cache).

        Returns:
            The freezer, or None (freezing off, the run too short, no blocks, or an own loop
            under DDP; said in an info event).

        Raises:
            RuntimeError: called before `resume`.
        """
        if self._reporter is None or self._optimizer is None:
            raise RuntimeError("call JobContext.resume(...) before JobContext.freezer(...)")
        spec, steps_per_epoch = self.job.spec, self._reporter.steps_per_epoch
        if spec.training.peft is not None:
            if spec.freezing.enabled:
                self.emit.info("freezing off: a LoRA job trains only its adapter (the base is "
                               "frozen by design)")
            return None
        if self.own_loop and self.parallel.distributed and spec.freezing.enabled:
            self.emit.info("freezing off: an own loop under DDP trains every layer (its "
                           "wrapper expects a gradient for each parameter)")
            return None
        copied = self._copied if self._saved is None else []  # a resumed run keeps its own
        with self.clock.paused():
            if isinstance(probe, data.Splits):
                self._freezer = freezing_setup.start(self.job, model, probe, self._optimizer,
                                                     steps_per_epoch, self.emit, self.parallel,
                                                     copied=copied)
            else:
                self._freezer = freezing_setup.start_for_model(
                    self.job, model, probe, self._optimizer, steps_per_epoch, self.emit,
                    copied=copied)
        if self._freezer is None:
            return None
        self._resources.callback(self._freezer.close)
        self._reporter.freezer = self._freezer
        saved = self._saved
        if saved is not None and saved.get(freezing.CHECKPOINT_KEY):
            self._freezer.load_state_dict(saved[freezing.CHECKPOINT_KEY], step=self.state.step)
            if self._freezer.boundary:
                self.emit.info(f"kept the frozen prefix {', '.join(self._freezer.frozen_modules)}")
        return self._freezer

    # -- per step and per evaluation -------------------------------------------------------

    @property
    def reporter(self) -> tracking.Reporter:
        """The run's progress reporter (history, metrics, progress events), from `resume` on.

        Raises:
            RuntimeError: before `resume`, or after `finish`.
        """
        return self._started()

    def trained(self, loss: torch.Tensor | float, *, samples: int) -> None:
        """Count one optimizer step on `samples` samples with training loss `loss`.

        Drives the freezer, reports progress every few seconds, and on a stop signal (on any
        rank) saves a checkpoint and exits the process with 128 + the signal. A NaN or infinite
        `loss` exits with `contract.EXIT_INVALID` (as `job_context`), saying the training
        diverged; the last checkpoint is kept.

        Raises:
            RuntimeError: called before `resume`, or after `finish`.
        """
        reporter = self._started()
        value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        with self._failing():
            check_finite("the loss", value, step=self.state.step + 1, location=self.location)
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
        if self.parallel.any_rank(self.stop.is_set()):
            try:
                self.interrupt()
            except Interrupted:
                self.close()
                raise SystemExit(128 + (self._signals[0] if self._signals else signal.SIGTERM))
        if self._stretch[3] >= PROGRESS_INTERVAL_SECONDS:
            self._report_training(announce=True)

    def evaluated(self, *, accuracy: float, loss: float, epoch_end: bool = True) -> bool:
        """Record a validation result (accuracy in [0, 1], mean loss in nats); register the
        best weights so far as a provisional zoo record when ``spec.zoo`` asks.

        Under DDP every rank calls it and rank 0's numbers count.

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
        accuracy, loss = self.parallel.broadcast_object((float(accuracy), float(loss)))
        if not 0.0 <= accuracy <= 1.0:  # also refuses NaN
            raise ValueError(f"evaluated(accuracy={accuracy}): accuracy must be a fraction in "
                             "[0, 1] (correct / total), not a percentage")
        if not (math.isfinite(loss) and loss >= 0.0):
            raise ValueError(f"evaluated(loss={loss}): loss must be a finite mean loss >= 0 "
                             "(nats); a NaN or infinite one means the training diverged: lower "
                             "the learning rate")
        self._report_training(announce=False)
        if epoch_end:
            self.state.epochs_done, self.state.epoch_batch = self.state.epochs_done + 1, 0
        reporter.evaluation(tracking.Evaluation(accuracy=accuracy, loss=loss),
                            self.job.spec.target)
        self._register_provisional()
        return self.state.finished(self.job.spec)

    def checkpoint(self, extra: Mapping[str, Any] | None = None) -> None:
        """Save model, optimizer, schedule, scaler, freezer, RNGs of every rank and position
        (off the clock; `checkpoint.capture`). Under DDP every rank calls it; rank 0 writes.

        Args:
            extra: your own values to keep (tensors, numbers, strings, lists, dicts); `extra`
                returns them after a resume.
        """
        self._started()
        assert self._model is not None and self._optimizer is not None
        if extra is not None:
            self._extra = dict(extra)
        with self.clock.paused():
            saved = checkpoint.capture(
                self.state, self.clock, self.job, self._model, self._optimizer, self._scheduler,
                ctx=self.parallel, wrapped=self._sharded, optimizer_name=self._optimizer_name(),
                amp=self.amp, freezer=self._freezer, user=self._extra, previous=self._written)
            replicas.check(self.parallel, self._model, self.state.step)
            if checkpoint.SHARDS_KEY in saved:  # every rank its shards, then the main object
                with self._failing():
                    shard = checkpoint.save_shards(self.location, saved, self._model,
                                                   self._optimizer, wrapped=self._sharded)
                _log.info("checkpoint shard: %d bytes to %s", shard, self.location.describe())
                self.parallel.barrier()
            if self.parallel.is_main:
                with self._failing():
                    size = checkpoint.save_checkpoint(self.location, saved)
                    checkpoint.drop_previous_shards(self.location, self._written, saved)
                _log.info("checkpoint: %d bytes to %s", size, self.location.describe())
            self._written = {checkpoint.SHARDS_KEY: saved.get(checkpoint.SHARDS_KEY)}
            self.parallel.barrier()

    def interrupt(self) -> NoReturn:
        """Save a checkpoint, say where, and stop.

        Raises:
            Interrupted: always, once the checkpoint is written.
        """
        self.checkpoint()
        self.emit.info(f"{contract.STOPPED_PREFIX} at epoch {self.state.epochs_done + 1}, step "
                       f"{self.state.step}; checkpoint saved to {self.location.describe()}")
        if self._tracker is not None:
            self._tracker.stopped(self.location.describe())
        raise Interrupted(self.location.describe())

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
        if self._model is not None and _unwrapped(model) is not self._model:
            raise ValueError("finish(model): not the model given to JobContext.resume(model, "
                             "...); pass that model, whose weights were trained and checkpointed")
        self._report_training(announce=False)
        spec, state = self.job.spec, self.state
        if not state.history:
            raise RuntimeError("call JobContext.evaluated(accuracy=..., loss=...) before "
                               "JobContext.finish(...): the result needs a validation metric")
        wall_seconds, final, warm_start = self.clock.seconds(), state.history[-1], self._record()
        zoo_model = self._register(_unwrapped(model), final)
        self.parallel.barrier()  # every rank is done with the checkpoint
        if self.parallel.is_main:
            with self._failing():  # a rerun of this job trains afresh
                checkpoint.delete_checkpoint(self.location)
            if self.location is not self._primary and zoo_model:  # the zoo is back
                try:
                    checkpoint.delete_checkpoint(self._primary)
                except zoo_store.StoreUnavailable as exc:
                    _log.warning("could not delete the older checkpoint %s: %s",
                                 self._primary.describe(), exc)
        name = registration.metric_name(spec)
        result = contract.Result(
            metric_name=name, metric=final[name],
            validation_accuracy=final["validation_accuracy"],
            validation_loss=final["validation_loss"], wall_seconds=wall_seconds,
            time_to_target_seconds=state.time_to_target_seconds,
            target_reached=state.time_to_target_seconds is not None,
            epochs_run=state.epochs_done + (1 if state.epoch_batch else 0), steps=state.step,
            samples_per_second=state.samples_per_second(), zoo_model=zoo_model,
            resumed_from_epoch=self.resumed_from, parent=warm_start.parent,
            similarity=warm_start.similarity, warm_start=warm_start.reason,
            freezing=self._freezer.summary() if self._freezer is not None else None,
            warm_start_decision=warm_start)
        self.emit.result(result)
        if self._tracker is not None:
            self._tracker.succeeded(result.to_json())
        self._finished = True
        self.close()
        return result

    def close(self, *, failure: str | None = None) -> None:
        """Stop the freezer's reference process and the metrics endpoint, close the TensorBoard
        log, end an MLflow run still open as failed, leave the process group, and give the stop
        signals back to their previous handlers (idempotent).

        Args:
            failure: why the run ends without a result, for the MLflow run; default the error
                being raised, if any.
        """
        if self._tracker is not None and self._tracker.live:
            # closed while an error propagates (Kiln's recipe, `_failing`): that is the outcome
            self._tracker.failed(failure or _failure(sys.exc_info()[1]))
        self._resources.close()
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers = {}

    # -- helpers -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _failing(self) -> Iterator[None]:
        """An own loop's process exits on what the user must fix (closing the run first, as
        its loop never will); Kiln's recipe raises."""
        if not self.own_loop:
            yield
            return
        try:
            with _exit_as_trainer(self.emit):
                yield
        except SystemExit:
            self.close()
            raise

    def _optimizer_name(self) -> str | None:
        """What a checkpoint says built the optimizer: an own loop's, or the job's (None)."""
        return OWN_OPTIMIZER if self.own_loop else None

    def _record(self) -> api.WarmStartDecision:
        return self.warm or api.WarmStartDecision(outcome=api.WarmStartOutcome.INIT_STATE,
                                                  reason="cold start: warm_start was not called")

    def _register_provisional(self) -> None:
        """The best weights so far as the job's provisional zoo record, when due."""
        if not (self.args.register and self.zoo is not None and self._model is not None
                and registration.provisional_due(self.job.spec, self.state)):
            return
        weights = self.parallel.full_state_dict(self._sharded or self._model, self._model)
        if self.parallel.is_main:  # collective above under FSDP
            self.state.zoo_record_id = registration.register_provisional(
                self.zoo, self.job, self._model, self.state, self._record(), weights=weights,
                content_fingerprint=self.data_fingerprint, base=self.lora_base)

    def _register(self, model: nn.Module, final: dict[str, Any]) -> records.ZooModelId | None:
        """The final zoo record (replacing the provisional one), when the job asks for one.

        A failed write raises `zoo_store.StoreUnavailable` on every rank, naming where the
        finished checkpoint is kept for a rerun to register.
        """
        if not (self.args.register and self.job.spec.zoo.register_model and self.zoo is not None):
            return None
        weights = self.parallel.full_state_dict(self._sharded or model, model)  # FSDP: collective
        zoo_model: records.ZooModelId | None = None
        unavailable: str | None = None
        if self.parallel.is_main:
            try:
                zoo_model = registration.register_model(
                    self.zoo, self.job, model, self.state, final, self._record(),
                    weights=weights, record_id=self.state.zoo_record_id,
                    content_fingerprint=self.data_fingerprint, base=self.lora_base)
            except zoo_store.StoreUnavailable as exc:  # the other ranks wait to hear
                unavailable = str(exc)
        zoo_model, unavailable = self.parallel.broadcast_object(  # rank 0's on every rank
            (zoo_model, unavailable))
        if unavailable is not None:  # the finished checkpoint stays: a rerun registers it
            with self._failing():
                raise zoo_store.StoreUnavailable(
                    "registration failed: zoo unavailable; the model is kept at "
                    f"{self.location.describe()}; rerun the job once the zoo is reachable to "
                    f"register it without retraining ({unavailable})")
        if zoo_model:
            self.emit.info(f"registered zoo model {zoo_model} in {self.zoo.describe()}")
        return zoo_model

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

"""Run tracking: the run's position, the training clock, history and progress reports.

`RunState` is the position a checkpoint carries; `Clock` the training clock; `Reporter` turns
training stretches and evaluations into history, Prometheus metrics, progress events and, when
on, TensorBoard scalars and an MLflow run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kiln import api, contract
from kiln_trainer import board, events, metrics, mlflow_tracking

_log = logging.getLogger(__name__)


@dataclasses.dataclass
class RunState:
    """Position of a run; with model, optimizer and RNG, what a checkpoint holds."""

    epochs_done: int = 0
    epoch_batch: int = 0  # batches of the next epoch already trained
    step: int = 0
    samples: int = 0
    train_seconds: float = 0.0
    time_to_target_seconds: float | None = None
    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    warm_start: dict[str, Any] | None = None  # api.WarmStartDecision, by field name
    zoo_record_id: str | None = None  # its provisional zoo record; the final one reuses it
    mlflow_run_id: str | None = None  # its MLflow run, continued after a restart

    def advance(self, stats: StepStats, *, steps_per_epoch: int) -> None:
        """Count a stretch of training steps; an empty one ends the epoch early."""
        self.step, self.samples = self.step + stats.steps, self.samples + stats.samples
        self.train_seconds += stats.seconds
        self.epoch_batch += stats.steps
        if stats.steps == 0:  # the loader yielded fewer batches than steps_per_epoch
            _log.warning("epoch %d ended after %d of %d batches", self.epochs_done + 1,
                         self.epoch_batch, steps_per_epoch)
            self.epoch_batch = steps_per_epoch

    def finished(self, spec: api.TrainingJobSpec) -> bool:
        """The epochs ran out, or the target was met and the job stops there."""
        stop_at_target = spec.target is not None and spec.target.stop_at_target
        return self.epochs_done >= spec.training.epochs or (
            stop_at_target and self.time_to_target_seconds is not None)

    def evaluated_now(self) -> bool:
        """Whether the latest evaluation saw the current weights."""
        return bool(self.history) and self.history[-1]["step"] == self.step

    def samples_per_second(self) -> float | None:
        """Mean training throughput over all runs (training steps only)."""
        return self.samples / self.train_seconds if self.train_seconds > 0 else None


@dataclasses.dataclass(frozen=True)
class StepStats:
    """What one call of `train_one_epoch` did: steps, samples, summed loss, seconds."""

    steps: int
    samples: int
    loss_sum: float
    seconds: float
    boundary_event: Any = None  # a freezing.controller.Event that ended the stretch, if any
    first_nonfinite_step: int | None = None  # the first step whose loss was NaN or infinite


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """Validation accuracy in [0, 1] and mean cross-entropy in nats."""

    accuracy: float
    loss: float


def target_met(target: api.TargetSpec, evaluation: Evaluation) -> bool:
    """Accuracy >= value, or loss <= value."""
    if target.metric == api.TargetMetric.VALIDATION_ACCURACY:
        return evaluation.accuracy >= target.value
    return evaluation.loss <= target.value


class Clock:
    """The training clock in seconds: starts at `offset_seconds`, excludes `paused()` spans.

    It starts after setup, continues across restarts from the checkpoint's elapsed seconds and
    excludes checkpoint I/O.
    """

    def __init__(
        self, *, offset_seconds: float = 0.0, now: Callable[[], float] = time.monotonic
    ) -> None:
        self._now, self._offset, self._excluded = now, offset_seconds, 0.0
        self._start = float(now())

    def seconds(self) -> float:
        """Training seconds so far, across restarts."""
        return self._offset + float(self._now()) - self._start - self._excluded

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Exclude the enclosed span (checkpoint I/O) from the clock."""
        began = float(self._now())
        try:
            yield
        finally:
            self._excluded += float(self._now()) - began


class Reporter:
    """Turns training and evaluation outcomes into history, metrics and progress events (and
    TensorBoard scalars when given a `board.Board`, an MLflow run's metrics and freezing events
    when given a `mlflow_tracking.Tracker`)."""

    def __init__(self, emit: events.EventWriter, gauges: metrics.MetricsReporter, clock: Clock,
                 state: RunState, *, epochs: int, steps_per_epoch: int,
                 freezer: Any = None, tensorboard: board.Board | None = None,
                 mlflow: mlflow_tracking.Tracker | None = None) -> None:
        self.emit, self.gauges, self.clock, self.state = emit, gauges, clock, state
        self.freezer = freezer  # a freezing.controller.Freezer, or None
        self.tensorboard, self.mlflow = tensorboard, mlflow
        self.epochs, self.steps_per_epoch = epochs, steps_per_epoch
        self.train_loss: float | None = None
        self.samples_per_second: float | None = None
        self._began_seconds, self._began_step = clock.seconds(), state.step

    def training(self, stats: StepStats, *, announce: bool = True) -> None:
        """Record a stretch of training steps; emit a progress event when `announce`."""
        self.train_loss = stats.loss_sum / stats.steps if stats.steps else self.train_loss
        self.samples_per_second = stats.samples / stats.seconds if stats.seconds else None
        self.gauges.record_training(samples=stats.samples, steps=stats.steps,
                                    train_loss=self.train_loss,
                                    samples_per_second=self.samples_per_second or 0.0)
        if announce:
            self._progress()

    def evaluation(self, evaluation: Evaluation, target: api.TargetSpec | None) -> None:
        """Record an evaluation (history, time-to-target) and report progress."""
        state, now = self.state, self.clock.seconds()
        state.history.append({
            "epoch": state.epochs_done, "epoch_batch": state.epoch_batch, "step": state.step,
            "elapsed_seconds": now, "train_loss": self.train_loss,
            "validation_accuracy": evaluation.accuracy, "validation_loss": evaluation.loss,
            "samples_per_second": self.samples_per_second,
            "frozen_modules": self.freezer.boundary if self.freezer is not None else None})
        self.gauges.record_validation(accuracy=evaluation.accuracy, loss=evaluation.loss)
        if self.tensorboard is not None:
            self.tensorboard.evaluation(state.history[-1], step=state.step)
        if self.mlflow is not None:
            self.mlflow.evaluation(state.history[-1], step=state.step)
        _log.info("epoch %d step %d: validation accuracy %.4f, loss %.4f (%.1f s)",
                  state.epochs_done, state.step, evaluation.accuracy, evaluation.loss, now)
        if target and state.time_to_target_seconds is None and target_met(target, evaluation):
            state.time_to_target_seconds = now
            self.emit.info(f"target {target.metric.value} {target.value} reached at epoch "
                           f"{state.epochs_done}, step {state.step}, after {now:.1f} s")
        self._progress(evaluated=True)

    def freezing(self, event: Any) -> None:
        """Announce a frozen-boundary change (a `freezing.controller.Event`) and its effect."""
        freezer, state = self.freezer, self.state
        verb = "froze" if event.kind == "froze" else "unfroze"
        self.emit.info(
            f"{verb} {', '.join(event.modules)} at epoch {state.epochs_done + 1}, step "
            f"{event.step}: {event.reason}; {freezer.boundary}/{len(freezer.partition.blocks)} "
            f"modules frozen, {_share(freezer.partition.backward_flops_fraction(freezer.boundary))}"
            " of backward FLOPs skipped from here")
        self._record_freezing()
        if self.mlflow is not None:
            self.mlflow.freezing([e.to_json() for e in freezer.events], freezer.frozen_modules,
                                 boundary=freezer.boundary, step=event.step)

    def _record_freezing(self) -> None:
        if self.freezer is not None:
            skipped = self.freezer.partition.backward_flops_fraction(self.freezer.boundary)
            self.gauges.record_freezing(
                frozen_modules=self.freezer.boundary,
                frozen_parameters=self.freezer.frozen_parameter_ratio,
                backward_flops_skipped=skipped,
                compute=compute_share(self.freezer.partition.flops,
                                      self.freezer.partition.backward_flops, skipped))

    def _progress(self, *, evaluated: bool = False) -> None:
        state = self.state
        total_steps = self.epochs * self.steps_per_epoch
        left_steps = max(0, (self.epochs - state.epochs_done) * self.steps_per_epoch
                         - state.epoch_batch)
        ran_steps = state.step - self._began_step
        seconds_per_step = (self.clock.seconds() - self._began_seconds) / max(1, ran_steps)
        eta = left_steps * seconds_per_step if ran_steps else None
        last = state.history[-1] if state.history else {}
        epoch = min(self.epochs, state.epochs_done + (1 if state.epoch_batch else 0))
        self.emit.progress(contract.Progress(
            epoch=epoch, epochs=self.epochs, step=state.step,
            steps_per_epoch=self.steps_per_epoch, train_loss=self.train_loss,
            validation_accuracy=last.get("validation_accuracy"),
            validation_loss=last.get("validation_loss"),
            samples_per_second=self.samples_per_second, eta_seconds=eta,
            elapsed_seconds=self.clock.seconds(),
            frozen_modules=self.freezer.boundary if self.freezer is not None else None,
            modules=len(self.freezer.partition.blocks) if self.freezer is not None else None,
            evaluated=evaluated))
        self._record_freezing()
        self.gauges.record_progress(epochs_done=state.epochs_done,
                                    progress=1.0 - left_steps / max(1, total_steps),
                                    eta_seconds=eta or 0.0)


def compute_share(forward: Sequence[float], backward: Sequence[float],
                  backward_skipped: float) -> float:
    """Share of a training step's FLOPs (forward and backward) still done when a frozen prefix
    skips `backward_skipped` of the backward, in (0, 1].

    The whole model's backward-to-forward ratio is read from its blocks' (backward usually
    costs about 2x the forward; 2 when the blocks counted nothing). The prefix's forward is
    counted as done: the activation cache may skip it, but only for samples it holds, so this
    errs towards more compute.

    Args:
        forward: forward FLOPs per sample of each block.
        backward: backward FLOPs per sample of each block.
        backward_skipped: share of the whole backward skipped, in [0, 1].
    """
    ratio = sum(backward) / sum(forward) if sum(forward) > 0 else 2.0
    return 1.0 - min(1.0, max(0.0, backward_skipped)) * ratio / (1.0 + ratio)


def _share(fraction: float) -> str:
    """A fraction as a percentage that never rounds up to 100% or down to 0% (the head always
    trains; a stem's sliver is not nothing): 0.4%, 31%, 99.6%."""
    percent = 100.0 * fraction
    if 0.0 < percent < 1.0 or 99.0 < percent < 100.0:
        return f"{math.floor(percent * 10) / 10:.1f}%"
    return f"{round(percent)}%"

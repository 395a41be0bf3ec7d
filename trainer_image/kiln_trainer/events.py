"""The trainer's stdout protocol: one JSON object per line, the result last.

Readers (the local runner `kiln.local.runner`, and anyone tailing a pod's log) see three events:

  * ``{"event": "progress", "epoch", "epochs", "step", "steps_per_epoch", "train_loss",
    "validation_accuracy", "validation_loss", "samples_per_second", "eta_seconds",
    "elapsed_seconds"}``: after every evaluation and at most every few seconds in between.
    ``epoch`` is the 1-based epoch in progress (equal to ``epochs`` at the end), ``step`` the
    optimizer steps so far (across restarts); metrics not yet known are null.
  * ``{"event": "info", "message"}``: things a person should see (resumed, target reached,
    registered, stopped by a signal).
  * ``{"event": "result", ...}`` (last line, once): the `Result` fields. Kubernetes shows a
    container's termination message in its status, so the same JSON also goes to
    ``/dev/termination-log`` when that file exists (kept under its 4 KiB limit). On a permanent
    failure the termination log gets ``{"event": "error", "message"}`` instead.

Non-finite numbers (a diverged loss) are written as null so every line is strict JSON. Human
logs go to stderr through `logging`, never here.

Callers: `kiln_trainer.loop` and `kiln_trainer.cli`. Non-goals: no parsing (readers own it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from pathlib import Path
from typing import Any, TextIO

_log = logging.getLogger(__name__)

# Where Kubernetes reads a container's termination message (the pod's terminationMessagePath);
# KILN_TERMINATION_LOG moves it (the e2e tests' kubelet gives each pod a scratch file).
TERMINATION_LOG = Path(os.environ.get("KILN_TERMINATION_LOG") or "/dev/termination-log")
# Kubernetes keeps at most 4096 bytes of a termination message; stay clear of the edge.
TERMINATION_LOG_MAX_BYTES = 4000


@dataclasses.dataclass(frozen=True)
class Progress:
    """One progress report (see the module docstring for field meanings; seconds, ratios)."""

    epoch: int
    epochs: int
    step: int
    steps_per_epoch: int
    train_loss: float | None
    validation_accuracy: float | None
    validation_loss: float | None
    samples_per_second: float | None
    eta_seconds: float | None
    elapsed_seconds: float
    frozen_modules: int | None = None  # front modules frozen now (None: freezing off)
    modules: int | None = None  # natural blocks of the model (None: freezing off)


@dataclasses.dataclass(frozen=True)
class Result:
    """The outcome of a training run.

    Attributes:
        metric_name: the target metric, or validation_accuracy without a target.
        metric: its final value.
        validation_accuracy: final validation accuracy in [0, 1] (token accuracy for LMs).
        validation_loss: final mean validation cross-entropy in nats.
        wall_seconds: training clock of all runs (checkpoint and zoo I/O excluded).
        time_to_target_seconds: training clock when the target was first met; None if never.
        target_reached: whether the final or any earlier evaluation met the target.
        epochs_run: epochs completed, across restarts.
        steps: optimizer steps, across restarts.
        samples_per_second: mean training throughput (training steps only).
        zoo_model: the registered zoo id, or None.
        resumed_from_epoch: epochs already done when this process resumed; 0 if fresh.
        parent: the zoo model the run warm-started from, or None (cold start).
        similarity: architectural similarity to that parent (or the best match) in [0, 1].
        warm_start: one sentence: which parent and how much transferred, or why cold.
        freezing: `freezing.controller.Freezer.summary()` (frozen modules, boundary events,
            mean skipped backward-FLOPs share, estimated saved seconds, reference CPU seconds);
            None when freezing was off.
    """

    metric_name: str
    metric: float | None
    validation_accuracy: float | None
    validation_loss: float | None
    wall_seconds: float
    time_to_target_seconds: float | None
    target_reached: bool
    epochs_run: int
    steps: int
    samples_per_second: float | None
    zoo_model: str | None
    resumed_from_epoch: int
    parent: str | None = None
    similarity: float | None = None
    warm_start: str = ""
    freezing: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        """The result as a JSON-ready dict (no "event" key)."""
        return {k: _finite(v) for k, v in dataclasses.asdict(self).items()}


class EventWriter:
    """Writes protocol events to a text stream, flushing each line.

    Args:
        out: the stream (the process's stdout).
        termination_log: file for the result when it exists; None disables it.
    """

    def __init__(self, out: TextIO, *, termination_log: Path | None = TERMINATION_LOG) -> None:
        self.out = out
        self.termination_log = termination_log

    def progress(self, progress: Progress) -> None:
        """Emit a progress event."""
        self._emit({"event": "progress", **dataclasses.asdict(progress)})

    def info(self, message: str) -> None:
        """Emit an info event (one sentence for a person)."""
        self._emit({"event": "info", "message": message})

    def result(self, result: Result) -> None:
        """Emit the result (last line) and copy it to the termination log."""
        event = {"event": "result", **result.to_json()}
        self._emit(event)
        self._terminate(event)

    def failure(self, message: str) -> None:
        """Put a permanent error in the termination log (stdout gets nothing: no result)."""
        self._terminate({"event": "error", "message": message[: TERMINATION_LOG_MAX_BYTES // 2]})

    def _emit(self, event: dict[str, Any]) -> None:
        line = json.dumps({k: _finite(v) for k, v in event.items()}, allow_nan=False)
        self.out.write(line + "\n")
        self.out.flush()

    def _terminate(self, event: dict[str, Any]) -> None:
        if self.termination_log is None or not self.termination_log.exists():
            return
        event = {k: _finite(v) for k, v in event.items()}
        data = json.dumps(event, allow_nan=False).encode("utf-8")
        if len(data) > TERMINATION_LOG_MAX_BYTES and isinstance(event.get("freezing"), dict):
            # the freezing history is the only open-ended part: keep the JSON whole without it
            event["freezing"] = {k: v for k, v in event["freezing"].items() if k != "events"}
            data = json.dumps(event, allow_nan=False).encode("utf-8")
        data = data[:TERMINATION_LOG_MAX_BYTES]
        try:
            self.termination_log.write_bytes(data)
        except OSError as exc:  # read-only or gone: the result is on stdout anyway
            _log.warning("could not write %s: %s", self.termination_log, exc)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value

"""kiln_trainer.events: the trainer writes contract events to stdout and the termination log."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from pathlib import Path

import pytest

from kiln import contract
from kiln_trainer import events

RESULT = contract.Result(
    metric_name="validation_accuracy", metric=0.97, validation_accuracy=0.97,
    validation_loss=0.1, wall_seconds=12.5, time_to_target_seconds=8.0, target_reached=True,
    epochs_run=3, steps=60, samples_per_second=900.0, zoo_model="small_cnn-0123abcd",
    resumed_from_epoch=0,
)


def test_every_event_is_one_strict_json_line_and_nan_becomes_null(tmp_path: Path) -> None:
    out = io.StringIO()
    writer = events.EventWriter(out, termination_log=tmp_path / "absent")
    writer.info("hello")
    writer.progress(contract.Progress(
        epoch=1, epochs=3, step=20, steps_per_epoch=20, train_loss=float("nan"),
        validation_accuracy=None, validation_loss=None, samples_per_second=10.0,
        eta_seconds=None, elapsed_seconds=1.0))
    writer.result(RESULT)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [line["event"] for line in lines] == ["info", "progress", "result"]
    assert lines[1]["train_loss"] is None
    assert set(lines[1]) == {"event", "epoch", "epochs", "step", "steps_per_epoch", "train_loss",
                             "validation_accuracy", "validation_loss", "samples_per_second",
                             "eta_seconds", "elapsed_seconds", "frozen_modules", "modules",
                             "evaluated"}
    assert set(lines[2]) == {"event", "metric_name", "metric", "validation_accuracy",
                             "validation_loss", "wall_seconds", "time_to_target_seconds",
                             "target_reached", "epochs_run", "steps", "samples_per_second",
                             "zoo_model", "resumed_from_epoch", "parent", "similarity",
                             "warm_start", "freezing", "warm_start_decision"}
    assert not (tmp_path / "absent").exists()


def test_result_goes_to_an_existing_termination_log_under_4_kib(tmp_path: Path) -> None:
    log = tmp_path / "termination-log"
    log.touch()
    events.EventWriter(io.StringIO(), termination_log=log).result(RESULT)
    text = log.read_text()
    assert len(text.encode()) < 4096
    assert json.loads(text)["zoo_model"] == "small_cnn-0123abcd"


def test_failure_goes_to_the_termination_log_only(tmp_path: Path) -> None:
    log, out = tmp_path / "termination-log", io.StringIO()
    log.touch()
    events.EventWriter(out, termination_log=log).failure("spec.dataset.path: x" * 1000)
    assert out.getvalue() == ""
    assert json.loads(log.read_text())["event"] == "error"
    assert len(log.read_bytes()) < 4096


def test_a_long_freezing_history_is_dropped_from_the_termination_log_not_cut(
        tmp_path: Path) -> None:
    log = tmp_path / "termination-log"
    log.write_text("")
    history = [{"kind": "froze", "modules": [f"features.{i}" for i in range(40)], "step": i,
                "boundary": i, "reason": "x" * 200} for i in range(8)]
    result = dataclasses.replace(RESULT, freezing={"events": history, "saved_seconds": 3.5})
    events.EventWriter(io.StringIO(), termination_log=log).result(result)
    written = json.loads(log.read_text())  # whole JSON, not a cut-off prefix
    assert written["freezing"] == {"saved_seconds": 3.5}
    assert written["metric"] == RESULT.metric


def test_a_reader_that_closed_the_pipe_gets_one_warning_not_a_traceback_per_event(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import os

    read, write = os.pipe()
    os.close(read)  # the local runner stopped reading (interrupted while we start)
    with open(write, "w", encoding="utf-8") as out:
        writer = events.EventWriter(out, termination_log=tmp_path / "absent")
        with caplog.at_level("WARNING", logger=events.__name__):
            writer.info("first")
            writer.info("second")
            writer.result(RESULT)
        assert [r.getMessage() for r in caplog.records] == [
            "the events' reader closed stdout; later events are not written"]
        with contextlib.suppress(BrokenPipeError):  # what is left in the buffer has no reader
            out.close()

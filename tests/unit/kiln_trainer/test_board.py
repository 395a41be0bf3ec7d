"""`kiln_trainer.board`: TensorBoard scalars when KILN_TENSORBOARD_DIR is set, and a clear warning
(training goes on) when the `tensorboard` package is missing."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kiln_trainer import board


def test_no_variable_no_board(tmp_path: Path) -> None:
    assert board.open_board({}, "job", step=0) is None
    assert board.open_board({"KILN_TENSORBOARD_DIR": " "}, "job", step=0) is None


def test_evaluations_become_scalars_readable_by_tensorboard(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")  # the `tensorboard` extra (in `test`)
    from tensorboard.backend.event_processing import event_accumulator

    written = board.open_board({"KILN_TENSORBOARD_DIR": str(tmp_path)}, "digits-warm", step=0)
    assert written is not None
    for step, accuracy in ((10, 0.5), (20, 0.75)):
        written.evaluation({"train_loss": 1.0 / step, "validation_accuracy": accuracy,
                            "validation_loss": None, "elapsed_seconds": step / 10}, step=step)
    written.close()
    events = event_accumulator.EventAccumulator(str(tmp_path / "digits-warm"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert sorted(tags) == ["loss/train", "metrics/validation_accuracy", "time/training_seconds"]
    points = events.Scalars("metrics/validation_accuracy")
    assert [(p.step, p.value) for p in points] == [(10, 0.5), (20, 0.75)]


@pytest.mark.process
def test_without_the_package_a_warning_names_the_extra_and_training_goes_on(
        tmp_path: Path) -> None:
    # A subprocess whose import system refuses `tensorboard`, as an environment without it.
    script = textwrap.dedent(f"""
        import importlib.abc, logging, sys
        class NoTensorBoard(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "tensorboard":
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        sys.meta_path.insert(0, NoTensorBoard())
        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        from kiln_trainer import board
        print(board.open_board({{"KILN_TENSORBOARD_DIR": {str(tmp_path)!r}}}, "job", step=0))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=False, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "None"
    assert "KILN_TENSORBOARD_DIR is set but TensorBoard is not installed" in done.stderr
    assert "'kiln-operator[tensorboard]'" in done.stderr
    assert not (tmp_path / "job").exists()


def test_an_unwritable_folder_is_a_warning_not_a_failure(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("tensorboard")
    blocker = tmp_path / "file"
    blocker.write_text("not a folder", encoding="utf-8")
    with caplog.at_level(logging.WARNING):
        assert board.open_board({"KILN_TENSORBOARD_DIR": str(blocker)}, "job", step=0) is None
    assert "point it at a writable folder" in caplog.text

"""Optional TensorBoard logging: each evaluation's numbers as scalars under
`$KILN_TENSORBOARD_DIR/<job>`, when that variable is set and the `tensorboard` package (the
`kiln-operator[tensorboard]` extra) is installed. It never stops training.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kiln import contract

_log = logging.getLogger(__name__)

# history key -> scalar tag; tags group as "loss/..." and "metrics/..." panels in TensorBoard.
TAGS = {"train_loss": "loss/train", "validation_loss": "loss/validation",
        "validation_accuracy": "metrics/validation_accuracy",
        "samples_per_second": "throughput/samples_per_second",
        "frozen_modules": "freezing/frozen_modules",
        "elapsed_seconds": "time/training_seconds"}


class Board:
    """Writes evaluations as TensorBoard scalars at their optimizer step.

    Args:
        writer: a `torch.utils.tensorboard.SummaryWriter` (or anything with its
            `add_scalar`, `flush` and `close`).
    """

    def __init__(self, writer: Any) -> None:
        self.writer = writer

    def evaluation(self, values: Mapping[str, Any], *, step: int) -> None:
        """Write the known `values` (keys of `TAGS`; None ones skipped) at `step`. The training
        clock is a scalar of its own: TensorBoard's wall time counts setup and restarts too."""
        for key, tag in TAGS.items():
            value = values.get(key)
            if isinstance(value, int | float):
                self.writer.add_scalar(tag, float(value), global_step=step)
        self.writer.flush()  # a crash or a kill keeps what was evaluated

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()


def open_board(environ: Mapping[str, str], job_name: str, *, step: int) -> Board | None:
    """A `Board` writing under `$KILN_TENSORBOARD_DIR/<job_name>`, or None when the variable is
    unset, empty, or TensorBoard is missing or cannot write there (then a warning says why and
    how to fix it, and training goes on).

    Args:
        environ: the process environment.
        job_name: the run's folder name, so several jobs show as runs side by side.
        step: the step training (re)starts at; points logged past it by an earlier attempt
            are hidden (TensorBoard's purge_step), so a resumed run draws one line.
    """
    folder = environ.get(contract.Env.TENSORBOARD_DIR, "").strip()
    if not folder:
        return None
    try:
        from torch.utils import tensorboard  # imports the `tensorboard` package
    except ImportError as exc:
        _log.warning("%s is set but TensorBoard is not installed (%s); install "
                     "'kiln-operator[tensorboard]' (pip install tensorboard) in the trainer's "
                     "environment; training continues without it",
                     contract.Env.TENSORBOARD_DIR.value, exc)
        return None
    log_dir = Path(folder) / job_name
    try:
        writer = tensorboard.SummaryWriter(log_dir=str(log_dir), purge_step=step or None)
    except OSError as exc:
        _log.warning("%s=%s: cannot write TensorBoard logs in %s (%s); point it at a writable "
                     "folder; training continues without them", contract.Env.TENSORBOARD_DIR.value,
                     folder, log_dir, exc.strerror or exc)
        return None
    _log.info("TensorBoard logs in %s (tensorboard --logdir %s)", log_dir, folder)
    return Board(writer)


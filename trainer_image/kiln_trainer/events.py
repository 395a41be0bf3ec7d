"""The trainer's side of the event protocol: write `kiln.contract` events to stdout and the
termination log. Human logs go to stderr through `logging`, never here.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TextIO

from kiln import api, contract

_log = logging.getLogger(__name__)

# Where this process writes its termination message (the e2e tests' kubelet moves it).
TERMINATION_LOG = Path(os.environ.get(contract.Env.TERMINATION_LOG)
                       or contract.TERMINATION_LOG_PATH)


class EventWriter:
    """Writes protocol events to a text stream, flushing each line.

    Args:
        out: the stream (the process's stdout).
        termination_log: file for the result (or profile, or failure) when it exists; None
            disables it.
    """

    def __init__(self, out: TextIO, *, termination_log: Path | None = TERMINATION_LOG) -> None:
        self.out = out
        self.termination_log = termination_log
        self._reader_gone = False

    def progress(self, progress: contract.Progress) -> None:
        """Emit a progress event."""
        self._emit(progress)

    def info(self, message: str, *, warm_start_decision: api.WarmStartDecision | None = None
             ) -> None:
        """Emit an info event (one sentence for a person; the warm-start decision applied)."""
        self._emit(contract.Info(message, warm_start_decision=warm_start_decision))

    def result(self, result: contract.Result) -> None:
        """Emit the result (last line) and copy it to the termination log."""
        self._emit(result)
        self._terminate(result)

    def profile(self, profile: contract.Profile) -> None:
        """Emit the profiling step's outcome (its only line) and copy it to the termination
        log."""
        self._emit(profile)
        self._terminate(profile)

    def failure(self, message: str) -> None:
        """Put a permanent error in the termination log (stdout gets nothing: no result)."""
        self._terminate(contract.Failure(message))

    def _emit(self, event: contract.Event) -> None:
        if self._reader_gone:
            return
        try:
            self.out.write(contract.to_line(event) + "\n")
            self.out.flush()
        except BrokenPipeError:
            # Whoever read our events stopped (a local run interrupted while we start): it is
            # stopping us too, and a traceback per later event would bury why in the log.
            self._reader_gone = True
            _log.warning("the events' reader closed stdout; later events are not written")

    def _terminate(self, event: contract.Result | contract.Failure | contract.Profile) -> None:
        if self.termination_log is None or not self.termination_log.exists():
            return
        try:
            self.termination_log.write_bytes(contract.termination_message(event))
        except OSError as exc:  # read-only or gone: the result is on stdout anyway
            _log.warning("could not write %s: %s", self.termination_log, exc)

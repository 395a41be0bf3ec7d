"""Waiting for a file a running `kiln` or trainer process writes (a checkpoint, a marker its
model's code leaves), failing at once with the process's output if it exits first.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path


def file_from(process: subprocess.Popen[str], path: Path, *, timeout: float, what: str) -> None:
    """Return once `path` exists; fail if `process` ends first or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, f"{what} never appeared: {path}"
        time.sleep(0.05)

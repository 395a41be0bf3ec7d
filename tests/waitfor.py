"""Waiting for a file a running `kiln` or trainer process writes (a checkpoint, a marker its
model's code leaves), failing at once with the process's output if it exits first.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from kubesim import client


def file_from(process: subprocess.Popen[str], path: Path, *, timeout: float, what: str) -> None:
    """Return once `path` exists; fail if `process` ends first or `timeout` seconds pass."""

    def there() -> bool:
        assert process.poll() is None, process.communicate()
        return path.exists()

    client.wait_until(there, timeout_seconds=timeout, what=f"{what} at {path}", poll_seconds=0.05)

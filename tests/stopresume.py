"""Stop a training script with SIGTERM, as a node drain stops its pod, once it has evaluated
its first epoch: the harness the Hugging Face and Lightning script tests share.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from kiln import contract


def stop_after_first_evaluation(command: Sequence[str], *, cwd: Path, env: Mapping[str, str],
                                timeout: float) -> None:
    """Run `command` and send it SIGTERM when it reports its first evaluated epoch.

    Asserts that it exits with 128 + SIGTERM and that its last event says it stopped.
    """
    process = subprocess.Popen(list(command), cwd=cwd, env=dict(env), stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True)
    assert process.stdout is not None
    for line in process.stdout:  # a resume starts after the epoch evaluated
        event = contract.from_line(line)
        if isinstance(event, contract.Progress) and event.evaluated:
            break
    process.send_signal(signal.SIGTERM)
    rest, _ = process.communicate(timeout=timeout)
    assert process.returncode == 128 + signal.SIGTERM, rest[-2000:]
    stopped = [e.message for e in map(contract.from_line, rest.splitlines())
               if isinstance(e, contract.Info)]
    assert stopped and stopped[-1].startswith(contract.STOPPED_PREFIX), rest[-2000:]

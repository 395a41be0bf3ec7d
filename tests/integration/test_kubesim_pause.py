"""The e2e harness's process control (`kubesim.pause`) on a real process group: a gate stops it
while any reason holds, and a throttle alternates it between stopped and running."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubesim import client, pause


def _state(pid: int) -> str:
    """The process's state letter from /proc (T: stopped)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0]


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                               start_new_session=True)
    yield process
    process.kill()
    process.wait()


def test_a_share_is_read_from_the_environment_and_a_bad_one_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(pause.TRAINER_SHARE_ENV, raising=False)
    assert pause.share_from_env(pause.TRAINER_SHARE_ENV) == 1.0
    monkeypatch.setenv(pause.TRAINER_SHARE_ENV, "0.33")
    assert pause.share_from_env(pause.TRAINER_SHARE_ENV) == 0.33
    for bad in ("0", "1.5", "third", "nan"):
        monkeypatch.setenv(pause.TRAINER_SHARE_ENV, bad)
        with pytest.raises(ValueError, match=f"{pause.TRAINER_SHARE_ENV}='{bad}'.*in \\(0, 1\\]"):
            pause.share_from_env(pause.TRAINER_SHARE_ENV)


def test_a_gate_keeps_the_group_stopped_until_its_last_reason_goes(
    sleeper: subprocess.Popen[bytes],
) -> None:
    gate = pause.Gate(sleeper.pid)
    gate.stop("held")
    client.wait_until(lambda: _state(sleeper.pid) == "T", timeout_seconds=10, what="stopped")
    gate.stop(pause.THROTTLED)
    gate.go("held")
    assert _state(sleeper.pid) == "T" and gate.stopped_by(pause.THROTTLED)
    gate.go(pause.THROTTLED)
    client.wait_until(lambda: _state(sleeper.pid) != "T", timeout_seconds=10, what="continued")


def test_a_throttle_alternates_stopped_and_running_until_the_group_leaves_it(
    sleeper: subprocess.Popen[bytes],
) -> None:
    throttle = pause.Throttle(0.5, period_seconds=0.2)
    gate = pause.Gate(sleeper.pid)
    try:
        throttle.add(gate)
        for stopped in (True, False, True):
            client.wait_until(lambda s=stopped: (_state(sleeper.pid) == "T") == s,
                              timeout_seconds=10, poll_seconds=0.01,
                              what="stopped" if stopped else "running")
        throttle.remove(gate)
        client.wait_until(lambda: _state(sleeper.pid) != "T", timeout_seconds=10,
                          what="continued once removed")
        assert not gate.stopped_by(pause.THROTTLED)
    finally:
        throttle.stop()

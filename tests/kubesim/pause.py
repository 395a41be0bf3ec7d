"""Stopping and continuing process groups: a process held where the test wants it, and a
throttle that runs processes only a share of the time (a machine that runs them slower).

The share comes from the environment (`share_from_env`): ``KUBESIM_TRAINER_SHARE`` for the pods
the test kubelet runs, ``KUBESIM_OPERATOR_SHARE`` for the operator process.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

TRAINER_SHARE_ENV = "KUBESIM_TRAINER_SHARE"
OPERATOR_SHARE_ENV = "KUBESIM_OPERATOR_SHARE"
# Short against a step's pace in the operator's loops (0.5 s housekeeping, 1 s placement), so
# a throttled process is slower rather than late in bursts.
PERIOD_SECONDS = 0.3
THROTTLED = "throttled"


def share_from_env(name: str) -> float:
    """The share of the time a process may run, from environment variable `name` (1: always).

    Raises:
        ValueError: the value is not a number in (0, 1].
    """
    text = os.environ.get(name, "").strip()
    if not text:
        return 1.0
    try:
        share = float(text)
    except ValueError:
        share = float("nan")
    if not 0.0 < share <= 1.0:
        raise ValueError(f"{name}={text!r}: set it to the share of the time a process may run, "
                         "in (0, 1] (0.33: three times slower), or leave it unset")
    return share


class Gate:
    """One process group, stopped (SIGSTOP) while any reason holds, continued (SIGCONT) when
    the last reason goes. Thread-safe: the throttle and the kubelet share a gate."""

    def __init__(self, pgid: int) -> None:
        self.pgid = pgid
        self._reasons: set[str] = set()
        self._lock = threading.Lock()

    def stop(self, reason: str) -> None:
        with self._lock:
            if not self._reasons:
                _signal_group(self.pgid, signal.SIGSTOP)
            self._reasons.add(reason)

    def go(self, reason: str) -> None:
        with self._lock:
            if reason not in self._reasons:
                return
            self._reasons.discard(reason)
            if not self._reasons:
                _signal_group(self.pgid, signal.SIGCONT)

    def stopped_by(self, reason: str) -> bool:
        with self._lock:
            return reason in self._reasons


class Throttle:
    """Lets the gates' groups run only `share` of every `period_seconds` (all in step), from a
    daemon thread: a machine `1 / share` times slower for them. A share of 1 does nothing.
    The periods stretch when this process is starved, which only lengthens the run phase."""

    def __init__(self, share: float, period_seconds: float = PERIOD_SECONDS) -> None:
        self.share = share
        self.period_seconds = period_seconds
        self._gates: set[Gate] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="kubesim-throttle", daemon=True)
        if share < 1.0:
            self._thread.start()

    def add(self, gate: Gate) -> None:
        if self.share < 1.0:
            with self._lock:
                self._gates.add(gate)

    def remove(self, gate: Gate) -> None:
        """Stop throttling the gate's group (continued, unless another reason holds it)."""
        with self._lock:
            self._gates.discard(gate)
        gate.go(THROTTLED)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        with self._lock:
            gates, self._gates = list(self._gates), set()
        for gate in gates:
            gate.go(THROTTLED)

    def _main(self) -> None:
        run, rest = self.share * self.period_seconds, (1 - self.share) * self.period_seconds
        while not self._stop.is_set():
            self._each(Gate.go)
            if self._stop.wait(run):
                break
            self._each(Gate.stop)
            self._stop.wait(rest)

    def _each(self, action: Callable[[Gate, str], None]) -> None:
        # Under the lock, so a gate `remove` returned for is never stopped again.
        with self._lock:
            for gate in self._gates:
                action(gate, THROTTLED)


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass  # it has exited

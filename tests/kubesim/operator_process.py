"""The real operator as a subprocess: ``python -m kiln.controller --kubeconfig ...``.

A subprocess is what runs in production, and its memory can be measured on its own. `start`
waits until kopf watches TrainingJobs and pods; `stop` sends SIGTERM, `kill` SIGKILL (a crash).
With a share below 1 (``KUBESIM_OPERATOR_SHARE``) it runs only that share of the time: an
operator slower against the trainers, as on a machine that trains faster.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from kubesim import client, emulator, pause

START_SECONDS = 120.0  # importing torch and kopf on a loaded 2-core machine



class OperatorProcess:
    """One run of the operator, with its liveness and metrics endpoints on free ports.

    Args:
        cluster: the emulator it talks to.
        work_dir: where the kubeconfig and the log go.
        args: extra `kiln operator` options.
        env: extra environment (zoo endpoint and credentials).
        share: the share of the time it runs (`pause.Throttle`); None: ``KUBESIM_OPERATOR_SHARE``,
            else 1.
    """

    def __init__(self, cluster: emulator.Emulator, work_dir: Path, *, args: list[str],
                 env: dict[str, str] | None = None, name: str = "operator",
                 share: float | None = None) -> None:
        self.cluster = cluster
        work_dir.mkdir(parents=True, exist_ok=True)
        self.kubeconfig = cluster.write_kubeconfig(work_dir / "kubeconfig")
        self.log_path = work_dir / f"{name}.log"
        self.args = args
        self.env = env or {}
        self.metrics_port = client.free_port()
        self.liveness_port = client.free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.share = pause.share_from_env(pause.OPERATOR_SHARE_ENV) if share is None else share
        self._throttle: pause.Throttle | None = None
        self._runs = 0

    def start(self) -> OperatorProcess:
        """Start it and wait until it watches TrainingJobs and pods.

        Raises:
            AssertionError: it exited, or did not start watching within START_SECONDS.
        """
        since = time.monotonic()
        self._runs += 1
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **self.env}
        env.pop("KUBECONFIG", None)
        with self.log_path.open("ab") as log:
            log.write(f"--- run {self._runs} ---\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                [sys.executable, "-m", "kiln.controller", "--kubeconfig", str(self.kubeconfig),
                 "--metrics-port", str(self.metrics_port), "--metrics-host", "127.0.0.1",
                 "--liveness-port", str(self.liveness_port), "--liveness-host", "127.0.0.1",
                 *self.args],
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self._throttle = pause.Throttle(self.share)  # its own group: its helper processes too
        self._throttle.add(pause.Gate(self.process.pid))

        def watching() -> bool:
            assert self.process is not None
            if self.process.poll() is not None:
                raise AssertionError(f"the operator exited with {self.process.returncode}:\n"
                                     f"{self.log_tail()}")
            watches = {r.resource for r in self.cluster.requests
                       if r.seconds >= since and r.action == "WATCH"}
            return {"trainingjobs", "pods"} <= watches

        client.wait_until(watching, timeout_seconds=START_SECONDS,
                            what="the operator to watch trainingjobs and pods",
                            details=self.log_tail)
        return self

    def stop(self) -> int:
        """SIGTERM, then wait (kopf stops gracefully); returns the exit code."""
        return self._end(signal.SIGTERM)

    def kill(self) -> int:
        """SIGKILL: the operator dies mid-work, as in a node failure."""
        return self._end(signal.SIGKILL)

    def _end(self, signum: int) -> int:
        if self._throttle is not None:
            self._throttle.stop()  # continued: it acts on the signal at once
            self._throttle = None
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else 0
        self.process.send_signal(signum)
        try:
            return self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def log_tail(self, lines: int = 60) -> str:
        if not self.log_path.exists():
            return "(no operator log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def metrics(self) -> str:
        """The operator's /metrics exposition."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as answer:
            text: str = answer.read().decode()
            return text

    def healthz_status(self) -> int:
        """HTTP status of the liveness endpoint."""
        url = f"http://127.0.0.1:{self.liveness_port}/healthz"
        with urllib.request.urlopen(url, timeout=10) as answer:
            status: int = answer.status
            return status

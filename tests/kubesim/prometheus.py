"""A real Prometheus server for tests: Debian's ``prometheus`` binary as a subprocess.

The dashboard's PromQL is evaluated by the real thing. One scrape job per `ScrapeJob` (1 s
interval), targets from a file_sd file the test rewrites (`set_targets`); `query` runs an
instant query. No rules, alerting, remote storage or Kubernetes service discovery.
"""

# `service_monitor_target` and `pod_monitor_target` give a target the labels the Prometheus
# Operator attaches (namespace, pod, container, endpoint, job, instance; a ServiceMonitor's also
# service), naming the scraped pod, not what its series are about. Without ``honor_labels`` an
# exposed label of the same name is renamed ``exported_<name>``; with it, the exposed one wins.
# `query` returns the decoded answer, errors included (a query that does not parse answers
# ``status: error``).

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kubesim import client

DEBIAN_BINARY = "/usr/bin/prometheus"
START_SECONDS = 60.0
INSTALL_HINT = ("the Prometheus server binary is missing: install Debian's package with "
                "`apt-get install prometheus` (`make test` does)")


class PrometheusMissing(RuntimeError):
    """No ``prometheus`` binary on this machine (the message says how to install it)."""


@dataclasses.dataclass(frozen=True)
class ScrapeJob:
    """One scrape job, its targets read from ``<name>.json`` in the work directory.

    Attributes:
        name: the job_name (the ``job`` target label, unless a target sets its own).
        honor_labels: keep the target's exposed labels on conflicts (Prometheus'
            ``honor_labels``; ServiceMonitor/PodMonitor ``honorLabels``).
    """

    name: str
    honor_labels: bool = False


@dataclasses.dataclass(frozen=True)
class Target:
    """A ``host:port`` to scrape at /metrics, with target labels (e.g. pod, namespace)."""

    address: str
    labels: dict[str, str] = dataclasses.field(default_factory=dict)


def service_monitor_target(address: str, *, namespace: str, pod: str, service: str,
                           endpoint: str, container: str) -> Target:
    """`address` with the target labels a ServiceMonitor endpoint gives it: the pod's
    namespace, pod, container, the Service, the port name as endpoint, the Service name as job
    (no jobLabel set) and the address as instance."""
    return Target(address, {"namespace": namespace, "pod": pod, "container": container,
                            "service": service, "endpoint": endpoint, "job": service,
                            "instance": address})


def pod_monitor_target(address: str, *, namespace: str, pod: str, monitor: str,
                       endpoint: str, container: str) -> Target:
    """`address` with the target labels a PodMonitor endpoint gives it: the pod's namespace,
    pod, container, the port name as endpoint, ``<monitor's namespace>/<monitor>`` as job and
    the address as instance."""
    return Target(address, {"namespace": namespace, "pod": pod, "container": container,
                            "endpoint": endpoint, "job": monitor, "instance": address})


def binary() -> str:
    """Path of the prometheus binary.

    Raises:
        PrometheusMissing: not installed.
    """
    found = shutil.which("prometheus") or (DEBIAN_BINARY if os.access(DEBIAN_BINARY, os.X_OK)
                                           else None)
    if found is None:
        raise PrometheusMissing(INSTALL_HINT)
    return found


class Prometheus:
    """One Prometheus server on 127.0.0.1 at a free port, its TSDB in `work_dir`.

    Args:
        work_dir: config, target files, TSDB and log go here.
        jobs: the scrape jobs.
        scrape_interval_seconds: scrape interval (and timeout) of every job.
    """

    def __init__(self, work_dir: Path, *, jobs: Sequence[ScrapeJob],
                 scrape_interval_seconds: float = 1.0) -> None:
        self.work_dir = work_dir
        self.jobs = {job.name: job for job in jobs}
        self.scrape_interval_seconds = scrape_interval_seconds
        self.port = client.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = work_dir / "prometheus.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> Prometheus:
        """Write the config and empty target files, start the server, wait until ready.

        Raises:
            PrometheusMissing: no binary.
            AssertionError: it exited, or was not ready within START_SECONDS.
        """
        executable = binary()
        self.work_dir.mkdir(parents=True, exist_ok=True)
        interval = f"{self.scrape_interval_seconds:g}s"
        config = {
            "global": {"scrape_interval": interval, "scrape_timeout": interval,
                       "evaluation_interval": interval},
            "scrape_configs": [{
                "job_name": job.name, "honor_labels": job.honor_labels,
                "file_sd_configs": [{"files": [str(self._targets_path(job.name))],
                                     "refresh_interval": interval}],
            } for job in self.jobs.values()],
        }
        config_path = self.work_dir / "prometheus.yml"
        config_path.write_text(json.dumps(config, indent=1))  # JSON is YAML
        for name in self.jobs:
            self.set_targets(name, [])
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [executable, f"--config.file={config_path}",
                 f"--storage.tsdb.path={self.work_dir / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, cwd=self.work_dir)
        client.wait_until(self._ready, timeout_seconds=START_SECONDS,
                          what=f"Prometheus to be ready on {self.url}", poll_seconds=0.2,
                          details=self.log_tail)
        return self

    def stop(self) -> None:
        """SIGTERM (Prometheus shuts down cleanly), SIGKILL after 30 s."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def set_targets(self, job: str, targets: Sequence[Target]) -> None:
        """Replace the targets of scrape job `job` (written atomically by rename)."""
        groups = [{"targets": [t.address], "labels": t.labels} for t in targets]
        path = self._targets_path(job)
        scratch = path.with_suffix(".tmp")
        scratch.write_text(json.dumps(groups))
        scratch.replace(path)

    def query(self, expr: str) -> dict[str, Any]:
        """The decoded answer of instant query `expr` at the server's now.

        A query that does not parse comes back as ``{"status": "error", "error": ...}``
        (HTTP 400/422 carry the same JSON body).
        """
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            with urllib.request.urlopen(url, timeout=10) as answer:
                body = answer.read()
        except urllib.error.HTTPError as exc:
            body = exc.read()
        decoded: dict[str, Any] = json.loads(body)
        return decoded

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return "(no Prometheus log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def _targets_path(self, job: str) -> Path:
        return self.work_dir / f"{job}.json"

    def _ready(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError(f"prometheus exited with {self.process.returncode}:\n"
                                 f"{self.log_tail()}")
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as answer:
                return bool(answer.status == 200)
        except OSError:
            return False


"""Prometheus metrics of one trainer process, ``kiln_trainer_<what>_<base unit>``.

Each carries the labels ``training_job`` and ``job_namespace`` (the warm-start info gauge adds
its verdict's): one series per job. They live in the reporter's own `CollectorRegistry`, never the global one,
so several reporters coexist.
"""

from __future__ import annotations

import math
import threading
from wsgiref.simple_server import WSGIServer

import prometheus_client

from kiln import api, contract

# Not ``job`` and ``namespace``: a scrape sets those target labels itself (the scrape job; the
# pod's namespace under the Prometheus Operator) and renames clashing ones ``exported_*``.
LABELS = ("training_job", "job_namespace")
WARM_START_LABELS = (*LABELS, "outcome", "parent", "reason")
# A label value is no place for a paragraph; the reason's first words say which case it is.
MAX_REASON_CHARACTERS = 200
_LABEL_HELP = (" Labels: training_job (TrainingJob name), job_namespace (its namespace or "
               "default).")


class MetricsReporter:
    """The trainer's metrics, labelled with one job, in a private registry.

    Example:
        >>> reporter = MetricsReporter(job="digits-resnet", namespace="default")
        >>> reporter.record_training(samples=128, steps=1, train_loss=0.7, samples_per_second=900.0)
        >>> reporter.record_validation(accuracy=0.93, loss=0.25)
        >>> b"kiln_trainer_validation_accuracy_ratio" in reporter.exposition()
        True
    """

    def __init__(self, *, job: str, namespace: str | None = None) -> None:
        self.registry = prometheus_client.CollectorRegistry(auto_describe=True)
        self._labels = dict(zip(LABELS, (job, namespace or "default"), strict=True))
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

        def gauge(name: str, text: str) -> prometheus_client.Gauge:
            metric = prometheus_client.Gauge(
                contract.METRIC_PREFIX + name, text + _LABEL_HELP, LABELS, registry=self.registry
            )
            return metric.labels(**self._labels)

        def counter(name: str, text: str) -> prometheus_client.Counter:
            metric = prometheus_client.Counter(
                contract.METRIC_PREFIX + name, text + _LABEL_HELP, LABELS, registry=self.registry
            )
            return metric.labels(**self._labels)

        # No gauge beside a counter of the same stem: prometheus-client refuses a gauge ``x``
        # next to a counter ``x_total``.
        self.train_loss = gauge(contract.Metric.TRAIN_LOSS, "Mean training loss since the previous report.")
        self.validation_accuracy = gauge(
            contract.Metric.VALIDATION_ACCURACY, "Validation accuracy in [0, 1] (token accuracy for LMs)."
        )
        self.validation_loss = gauge(contract.Metric.VALIDATION_LOSS, "Mean validation cross-entropy in nats.")
        self.samples_per_second = gauge(
            contract.Metric.SAMPLES_PER_SECOND, "Training throughput over the last report interval."
        )
        self.samples = counter("samples", "Training samples consumed, across restarts.")
        self.steps = counter(contract.Metric.STEPS, "Optimizer steps taken, across restarts.")
        self.epoch = gauge(contract.Metric.EPOCH, "Epochs completed.")
        self.progress = gauge("progress_ratio", "Share of the epoch budget done, in [0, 1].")
        self.eta = gauge(contract.Metric.ETA, "Estimated seconds left for the remaining epochs.")
        self.frozen_modules = gauge(contract.Metric.FROZEN_MODULES, "Front modules frozen now (Egeria).")
        self.frozen_parameters = gauge(
            "frozen_parameters_ratio", "Share of the model's parameters frozen, in [0, 1]."
        )
        self.backward_flops_skipped = gauge(
            "backward_flops_skipped_ratio", "Share of backward FLOPs a step skips now, in [0, 1]."
        )
        self.compute = gauge(
            contract.Metric.COMPUTE,
            "Share of the whole model's per-step compute (forward and backward) still done now.",
        )
        self.compute.set(1.0)  # nothing frozen (yet)
        self.warm_start = prometheus_client.Gauge(
            contract.METRIC_PREFIX + contract.Metric.WARM_START,
            "The warm start the trainer applied, always 1." + _LABEL_HELP
            + " Also outcome (warm, pinned, cold_guard, ...), parent (zoo id, empty if cold) and"
            " reason.",
            WARM_START_LABELS, registry=self.registry,
        )
        # NaN (not compared) until the probe guard ran: 0 would read as a perfect loss.
        self.probe_loss = gauge(contract.Metric.PROBE_LOSS, "The started model's probe-batch loss.")
        self.cold_probe_loss = gauge(
            contract.Metric.COLD_PROBE_LOSS, "A cold-initialised model's probe-batch loss."
        )
        self.probe_accuracy = gauge(
            contract.Metric.PROBE_ACCURACY, "The started model's probe-batch accuracy, in [0, 1]."
        )
        self.cold_probe_accuracy = gauge(
            contract.Metric.COLD_PROBE_ACCURACY, "A cold model's probe-batch accuracy, in [0, 1]."
        )
        for probe in (self.probe_loss, self.cold_probe_loss, self.probe_accuracy,
                      self.cold_probe_accuracy):
            probe.set(math.nan)

    def serve(self, port: int, *, address: str = "0.0.0.0") -> int:
        """Start the /metrics HTTP endpoint in a daemon thread (opt-in: the trainer's
        ``--metrics-port`` defaults to 0, no server; trainer pods get a port).

        Args:
            port: TCP port; 0 picks a free one.
            address: interface to bind.

        Returns:
            The bound port.

        Raises:
            OSError: the port is taken or cannot be bound.
        """
        self._server, self._thread = prometheus_client.start_http_server(
            port, addr=address, registry=self.registry
        )
        return int(self._server.server_port)

    def close(self) -> None:
        """Stop the HTTP endpoint, if serving."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def record_training(
        self, *, samples: int, steps: int, train_loss: float | None, samples_per_second: float
    ) -> None:
        """Count `samples` and `steps` just trained; set loss and throughput gauges."""
        self.samples.inc(samples)
        self.steps.inc(steps)
        if train_loss is not None:
            self.train_loss.set(train_loss)
        self.samples_per_second.set(samples_per_second)

    def record_validation(self, *, accuracy: float, loss: float) -> None:
        """Set the validation gauges (accuracy in [0, 1], loss in nats)."""
        self.validation_accuracy.set(accuracy)
        self.validation_loss.set(loss)

    def record_progress(self, *, epochs_done: int, progress: float, eta_seconds: float) -> None:
        """Set epoch, progress ratio in [0, 1] and ETA in seconds."""
        self.epoch.set(epochs_done)
        self.progress.set(min(1.0, max(0.0, progress)))
        self.eta.set(max(0.0, eta_seconds))

    def record_freezing(
        self, *, frozen_modules: int, frozen_parameters: float, backward_flops_skipped: float,
        compute: float = 1.0,
    ) -> None:
        """Set the freezing gauges: module count, parameter, backward-FLOPs and compute ratios."""
        self.frozen_modules.set(frozen_modules)
        self.frozen_parameters.set(frozen_parameters)
        self.backward_flops_skipped.set(backward_flops_skipped)
        self.compute.set(min(1.0, max(0.0, compute)))

    def record_warm_start(self, decision: api.WarmStartDecision) -> None:
        """Publish the warm start applied (the probe guard's verdict: outcome, parent, reason)
        and its probe scores (NaN: not measured), so the operator shows it while the job runs.
        """
        self.warm_start.clear()  # one verdict per job
        self.warm_start.labels(
            **self._labels, outcome=decision.outcome.value, parent=decision.parent or "",
            reason=decision.reason[:MAX_REASON_CHARACTERS],
        ).set(1)
        for metric, value in ((self.probe_loss, decision.probe_loss),
                              (self.cold_probe_loss, decision.cold_probe_loss),
                              (self.probe_accuracy, decision.probe_accuracy),
                              (self.cold_probe_accuracy, decision.cold_probe_accuracy)):
            metric.set(math.nan if value is None else value)

    def exposition(self) -> bytes:
        """The registry in Prometheus text format (what a scrape returns)."""
        return prometheus_client.generate_latest(self.registry)


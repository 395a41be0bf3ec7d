"""Prometheus metrics of the operator process, in the operator's own registry.

Named ``kiln_<what>_<base unit>`` (seconds, ratios in [0, 1], counters ending ``_total``), with
bounded labels only (job_namespace, phase, handler, outcome, solver, result, state): no per-job
labels; a sweep's two series live as long as the sweep. The process_* and python_* collectors
ride along; ``_created`` series are off.
"""

from __future__ import annotations

import contextlib
import platform

import prometheus_client

import kiln
from kiln import api

VERSION = kiln.__version__
_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_WAIT_BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 300.0, 900.0, 1800.0, 3600.0, 4 * 3600.0,
                 12 * 3600.0, 24 * 3600.0)
_RATIO_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
# Values of the `handler` label: kiln.controller.handlers' wrapped handlers and the placement
# loop (a test checks handlers.py names no other).
HANDLERS = ("admit", "resume", "suspend", "spec-edit", "cleanup", "pods", "housekeeping",
            "placement", "kueue", "sweeps")
# `outcome` values beyond api.WarmStartOutcome (kiln.controller.admission).
ZOO_UNAVAILABLE_OUTCOME = "zoo_unavailable"
RESULTS = ("succeeded", "failed")
# The TrainingJob's namespace. Not `namespace`: a scrape without honor_labels (a
# ServiceMonitor's default) sets `namespace` to the operator pod's own and renames ours
# `exported_namespace`.
NAMESPACE_LABEL = "job_namespace"


# Every metric, in one table (a test keeps it complete):
#
# | metric | type | labels | meaning |
# |---|---|---|---|
# | kiln_build_info | gauge (1) | version, python | the running build |
# | kiln_jobs | gauge | job_namespace, phase | TrainingJobs by phase (as last written) |
# | kiln_jobs_finished_total | counter | job_namespace, result | jobs that reached succeeded/failed |
# | kiln_job_restarts_total | counter | job_namespace | trainer restarts after retryable exits |
# | kiln_reconcile_errors_total | counter | handler | handler calls that raised |
# | kiln_reconcile_seconds | histogram | handler | wall time of one handler call |
# | kiln_warm_start_total | counter | outcome | warm-start decisions, one per admitted job |
# | kiln_warm_start_similarity_ratio | histogram | | similarity of a warm-start parent |
# | kiln_zoo_warm_start_seconds_saved_total | counter | job_namespace | training seconds warm
#   starts saved (parents.seconds_saved), counted when a warm-started job succeeds |
# | kiln_zoo_unavailable_total | counter | | failed attempts to reach the zoo at admission |
# | kiln_zoo_query_seconds | histogram | | one warm-start parent search |
# | kiln_placement_solve_seconds | histogram | solver | one (re)plan |
# | kiln_queue_wait_seconds | histogram | | from Queued to the trainer pod's creation |
# | kiln_queued_jobs | gauge | | jobs waiting in the operator's placement queue |
# | kiln_sweep_trials | gauge | job_namespace, sweep, state | a TrainingSweep's trials by state |
# | kiln_sweep_best_metric | gauge | job_namespace, sweep | its best trial's objective so far |
class OperatorMetrics:
    """The operator's metrics in a private `CollectorRegistry` (`main` serves it over HTTP).

    Series whose label values are known in advance exist from the start at 0, so that
    `rate()` and `increase()` see their first increment: every warm-start outcome, every
    handler's errors, and, once a namespace's first job is seen, that namespace's phases,
    results and restarts.
    """

    def __init__(self) -> None:
        # A `<counter>_created` series per counter and histogram doubles the series count for
        # a timestamp no dashboard reads. The switch is process-wide; the operator owns it.
        prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = prometheus_client.CollectorRegistry(auto_describe=True)
        r = self.registry
        # What the default registry would carry: process_* (CPU, memory, file descriptors,
        # start time) and python_* (version, garbage collections).
        prometheus_client.ProcessCollector(registry=r)
        prometheus_client.PlatformCollector(registry=r)
        prometheus_client.GCCollector(registry=r)
        self.build_info = prometheus_client.Gauge(
            "kiln_build_info", "The running Kiln operator build (always 1). Labels: version, "
            "python.", ["version", "python"], registry=r)
        self.build_info.labels(version=VERSION, python=platform.python_version()).set(1)
        self.jobs = prometheus_client.Gauge(
            "kiln_jobs", "TrainingJobs by phase. Labels: job_namespace, phase (Pending, Queued, "
            "Running, Succeeded, Failed, Suspended).", [NAMESPACE_LABEL, "phase"], registry=r)
        self.finished = prometheus_client.Counter(
            "kiln_jobs_finished", "TrainingJobs that ended. Labels: job_namespace, result "
            "(succeeded, failed).", [NAMESPACE_LABEL, "result"], registry=r)
        self.restarts = prometheus_client.Counter(
            "kiln_job_restarts", "Trainer restarts after retryable exits. Labels: "
            "job_namespace.", [NAMESPACE_LABEL], registry=r)
        self.reconcile_errors = prometheus_client.Counter(
            "kiln_reconcile_errors", "Handler calls that raised. Labels: handler (admit, "
            "resume, pods, suspend, housekeeping, cleanup, placement, kueue).", ["handler"],
            registry=r)
        for handler in HANDLERS:
            self.reconcile_errors.labels(handler=handler)
        self.reconcile_seconds = prometheus_client.Histogram(
            "kiln_reconcile_seconds", "Wall seconds of one handler call. Labels: handler.",
            ["handler"], buckets=_SECONDS_BUCKETS, registry=r)
        self.warm_starts = prometheus_client.Counter(
            "kiln_warm_start", "Warm-start decisions, one per admitted job. Labels: outcome "
            "(warm, pinned, "
            "cold_empty, cold_incompatible, cold_below_min_similarity, cold_few_tensors, "
            "cold_untraceable, cold_unreadable_parent, cold_other_family, cold_guard, disabled, in_trainer, zoo_unavailable).",
            ["outcome"], registry=r)
        for outcome in (*(o.value for o in api.WarmStartOutcome), ZOO_UNAVAILABLE_OUTCOME):
            self.warm_starts.labels(outcome=outcome)
        self.warm_start_similarity = prometheus_client.Histogram(
            "kiln_warm_start_similarity_ratio", "Architectural similarity in [0, 1] of the "
            "parent a job warm-starts from (outcomes warm and pinned).",
            buckets=_RATIO_BUCKETS, registry=r)
        self.warm_start_seconds_saved = prometheus_client.Counter(
            "kiln_zoo_warm_start_seconds_saved", "Training seconds warm starts saved, "
            "estimated when a warm-started job succeeds: its parent's training seconds times "
            "the share of weight tensors transferred. Labels: job_namespace.",
            [NAMESPACE_LABEL], registry=r)
        self.zoo_unavailable = prometheus_client.Counter(
            "kiln_zoo_unavailable", "Failed attempts to reach the model zoo at admission.",
            registry=r)
        self.zoo_query_seconds = prometheus_client.Histogram(
            "kiln_zoo_query_seconds", "Wall seconds of one warm-start parent search.",
            buckets=_SECONDS_BUCKETS, registry=r)
        self.placement_solve_seconds = prometheus_client.Histogram(
            "kiln_placement_solve_seconds", "Wall seconds of one (re)plan. Labels: solver "
            "(heuristic, milp, ...).", ["solver"], buckets=_SECONDS_BUCKETS, registry=r)
        self.queue_wait_seconds = prometheus_client.Histogram(
            "kiln_queue_wait_seconds", "Seconds from Queued to the trainer pod's creation.",
            buckets=_WAIT_BUCKETS, registry=r)
        self.queued_jobs = prometheus_client.Gauge(
            "kiln_queued_jobs", "Jobs waiting in the operator's placement queue.", registry=r)
        self.sweep_trials = prometheus_client.Gauge(
            "kiln_sweep_trials", "A TrainingSweep's trials by state. Labels: job_namespace, "
            "sweep, state (Running, Succeeded, Pruned, Failed).",
            [NAMESPACE_LABEL, "sweep", "state"], registry=r)
        self.sweep_best_metric = prometheus_client.Gauge(
            "kiln_sweep_best_metric", "A TrainingSweep's best trial's objective so far (its "
            "spec.objective.metric). Labels: job_namespace, sweep.", [NAMESPACE_LABEL, "sweep"],
            registry=r)
        self._phases: dict[tuple[str, str], str] = {}
        self._namespaces: set[str] = set()

    def set_phase(self, namespace: str, name: str, phase: api.Phase | None) -> None:
        """Record job `namespace/name`'s phase (None: the job is gone)."""
        self._see(namespace)
        key = (namespace, name)
        before = self._phases.pop(key, None)
        if before is not None:
            self.jobs.labels(namespace, before).dec()
        if phase is not None:
            self._phases[key] = phase.value
            self.jobs.labels(namespace, phase.value).inc()

    def count_finished(self, namespace: str, result: str) -> None:
        """Count a job of `namespace` that ended with `result` (one of `RESULTS`)."""
        self._see(namespace)
        self.finished.labels(namespace, result).inc()

    def count_seconds_saved(self, namespace: str, seconds: float) -> None:
        """Add a succeeded job's estimated warm-start saving (`parents.seconds_saved`)."""
        self._see(namespace)
        self.warm_start_seconds_saved.labels(namespace).inc(seconds)

    def count_restart(self, namespace: str) -> None:
        """Count a trainer restart of a job in `namespace`."""
        self._see(namespace)
        self.restarts.labels(namespace).inc()

    def set_sweep(self, namespace: str, sweep: str, counts: api.sweep.TrialCounts,
                  best: float | None) -> None:
        """Record sweep `namespace/sweep`'s trial counts and best objective (None: none yet)."""
        for state in api.sweep.TrialState:
            self.sweep_trials.labels(namespace, sweep, state.value).set(
                getattr(counts, state.value.lower()))
        if best is not None:
            self.sweep_best_metric.labels(namespace, sweep).set(best)

    def forget_sweep(self, namespace: str, sweep: str) -> None:
        """Drop a deleted sweep's series."""
        for state in api.sweep.TrialState:
            with contextlib.suppress(KeyError):
                self.sweep_trials.remove(namespace, sweep, state.value)
        with contextlib.suppress(KeyError):
            self.sweep_best_metric.remove(namespace, sweep)

    def _see(self, namespace: str) -> None:
        """Create `namespace`'s phase, result and restart series at 0 the first time."""
        if namespace in self._namespaces:
            return
        self._namespaces.add(namespace)
        for known in api.Phase:
            self.jobs.labels(namespace, known.value)
        for result in RESULTS:
            self.finished.labels(namespace, result)
        self.restarts.labels(namespace)
        self.warm_start_seconds_saved.labels(namespace)

    def exposition(self) -> bytes:
        """The registry in Prometheus text format."""
        return prometheus_client.generate_latest(self.registry)

"""kiln.controller.metrics: names follow Prometheus conventions, known series start at 0."""

from __future__ import annotations

import inspect
import re

from prometheus_client.parser import text_string_to_metric_families

from kiln import api
from kiln.controller import handlers, metrics


def _families(reporter: metrics.OperatorMetrics) -> dict[str, str]:
    """Kiln's metric family name -> type, as registered (a counter's name without ``_total``);
    the process and platform collectors' are not Kiln's."""
    return {f.name: f.type for f in reporter.registry.collect()
            if not f.name.startswith(("process_", "python_"))}


def _value(reporter: metrics.OperatorMetrics, sample: str, labels: dict[str, str]) -> float:
    text = reporter.exposition().decode()
    for family in text_string_to_metric_families(text):
        for found in family.samples:
            if found.name == sample and found.labels == labels:
                return float(found.value)
    raise AssertionError(f"no sample {sample}{labels}")


def test_every_metric_is_named_in_base_units_and_documented_in_the_module_table() -> None:
    families = _families(metrics.OperatorMetrics())
    table = set(re.findall(r"^# \| (kiln_\w+) \|", inspect.getsource(metrics), re.MULTILINE))
    exported = {name + ("_total" if kind == "counter" else "") for name, kind in families.items()}
    assert exported == table
    for name, kind in families.items():
        assert name.startswith("kiln_")
        if kind == "histogram":
            assert name.endswith(("_seconds", "_ratio")), name


def test_warm_start_similarity_is_a_histogram_over_zero_to_one() -> None:
    reporter = metrics.OperatorMetrics()
    reporter.warm_start_similarity.observe(0.83)
    assert _families(reporter)["kiln_warm_start_similarity_ratio"] == "histogram"
    assert _value(reporter, "kiln_warm_start_similarity_ratio_bucket", {"le": "0.8"}) == 0.0
    assert _value(reporter, "kiln_warm_start_similarity_ratio_bucket", {"le": "0.9"}) == 1.0
    assert _value(reporter, "kiln_warm_start_similarity_ratio_sum", {}) == 0.83
    family = next(f for f in reporter.registry.collect()
                  if f.name == "kiln_warm_start_similarity_ratio")
    bounds = [float(s.labels["le"]) for s in family.samples
              if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"]
    assert bounds == sorted(bounds) and bounds[0] > 0.0 and bounds[-1] == 1.0


def test_known_outcomes_and_handlers_exist_at_zero_before_anything_happens() -> None:
    reporter = metrics.OperatorMetrics()
    for outcome in [*api.WarmStartOutcome, metrics.ZOO_UNAVAILABLE_OUTCOME]:
        assert _value(reporter, "kiln_warm_start_total", {"outcome": str(outcome)}) == 0.0
    for handler in metrics.HANDLERS:
        assert _value(reporter, "kiln_reconcile_errors_total", {"handler": handler}) == 0.0


def test_a_namespace_seen_first_gets_every_phase_result_and_restart_series_at_zero() -> None:
    reporter = metrics.OperatorMetrics()
    reporter.set_phase("team-a", "job-1", api.Phase.QUEUED)
    assert _value(reporter, "kiln_jobs", {"job_namespace": "team-a", "phase": "Queued"}) == 1.0
    for phase in api.Phase:
        if phase is not api.Phase.QUEUED:
            assert _value(reporter, "kiln_jobs",
                          {"job_namespace": "team-a", "phase": phase}) == 0.0
    for result in metrics.RESULTS:
        assert _value(reporter, "kiln_jobs_finished_total",
                      {"job_namespace": "team-a", "result": result}) == 0.0
    assert _value(reporter, "kiln_job_restarts_total", {"job_namespace": "team-a"}) == 0.0
    reporter.set_phase("team-a", "job-1", api.Phase.RUNNING)
    assert _value(reporter, "kiln_jobs", {"job_namespace": "team-a", "phase": "Queued"}) == 0.0
    assert _value(reporter, "kiln_jobs", {"job_namespace": "team-a", "phase": "Running"}) == 1.0


def test_finishes_and_restarts_count_under_the_jobs_namespace() -> None:
    reporter = metrics.OperatorMetrics()
    reporter.count_restart("team-b")
    reporter.count_finished("team-b", "failed")
    assert _value(reporter, "kiln_job_restarts_total", {"job_namespace": "team-b"}) == 1.0
    assert _value(reporter, "kiln_jobs_finished_total",
                  {"job_namespace": "team-b", "result": "failed"}) == 1.0
    assert _value(reporter, "kiln_jobs_finished_total",
                  {"job_namespace": "team-b", "result": "succeeded"}) == 0.0
    assert _value(reporter, "kiln_jobs", {"job_namespace": "team-b", "phase": "Running"}) == 0.0


def test_no_series_carries_a_label_prometheus_sets_on_every_target() -> None:
    # A scrape sets job, instance and (under the Prometheus Operator) namespace, pod, service,
    # container and endpoint; without honor_labels an exported one is renamed exported_<name>.
    reporter = metrics.OperatorMetrics()
    reporter.set_phase("team-a", "job-1", api.Phase.RUNNING)
    reporter.count_restart("team-a")
    reserved = {"job", "instance", "namespace", "pod", "service", "container", "endpoint"}
    families = list(text_string_to_metric_families(reporter.exposition().decode()))
    clashes = {(s.name, label) for f in families for s in f.samples for label in s.labels
               if label in reserved}
    assert not clashes


def test_process_metrics_are_exported_and_created_series_are_not() -> None:
    text = metrics.OperatorMetrics().exposition().decode()
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    assert {"process_cpu_seconds_total", "process_resident_memory_bytes",
            "process_start_time_seconds", "python_info"} <= names
    assert not [name for name in names if name.endswith("_created")]


def test_every_wrapped_handler_name_is_a_known_handler_label() -> None:
    names = set(re.findall(r'_surfaced\("([\w-]+)"', inspect.getsource(handlers.register)))
    assert names and names <= set(metrics.HANDLERS)

"""Reading trainer metrics into status.progress (kiln.controller.progress)."""

from __future__ import annotations

import math

import prometheus_client
import pytest

from kiln import api
from kiln.controller import progress
from kiln_trainer import metrics, tracking


def _parse(text: str, *, epochs: int,
           rejected: dict[str, float] | None = None) -> api.ProgressStatus:
    found = progress.parse(text, epochs=epochs, rejected=rejected)
    assert found is not None
    return found


def test_trainer_metrics_become_status_progress() -> None:
    registry = prometheus_client.CollectorRegistry()
    labels = list(metrics.LABELS)
    for name, value in (("epoch", 2), ("train_loss", 0.5), ("validation_accuracy_ratio", 0.9),
                        ("eta_seconds", 12.5), ("frozen_modules", 1)):
        prometheus_client.Gauge(f"kiln_trainer_{name}", "h", labels, registry=registry).labels(
            "j", "ns").set(value)
    prometheus_client.Counter("kiln_trainer_steps", "h", labels, registry=registry).labels(
        "j", "ns").inc(40)
    text = prometheus_client.generate_latest(registry).decode()
    assert api.to_wire(_parse(text, epochs=3)) == {
        "epoch": 3, "step": 40, "trainLoss": 0.5, "validationAccuracy": 0.9,
        "etaSeconds": 12.5, "frozenModules": 1}
    assert _parse(text, epochs=2).epoch == 2
    assert progress.parse("# no Kiln metrics\n", epochs=2) is None


def test_the_share_of_compute_freezing_left_reaches_status_progress() -> None:
    reporter = metrics.MetricsReporter(job="j", namespace="ns")
    assert _parse(reporter.exposition().decode(), epochs=1).compute_fraction == 1.0
    # Backward costs 2x forward in these blocks; skipping half the backward leaves 2/3.
    left = tracking.compute_share([1.0, 3.0], [2.0, 6.0], 0.5)
    assert left == pytest.approx(2 / 3)
    reporter.record_freezing(frozen_modules=1, frozen_parameters=0.3,
                             backward_flops_skipped=0.5, compute=left)
    found = _parse(reporter.exposition().decode(), epochs=1)
    assert (found.frozen_modules, found.compute_fraction) == (1, round(2 / 3, 6))


def test_compute_share_without_counted_flops_assumes_backward_twice_forward() -> None:
    assert tracking.compute_share([0.0], [0.0], 1.0) == pytest.approx(1 / 3)
    assert tracking.compute_share([1.0], [2.0], 0.0) == 1.0


def test_the_trainers_warm_start_verdict_is_read_with_its_probe_scores() -> None:
    reporter = metrics.MetricsReporter(job="j", namespace="ns")
    assert progress.warm_start_decision(reporter.exposition().decode()) is None
    reason = ('warm start from "bad" (similarity 0.45) rejected: probe loss 2.410 vs 2.300 '
              "cold on 256 training samples; cold start " + "x" * 500)
    reporter.record_warm_start(api.WarmStartDecision(
        outcome=api.WarmStartOutcome.COLD_GUARD, reason=reason, probe_loss=2.4123456789012345,
        cold_probe_loss=2.3, probe_accuracy=0.09, cold_probe_accuracy=0.11))
    text = reporter.exposition().decode()
    assert progress.warm_start_decision(text) == {
        "outcome": "cold_guard", "parent": None,
        "reason": reason[:metrics.MAX_REASON_CHARACTERS], "probe_loss": 2.4123456789012345,
        "cold_probe_loss": 2.3, "probe_accuracy": 0.09, "cold_probe_accuracy": 0.11}
    assert "warmStart" not in api.to_wire(_parse(text, epochs=1))  # not a progress field
    # A run resumed from a checkpoint publishes the verdict again: still one series.
    reporter.record_warm_start(api.WarmStartDecision(
        outcome=api.WarmStartOutcome.WARM, parent="p-1", reason="kept p-1", probe_loss=0.4,
        cold_probe_loss=2.3))
    again = progress.warm_start_decision(reporter.exposition().decode())
    assert again == {"outcome": "warm", "parent": "p-1", "reason": "kept p-1",
                     "probe_loss": 0.4, "cold_probe_loss": 2.3}


@pytest.mark.parametrize(("sample", "field", "value"), [
    ("kiln_trainer_epoch +Inf", "epoch", math.inf),  # raised OverflowError: no progress read
    ("kiln_trainer_epoch -7", "epoch", -7.0),
    ("kiln_trainer_steps_total -5", "step", -5.0),
    ("kiln_trainer_steps_total 1e300", "step", 1e300),
    ("kiln_trainer_frozen_modules 1e30", "frozen_modules", 1e30),
    ("kiln_trainer_eta_seconds -100", "eta_seconds", -100.0),
    ("kiln_trainer_samples_per_second +Inf", "samples_per_second", math.inf),
    ("kiln_trainer_samples_per_second -3", "samples_per_second", -3.0),
    ("kiln_trainer_compute_ratio 7", "compute_fraction", 7.0),
])
def test_a_value_no_trainer_reports_is_left_out_and_named(sample: str, field: str,
                                                            value: float) -> None:
    rejected: dict[str, float] = {}
    found = _parse(f"{sample}\nkiln_trainer_train_loss 0.5\n", epochs=3, rejected=rejected)
    assert getattr(found, field) is None and found.train_loss == 0.5
    assert list(rejected) == [field] and rejected[field] == value


def test_a_diverged_loss_is_left_out_without_being_named() -> None:
    rejected: dict[str, float] = {}
    found = _parse("kiln_trainer_train_loss NaN\nkiln_trainer_steps_total 3\n", epochs=1,
                   rejected=rejected)
    assert (found.train_loss, found.step, rejected) == (None, 3, {})

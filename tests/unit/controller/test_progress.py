"""Reading trainer metrics into status.progress (kiln.controller.progress)."""

from __future__ import annotations

import prometheus_client

from kiln.controller import progress


def test_trainer_metrics_become_status_progress() -> None:
    registry = prometheus_client.CollectorRegistry()
    labels = ["job", "namespace"]
    for name, value in (("epoch", 2), ("train_loss", 0.5), ("validation_accuracy_ratio", 0.9),
                        ("eta_seconds", 12.5), ("frozen_modules", 1)):
        prometheus_client.Gauge(f"kiln_trainer_{name}", "h", labels, registry=registry).labels(
            "j", "ns").set(value)
    prometheus_client.Counter("kiln_trainer_steps", "h", labels, registry=registry).labels(
        "j", "ns").inc(40)
    text = prometheus_client.generate_latest(registry).decode()
    assert progress.parse(text, epochs=3) == {
        "epoch": 3, "step": 40, "trainLoss": 0.5, "validationAccuracy": 0.9,
        "etaSeconds": 12.5, "frozenModules": 1}
    assert progress.parse(text, epochs=2)["epoch"] == 2

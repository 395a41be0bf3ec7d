"""kiln_trainer.metrics: names, labels and the HTTP endpoint."""

from __future__ import annotations

import urllib.request

from kiln_trainer import metrics

EXPECTED_NAMES = [
    "kiln_trainer_train_loss",
    "kiln_trainer_validation_accuracy_ratio",
    "kiln_trainer_validation_loss",
    "kiln_trainer_samples_per_second",
    "kiln_trainer_samples_total",
    "kiln_trainer_steps_total",
    "kiln_trainer_epoch",
    "kiln_trainer_progress_ratio",
    "kiln_trainer_eta_seconds",
]


def _sample_lines(text: str) -> dict[str, str]:
    return {line.split("{")[0]: line for line in text.splitlines() if line.startswith("kiln_")}


def test_every_metric_is_served_over_http_with_training_job_and_job_namespace_labels() -> None:
    reporter = metrics.MetricsReporter(job="digits-a", namespace="team-a")
    try:
        port = reporter.serve(0, address="127.0.0.1")
        reporter.record_training(samples=64, steps=1, train_loss=0.5, samples_per_second=320.0)
        reporter.record_validation(accuracy=0.75, loss=0.8)
        reporter.record_progress(epochs_done=2, progress=0.4, eta_seconds=12.0)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
    finally:
        reporter.close()
    samples = _sample_lines(text)
    for name in EXPECTED_NAMES:
        assert name in samples, name
        assert 'training_job="digits-a"' in samples[name], samples[name]
        assert 'job_namespace="team-a"' in samples[name], samples[name]
    assert samples["kiln_trainer_samples_total"].endswith(" 64.0")
    assert samples["kiln_trainer_validation_accuracy_ratio"].endswith(" 0.75")
    assert samples["kiln_trainer_eta_seconds"].endswith(" 12.0")


def test_labels_are_only_training_job_and_job_namespace_with_default_namespace() -> None:
    # Not `job` or `namespace`: a scrape sets those itself and renames ours exported_*.
    reporter = metrics.MetricsReporter(job="j")
    for line in reporter.exposition().decode().splitlines():
        if line.startswith("kiln_"):
            labels = line.split("{")[1].split("}")[0]
            assert sorted(part.split("=")[0] for part in labels.split(",")) == [
                "job_namespace", "training_job"]
            assert 'job_namespace="default"' in labels


def test_counters_accumulate_and_progress_is_clamped() -> None:
    reporter = metrics.MetricsReporter(job="j")
    reporter.record_training(samples=10, steps=1, train_loss=None, samples_per_second=1.0)
    reporter.record_training(samples=5, steps=2, train_loss=0.1, samples_per_second=1.0)
    reporter.record_progress(epochs_done=1, progress=1.5, eta_seconds=-3.0)
    samples = _sample_lines(reporter.exposition().decode())
    assert samples["kiln_trainer_samples_total"].endswith(" 15.0")
    assert samples["kiln_trainer_steps_total"].endswith(" 3.0")
    assert samples["kiln_trainer_progress_ratio"].endswith(" 1.0")
    assert samples["kiln_trainer_eta_seconds"].endswith(" 0.0")


def test_two_reporters_in_one_process_do_not_collide() -> None:
    first, second = metrics.MetricsReporter(job="a"), metrics.MetricsReporter(job="b")
    first.record_validation(accuracy=0.1, loss=1.0)
    second.record_validation(accuracy=0.9, loss=0.1)
    assert b'training_job="b"' not in first.exposition()

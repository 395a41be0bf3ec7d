"""Reading trainer metrics into status.progress; the operator's command line."""

from __future__ import annotations

import prometheus_client
import pytest

from kiln.controller import main, progress


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


def test_every_option_has_a_flag() -> None:
    args = main.build_parser().parse_args([
        "--kubeconfig", "/tmp/kc", "-n", "a", "-n", "b", "--zoo-uri", "s3://z",
        "--no-placement-use-milp", "--cpu-slots-per-node", "4"])
    options = main.options_from_args(args)
    assert options.namespaces == ("a", "b")
    assert options.zoo_uri == "s3://z" and options.placement_use_milp is False
    assert options.cpu_slots_per_node == 4 and str(options.kubeconfig) == "/tmp/kc"
    assert options.gpu_type is None


@pytest.mark.parametrize(("argv", "message"), [
    (["--placement-interval-seconds", "-1"], "must be greater than 0, got -1"),
    (["--placement-time-limit-seconds", "nan"], "expected a finite number"),
    (["--housekeeping-interval-seconds", "0"], "must be greater than 0"),
    (["--zoo-retry-limit", "-2"], "must be 0 or more"),
    (["--zoo-retry-limit", "1.5"], "expected a whole number"),
    (["--metrics-port", "70000"], "a port is at most 65535"),
    (["--max-gpus-per-job", "0"], "must be greater than 0"),
])
def test_numeric_options_out_of_range_are_usage_errors_naming_the_flag(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main.build_parser().parse_args(argv)
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert f"argument {argv[0]}: {message}" in error, error


def test_zero_ports_and_retries_are_allowed() -> None:
    options = main.options_from_args(main.build_parser().parse_args([
        "--metrics-port", "0", "--liveness-port", "0", "--zoo-retry-limit", "0",
        "--gpu-type", "NVIDIA-A100-SXM4-80GB"]))
    assert (options.metrics_port, options.liveness_port, options.zoo_retry_limit) == (0, 0, 0)
    assert options.gpu_type == "NVIDIA-A100-SXM4-80GB"

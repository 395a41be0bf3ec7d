"""Live progress of a running trainer, read from its Prometheus endpoint into status.progress.

No status writes and no retries: the next housekeeping tick tries again.
"""

from __future__ import annotations

import math
from typing import Any

import aiohttp
from prometheus_client import parser

from kiln import api, contract
from kiln.controller import pods

# sample name (without the prefix) -> field of `api.ProgressStatus`
_FIELDS = {
    f"{contract.Metric.STEPS}_total": "step",
    contract.Metric.TRAIN_LOSS: "train_loss",
    contract.Metric.VALIDATION_ACCURACY: "validation_accuracy",
    contract.Metric.VALIDATION_LOSS: "validation_loss",
    contract.Metric.SAMPLES_PER_SECOND: "samples_per_second",
    contract.Metric.ETA: "eta_seconds",
    contract.Metric.FROZEN_MODULES: "frozen_modules",
    contract.Metric.COMPUTE: "compute_fraction",
}
# sample name (without the prefix) -> key of `contract.Result.warm_start_decision`
_PROBES: dict[str, str] = {
    contract.Metric.PROBE_LOSS: "probe_loss",
    contract.Metric.COLD_PROBE_LOSS: "cold_probe_loss",
    contract.Metric.PROBE_ACCURACY: "probe_accuracy",
    contract.Metric.COLD_PROBE_ACCURACY: "cold_probe_accuracy",
}
_INTEGERS = ("step", "frozen_modules")
# A count beyond this is no trainer's (and no longer an exact JSON number in the API).
MAX_COUNT = 2**53
# field -> the values a real trainer publishes (`kiln_trainer.metrics` clamps its own); what
# the planner reads is only believed within them. Losses and accuracy: any finite value.
_RANGES: dict[str, tuple[float, float]] = {
    "epoch": (0, MAX_COUNT), "step": (0, MAX_COUNT), "frozen_modules": (0, MAX_COUNT),
    "samples_per_second": (0, math.inf), "eta_seconds": (0, math.inf),
    "compute_fraction": (0, 1)}


def address(template: str, state: pods.PodState, namespace: str) -> str | None:
    """The trainer's host:port, or None before the pod has an IP and a metrics port.

    `template` is the operator's progress_address setting: "{pod_ip}:{port}" in a cluster (the
    tests' kubelet runs every pod on 127.0.0.1 with its own port).
    """
    if not state.pod_ip or not state.metrics_port:
        return None
    return template.format(pod_ip=state.pod_ip, port=state.metrics_port, pod=state.name,
                           namespace=namespace)


async def read(session: aiohttp.ClientSession, host_port: str, *,
               timeout_seconds: float) -> str | None:
    """The exposition text at http://host_port/metrics, or None when it cannot be read."""
    try:
        async with session.get(f"http://{host_port}/metrics",
                               timeout=aiohttp.ClientTimeout(total=timeout_seconds)) as answer:
            if answer.status != 200:
                return None
            return await answer.text()
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
        return None


def parse(text: str, *, epochs: int,
          rejected: dict[str, float] | None = None) -> api.ProgressStatus | None:
    """status.progress from a trainer's exposition text (None when it has no Kiln metrics).

    A value no trainer publishes (a negative step or ETA, a compute share above 1, a count
    beyond `MAX_COUNT`, an infinite epoch) is left out, as if not reported.

    Args:
        text: Prometheus text format.
        epochs: the job's epoch budget (caps the 1-based epoch in progress).
        rejected: when given, filled with each left-out field and the value reported.

    Raises:
        ValueError: the text is not Prometheus text format.
    """
    values: dict[str, float] = {}
    for family in parser.text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(contract.METRIC_PREFIX):
                values[sample.name[len(contract.METRIC_PREFIX):]] = float(sample.value)
    progress: dict[str, float | int] = {}
    for name, field in ((contract.Metric.EPOCH, "epoch"), *_FIELDS.items()):
        value = values.get(name)
        if value is None:
            continue
        if not math.isfinite(value) or field in _RANGES and not (
                _RANGES[field][0] <= value <= _RANGES[field][1]):
            if rejected is not None and field in _RANGES:
                rejected[field] = value
            continue
        if field == "epoch":  # epochs completed -> the 1-based epoch in progress
            progress[field] = min(int(value) + 1, epochs)
        else:
            progress[field] = int(value) if field in _INTEGERS else round(value, 6)
    return api.ProgressStatus.model_validate(progress) if progress else None


def warm_start_decision(text: str) -> dict[str, Any] | None:
    """The warm start a trainer applied, as its exposition text publishes it from its first
    step on: the keys of `contract.Result.warm_start_decision` (outcome, parent, reason and
    the probe scores it has), or None when the text has none (an older trainer).

    Raises:
        ValueError: the text is not Prometheus text format.
    """
    info = contract.METRIC_PREFIX + contract.Metric.WARM_START
    found: dict[str, Any] | None = None
    probes: dict[str, float] = {}
    for family in parser.text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == info and sample.value == 1 and sample.labels.get("outcome"):
                found = {"outcome": sample.labels["outcome"],
                         "parent": sample.labels.get("parent") or None,
                         "reason": sample.labels.get("reason") or ""}
            elif sample.name.startswith(contract.METRIC_PREFIX):
                key = _PROBES.get(sample.name[len(contract.METRIC_PREFIX):])
                if key is not None and math.isfinite(sample.value):  # unrounded: the result
                    probes[key] = float(sample.value)  # repeats them, and must compare equal
    return None if found is None else {**found, **probes}

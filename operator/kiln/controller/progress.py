"""Live progress of a running trainer, read from its Prometheus endpoint.

The trainer serves ``kiln_trainer_*`` metrics (kiln_trainer.metrics) on its pod's metrics
port; `read` fetches them over HTTP and `parse` turns the exposition text into
status.progress (`api.ProgressStatus` wire names): epoch (1-based, in progress), step,
trainLoss, validationAccuracy, validationLoss, samplesPerSecond, etaSeconds, frozenModules.
The ETA also refines the planner's idea of when the job's devices come free.

Where the endpoint is comes from the pod: its IP and its ``prometheus.io/port`` annotation,
formatted by the operator's `progress_address` setting ("{pod_ip}:{port}" in a cluster; the
tests' kubelet runs every pod on 127.0.0.1 with its own port).

Callers: `kiln.controller.housekeeping`. Non-goals: no status writes, no retries (the next
housekeeping tick tries again).
"""

from __future__ import annotations

import math
from typing import Any

import aiohttp
from prometheus_client import parser

from kiln.controller import pods

PREFIX = "kiln_trainer_"
# metric (without the prefix) -> status.progress field; gauges unless marked.
_FIELDS = {
    "steps_total": "step",
    "train_loss": "trainLoss",
    "validation_accuracy_ratio": "validationAccuracy",
    "validation_loss": "validationLoss",
    "samples_per_second": "samplesPerSecond",
    "eta_seconds": "etaSeconds",
    "frozen_modules": "frozenModules",
}
_INTEGERS = ("step", "frozenModules")


def address(template: str, state: pods.PodState, namespace: str) -> str | None:
    """The trainer's host:port, or None before the pod has an IP and a metrics port."""
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


def parse(text: str, *, epochs: int) -> dict[str, Any]:
    """status.progress from a trainer's exposition text ({} when it has no Kiln metrics).

    Args:
        text: Prometheus text format.
        epochs: the job's epoch budget (caps the 1-based epoch in progress).

    Raises:
        ValueError: the text is not Prometheus text format.
    """
    values: dict[str, float] = {}
    for family in parser.text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(PREFIX):
                values[sample.name[len(PREFIX):]] = float(sample.value)
    progress: dict[str, Any] = {}
    if "epoch" in values:
        progress["epoch"] = min(int(values["epoch"]) + 1, epochs)
    for name, field in _FIELDS.items():
        value = values.get(name)
        if value is None or not math.isfinite(value):
            continue
        progress[field] = int(value) if field in _INTEGERS else round(value, 6)
    return progress

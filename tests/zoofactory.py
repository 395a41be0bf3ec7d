"""Small zoo records for tests: real weights and graph files, a chosen size and age, hits."""

from __future__ import annotations

import datetime
from typing import Any

import torch

from kiln.zoo import eviction, records, store

NOW = datetime.datetime(2025, 3, 1, 12, 0, tzinfo=datetime.UTC)


def add(zoo: store.ObjectStore, record_id: str, *, floats: int, days_old: float = 10.0,
        seed: int | None = None, history: list[dict[str, Any]] | None = None,
        **changes: Any) -> records.ZooRecord:
    """A record whose weights hold `floats` float32 values (zeros, or random from `seed`),
    registered `days_old` days before `NOW`, produced by the job ``job-<record_id>``, keeping
    `history` (its run's evaluations) when given."""
    created = (NOW - datetime.timedelta(days=days_old)).strftime("%Y-%m-%dT%H:%M:%SZ")
    fields: dict[str, Any] = {
        "architecture": "small_cnn", "args": {}, "input_shape": (1, 8, 8), "modality": "image",
        "task": "classification", "dataset": "digits", "metric_name": "validation_accuracy",
        "metric_value": 0.9, "num_params": floats, "created_time": created,
        "job_name": f"job-{record_id}", "job_spec": {}, **changes}
    record = records.ZooRecord(id=records.ZooModelId(record_id), **fields)
    weights = (torch.zeros(floats) if seed is None else
               torch.randn(floats, generator=torch.Generator().manual_seed(seed)))
    return records.write_record(zoo, record, {"w": weights}, {"nodes": []}, history=history)


def hit(zoo: store.ObjectStore, record_id: str, *, days_ago: float, times: int = 1) -> None:
    """Count `record_id` as chosen as a parent `times` times, `days_ago` days before `NOW`."""
    for _ in range(times):
        eviction.record_hit(zoo, record_id, now=NOW - datetime.timedelta(days=days_ago))

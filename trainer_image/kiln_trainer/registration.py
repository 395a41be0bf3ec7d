"""Zoo registration of a trained model: the record, its weights and its architecture graph.

Under data parallelism only rank 0 calls it, with the full weights; it never reads the zoo.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from kiln import api, models
from kiln.warmstart import decision, graph
from kiln.zoo import records
from kiln.zoo import store as zoo_store
from kiln_trainer import tracking, warm

_log = logging.getLogger(__name__)


def metric_name(spec: api.TrainingJobSpec) -> str:
    """The target's metric, or validation_accuracy for a job without a target."""
    return spec.target.metric.value if spec.target else api.TargetMetric.VALIDATION_ACCURACY.value


def register_model(
    zoo: zoo_store.ObjectStore,
    job: api.TrainingJob,
    raw_model: nn.Module,
    state: tracking.RunState,
    final: dict[str, Any],
    warm_start: warm.WarmStart,
    *,
    weights: Mapping[str, torch.Tensor] | None = None,
) -> records.ZooModelId | None:
    """Write the trained model to the zoo; None (with a warning) when its metric is not finite.

    Args:
        zoo: the zoo store.
        job: the job that trained it (its spec goes in the record).
        raw_model: the unwrapped model (parameter count; its weights unless `weights`).
        state: the run's position (throughput).
        final: the last evaluation (history entry).
        warm_start: the parent it started from, if any.
        weights: the full state dict to store (FSDP gathers it); default
            ``raw_model.state_dict()``.

    Raises:
        zoo_store.StoreUnavailable: the store failed (the checkpoint is kept, so a rerun only
            redoes this).
    """
    spec, name = job.spec, metric_name(job.spec)
    value = final[name]
    if value is None or not np.isfinite(value):
        _log.warning("not registering: final %s is %s (training diverged?)", name, value)
        return None
    record = records.ZooRecord(
        id=records.new_id(spec.model.label), architecture=spec.model.architecture,
        entrypoint=spec.model.entrypoint,
        args=dict(spec.model.args), input_shape=tuple(spec.model.input_shape),
        modality=models.modality_of(spec.model).value, task=models.task_of(spec.model).value,
        dataset=spec.dataset.source,
        metric_name=name, metric_value=float(value),
        validation_accuracy=final["validation_accuracy"],
        validation_loss=final["validation_loss"],
        samples_per_second=state.samples_per_second(),
        num_params=sum(p.numel() for p in raw_model.parameters()),  # global, even for shards
        created_time=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        job_name=job.name, job_spec=api.to_wire(spec),
        parent=records.ZooModelId(warm_start.parent) if warm_start.parent else None,
        similarity=warm_start.similarity)
    try:
        architecture = graph.to_json(decision.model_graph(spec.model))
    except graph.GraphError as exc:  # kept, but no later job can match against it
        _log.warning("registering without an architecture graph: %s", exc)
        architecture = {"untraceable": str(exc)}
    weights = raw_model.state_dict() if weights is None else weights
    return records.write_record(zoo, record, weights, architecture).id

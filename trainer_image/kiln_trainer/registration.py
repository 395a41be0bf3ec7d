"""Zoo registration of a trained model: the record, its weights and its architecture graph.

Under data parallelism only rank 0 calls it, with the full weights. A LoRA job's pretrained
base is registered here too (`import_base`).
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

import kiln
from kiln import api, contract, models
from kiln.models import lora
from kiln.warmstart import decision, graph
from kiln.zoo import eviction, presigned, records
from kiln.zoo import store as zoo_store
from kiln_trainer import tracking

_log = logging.getLogger(__name__)


def share_of(spec: api.TrainingJobSpec, environ: Mapping[str, str]) -> api.ZooShare:
    """Who sees the job's record: ``spec.zoo.share``, else the operator's default (its
    ``--zoo-share``, passed in KILN_ZOO_SHARE), else private."""
    if spec.zoo.share is not None:
        return spec.zoo.share
    default = environ.get(contract.Env.ZOO_SHARE) or api.ZooShare.PRIVATE.value
    try:
        return api.ZooShare(default)
    except ValueError:
        _log.warning("%s=%r is neither private nor shared; registering as private",
                     contract.Env.ZOO_SHARE, default)
        return api.ZooShare.PRIVATE


def metric_name(spec: api.TrainingJobSpec) -> str:
    """The target's metric, or validation_accuracy for a job without a target."""
    return spec.target.metric.value if spec.target else api.TargetMetric.VALIDATION_ACCURACY.value


def record_parent_hit(zoo: zoo_store.ObjectStore | None,
                      warm_start: api.WarmStartDecision) -> None:
    """Count the parent the job started from as chosen once more (what keeps it in a zoo with
    a capacity, `kiln.zoo.eviction`); nothing on a cold start. A store failure only warns:
    a lost hit must not stop training."""
    if zoo is None or warm_start.parent is None:
        return
    try:
        eviction.record_hit(zoo, warm_start.parent, now=datetime.datetime.now(datetime.UTC))
    except (zoo_store.StoreUnavailable, zoo_store.StoreMisconfigured, ValueError) as exc:
        _log.warning("could not count the warm start from %s in the zoo: %s",
                     warm_start.parent, exc)


def register_model(
    zoo: zoo_store.ObjectStore,
    job: api.TrainingJob,
    raw_model: nn.Module,
    state: tracking.RunState,
    final: dict[str, Any],
    warm_start: api.WarmStartDecision,
    *,
    weights: Mapping[str, torch.Tensor] | None = None,
    record_id: str | None = None,
    provisional: bool = False,
    content_fingerprint: str | None = None,
    base: str | None = None,
) -> records.ZooModelId | None:
    """Write the trained model to the zoo; None (with a warning) when its metric is not finite.

    With `record_id` naming this job's provisional record, the new record replaces it under
    the same id, so children that warm-started from it keep a valid parent: the old meta.json
    is deleted first (the record vanishes at once), then weights, graph, the evaluation
    history (`kiln plot MODEL`) and meta.json are written (`records.write_record`), so no
    reader ever sees a mix of the two.

    Args:
        zoo: the zoo store.
        job: the job that trained it (its spec goes in the record).
        raw_model: the unwrapped model (parameter count; its weights unless `weights`).
        state: the run's position (throughput) and evaluation history.
        final: the last evaluation (history entry).
        warm_start: the parent it started from, if any.
        weights: the full state dict to store (FSDP gathers it); default
            ``raw_model.state_dict()``.
        record_id: the job's provisional record to replace, or None for a new id (also when
            that record is gone or is not this job's provisional one).
        provisional: write the record as provisional (the job is still training).
        content_fingerprint: what the trainer loaded (`data.Splits.fingerprint`), or None
            when Kiln did not load the data (a library user's own loop).
        base: a LoRA job's base record (``spec.training.peft``): the record then stores only
            the adapter (`lora.adapter_state`) and names this base.

    Raises:
        zoo_store.StoreUnavailable: the store failed (the checkpoint is kept, so a rerun only
            redoes this).
    """
    spec, name = job.spec, metric_name(job.spec)
    value = final[name]
    if value is None or not np.isfinite(value):
        _log.warning("not registering: final %s is %s (training diverged?)", name, value)
        return None
    own = record_id is not None and _own_provisional(zoo, record_id, job.name)
    chosen = records.ZooModelId(record_id) if record_id is not None and own else _new_id(zoo, spec)
    # Under its reserved id a record of this job may be there already: an earlier attempt's
    # final record, when that attempt was stopped before it could say so.
    replace = own or _own_record(zoo, chosen, job)
    weights = raw_model.state_dict() if weights is None else weights
    peft = spec.training.peft if base is not None else None
    if peft is not None:  # the adapter alone; its base's weights are in the base record
        weights = lora.adapter_state(raw_model, weights)
    trained = (p for p in raw_model.parameters() if p.requires_grad or peft is None)
    record = records.ZooRecord(
        id=chosen, architecture=spec.model.architecture,
        entrypoint=spec.model.entrypoint,
        args=dict(spec.model.args), input_shape=tuple(spec.model.input_shape),
        modality=models.modality_of(spec.model).value, task=models.task_of(spec.model).value,
        dataset=spec.dataset.source,
        metric_name=name, metric_value=float(value),
        validation_accuracy=final["validation_accuracy"],
        validation_loss=final["validation_loss"],
        samples_per_second=state.samples_per_second(),
        num_params=sum(p.numel() for p in trained),  # global, even for shards
        created_time=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        job_name=job.name, job_spec=api.to_wire(spec),
        parent=records.ZooModelId(warm_start.parent) if warm_start.parent else None,
        similarity=warm_start.similarity, provisional=provisional,
        namespace=job.namespace, share=share_of(spec, os.environ),
        dataset_fingerprint=records.dataset_fingerprint(spec.dataset),
        content_fingerprint=content_fingerprint,
        trainer_image=os.environ.get(contract.Env.TRAINER_IMAGE) or None,
        kiln_version=kiln.__version__, train_seconds=state.train_seconds or None,
        base=records.ZooModelId(base) if peft is not None and base else None,
        adapter=api.to_wire(peft) if peft is not None else None)
    architecture = _graph(spec)
    if replace:
        records.delete_record(zoo, record.id)
    history_key = records.record_prefix(record.id) + records.HISTORY_NAME
    # An older operator's presigned grants have no history key: the record goes without it.
    keep_history = (not isinstance(zoo, presigned.PresignedStore)
                    or bool(zoo.granted(history_key, "put")))
    return records.write_record(zoo, record, weights, architecture,
                                history=state.history if keep_history else None).id


def import_base(zoo: zoo_store.ObjectStore, job: api.TrainingJob, raw_model: nn.Module,
                measured: tuple[float, float], *, weights_sha256: str) -> records.ZooRecord:
    """Register the pretrained weights a LoRA job starts from (``spec.model.pretrained.uri``,
    in `raw_model` before its adapters) as a full-weight record, the base its adapters name.

    Its id is `records.base_record_id` of the job's own (the operator grants both); like
    `kiln zoo import`, it is trained on "imported" data, and its metric is the job's,
    measured on the job's validation split before training. A record of this job already
    under that id holding the same weights (an earlier attempt's) is kept.

    Args:
        zoo: the zoo store.
        job: the LoRA job.
        raw_model: the model holding the pretrained weights, no adapters attached.
        measured: (validation accuracy, validation loss) of those weights.
        weights_sha256: the SHA-256 of the weights as a record stores them.

    Raises:
        api.InvalidSpec: the measured metric is not finite (the weights give NaN or inf).
        zoo_store.StoreUnavailable: the store failed; a half-written record is never read.
        ValueError: another record holds the id, or it is damaged.
    """
    spec, name = job.spec, metric_name(job.spec)
    accuracy, loss = measured
    value = accuracy if name == api.TargetMetric.VALIDATION_ACCURACY else loss
    if not np.isfinite(value) or not np.isfinite(loss):
        raise api.InvalidSpec([(
            f"spec.model.pretrained.uri: its weights give a validation loss of {loss} on the "
            "job's data; check spec.model against the model they were saved from")],
            source=f"job {job.name}")
    source = spec.model.pretrained
    assert source is not None
    record = records.ZooRecord(
        id=records.base_record_id(_new_id(zoo, spec)), architecture=spec.model.architecture,
        entrypoint=spec.model.entrypoint, args=dict(spec.model.args),
        input_shape=tuple(spec.model.input_shape),
        modality=models.modality_of(spec.model).value, task=models.task_of(spec.model).value,
        dataset="imported", metric_name=name, metric_value=float(value),
        validation_accuracy=float(accuracy), validation_loss=float(loss),
        num_params=sum(p.numel() for p in raw_model.parameters()),
        created_time=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        job_name=job.name, job_spec={"spec": {"model": api.to_wire(spec.model)}},
        source=source.uri, namespace=job.namespace, share=share_of(spec, os.environ),
        weights_sha256=weights_sha256, kiln_version=kiln.__version__)
    try:
        found: records.ZooRecord | None = records.read_record(zoo, record.id)
    except zoo_store.ObjectNotFound:
        found = None
    if found is not None and (found.weights_sha256, found.namespace, found.job_name) == (
            weights_sha256, job.namespace, job.name):
        return found
    written = records.write_record(zoo, record, raw_model.state_dict(), _graph(spec))
    _log.info("imported %s as zoo model %s, the base of the job's adapter", source.uri,
              written.id)
    return written


def _graph(spec: api.TrainingJobSpec) -> dict[str, Any]:
    """The model's architecture graph for its record; without one no job can match it."""
    try:
        return graph.to_json(decision.model_graph(spec.model))
    except graph.GraphError as exc:  # kept, but no later job can match against it
        _log.warning("registering without an architecture graph: %s", exc)
        return {"untraceable": str(exc)}


def register_provisional(
    zoo: zoo_store.ObjectStore,
    job: api.TrainingJob,
    raw_model: nn.Module,
    state: tracking.RunState,
    warm_start: api.WarmStartDecision,
    *,
    weights: Mapping[str, torch.Tensor],
    content_fingerprint: str | None = None,
    base: str | None = None,
) -> str | None:
    """Register the current weights as the job's provisional record (replacing the previous
    one); a store failure only warns, as training goes on.

    Returns:
        The provisional record's id (the previous one when this write failed).
    """
    try:
        written = register_model(zoo, job, raw_model, state, state.history[-1], warm_start,
                                 weights=weights, record_id=state.zoo_record_id,
                                 provisional=True, content_fingerprint=content_fingerprint,
                                 base=base)
    except (zoo_store.StoreUnavailable, zoo_store.StoreMisconfigured) as exc:
        _log.warning("could not register the provisional zoo record: %s", exc)
        return state.zoo_record_id
    if written is not None:
        _log.info("registered provisional zoo model %s (step %d)", written, state.step)
    return written or state.zoo_record_id


def _new_id(zoo: zoo_store.ObjectStore, spec: api.TrainingJobSpec) -> records.ZooModelId:
    """A new record's id: the one the operator reserved for the job (in the presigned
    manifest, else in KILN_ZOO_RECORD; the operator accepts no other in the result), else a
    fresh one (`kiln run`)."""
    if isinstance(zoo, presigned.PresignedStore) and zoo.reserved_record:
        return records.check_id(zoo.reserved_record)
    reserved = os.environ.get(contract.Env.ZOO_RECORD)
    return records.check_id(reserved) if reserved else records.new_id(spec.model.label)


def _own_record(zoo: zoo_store.ObjectStore, record_id: str, job: api.TrainingJob) -> bool:
    """Whether `record_id` holds a record of this job (its namespace and name)."""
    try:
        found = records.read_record(zoo, record_id)
    except (zoo_store.ObjectNotFound, ValueError):  # none, or damaged
        return False
    return found.namespace == job.namespace and found.job_name == job.name


def _own_provisional(zoo: zoo_store.ObjectStore, record_id: str, job_name: str) -> bool:
    """Whether `record_id` is a provisional record of this job (never replace anything else)."""
    try:
        found = records.read_record(zoo, record_id)
    except (zoo_store.ObjectNotFound, ValueError):  # gone (evicted, deleted) or damaged
        return False
    return found.provisional and found.job_name == job_name


def provisional_due(spec: api.TrainingJobSpec, state: tracking.RunState) -> bool:
    """Whether to register the current weights as the job's provisional record now.

    Every ``spec.zoo.provisionalEveryEvaluations``-th evaluation, when it is the best so far
    (by the target's metric) and training goes on (the final record follows anyway).
    """
    every = spec.zoo.provisional_every_evaluations
    if (not every or not spec.zoo.register_model or not state.evaluated_now()
            or state.finished(spec) or len(state.history) % every):
        return False
    name = metric_name(spec)
    seen = [h[name] for h in state.history if h[name] is not None and np.isfinite(h[name])]
    latest = state.history[-1][name]
    if latest is None or not np.isfinite(latest):
        return False
    lower_is_better = name == api.TargetMetric.VALIDATION_LOSS.value
    return bool(latest == (min(seen) if lower_is_better else max(seen)))

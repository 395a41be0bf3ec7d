"""The warm-start decision, made once (`decide`), and seeding the child with it (`apply`).

`decide` runs every check that can make a start cold (policy, parent record, the 10% rule), so
a decision passed downstream is final: `apply` only transforms the chosen parent's weights into
the child's shapes. Only an unreachable store raises (`store.StoreUnavailable`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping

import networkx as nx
import torch
from torch import Tensor, nn

from kiln import api, models
from kiln.warmstart import graph, index, match, select, transform
from kiln.zoo import records, store

QUERY_TIMEOUT_SECONDS = 30.0

_log = logging.getLogger(__name__)


class ApplyError(RuntimeError):
    """The decided parent can no longer be loaded or transformed (deleted or damaged since)."""


@dataclasses.dataclass(frozen=True)
class Applied:
    """The outcome of `apply`.

    Attributes:
        state_dict: the child's warm-started state_dict, or None on a cold start.
        untransferred_fraction: share of the child's weight tensors NOT transferred, in [0, 1]
            (1.0 on a cold start); drives the learning-rate damping of the first epochs.
        notes: one sentence per special case of the transform (resized heads, skipped inits).
    """

    state_dict: dict[str, Tensor] | None
    untransferred_fraction: float
    notes: tuple[str, ...] = ()


def model_graph(spec: api.ModelSpec) -> nx.DiGraph:
    """The architecture graph of a job's model, built on the `meta` device (no weights).

    Raises:
        graph.GraphError: the model cannot be traced.
    """
    with torch.device("meta"):
        model = models.build(spec)
    dtype = models.example_batch(spec, device="meta").dtype
    return graph.extract(model, spec.input_shape, name=spec.label, input_dtype=dtype)


def decide(
    job: api.TrainingJob,
    zoo: store.ObjectStore,
    *,
    zoo_index: index.ZooIndex | None = None,
    timeout_seconds: float = QUERY_TIMEOUT_SECONDS,
) -> select.Decision:
    """Decide the parent of `job` among the models of `zoo`; the decision is final.

    Every way warm start can fail (disabled, untraceable child, empty or incompatible zoo,
    similarity below `minSimilarity`, an unreadable parent record, fewer than 10% of the
    child's weight tensors transferable) ends in a cold-start decision whose reason says why
    with numbers.

    Args:
        job: the validated job; `spec.warmStart` says whether and how.
        zoo: the model zoo.
        zoo_index: a loaded index to reuse (the operator keeps one); None: index `zoo` now.
        timeout_seconds: deadline of the similarity search (partial results count).

    Returns:
        The decision: a parent with its transfer counts, or a cold start with its reason.

    Raises:
        api.InvalidSpec: the pinned parent is not in the zoo (the fix is to pick an existing id).
        store.StoreUnavailable: the zoo could not be read.
    """
    spec = job.spec.warm_start
    if not spec.enabled:
        return select.cold_start(select.Outcome.DISABLED,
                                 "warm start disabled by spec.warmStart.enabled")
    modality = str(models.modality_of(job.spec.model))
    task = str(models.task_of(job.spec.model))
    try:
        child = model_graph(job.spec.model)
    except graph.GraphError as exc:
        return select.cold_start(select.Outcome.COLD_UNTRACEABLE, f"cold start: {exc}")
    if spec.parent != "auto":
        record = pinned_record(zoo, spec.parent)
        parent = graph.from_json(records.load_graph(zoo, record))
        chosen = select.pinned(_candidate(record, match.similarity(parent, child)),
                               modality=modality, task=task, min_similarity=spec.min_similarity)
        return _count_transfer(chosen, zoo, job.spec.model)
    owned = zoo_index is None
    zoo_index = zoo_index or index.ZooIndex(zoo)
    try:
        found = zoo_index.query(child, modality=modality, task=task, top_k=None,
                                timeout_seconds=timeout_seconds)
    finally:
        if owned:
            zoo_index.close()
    candidates = [_candidate(c.record, c.similarity) for c in found.candidates]
    if not candidates and len(zoo_index):
        return select.cold_start(select.Outcome.COLD_INCOMPATIBLE,
                                 f"cold start: none of the {len(zoo_index)} zoo models is a "
                                 f"{modality} {task} model")
    chosen = select.choose_parent(candidates, modality=modality, task=task,
                                  min_similarity=spec.min_similarity)
    return _count_transfer(chosen, zoo, job.spec.model)


def apply(
    decision: select.Decision,
    zoo: store.ObjectStore | None,
    child_model: nn.Module,
    input_shape: list[int] | tuple[int, ...],
    *,
    seed: int = 0,
) -> Applied:
    """Transform the decided parent's weights into `child_model`'s shapes (not loaded).

    The decision is final: nothing here chooses again or turns it cold. The alignment of the
    two graphs is recomputed to map the tensors.

    Args:
        decision: from `decide`, here or upstream.
        zoo: the model zoo holding the parent (None only with a cold-start decision).
        child_model: the freshly initialised child (left unchanged).
        input_shape: one sample's shape without the batch.
        seed: seeds the symmetry-breaking noise of widened units.

    Returns:
        The warm state_dict (None on a cold start) and what was not transferred.

    Raises:
        ApplyError: no zoo was given, or the parent cannot be loaded or transformed any more.
        store.StoreUnavailable: the zoo could not be read.
    """
    if decision.parent_id is None:
        return Applied(None, 1.0)
    if zoo is None:
        raise ApplyError(f"the warm-start decision names parent {decision.parent_id}, but no "
                         "model zoo is configured (--zoo)")
    try:
        parent_state, parent_graph = _load_parent(zoo, decision.parent_id)
        result = transform.warm_start_state(
            parent_state, parent_graph, child_model, input_shape,
            generator=torch.Generator().manual_seed(seed))
    except (store.ObjectNotFound, records.CorruptRecord, graph.GraphError,
            transform.TransformError) as exc:
        raise ApplyError(f"warm-start parent {decision.parent_id} is unusable now ({exc}); "
                         "resubmit the job to decide again") from exc
    if (result.matched_tensors, result.total_tensors) != (decision.matched_tensors,
                                                          decision.total_tensors):
        _log.warning("warm start from %s transferred %d of %d tensors, the decision counted "
                     "%s of %s", decision.parent_id, result.matched_tensors,
                     result.total_tensors, decision.matched_tensors, decision.total_tensors)
    return Applied(result.state_dict, result.untransferred_fraction, tuple(result.notes))


def pinned_record(zoo: store.ObjectStore, model_id: str) -> records.ZooRecord:
    """The zoo record a job pins as its parent (``spec.warmStart.parent``).

    Raises:
        api.InvalidSpec: no such record, or a damaged one (one problem naming the field).
        store.StoreUnavailable: the zoo could not be read.
    """
    try:
        return records.read_record(zoo, model_id)
    except (store.ObjectNotFound, ValueError) as exc:
        detail = "" if isinstance(exc, store.ObjectNotFound) else f" ({exc})"
        raise api.InvalidSpec([
            (f"spec.warmStart.parent: no usable zoo model {model_id!r} in {zoo.describe()}"
            f"{detail}; use an id from `kiln zoo ls`, or auto")]) from None


def _count_transfer(chosen: select.Decision, zoo: store.ObjectStore,
                    spec: api.ModelSpec) -> select.Decision:
    """`select.finalize` on a dry run of the transform: the parent's weights into a child on
    the `meta` device, so nothing is computed; a parent that cannot be read gives a cold start."""
    if chosen.parent_id is None:
        return chosen
    try:
        parent_state, parent_graph = _load_parent(zoo, chosen.parent_id)
        with torch.device("meta"):
            child_model = models.build(spec)
        result = transform.warm_start_state(parent_state, parent_graph, child_model,
                                            spec.input_shape, noise_std=0.0)
    except (store.ObjectNotFound, records.CorruptRecord, graph.GraphError,
            transform.TransformError) as exc:
        return select.cold_start(select.Outcome.COLD_UNREADABLE_PARENT,
                                 f"cold start: parent {chosen.parent_id} is unusable ({exc})")
    return select.finalize(chosen, result.matched_tensors, result.total_tensors)


def _load_parent(zoo: store.ObjectStore,
                 parent_id: str) -> tuple[Mapping[str, Tensor], nx.DiGraph]:
    """The parent's weights (checksum verified) and graph."""
    record = records.read_record(zoo, parent_id)
    return records.load_weights(zoo, record), graph.from_json(records.load_graph(zoo, record))


def _candidate(record: records.ZooRecord, similarity: float) -> select.Candidate:
    return select.Candidate(
        model_id=record.id, similarity=min(1.0, max(0.0, similarity)),
        metric_name=record.metric_name, metric_value=record.metric_value,
        higher_is_better=record.metric_name != api.TargetMetric.VALIDATION_LOSS,
        modality=record.modality, task=record.task, dataset=record.dataset)

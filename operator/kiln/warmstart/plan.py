"""Warm start end to end: decide the parent (`plan`), then seed the child with it (`apply`).

The ModelKeeper pipeline (Lai et al., NSDI '23; DESIGN.md section 4) behind two calls, so the
trainer, the operator and `kiln zoo query` share one path:

1. `plan(job, zoo)`: trace the child architecture (`graph`), query the zoo index for the most
   similar compatible models (`kiln.warmstart.index`), and let `select` pick the parent by similarity
   bucket, then accuracy; or score a pinned parent (`spec.warmStart.parent`). The operator runs
   this in an executor and passes the parent to the trainer pod.
2. `apply(decision, zoo, child_model, input_shape)`: load the parent's weights (checksum
   verified) and graph, transform them into the child's shapes (`transform`), and apply the 10%
   rule (`select.finalize`). The caller loads `state_dict` into its model.

Every way warm start can fail — disabled, untraceable child, empty or incompatible zoo,
similarity below `minSimilarity`, too few tensors, an unreadable parent record — ends in a
cold-start decision whose reason says why with numbers; only an unreachable store raises
(`store.StoreUnavailable`: the operator turns it into a ZooUnavailable condition and retries).

Callers: `kiln_trainer.loop`, `kiln.controller`, `kiln.cli` (`kiln zoo query`).
Non-goals: no training, no learning-rate damping (see `transform.lr_damping`).
"""

from __future__ import annotations

import dataclasses

import networkx as nx
import torch
from torch import Tensor, nn

from kiln import api, models
from kiln.warmstart import graph, match, select, transform
from kiln.warmstart import index as zoo_index
from kiln.zoo import records, store

QUERY_TIMEOUT_SECONDS = 30.0


@dataclasses.dataclass(frozen=True)
class Applied:
    """The outcome of `apply`.

    Attributes:
        decision: the final decision (a cold start if the 10% rule or the parent record failed).
        state_dict: the child's warm-started state_dict, or None on a cold start.
        untransferred_fraction: share of the child's weight tensors NOT transferred, in [0, 1]
            (1.0 on a cold start); drives the learning-rate damping of the first epochs.
        notes: one sentence per special case of the transform (resized heads, skipped inits).
    """

    decision: select.Decision
    state_dict: dict[str, Tensor] | None
    untransferred_fraction: float
    notes: tuple[str, ...] = ()


def child_graph(spec: api.ModelSpec) -> nx.DiGraph:
    """The architecture graph of the job's model, built on the `meta` device (no weights).

    Raises:
        graph.GraphError: the model cannot be traced.
    """
    with torch.device("meta"):
        model = models.build(spec)
    return graph.extract(model, spec.input_shape, name=spec.architecture)


def plan(
    job: api.TrainingJob,
    zoo: store.ObjectStore,
    *,
    index: zoo_index.ZooIndex | None = None,
    timeout_seconds: float = QUERY_TIMEOUT_SECONDS,
) -> select.Decision:
    """Decide the parent of `job` among the models of `zoo`.

    Args:
        job: the validated job; `spec.warmStart` says whether and how.
        zoo: the model zoo.
        index: a loaded index to reuse (the operator keeps one); None: index `zoo` now.
        timeout_seconds: deadline of the similarity search (partial results count).

    Returns:
        The decision: a parent, or a cold start with its reason.

    Raises:
        api.InvalidSpec: the pinned parent is not in the zoo (the fix is to pick an existing id).
        store.StoreUnavailable: the zoo could not be read.
    """
    spec = job.spec.warm_start
    if not spec.enabled:
        return cold_start(select.Outcome.DISABLED, "warm start disabled by spec.warmStart.enabled")
    info = models.get_info(job.spec.model.architecture)
    modality, task = str(info.modality), str(info.task)
    try:
        child = child_graph(job.spec.model)
    except graph.GraphError as exc:
        return cold_start(select.Outcome.COLD_UNTRACEABLE, f"cold start: {exc}")
    if spec.parent != "auto":
        record = pinned_record(zoo, spec.parent)
        parent = graph.from_json(records.load_graph(zoo, record))
        return select.pinned(_candidate(record, match.similarity(parent, child)),
                             modality=modality, task=task, min_similarity=spec.min_similarity)
    owned = index is None
    index = index or zoo_index.ZooIndex(zoo)
    try:
        found = index.query(child, modality=modality, task=task, top_k=None,
                            timeout_seconds=timeout_seconds)
    finally:
        if owned:
            index.close()
    candidates = [_candidate(c.record, c.similarity) for c in found.candidates]
    if not candidates and len(index):
        return cold_start(select.Outcome.COLD_INCOMPATIBLE,
                     f"cold start: none of the {len(index)} zoo models is a {modality} "
                     f"{task} model")
    return select.choose_parent(candidates, modality=modality, task=task,
                                min_similarity=spec.min_similarity)


def apply(
    decision: select.Decision,
    zoo: store.ObjectStore,
    child_model: nn.Module,
    input_shape: list[int] | tuple[int, ...],
    *,
    seed: int = 0,
) -> Applied:
    """Transform the chosen parent's weights into `child_model`'s shapes (not loaded).

    Args:
        decision: from `plan` (or passed down by the operator).
        zoo: the model zoo holding the parent.
        child_model: the freshly initialised child (left unchanged).
        input_shape: one sample's shape without the batch.
        seed: seeds the symmetry-breaking noise of widened units.

    Returns:
        The final decision and, unless it is a cold start, the warm state_dict.

    Raises:
        store.StoreUnavailable: the zoo could not be read.
    """
    if decision.cold_start or decision.parent_id is None:
        return Applied(decision, None, 1.0)
    try:
        record = records.read_record(zoo, decision.parent_id)
        parent_state = records.load_weights(zoo, record)
        parent_graph = graph.from_json(records.load_graph(zoo, record))
        result = transform.warm_start_state(
            parent_state, parent_graph, child_model, input_shape,
            generator=torch.Generator().manual_seed(seed))
    except (store.ObjectNotFound, records.CorruptRecord, graph.GraphError,
            transform.TransformError) as exc:
        return Applied(cold_start(select.Outcome.COLD_UNREADABLE_PARENT,
                             f"cold start: parent {decision.parent_id} is unusable ({exc})"),
                       None, 1.0)
    final = select.finalize(decision, result.matched_tensors, result.total_tensors)
    if final.cold_start:
        return Applied(final, None, 1.0, tuple(result.notes))
    return Applied(final, result.state_dict, result.untransferred_fraction, tuple(result.notes))


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


def _candidate(record: records.ZooRecord, similarity: float) -> select.Candidate:
    return select.Candidate(
        model_id=record.id, similarity=min(1.0, max(0.0, similarity)),
        metric_name=record.metric_name, metric_value=record.metric_value,
        higher_is_better=record.metric_name != api.TargetMetric.VALIDATION_LOSS,
        modality=record.modality, task=record.task, dataset=record.dataset)


def cold_start(outcome: select.Outcome, reason: str) -> select.Decision:
    """A cold-start decision with its outcome and reason."""
    return select.Decision(parent_id=None, similarity=None, parent_metric=None,
                           matched_tensors=None, total_tensors=None, reason=reason,
                           candidates_considered=0, outcome=outcome)

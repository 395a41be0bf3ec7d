"""The warm-start decision, made once (`decide`), and seeding the child with it (`apply`).

`decide` runs every check that can make a start cold (policy, parent record, the 10% rule), so
a decision passed downstream is final: `apply` only transforms the chosen parent's weights into
the child's shapes. Only an unreachable store raises (`store.StoreUnavailable`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence

import networkx as nx
import torch
from torch import Tensor, nn

from kiln import api, models
from kiln.warmstart import graph, index, match, select, transform
from kiln.zoo import records, store

QUERY_TIMEOUT_SECONDS = 30.0
# A damaged parent (bad checksum, missing weights) must not cold-start every job that would
# choose it: the policy chooses again without it, this many parents in all.
MAX_PARENT_TRIES = 3
# Parents the policy would choose next, each passing every check, kept in the decision for the
# trainer's probe guard to try when the chosen parent does no better than a cold start.
MAX_ALTERNATIVES = 2
# Parents of another family (`match.family_mismatch`) the policy passes over before it gives up
# and starts cold; each costs reading one graph.
MAX_FAMILY_REFUSALS = 8

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
        matched_tensors: child weight tensors transferred (0 on a cold start).
        total_tensors: the child's weight tensors (0 on a cold start).
        similarity: the alignment's similarity (None on a cold start).
        parent_metric: the parent record's metric value (None on a cold start).
        metric_name: its name.
        parent_provisional: the parent is a provisional record (its job's best weights so far).
        parent_data: what the parent was trained on (`records.ZooRecord.data_fingerprint`).
        unchanged: child state_dict keys holding their parent tensor exactly
            (`transform.TransformResult.unchanged`).
    """

    state_dict: dict[str, Tensor] | None
    untransferred_fraction: float
    notes: tuple[str, ...] = ()
    matched_tensors: int = 0
    total_tensors: int = 0
    similarity: float | None = None
    parent_metric: float | None = None
    metric_name: str | None = None
    parent_provisional: bool = False
    parent_data: str | None = None
    unchanged: frozenset[str] = frozenset()


def model_graph(spec: api.ModelSpec) -> nx.DiGraph:
    """The architecture graph of a job's model, built on the `meta` device (no weights).

    Raises:
        graph.GraphError: the model cannot be traced.
    """
    with torch.device("meta"):
        model = models.build(spec)
    dtype = models.example_batch(spec, device="meta").dtype
    return graph.extract(model, spec.input_shape, name=spec.label, input_dtype=dtype)


PRETRAINED_LORA_REASON = (
    "a LoRA job on spec.model.pretrained.uri: its trainer finds the zoo record of those weights "
    "(importing them once) and continues the best adapter on them, before its first step")


# A rewrite of a small record takes well under a second; a damaged one fails after these.
REREAD_DELAYS_SECONDS = (0.5, 1.0, 2.0)


def decide(
    job: api.TrainingJob,
    zoo: store.ObjectStore,
    *,
    zoo_index: index.ZooIndex | None = None,
    timeout_seconds: float = QUERY_TIMEOUT_SECONDS,
    child: nx.DiGraph | None = None,
) -> api.WarmStartDecision:
    """Decide the parent of `job` among the models of `zoo`; the decision is final.

    Every way warm start can fail (disabled, untraceable child, empty or incompatible zoo,
    similarity below `minSimilarity`, an unreadable parent record, fewer than 10% of the
    child's weight tensors transferable) ends in a cold-start decision whose reason says why
    with numbers. A chosen parent that cannot be read (corrupt, failed checksum, missing) is
    skipped and the policy chooses again among the rest, up to `MAX_PARENT_TRIES` parents;
    the reason names each skipped parent and why.

    Args:
        job: the validated job; `spec.warmStart` says whether and how.
        zoo: the model zoo.
        zoo_index: a loaded index to reuse (the operator keeps one); None: index `zoo` now.
        timeout_seconds: deadline of the similarity search (partial results count).
        child: the job's `model_graph`, when the caller extracted it already (the operator
            does, in a process it can kill); None: extract it here.

    Returns:
        The decision: a parent with its transfer counts, or a cold start with its reason.

    Raises:
        api.InvalidSpec: the pinned parent is not in the zoo (the fix is to pick an existing id).
        store.StoreUnavailable: the zoo could not be read.
    """
    spec = job.spec.warm_start
    if not spec.enabled:
        return select.cold_start(api.WarmStartOutcome.DISABLED,
                                 "warm start disabled by spec.warmStart.enabled")
    if job.spec.model.pretrained is not None and job.spec.training.peft is not None:
        return select.cold_start(api.WarmStartOutcome.IN_TRAINER, PRETRAINED_LORA_REASON)
    if job.spec.model.pretrained is not None:
        return select.cold_start(api.WarmStartOutcome.DISABLED, select.PRETRAINED_REASON)
    modality = str(models.modality_of(job.spec.model))
    task = str(models.task_of(job.spec.model))
    try:
        child = child if child is not None else model_graph(job.spec.model)
    except graph.GraphError as exc:
        return select.cold_start(api.WarmStartOutcome.COLD_UNTRACEABLE, f"cold start: {exc}")
    if spec.parent != "auto":
        record = pinned_record(zoo, spec.parent, namespace=job.namespace)
        if job.spec.training.peft is not None:  # the trainer loads base and adapter as pinned
            require_lora_shape(job, record)  # an adapter's record keeps its base's shape
            return api.WarmStartDecision(
                outcome=api.WarmStartOutcome.PINNED, parent=record.id, similarity=1.0,
                reason=f"LoRA on {record.base or record.id} (pinned parent {record.id}); "
                "layer freezing is off: the base is frozen by design")
        if record.base is not None:
            raise api.InvalidSpec([(
                f"spec.warmStart.parent: zoo model {record.id} is a LoRA adapter on "
                f"{record.base}; pin {record.base}, set spec.training.peft to continue the "
                "adapter, or `kiln zoo export` it merged and import that")])
        parent = graph.from_json(records.load_graph(zoo, record))
        chosen = select.pinned(_candidate(record, match.similarity(parent, child)),
                               modality=modality, task=task, min_similarity=spec.min_similarity)
        return _noting_provisional(_count_transfer(chosen, zoo, job.spec.model),
                                   {record.id} if record.provisional else set())
    owned = zoo_index is None
    zoo_index = zoo_index or index.ZooIndex(zoo)
    try:
        found = zoo_index.query(child, modality=modality, task=task, top_k=None,
                                timeout_seconds=timeout_seconds)
    finally:
        if owned:
            zoo_index.close()
    # Tenancy: a job sees its own namespace's models and shared ones, nothing else; the
    # policy (and spec.warmStart.preferred) only ranks these.
    # An adapter's weights are no whole model: only a LoRA job that pins one starts from it.
    # Nor is the job's own reserved record a parent: a run resumed without its checkpoint
    # would otherwise start from its own earlier model, and name itself its parent.
    own_record = _reserved_id(job)
    candidates = [_candidate(c.record, c.similarity) for c in found.candidates
                  if c.record.visible_to(job.namespace) and c.record.base is None
                  and c.record.id != own_record]
    visible = sum(r.visible_to(job.namespace) for r in zoo_index.all_records())
    if not visible and len(zoo_index):
        return select.cold_start(api.WarmStartOutcome.COLD_EMPTY,
                                 f"cold start: none of the {len(zoo_index)} zoo models is "
                                 f"visible to namespace {job.namespace} (they are private to "
                                 "other namespaces)")
    if not candidates and visible:
        return select.cold_start(api.WarmStartOutcome.COLD_INCOMPATIBLE,
                                 f"cold start: none of the {visible} zoo models visible to "
                                 f"namespace {job.namespace} is a {modality} {task} model")
    skipped: dict[str, str] = {}
    refused: dict[str, str] = {}
    chosen = _choose(candidates, zoo, job, modality, task, child, skipped, refused)
    if chosen.parent is not None:  # the parents the policy would choose next, in order
        rest = [c for c in candidates if c.model_id != chosen.parent
                and c.model_id not in skipped and c.model_id not in refused]
        alternatives: list[str] = []
        while rest and len(alternatives) < MAX_ALTERNATIVES:
            after = _choose(rest, zoo, job, modality, task, child, {}, {})
            if after.parent is None:
                break
            alternatives.append(after.parent)
            rest = [c for c in rest if c.model_id != after.parent]
        own = _best_preferred(rest, job.spec.warm_start)
        if own is not None:
            # The policy ranks by similarity first; the best of the models the job prefers (a
            # sweep's best trial so far) may have learned far more. The guard tries both and
            # keeps it if it starts clearly lower.
            after = _choose([own], zoo, job, modality, task, child, {}, {})
            if after.parent is not None:
                alternatives.insert(0, after.parent)
        chosen = chosen.model_copy(update={"alternatives": alternatives})
    chosen = _with_refusals(chosen, refused)
    chosen = _noting_provisional(chosen, {c.record.id for c in found.candidates
                                          if c.record.provisional})
    if not skipped:
        return chosen
    unusable = "skipped unusable parent " + "; ".join(f"{k} ({v})" for k, v in skipped.items())
    if chosen.parent is not None:
        return chosen.model_copy(update={"reason": f"{chosen.reason}; {unusable}"})
    if chosen.outcome is api.WarmStartOutcome.COLD_UNREADABLE_PARENT:
        return chosen
    then = chosen.reason if len(skipped) < len(candidates) else \
        "cold start: no other candidate is left"
    return chosen.model_copy(update={"outcome": api.WarmStartOutcome.COLD_UNREADABLE_PARENT,
                                     "reason": f"{then}; {unusable}"})


def _reserved_id(job: api.TrainingJob) -> str | None:
    """The zoo record id reserved for `job`'s model (`records.job_record_id`), None without a
    usable uid."""
    try:
        return records.job_record_id(job.spec.model.label, str(job.metadata.uid or ""))
    except ValueError:
        return None


def _best_preferred(candidates: Sequence[select.Candidate],
                    spec: api.WarmStartSpec) -> select.Candidate | None:
    """The first of `spec.preferred` (best first) among `candidates` that reaches
    `minSimilarity`, or None."""
    eligible = {c.model_id: c for c in candidates if c.similarity >= spec.min_similarity}
    return next((eligible[i] for i in spec.preferred if i in eligible), None)


def _choose(candidates: list[select.Candidate], zoo: store.ObjectStore, job: api.TrainingJob,
            modality: str, task: str, child: nx.DiGraph, skipped: dict[str, str],
            refused: dict[str, str]) -> api.WarmStartDecision:
    """The policy's choice among `candidates`, counted by a dry run; a parent that cannot be
    read goes into `skipped` (id: why) and the policy chooses again without it, up to
    `MAX_PARENT_TRIES` parents; a parent of another family goes into `refused` (id: why), up
    to `MAX_FAMILY_REFUSALS` of them."""
    spec = job.spec.warm_start
    while len(skipped) < MAX_PARENT_TRIES:
        chosen = select.choose_parent(
            candidates, modality=modality, task=task, min_similarity=spec.min_similarity,
            dataset_fingerprint=records.dataset_fingerprint(job.spec.dataset),
            preferred=spec.preferred)
        parent = chosen.parent
        if parent is None:
            break
        counted = _dry_run(chosen, zoo, job.spec.model, child=child)
        if isinstance(counted, api.WarmStartDecision):
            chosen = counted
            break
        if isinstance(counted, _OtherFamily):
            refused[parent] = counted.why
            if len(refused) >= MAX_FAMILY_REFUSALS:
                chosen = select.cold_start(
                    api.WarmStartOutcome.COLD_OTHER_FAMILY,
                    f"cold start: the first {MAX_FAMILY_REFUSALS} parents chosen are of "
                    f"another family", considered=chosen.candidates_considered)
                break
        else:
            skipped[parent] = counted
        candidates = [c for c in candidates if c.model_id != parent]
    else:
        return select.cold_start(
            api.WarmStartOutcome.COLD_UNREADABLE_PARENT,
            f"cold start: the first {MAX_PARENT_TRIES} parents chosen are unusable: "
            + "; ".join(f"{k} ({v})" for k, v in skipped.items()),
            considered=chosen.candidates_considered)
    return chosen


def _with_refusals(chosen: api.WarmStartDecision,
                   refused: Mapping[str, str]) -> api.WarmStartDecision:
    """`chosen`, saying which parents of another family the policy passed over; when that left
    it cold, the outcome is COLD_OTHER_FAMILY (an unreadable parent keeps its own outcome)."""
    if not refused:
        return chosen
    passed = "passed over " + "; ".join(f"{k} ({v})" for k, v in refused.items())
    if chosen.parent is not None:
        return chosen.model_copy(update={"reason": f"{chosen.reason}; {passed}"})
    if chosen.outcome is api.WarmStartOutcome.COLD_UNREADABLE_PARENT:
        return chosen.model_copy(update={"reason": f"{chosen.reason}; {passed}"})
    then = ("" if chosen.outcome in (api.WarmStartOutcome.COLD_EMPTY,
                                     api.WarmStartOutcome.COLD_OTHER_FAMILY)
            else "; then " + chosen.reason.removeprefix("cold start: "))
    return chosen.model_copy(update={"outcome": api.WarmStartOutcome.COLD_OTHER_FAMILY,
                                     "reason": f"cold start: {passed}{then}"})


def _noting_provisional(chosen: api.WarmStartDecision,
                        provisional: set[str]) -> api.WarmStartDecision:
    """`chosen`, saying so when its parent is a provisional record (its job still trains: the
    weights are its best so far, and the final record will replace them under the same id)."""
    if chosen.parent is None or chosen.parent not in provisional:
        return chosen
    return chosen.model_copy(update={"reason": f"{chosen.reason}; {chosen.parent} is a "
                                     "provisional record (its job's best weights so far: "
                                     "that job still trains, or was stopped early, e.g. "
                                     "pruned)"})


@dataclasses.dataclass(frozen=True)
class _OtherFamily:
    """A `_dry_run` verdict: the parent is of another family (`match.family_mismatch`)."""

    why: str


def apply(
    decision: api.WarmStartDecision,
    zoo: store.ObjectStore | None,
    child_model: nn.Module,
    input_shape: list[int] | tuple[int, ...],
    *,
    seed: int = 0,
    reread_delays: Sequence[float] = REREAD_DELAYS_SECONDS,
) -> Applied:
    """Transform the decided parent's weights into `child_model`'s shapes (not loaded).

    The decision is final: nothing here chooses again or turns it cold. The alignment of the
    two graphs is recomputed to map the tensors. A parent that cannot be read is read again
    after each of `reread_delays` (seconds) first: a running job's provisional record is
    rewritten as it trains, and is missing or half-new while that lasts.

    Args:
        decision: from `decide`, here or upstream.
        zoo: the model zoo holding the parent (None only with a cold-start decision).
        child_model: the freshly initialised child (left unchanged).
        input_shape: one sample's shape without the batch.
        seed: seeds the symmetry-breaking noise of widened units.
        reread_delays: the waits before reading an unreadable parent again.

    Returns:
        The warm state_dict (None on a cold start) and what was not transferred.

    Raises:
        ApplyError: no zoo was given, or the parent cannot be loaded or transformed any more.
        store.StoreUnavailable: the zoo could not be read.
    """
    if decision.parent is None:
        return Applied(None, 1.0)
    if zoo is None:
        raise ApplyError(f"the warm-start decision names parent {decision.parent}, but no "
                         "model zoo is configured (--zoo)")
    try:
        record, parent_state, parent_graph = _read_parent(zoo, decision.parent, reread_delays)
        result = transform.warm_start_state(
            parent_state, parent_graph, child_model, input_shape,
            generator=torch.Generator().manual_seed(seed))
    except (store.ObjectNotFound, records.CorruptRecord, graph.GraphError,
            transform.TransformError) as exc:
        raise ApplyError(f"warm-start parent {decision.parent} is unusable now ({exc}); "
                         "resubmit the job to decide again") from exc
    if decision.matched_tensors is not None and (
            result.matched_tensors, result.total_tensors) != (decision.matched_tensors,
                                                              decision.total_tensors):
        _log.warning("warm start from %s transferred %d of %d tensors, the decision counted "
                     "%s of %s", decision.parent, result.matched_tensors,
                     result.total_tensors, decision.matched_tensors, decision.total_tensors)
    return Applied(result.state_dict, result.untransferred_fraction, tuple(result.notes),
                   matched_tensors=result.matched_tensors, total_tensors=result.total_tensors,
                   similarity=result.similarity, parent_metric=record.metric_value,
                   metric_name=record.metric_name, parent_provisional=record.provisional,
                   parent_data=record.data_fingerprint, unchanged=frozenset(result.unchanged))


def _read_parent(zoo: store.ObjectStore, parent: str, delays: Sequence[float]
                 ) -> tuple[records.ZooRecord, Mapping[str, Tensor], nx.DiGraph]:
    """The parent's record, weights and graph, read again after each of `delays` while it
    is missing or disagrees with itself (the last failure is raised)."""
    for delay in (*delays, None):
        try:
            record = records.read_record(zoo, parent)
            return (record, *_load_parent(zoo, parent, record))
        except (store.ObjectNotFound, records.CorruptRecord):
            if delay is None:
                raise
            _log.info("warm-start parent %s is unreadable, perhaps being rewritten: reading it "
                      "again in %.1f s", parent, delay)
            time.sleep(delay)
    raise AssertionError("unreachable: the last try raises")


def require_lora_shape(job: api.TrainingJob, base: records.ZooRecord) -> None:
    """Refuse a LoRA job whose spec.model.inputShape is not its base's (`base`: the base or
    an adapter on it): a convolution's weights load at any image size, so only this check
    stops training a base on inputs it never saw."""
    shape = list(job.spec.model.input_shape)
    if list(base.input_shape) != shape:
        raise api.InvalidSpec([(
            f"spec.model.inputShape: {shape} is not the LoRA base {base.id}'s "
            f"{list(base.input_shape)}; LoRA trains on its base as that was trained, so set "
            f"inputShape to {list(base.input_shape)} (`kiln zoo show {base.id}`) or pin a base "
            "trained on this shape")], source=f"job {job.name}")


def pinned_record(zoo: store.ObjectStore, model_id: str, *,
                  namespace: str) -> records.ZooRecord:
    """The zoo record a job of `namespace` pins as its parent (``spec.warmStart.parent``).

    Raises:
        api.InvalidSpec: no such record, a damaged one (one problem naming the field), or a
            private record of another namespace.
        store.StoreUnavailable: the zoo could not be read.
    """
    try:
        record = records.read_record(zoo, model_id)
    except (store.ObjectNotFound, ValueError) as exc:
        detail = "" if isinstance(exc, store.ObjectNotFound) else f" ({exc})"
        raise api.InvalidSpec([
            (f"spec.warmStart.parent: no usable zoo model {model_id!r} in {zoo.describe()}"
            f"{detail}; use an id from `kiln zoo ls`, or auto (a LoRA job without "
             "spec.model.pretrained.uri needs its base pinned)")]) from None
    if not record.visible_to(namespace):
        raise api.InvalidSpec([(
            f"spec.warmStart.parent: zoo model {model_id!r} is private to namespace "
            f"{record.namespace}, and this job runs in {namespace}; pin a model of "
            f"{namespace} or a shared one (`kiln zoo ls --namespace {namespace}`), or ask its "
            "owners to register it with spec.zoo.share: shared")])
    return record


def _count_transfer(chosen: api.WarmStartDecision, zoo: store.ObjectStore,
                    spec: api.ModelSpec) -> api.WarmStartDecision:
    """`_dry_run`, where a parent that cannot be read gives a cold start."""
    if chosen.parent is None:
        return chosen
    counted = _dry_run(chosen, zoo, spec)  # a pinned parent is never refused for its family
    assert not isinstance(counted, _OtherFamily)
    if isinstance(counted, str):
        return select.cold_start(api.WarmStartOutcome.COLD_UNREADABLE_PARENT,
                                 f"cold start: parent {chosen.parent} is unusable ({counted})")
    return counted


def _dry_run(chosen: api.WarmStartDecision, zoo: store.ObjectStore, spec: api.ModelSpec, *,
             child: nx.DiGraph | None = None) -> api.WarmStartDecision | str | _OtherFamily:
    """`select.finalize` on a dry run of the transform: the parent's weights into a child on
    the `meta` device, so nothing is computed; or why the parent cannot be read; or, given the
    `child` graph, that the parent is of another family (read before its weights)."""
    assert chosen.parent is not None
    try:
        record = records.read_record(zoo, chosen.parent)
        parent_graph = graph.from_json(records.load_graph(zoo, record))
        why = match.family_mismatch(parent_graph, child) if child is not None else None
        if why is not None:
            return _OtherFamily(why)
        parent_state = records.load_weights(zoo, record)
        with torch.device("meta"):
            child_model = models.build(spec)
        result = transform.warm_start_state(parent_state, parent_graph, child_model,
                                            spec.input_shape, noise_std=0.0)
    except (store.ObjectNotFound, records.CorruptRecord, graph.GraphError,
            transform.TransformError) as exc:
        return str(exc)
    return select.finalize(chosen, result.matched_tensors, result.total_tensors)


def _load_parent(zoo: store.ObjectStore, parent_id: str,
                 record: records.ZooRecord | None = None) -> tuple[Mapping[str, Tensor],
                                                                   nx.DiGraph]:
    """The parent's weights (checksum verified) and graph (`record`: its record, if read)."""
    record = record or records.read_record(zoo, parent_id)
    return records.load_weights(zoo, record), graph.from_json(records.load_graph(zoo, record))


def _candidate(record: records.ZooRecord, similarity: float) -> select.Candidate:
    return select.Candidate(
        model_id=record.id, similarity=min(1.0, max(0.0, similarity)),
        metric_name=record.metric_name, metric_value=record.metric_value,
        higher_is_better=record.metric_name != api.TargetMetric.VALIDATION_LOSS,
        modality=record.modality, task=record.task, dataset=record.dataset,
        dataset_fingerprint=record.dataset_fingerprint,
        content_fingerprint=record.content_fingerprint)

"""Parent selection: which zoo model, if any, seeds a new job (ModelKeeper's policy, as data).

Pure functions of candidates and their similarities: no store I/O, no graphs, no torch (the
caller turns zoo records into `Candidate`s). The result is an `api.WarmStartDecision`.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import pydantic

from kiln import api

# The policy is ModelKeeper's accuracy-aware selection (Lai et al., "ModelKeeper: Accelerating
# DNN Training via Automated Training Warmup", NSDI '23), with these changes:
#
# 1. Compatibility: keep candidates with the child's modality AND task (ModelKeeper keeps one
#    flat zoo; a text model cannot seed an image model). The count dropped goes in the reason.
# 2. Accuracy outliers: within each (task, dataset, metric) group of >= 3 candidates, drop those
#    below mean - 3 sigma (higher-is-better metrics) or above mean + 3 sigma (losses); sigma is
#    the population standard deviation of the group, the candidate included (ModelKeeper's
#    z-score, `outlier_factor = 3`). Note: with n members and the candidate included, no z-score
#    can exceed (n - 1) / sqrt(n), so the filter can only fire in groups of 11 or more.
#    Candidates with a non-finite metric (a diverged run) are dropped first, whatever the group
#    size.
# 3. Threshold: if the best similarity is below `min_similarity`, cold start. Otherwise only
#    candidates at or above it take part (ModelKeeper has no threshold: SCORE_THRESHOLD = -inf).
# 4. Buckets: split [0, 1] into 10 equal-width similarity buckets ([0.9, 1.0] is the top one),
#    take the highest non-empty bucket and, within it, the best metric (ties: higher similarity,
#    then the smaller id, so the choice is deterministic). If the bucket mixes metric names, only
#    the most common one is compared (a loss and an accuracy are not comparable).
#    Within the bucket, candidates trained on the child's dataset (same fingerprint) are
#    preferred: similar data makes warm weights more useful, but never outranks similarity.
#    The fingerprint is the spec's (`records.dataset_fingerprint`: the user's, or a hash of
#    the dataset spec): at admission nothing has read the child's data yet. A model whose
#    content fingerprint equals that of a model with the child's spec fingerprint counts as
#    trained on the same data too (the same files reached by another path or spec). The
#    trainer, once it has read the data, says whether the parent's content fingerprint
#    matches (`kiln_trainer.warm`).
# 5. Once the weight transform has counted what transfers, `finalize` turns the decision into a
#    cold start when fewer than 10% of the child's weight tensors transfer (ModelKeeper's
#    THRESHOLD = 0.1, but there the transformed weights were still returned and loaded).
#
# A pinned parent (`spec.warmStart.parent` != "auto") skips the policy: the caller finds the
# record and calls `pinned`, which still reports similarity and threshold in the reason.

BUCKETS = 10
"""Number of equal-width similarity buckets over [0, 1] (ModelKeeper `bucketing_selection`)."""
OUTLIER_SIGMAS = 3.0
"""Metric z-score beyond which a candidate is an outlier (ModelKeeper `outlier_factor`)."""
MIN_GROUP_FOR_OUTLIERS = 3
"""Smallest (task, dataset, metric) group in which outliers are looked for."""
MIN_TRANSFER_FRACTION = 0.1
"""Below this fraction of the child's weight tensors transferred, cold start (ModelKeeper)."""
PRETRAINED_REASON = "no zoo parent: the job starts from spec.model.pretrained.uri"
"""The reason of a job that starts from `spec.model.pretrained` (outcome disabled): the
results table says "pretrained" for it."""
PREFERRED_SLACK = 0.05
"""A `spec.warmStart.preferred` model wins when its similarity is at most this far below the
best match's: a sweep's own trials, nearly as close, beat a stranger's model."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidate:
    """One zoo model as seen by selection.

    Attributes:
        model_id: the zoo id, e.g. "small_resnet-7f3c2a1b".
        similarity: architectural similarity to the child in [0, 1] (`match.similarity`).
        metric_name: e.g. "validation_accuracy" or "validation_loss".
        metric_value: its final value.
        higher_is_better: True for accuracies, False for losses.
        modality: "image" or "text" (`kiln.models.Modality` values).
        task: "classification" or "language_modeling" (`kiln.models.Task` values).
        dataset: dataset name it was trained on.
        matched_tensors: child weight tensors that would transfer, if already known.
        total_tensors: the child's weight tensors, if known.
        dataset_fingerprint: the record's dataset fingerprint, or None if unknown.
        content_fingerprint: what its trainer loaded (``content:``/``sample:``/``user:``),
            or None for older records.

    Raises:
        ValueError: similarity is not a number in [0, 1].
    """

    model_id: str
    similarity: float
    metric_name: str
    metric_value: float
    higher_is_better: bool
    modality: str
    task: str
    dataset: str
    matched_tensors: int | None = None
    total_tensors: int | None = None
    dataset_fingerprint: str | None = None
    content_fingerprint: str | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.similarity <= 1.0:  # also rejects NaN
            raise ValueError(f"candidate {self.model_id}: similarity must be in [0, 1] "
                             f"(got {self.similarity})")


def from_report(report: api.WarmStartDecision | Mapping[str, Any] | None,
                ) -> api.WarmStartDecision | None:
    """The decision a trainer reported (in its result or profile, or as JSON from its metrics),
    or None when it holds none: no report, no outcome, or an outcome that is no decision
    (`IN_TRAINER`: still to be made; `INIT_STATE`: the run's own code set the weights).

    Raises:
        ValueError: a field has the wrong type or value (the message names it).
    """
    if isinstance(report, Mapping):
        if report.get("outcome") is None:
            return None
        try:
            report = api.WarmStartDecision.model_validate(report)
        except pydantic.ValidationError as exc:
            raise ValueError("warm-start decision: " + "; ".join(api.problems_of(exc))) from None
    if report is None or report.outcome in (api.WarmStartOutcome.IN_TRAINER,
                                            api.WarmStartOutcome.INIT_STATE):
        return None
    return report


def choose_parent(
    candidates: Sequence[Candidate],
    *,
    modality: str,
    task: str,
    min_similarity: float,
    dataset_fingerprint: str | None = None,
    preferred: Sequence[str] = (),
) -> api.WarmStartDecision:
    """Pick the parent for a child by ModelKeeper's bucketed policy (see the comment at the top).

    Args:
        candidates: every zoo model, with its similarity to the child.
        modality: the child's input modality ("image" / "text").
        task: the child's task ("classification" / "language_modeling").
        min_similarity: `spec.warmStart.minSimilarity` in [0, 1].
        dataset_fingerprint: the child's dataset fingerprint; within the chosen bucket,
            candidates trained on the same data are preferred (None: no preference).
        preferred: `spec.warmStart.preferred`: among the eligible candidates within
            `PREFERRED_SLACK` similarity of the best match, the first of these ids present
            wins over the policy's choice; ids not among `candidates` are ignored (the caller
            passes only what the job may see).

    Returns:
        The decision; `parent` is None for a cold start, and `reason` says why.

    Raises:
        ValueError: min_similarity is not in [0, 1].
    """
    if not 0.0 <= min_similarity <= 1.0:
        raise ValueError(f"min_similarity must be in [0, 1] (got {min_similarity})")
    if not candidates:
        return cold_start(api.WarmStartOutcome.COLD_EMPTY, "cold start: the model zoo is empty")
    compatible = [c for c in candidates if c.modality == modality and c.task == task]
    incompatible = len(candidates) - len(compatible)
    if not compatible:
        return cold_start(api.WarmStartOutcome.COLD_INCOMPATIBLE,
                     f"cold start: none of the {len(candidates)} zoo models is "
                     f"{_a(modality)} {modality} {task} model", considered=0,
                     incompatible=incompatible)
    kept = drop_outliers(compatible)
    outliers = len(compatible) - len(kept)
    dropped = _dropped_phrase(incompatible, outliers)
    if not kept:
        return cold_start(api.WarmStartOutcome.COLD_INCOMPATIBLE,
                     f"cold start: all {len(compatible)} compatible zoo models have unusable "
                     f"metrics{dropped}", considered=0, incompatible=incompatible,
                     outliers=outliers)
    kept.sort(key=lambda c: c.model_id)  # `max` keeps the first maximum: ties -> smaller id
    best = max(kept, key=lambda c: c.similarity)
    if best.similarity < min_similarity:
        return cold_start(api.WarmStartOutcome.COLD_BELOW_MIN_SIMILARITY,
                          f"cold start: best zoo match {best.model_id} has similarity "
                          f"{best.similarity:.2f} < minSimilarity {min_similarity:.2f}"
                          f" ({_count(len(kept), 'candidate')}{dropped})",
                          considered=len(kept), incompatible=incompatible,
                          outliers=outliers).model_copy(update={"similarity": best.similarity})
    eligible = [c for c in kept if c.similarity >= min_similarity]
    top = max(bucket_of(c.similarity) for c in eligible)
    in_bucket = [c for c in eligible if bucket_of(c.similarity) == top]
    metric, compared = _comparable(in_bucket)
    # The content another model with the child's spec fingerprint was trained on is the
    # child's data too, whatever path or spec a third model reached it by.
    contents = {c.content_fingerprint for c in candidates if dataset_fingerprint
                and c.dataset_fingerprint == dataset_fingerprint and c.content_fingerprint}
    same_data = [c for c in compared if dataset_fingerprint and (
        c.dataset_fingerprint == dataset_fingerprint or c.content_fingerprint in contents)]
    parent = max(same_data or compared, key=lambda c: (_goodness(c), c.similarity))
    low, high = top / BUCKETS, (top + 1) / BUCKETS
    mixed = (f", compared on {metric} only" if len(compared) < len(in_bucket) else "")
    if same_data and parent.dataset_fingerprint == dataset_fingerprint:
        mixed += (f", trained on the same dataset ({_fingerprint_kind(parent)} fingerprint "
                  f"{_short_fingerprint(parent)}; {len(same_data)} of {len(compared)} were)")
    elif same_data:
        mixed += (f", trained on the same dataset (the same content, "
                  f"{(parent.content_fingerprint or '')[:27]}…, as a model with this job's "
                  f"dataset fingerprint; {len(same_data)} of {len(compared)} were)")
    # A candidate until the trainer's probe guard accepts it (kiln_trainer.warm).
    reason = (f"candidate parent {parent.model_id}: similarity {parent.similarity:.2f} "
              f"(bucket {low:.1f}-{high:.1f}, best {metric} {parent.metric_value:.4g} of "
              f"{len(in_bucket)} in the bucket{mixed}; {_count(len(kept), 'candidate')}{dropped})")
    near = {c.model_id: c for c in eligible
            if c.similarity >= best.similarity - PREFERRED_SLACK - 1e-9}
    favoured = next((near[i] for i in preferred if i in near), None)
    if favoured is not None and favoured is not parent:
        reason = (f"candidate parent {favoured.model_id}: similarity "
                  f"{favoured.similarity:.2f}, {favoured.metric_name} "
                  f"{favoured.metric_value:.4g}; listed in spec.warmStart.preferred and within "
                  f"{PREFERRED_SLACK} of the best match {best.model_id} "
                  f"({best.similarity:.2f}), so chosen over {parent.model_id}; "
                  f"{_count(len(kept), 'candidate')}{dropped}")
        parent = favoured
    return api.WarmStartDecision(
        parent=parent.model_id, similarity=parent.similarity, parent_metric=parent.metric_value,
        metric_name=parent.metric_name, matched_tensors=parent.matched_tensors,
        total_tensors=parent.total_tensors, reason=reason, candidates_considered=len(kept),
        outcome=api.WarmStartOutcome.WARM, dropped_incompatible=incompatible,
        dropped_outliers=outliers)


def pinned(
    candidate: Candidate,
    *,
    modality: str,
    task: str,
    min_similarity: float,
) -> api.WarmStartDecision:
    """The decision for a parent pinned by `spec.warmStart.parent`: always that parent.

    The policy (compatibility, outliers, threshold) is not applied: the user chose. The reason
    still reports the similarity and flags a threshold or modality/task mismatch, so a poor
    pin is visible in status. `finalize` still applies the 10% rule.

    Args:
        candidate: the pinned zoo model, with its similarity to the child.
        modality: the child's input modality.
        task: the child's task.
        min_similarity: `spec.warmStart.minSimilarity`, reported only.

    Returns:
        A decision with outcome PINNED.
    """
    notes = []
    if candidate.similarity < min_similarity:
        notes.append(f"below minSimilarity {min_similarity:.2f}, used because it is pinned")
    if candidate.modality != modality or candidate.task != task:
        notes.append(f"it is {_a(candidate.modality)} {candidate.modality} {candidate.task} "
                     f"model, the job {_a(modality)} {modality} {task} one")
    extra = f" ({'; '.join(notes)})" if notes else ""
    return api.WarmStartDecision(
        parent=candidate.model_id, similarity=candidate.similarity,
        parent_metric=candidate.metric_value, metric_name=candidate.metric_name,
        matched_tensors=candidate.matched_tensors, total_tensors=candidate.total_tensors,
        reason=(f"candidate parent {candidate.model_id} (pinned): similarity "
                f"{candidate.similarity:.2f}{extra}"),
        candidates_considered=1, outcome=api.WarmStartOutcome.PINNED)


def finalize(decision: api.WarmStartDecision, matched: int,
             total: int) -> api.WarmStartDecision:
    """Apply the 10% rule once the weight transform has counted what transfers.

    Args:
        decision: from `choose_parent` or `pinned`.
        matched: child weight tensors that received parent values
            (`transform.TransformResult.matched_tensors`).
        total: the child's weight tensors (`TransformResult.total_tensors`).

    Returns:
        A cold start (outcome COLD_FEW_TENSORS, parent None) if matched < 10% of total;
        otherwise the decision with the counts filled in and appended to the reason. A cold
        decision is returned with the counts only.

    Raises:
        ValueError: a negative count, or matched > total.
    """
    if matched < 0 or total < 0 or matched > total:
        raise ValueError(f"need 0 <= matched <= total (got matched={matched}, total={total})")
    counted = decision.model_copy(update={"matched_tensors": matched, "total_tensors": total})
    if decision.cold_start:
        return counted
    share = matched / total if total else 0.0
    amount = f"{matched} of {total} weight tensors ({100 * share:.1f}%)"
    if total == 0 or share < MIN_TRANSFER_FRACTION:
        return counted.model_copy(update={
            "parent": None, "parent_metric": None,
            "outcome": api.WarmStartOutcome.COLD_FEW_TENSORS,
            "reason": (f"cold start: only {amount} of the child transfer from {decision.parent} "
                       f"(similarity {_fmt(decision.similarity)}), below the "
                       f"{100 * MIN_TRANSFER_FRACTION:.0f}% minimum")})
    return counted.model_copy(update={"reason": f"{decision.reason}; {amount} transfer"})


def bucket_of(similarity: float) -> int:
    """Similarity bucket 0..9: [0, 0.1) -> 0, ..., [0.9, 1.0] -> 9 (1.0 joins the top bucket).

    A 1e-9 slack keeps 0.3 (stored as 0.29999...) in bucket 3.
    """
    return min(BUCKETS - 1, math.floor(similarity * BUCKETS + 1e-9))


def drop_outliers(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Remove non-finite metrics and 3-sigma metric outliers per (task, dataset, metric) group.

    Args:
        candidates: compatible candidates.

    Returns:
        The kept candidates, in input order.
    """
    finite = [c for c in candidates if math.isfinite(c.metric_value)]
    groups: dict[tuple[str, str, str], list[Candidate]] = collections.defaultdict(list)
    for c in finite:
        groups[(c.task, c.dataset, c.metric_name)].append(c)
    outliers: set[int] = set()
    for members in groups.values():
        if len(members) < MIN_GROUP_FOR_OUTLIERS:
            continue
        values = [c.metric_value for c in members]
        mean = sum(values) / len(values)
        sigma = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        for c in members:
            bad = (c.metric_value < mean - OUTLIER_SIGMAS * sigma if c.higher_is_better
                   else c.metric_value > mean + OUTLIER_SIGMAS * sigma)
            if bad:
                outliers.add(id(c))
    return [c for c in finite if id(c) not in outliers]


def _comparable(in_bucket: list[Candidate]) -> tuple[str, list[Candidate]]:
    """The most common metric name in the bucket (ties: name order) and its candidates."""
    counts = collections.Counter(c.metric_name for c in in_bucket)
    metric = min(counts, key=lambda name: (-counts[name], name))
    return metric, [c for c in in_bucket if c.metric_name == metric]


def _fingerprint_kind(c: Candidate) -> str:
    """The kind of `c`'s fingerprint: spec (a hash of the dataset spec, as
    `records.dataset_fingerprint` makes it), else user (the job's own)."""
    return "spec" if (c.dataset_fingerprint or "").startswith("spec-") else "user"


def _short_fingerprint(c: Candidate) -> str:
    text = c.dataset_fingerprint or ""
    return text if len(text) <= 24 else text[:20] + "..."  # "spec-" and 16 hex digits fit


def _goodness(c: Candidate) -> float:
    return c.metric_value if c.higher_is_better else -c.metric_value


def _dropped_phrase(incompatible: int, outliers: int) -> str:
    parts = []
    if incompatible:
        parts.append(f"{incompatible} incompatible dropped")
    if outliers:
        parts.append(f"{outliers} metric outlier{'s' if outliers > 1 else ''} dropped")
    return "".join(f", {p}" for p in parts)


def cold_start(outcome: api.WarmStartOutcome, reason: str, *, considered: int = 0,
               incompatible: int = 0, outliers: int = 0) -> api.WarmStartDecision:
    """A cold-start decision with its outcome and reason (one sentence with numbers)."""
    return api.WarmStartDecision(reason=reason, outcome=outcome, candidates_considered=considered,
                                 dropped_incompatible=incompatible, dropped_outliers=outliers)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _a(word: str) -> str:
    return "an" if word[:1].lower() in "aeiou" else "a"


def _fmt(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.2f}"

"""A sweep's trials as the operator reads them from their TrainingJobs, and the sweep's conditions.

Pure: which jobs are a sweep's trials (its controller ownerReference, never a label alone), what
a trial job's status says (evaluations of the objective, its end, its zoo model: the operator's
own status, never anything a pod or a user wrote), and the sweep's conditions. No API calls.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, Literal

import pydantic

from kiln import api
from kiln.controller import status
from kiln.zoo import records

S = api.sweep
ENDED = (S.SweepPhase.SUCCEEDED, S.SweepPhase.FAILED)


@dataclasses.dataclass(frozen=True)
class Reading:
    """What a trial's TrainingJob says now.

    Attributes:
        evaluation: its latest evaluation of the objective whose epoch is certain, as
            (epochs completed, value); None before the first.
        state: Running until the job ends, then Succeeded or Failed.
        metric: the objective at the end (Succeeded), else the latest value.
        zoo_model: its registered model (Succeeded: status.result.zooModel, which the
            operator checked), or the record reserved for it when the zoo holds one (a
            provisional model); else None.
        parent: the zoo model the operator warm-started it from.
        similarity: its architecture's similarity to the parent's (None when cold).
        message: why it failed.
        suspended: its spec.runPolicy.suspend is set (a pruned trial's stop was asked).
    """

    evaluation: tuple[int, float] | None
    state: S.TrialState
    metric: float | None
    zoo_model: str | None
    parent: str | None
    similarity: float | None
    message: str
    suspended: bool


def owner_uid(job: Mapping[str, Any]) -> str | None:
    """The uid of the TrainingSweep that controls `job`, or None."""
    for owner in (job.get("metadata") or {}).get("ownerReferences") or []:
        if (isinstance(owner, Mapping) and owner.get("controller") is True
                and owner.get("kind") == S.SWEEP_KIND
                and owner.get("apiVersion") == api.API_VERSION):
            return str(owner.get("uid") or "") or None
    return None


def owned(uid: str, sweep: str, jobs: Iterable[Mapping[str, Any]]) -> dict[int, dict[str, Any]]:
    """The trial jobs of sweep `sweep` (of uid `uid`) by trial index: those it controls
    (ownerReference), named as its trial of their kiln.dev/trial label. A job that only
    carries the sweep's label is anyone's and is ignored."""
    found: dict[int, dict[str, Any]] = {}
    for job in jobs:
        meta = job.get("metadata") or {}
        label = str((meta.get("labels") or {}).get(S.TRIAL_LABEL) or "")
        if not label.isdigit() or owner_uid(job) != uid:
            continue
        index = int(label)
        if meta.get("name") == S.trial_name(sweep, index):
            found[index] = dict(job)
    return found


def params_of(job: Mapping[str, Any]) -> dict[str, Any]:
    """The values the operator gave a trial job (its kiln.dev/trial-params annotation)."""
    text = ((job.get("metadata") or {}).get("annotations") or {}).get(S.PARAMS_ANNOTATION)
    try:
        params = json.loads(text) if isinstance(text, str) else {}
    except ValueError:
        return {}
    return params if isinstance(params, dict) else {}


def read(job: Mapping[str, Any], objective: S.Objective, *,
         zoo_ids: Collection[str] = ()) -> Reading:
    """What trial job `job` says (see `Reading`); `zoo_ids` are the zoo's record ids.

    While a job runs, status.progress holds the 1-based epoch in progress (capped at the
    budget) and the latest evaluation: the value belongs to epoch ``epoch - 1`` while that is
    below the budget; at the last epoch the two cannot be told apart, and the final value
    comes from status.result at the end.
    """
    st = job.get("status") or {}
    key = objective.metric.value  # validation_accuracy | validation_loss
    progress = status.part(st, "progress", api.ProgressStatus)
    result = status.part(st, "result", api.ResultStatus)
    warm = status.part(st, "warmStart", api.WarmStartDecision)
    # What the trainer reported, which the metric cannot take (an accuracy of 95), is none.
    latest = S.objective_value(objective.metric, getattr(progress, key))
    suspended = ((job.get("spec") or {}).get("runPolicy") or {}).get("suspend") is True
    state, metric, message = S.TrialState.RUNNING, latest, ""
    evaluation: tuple[int, float] | None = None
    if status.is_true(st, api.ConditionType.FAILED):
        failed = status.condition(st, api.ConditionType.FAILED)
        state, message = S.TrialState.FAILED, failed.message if failed else ""
    elif status.is_true(st, api.ConditionType.SUCCEEDED):
        state = S.TrialState.SUCCEEDED
        metric = S.objective_value(objective.metric, getattr(result, key))
        metric = latest if metric is None else metric
        if metric is not None and progress.epoch:
            # at the end: the epochs run, as the trainer counts them (at most the budget)
            evaluation = (min(progress.epoch, _epochs(job)), metric)
    elif latest is not None and progress.epoch is not None:
        epochs = _epochs(job)
        if progress.epoch < epochs and progress.epoch >= 2:
            evaluation = (progress.epoch - 1, latest)
    zoo_model = result.zoo_model if state is S.TrialState.SUCCEEDED else None
    if zoo_model is None:
        reserved = _reserved_id(job)
        zoo_model = reserved if reserved in zoo_ids else None
    return Reading(evaluation=evaluation, state=state, metric=metric, zoo_model=zoo_model,
                   parent=warm.parent, similarity=warm.similarity if warm.parent else None,
                   message=message, suspended=suspended)


def _epochs(job: Mapping[str, Any]) -> int:
    """The admitted epoch budget (an edit of spec.training does not take effect)."""
    spec = api.running_doc(dict(job)).get("spec") or {}
    epochs = (spec.get("training") or {}).get("epochs")
    return epochs if isinstance(epochs, int) and epochs > 0 else 1


def _reserved_id(job: Mapping[str, Any]) -> str | None:
    """The zoo id the operator reserves for the job's model (None when it cannot be told)."""
    try:
        parsed = api.parse_running(dict(job))
        uid = str((job.get("metadata") or {}).get("uid") or "")
        return records.job_record_id(parsed.spec.model.label, uid)
    except ValueError:  # api.InvalidSpec, or no uid
        return None


def history_of(st: Mapping[str, Any]) -> list[S.Trial]:
    """status.history as trials in index order (an entry that is none is skipped: the CRD's
    schema admits nothing else, status is the operator's)."""
    found: list[S.Trial] = []
    for item in st.get("history") or []:
        try:
            found.append(S.Trial.model_validate(item))
        except pydantic.ValidationError:
            continue
    return sorted(found, key=lambda t: t.index)


def next_index(history: Sequence[S.Trial]) -> int:
    return max((t.index for t in history), default=-1) + 1


def stopped(trial: S.Trial, why: str) -> S.Trial:
    """A running trial stopped because the sweep ended (`why`), recorded as pruned."""
    last = trial.evaluations[-1] if trial.evaluations else None
    why = status.cap(why, S.TRIAL_MESSAGE_MAX_BYTES // 2)  # twice in every stopped trial
    pruned_at = S.PrunedAt(epoch=int(last[0]), value=float(last[1]),
                           against=f"the sweep ended: {why}") if last else None
    return trial.model_copy(update={"state": S.TrialState.PRUNED, "pruned_at": pruned_at,
                                    "message": f"stopped: the sweep ended: {why}"})


def conditions(st: Mapping[str, Any]) -> list[S.SweepCondition]:
    found = []
    for item in st.get("conditions") or []:
        try:
            found.append(S.SweepCondition.model_validate(item))
        except pydantic.ValidationError:
            continue
    return found


def set_condition(st: dict[str, Any], type_: S.SweepConditionType, value: bool, reason: str,
                  message: str, *, now: float) -> bool:
    """Upsert a sweep condition in the wire status `st`; whether it changed. Its
    lastTransitionTime moves only when its status flips."""
    text: Literal["True", "False"] = "True" if value else "False"
    old = next((c for c in conditions(st) if c.type == type_), None)
    since = old.last_transition_time if old is not None and old.status == text else None
    new = S.SweepCondition(type=type_, status=text, reason=reason,
                           message=status.cap(message, status.CONDITION_MESSAGE_MAX_BYTES),
                           last_transition_time=since or status.rfc3339(now))
    if old == new:
        return False
    listed = [c for c in st.get("conditions") or [] if isinstance(c, Mapping)]
    at = next((i for i, c in enumerate(listed) if c.get("type") == type_.value), len(listed))
    listed[at:at + 1] = [api.to_wire(new)]
    st["conditions"] = listed
    return True


def is_true(st: Mapping[str, Any], type_: S.SweepConditionType) -> bool:
    return any(c.type == type_ and c.status == "True" for c in conditions(st))


def metric_text(objective: S.Objective, value: float) -> str:
    return f"{objective.metric.value} {value:.4f}"


def params_text(params: Mapping[str, Any]) -> str:
    return ", ".join(f"{path}={json.dumps(value)}" for path, value in params.items()) or "none"

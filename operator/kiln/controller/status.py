"""TrainingJob status as data: conditions, phase, and the merge patch between two statuses.

Pure functions over the wire (camelCase) status, built and read as the `api` status types;
`now` is passed in. Never imports kopf.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
from collections.abc import Mapping
from typing import Any, Literal, TypeVar

import pydantic

from kiln import api

CONDITION_MESSAGE_MAX_BYTES = 32 * 1024  # Kueue's cap for condition messages
EVENT_MESSAGE_MAX_BYTES = 1024  # Kubernetes truncates event messages around here

TERMINAL = (api.ConditionType.SUCCEEDED, api.ConditionType.FAILED)

_Part = TypeVar("_Part", bound=pydantic.BaseModel)


@dataclasses.dataclass(frozen=True)
class Event:
    """A Kubernetes Event to post about a job; `reason` reuses the condition's reason.

    Attributes:
        type: "Normal" for progress, "Warning" when the user must act or should know.
        reason: the CamelCase reason (an `api.Reason`).
        message: one sentence with numbers and a next step.
    """

    type: str
    reason: api.Reason
    message: str

    @classmethod
    def normal(cls, reason: api.Reason, message: str) -> Event:
        return cls("Normal", reason, message)

    @classmethod
    def warning(cls, reason: api.Reason, message: str) -> Event:
        return cls("Warning", reason, message)


def rfc3339(epoch_seconds: float) -> str:
    """`epoch_seconds` as an RFC 3339 UTC timestamp with second precision."""
    moment = datetime.datetime.fromtimestamp(epoch_seconds, tz=datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_rfc3339(text: str | None) -> float | None:
    """Epoch seconds of an RFC 3339 timestamp; None for None or an unreadable value."""
    if not text:
        return None
    try:
        moment = datetime.datetime.fromisoformat(text)
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.UTC)
    return moment.timestamp()


def cap(message: str, max_bytes: int) -> str:
    """`message` cut to at most `max_bytes` UTF-8 bytes, marked with an ellipsis when cut."""
    data = message.encode("utf-8")
    if len(data) <= max_bytes:
        return message
    return data[: max_bytes - 3].decode("utf-8", errors="ignore") + "..."


def part(status: Mapping[str, Any], key: str, model: type[_Part]) -> _Part:
    """``status[key]`` (e.g. "placement") as its `api` type: all defaults when absent, or
    when malformed (the CRD's schema admits nothing else; an object edited outside it)."""
    try:
        return model.model_validate(status.get(key) or {})
    except pydantic.ValidationError:
        return model()


def conditions(status: Mapping[str, Any]) -> list[api.Condition]:
    """The conditions of a status (empty when absent). The CRD's schema admits nothing else;
    an entry that is no `api.Condition` (an object edited outside it) is skipped."""
    found: list[api.Condition] = []
    for item in status.get("conditions") or []:
        try:
            found.append(api.Condition.model_validate(item))
        except pydantic.ValidationError:
            continue
    return found


def condition(status: Mapping[str, Any], type_: api.ConditionType) -> api.Condition | None:
    """The condition of `type_`, or None."""
    return next((c for c in conditions(status) if c.type == type_), None)


def is_true(status: Mapping[str, Any], type_: api.ConditionType) -> bool:
    """Whether the condition of `type_` exists with status "True"."""
    found = condition(status, type_)
    return found is not None and found.status == "True"


def is_terminal(status: Mapping[str, Any]) -> bool:
    """Succeeded or Failed: nothing more will happen to the job but its TTL."""
    return any(is_true(status, t) for t in TERMINAL)


def set_condition(
    status: dict[str, Any],
    type_: api.ConditionType,
    value: bool | None,
    reason: api.Reason,
    message: str,
    *,
    now: float,
    generation: int | None,
) -> bool:
    """Upsert the condition of `type_` in `status` (in place).

    Args:
        status: the wire status being built (its "conditions" list is replaced).
        type_: the condition type.
        value: True, False, or None for "Unknown".
        reason: the CamelCase reason.
        message: one sentence; capped at CONDITION_MESSAGE_MAX_BYTES.
        now: epoch seconds; becomes `lastTransitionTime` when the status flips (or is new).
        generation: the job's metadata.generation, recorded as `observedGeneration`.

    Returns:
        Whether anything about the condition changed.
    """
    text: Literal["True", "False", "Unknown"] = (
        "Unknown" if value is None else "True" if value else "False")
    old = condition(status, type_)
    since = old.last_transition_time if old is not None and old.status == text else None
    new = api.Condition(
        type=type_, status=text, reason=reason.value,
        message=cap(message, CONDITION_MESSAGE_MAX_BYTES),
        last_transition_time=since or rfc3339(now), observed_generation=generation)
    if old == new:
        return False
    listed = [c for c in status.get("conditions") or [] if isinstance(c, Mapping)]
    at = next((i for i, c in enumerate(listed) if c.get("type") == type_.value), len(listed))
    listed[at:at + 1] = [api.to_wire(new)]  # in its place, or appended
    status["conditions"] = listed
    return True


def phase_of(status: Mapping[str, Any]) -> api.Phase:
    """The phase the conditions imply; nothing sets the phase directly.

    Failed, then Succeeded, then Suspended win; a running or restarting trainer is Running;
    a job waiting for its plan, or placed but not yet running, is Queued; else Pending.
    """
    if is_true(status, api.ConditionType.FAILED):
        return api.Phase.FAILED
    if is_true(status, api.ConditionType.SUCCEEDED):
        return api.Phase.SUCCEEDED
    if is_true(status, api.ConditionType.SUSPENDED):
        return api.Phase.SUSPENDED
    if is_true(status, api.ConditionType.RUNNING) or is_true(
            status, api.ConditionType.RESTARTING):
        return api.Phase.RUNNING
    if is_true(status, api.ConditionType.QUEUED) or is_true(status, api.ConditionType.PLACED):
        return api.Phase.QUEUED
    return api.Phase.PENDING


def with_phase(status: dict[str, Any]) -> dict[str, Any]:
    """`status` with "phase" set from its conditions (in place; returned for chaining)."""
    status["phase"] = phase_of(status).value
    return status


def merge_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON merge patch (RFC 7386) that turns `old` into `new`.

    Keys missing from `new` become null (removed), nested mappings are diffed recursively,
    anything else (lists included) is replaced whole. {} means no change.
    """
    patch: dict[str, Any] = {}
    for key in old:
        if key not in new:
            patch[key] = None
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            nested = merge_patch(before, value)
            if nested:
                patch[key] = nested
        elif key not in old or before != value:
            patch[key] = copy.deepcopy(value)
    return patch

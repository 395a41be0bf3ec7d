"""Conditions, phase and merge patches of kiln.controller.status (pure)."""

from __future__ import annotations

from typing import Any

import pytest

from kiln import api
from kiln.controller import status

C, R = api.ConditionType, api.Reason


def _condition(st: dict[str, Any], type_: api.ConditionType) -> api.Condition:
    found = status.condition(st, type_)
    assert found is not None
    return found


def test_set_condition_moves_the_transition_time_only_when_the_status_flips() -> None:
    st: dict[str, Any] = {}
    assert status.set_condition(st, C.RUNNING, True, R.TRAINER_STARTED, "a", now=100.0,
                                generation=1)
    first = status.condition(st, C.RUNNING)
    assert first is not None and first.last_transition_time == status.rfc3339(100.0)
    assert status.set_condition(st, C.RUNNING, True, R.TRAINER_STARTED, "b", now=200.0,
                                generation=1)
    assert _condition(st, C.RUNNING).last_transition_time == status.rfc3339(100.0)
    assert status.set_condition(st, C.RUNNING, False, R.TRAINING_COMPLETED, "c", now=300.0,
                                generation=1)
    assert _condition(st, C.RUNNING).last_transition_time == status.rfc3339(300.0)


def test_setting_the_same_condition_again_reports_no_change() -> None:
    st: dict[str, Any] = {}
    status.set_condition(st, C.QUEUED, True, R.WAITING_FOR_PLACEMENT, "m", now=1.0,
                         generation=2)
    assert not status.set_condition(st, C.QUEUED, True, R.WAITING_FOR_PLACEMENT, "m", now=9.0,
                                    generation=2)
    assert _condition(st, C.QUEUED).observed_generation == 2
    assert st["conditions"] == [{  # the wire form: camelCase, nulls left out
        "type": "Queued", "status": "True", "reason": "WaitingForPlacement", "message": "m",
        "lastTransitionTime": status.rfc3339(1.0), "observedGeneration": 2}]


def test_a_condition_outside_the_schema_is_not_read_and_kept_as_it_is() -> None:
    odd = {"type": "Ready", "status": "True"}  # another type than Kiln's: never read
    st: dict[str, Any] = {"conditions": [odd, {"type": "Running", "status": "Maybe"}]}
    assert status.condition(st, C.RUNNING) is None and not status.is_true(st, C.RUNNING)
    assert status.set_condition(st, C.RUNNING, True, R.TRAINER_STARTED, "a", now=1.0,
                                generation=None)
    assert st["conditions"] == [odd, {
        "type": "Running", "status": "True", "reason": "TrainerStarted", "message": "a",
        "lastTransitionTime": status.rfc3339(1.0)}]


def test_condition_messages_are_capped() -> None:
    st: dict[str, Any] = {}
    status.set_condition(st, C.FAILED, True, R.INVALID_SPEC, "x" * 100_000, now=0.0,
                         generation=None)
    message = _condition(st, C.FAILED).message
    assert len(message.encode()) <= status.CONDITION_MESSAGE_MAX_BYTES
    assert message.endswith("...")


@pytest.mark.parametrize(("conditions", "phase"), [
    pytest.param([], api.Phase.PENDING, id="nothing-yet"),
    pytest.param([(C.QUEUED, True)], api.Phase.QUEUED, id="queued"),
    pytest.param([(C.QUEUED, False), (C.PLACED, True)], api.Phase.QUEUED, id="placed"),
    pytest.param([(C.PLACED, True), (C.RUNNING, True)], api.Phase.RUNNING, id="running"),
    pytest.param([(C.RUNNING, False), (C.RESTARTING, True)], api.Phase.RUNNING,
                 id="restarting"),
    pytest.param([(C.RUNNING, True), (C.SUSPENDED, True)], api.Phase.SUSPENDED,
                 id="suspended"),
    pytest.param([(C.RUNNING, False), (C.SUCCEEDED, True)], api.Phase.SUCCEEDED,
                 id="succeeded"),
    pytest.param([(C.SUCCEEDED, True), (C.FAILED, True)], api.Phase.FAILED,
                 id="failed-wins"),
])
def test_phase_is_derived_from_conditions(conditions: list[tuple[api.ConditionType, bool]],
                                          phase: api.Phase) -> None:
    st: dict[str, Any] = {}
    for type_, value in conditions:
        status.set_condition(st, type_, value, R.PLANNED, "", now=0.0, generation=None)
    assert status.phase_of(st) == phase


def test_merge_patch_removes_replaces_and_recurses() -> None:
    old = {"a": 1, "b": {"x": 1, "y": 2}, "c": [1, 2], "gone": True}
    new = {"a": 1, "b": {"x": 1, "y": 3, "z": 4}, "c": [1]}
    assert status.merge_patch(old, new) == {"gone": None, "b": {"y": 3, "z": 4}, "c": [1]}
    assert status.merge_patch(new, new) == {}


def test_rfc3339_round_trips() -> None:
    assert status.parse_rfc3339(status.rfc3339(1_700_000_000.0)) == 1_700_000_000.0
    assert status.parse_rfc3339("not a time") is None

"""The trainer's warm-start verdict reaches status.warmStart while it runs, and the end of the
job repeats it without a second event."""

from __future__ import annotations

from typing import Any

from kiln import api
from kiln.controller import housekeeping, jobs, lifecycle
from kiln.warmstart import select

ADMITTED = api.WarmStartDecision(
    parent="bad-1", similarity=0.9, parent_metric=0.97, matched_tensors=6, total_tensors=6,
    reason="warm start from bad-1: similarity 0.90", candidates_considered=2,
    outcome=api.WarmStartOutcome.WARM, alternatives=("other-2",))
REFUSED = {"outcome": "cold_guard", "parent": None,
           "reason": "warm start from bad-1 (similarity 0.90) rejected: probe loss 9.100 vs "
                     "2.300 cold on 256 training samples; cold start",
           "probe_loss": 9.1, "cold_probe_loss": 2.3, "probe_accuracy": 0.1,
           "cold_probe_accuracy": 0.12}


def _edit(warm_start: dict[str, Any]) -> jobs.Edit:
    return jobs.Edit(body={}, status={"warmStart": warm_start},
                     jobs=None)  # type: ignore[arg-type]  # condition() does not write


def test_a_live_cold_guard_verdict_is_recorded_with_one_guarded_event() -> None:
    edit = _edit(api.to_wire(ADMITTED))
    live = housekeeping._with_admission(edit.status["warmStart"], REFUSED)
    lifecycle.record_trainer_decision(edit, live, now=10.0)
    warm = edit.status["warmStart"]
    assert warm == warm | {"outcome": "cold_guard", "probeLoss": 9.1, "coldProbeLoss": 2.3,
                           "probeAccuracy": 0.1, "coldProbeAccuracy": 0.12,
                           "similarity": 0.9, "alternatives": ["other-2"]}
    assert "parent" not in warm and "parentMetric" not in warm
    (condition,) = edit.status["conditions"]
    assert (condition["type"], condition["status"], condition["reason"]) == (
        "WarmStarted", "False", "ColdStart")
    assert "probe loss 9.100 vs 2.300" in condition["message"]
    (event,) = edit.events
    assert event.reason == api.Reason.WARM_START_GUARDED
    assert "refused parent bad-1" in event.message and "started cold" in event.message

    # The next reads, and the result at the end, repeat the verdict: no more events.
    edit.events.clear()
    again = housekeeping._with_admission(edit.status["warmStart"], REFUSED)
    lifecycle.record_trainer_decision(edit, again, now=20.0)
    lifecycle.record_trainer_decision(edit, {**REFUSED, "reason": REFUSED["reason"] + " (full)"},
                                      now=30.0)
    assert edit.events == []
    assert edit.status["warmStart"]["reason"].endswith("(full)")


def test_a_switch_to_an_alternative_parent_is_guarded_and_a_kept_parent_is_not() -> None:
    edit = _edit(api.to_wire(ADMITTED))
    switched = {**REFUSED, "outcome": "warm", "parent": "other-2",
                "reason": "warm start from other-2 after bad-1 was rejected", "probe_loss": 1.0}
    lifecycle.record_trainer_decision(
        edit, housekeeping._with_admission(edit.status["warmStart"], switched), now=1.0)
    warm = edit.status["warmStart"]
    assert (warm["parent"], warm["outcome"]) == ("other-2", "warm")
    assert "similarity" not in warm  # the admitted parent's, not this one's
    assert [e.reason for e in edit.events] == [api.Reason.WARM_START_GUARDED]

    kept = _edit(api.to_wire(ADMITTED))
    passed = {**REFUSED, "outcome": "warm", "parent": "bad-1", "reason": "kept bad-1",
              "probe_loss": 0.5}
    lifecycle.record_trainer_decision(
        kept, housekeeping._with_admission(kept.status["warmStart"], passed), now=1.0)
    assert kept.status["warmStart"] == kept.status["warmStart"] | {
        "parent": "bad-1", "parentMetric": 0.97, "similarity": 0.9, "probeLoss": 0.5}
    assert [e.reason for e in kept.events] == [api.Reason.PARENT_SELECTED]


def test_a_cold_start_without_a_probe_changes_nothing() -> None:
    cold = select.cold_start(api.WarmStartOutcome.COLD_EMPTY, "cold start: the model zoo is empty")
    edit = _edit(api.to_wire(cold))
    live = {"outcome": "cold_empty", "parent": None, "reason": cold.reason}
    lifecycle.record_trainer_decision(
        edit, housekeeping._with_admission(edit.status["warmStart"], live), now=1.0)
    assert edit.status == {"warmStart": api.to_wire(cold)} and edit.events == []

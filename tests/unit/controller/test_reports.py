"""What a pod reports is checked against what its job was granted (`kiln.controller.reports`):
its zoo model must be the job's reserved record, its parents ones its namespace may see, or
once admission decided, ones the job was granted."""

from __future__ import annotations

import asyncio
import types
from pathlib import Path
from typing import Any

import pytest
from zoofactory import add

from kiln import api
from kiln.controller import cache, jobs, lifecycle, parents, reports
from kiln.warmstart import select
from kiln.zoo import records, store

UID = "1f2e3d4c-0000-0000-0000-000000000000"
OWNER = {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob",
         "metadata": {"name": "digits", "namespace": "team-b", "uid": UID},
         "spec": {"model": {"architecture": "small_cnn", "inputShape": [1, 8, 8]}}}
RESERVED = "small_cnn-1f2e3d4c"


def test_a_jobs_record_id_carries_its_uid_so_a_new_job_of_the_same_name_gets_another() -> None:
    assert records.job_record_id("small_cnn", UID) == RESERVED
    assert records.job_record_id("mynets.mixer:mixer", "ABCDEF12-3") == "mixer-abcdef12"
    assert records.job_record_id("small_cnn", "0c1d2e3f-...") != RESERVED
    with pytest.raises(ValueError, match="metadata.uid"):
        records.job_record_id("small_cnn", "")


def test_only_the_jobs_reserved_record_holding_its_own_model_is_its_model(
        tmp_path: Path) -> None:
    zoo, job = store.DirStore(tmp_path), api.parse_job(OWNER)

    def problem(model: str) -> str | None:
        return asyncio.run(reports.model_problem(zoo, OWNER, job, model))

    theirs = add(zoo, "small_cnn-0000beef", floats=4, job_name="digits", namespace="team-a")
    assert problem(theirs.id) == f"the job's model can only be {RESERVED}"
    with pytest.raises(store.ObjectNotFound):
        problem(RESERVED)
    # Under the job's id, but written as another namespace's job of the same name.
    add(zoo, RESERVED, floats=4, job_name="digits", namespace="team-a")
    assert "not this job's but team-a/digits's" in str(problem(RESERVED))
    records.delete_record(zoo, RESERVED)
    add(zoo, RESERVED, floats=4, job_name="digits", namespace="team-b")
    assert problem(RESERVED) is None


def test_parents_a_pod_decided_must_be_visible_and_admitted_ones_granted(tmp_path: Path) -> None:
    zoo = store.DirStore(tmp_path)
    own = add(zoo, "small_cnn-00000001", floats=4, namespace="team-b")
    shared = add(zoo, "small_cnn-00000002", floats=4, namespace="team-a",
                 share=api.ZooShare.SHARED)
    private = add(zoo, "small_cnn-00000003", floats=4, namespace="team-a")

    def problem(ids: list[str], granted: list[str] | None = None) -> str | None:
        return asyncio.run(reports.parents_problem(zoo, "team-b", ids, granted=granted))

    assert problem([own.id, shared.id]) is None
    for unseen in (private.id, "small_cnn-00000004", "../not-an-id"):
        assert problem([own.id, unseen]) == \
            f"{unseen} is not a zoo model that namespace team-b may see"
    assert problem([own.id], granted=[own.id, shared.id]) is None
    assert problem([shared.id], granted=[own.id]) == \
        f"{shared.id} is not among the parents granted to the job ({own.id})"


def _edit(warm: api.WarmStartDecision) -> jobs.Edit:
    return jobs.Edit(body=OWNER, status={"warmStart": api.to_wire(warm)},
                     jobs=None)  # type: ignore[arg-type]  # condition() does not write


def _report(parent: str, *, outcome: str = "warm") -> dict[str, Any]:
    return {"outcome": outcome, "parent": parent, "reason": f"warm start from {parent}",
            "similarity": 0.9, "matched_tensors": 4, "total_tensors": 4, "probe_loss": 0.5,
            "cold_probe_loss": 2.0}


def test_a_trainers_decision_naming_a_parent_it_was_not_granted_is_refused_once(
        tmp_path: Path) -> None:
    zoo = store.DirStore(tmp_path)
    private = add(zoo, "small_cnn-00000003", floats=4, namespace="team-a")
    deps: Any = types.SimpleNamespace(parents=types.SimpleNamespace(zoo=zoo),
                                      caches=cache.Caches())
    left = select.cold_start(api.WarmStartOutcome.IN_TRAINER, parents.IN_TRAINER_REASON)
    edit = _edit(left)
    for now in (1.0, 2.0):  # a live report, then the result repeating it
        asyncio.run(lifecycle.take_trainer_decision(deps, edit, _report(private.id),
                                                    pod="digits-trainer-0", now=now))
    assert edit.status["warmStart"] == api.to_wire(left)
    assert "conditions" not in edit.status
    (event,) = edit.events
    assert (event.type, event.reason) == ("Warning", api.Reason.REPORT_REFUSED)
    assert private.id in event.message and "Pod digits-trainer-0 reported" in event.message

    own = add(zoo, "small_cnn-00000001", floats=4, namespace="team-b")
    asyncio.run(lifecycle.take_trainer_decision(deps, edit, _report(own.id),
                                                pod="digits-trainer-0", now=3.0))
    assert edit.status["warmStart"]["parent"] == own.id


def test_an_admitted_decision_keeps_its_parent_when_the_trainer_names_another(
        tmp_path: Path) -> None:
    zoo = store.DirStore(tmp_path)
    admitted = api.WarmStartDecision(
        parent="small_cnn-00000001", similarity=0.9, parent_metric=0.9, matched_tensors=4,
        total_tensors=4, reason="warm start", candidates_considered=2,
        outcome=api.WarmStartOutcome.WARM, alternatives=("small_cnn-00000002",))
    deps: Any = types.SimpleNamespace(parents=types.SimpleNamespace(zoo=zoo),
                                      caches=cache.Caches())
    edit = _edit(admitted)
    asyncio.run(lifecycle.take_trainer_decision(deps, edit, _report("small_cnn-00000009"),
                                                pod="digits-trainer-0", now=1.0))
    assert edit.status["warmStart"] == api.to_wire(admitted)
    assert [e.reason for e in edit.events] == [api.Reason.REPORT_REFUSED]
    assert "not among the parents granted" in edit.events[0].message
    edit.events.clear()
    asyncio.run(lifecycle.take_trainer_decision(deps, edit, _report("small_cnn-00000002"),
                                                pod="digits-trainer-0", now=2.0))
    assert edit.status["warmStart"]["parent"] == "small_cnn-00000002"  # the guard's switch
    assert [e.reason for e in edit.events] == [api.Reason.WARM_START_GUARDED]

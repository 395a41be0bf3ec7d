"""kiln.controller.parents: the warm-start decision survives its trip through status."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kiln import api
from kiln.controller import metrics, parents
from kiln.warmstart import select
from kiln.zoo import store

WARM = select.Decision(parent_id="small_cnn-1234abcd", similarity=0.75, parent_metric=0.9,
                       matched_tensors=4, total_tensors=5, reason="warm start from it; 4 of 5",
                       candidates_considered=3, outcome=select.Outcome.PINNED)


@pytest.mark.parametrize("decided", [
    pytest.param(WARM, id="warm"),
    pytest.param(select.cold_start(select.Outcome.COLD_FEW_TENSORS, "cold start: 0 of 5"),
                 id="cold"),
])
def test_a_decision_reads_back_from_status_as_the_trainer_needs_it(
    decided: select.Decision,
) -> None:
    wire = parents.to_status(decided)
    api.WarmStartStatus.model_validate(wire)  # every field is declared in the CRD
    back = parents.from_status(wire)
    for field in ("parent_id", "similarity", "parent_metric", "matched_tensors",
                  "total_tensors", "reason", "outcome"):
        assert getattr(back, field) == getattr(decided, field)


def test_a_status_without_outcome_reads_as_warm_or_cold_by_its_parent() -> None:
    assert parents.from_status({"parent": "p-1", "reason": "r"}).outcome == select.Outcome.WARM
    assert parents.from_status(None).cold_start


def test_the_operator_leaves_an_entrypoint_models_decision_to_the_trainer(
        tmp_path: Path) -> None:
    job = api.parse_job({"apiVersion": api.API_VERSION, "kind": api.KIND,
                         "metadata": {"name": "own"},
                         "spec": {"model": {"entrypoint": "not_importable_here:build",
                                            "inputShape": [1, 8, 8]}}})
    chooser = parents.ParentChooser(store.DirStore(tmp_path), metrics=metrics.OperatorMetrics(),
                                    refresh_seconds=60.0, query_timeout_seconds=5.0)
    decided = asyncio.run(chooser.decide(job))
    assert (decided.outcome, decided.parent_id) == (select.Outcome.IN_TRAINER, None)
    assert "made in the trainer pod, before its first step" in decided.reason


def test_the_trainers_own_decision_reads_back_for_status() -> None:
    report = {"parent": "mixer-1a2b3c4d", "similarity": 0.49, "parent_metric": 0.9,
              "matched_tensors": 30, "total_tensors": 54, "outcome": "warm",
              "reason": "warm start from mixer-1a2b3c4d"}
    decided = parents.from_trainer(report)
    assert decided is not None
    assert parents.to_status(decided) == {
        "parent": "mixer-1a2b3c4d", "similarity": 0.49, "parentMetric": 0.9,
        "matchedTensors": 30, "totalTensors": 54, "reason": "warm start from mixer-1a2b3c4d",
        "outcome": "warm"}
    assert parents.from_trainer({"outcome": "in_trainer"}) is None
    assert parents.from_trainer({}) is None

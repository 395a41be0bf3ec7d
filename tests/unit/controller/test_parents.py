"""kiln.controller.parents: the warm-start decision survives its trip through status."""

from __future__ import annotations

import pytest

from kiln import api
from kiln.controller import parents
from kiln.warmstart import select

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

"""kiln_trainer.warm: the trainer applies the warm-start decision it is given, never a new one."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln import api, models
from kiln.warmstart import decision, graph, select
from kiln.zoo import records, store
from kiln_trainer import warm

SMALL = {"blocks": [1, 1, 1], "width": 8}
DEEPER = {"blocks": [2, 2, 2], "width": 8}


def _job(args: dict[str, Any], **warm_start: Any) -> api.TrainingJob:
    return api.parse_job({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "child"},
        "spec": {"model": {"architecture": "small_resnet", "args": args, "inputShape": [1, 8, 8]},
                 "dataset": {"name": "digits"}, "warmStart": warm_start},
    })


def _register(zoo: store.ObjectStore, job: api.TrainingJob) -> records.ZooRecord:
    model = models.build(job.spec.model)
    record = records.ZooRecord(
        id=records.new_id("small_resnet"), architecture="small_resnet",
        args=dict(job.spec.model.args), input_shape=(1, 8, 8), modality="image",
        task="classification", dataset="digits", metric_name="validation_accuracy",
        metric_value=0.9, validation_accuracy=0.9, validation_loss=0.1,
        samples_per_second=100.0, num_params=sum(p.numel() for p in model.parameters()),
        created_time="2026-11-30T00:00:00Z", job_name="parent", job_spec=api.to_wire(job.spec),
        parent=None, similarity=None, weights_sha256="")
    return records.write_record(zoo, record, model.state_dict(),
                                graph.to_json(decision.model_graph(job.spec.model)))


@pytest.fixture
def zoo(tmp_path: Path) -> store.DirStore:
    return store.DirStore(tmp_path / "zoo")


def test_a_cold_decision_from_upstream_stays_cold_though_the_zoo_has_a_parent(
    zoo: store.DirStore,
) -> None:
    _register(zoo, _job(SMALL))
    job = _job(DEEPER)
    cold = select.cold_start(api.WarmStartOutcome.COLD_EMPTY, "cold start: the model zoo is empty")
    model = models.build(job.spec.model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    done = warm.warm_start(job, model, zoo, decided=cold)
    assert done.parent is None and done.reason == cold.reason
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_warm_decision_from_upstream_is_applied_with_its_numbers(zoo: store.DirStore) -> None:
    parent = _register(zoo, _job(SMALL))
    job = _job(DEEPER)
    decided = decision.decide(job, zoo)
    assert decided.parent == parent.id
    passed = warm.parse_decision(decided.model_dump_json())
    assert passed == decided
    done = warm.warm_start(job, models.build(job.spec.model), zoo, decided=passed)
    # no probe: applied as decided, and the reason says the candidate went unguarded
    assert (done.parent, done.similarity, done.reason) == (
        parent.id, decided.similarity,
        f"warm start from {parent.id} (no probe guard): {decided.reason}")
    assert decided.reason.startswith(f"candidate parent {parent.id}: similarity")
    assert done.matched_tensors == decided.matched_tensors
    assert 0.0 < warm.untransferred_fraction(done) < 1.0


def test_without_a_decision_the_trainer_decides_with_the_same_function(
    zoo: store.DirStore,
) -> None:
    parent = _register(zoo, _job(SMALL))
    job = _job(DEEPER)
    done = warm.warm_start(job, models.build(job.spec.model), zoo)
    assert done.parent == parent.id and done.reason == (
        f"warm start from {parent.id} (no probe guard): {decision.decide(job, zoo).reason}")


@pytest.mark.parametrize("text", [
    pytest.param("{not json", id="not-json"),
    pytest.param("[1, 2]", id="not-an-object"),
    pytest.param('{"parent": null}', id="no-outcome"),
    pytest.param('{"outcome": "lukewarm"}', id="unknown-outcome"),
    pytest.param('{"outcome": "warm", "parent": "p-1", "similarity": "0.9"}', id="text-number"),
])
def test_a_malformed_decision_is_an_invalid_setting_naming_the_flag(text: str) -> None:
    with pytest.raises(api.InvalidSpec, match="--warm-start") as caught:
        warm.parse_decision(text)
    if "lukewarm" in text:
        assert "outcome: Input should be 'warm', 'pinned'" in str(caught.value)
    if "0.9" in text:
        assert "similarity: Input should be a valid number (got '0.9')" in str(caught.value)


def test_a_decision_left_to_the_trainer_reads_as_none_so_the_trainer_decides() -> None:
    deferred = select.cold_start(api.WarmStartOutcome.IN_TRAINER, "decided in the trainer pod")
    assert warm.parse_decision(deferred.model_dump_json()) is None
    cold = select.cold_start(api.WarmStartOutcome.COLD_EMPTY, "the zoo is empty")
    assert warm.parse_decision(cold.model_dump_json()) == cold


def _unreachable_zoo(waits: list[float]) -> store.S3Store:
    """An S3 zoo on a closed local port; `waits` records every retry (any contact)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return store.S3Store(f"127.0.0.1:{port}", "zoo", access_key=None, secret_key=None,
                         retry=store.RetryPolicy(attempts=2), sleep=waits.append)


@pytest.mark.parametrize(("job", "decided"), [
    pytest.param(_job(SMALL, enabled=False), None, id="disabled"),
    pytest.param(_job(SMALL),
                 select.cold_start(api.WarmStartOutcome.COLD_EMPTY, "the zoo is empty"),
                 id="cold-decision-from-upstream"),
])
def test_a_cold_start_never_contacts_the_zoo(
    job: api.TrainingJob, decided: api.WarmStartDecision | None
) -> None:
    waits: list[float] = []
    assert not warm.needs_zoo(job, decided)
    applied = warm.warm_start(job, models.build(job.spec.model), _unreachable_zoo(waits),
                              decided=decided)
    assert applied.parent is None and waits == []


def test_a_job_that_decides_in_the_trainer_or_names_a_parent_needs_the_zoo(
    zoo: store.DirStore,
) -> None:
    parent = _register(zoo, _job(SMALL))
    assert warm.needs_zoo(_job(SMALL), None)
    assert warm.needs_zoo(_job(DEEPER), decision.decide(_job(DEEPER, parent=parent.id), zoo))

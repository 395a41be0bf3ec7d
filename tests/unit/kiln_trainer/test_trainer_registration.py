"""Provisional registration (`kiln_trainer.registration`): when it is due, and that the final
record takes the provisional one's id only when that record is this job's provisional one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from zoofactory import add

from kiln import api, contract
from kiln.zoo import records, store
from kiln_trainer import registration, tracking

COLD = api.WarmStartDecision(outcome=api.WarmStartOutcome.COLD_EMPTY,
                             reason="cold start: empty zoo")


def _job(name: str = "sweep-a", *, every: int | None = 1, epochs: int = 5) -> api.TrainingJob:
    return api.TrainingJob.model_validate({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name},
        "spec": {"model": {"architecture": "small_cnn", "args": {"depth": 2, "width": 8},
                           "inputShape": [1, 8, 8]},
                 "dataset": {"name": "digits"}, "training": {"epochs": epochs},
                 "zoo": {"provisionalEveryEvaluations": every}}})


def _state(*accuracies: float) -> tracking.RunState:
    state = tracking.RunState(epochs_done=len(accuracies), step=10 * len(accuracies))
    state.history = [{"step": 10 * (i + 1), "validation_accuracy": a, "validation_loss": 1 - a}
                     for i, a in enumerate(accuracies)]
    return state


@pytest.mark.parametrize("every,accuracies,due", [
    pytest.param(1, (0.5, 0.7), True, id="best-so-far"),
    pytest.param(1, (0.7, 0.5), False, id="worse-than-before"),
    pytest.param(2, (0.5, 0.6, 0.7), False, id="not-the-nth-evaluation"),
    pytest.param(None, (0.5,), False, id="unset"),
])
def test_provisional_due_on_every_nth_evaluation_that_is_the_best(
        every: int | None, accuracies: tuple[float, ...], due: bool) -> None:
    assert registration.provisional_due(_job(every=every).spec, _state(*accuracies)) is due


def test_no_provisional_record_once_training_is_over() -> None:
    assert not registration.provisional_due(_job(epochs=2).spec, _state(0.5, 0.7))


def _register(zoo: store.ObjectStore, job: api.TrainingJob, record_id: str | None,
              **kwargs: Any) -> str | None:
    from kiln import models

    model = models.build(job.spec.model)
    state = _state(0.8)
    return registration.register_model(zoo, job, model, state, state.history[-1], COLD,
                                       record_id=record_id, **kwargs)


def test_final_record_replaces_the_jobs_provisional_record_under_its_id(tmp_path: Path) -> None:
    zoo, job = store.DirStore(tmp_path), _job()
    provisional = _register(zoo, job, None, provisional=True)
    assert provisional is not None and records.read_record(zoo, provisional).provisional
    assert _register(zoo, job, provisional) == provisional
    assert not records.verify_record(zoo, provisional).provisional


def test_never_replaces_another_jobs_record(tmp_path: Path) -> None:
    zoo = store.DirStore(tmp_path)
    other = add(zoo, "small_cnn-0000beef", floats=10, provisional=True, job_name="someone-else")
    written = _register(zoo, _job(), other.id)
    assert written is not None and written != other.id
    assert records.read_record(zoo, other.id) == other


def test_a_pods_model_takes_the_id_the_operator_reserved_and_replaces_its_own_record_there(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    zoo, job = store.DirStore(tmp_path), _job()
    reserved = records.job_record_id("small_cnn", "1f2e3d4c-0000-0000-0000-000000000000")
    monkeypatch.setenv(contract.Env.ZOO_RECORD, reserved)
    assert _register(zoo, job, None) == reserved
    # An attempt stopped after registering, before it could say so: the next one replaces it.
    assert _register(zoo, job, None) == reserved
    assert not records.verify_record(zoo, reserved).provisional


def test_another_jobs_record_under_the_reserved_id_is_never_replaced(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    zoo = store.DirStore(tmp_path)
    other = add(zoo, "small_cnn-1f2e3d4c", floats=10, job_name="someone-else")
    monkeypatch.setenv(contract.Env.ZOO_RECORD, other.id)
    with pytest.raises(ValueError, match="already exists"):
        _register(zoo, _job(), None)
    assert records.read_record(zoo, other.id) == other

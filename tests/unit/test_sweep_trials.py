"""A sweep's trial as a TrainingJob: valid, labelled, owned, cold when independent, preferring
the sweep's own models when chained."""

from __future__ import annotations

import json
from typing import Any

from kiln import api
from kiln.sweep import trial_job


def _sweep(metadata: dict[str, Any] | None = None, **fields: Any) -> api.sweep.TrainingSweep:
    template = fields.pop("template", {
        "model": {"architecture": "small_cnn", "args": {"depth": 2, "width": 16},
                  "inputShape": [1, 16, 16]},
        "dataset": {"name": "digits"},
        "training": {"epochs": 6, "batchSize": 64},
    })
    return api.sweep.parse_sweep({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSweep",
        "metadata": metadata or {"name": "fm", "namespace": "team-a", "uid": "sweep-uid-1"},
        "spec": {"template": template, "parameters": [
            {"path": "training.optimizer.lr", "float": {"min": 0.001, "max": 0.3, "log": True}},
            {"path": "model.args.depth", "int": {"min": 1, "max": 4}},
        ], **fields},
    })


PARAMS = {"training.optimizer.lr": 0.01, "model.args.depth": 3}


def test_a_chained_trial_is_a_valid_owned_labelled_job_with_its_values() -> None:
    doc = trial_job(_sweep(), 4, PARAMS, preferred=["small_cnn-aa11", "small_cnn-bb22"])
    job = api.parse_job(doc)
    assert job.metadata.name == "fm-t4" and job.metadata.namespace == "team-a"
    assert job.metadata.labels == {"kiln.dev/sweep": "fm", "kiln.dev/trial": "4"}
    assert json.loads(job.metadata.annotations["kiln.dev/trial-params"]) == PARAMS
    assert job.metadata.owner_references == [{
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSweep", "name": "fm",
        "uid": "sweep-uid-1", "controller": True, "blockOwnerDeletion": True}]
    assert job.spec.training.optimizer.lr == 0.01
    assert job.spec.model.args == {"depth": 3, "width": 16}
    assert job.spec.warm_start.enabled
    assert job.spec.warm_start.preferred == ["small_cnn-aa11", "small_cnn-bb22"]
    assert job.spec.zoo.provisional_every_evaluations == 1
    assert job.spec.target is None  # the objective has no target


def test_an_independent_trial_starts_cold_and_prefers_nothing() -> None:
    doc = trial_job(_sweep(warmStart="independent"), 0, PARAMS, preferred=["small_cnn-aa11"])
    job = api.parse_job(doc)
    assert not job.spec.warm_start.enabled
    assert job.spec.warm_start.preferred == []
    assert job.spec.zoo.provisional_every_evaluations is None


def test_the_templates_own_choices_are_kept() -> None:
    template = {
        "model": {"architecture": "small_cnn", "inputShape": [1, 16, 16]},
        "dataset": {"name": "digits"},
        "target": {"metric": "validation_accuracy", "value": 0.9, "stopAtTarget": False},
        "zoo": {"provisionalEveryEvaluations": 3},
    }
    doc = trial_job(_sweep(template=template, objective={"target": 0.95}), 1, PARAMS)
    job = api.parse_job(doc)
    assert job.spec.zoo.provisional_every_evaluations == 3
    assert job.spec.target is not None and job.spec.target.value == 0.9
    assert job.spec.model.args == {"depth": 3}  # created where the template had no args


def test_the_objectives_target_stops_a_trial_at_it() -> None:
    doc = trial_job(_sweep(objective={"metric": "validation_loss", "target": 0.2}), 0, PARAMS)
    target = api.parse_job(doc).spec.target
    assert target is not None
    assert (target.metric, target.value, target.stop_at_target) == (
        api.TargetMetric.VALIDATION_LOSS, 0.2, True)


def test_a_sweep_without_uid_or_namespace_makes_an_unowned_job() -> None:
    doc = trial_job(_sweep(metadata={"name": "local"}), 0, PARAMS)
    assert "ownerReferences" not in doc["metadata"] and "namespace" not in doc["metadata"]
    assert api.parse_job(doc).metadata.name == "local-t0"


def test_preferred_ids_are_deduplicated_and_capped() -> None:
    ids = [f"m-{i % 40}" for i in range(80)]
    doc = trial_job(_sweep(), 0, PARAMS, preferred=ids)
    preferred = api.parse_job(doc).spec.warm_start.preferred
    assert preferred == [f"m-{i}" for i in range(api.MAX_PREFERRED_PARENTS)]

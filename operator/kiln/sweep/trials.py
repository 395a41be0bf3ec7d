"""A trial as a TrainingJob: the template with the trial's values, labelled and owned by its
sweep, cold in independent mode, preferring the sweep's own models in chain mode."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from kiln import api


def trial_job(sweep: api.sweep.TrainingSweep, index: int, params: dict[str, Any], *,
              preferred: Sequence[str] = ()) -> dict[str, Any]:
    """The TrainingJob document of trial `index` (a dict, as `kubectl apply` sends it).

    Args:
        sweep: the sweep (its uid, when set, becomes the trial's controller ownerReference).
        index: the trial's index; the job is named `api.sweep.trial_name(sweep, index)`.
        params: path -> value, applied to the template.
        preferred: zoo model ids of the sweep's own trials, best first; in chain mode the trial
            warm-starts from them before other zoo models of equal similarity.

    A template without a target gets the objective's target (stopping at it), so the trial that
    reaches it ends, and with it the sweep, without training its remaining epochs.
    """
    spec = api.sweep.apply(api.to_wire(sweep.spec.template), params)
    template = sweep.spec.template
    objective = sweep.spec.objective
    if objective.target is not None and template.target is None:
        spec["target"] = {"metric": objective.metric.value, "value": objective.target,
                          "stopAtTarget": True}
    warm = spec.setdefault("warmStart", {})
    if sweep.spec.warm_start is api.sweep.SweepWarmStart.INDEPENDENT:
        warm["enabled"] = False
        warm.pop("preferred", None)
    else:
        zoo = spec.setdefault("zoo", {})
        if zoo.get("provisionalEveryEvaluations") is None:
            # Each trial registers its best so far at every evaluation: later trials (and
            # pruned ones' successors) can warm-start from it before it ends.
            zoo["provisionalEveryEvaluations"] = 1
        warm["preferred"] = list(dict.fromkeys(preferred))[:api.MAX_PREFERRED_PARENTS]
    metadata: dict[str, Any] = {
        "name": api.sweep.trial_name(sweep.name, index),
        "labels": {api.sweep.SWEEP_LABEL: sweep.name, api.sweep.TRIAL_LABEL: str(index)},
        "annotations": {api.sweep.PARAMS_ANNOTATION: json.dumps(params)},
    }
    if sweep.metadata.namespace:
        metadata["namespace"] = sweep.metadata.namespace
    if sweep.metadata.uid:
        # blockOwnerDeletion, as for every object the operator owns (`kopf.adopt`): a
        # foreground deletion of the sweep waits for its trials. Where
        # OwnerReferencesPermissionEnforcement is on, setting it needs update on
        # trainingsweeps/finalizers (`kiln.controller.rbac.OWNER_REFERENCE_RULES`).
        metadata["ownerReferences"] = [{
            "apiVersion": api.API_VERSION, "kind": api.sweep.SWEEP_KIND, "name": sweep.name,
            "uid": sweep.metadata.uid, "controller": True, "blockOwnerDeletion": True,
        }]
    return {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": metadata, "spec": spec}


def ranked(objective: api.sweep.Objective,
           history: Sequence[api.sweep.Trial]) -> list[api.sweep.Trial]:
    """Trials best first by their metric (else their last evaluation); those with neither
    last; ties by index."""
    sign = -1.0 if objective.maximize else 1.0

    def key(t: api.sweep.Trial) -> tuple[bool, float, int]:
        value = t.metric if t.metric is not None else (
            t.evaluations[-1][1] if t.evaluations else None)
        return (value is None, sign * (value or 0.0), t.index)

    return sorted(history, key=key)


def own_models(objective: api.sweep.Objective, history: Sequence[api.sweep.Trial], *,
               provisional: Mapping[int, str] | None = None) -> list[str]:
    """The sweep's own zoo models, best trial first (`trial_job`'s `preferred`): each
    non-failed trial's registered model, or a running trial's provisional record where the
    driver knows it is in the zoo (`provisional`: trial index -> record id)."""
    out: list[str] = []
    for t in ranked(objective, history):
        if t.state is api.sweep.TrialState.FAILED:
            continue
        model = t.zoo_model or (provisional or {}).get(t.index)
        if model and model not in out:
            out.append(model)
    return out

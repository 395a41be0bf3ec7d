"""kiln.controller.trials: which jobs are a sweep's trials, and what a trial job's status says."""

from __future__ import annotations

from typing import Any

from kiln import api, sweep
from kiln.controller import trials

S = api.sweep
UID = "5f0c9a52-0000-4000-8000-000000000001"


def _job(index: int, *, owner: str | None = UID, name: str | None = None,
         status: dict[str, Any] | None = None, epochs: int = 5) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name or S.trial_name("sw", index), "namespace": "team-a",
        "uid": f"{index:08d}-0000-4000-8000-000000000000",
        "labels": {S.SWEEP_LABEL: "sw", S.TRIAL_LABEL: str(index)},
        "annotations": {S.PARAMS_ANNOTATION: '{"training.optimizer.lr": 0.02}'}}
    if owner is not None:
        meta["ownerReferences"] = [{"apiVersion": api.API_VERSION, "kind": S.SWEEP_KIND,
                                    "name": "sw", "uid": owner, "controller": True}]
    spec = {"model": {"architecture": "small_cnn", "args": {"depth": 2, "width": 8},
                      "inputShape": [1, 8, 8]},
            "dataset": {"name": "digits"}, "training": {"epochs": epochs, "batchSize": 32}}
    return {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": meta, "spec": spec,
            "status": status or {}}


def _condition(type_: str) -> dict[str, Any]:
    return {"type": type_, "status": "True", "reason": "R", "message": f"{type_} here"}


def test_only_jobs_the_sweep_controls_under_their_trial_name_are_its_trials() -> None:
    jobs = [_job(0), _job(1, owner="someone-else"), _job(2, owner=None),
            _job(3, name="sw-t9"), _job(4)]
    assert sorted(trials.owned(UID, "sw", jobs)) == [0, 4]
    assert trials.params_of(jobs[0]) == {"training.optimizer.lr": 0.02}


def test_a_running_trials_evaluation_is_dated_by_its_status_and_the_last_epoch_waits() -> None:
    objective = S.Objective()
    running = _job(0, status={"progress": {"epoch": 3, "validationAccuracy": 0.61}})
    assert trials.read(running, objective).evaluation == (2, 0.61)
    first = _job(0, status={"progress": {"epoch": 1, "validationAccuracy": 0.1}})
    assert trials.read(first, objective).evaluation is None  # no epoch evaluated yet
    last = _job(0, status={"progress": {"epoch": 5, "validationAccuracy": 0.7}})
    assert trials.read(last, objective).evaluation is None  # epoch 4's or 5's: untold


def test_an_ended_trial_takes_its_metric_and_model_from_status_result() -> None:
    done = _job(0, status={"conditions": [_condition("Succeeded")],
                           "progress": {"epoch": 5, "validationLoss": 0.4},
                           "result": {"validationLoss": 0.35, "zooModel": "small_cnn-00000000"},
                           "warmStart": {"outcome": "warm", "parent": "small_cnn-abcdef12",
                                         "similarity": 0.6, "reason": "r"}})
    reading = trials.read(done, S.Objective(metric=api.TargetMetric.VALIDATION_LOSS))
    assert (reading.state, reading.metric, reading.evaluation) == (
        S.TrialState.SUCCEEDED, 0.35, (5, 0.35))
    assert (reading.zoo_model, reading.parent, reading.similarity) == (
        "small_cnn-00000000", "small_cnn-abcdef12", 0.6)
    failed = trials.read(_job(1, status={"conditions": [_condition("Failed")],
                                         "warmStart": {"outcome": "cold_guard", "reason": "r",
                                                       "similarity": 0.9}}), S.Objective())
    assert (failed.state, failed.message) == (S.TrialState.FAILED, "Failed here")
    assert (failed.parent, failed.similarity) == (None, None)  # cold: its best match's is moot


def test_what_a_pod_reports_that_the_metric_cannot_take_is_no_evaluation() -> None:
    # A trial's pod is user code: an accuracy in percent, a negative loss or an epoch past the
    # budget would end the sweep at its target, lead its search or misdate an evaluation.
    objective = S.Objective(target=0.9)
    running = _job(0, status={"progress": {"epoch": 3, "validationAccuracy": 95.0}})
    assert trials.read(running, objective).evaluation is None
    done = _job(0, status={"conditions": [_condition("Succeeded")],
                           "progress": {"epoch": 10**9, "validationAccuracy": 0.8},
                           "result": {"validationAccuracy": 95.0}})
    reading = trials.read(done, objective)
    assert (reading.metric, reading.evaluation) == (0.8, (5, 0.8))
    loss = S.Objective(metric=api.TargetMetric.VALIDATION_LOSS)
    negative = _job(0, status={"conditions": [_condition("Succeeded")],
                               "progress": {"epoch": 5, "validationLoss": -1.0},
                               "result": {"validationLoss": -1.0}})
    assert (trials.read(negative, loss).metric, trials.read(negative, loss).evaluation) == (
        None, None)


def test_a_running_trials_model_is_its_reserved_record_only_once_the_zoo_holds_it() -> None:
    job = _job(0, status={"progress": {"epoch": 2, "validationAccuracy": 0.5}})
    reserved = "small_cnn-00000000"
    assert trials.read(job, S.Objective()).zoo_model is None
    assert trials.read(job, S.Objective(), zoo_ids={reserved}).zoo_model == reserved


def test_own_models_are_the_trials_best_first_and_a_stopped_trial_says_why() -> None:
    history = [S.Trial(index=i, name=f"sw-t{i}", state=state, metric=metric, zoo_model=model,
                       evaluations=[[1.0, metric]] if metric is not None else [])
               for i, (state, metric, model) in enumerate([
                   (S.TrialState.SUCCEEDED, 0.7, "m-a"), (S.TrialState.PRUNED, 0.9, "m-b"),
                   (S.TrialState.FAILED, 0.95, "m-c"), (S.TrialState.RUNNING, None, "m-d")])]
    # One rule for both drivers (kiln.sweep): never a failed trial's model; unranked ones last.
    assert sweep.own_models(S.Objective(), history) == ["m-b", "m-a", "m-d"]
    loss = S.Objective(metric=api.TargetMetric.VALIDATION_LOSS)
    assert sweep.own_models(loss, history) == ["m-a", "m-b", "m-d"]
    assert sweep.own_models(loss, history[:2] + [history[3].model_copy(
        update={"zoo_model": None})], provisional={3: "m-p"}) == ["m-a", "m-b", "m-p"]
    stopped = trials.stopped(history[0].model_copy(update={"state": S.TrialState.RUNNING}),
                             "trial sw-t1 reached the target")
    assert stopped.state is S.TrialState.PRUNED and stopped.pruned_at is not None
    assert stopped.pruned_at.against == "the sweep ended: trial sw-t1 reached the target"


def test_sweep_conditions_keep_their_transition_time_until_they_flip() -> None:
    st: dict[str, Any] = {}
    C = S.SweepConditionType
    assert trials.set_condition(st, C.RUNNING, True, "TrialsRunning", "1 running", now=0.0)
    assert not trials.set_condition(st, C.RUNNING, True, "TrialsRunning", "1 running", now=9.0)
    assert trials.set_condition(st, C.RUNNING, True, "TrialsRunning", "2 running", now=9.0)
    assert st["conditions"][0]["lastTransitionTime"] == "1970-01-01T00:00:00Z"
    assert trials.set_condition(st, C.RUNNING, False, "MaxTrialsReached", "done", now=9.0)
    assert st["conditions"][0]["lastTransitionTime"] == "1970-01-01T00:00:09Z"
    assert trials.is_true(st, C.RUNNING) is False

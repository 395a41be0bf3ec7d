"""Where a sweep stands: counts, best trial, phase and reason, and how many trials may start."""

from __future__ import annotations

from typing import Any

from kiln import api
from kiln.sweep import standing

S = api.sweep.TrialState
Phase = api.sweep.SweepPhase


def _spec(**fields: Any) -> api.sweep.TrainingSweepSpec:
    return api.sweep.parse_sweep({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSweep", "metadata": {"name": "s"},
        "spec": {
            "template": {"model": {"architecture": "small_cnn", "inputShape": [1, 16, 16]},
                         "dataset": {"name": "digits"}, "training": {"epochs": 6}},
            "parameters": [{"path": "model.args.depth", "int": {"min": 1, "max": 4}}],
            **fields,
        },
    }).spec


def _trial(index: int, state: api.sweep.TrialState, metric: float | None = None,
           evaluations: list[list[float]] | None = None, message: str = "") -> api.sweep.Trial:
    return api.sweep.Trial(index=index, name=f"s-t{index}", params={"model.args.depth": index},
                           state=state, metric=metric, evaluations=evaluations or [],
                           zoo_model=f"m-{index}", message=message)


def test_a_new_sweep_is_pending_and_may_start_its_parallel_trials() -> None:
    now = standing(_spec(parallelTrials=3, maxTrials=8), [])
    assert (now.phase, now.reason, now.to_start, now.best) == (Phase.PENDING, "TrialsPending",
                                                               3, None)
    assert standing(_spec(parallelTrials=3, maxTrials=2), []).to_start == 2


def test_a_running_sweep_fills_its_free_slots_within_the_budget() -> None:
    spec = _spec(parallelTrials=3, maxTrials=5)
    history = [_trial(0, S.SUCCEEDED, 0.8), _trial(1, S.RUNNING), _trial(2, S.PRUNED),
               _trial(3, S.FAILED, message="OOMKilled")]
    now = standing(spec, history)
    assert now.phase is Phase.RUNNING and now.reason == "TrialsRunning"
    assert now.counts == api.sweep.TrialCounts(total=4, running=1, succeeded=1, pruned=1,
                                               failed=1)
    assert now.to_start == 1  # two slots free, one trial left in the budget
    assert now.message == ("3 of 5 trials ended, 1 running: 1 succeeded, 1 pruned, 1 failed; "
                           "best validation_accuracy 0.8 (s-t0).")
    assert standing(_spec(parallelTrials=3, maxTrials=16), history).to_start == 2


def test_the_budget_used_up_ends_the_sweep_once_nothing_runs() -> None:
    spec = _spec(maxTrials=3)
    running = [_trial(0, S.SUCCEEDED, 0.7), _trial(1, S.PRUNED), _trial(2, S.RUNNING)]
    now = standing(spec, running)
    assert (now.phase, now.to_start) == (Phase.RUNNING, 0)
    done = standing(spec, [*running[:2], _trial(2, S.SUCCEEDED, 0.9)])
    assert (done.phase, done.reason, done.to_start) == (Phase.SUCCEEDED, "MaxTrialsReached", 0)
    assert done.best is not None and done.best.trial == "s-t2" and done.best.zoo_model == "m-2"
    assert done.message == ("All 3 trials ended: 2 succeeded, 1 pruned, 0 failed; best "
                            "validation_accuracy 0.9 (s-t2).")


def test_a_trial_reaching_the_target_ends_the_sweep() -> None:
    spec = _spec(maxTrials=10, objective={"target": 0.9})
    history = [_trial(0, S.SUCCEEDED, 0.85), _trial(1, S.SUCCEEDED, 0.93), _trial(2, S.RUNNING)]
    now = standing(spec, history)
    assert (now.phase, now.reason, now.to_start) == (Phase.SUCCEEDED, "TargetReached", 0)
    assert now.message.startswith("Trial s-t1 reached validation_accuracy 0.93 (target 0.9) "
                                  "after 3 of 10 trials")
    loss = _spec(objective={"metric": "validation_loss", "target": 0.2})
    assert standing(loss, [_trial(0, S.SUCCEEDED, 0.25)]).phase is Phase.RUNNING
    assert standing(loss, [_trial(0, S.SUCCEEDED, 0.19)]).reason == "TargetReached"


def test_no_new_trial_while_a_running_one_has_reached_the_target() -> None:
    spec = _spec(maxTrials=10, parallelTrials=4, objective={"target": 0.9})
    history = [_trial(0, S.RUNNING, evaluations=[[1, 0.5], [2, 0.91]]), _trial(1, S.RUNNING)]
    now = standing(spec, history)
    assert (now.phase, now.to_start) == (Phase.RUNNING, 0)
    assert standing(spec, [_trial(0, S.RUNNING, evaluations=[[1, 0.5]])]).to_start == 3


def test_more_failures_than_allowed_fail_the_sweep() -> None:
    spec = _spec(maxTrials=10, maxFailedTrials=1)
    one = [_trial(0, S.FAILED, message="image pull failed"), _trial(1, S.RUNNING)]
    assert standing(spec, one).phase is Phase.RUNNING
    now = standing(spec, [*one, _trial(2, S.FAILED, message="exit code 1")])
    assert (now.phase, now.reason, now.to_start) == (Phase.FAILED, "TooManyFailedTrials", 0)
    assert now.message.startswith("2 trials failed, more than maxFailedTrials 1 (last: s-t2: "
                                  "exit code 1)")


def test_an_exhausted_search_ends_once_its_trials_do() -> None:
    spec = _spec(maxTrials=10)
    running = [_trial(0, S.SUCCEEDED, 0.5), _trial(1, S.RUNNING)]
    now = standing(spec, running, exhausted=True)
    assert (now.phase, now.to_start) == (Phase.RUNNING, 0)
    done = standing(spec, [running[0], _trial(1, S.PRUNED)], exhausted=True)
    assert (done.phase, done.reason) == (Phase.SUCCEEDED, "SearchExhausted")
    assert done.ended and not now.ended


def test_the_best_is_the_best_succeeded_trial_else_the_best_evaluation() -> None:
    history = [_trial(0, S.PRUNED, evaluations=[[1, 0.97]]), _trial(1, S.SUCCEEDED, 0.8),
               _trial(2, S.SUCCEEDED, 0.9), _trial(3, S.SUCCEEDED, 0.9)]
    best = standing(_spec(), history).best
    assert best is not None and (best.index, best.metric) == (2, 0.9)  # ties: the earlier
    assert best.params == {"model.args.depth": 2}
    loss = standing(_spec(objective={"metric": "validation_loss"}), history).best
    assert loss is not None and loss.index == 1
    early = [_trial(0, S.RUNNING, evaluations=[[1, 0.4], [2, 0.6]]),
             _trial(1, S.PRUNED, evaluations=[[1, 0.5], [2, float("nan")]]),
             _trial(2, S.FAILED)]
    best = standing(_spec(), early).best
    assert best is not None and (best.index, best.metric) == (0, 0.6)
    assert standing(_spec(), [_trial(0, S.RUNNING)]).best is None


def test_a_failed_trial_is_never_the_best() -> None:
    spec = _spec(maxTrials=3)
    # Its evaluations were the best, but it failed: the running trial's stand in.
    failed = _trial(0, S.FAILED, evaluations=[[1, 0.9], [2, 0.95]], message="registration")
    running = standing(spec, [failed, _trial(1, S.RUNNING, evaluations=[[1, 0.3]])])
    assert running.best is not None and (running.best.trial, running.best.metric) == ("s-t1",
                                                                                      0.3)
    # Every trial ended Failed (within maxFailedTrials): the sweep failed, with no best.
    over = standing(spec, [failed, _trial(1, S.FAILED, evaluations=[[1, 0.3]]),
                           _trial(2, S.FAILED, evaluations=[[1, 0.15]])])
    assert (over.phase, over.reason, over.best) == (Phase.FAILED, "NoTrialSucceeded", None)
    assert over.message == ("All 3 trials ended and none succeeded: 0 succeeded, 0 pruned, "
                            "3 failed.")
    too_many = standing(_spec(maxTrials=3, maxFailedTrials=1),
                        [failed, _trial(1, S.FAILED, evaluations=[[1, 0.3]])])
    assert (too_many.reason, too_many.best) == ("TooManyFailedTrials", None)
    # A pruned trial's evaluation still stands in once the sweep has ended.
    pruned = standing(spec, [failed, _trial(1, S.PRUNED, evaluations=[[1, 0.3]]),
                             _trial(2, S.FAILED, metric=0.99)])
    assert pruned.best is not None and pruned.best.trial == "s-t1"
    assert pruned.message.endswith("best validation_accuracy 0.3 (s-t1).")

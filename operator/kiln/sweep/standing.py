"""Where a sweep stands, from its spec and trials: counts, the best trial, whether it has
ended and why, and how many trials may start now."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from kiln import api


@dataclasses.dataclass(frozen=True)
class Standing:
    counts: api.sweep.TrialCounts
    best: api.sweep.BestTrial | None
    phase: api.sweep.SweepPhase
    reason: str  # CamelCase, for the condition and events: TrialsPending, TrialsRunning,
    #              MaxTrialsReached, TargetReached, SearchExhausted, TooManyFailedTrials,
    #              NoTrialSucceeded, ObjectiveNotReported
    message: str  # one sentence with numbers
    to_start: int  # new trials that may start now (0 once ended)

    @property
    def ended(self) -> bool:
        return self.phase in (api.sweep.SweepPhase.SUCCEEDED, api.sweep.SweepPhase.FAILED)


def standing(spec: api.sweep.TrainingSweepSpec, history: Sequence[api.sweep.Trial],
             *, exhausted: bool = False) -> Standing:
    """The sweep's standing; `exhausted`: the search has no values left (grid done).

    The best trial is the Succeeded one with the best final metric; while none has succeeded,
    the Running or Pruned trial with the best evaluation so far, so a sweep shows progress
    early. A Failed trial is never the best, however well it evaluated before failing.
    The target counts once a trial reaching it has Succeeded (its model is registered); while a
    running trial's evaluation has reached it, no new trial starts.
    """
    state = api.sweep.TrialState
    phase = api.sweep.SweepPhase
    counts = api.sweep.TrialCounts(
        total=len(history),
        running=sum(t.state is state.RUNNING for t in history),
        succeeded=sum(t.state is state.SUCCEEDED for t in history),
        pruned=sum(t.state is state.PRUNED for t in history),
        failed=sum(t.state is state.FAILED for t in history),
    )
    objective = spec.objective
    best = _best(history, objective.maximize)
    budget = spec.trial_budget
    ended = counts.total - counts.running
    summary = (f"{counts.succeeded} succeeded, {counts.pruned} pruned, {counts.failed} failed"
               + (f"; best {objective.metric.value} {best.metric:.4g} ({best.trial})"
                  if best is not None else ""))

    reached = [t for t in history if t.state is state.SUCCEEDED
               and _meets(t.metric, objective)]
    if reached:
        first = reached[0]
        assert first.metric is not None
        return Standing(counts, best, phase.SUCCEEDED, "TargetReached",
                        f"Trial {first.name} reached {objective.metric.value} "
                        f"{first.metric:.4g} (target {objective.target:.4g}) after "
                        f"{counts.total} of {budget} trials: {summary}.", 0)
    if counts.failed > spec.max_failed_trials:
        last = next(t for t in reversed(history) if t.state is state.FAILED)
        why = f" (last: {last.name}: {last.message})" if last.message else f" (last: {last.name})"
        return Standing(counts, best, phase.FAILED, "TooManyFailedTrials",
                        f"{counts.failed} trials failed, more than maxFailedTrials "
                        f"{spec.max_failed_trials}{why}; {summary}.", 0)
    over = counts.total >= budget or exhausted
    if over and counts.running == 0 and counts.total and not counts.succeeded:
        # no trained model to show for it, whatever the budget says
        return Standing(counts, best, phase.FAILED, "NoTrialSucceeded",
                        f"All {counts.total} trials ended and none succeeded: {summary}.", 0)
    if over and counts.running == 0 and not any(
            t.state is state.SUCCEEDED and _finite(t.metric) for t in history):
        # trained models, but nothing says which is best: the objective was never measured
        metric = objective.metric.value
        return Standing(counts, best, phase.FAILED, "ObjectiveNotReported",
                        f"All {counts.total} trials ended and none that succeeded reported "
                        f"{metric}, the objective: {summary}. Make the trainer report {metric} "
                        "at each evaluation, or set spec.objective.metric to one it reports.", 0)
    if counts.total >= budget and counts.running == 0:
        return Standing(counts, best, phase.SUCCEEDED, "MaxTrialsReached",
                        f"All {counts.total} trials ended: {summary}.", 0)
    if exhausted and counts.running == 0:
        return Standing(counts, best, phase.SUCCEEDED, "SearchExhausted",
                        f"Every value of the search was tried in {counts.total} trials: "
                        f"{summary}.", 0)

    waiting = any(t.state is state.RUNNING and any(_meets(e[1], objective)
                                                   for e in t.evaluations if len(e) >= 2)
                  for t in history)
    to_start = 0
    if not exhausted and not waiting:
        to_start = max(0, min(spec.parallel_trials - counts.running, budget - counts.total))
    if counts.total == 0:
        return Standing(counts, best, phase.PENDING, "TrialsPending",
                        f"No trial has started yet; {to_start} of {budget} may start now.",
                        to_start)
    return Standing(counts, best, phase.RUNNING, "TrialsRunning",
                    f"{ended} of {budget} trials ended, {counts.running} running: {summary}.",
                    to_start)


def _best(history: Sequence[api.sweep.Trial], maximize: bool) -> api.sweep.BestTrial | None:
    """The best Succeeded trial by its metric; else the best evaluation of a Running or Pruned
    trial; never a Failed trial."""
    state = api.sweep.TrialState
    scored = [(t.metric, t) for t in history if t.state is state.SUCCEEDED and _finite(t.metric)]
    if not scored:
        scored = [(e[1], t) for t in history if t.state in (state.RUNNING, state.PRUNED)
                  for e in t.evaluations if len(e) >= 2 and _finite(e[1])]
    if not scored:
        return None
    sign = -1.0 if maximize else 1.0
    # Ties go to the earlier trial.
    metric, trial = min(scored, key=lambda pair: (sign * float(pair[0] or 0.0), pair[1].index))
    assert metric is not None
    return api.sweep.BestTrial(trial=trial.name, index=trial.index, metric=float(metric),
                               params=dict(trial.params), zoo_model=trial.zoo_model)


def _meets(value: float | None, objective: api.sweep.Objective) -> bool:
    if objective.target is None or not _finite(value):
        return False
    assert value is not None
    return value >= objective.target if objective.maximize else value <= objective.target


def _finite(value: float | None) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)

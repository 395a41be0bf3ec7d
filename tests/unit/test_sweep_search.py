"""The sweep search: seeded samplers, grid coverage, pruning with what it compared against, and
rebuilding from a sweep's recorded trials."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from kiln import api
from kiln.sweep import Inheritance, Search, Verdict, inheritance

TrialState = api.sweep.TrialState


def _spec(parameters: list[dict[str, Any]], **fields: Any) -> api.sweep.TrainingSweepSpec:
    doc = {
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSweep", "metadata": {"name": "s"},
        "spec": {
            "template": {
                "model": {"architecture": "small_cnn", "args": {"depth": 2, "width": 16},
                          "inputShape": [1, 16, 16]},
                "dataset": {"name": "digits"},
                "training": {"epochs": 9, "batchSize": 64},
            },
            "parameters": parameters,
            **fields,
        },
    }
    return api.sweep.parse_sweep(doc).spec


MIXED = [
    {"path": "training.optimizer.lr", "float": {"min": 0.001, "max": 0.3, "log": True}},
    {"path": "training.optimizer.weightDecay", "float": {"min": 0.0, "max": 0.01}},
    {"path": "model.args.depth", "int": {"min": 1, "max": 4}},
    {"path": "model.args.width", "int": {"min": 8, "max": 64, "log": True}},
    {"path": "training.batchSize", "int": {"min": 16, "max": 70, "step": 16}},
    {"path": "model.args.act", "categorical": ["relu", 1, True, 2.5]},
]
GRID = [
    {"path": "model.args.depth", "int": {"min": 1, "max": 3}},
    {"path": "model.args.width", "categorical": [1, True, "wide", 1.5]},
]


class Driver:
    """What `kiln sweep run` and the operator do with a Search: record each trial as the sweep's
    status would (so a second Search can be rebuilt from it) and act on verdicts."""

    def __init__(self, spec: api.sweep.TrainingSweepSpec,
                 history: list[api.sweep.Trial] | None = None) -> None:
        self.spec = spec
        self.history = {t.index: t for t in history or []}
        self.search = Search(spec, list(self.history.values()))

    def ask(self) -> dict[str, Any] | None:
        params = self.search.ask()
        if params is not None:
            index = len(self.history)
            self.history[index] = api.sweep.Trial(index=index, name=f"s-t{index}", params=params,
                                                  state=TrialState.RUNNING)
        return params

    def report(self, index: int, epoch: int, value: float) -> Verdict | None:
        trial = self.history[index]
        self._update(index, evaluations=[*trial.evaluations, [epoch, value]])
        verdict = self.search.report(index, epoch, value,
                                     inheritance(trial.parent, trial.similarity))
        if verdict is not None:
            self._update(index, state=TrialState.PRUNED, pruned_at=verdict.pruned_at())
            self.search.tell(index, TrialState.PRUNED, None)
        return verdict

    def started_from(self, index: int, parent: str | None, similarity: float | None) -> None:
        """Trial `index` warm-started from `parent` (None: cold), as its job's status says."""
        self._update(index, parent=parent, similarity=similarity)

    def succeed(self, index: int, metric: float) -> None:
        self._update(index, state=TrialState.SUCCEEDED, metric=metric)
        self.search.tell(index, TrialState.SUCCEEDED, metric)

    def _update(self, index: int, **fields: Any) -> None:
        self.history[index] = self.history[index].model_copy(update=fields)

    def snapshot(self) -> list[api.sweep.Trial]:
        """The history as a status written now and read back (JSON, so 1 and True survive)."""
        return [api.sweep.Trial.model_validate_json(t.model_dump_json(by_alias=True))
                for t in self.history.values()]


def _key(params: dict[str, Any]) -> str:
    return json.dumps(params, sort_keys=True)


@pytest.mark.parametrize("algorithm", ["random", "tpe"])
def test_sampled_values_are_seeded_and_within_bounds_and_types(algorithm: str) -> None:
    spec = _spec(MIXED, algorithm={"name": algorithm, "seed": 7}, maxTrials=24)
    driver = Driver(spec)
    drawn = []
    for index in range(24):
        params = driver.ask()
        assert params is not None
        drawn.append(params)
        # TPE's model needs finished trials: give it a landscape to follow.
        driver.succeed(index, 1.0 - abs(math.log10(params["training.optimizer.lr"]) + 2))
    for params in drawn:
        assert list(params) == [p["path"] for p in MIXED]
        lr = params["training.optimizer.lr"]
        assert type(lr) is float and 0.001 <= lr <= 0.3
        wd = params["training.optimizer.weightDecay"]
        assert type(wd) is float and 0.0 <= wd <= 0.01
        assert type(params["model.args.depth"]) is int and 1 <= params["model.args.depth"] <= 4
        assert type(params["model.args.width"]) is int and 8 <= params["model.args.width"] <= 64
        assert params["training.batchSize"] in (16, 32, 48, 64)
        assert type(params["training.batchSize"]) is int
        act = params["model.args.act"]
        assert any(json.dumps(act) == json.dumps(c) for c in ("relu", 1, True, 2.5))
    assert len({p["training.optimizer.lr"] for p in drawn}) == 24  # real draws, not one value

    again = Driver(spec)
    for index, params in enumerate(drawn):
        assert again.ask() == params
        again.succeed(index, 1.0 - abs(math.log10(params["training.optimizer.lr"]) + 2))
    other = Search(_spec(MIXED, algorithm={"name": algorithm, "seed": 8}))
    assert other.ask() != drawn[0]


def test_grid_asks_every_point_once_then_nothing() -> None:
    spec = _spec(GRID, algorithm={"name": "grid", "seed": 3})
    search = Search(spec)
    asked = [search.ask() for _ in range(12)]
    points = api.sweep.all_grid_points(spec.parameters)
    assert sorted(_key(p) for p in asked if p is not None) == sorted(_key(p) for p in points)
    assert search.exhausted
    assert search.ask() is None
    # 1 and True are different values of the grid, each asked once with its own type.
    widths = [json.dumps(p["model.args.width"]) for p in asked if p is not None]
    assert widths.count("1") == 3 and widths.count("true") == 3
    # Seeded: the same order again, another order for another seed.
    assert [Search(spec).ask() for _ in range(1)] == asked[:1]
    same = Search(spec)
    assert [same.ask() for _ in range(12)] == asked
    other = Search(_spec(GRID, algorithm={"name": "grid", "seed": 4}))
    assert [other.ask() for _ in range(12)] != asked


def test_grid_below_its_size_is_a_sample_without_repeats() -> None:
    spec = _spec(GRID, algorithm={"name": "grid", "seed": 0}, maxTrials=5)
    search = Search(spec)
    asked = [search.ask() for _ in range(5)]
    assert len({_key(p) for p in asked if p is not None}) == 5
    assert not search.exhausted


def test_asha_prunes_a_trial_behind_the_rung_and_says_against_what() -> None:
    spec = _spec(GRID, earlyStopping={"name": "asha", "minEpochs": 1, "reductionFactor": 3},
                 algorithm={"name": "grid"})
    driver = Driver(spec)
    for _ in range(4):
        driver.ask()
    assert driver.report(0, 1, 0.90) is None  # first at rung 0: nothing to compare with
    assert driver.report(1, 1, 0.95) is None  # ahead of 0.90
    assert driver.report(2, 1, 0.97) is None
    verdict = driver.report(3, 1, 0.80)
    assert verdict == Verdict(epoch=1, value=0.80, against=(
        "rung 0 (epoch 1): 4 cold trials reached it; the top 1/3 (1) go on, needing ≥ 0.97"))
    assert driver.history[3].pruned_at == api.sweep.PrunedAt(epoch=1, value=0.80,
                                                             against=verdict.against)
    # Between rungs nothing is judged; at rung 1 (epoch 3) trial 1 meets the two ahead of it.
    assert driver.report(1, 2, 0.10) is None
    assert driver.report(0, 3, 0.96) is None
    assert driver.report(2, 3, 0.98) is None
    late = driver.report(1, 3, 0.91)
    assert late is not None and late.against == (
        "rung 1 (epoch 3): 3 cold trials reached it; the top 1/3 (1) go on, needing ≥ 0.98")
    assert driver.report(1, 4, 0.99) is None  # already stopped: later reports are ignored


def test_a_chained_trial_is_pruned_only_against_trials_that_inherited_as_much() -> None:
    # What the chain did wrong before: a wide trial partly warm-started from a narrow parent
    # (0.78 after one epoch, ahead of its cold twin's 0.68) was cut because trials fine-tuning
    # a parent of their own architecture had set the rung (0.83).
    spec = _spec(GRID, earlyStopping={"name": "asha", "minEpochs": 1, "reductionFactor": 3},
                 algorithm={"name": "grid"})
    driver = Driver(spec)
    for _ in range(8):
        driver.ask()
    kinds = {0: (None, None), 1: (None, None), 2: ("m-0", 1.0), 3: ("m-0", 1.0),
             4: ("m-1", 1.0), 5: ("m-0", 0.73), 6: ("m-1", 0.41), 7: (None, 0.9)}
    for index, (parent, similarity) in kinds.items():
        driver.started_from(index, parent, similarity)
    assert [inheritance(*kinds[i]) for i in (0, 2, 5, 7)] == [
        Inheritance.COLD, Inheritance.OWN_ARCHITECTURE, Inheritance.OTHER_ARCHITECTURE,
        Inheritance.COLD]  # a cold start's similarity is its best match's: still cold
    assert driver.report(0, 1, 0.68) is None
    for index, value in ((2, 0.83), (3, 0.84), (4, 0.85)):
        assert driver.report(index, 1, value) is None
    # First of its kind at the rung: nothing to compare with, though far behind the others.
    assert driver.report(5, 1, 0.78) is None
    verdict = driver.report(6, 1, 0.70)  # the partly warm 0.78 is ahead of it
    assert verdict is not None and verdict.against == (
        "rung 0 (epoch 1): 2 trials warm-started from a parent of other layers or sizes "
        "reached it; the top 1/3 (1) go on, needing ≥ 0.78")
    assert driver.report(1, 1, 0.60).against.startswith(  # type: ignore[union-attr]
        "rung 0 (epoch 1): 2 cold trials reached it")
    assert driver.report(7, 1, 0.65).against == (  # type: ignore[union-attr]
        "rung 0 (epoch 1): 3 cold trials reached it; the top 1/3 (1) go on, needing ≥ 0.68")


def test_a_rebuilt_chain_keeps_each_trials_kind() -> None:
    spec = _spec(GRID, earlyStopping={"name": "asha", "minEpochs": 1, "reductionFactor": 2},
                 algorithm={"name": "grid"})
    live = Driver(spec)
    for _ in range(4):
        live.ask()
    live.started_from(1, "m-0", 1.0)
    live.started_from(2, "m-0", 0.5)
    live.started_from(3, "m-0", 0.5)
    for index, value in ((0, 0.5), (1, 0.9), (2, 0.7)):
        assert live.report(index, 1, value) is None  # each first of its kind
    rebuilt = Driver(spec, live.snapshot())
    # Trial 3 meets only trial 2 at rung 0, as it would have in the live search.
    for driver in (live, rebuilt):
        verdict = driver.report(3, 1, 0.6)
        assert verdict is not None and "needing ≥ 0.7" in verdict.against


def test_a_trials_last_epoch_is_never_pruned_since_it_ends_there_anyway() -> None:
    # Rung 1 falls at epoch 3, a 3-epoch trial's last: being behind there stops nothing.
    spec = _spec(GRID, earlyStopping={"name": "asha", "minEpochs": 1, "reductionFactor": 3},
                 algorithm={"name": "grid"})
    spec = spec.model_copy(update={"template": spec.template.model_copy(update={
        "training": spec.template.training.model_copy(update={"epochs": 3})})})
    driver = Driver(spec)
    for _ in range(3):
        driver.ask()
    for index, value in enumerate((0.90, 0.95, 0.97)):
        assert driver.report(index, 1, value) is None
    assert driver.report(0, 3, 0.96) is None
    assert driver.report(2, 3, 0.98) is None
    assert driver.report(1, 3, 0.50) is None  # behind both, but at its last epoch


def test_asha_minimising_a_loss_cuts_from_below() -> None:
    spec = _spec(GRID, objective={"metric": "validation_loss"},
                 earlyStopping={"name": "asha", "minEpochs": 2, "reductionFactor": 2})
    driver = Driver(spec)
    for _ in range(2):
        driver.ask()
    assert driver.report(0, 1, 0.5) is None  # below minEpochs: no rung yet
    assert driver.report(0, 2, 0.4) is None
    verdict = driver.report(1, 2, 0.6)
    assert verdict is not None and verdict.against == (
        "rung 0 (epoch 2): 2 cold trials reached it; the top 1/2 (1) go on, needing ≤ 0.4")


def test_median_prunes_below_the_finished_trials_median_after_warmup_and_startup() -> None:
    spec = _spec(GRID, earlyStopping={"name": "median", "minEpochs": 2, "startupTrials": 2})
    driver = Driver(spec)
    for _ in range(4):
        driver.ask()
    for index, values in ((0, [0.5, 0.6, 0.7]), (1, [0.7, 0.8, 0.9])):
        for epoch, value in enumerate(values, start=1):
            driver.report(index, epoch, value)
    driver.succeed(0, 0.7)
    assert driver.report(2, 2, 0.1) is None  # one finished trial: below startupTrials
    driver.succeed(1, 0.9)
    assert driver.report(3, 1, 0.1) is None  # epoch 1 is before minEpochs
    verdict = driver.report(3, 2, 0.65)
    assert verdict == Verdict(epoch=2, value=0.65, against=(
        "median 0.7 at epoch 2 of 2 finished cold trials; its best so far 0.65"))
    assert driver.report(2, 3, 0.81) is None  # ahead of the median 0.8


def test_no_early_stopping_never_prunes() -> None:
    driver = Driver(_spec(GRID))
    driver.ask()
    driver.ask()
    driver.report(0, 1, 0.9)
    assert all(driver.report(1, epoch, 0.01) is None for epoch in range(1, 9))


def test_non_finite_values_are_dropped_and_repeats_ignored() -> None:
    spec = _spec(GRID, earlyStopping={"name": "asha", "minEpochs": 1, "reductionFactor": 2})
    driver = Driver(spec)
    driver.ask()
    driver.ask()
    assert driver.report(0, 1, math.nan) is None
    assert driver.report(0, 1, 0.9) is None  # the NaN was no evaluation: epoch 1 still open
    assert driver.report(1, 1, math.inf) is None
    assert driver.search.report(0, 1, 0.1) is None  # epoch 1 told already
    driver.succeed(0, math.nan)  # a Succeeded trial without a usable metric: no crash
    driver.search.tell(1, TrialState.FAILED, None)
    assert driver.ask() is not None
    with pytest.raises(KeyError, match="trial 9 was never asked"):
        driver.search.report(9, 1, 0.5)
    with pytest.raises(ValueError, match="ended state"):
        driver.search.tell(2, TrialState.RUNNING, None)


def _script(driver: Driver, steps: list[tuple[str, int, int, float]]) -> list[Any]:
    out: list[Any] = []
    for op, index, epoch, value in steps:
        if op == "ask":
            out.append(driver.ask())
        elif op == "report":
            out.append(driver.report(index, epoch, value))
        else:
            driver.succeed(index, value)
            out.append(None)
    return out


# Trials interleaved as parallel trials report: some pruned at rung 0 (epoch 1) or rung 1
# (epoch 2), some finished, some still running at the cut.
BEFORE = [
    ("ask", 0, 0, 0), ("ask", 0, 0, 0), ("ask", 0, 0, 0),
    ("report", 0, 1, 0.60), ("report", 1, 1, 0.70), ("report", 2, 1, 0.50),
    ("report", 0, 2, 0.72), ("report", 1, 2, 0.80), ("ask", 0, 0, 0), ("report", 3, 1, 0.75),
    ("report", 1, 3, 0.85), ("report", 1, 4, 0.90), ("succeed", 1, 0, 0.90),
    ("ask", 0, 0, 0), ("report", 4, 1, 0.40), ("report", 3, 2, 0.78),
]
AFTER = [
    ("report", 3, 3, 0.80), ("report", 3, 4, 0.82), ("ask", 0, 0, 0), ("ask", 0, 0, 0),
    ("report", 5, 1, 0.74), ("report", 6, 1, 0.73), ("report", 5, 2, 0.81),
    ("report", 6, 2, 0.70), ("report", 5, 4, 0.95), ("succeed", 5, 0, 0.95), ("ask", 0, 0, 0),
    ("report", 7, 1, 0.65), ("ask", 0, 0, 0), ("ask", 0, 0, 0), ("ask", 0, 0, 0),
    ("ask", 0, 0, 0),
]


@pytest.mark.parametrize("algorithm", ["grid", "random", "tpe"])
def test_a_rebuilt_search_continues_as_the_uninterrupted_one(algorithm: str) -> None:
    spec = _spec(GRID, algorithm={"name": algorithm, "seed": 5}, maxTrials=12,
                 earlyStopping={"name": "asha", "minEpochs": 1, "reductionFactor": 2})
    live = Driver(spec)
    before = _script(live, BEFORE)
    assert any(isinstance(v, Verdict) for v in before)  # the cut falls after some pruning
    history = live.snapshot()
    assert {t.state for t in history} == {TrialState.RUNNING, TrialState.PRUNED,
                                          TrialState.SUCCEEDED}

    rebuilt = Driver(spec, history)  # the driver restarted: same spec, the recorded trials
    expected = _script(live, AFTER)
    assert _script(rebuilt, AFTER) == expected
    assert any(isinstance(v, Verdict) for v in expected)  # decisions after the cut compared
    asked = [t.params for t in rebuilt.history.values()]
    if algorithm == "grid":
        assert len({_key(p) for p in asked}) == len(asked) == 12
        assert rebuilt.ask() is None


def test_a_rebuild_restores_each_recorded_value_exactly() -> None:
    spec = _spec(GRID, algorithm={"name": "grid", "seed": 1})
    live = Driver(spec)
    for _ in range(12):
        live.ask()
    history = live.snapshot()
    rebuilt = Search(spec, list(reversed(history)))  # any order: replayed by index
    assert rebuilt.exhausted and rebuilt.ask() is None
    # A history read from a server may give 2.0 for 2: still the same grid point.
    trial = history[0].model_copy(update={"params": {
        "model.args.depth": float(history[0].params["model.args.depth"]),
        "model.args.width": history[0].params["model.args.width"]}})
    assert Search(spec, [trial]).ask() not in (None, history[0].params)


@pytest.mark.parametrize(("params", "message"), [
    ({"model.args.depth": 7, "model.args.width": 1}, "model.args.depth=7 is not among"),
    ({"model.args.depth": 1, "model.args.width": "narrow"}, "model.args.width='narrow'"),
    ({"model.args.depth": 1}, "the parameters changed"),
])
def test_a_history_the_spec_cannot_take_is_refused_by_name(params: dict[str, Any],
                                                           message: str) -> None:
    spec = _spec(GRID)
    trial = api.sweep.Trial(index=0, name="s-t0", params=params, state=TrialState.SUCCEEDED,
                            metric=0.5)
    with pytest.raises(ValueError, match=r"trial 0 \(s-t0\)") as caught:
        Search(spec, [trial])
    assert message in str(caught.value)


def test_a_pruned_trials_reports_after_its_verdict_are_not_replayed() -> None:
    spec = _spec(GRID, earlyStopping={"name": "asha", "minEpochs": 1, "reductionFactor": 2})
    ahead = api.sweep.Trial(index=0, name="s-t0", params={"model.args.depth": 1,
                                                          "model.args.width": 1},
                            state=TrialState.RUNNING, evaluations=[[1, 0.9]])
    # Stopped at rung 0; an evaluation it sent while stopping must not put it at rung 1.
    pruned = api.sweep.Trial(index=1, name="s-t1", params={"model.args.depth": 2,
                                                           "model.args.width": 1},
                             state=TrialState.PRUNED, evaluations=[[1, 0.5], [2, 0.99]],
                             pruned_at=api.sweep.PrunedAt(epoch=1, value=0.5, against="x"))
    search = Search(spec, [ahead, pruned])
    search.ask()
    assert search.report(0, 2, 0.91) is None  # alone at rung 1: the pruned trial is not there


def test_a_grid_told_to_its_end_and_rebuilt_from_it_stays_quiet() -> None:
    spec = _spec(GRID, algorithm={"name": "grid"})
    driver = Driver(spec)
    for index in range(12):
        driver.ask()
        driver.succeed(index, index / 12)  # the last one finishes the grid: nothing raises
    assert driver.ask() is None
    rebuilt = Search(spec, driver.snapshot())
    assert rebuilt.exhausted and rebuilt.ask() is None

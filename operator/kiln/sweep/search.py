"""One sweep's search: an Optuna study (sampler and pruner from the spec), asked for each new
trial's values and told each evaluation, rebuilt from the recorded trials."""

from __future__ import annotations

import dataclasses
import enum
import math
import random
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.trial import TrialState as OptunaState

from kiln import api

# Optuna's successive-halving pruner keeps each trial's value at rung r in this system attribute
# of the trial; the rebuild and the "against" text read it.
_RUNG_KEY = "completed_rung_{}"
_INHERITED_KEY = "kiln_inherited"  # a trial's user attribute: its `Inheritance`


class Inheritance(enum.StrEnum):
    """What a trial started from. Pruning compares a trial only with trials of its own kind:
    after one epoch a trial fine-tuning a parent of its own architecture is far ahead of one
    whose wider or deeper layers were partly transferred, which is ahead of a cold one, and
    none of the three says which will end best (measured: the chain's pruned wide trials had
    beaten their cold twins at the first rung)."""

    COLD = "cold"
    OTHER_ARCHITECTURE = "other_architecture"  # weights partly transferred from another
    OWN_ARCHITECTURE = "own_architecture"  # a parent of the same architecture fine-tuned


# In words a user reads in prunedAt: "architecture" here means layers and their sizes.
_AMONG = {Inheritance.COLD: "cold trials",
          Inheritance.OTHER_ARCHITECTURE: "trials warm-started from a parent of other layers "
                                          "or sizes",
          Inheritance.OWN_ARCHITECTURE: "trials fine-tuning a parent of their own layers and "
                                        "sizes"}


def inheritance(parent: str | None, similarity: float | None) -> Inheritance:
    """A trial's `Inheritance` from its parent and that parent's similarity (1: the same
    architecture, as the warm-start match scores it)."""
    if not parent:
        return Inheritance.COLD
    if similarity is not None and similarity >= 1.0:
        return Inheritance.OWN_ARCHITECTURE
    return Inheritance.OTHER_ARCHITECTURE


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Stop this trial now: its evaluation at `epoch` was `value`, behind `against`."""

    epoch: int
    value: float
    against: str  # e.g. "rung 1 (epoch 3): 5 trials reached it; the top 1/3 (1) go on, ..."

    def pruned_at(self) -> api.sweep.PrunedAt:
        return api.sweep.PrunedAt(epoch=self.epoch, value=self.value, against=self.against)


class Search:
    """The search of one sweep.

    Built from the spec and the trials recorded so far (`status.history`, creation order): each
    recorded trial's values are enqueued, its evaluations replayed and finished ones told, so a
    restarted driver continues the same search without re-running or losing a trial.

    Random and TPE draw trial i's values with a seed made from (algorithm.seed, i), so a rebuilt
    search asks what the uninterrupted one would have; grid takes the seeded shuffle of the grid
    in order, never a point already tried. Values that are not finite numbers are dropped as
    failed evaluations; a Succeeded trial without a finite metric counts as failed to Optuna.
    """

    def __init__(self, spec: api.sweep.TrainingSweepSpec,
                 history: Sequence[api.sweep.Trial] = ()) -> None:
        optuna.logging.set_verbosity(optuna.logging.ERROR)
        self._spec = spec
        self._distributions = {p.path: _distribution(p) for p in spec.parameters}
        self._grid: _Grid | None = None
        self._grid_size = 0
        if spec.algorithm.name is api.sweep.Algorithm.GRID:
            self._grid_size = api.sweep.grid_size(spec.parameters) or 0
            self._grid = _Grid(
                {p.path: _grid_choices(p) for p in spec.parameters}, seed=spec.algorithm.seed)
        self._study = optuna.create_study(
            storage=optuna.storages.InMemoryStorage(),
            direction="maximize" if spec.objective.maximize else "minimize",
            sampler=self._sampler(0), pruner=_ByInheritance(_pruner(spec.early_stopping)))
        self._open: dict[int, optuna.Trial] = {}  # index -> its trial, not yet told
        self._epochs: dict[int, set[int]] = {}  # index -> epochs reported
        self._stopped: set[int] = set()  # given a Verdict: later reports are ignored
        self._told: set[int] = set()
        self._tried: set[str] = set()  # keys of the values asked so far
        self._next = 0
        for trial in sorted(history, key=lambda t: t.index):
            self._replay(trial)

    @property
    def exhausted(self) -> bool:
        """Whether the search has no values left: every point of a grid was asked."""
        return self._grid is not None and len(self._tried) >= self._grid_size

    def ask(self) -> dict[str, Any] | None:
        """The values of the next trial (index = trials so far), path -> value; None when the
        search has nothing left (a grid run through). The trial counts as running from here."""
        if self.exhausted:
            return None
        index = self._next
        # Only a grid can offer a point already tried (a history written in another order);
        # such an offer is closed as failed, which also marks its point visited for Optuna.
        for _ in range(2 * self._grid_size + 1):
            self._study.sampler = self._sampler(index)
            trial = self._study.ask(self._distributions)
            params = self._values(trial.params)
            if self._grid is None or _key(params) not in self._tried:
                break
            self._study.tell(trial, state=OptunaState.FAIL)
        else:
            return None
        self._open[index] = trial
        self._epochs[index] = set()
        self._tried.add(_key(params))
        self._next = index + 1
        return params

    def report(self, index: int, epoch: int, value: float,
               inherited: Inheritance = Inheritance.COLD) -> Verdict | None:
        """Trial `index` evaluated `value` (the objective) after `epoch` epochs; a Verdict when
        the pruner says stop. Repeated reports of an epoch already told are ignored. What the
        trial inherited counts as told with its first report: it is pruned against trials that
        inherited as much."""
        trial = self._trial(index)
        if trial is None or index in self._stopped or not _finite(value):
            return None
        epoch = int(epoch)
        if epoch in self._epochs[index]:
            return None
        self._epochs[index].add(epoch)
        if _INHERITED_KEY not in trial.user_attrs:
            trial.set_user_attr(_INHERITED_KEY, inherited.value)
        trial.report(float(value), epoch)
        # The last epoch's evaluation ends the trial anyway: nothing is left to save.
        budget = self._values(trial.params).get("training.epochs",
                                                self._spec.template.training.epochs)
        if epoch >= int(budget) or not trial.should_prune():
            return None
        self._stopped.add(index)
        return Verdict(epoch=epoch, value=float(value), against=self._against(trial))

    def tell(self, index: int, state: api.sweep.TrialState, metric: float | None) -> None:
        """Trial `index` ended: Succeeded with its final objective, Pruned, or Failed."""
        if state is api.sweep.TrialState.RUNNING:
            raise ValueError(f"trial {index}: tell needs an ended state, not {state.value}")
        trial = self._trial(index)
        if trial is None:
            return
        if state is api.sweep.TrialState.SUCCEEDED and metric is not None and _finite(metric):
            self._study.tell(trial, float(metric))
        elif state is api.sweep.TrialState.PRUNED:
            self._study.tell(trial, state=OptunaState.PRUNED)
        else:
            self._study.tell(trial, state=OptunaState.FAIL)
        del self._open[index]
        self._stopped.discard(index)
        self._told.add(index)

    # ------------------------------------------------------------------ rebuild

    def _replay(self, recorded: api.sweep.Trial) -> None:
        index = recorded.index
        if index in self._open or index in self._told:
            raise ValueError(f"trial {index} ({recorded.name}) is recorded twice in the history")
        fixed = self._recorded(recorded)
        self._study.enqueue_trial(fixed)
        self._study.sampler = self._sampler(index)
        trial = self._study.ask(self._distributions)
        if trial.params != fixed:
            raise ValueError(f"trial {index} ({recorded.name}): the search could not restore "
                             f"its values {recorded.params} (got {self._values(trial.params)})")
        self._open[index] = trial
        self._epochs[index] = set()
        self._tried.add(_key(self._values(fixed)))
        trial.set_user_attr(_INHERITED_KEY,
                            inheritance(recorded.parent, recorded.similarity).value)
        self._next = max(self._next, index + 1)
        cut = recorded.pruned_at.epoch if recorded.pruned_at is not None else None
        for evaluation in recorded.evaluations:
            if len(evaluation) < 2 or not all(_finite(x) for x in evaluation[:2]):
                continue
            epoch, value = int(evaluation[0]), float(evaluation[1])
            if epoch in self._epochs[index] or (cut is not None and epoch > cut):
                continue
            self._epochs[index].add(epoch)
            trial.report(value, epoch)
            self._record_rungs(trial)
        if recorded.state is not api.sweep.TrialState.RUNNING:
            self._told_state(index, recorded)

    def _told_state(self, index: int, recorded: api.sweep.Trial) -> None:
        metric = recorded.metric
        if recorded.state is api.sweep.TrialState.SUCCEEDED and metric is None:
            values = [e[1] for e in recorded.evaluations if len(e) >= 2 and _finite(e[1])]
            metric = values[-1] if values else None
        self.tell(index, recorded.state, metric)

    def _record_rungs(self, trial: optuna.Trial) -> None:
        """Let successive halving record the rungs this trial's evaluations reached, as it did
        when they were first reported. Its decisions now are ignored: they would compare with
        trials that reached the rung later. Other pruners keep no state, so need no replay."""
        if self._spec.early_stopping.name is not api.sweep.EarlyStoppingName.ASHA:
            return
        rungs = len(self._rungs(trial.number))
        # A trial not promoted now stops the pruner at that rung; ask again so every rung up to
        # this epoch is recorded, as for a trial the live search let go on.
        while trial.should_prune():
            now = len(self._rungs(trial.number))
            if now == rungs:
                break
            rungs = now

    def _recorded(self, recorded: api.sweep.Trial) -> dict[str, Any]:
        """The recorded trial's values as Optuna parameters, checked against the spec."""
        where = f"trial {recorded.index} ({recorded.name})"
        misfit = misfit_of(self._spec, recorded.params)
        if misfit:
            raise ValueError(f"{where}: {misfit}")
        return {p.path: _internal(p, recorded.params[p.path]) for p in self._spec.parameters}

    # ------------------------------------------------------------------ helpers

    def _trial(self, index: int) -> optuna.Trial | None:
        """The open trial `index`; None once told. Raises for an index never asked."""
        if index in self._told:
            return None
        trial = self._open.get(index)
        if trial is None:
            raise KeyError(f"trial {index} was never asked of this search")
        return trial

    def _sampler(self, index: int) -> optuna.samplers.BaseSampler:
        if self._grid is not None:
            return self._grid
        seed = random.Random(f"{self._spec.algorithm.seed}/{index}").getrandbits(32)
        if self._spec.algorithm.name is api.sweep.Algorithm.TPE:
            return optuna.samplers.TPESampler(seed=seed)
        return optuna.samplers.RandomSampler(seed=seed)

    def _values(self, internal: Mapping[str, Any]) -> dict[str, Any]:
        """Optuna parameters as the trial's values, path -> value, in the spec's order."""
        out: dict[str, Any] = {}
        for p in self._spec.parameters:
            value = internal[p.path]
            if p.categorical is not None:
                out[p.path] = p.categorical[int(value)]
            elif p.int_range is not None:
                out[p.path] = int(value)
            else:
                out[p.path] = float(value)
        return out

    def _rungs(self, number: int) -> list[float]:
        attrs = self._study.get_trials(deepcopy=False)[number].system_attrs
        rungs: list[float] = []
        while _RUNG_KEY.format(len(rungs)) in attrs:
            rungs.append(float(attrs[_RUNG_KEY.format(len(rungs))]))
        return rungs

    def _against(self, trial: optuna.Trial) -> str:
        """What the pruner compared `trial` with, in words: Optuna only says yes or no."""
        stopping = self._spec.early_stopping
        maximize = self._spec.objective.maximize
        better = "≥" if maximize else "≤"
        me = self._study.get_trials(deepcopy=False)[trial.number]
        kind = _inherited(me)
        trials = [t for t in self._study.get_trials(deepcopy=False) if _inherited(t) is kind]
        # Only a chain mixes kinds; its text says which kind the trial was compared within.
        among = _AMONG[kind] if self._spec.warm_start is api.sweep.SweepWarmStart.CHAIN \
            else "trials"
        if stopping.name is api.sweep.EarlyStoppingName.ASHA:
            rung = len(self._rungs(trial.number)) - 1
            key = _RUNG_KEY.format(rung)
            reached = sorted((float(t.system_attrs[key]) for t in trials
                              if key in t.system_attrs), reverse=maximize)
            keep = max(len(reached) // stopping.reduction_factor, 1)
            epoch = stopping.min_epochs * stopping.reduction_factor ** rung
            return (f"rung {rung} (epoch {epoch}): {len(reached)} {among} reached it; "
                    f"the top 1/{stopping.reduction_factor} ({keep}) go on, needing {better} "
                    f"{reached[keep - 1]:.4g}")
        step = me.last_step
        own = [v for v in me.intermediate_values.values() if _finite(v)]
        best = max(own) if maximize else min(own)
        finished = [t.intermediate_values[step] for t in trials
                    if t.state is OptunaState.COMPLETE and step in t.intermediate_values]
        median = statistics.median(v for v in finished if _finite(v))
        return (f"median {median:.4g} at epoch {step} of {len(finished)} finished {among}; "
                f"its best so far {best:.4g}")


def misfit_of(spec: api.sweep.TrainingSweepSpec, params: Mapping[str, Any]) -> str | None:
    """Why `params` (a trial's recorded values) cannot be a trial of `spec` now, or None."""
    paths = [p.path for p in spec.parameters]
    if set(params) != set(paths):
        return (f"recorded values for {sorted(params)} but the sweep's parameters are "
                f"{sorted(paths)}; the parameters changed after the sweep began (recreate the "
                "sweep to change them)")
    for p in spec.parameters:
        if _internal(p, params[p.path]) is None:
            return (f"recorded {p.path}={params[p.path]!r} is not among the parameter's values "
                    "now; the parameters changed after the sweep began (recreate the sweep to "
                    "change them)")
    return None


class _Grid(optuna.samplers.GridSampler):
    """Optuna's grid sampler, minus its end-of-grid `study.stop()`: that works only inside
    `study.optimize` (here it raises), and the drivers end a sweep themselves (`standing`)."""

    def after_trial(self, study: optuna.Study, trial: optuna.trial.FrozenTrial,
                    state: OptunaState, values: Sequence[float] | None) -> None:
        return None


class _ByInheritance(optuna.pruners.BasePruner):
    """Optuna's pruner, shown only the trials that inherited what the judged trial did."""

    def __init__(self, pruner: optuna.pruners.BasePruner) -> None:
        self._pruner = pruner

    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        return self._pruner.prune(_Kind(study, _inherited(trial)), trial)  # type: ignore[arg-type]


class _Kind:
    """A study as the pruner reads it, less the trials of other `Inheritance`s: both Optuna
    pruners see the others through `get_trials` alone; the rest (direction, storage) passes."""

    def __init__(self, study: optuna.Study, kind: Inheritance) -> None:
        self._study, self._kind = study, kind

    def get_trials(self, deepcopy: bool = True, states: Sequence[OptunaState] | None = None
                   ) -> list[optuna.trial.FrozenTrial]:
        return [t for t in self._study.get_trials(deepcopy=deepcopy, states=states)
                if _inherited(t) is self._kind]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._study, name)


def _inherited(trial: optuna.trial.FrozenTrial) -> Inheritance:
    return Inheritance(trial.user_attrs.get(_INHERITED_KEY, Inheritance.COLD.value))


def _pruner(stopping: api.sweep.EarlyStoppingSpec) -> optuna.pruners.BasePruner:
    if stopping.name is api.sweep.EarlyStoppingName.ASHA:
        return optuna.pruners.SuccessiveHalvingPruner(
            min_resource=stopping.min_epochs, reduction_factor=stopping.reduction_factor,
            min_early_stopping_rate=0)
    if stopping.name is api.sweep.EarlyStoppingName.MEDIAN:
        # Epochs count from 1: epoch minEpochs is the first that may be stopped.
        return optuna.pruners.MedianPruner(n_startup_trials=stopping.startup_trials,
                                           n_warmup_steps=stopping.min_epochs)
    return optuna.pruners.NopPruner()


def _distribution(p: api.sweep.Parameter) -> BaseDistribution:
    # Categorical values go to Optuna as their positions: it finds a value by ==, so 1 and
    # True (or 1 and 1.0), both valid choices, would be one to it.
    if p.categorical is not None:
        return CategoricalDistribution(tuple(range(len(p.categorical))))
    if p.int_range is not None:
        r = p.int_range
        top = r.min + (r.max - r.min) // r.step * r.step
        return IntDistribution(r.min, top, log=r.log, step=r.step)
    assert p.float_range is not None
    return FloatDistribution(p.float_range.min, p.float_range.max, log=p.float_range.log)


def _grid_choices(p: api.sweep.Parameter) -> list[int]:
    if p.categorical is not None:
        return list(range(len(p.categorical)))
    return list(api.sweep.finite_values(p) or [])


def _internal(p: api.sweep.Parameter, value: Any) -> Any:
    """`value` (as recorded in a status) as the Optuna parameter of `p`, or None if `p` cannot
    take it."""
    if p.categorical is not None:
        for i, choice in enumerate(p.categorical):
            if _scalar_key(choice) == _scalar_key(value):
                return i
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not _finite(value):
        return None
    if p.int_range is not None:
        if value != int(value) or int(value) not in (api.sweep.finite_values(p) or []):
            return None
        return int(value)
    assert p.float_range is not None
    if not p.float_range.min <= value <= p.float_range.max:
        return None
    return float(value)


def _scalar_key(value: Any) -> tuple[str, Any]:
    # A status read back may give 2.0 for 2; a boolean is never a number here.
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int | float):
        return ("number", float(value))
    return (type(value).__name__, value)


def _key(params: Mapping[str, Any]) -> str:
    return repr(sorted((k, _scalar_key(v)) for k, v in params.items()))


def _finite(value: Any) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value))

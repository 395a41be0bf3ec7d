"""The TrainingSweep API: a search over TrainingJob specs, its status, and its checks.

A sweep is a TrainingJob spec (`spec.template`) plus parameters, each a dotted path into that
spec with the values it may take; every trial is a TrainingJob with the trial's values applied.
"""

from __future__ import annotations

import copy
import enum
import itertools
import json
import math
import typing
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
)

from kiln.api import bounds, names, validation
from kiln.api import spec as spec_mod

SWEEP_KIND = "TrainingSweep"
SWEEP_PLURAL = "trainingsweeps"
SWEEP_SINGULAR = "trainingsweep"
SWEEP_SHORT_NAMES = ("tsw",)
# Labels and annotation on each trial TrainingJob: which sweep, which trial, its values (JSON).
SWEEP_LABEL = "kiln.dev/sweep"
TRIAL_LABEL = "kiln.dev/trial"
PARAMS_ANNOTATION = "kiln.dev/trial-params"
MAX_TRIALS = 200  # each trial's history lives in the sweep's status, which etcd caps at 1.5 MiB
MAX_PARAMETERS = 20
MAX_CATEGORIES = 64
# A grid search lists every combination (Optuna's GridSampler does), so it is bounded even when
# maxTrials runs only a part of it.
MAX_GRID_POINTS = 100_000
# status.history holds every trial's values and an evaluation per epoch; etcd stores an object
# of at most 1.5 MiB, the spec (at most about 100 KiB), metadata and conditions included. A
# sweep whose history could outgrow this is refused (each part's bytes as compact JSON, at most).
MAX_HISTORY_BYTES = 1152 * 1024
TRIAL_BYTES = 1024  # a trial's name, state, metric, zoo ids, prunedAt and a capped message
EVALUATION_BYTES = 40  # [epoch, value, seconds]
TRIAL_MESSAGE_MAX_BYTES = 256  # a failed trial's message as the history keeps it
MAX_VALUE_CHARS = 256  # a categorical string value
# Admission builds a trial's model at each of these combinations of parameter values (on the
# meta device): a few seconds at most.
MAX_PROBE_POINTS = 64
# Trials are named <sweep>-t<index>; the sweep's name leaves room for "-t199" in 63 characters.
SWEEP_NAME_MAX_LENGTH = names.NAME_MAX_LENGTH - len(f"-t{MAX_TRIALS - 1}")
# Paths below these spec fields are free-form (builder and dataset keyword arguments).
FREE_FORM_PATHS = ("model.args", "dataset.args")
PATH_PATTERN = r"^[A-Za-z][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"

Scalar = StrictBool | StrictInt | StrictFloat | StrictStr


class Algorithm(enum.StrEnum):
    GRID = "grid"  # every combination once, in an order drawn from the seed
    RANDOM = "random"  # independent uniform (or log-uniform) draws
    TPE = "tpe"  # tree-structured Parzen estimator: draws near the good trials so far


class EarlyStoppingName(enum.StrEnum):
    NONE = "none"
    ASHA = "asha"  # asynchronous successive halving: keep the top 1/reductionFactor per rung
    MEDIAN = "median"  # stop a trial below the median of earlier trials at the same epoch


class Goal(enum.StrEnum):
    MAXIMIZE = "maximize"
    MINIMIZE = "minimize"


class SweepWarmStart(enum.StrEnum):
    CHAIN = "chain"  # trials warm-start from the zoo, the sweep's own trials first
    INDEPENDENT = "independent"  # every trial starts cold: a clean comparison of the values


class SweepPhase(enum.StrEnum):
    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class SweepConditionType(enum.StrEnum):
    CREATED = "Created"  # validated; trials may be created
    RUNNING = "Running"  # trials are running
    SUCCEEDED = "Succeeded"  # maxTrials ended, or a trial reached the objective's target
    FAILED = "Failed"  # invalid, or more than maxFailedTrials trials failed


class TrialState(enum.StrEnum):
    RUNNING = "Running"  # its TrainingJob exists and has not ended
    SUCCEEDED = "Succeeded"
    PRUNED = "Pruned"  # stopped early: its evaluations were behind the others'
    FAILED = "Failed"


# ---------------------------------------------------------------------------- spec


class FloatRange(names.ApiModel):
    min: float = Field(description="min: the smallest value.")
    max: float = Field(description="max: the largest value (above min).")
    log: bool = Field(default=False, description="log: draw on a log scale (min above 0).")


class IntRange(names.ApiModel):
    min: int = Field(description="min: the smallest value.")
    max: int = Field(description="max: the largest value (at least min).")
    step: int = Field(default=1, ge=1, description="step: spacing of the values from min.")
    log: bool = Field(default=False, description="log: draw on a log scale (min at least 1).")


class Parameter(names.ApiModel):
    path: str = Field(
        min_length=1, max_length=256, pattern=PATH_PATTERN,
        description="path: a dotted field path in the TrainingJob spec, e.g. "
        "training.optimizer.lr, "
        "model.args.depth (below model.args and dataset.args any key).",
    )
    categorical: list[Scalar] | None = Field(
        default=None, min_length=1, max_length=MAX_CATEGORIES,
        description="categorical: the values to choose from (strings, numbers or booleans).",
    )
    int_range: IntRange | None = Field(
        default=None, alias="int", description="int: an integer range.")
    float_range: FloatRange | None = Field(
        default=None, alias="float", description="float: a real range.")


class Objective(names.ApiModel):
    metric: names.TargetMetric = Field(
        default=names.TargetMetric.VALIDATION_ACCURACY,
        description="metric: what the trainer reports at each evaluation that the search "
        "optimises: validation_accuracy or validation_loss.",
    )
    goal: Goal | None = Field(
        default=None,
        description="goal: maximize or minimize; default: maximize accuracy, minimize loss.",
    )
    target: float | None = Field(
        default=None,
        description="target: the sweep succeeds, and stops its other trials, once a trial "
        "reaches it (accuracy in (0, 1], loss above 0).",
    )

    @property
    def maximize(self) -> bool:
        if self.goal is not None:
            return self.goal is Goal.MAXIMIZE
        return self.metric is names.TargetMetric.VALIDATION_ACCURACY


class AlgorithmSpec(names.ApiModel):
    name: Algorithm = Field(default=Algorithm.RANDOM,
                            description="name: grid, random or tpe.")
    seed: int = Field(default=0, ge=0, le=2**31 - 1,
                      description="seed: the sampler's seed (same seed, same values).")


class EarlyStoppingSpec(names.ApiModel):
    name: EarlyStoppingName = Field(default=EarlyStoppingName.NONE,
                                    description="name: none, asha or median.")
    min_epochs: int = Field(
        default=1, ge=1,
        description="minEpochs: no trial is stopped before this many evaluations (asha's first "
        "rung; median's warm-up).",
    )
    reduction_factor: int = Field(
        default=3, ge=2, le=16,
        description="reductionFactor: asha keeps the top 1/reductionFactor at each rung.",
    )
    startup_trials: int = Field(
        default=3, ge=0,
        description="startupTrials: median stops nothing until this many trials have ended.",
    )


class TrainingSweepSpec(names.ApiModel):
    template: spec_mod.TrainingJobSpec = Field(
        description="template: the TrainingJob spec every trial starts from.")
    parameters: list[Parameter] = Field(
        min_length=1, max_length=MAX_PARAMETERS,
        description="parameters: what the search varies; each sets one path of the template.",
    )
    objective: Objective = Field(default_factory=Objective,
                                 description="objective: the metric to optimise.")
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec,
                                     description="algorithm: how values are chosen.")
    early_stopping: EarlyStoppingSpec = Field(
        default_factory=EarlyStoppingSpec,
        description="earlyStopping: stopping trials that fall behind (pruning).")
    max_trials: int | None = Field(
        default=None, ge=1, le=MAX_TRIALS,
        description=f"maxTrials: trials in all (at most {MAX_TRIALS}); default: the grid's size "
        "for grid, else 16.",
    )
    parallel_trials: int = Field(default=2, ge=1, le=64,
                                 description="parallelTrials: trials unfinished at once.")
    max_failed_trials: int = Field(
        default=3, ge=0,
        description="maxFailedTrials: the sweep fails once more trials than this have failed.",
    )
    warm_start: SweepWarmStart = Field(
        default=SweepWarmStart.CHAIN,
        description="warmStart: chain (trials warm-start from the zoo, the sweep's own "
        "trials first: the search finishes sooner) or independent (every trial cold: the "
        "values are compared on equal terms).",
    )

    @property
    def trial_budget(self) -> int:
        """maxTrials, defaulted: the grid's size for grid search, else 16."""
        if self.max_trials is not None:
            return self.max_trials
        if self.algorithm.name is Algorithm.GRID:
            return min(MAX_TRIALS, grid_size(self.parameters) or 1)
        return 16


# ---------------------------------------------------------------------------- status


class SweepCondition(names.ApiModel):
    type: SweepConditionType = Field(description="type: Created, Running, Succeeded, Failed.")
    status: Literal["True", "False", "Unknown"] = Field(description="status: True/False/Unknown.")
    reason: str = Field(default="", description="reason: CamelCase cause.")
    message: str = Field(default="", description="message: one sentence with numbers.")
    last_transition_time: str | None = Field(
        default=None, description="lastTransitionTime: RFC 3339 time the status last flipped.")


class PrunedAt(names.ApiModel):
    epoch: StrictInt = Field(description="epoch: the evaluation at which it was stopped.")
    value: StrictFloat = Field(description="value: its objective there.")
    against: StrictStr = Field(
        default="", description="against: what it was compared with, e.g. the rung's cut-off.")


class Trial(names.ApiModel):
    index: StrictInt = Field(ge=0, description="index: 0-based order of creation.")
    name: StrictStr = Field(description="name: its TrainingJob.")
    params: dict[str, Any] = Field(default_factory=dict,
                                   description="params: path -> value for this trial.")
    state: TrialState = Field(description="state: Running, Succeeded, Pruned or Failed.")
    evaluations: list[Annotated[list[float], Field(min_length=2, max_length=3)]] = Field(
        default_factory=list,
        description="evaluations: [epoch, objective, seconds since the sweep started] at each "
        "evaluation so far.")
    metric: float | None = Field(default=None,
                                 description="metric: its final (or last) objective.")
    parent: StrictStr | None = Field(default=None,
                                     description="parent: the zoo model it warm-started from.")
    similarity: float | None = Field(
        default=None, ge=0.0, le=1.0,
        description="similarity: of its architecture to its parent's (1: the same); a chained "
        "trial is pruned only against trials that inherited as much (none, another "
        "architecture's weights, its own architecture's).")
    zoo_model: StrictStr | None = Field(default=None,
                                        description="zooModel: the zoo model it registered.")
    pruned_at: PrunedAt | None = Field(default=None, description="prunedAt: when pruned.")
    message: StrictStr = Field(default="", description="message: why it failed.")


class TrialCounts(names.ApiModel):
    total: int = Field(default=0, description="total: trials created.")
    running: int = Field(default=0, description="running.")
    succeeded: int = Field(default=0, description="succeeded.")
    pruned: int = Field(default=0, description="pruned.")
    failed: int = Field(default=0, description="failed.")


class BestTrial(names.ApiModel):
    trial: StrictStr = Field(description="trial: its TrainingJob's name.")
    index: StrictInt = Field(description="index: its trial index.")
    metric: float = Field(description="metric: its objective.")
    params: dict[str, Any] = Field(default_factory=dict, description="params: its values.")
    zoo_model: StrictStr | None = Field(default=None, description="zooModel: its zoo model.")


class TrainingSweepStatus(names.ApiModel):
    phase: SweepPhase | None = Field(default=None, description="phase: from the conditions.")
    conditions: list[SweepCondition] = Field(default_factory=list, description="conditions.")
    trials: TrialCounts = Field(default_factory=TrialCounts, description="trials: counts.")
    best: BestTrial | None = Field(default=None, description="best: the best trial so far.")
    history: list[Trial] = Field(default_factory=list,
                                 description="history: every trial, in creation order.")
    start_time: str | None = Field(default=None, description="startTime: RFC 3339.")
    completion_time: str | None = Field(default=None, description="completionTime: RFC 3339.")


class TrainingSweep(names.ApiModel):
    """TrainingSweep: a search over TrainingJobs; Kiln chains warm starts between its trials."""

    api_version: Literal["kiln.dev/v1alpha1"] = Field(description="apiVersion: kiln.dev/v1alpha1")
    kind: Literal["TrainingSweep"] = Field(description="kind: TrainingSweep")
    metadata: spec_mod.ObjectMeta = Field(description="metadata: standard object metadata.")
    spec: TrainingSweepSpec = Field(description="spec: the template and the search.")
    status: TrainingSweepStatus | None = Field(
        default=None, description="status: written by the operator (phase, trials, best).")

    @property
    def name(self) -> str:
        return self.metadata.name

    @property
    def namespace(self) -> str:
        return self.metadata.namespace or "default"


# ---------------------------------------------------------------------------- values


def grid_size(parameters: list[Parameter]) -> int | None:
    """How many combinations a grid over `parameters` has; None if a float range is open."""
    size = 1
    for p in parameters:
        if p.categorical is not None:
            size *= len(p.categorical)
        elif p.int_range is not None:  # counted, not listed (len() of a range stops at 2**63)
            r = p.int_range
            size *= max(0, (r.max - r.min) // r.step + 1)
        else:
            return None
    return size


def finite_values(p: Parameter) -> Sequence[Any] | None:
    """Every value `p` may take, in order, or None for a float range (no finite set). An int
    range's values are a `range`: its length and membership cost nothing, and it is never
    listed (it may hold billions)."""
    if p.categorical is not None:
        return list(p.categorical)
    if p.int_range is not None:
        r = p.int_range
        return range(r.min, r.max + 1, r.step)
    return None


def apply(template: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """A copy of the wire spec `template` with each ``path: value`` of `params` set in it.

    Objects missing on the way are created (a parameter may set a field the template left at
    its default).
    """
    spec = copy.deepcopy(template)
    for path, value in params.items():
        *parents, leaf = path.split(".")
        node = spec
        for part in parents:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        node[leaf] = value
    return spec


def trial_name(sweep: str, index: int) -> str:
    return f"{sweep}-t{index}"


def objective_value(metric: names.TargetMetric, value: Any) -> float | None:
    """`value`, a trainer's report of `metric`, as an evaluation, or None when it cannot be
    one: not a finite number, or one `names.metric_problem` refuses. A trainer's report is
    user code's: a value the metric cannot take would end a sweep at its target or lead its
    search."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return None if names.metric_problem(metric, value) else float(value)


# ---------------------------------------------------------------------------- checks


def parse_sweep(doc: Any, *, source: str = "") -> TrainingSweep:
    """Parse and check one TrainingSweep document (a dict as decoded from YAML/JSON).

    Raises:
        InvalidSpec: every problem, one line each with the field's path: the schema's (types,
            bounds, unknown fields), the template's as a TrainingJob's, and `problems`'.
    """
    too_large = bounds.problems(doc)
    if too_large:
        raise names.InvalidSpec(too_large, source=source, kind=SWEEP_KIND)
    if not isinstance(doc, dict):
        raise names.InvalidSpec([f"<document>: expected a mapping, got {type(doc).__name__}"],
                                source=source, kind=SWEEP_KIND)
    unknown = validation.unknown_fields(TrainingSweep, doc)
    try:
        sweep = TrainingSweep.model_validate_json(json.dumps(doc), strict=True)
    except ValidationError as exc:
        shown = [p for p in validation.problems_of(exc)
                 if "extra inputs are not permitted" not in p.lower()]
        # As for a job: the checks that read no rejected field still run, on the sweep with
        # those fields at their defaults, so every problem shows at once.
        partial, rejected = validation.without_rejected(
            doc, exc.errors(), validation.misspelt(unknown), TrainingSweep)
        more = validation.unaffected(problems(partial), rejected) if partial is not None else []
        raise names.InvalidSpec(unknown + shown + more, source=source, kind=SWEEP_KIND,
                                job=partial, rejected=rejected) from None
    except ValueError as exc:
        raise names.InvalidSpec(unknown + [str(exc)], source=source, kind=SWEEP_KIND) from None
    found = unknown + problems(sweep)
    if found:
        raise names.InvalidSpec(found, source=source, kind=SWEEP_KIND)
    return sweep


def problems(sweep: TrainingSweep) -> list[str]:
    """The cross-field problems of a parsed sweep: its name, the template as a job, each
    parameter's path and values (every trial must be a valid TrainingJob), the algorithm's and
    early stopping's needs, the objective's target."""
    out: list[str] = []
    spec = sweep.spec
    if len(sweep.name) > SWEEP_NAME_MAX_LENGTH:
        out.append(f"metadata.name: at most {SWEEP_NAME_MAX_LENGTH} characters, so trial names "
                   f"(<name>-t<index>) stay within {names.NAME_MAX_LENGTH}")
    template = validation.to_wire(spec.template)
    out += [f"spec.template.{p.removeprefix('spec.')}" for p in _job_problems(sweep, template)]
    if spec.template.run_policy.suspend:
        out.append("spec.template.runPolicy.suspend: trials would be created suspended and "
                   "never run; leave it false (the sweep suspends a trial to prune it)")
    seen: set[str] = set()
    for i, param in enumerate(spec.parameters):
        at = f"spec.parameters[{i}]"
        if param.path in seen:
            out.append(f"{at}.path: {param.path!r} is set by an earlier parameter too")
        seen.add(param.path)
        out += _parameter_problems(sweep, template, param, at)
    out += _algorithm_problems(spec)
    out += _objective_problems(spec)
    out += _history_problems(spec)
    epochs = spec.template.training.epochs
    stopping = spec.early_stopping
    if stopping.name is not EarlyStoppingName.NONE and stopping.min_epochs >= epochs:
        out.append(f"spec.earlyStopping.minEpochs: {stopping.min_epochs} leaves nothing to stop "
                   f"in a {epochs}-epoch trial; set it below spec.template.training.epochs")
    return out


def _parameter_problems(sweep: TrainingSweep, template: dict[str, Any], param: Parameter,
                        at: str) -> list[str]:
    kinds = [k for k, v in (("categorical", param.categorical), ("int", param.int_range),
                            ("float", param.float_range)) if v is not None]
    if len(kinds) != 1:
        return [(f"{at}: set exactly one of categorical, int or float (got "
                f"{', '.join(kinds) or 'none'})")]
    path_problem = path_problem_of(param.path)
    if path_problem:
        return [f"{at}.path: {path_problem}"]
    out: list[str] = []
    if param.float_range is not None and _integer_field(param.path):
        out.append(f"{at}.float: {param.path} takes whole numbers; use an int range")
    if param.int_range is not None:
        r = param.int_range
        if r.max < r.min:
            out.append(f"{at}.int: empty range: max {r.max} is below min {r.min}")
        if r.log and r.min < 1:
            out.append(f"{at}.int.log: a log scale needs min at least 1 (got {r.min})")
        if r.log and r.step != 1:
            out.append(f"{at}.int: step and log cannot be combined; drop one")
    if param.float_range is not None:
        f = param.float_range
        if not (math.isfinite(f.min) and math.isfinite(f.max)):
            out.append(f"{at}.float: min and max must be finite numbers")
        elif f.max <= f.min:
            out.append(f"{at}.float: empty range: max {f.max} is not above min {f.min}")
        elif f.log and f.min <= 0:
            out.append(f"{at}.float.log: a log scale needs min above 0 (got {f.min})")
    if param.categorical is not None:
        # 1 and 1.0 are one value: JSON (and a status read back) may give either for both.
        keys = [json.dumps(float(v) if type(v) is int else v) for v in param.categorical]
        if len(set(keys)) != len(keys):
            out.append(f"{at}.categorical: a value is listed twice (1 and 1.0 are the same "
                       "number)")
        long = [v for v in param.categorical if isinstance(v, str) and len(v) > MAX_VALUE_CHARS]
        if long:
            out.append(f"{at}.categorical: a string value has at most {MAX_VALUE_CHARS} "
                       f"characters (got {len(long[0])}); keep long settings in the template")
    if out:
        return out
    # Every trial is a TrainingJob: each value (each end of a range) must make a valid one.
    for value in probe_values(param):
        bad = _job_problems(sweep, apply(template, {param.path: value}))
        if bad:
            out.append(f"{at}: {param.path}={json.dumps(value)} makes an invalid trial: "
                       + "; ".join(bad))
    return out


def probe_values(param: Parameter) -> list[Any]:
    """The values a trial's spec is checked at for `param`: each categorical value, or a range's
    two ends (an int range's last value on its step)."""
    if param.categorical is not None:
        return list(param.categorical)
    if param.int_range is not None:
        values = finite_values(param) or [param.int_range.min]
        return sorted({values[0], values[-1]})
    assert param.float_range is not None
    return [param.float_range.min, param.float_range.max]


def probe_points(parameters: Sequence[Parameter]) -> list[dict[str, Any]]:
    """Combinations of several parameters' `probe_values` a trial's spec is checked at too:
    values valid alone may not be together (the deepest and the widest model, a warm-up as
    long as the fewest epochs). Every combination while there are at most `MAX_PROBE_POINTS`;
    else all parameters at their first, and at their last, probe value."""
    if len(parameters) < 2:
        return []
    values = [probe_values(p) for p in parameters]
    paths = [p.path for p in parameters]
    if math.prod(len(v) for v in values) <= MAX_PROBE_POINTS:
        combos = list(itertools.product(*values))
    else:
        combos = [tuple(v[0] for v in values), tuple(v[-1] for v in values)]
    return [dict(zip(paths, combo, strict=True)) for combo in combos]


def path_problem_of(path: str) -> str | None:
    """Why `path` names no field of a TrainingJob spec that a trial may set, or None."""
    parts = path.split(".")
    model: type[BaseModel] = spec_mod.TrainingJobSpec
    walked: list[str] = []
    for i, part in enumerate(parts):
        fields = {(f.alias or n): f for n, f in model.model_fields.items()}
        field = fields.get(part)
        if field is None:
            where = ".".join(walked) or "the spec"
            return (f"{path!r} is not a TrainingJob field: {where} has no {part!r}; known: "
                    f"{', '.join(sorted(fields))}")
        walked.append(part)
        here = ".".join(walked)
        if here == "template":
            return "spec.template (the pod template) cannot be searched; set it in the template"
        if here == "runPolicy.suspend":
            return ("runPolicy.suspend cannot be searched: the sweep suspends a trial to stop "
                    "it (a suspended trial holds its place among parallelTrials)")
        nested = bounds.model_types(field.annotation)
        if here in FREE_FORM_PATHS:
            if i == len(parts) - 1:
                return f"{here} is a map; name a key below it, e.g. {here}.depth"
            return None
        if i == len(parts) - 1:
            if nested:
                return f"{here} is an object; name one of its fields"
            return None
        if not nested:
            return f"{here} is a value, not an object; it has no {parts[i + 1]!r}"
        model = nested[0]
    return None


def _integer_field(path: str) -> bool:
    """Whether `path` (a valid one) names an integer field of the spec's typed part."""
    model: type[BaseModel] = spec_mod.TrainingJobSpec
    for part in path.split("."):
        fields = {(f.alias or n): f for n, f in model.model_fields.items()}
        field = fields[part]
        nested = bounds.model_types(field.annotation)
        if not nested:
            return int in (field.annotation, *typing.get_args(field.annotation))
        model = nested[0]
    return False


def _job_problems(sweep: TrainingSweep, spec: dict[str, Any]) -> list[str]:
    """The problems of `spec` as a trial TrainingJob's spec, each ``spec.<field>: ...``."""
    doc = {"apiVersion": names.API_VERSION, "kind": names.KIND,
           "metadata": {"name": trial_name(sweep.name[:SWEEP_NAME_MAX_LENGTH], 0),
                        "namespace": sweep.namespace},
           "spec": spec}
    try:
        validation.parse_job(doc)
    except names.InvalidSpec as exc:
        return list(exc.problems)
    return []


def _algorithm_problems(spec: TrainingSweepSpec) -> list[str]:
    if spec.algorithm.name is not Algorithm.GRID:
        return []
    open_ = [p.path for p in spec.parameters if finite_values(p) is None]
    if open_:
        return [(f"spec.algorithm.name: grid needs a finite set per parameter; "
                f"{', '.join(open_)} is a float range (give categorical values, or use random "
                "or tpe)")]
    size = grid_size(spec.parameters) or 0
    if size > MAX_GRID_POINTS:
        return [(f"spec.parameters: the grid has {size} combinations, above {MAX_GRID_POINTS}; "
                "narrow the parameters, or use random or tpe")]
    if size > MAX_TRIALS and spec.max_trials is None:
        return [(f"spec.maxTrials: the grid has {size} combinations, above {MAX_TRIALS}; set "
                "maxTrials to run a part of it, or narrow the parameters")]
    return []


def _objective_problems(spec: TrainingSweepSpec) -> list[str]:
    objective = spec.objective
    out = []
    accuracy = objective.metric is names.TargetMetric.VALIDATION_ACCURACY
    if objective.goal is not None and objective.maximize != accuracy:
        out.append(f"spec.objective.goal: {objective.goal.value} {objective.metric.value} makes "
                   f"the search prefer worse models; use "
                   f"{'maximize' if accuracy else 'minimize'}")
    target = objective.target
    if target is not None and not math.isfinite(target):
        out.append(f"spec.objective.target: must be a finite number (got {target})")
    elif target is not None:
        if accuracy and not 0 < target <= 1:
            out.append(f"spec.objective.target: an accuracy is in (0, 1] (got {target})")
        if not accuracy and not target > 0:
            out.append(f"spec.objective.target: a loss target is above 0 (got {target})")
    return out


def _history_problems(spec: TrainingSweepSpec) -> list[str]:
    """Whether every trial's history fits the sweep's status (`MAX_HISTORY_BYTES`)."""
    epochs = spec.template.training.epochs
    values = 0
    for p in spec.parameters:
        if p.path == "training.epochs":
            epochs = max([epochs, *(v for v in probe_values(p) if type(v) is int)])
        if p.float_range is not None:
            widest = 24  # repr of a float
        elif p.int_range is not None:
            widest = max(len(str(p.int_range.min)), len(str(p.int_range.max)))
        else:
            widest = max(len(json.dumps(v)) for v in p.categorical or [""])
        values += len(p.path) + widest + 4  # "path":value,
    per_trial = TRIAL_BYTES + values + epochs * EVALUATION_BYTES
    budget = spec.trial_budget
    if budget * per_trial <= MAX_HISTORY_BYTES:
        return []
    fit = MAX_HISTORY_BYTES // per_trial
    return [(f"spec.maxTrials: {budget} trials of up to {epochs} epochs would record about "
             f"{budget * per_trial // 1024} KiB in the sweep's status (each trial's values and "
             f"an evaluation per epoch), above the {MAX_HISTORY_BYTES // 1024} KiB it may hold; "
             + (f"run at most {fit} trials of {epochs} epochs, or fewer epochs" if fit
                else "train fewer epochs per trial"))]


def all_grid_points(parameters: list[Parameter]) -> list[dict[str, Any]]:
    """Every combination of a grid, in order (first parameter slowest)."""
    values = [finite_values(p) or [] for p in parameters]
    return [dict(zip([p.path for p in parameters], combo, strict=True))
            for combo in itertools.product(*values)]


def is_sweep(doc: Any) -> bool:
    """Whether a decoded document says it is a TrainingSweep (by kind)."""
    return isinstance(doc, dict) and doc.get("kind") == SWEEP_KIND


__all__ = [
    "Algorithm", "AlgorithmSpec", "BestTrial", "EarlyStoppingName", "EarlyStoppingSpec",
    "FloatRange", "Goal", "IntRange", "Objective", "Parameter", "PrunedAt", "Scalar",
    "SweepCondition", "SweepConditionType", "SweepPhase", "SweepWarmStart", "TrainingSweep",
    "TrainingSweepSpec", "TrainingSweepStatus", "Trial", "TrialCounts", "TrialState",
]

"""The placement MILP: time-indexed, count-based; build the model, solve it, decode it.

Saturn (VLDB'24, section 3) picks parallelism, GPU count, node and start time jointly with a
continuous-time big-M model (M = 1e10, one start variable per GPU); it does not scale past a
few dozen jobs and its LP bound is the area bound. Kiln instead discretises time into slots
and counts GPUs per node, which Kubernetes needs (the device plugin picks GPU ids). The
heuristic plan comes first (`heuristic.schedule`): its makespan H sets the horizon, it is the
warm start, and it is the fallback.

Formulation (times relative to `now`, in slots of `slot_seconds` = 1.2 H / T):
  Sets      JOBS (queued jobs), NODES, SLOTS = 0..T-1, CHOICES = (job, config, node, slot)
            tuples where the config fits the node and the job runs between its release slot
            and T (built in Python: only meaningful tuples are indexed).
  Params    gpus[c] (devices), duration_slots[c] = ceil(seconds / slot_seconds),
            capacity_gpus[n, t] = node GPUs minus those reserved by running or frozen jobs
            anywhere in slot t, reserved_area[n] (GPU-slots already held on n).
  Variables x[c] in {0, 1} (choice c is taken); makespan >= 0, integer, in slots.
  each_job_once           every job takes exactly one choice.
  gpus_within_capacity    per node and slot, GPUs of choices running then <= capacity_gpus.
  makespan_after_end      makespan >= every job's end slot.
  area_cut, node_area_cut all GPUs (each node's GPUs) times makespan >= GPU-slots used.
  identical_jobs_ordered  of identical jobs (learning-rate copies), the earlier-listed one
                          starts no later (symmetry breaking).
  identical_nodes_by_load of identical, unreserved nodes, the earlier one carries no less
                          GPU-area (symmetry breaking).
  Objective: minimise makespan + eps * sum of end slots, eps = 0.1 / (|JOBS| T + 1), so the
  second term (< 0.1) pulls work left without ever trading a slot of makespan, and an
  absolute gap of 0.85 proves the makespan optimal.
Big-M never appears; the makespan lower bound (heuristic.lower_bound) bounds the variable.
Decode: jobs in (start slot, name) order, list-scheduled on their chosen node and config with
true durations (earliest fit); each start is at most its slot time, so the decoded makespan is
at most now + slot_seconds * makespan.

`build_problem` computes the sets and parameters in Python, `build_model` the Pyomo model,
`solve` runs HiGHS, `decode` turns the chosen tuples into a plan; `run` does all four.
Callers: `worker` (in a separate process) and tests. Non-goals: no process management (see
`worker`), no choice between MILP and heuristic (see `planner`).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
from collections.abc import Mapping
from typing import Any

import pyomo.environ as pyo
from pyomo.contrib.appsi.base import TerminationCondition
from pyomo.contrib.appsi.solvers import highs

from kiln.placement import heuristic, types

log = logging.getLogger(__name__)
DECODE_SHARE = 0.15  # of the time budget, kept for decoding, polishing and the reply
HORIZON_FACTOR = 1.2  # H' = 1.2 H: room for slot rounding (1.1-1.3 works)


# The model's data on the slot grid, built in Python (sparse: only meaningful choices) ----
Choice = tuple[str, int, str, int]  # (job, index into options[job], node, start slot)


@dataclasses.dataclass
class SlotProblem:
    """The model's sets and parameters, built in Python (sparse: only meaningful choices)."""

    problem: heuristic.Problem
    slot_seconds: float
    slots: int
    choices: list[Choice]
    gpus: list[int]
    duration_slots: list[int]
    choices_of: dict[str, list[int]]
    holding: dict[tuple[str, int], list[int]]
    capacity_gpus: dict[tuple[str, int], int]
    reserved_area: dict[str, int]
    lower_bound_slots: int
    identical_jobs: list[tuple[str, str]]
    identical_nodes: list[tuple[str, str]]
    warm: dict[str, int] | None  # job -> choice index of the warm start


def _slot_capacity(problem: heuristic.Problem, slot_seconds: float, slots: int
                   ) -> dict[tuple[str, int], int]:
    """Per (node, slot): GPUs minus reservations overlapping the slot (conservative)."""
    cap = {(n.name, t): n.gpus for n in problem.nodes for t in range(slots)}
    for r in problem.reservations:
        first = max(0, math.floor((r.start - problem.now) / slot_seconds))
        last = min(slots, math.ceil((r.end - problem.now) / slot_seconds - 1e-9))
        for t in range(first, last):
            cap[r.node, t] -= r.gpus
    return cap


def _warm_slots(problem: heuristic.Problem, warm: types.Plan, slot_seconds: float,
                slots: int, cap: Mapping[tuple[str, int], int]
                ) -> tuple[dict[str, tuple[int, str, int]], int]:
    """The warm plan on the slot grid: per job (option index, node, slot), and its end slot.

    Jobs keep the warm plan's node and config and its start order, each at its earliest
    slot that fits; the end may exceed `slots` (the caller then widens the slots).
    """
    used = {key: 0 for key in cap}
    out: dict[str, tuple[int, str, int]] = {}
    end = 0
    planned = {a.job: a for a in warm.assignments}
    type_of = {n.name: n.device_type for n in problem.nodes}
    for job in sorted(problem.jobs, key=lambda j: (planned[j.name].start, j.name)):
        a = planned[job.name]
        idx = next((i for i, c in enumerate(problem.options[job.name])
                    if c.gpus == a.gpus and c.parallelism == a.parallelism
                    and c.device_type in ("", type_of.get(a.node, ""))), None)
        if idx is None:
            raise ValueError(f"warm plan: job {job.name} uses a config not among its options")
        p = math.ceil(a.seconds / slot_seconds - 1e-9)
        t = math.ceil((problem.release[job.name] - problem.now) / slot_seconds - 1e-9)
        while any(used.get((a.node, s), 0) + a.gpus > cap.get((a.node, s), a.gpus)
                  for s in range(t, t + p)):
            t += 1
        for s in range(t, t + p):
            if (a.node, s) in used:
                used[a.node, s] += a.gpus
        out[job.name] = (idx, a.node, t)
        end = max(end, t + p)
    return out, end


def build_problem(problem: heuristic.Problem, warm: types.Plan, settings: types.Settings
                  ) -> SlotProblem:
    """Slot length, horizon, choices, capacities, symmetry pairs and warm start.

    The slot length starts at 1.2 H / T (H: the warm plan's remaining makespan) or
    `settings.slot_seconds`; if the warm plan rounded to slots does not fit the horizon, the
    slots grow (fixed length) or the length grows, so the warm start is always feasible.
    """
    horizon = max(warm.makespan - problem.now, 1e-9)
    slots = settings.slots
    slot_seconds = settings.slot_seconds or HORIZON_FACTOR * horizon / slots
    if settings.slot_seconds:
        slots = max(1, math.ceil(HORIZON_FACTOR * horizon / slot_seconds))
    for _ in range(8):
        cap = _slot_capacity(problem, slot_seconds, slots)
        placed, end = _warm_slots(problem, warm, slot_seconds, slots, cap)
        if end <= slots:
            break
        if settings.slot_seconds:
            slots = end
        else:
            slot_seconds *= end / slots * 1.01
    else:
        raise RuntimeError("warm start does not fit the slot horizon")  # cannot happen
    choices: list[Choice] = []
    choices_of: dict[str, list[int]] = {j.name: [] for j in problem.jobs}
    holding: dict[tuple[str, int], list[int]] = {}
    gpus, duration = [], []
    warm_index: dict[str, int] = {}
    for job in problem.jobs:
        release = math.ceil((problem.release[job.name] - problem.now) / slot_seconds - 1e-9)
        for idx, config in enumerate(problem.options[job.name]):
            p = max(1, math.ceil(config.seconds / slot_seconds - 1e-9))
            for node in problem.nodes:
                if not types.fits(config, node):
                    continue
                for t in range(release, slots - p + 1):
                    if any(cap[node.name, s] < config.gpus for s in range(t, t + p)):
                        continue
                    if placed[job.name] == (idx, node.name, t):
                        warm_index[job.name] = len(choices)
                    choices_of[job.name].append(len(choices))
                    for s in range(t, t + p):
                        holding.setdefault((node.name, s), []).append(len(choices))
                    choices.append((job.name, idx, node.name, t))
                    gpus.append(config.gpus)
                    duration.append(p)
    full = {n.name: n.gpus for n in problem.nodes}
    reserved = {n.name: sum(full[n.name] - cap[n.name, t] for t in range(slots))
                for n in problem.nodes}
    bound = max(0, math.ceil((heuristic.lower_bound(problem) - problem.now) / slot_seconds
                             - 1e-6))
    sp = SlotProblem(problem, slot_seconds, slots, choices, gpus, duration, choices_of,
                     holding, cap, reserved, bound, _identical_jobs(problem),
                     _identical_nodes(problem, cap, slots), None)
    sp.warm = _symmetric_warm(sp, warm_index)
    return sp


def _identical_jobs(problem: heuristic.Problem) -> list[tuple[str, str]]:
    """Consecutive pairs of jobs with the same options and release (e.g. lr copies)."""
    groups: dict[tuple[object, ...], list[str]] = {}
    for job in problem.jobs:
        key = (problem.options[job.name], problem.release[job.name])
        groups.setdefault(key, []).append(job.name)
    return [(a, b) for names in groups.values() for a, b in itertools.pairwise(names)]


def _identical_nodes(problem: heuristic.Problem, cap: Mapping[tuple[str, int], int],
                     slots: int) -> list[tuple[str, str]]:
    """Consecutive pairs of nodes with equal GPUs, of one GPU type, nothing reserved, and
    allowed to the same jobs (`types.Config.nodes`)."""
    groups: dict[tuple[int, str, frozenset[str]], list[str]] = {}
    for n in problem.nodes:
        if all(cap[n.name, t] == n.gpus for t in range(slots)):
            barred = frozenset(j for j, options in problem.options.items()
                               if any(c.nodes is not None and n.name not in c.nodes
                                      for c in options))
            groups.setdefault((n.gpus, n.device_type, barred), []).append(n.name)
    return [(a, b) for names in groups.values() for a, b in itertools.pairwise(names)]


def _symmetric_warm(sp: SlotProblem, warm: dict[str, int]) -> dict[str, int] | None:
    """The warm start relabelled to satisfy the symmetry-breaking rows (or None)."""
    if set(warm) != set(sp.choices_of):
        return None
    assigned = {job: sp.choices[c] for job, c in warm.items()}
    for group in _chains(sp.identical_nodes):  # heaviest node first
        load = {n: 0 for n in group}
        for job, (j, idx, node, t) in assigned.items():
            if node in load:
                load[node] += sp.problem.options[j][idx].gpus * sp.duration_slots[warm[job]]
        relabel = dict(zip(sorted(group, key=lambda n: -load[n]), group, strict=True))
        assigned = {job: (j, i, relabel.get(n, n), t) for job, (j, i, n, t) in assigned.items()}
    for group in _chains(sp.identical_jobs):  # earliest start to the earliest-listed job
        tuples = sorted((assigned[j] for j in group), key=lambda c: c[3])
        for job, (_, idx, node, t) in zip(group, tuples, strict=True):
            assigned[job] = (job, idx, node, t)
    index = {c: i for i, c in enumerate(sp.choices)}
    out = {job: index.get(choice) for job, choice in assigned.items()}
    return None if None in out.values() else {j: i for j, i in out.items() if i is not None}


def _chains(pairs: list[tuple[str, str]]) -> list[list[str]]:
    """Consecutive pairs back to ordered groups."""
    groups: list[list[str]] = []
    for a, b in pairs:
        if groups and groups[-1][-1] == a:
            groups[-1].append(b)
        else:
            groups.append([a, b])
    return groups


# The model: build, solve, decode ------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SolveOutcome:
    """How a solve ended: status is optimal | feasible | infeasible | no-solution | error."""

    status: str
    termination: str
    objective: float | None = None
    bound: float | None = None
    gap: float | None = None
    build_seconds: float = 0.0
    solve_seconds: float = 0.0
    binaries: int = 0
    rows: int = 0
    message: str = ""

    @property
    def has_solution(self) -> bool:
        return self.status in ("optimal", "feasible")


def build_model(sp: SlotProblem) -> pyo.ConcreteModel:
    """The Pyomo model of the formulation in the module docstring (pure)."""
    m = pyo.ConcreteModel(name="kiln-placement-model-a")
    m.CHOICES = pyo.RangeSet(0, len(sp.choices) - 1)
    m.JOBS = pyo.Set(initialize=list(sp.choices_of), ordered=True)
    m.NODES = pyo.Set(initialize=[n.name for n in sp.problem.nodes], ordered=True)
    m.x = pyo.Var(m.CHOICES, within=pyo.Binary)
    m.makespan = pyo.Var(within=pyo.NonNegativeIntegers,
                         bounds=(min(sp.lower_bound_slots, sp.slots), sp.slots))
    m.end = pyo.Expression(m.JOBS, rule=lambda m, j: pyo.quicksum(
        (sp.choices[c][3] + sp.duration_slots[c]) * m.x[c] for c in sp.choices_of[j]))
    m.each_job_once = pyo.Constraint(m.JOBS, rule=lambda m, j: pyo.quicksum(
        m.x[c] for c in sp.choices_of[j]) == 1)

    def gpus_within_capacity(m: pyo.ConcreteModel, node: str, t: int) -> object:
        held = sp.holding.get((node, t), [])
        if not held or sum(sp.gpus[c] for c in held) <= sp.capacity_gpus[node, t]:
            return pyo.Constraint.Skip  # cannot bind
        return pyo.quicksum(sp.gpus[c] * m.x[c] for c in held) <= sp.capacity_gpus[node, t]

    m.gpus_within_capacity = pyo.Constraint(m.NODES, pyo.RangeSet(0, sp.slots - 1),
                                            rule=gpus_within_capacity)
    m.makespan_after_end = pyo.Constraint(m.JOBS, rule=lambda m, j: m.makespan >= m.end[j])
    area = {n: pyo.quicksum(sp.gpus[c] * sp.duration_slots[c] * m.x[c]
                            for c in range(len(sp.choices)) if sp.choices[c][2] == n)
            for n in m.NODES}
    total = sum(n.gpus for n in sp.problem.nodes)
    m.area_cut = pyo.Constraint(expr=total * m.makespan >= sum(sp.reserved_area.values())
                                + pyo.quicksum(area.values()))
    gpus_of = {n.name: n.gpus for n in sp.problem.nodes}
    m.node_area_cut = pyo.Constraint(m.NODES, rule=lambda m, n: gpus_of[n] * m.makespan
                                     >= sp.reserved_area[n] + area[n])

    def start(j: str) -> Any:
        return pyo.quicksum(sp.choices[c][3] * m.x[c] for c in sp.choices_of[j])

    m.identical_jobs_ordered = pyo.Constraint(
        range(len(sp.identical_jobs)),
        rule=lambda m, i: start(sp.identical_jobs[i][0]) <= start(sp.identical_jobs[i][1]))
    m.identical_nodes_by_load = pyo.Constraint(
        range(len(sp.identical_nodes)),
        rule=lambda m, i: area[sp.identical_nodes[i][0]] >= area[sp.identical_nodes[i][1]])
    eps = 0.1 / (len(sp.choices_of) * sp.slots + 1)
    m.objective = pyo.Objective(expr=m.makespan + eps * pyo.quicksum(m.end.values()),
                                sense=pyo.minimize)
    return m


def solve(m: pyo.ConcreteModel, sp: SlotProblem, settings: types.Settings, *,
          time_limit_seconds: float) -> SolveOutcome:
    """HiGHS through Pyomo's appsi interface (what `SolverFactory('appsi_highs')` wraps).

    Warm-starts from `sp.warm` (HiGHS setSolution), fixed seed, `settings.threads`,
    `settings.mip_rel_gap`, an absolute gap under one slot (the makespan is integral).
    `time_limit_seconds` covers loading the model into HiGHS too. Presolve is off: on these
    models HiGHS's probing ran for many times the time limit without checking it (measured
    on 12 jobs x 1 node: 9 s of probing under a 1 s limit). Never assumes optimality: the
    termination condition is classified.
    """
    began = time.perf_counter()
    if sp.warm is not None:
        chosen = set(sp.warm.values())
        for c in m.CHOICES:
            m.x[c].set_value(1 if c in chosen else 0)
        m.makespan.set_value(max(sp.choices[c][3] + sp.duration_slots[c] for c in chosen))
    solver = highs.Highs()
    for key in solver.update_config:  # the model is loaded once, below: no change checks
        if key != "treat_fixed_vars_as_params":
            setattr(solver.update_config, key, False)
    try:
        solver.set_instance(m)
        left = time_limit_seconds - (time.perf_counter() - began)
        if left <= 0:
            return SolveOutcome("no-solution", "loadTime", solve_seconds=time.perf_counter()
                                - began, binaries=len(sp.choices),
                                message=f"loading the model into HiGHS took more than "
                                        f"{time_limit_seconds:.1f} s")
        solver.config.time_limit = max(0.1, left)
        solver.config.mip_gap = settings.mip_rel_gap
        solver.config.warmstart = sp.warm is not None
        solver.config.load_solution = False
        solver.highs_options = {"random_seed": settings.seed, "threads": settings.threads,
                                "mip_abs_gap": 0.85, "presolve": "off",
                                "mip_heuristic_effort": 0.25, "output_flag": False}
        result = solver.solve(m)
    except RuntimeError as err:  # HiGHS/appsi failures surface as RuntimeError
        return SolveOutcome("error", "error", solve_seconds=time.perf_counter() - began,
                            message=f"{type(err).__name__}: {err}")
    seconds = time.perf_counter() - began
    term = result.termination_condition
    feasible = result.best_feasible_objective is not None
    if term == TerminationCondition.optimal:
        status = "optimal"
    elif term == TerminationCondition.infeasible:
        status = "infeasible"
    elif feasible and term in (TerminationCondition.maxTimeLimit,
                               TerminationCondition.maxIterations,
                               TerminationCondition.objectiveLimit):
        status = "feasible"
    elif term == TerminationCondition.maxTimeLimit:
        status = "no-solution"
    else:
        status = "error"
    if feasible:
        result.solution_loader.load_vars()
    obj, bound = result.best_feasible_objective, result.best_objective_bound
    gap = (None if obj is None or bound is None or obj == 0 or not math.isfinite(bound)
           else max(0.0, (obj - bound) / abs(obj)))
    return SolveOutcome(status, str(term.name), obj, bound, gap, solve_seconds=seconds,
                        binaries=len(sp.choices), rows=m.nconstraints())


def decode(m: pyo.ConcreteModel, sp: SlotProblem) -> types.Plan:
    """List-schedule the chosen (node, config) per job in slot order with true durations.

    Also re-times the chosen configs with `heuristic.polish` (other list orders, free nodes,
    one-job config changes) and returns the better; `reason` says which ("slot order" or
    "polished: ..."). The slot-order plan alone ends by now + slot_seconds * makespan.
    """
    picked: dict[str, Choice] = {}
    for c in m.CHOICES:
        if (m.x[c].value or 0.0) > 0.5:
            picked[sp.choices[c][0]] = sp.choices[c]
    missing = set(sp.choices_of) - set(picked)
    if missing:
        raise ValueError(f"MILP solution places no choice for {sorted(missing)}")
    problem = sp.problem
    choice = {j: problem.options[j][idx] for j, (_, idx, _, _) in picked.items()}
    order = sorted(picked, key=lambda j: (picked[j][3], j))
    assignments = heuristic.list_schedule(problem, choice, order,
                                          node_of={j: picked[j][2] for j in picked})
    decoded = types.Plan(tuple(sorted(assignments, key=lambda a: (a.start, a.job))),
                         heuristic.makespan_of(problem, assignments), "milp",
                         "slot order", lower_bound=heuristic.lower_bound(problem),
                         objective=problem.objective, cost=heuristic.cost(problem, assignments))
    polished = heuristic.polish(problem, choice)
    if (polished.makespan, sum(a.end for a in polished.assignments)) < (
            decoded.makespan, sum(a.end for a in decoded.assignments)):
        return dataclasses.replace(polished, solver="milp")
    return decoded


def run(problem: heuristic.Problem, warm: types.Plan, settings: types.Settings, *,
        time_limit_seconds: float | None = None) -> tuple[types.Plan | None, SolveOutcome]:
    """Build, solve and decode within a time limit (model build and decode included).

    Args:
        problem: the normalised snapshot.
        warm: the heuristic plan.
        settings: solver settings.
        time_limit_seconds: wall budget from now (default `settings.time_limit_seconds`);
            DECODE_SHARE of it is kept for decoding.

    Returns:
        (decoded plan or None when no solution, outcome). `plan.reason` summarises the
        outcome.
    """
    began = time.perf_counter()
    budget = settings.time_limit_seconds if time_limit_seconds is None else time_limit_seconds
    sp = build_problem(problem, warm, settings)
    m = build_model(sp)
    built = time.perf_counter() - began
    left = budget * (1.0 - DECODE_SHARE) - built
    if left <= 0:
        return None, SolveOutcome("no-solution", "buildTime", build_seconds=built,
                                  binaries=len(sp.choices),
                                  message=f"model build took {built:.1f} s of a "
                                          f"{budget:.1f} s budget")
    outcome = dataclasses.replace(solve(m, sp, settings, time_limit_seconds=left),
                                  build_seconds=built)
    if not outcome.has_solution:
        return None, outcome
    decoded = decode(m, sp)
    gap = "n/a" if outcome.gap is None else f"{outcome.gap:.3f}"
    reason = (f"milp: {outcome.status} ({outcome.termination}), gap {gap}, "
              f"{outcome.binaries} binaries, {sp.slots} slots of {sp.slot_seconds:.1f} s, "
              f"slot makespan {m.makespan.value * sp.slot_seconds:.1f} s, decoded by "
              f"{decoded.reason}")
    return dataclasses.replace(decoded, reason=reason), outcome

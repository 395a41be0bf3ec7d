"""The placement MILP: time-indexed, count-based (research digest section 7.2, "Model A").

Saturn (VLDB'24, section 3 of the digest) picks parallelism, GPU count, node and start
time jointly with a continuous-time big-M model (M = 1e10, one start variable per GPU); it
does not scale past a few dozen jobs and its LP bound is the area bound. Kiln instead
discretises time into slots and counts GPUs per node, which Kubernetes needs (the device
plugin picks GPU ids). The heuristic plan comes first (`heuristic.schedule`): its makespan H
sets the horizon, it is the warm start, and it is the fallback.

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
at most now + slot_seconds * makespan (digest 7.2).

The sets and parameters are computed in `slotgrid` (`build_problem`, re-exported here); this
module builds the Pyomo model from them, solves it and decodes the solution.

Callers: `worker` (in a separate process) and tests. Non-goals: no process management (see
`worker`), no choice between MILP and heuristic (see `plan`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any

import pyomo.environ as pyo
from pyomo.contrib.appsi.base import TerminationCondition
from pyomo.contrib.appsi.solvers import highs

from kiln.placement import heuristic, slotgrid, types

log = logging.getLogger(__name__)
DECODE_SHARE = 0.15  # of the time budget, kept for decoding, polishing and the reply

# Re-exports: the slot-grid data the model is built from (kiln.placement.slotgrid).
HORIZON_FACTOR = slotgrid.HORIZON_FACTOR
Choice = slotgrid.Choice
SlotProblem = slotgrid.SlotProblem
build_problem = slotgrid.build_problem


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
                         "slot order", lower_bound=heuristic.lower_bound(problem))
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

"""The planner: the best plan for a snapshot (`plan`) and online re-planning (`replan`, `extend`).

Plans depend on `Snapshot.now`, never on the wall clock (which only bounds the solver's time).
Never imports Kubernetes or torch.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from kiln.placement import heuristic, types, worker

log = logging.getLogger(__name__)

DEFAULT_SETTINGS = types.Settings()
MIN_MILP_SECONDS = 0.5  # less budget than this left after the heuristic: no MILP worker


def plan(snapshot: types.Snapshot, settings: types.Settings = DEFAULT_SETTINGS) -> types.Plan:
    """The best plan found for a snapshot: heuristic, then the MILP if it does better.

    The MILP runs in a watchdogged worker (`worker.solve`) unless it is off, there are more
    than `milp_max_jobs` jobs, or the heuristic already meets the lower bound;
    `settings.time_limit_seconds` is the wall budget of the whole call. `Plan.solver` says
    which plan won and `Plan.reason` why, including every fallback (timeout, crash,
    infeasible, no solution).

    Args:
        snapshot: nodes, queued jobs with their configs, running jobs (pinned).
        settings: solver and heuristic settings.

    Returns:
        A plan placing every queued job; `solver` is "heuristic" or "milp".

    Raises:
        types.Unplaceable: a queued job has no config that fits any node (names every such
            job).
        ValueError: duplicate job or node names, a running job on an unknown node.
    """
    began = time.perf_counter()
    best = _best(heuristic.problem_of(snapshot), settings, began)
    return dataclasses.replace(best, solve_seconds=time.perf_counter() - began)


def _best(problem: heuristic.Problem, settings: types.Settings, began: float) -> types.Plan:
    """Heuristic first; the MILP in a worker when it may help; the better plan.

    `settings.time_limit_seconds` is the wall budget of the whole call, counted from
    `began` (perf_counter): the MILP worker gets what the heuristic left.
    """
    h = heuristic.schedule(problem, settings)
    skip = None
    if not settings.use_milp:
        skip = "MILP off"
    elif not problem.jobs:
        skip = "nothing to place"
    elif len(problem.jobs) > settings.milp_max_jobs:
        skip = (f"MILP skipped: {len(problem.jobs)} jobs > milp_max_jobs "
                f"{settings.milp_max_jobs} (the heuristic is near the area bound there)")
    elif h.makespan <= h.lower_bound + 1e-9 * max(1.0, abs(h.lower_bound)):
        skip = "MILP skipped: the heuristic meets the lower bound"
    left = settings.time_limit_seconds - (time.perf_counter() - began)
    if skip is None and left < MIN_MILP_SECONDS:
        skip = (f"MILP skipped: {max(left, 0.0):.2f} s of the {settings.time_limit_seconds:g} s "
                f"budget left after the heuristic")
    if skip is not None:
        return dataclasses.replace(h, reason=f"{h.reason}; {skip}")
    decoded, why, _outcome = worker.solve(problem, h, settings, budget_seconds=left)
    if decoded is not None and _score(decoded) < _score(h):
        return dataclasses.replace(decoded, reason=(
            f"{why}; decoded makespan {decoded.makespan - problem.now:.1f} s beats the "
            f"heuristic's {h.makespan - problem.now:.1f} s"))
    if decoded is None:
        log.warning("placement falls back to the heuristic plan: %s", why)
        return dataclasses.replace(h, reason=f"{h.reason}; fallback: {why}")
    return dataclasses.replace(h, reason=(
        f"{h.reason}; kept over the MILP ({why}): decoded makespan "
        f"{decoded.makespan - problem.now:.1f} s >= {h.makespan - problem.now:.1f} s"))


def _score(p: types.Plan) -> tuple[float, float]:
    """(makespan, sum of ends), rounded so float noise never decides."""
    return round(p.makespan, 6), round(sum(a.end for a in p.assignments), 6)


def replan(current: types.Plan | None, snapshot: types.Snapshot,
           settings: types.Settings = DEFAULT_SETTINGS) -> types.Plan:
    """Online re-planning: keep the current plan unless clearly beaten.

    Saturn (VLDB'24) swaps plans at each interval with a hysteresis threshold but supports
    neither arrivals nor measured progress. Here running jobs are pinned for their measured
    remaining time (`Snapshot.running`), assignments starting within the freeze window keep
    their node, config and start (their pods are being created), and new jobs are added.

    The current plan is first brought up to date (`extend`: finished and started jobs
    dropped, frozen assignments kept, the rest re-timed in their order with current
    estimates, new jobs inserted). A fresh plan (`plan`, with the same frozen assignments)
    replaces it only when its remaining makespan (makespan - now) is shorter by the fraction
    `settings.replan_threshold`.

    Args:
        current: the plan in force, or None (then this is `plan`).
        snapshot: the cluster now.
        settings: as for `plan`, plus `replan_threshold` and `freeze_window_seconds`.

    Returns:
        The kept plan (`kept_current` True, its producer's `solver`) or the fresh one;
        `reason` gives both remaining makespans.

    Raises:
        types.Unplaceable: a queued job has no config that fits any node.
        ValueError: as for `plan`.
    """
    if current is None:
        return plan(snapshot, settings)
    began = time.perf_counter()
    problem, kept = _kept(current, snapshot, settings)
    fresh = _best(problem, settings, began)
    now = snapshot.now
    kept_left, fresh_left = kept.makespan - now, fresh.makespan - now
    elapsed = time.perf_counter() - began
    if fresh_left < (1.0 - settings.replan_threshold) * kept_left:
        return dataclasses.replace(fresh, solve_seconds=elapsed, reason=(
            f"replaced: remaining makespan {fresh_left:.1f} s < {kept_left:.1f} s by more "
            f"than {settings.replan_threshold:.0%}; {fresh.reason}"))
    return dataclasses.replace(kept, solve_seconds=elapsed, reason=(
        f"kept current plan: new remaining makespan {fresh_left:.1f} s vs {kept_left:.1f} s "
        f"(threshold {settings.replan_threshold:.0%})"))


def extend(current: types.Plan | None, snapshot: types.Snapshot,
           settings: types.Settings = DEFAULT_SETTINGS) -> types.Plan:
    """The current plan brought up to date, without re-optimising it.

    Jobs no longer queued are dropped; frozen assignments keep their slot; the other kept
    jobs keep node and config (current estimates) and are re-timed in their planned order;
    new jobs get the heuristic's config ("area" unless `k_policy` is "knee") and the node
    where they finish earliest, longest first. `current` None means plan from scratch.

    Raises:
        types.Unplaceable: a queued job has no config that fits any node.
        ValueError: as for `plan`.
    """
    if current is None:
        return plan(snapshot, settings)
    began = time.perf_counter()
    _, kept = _kept(current, snapshot, settings)
    return dataclasses.replace(kept, solve_seconds=time.perf_counter() - began,
                               reason="extended current plan")


def _same_config(job: types.JobRequest, a: types.Assignment) -> types.Config | None:
    """The job's current estimate for the assignment's (parallelism, gpus), if any."""
    return next((c for c in sorted(job.configs, key=lambda c: c.seconds)
                 if c.gpus == a.gpus and c.parallelism == a.parallelism
                 and c.seconds != float("inf")), None)



def _kept(current: types.Plan, snapshot: types.Snapshot, settings: types.Settings
          ) -> tuple[heuristic.Problem, types.Plan]:
    """The problem of `snapshot` with `current`'s frozen starts fixed, and `current` re-timed
    on it (what `replan` compares against and `extend` returns)."""
    problem = heuristic.problem_of(snapshot, fixed=_frozen(current, snapshot, settings))
    return problem, _retimed(current, problem, settings)

def _frozen(current: types.Plan, snapshot: types.Snapshot,
            settings: types.Settings) -> list[types.Assignment]:
    """Still-queued assignments starting by now + freeze window, on their node and config.

    Each keeps its start unless its GPUs are still held then (a running job overran): then
    it starts at the earliest time they are free. An assignment whose node or config no
    longer exists is not frozen (it is re-planned).
    """
    queued = {j.name: j for j in snapshot.queued}
    nodes = {n.name: n for n in snapshot.nodes}
    base = heuristic.problem_of(dataclasses.replace(snapshot, queued=()))
    lines = heuristic.timelines(base)
    out = []
    horizon = snapshot.now + settings.freeze_window_seconds
    for a in sorted(current.assignments, key=lambda a: (a.start, a.job)):
        job = queued.get(a.job)
        if job is None or a.start > horizon or a.node not in nodes:
            continue
        config = _same_config(job, a)
        if config is None or config.gpus > nodes[a.node].gpus:
            continue
        release = max(a.start, snapshot.now, job.arrival)
        start = lines[a.node].earliest(config.gpus, config.seconds, release)
        lines[a.node].add(start, start + config.seconds, config.gpus)
        out.append(dataclasses.replace(a, start=start, seconds=config.seconds))
    return out


def _retimed(current: types.Plan, problem: heuristic.Problem,
             settings: types.Settings) -> types.Plan:
    """`current` on `problem`: kept jobs in planned order on their node, new jobs appended."""
    planned = {a.job: a for a in current.assignments}
    gpus_of = {n.name: n.gpus for n in problem.nodes}
    choice: dict[str, types.Config] = {}
    node_of: dict[str, str] = {}
    kept, new = [], []
    for job in problem.jobs:
        a = planned.get(job.name)
        config = None if a is None else _same_config(job, a)
        if a is not None and config is not None and config.gpus <= gpus_of.get(a.node, 0):
            choice[job.name], node_of[job.name] = config, a.node
            kept.append(job.name)
        else:
            policy = settings.k_policy if settings.k_policy == "knee" else "area"
            choice[job.name] = heuristic.choose_k(problem.options[job.name], policy,
                                                  knee_efficiency=settings.knee_efficiency)
            new.append(job.name)
    order = sorted(kept, key=lambda j: (planned[j].start, j))
    order += sorted(new, key=lambda j: (-choice[j].seconds, j))
    assignments = heuristic.list_schedule(problem, choice, order, node_of=node_of)
    return types.Plan(tuple(sorted(assignments, key=lambda a: (a.start, a.job))),
                      heuristic.makespan_of(problem, assignments), current.solver,
                      lower_bound=heuristic.lower_bound(problem), kept_current=True)

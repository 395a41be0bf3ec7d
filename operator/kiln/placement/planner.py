"""The planner: the best plan for a snapshot (`plan`) and online re-planning (`replan`, `extend`).

It picks the objective (`objective_of`: makespan for a sweep, weighted completion time for
arrivals) and whether the MILP may help. Plans depend on `Snapshot.now`, never on the wall
clock (which only bounds the solver's time). Never imports Kubernetes or torch.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence

from kiln.placement import heuristic, types, worker

log = logging.getLogger(__name__)

DEFAULT_SETTINGS = types.Settings()
MIN_MILP_SECONDS = 0.5  # less budget than this left after the heuristic: no MILP worker


def objective_of(snapshot: types.Snapshot, settings: types.Settings,
                 current: types.Plan | None = None) -> str:
    """The objective to plan `snapshot` for: "makespan" or "completion-time".

    An explicit `settings.objective` wins. Under "auto" a sweep (a model-selection batch,
    judged on when its last job ends) is planned for makespan: every queued job in one
    non-empty `JobRequest.group`; or, with no groups, at least `settings.sweep_min_jobs`
    jobs that arrived within `settings.sweep_window_seconds` of each other, while nothing
    runs or the plan in force is already a makespan plan (the same sweep, part started).
    Anything else is a stream of arrivals in a shared cluster: completion time.
    """
    if settings.objective != "auto":
        return settings.objective
    groups = {j.group for j in snapshot.queued}
    if groups and "" not in groups:
        return "makespan" if len(groups) == 1 else "completion-time"
    if groups != {""} or len(snapshot.queued) < settings.sweep_min_jobs:
        return "completion-time"
    arrivals = [j.arrival for j in snapshot.queued]
    if max(arrivals) - min(arrivals) > settings.sweep_window_seconds:
        return "completion-time"
    if snapshot.running and (current is None or current.objective != "makespan"):
        return "completion-time"
    return "makespan"


def plan(snapshot: types.Snapshot, settings: types.Settings = DEFAULT_SETTINGS) -> types.Plan:
    """The best plan found for a snapshot: heuristic, then the MILP if it does better.

    The objective is `objective_of(snapshot, settings)`. The MILP (makespan only) runs in a
    watchdogged worker (`worker.solve`) unless it is off, the objective is completion time,
    there are more than `milp_max_jobs` jobs, a namespace quota applies, or the heuristic
    already meets the lower bound; `settings.time_limit_seconds` is the wall budget of the
    whole call. `Plan.solver` says which plan won, `Plan.milp` how the MILP fared and
    `Plan.reason` why, including every fallback (timeout, crash, infeasible, no solution).

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
    problem = heuristic.problem_of(snapshot, objective=objective_of(snapshot, settings),
                                   settings=settings)
    best = _best(problem, settings, began)
    return dataclasses.replace(best, solve_seconds=time.perf_counter() - began)


def _best(problem: heuristic.Problem, settings: types.Settings, began: float, *,
          kicks: bool = True) -> types.Plan:
    """Heuristic first (its iterated search only with `kicks`); the MILP in a worker when it
    may help; the better plan.

    `settings.time_limit_seconds` is the wall budget of the whole call, counted from
    `began` (perf_counter): the MILP worker gets what the heuristic left.
    """
    h = heuristic.schedule(problem, settings, kicks=kicks)
    skip = None
    if not settings.use_milp:
        skip = "MILP off"
    elif not problem.jobs:
        skip = "nothing to place"
    elif problem.objective != "makespan":
        skip = ("MILP skipped: it minimises makespan; weighted completion time is planned by "
                "the heuristic (Smith's rule with a GPU-second price)")
    elif any(c.node_count > 1 for options in problem.options.values() for c in options):
        skip = "MILP skipped: multi-node configs are planned by the heuristic"
    elif any(problem.namespace_of.get(j.name, "") in problem.quota for j in problem.jobs):
        skip = "MILP skipped: namespace GPU quotas apply (the heuristic enforces them)"
    elif len(problem.jobs) > settings.milp_max_jobs:
        skip = (f"MILP skipped: {len(problem.jobs)} jobs > milp_max_jobs "
                f"{settings.milp_max_jobs} (there it rarely beats the heuristic, by little, "
                "at many times the CPU)")
    elif h.makespan <= h.lower_bound + 1e-9 * max(1.0, abs(h.lower_bound)):
        skip = "MILP skipped: the heuristic meets the lower bound"
    left = settings.time_limit_seconds - (time.perf_counter() - began)
    if skip is None and left < MIN_MILP_SECONDS:
        skip = (f"MILP skipped: {max(left, 0.0):.2f} s of the {settings.time_limit_seconds:g} s "
                f"budget left after the heuristic")
    if skip is not None:
        return dataclasses.replace(h, reason=f"{h.reason}; {skip}", milp="skipped")
    decoded, why, _outcome = worker.solve(problem, h, settings, budget_seconds=left)
    if decoded is not None and _score(decoded) < _score(h):
        return dataclasses.replace(decoded, milp="won", reason=(
            f"{why}; decoded makespan {decoded.makespan - problem.now:.1f} s beats the "
            f"heuristic's {h.makespan - problem.now:.1f} s"))
    if decoded is None:
        log.warning("placement falls back to the heuristic plan: %s", why)
        return dataclasses.replace(h, reason=f"{h.reason}; fallback: {why}", milp="failed")
    return dataclasses.replace(h, milp="lost", reason=(
        f"{h.reason}; kept over the MILP ({why}): decoded makespan "
        f"{decoded.makespan - problem.now:.1f} s >= {h.makespan - problem.now:.1f} s"))


def _score(p: types.Plan) -> tuple[float, float]:
    """(makespan, sum of ends), rounded so float noise never decides."""
    return round(p.makespan, 6), round(sum(a.end for a in p.assignments), 6)


def milp_win_fraction(plans: Sequence[types.Plan]) -> float | None:
    """Of the plans whose call ran the MILP (won, lost or failed), the fraction it won;
    None when none ran it."""
    ran = [p for p in plans if p.milp != "skipped"]
    return sum(p.milp == "won" for p in ran) / len(ran) if ran else None


def replan(current: types.Plan | None, snapshot: types.Snapshot,
           settings: types.Settings = DEFAULT_SETTINGS) -> types.Plan:
    """Online re-planning: keep the current plan unless clearly beaten.

    Saturn (VLDB'24) swaps plans at each interval with a hysteresis threshold but supports
    neither arrivals nor measured progress. Here running jobs are pinned for their measured
    remaining time (`Snapshot.running`), under makespan assignments starting within the
    freeze window keep their node, config and start, and new jobs are added.

    The current plan is first brought up to date (`extend`: finished and started jobs
    dropped, frozen assignments kept, the rest re-timed in their order with current
    estimates, new jobs inserted). A fresh plan (`plan`, with the same frozen assignments)
    is planned for `objective_of`. Under completion time the fresh plan is taken and nothing
    is frozen: queued jobs are not pinned to the plan in force. Under makespan both are
    judged on it (`heuristic.cost`): the fresh one replaces the kept one only when its makespan is lower
    by the fraction `settings.replan_threshold`, or when it is no longer and its sum of
    remaining ends is lower by that fraction (a long job that fixes the makespan must not
    freeze the order of everything else).

    Args:
        current: the plan in force, or None (then this is `plan`).
        snapshot: the cluster now.
        settings: as for `plan`, plus `replan_threshold` and `freeze_window_seconds`.

    Returns:
        The kept plan (`kept_current` True, its producer's `solver`) or the fresh one;
        `reason` gives both costs.

    Raises:
        types.Unplaceable: a queued job has no config that fits any node.
        ValueError: as for `plan`.
    """
    if current is None:
        return plan(snapshot, settings)
    began = time.perf_counter()
    problem, kept = _kept(current, snapshot, settings)
    # A new batch (no makespan plan in force) gets the heuristic's iterated search; a re-plan
    # of the batch in force does not: it runs on every event and rarely wins by the threshold.
    fresh = _best(problem, _fresh_settings(problem, current, settings), began,
                  kicks=current.objective != problem.objective)
    elapsed = time.perf_counter() - began
    if problem.objective == "completion-time":
        # Queued jobs are not pinned to the plan in force: re-planning jobs that have not
        # started costs nothing, and a kept plan would tie them to a node's queue. The freeze
        # window still holds the starts whose pods are being created.
        return dataclasses.replace(fresh, solve_seconds=elapsed, reason=(
            f"queued jobs placed afresh (under completion time none is pinned; the plan in "
            f"force would cost {kept.cost:.1f} weighted job-seconds): {fresh.reason}"))
    keep = 1.0 - settings.replan_threshold
    what = "remaining makespan"
    values = fresh.cost, kept.cost
    better = values[0] < keep * values[1]
    if not better and fresh.cost <= kept.cost + 1e-6:
        ends = (sum(a.end - snapshot.now for a in fresh.assignments),
                sum(a.end - snapshot.now for a in kept.assignments))
        if ends[0] < keep * ends[1]:
            better, what, values = True, "sum of remaining ends (same makespan)", ends
    if better:
        return dataclasses.replace(fresh, solve_seconds=elapsed, reason=(
            f"replaced: {what} {values[0]:.1f} s < {values[1]:.1f} s by more than "
            f"{settings.replan_threshold:.0%}; {fresh.reason}"))
    return dataclasses.replace(kept, solve_seconds=elapsed, milp=fresh.milp, reason=(
        f"kept current plan: new {what} {values[0]:.1f} s vs {values[1]:.1f} s "
        f"(threshold {settings.replan_threshold:.0%})"))


def _fresh_settings(problem: heuristic.Problem, current: types.Plan,
                    settings: types.Settings) -> types.Settings:
    """Settings of a re-plan's fresh plan: "best" becomes "area" when a sweep grew.

    Under makespan, jobs of a named sweep (`JobRequest.group`) that the plan in force does
    not hold mean the sweep is submitted in parts, and more may follow. Minimising the known
    jobs' makespan then buys speed-up with GPU-seconds the next part needs; minimum-area
    configs leave it the most (on sweeps arriving in waves "best" lost to fixed-k FIFO).
    """
    planned = {a.job for a in current.assignments}
    if (problem.objective != "makespan" or settings.k_policy != "best"
            or not any(j.group and j.name not in planned for j in problem.jobs)):
        return settings
    return dataclasses.replace(settings, k_policy="area")


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


def _same_config(job: types.JobRequest, a: types.Assignment,
                 nodes: Mapping[str, types.Node]) -> types.Config | None:
    """The job's current estimate for the assignment's (parallelism, gpus) on its node's GPU
    type, if any (None also when the node is gone or too small)."""
    node = nodes.get(a.node)
    return next((c for c in sorted(job.configs, key=lambda c: c.seconds)
                 if c.gpus == a.gpus and c.parallelism == a.parallelism
                 and c.node_count == len(a.all_nodes)
                 and c.seconds != float("inf") and node is not None and types.fits(c, node)),
                None)



def _kept(current: types.Plan, snapshot: types.Snapshot, settings: types.Settings
          ) -> tuple[heuristic.Problem, types.Plan]:
    """The problem of `snapshot` with `current`'s frozen starts fixed, and `current` re-timed
    on it (what `replan` compares against and `extend` returns)."""
    objective = objective_of(snapshot, settings, current)
    # Under completion time no start is frozen: a queued job has no pods yet, and a slot
    # frozen at the narrow config it waited for would keep it narrow once wider ones are free.
    fixed = _frozen(current, snapshot, settings) if objective == "makespan" else []
    problem = heuristic.problem_of(snapshot, fixed=fixed, objective=objective,
                                   settings=settings)
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
    base = heuristic.problem_of(dataclasses.replace(snapshot, queued=()), settings=settings)
    lines = heuristic.timelines(base)
    out = []
    horizon = snapshot.now + settings.freeze_window_seconds
    for a in sorted(current.assignments, key=lambda a: (a.start, a.job)):
        job = queued.get(a.job)
        if job is None or a.start > horizon or a.node not in nodes or a.peer_nodes:
            continue  # a multi-node assignment is re-planned whole (heuristic._place_gang)
        config = _same_config(job, a, nodes)
        if config is None:
            continue
        release = max(a.start, snapshot.now, job.arrival)
        start = lines[a.node].earliest(config.gpus, config.seconds, release)
        lines[a.node].add(start, start + config.seconds, config.gpus)
        out.append(dataclasses.replace(a, start=start, seconds=config.seconds))
    return out


def _retimed(current: types.Plan, problem: heuristic.Problem,
             settings: types.Settings) -> types.Plan:
    """`current` on `problem`: kept jobs in planned order on their node, new jobs appended
    (longest first under makespan; under completion time by weight per GPU-second, with the
    config their GPU-second price favours)."""
    planned = {a.job: a for a in current.assignments}
    nodes = {n.name: n for n in problem.nodes}
    choice: dict[str, types.Config] = {}
    node_of: dict[str, str] = {}
    kept, new = [], []
    for job in problem.jobs:
        a = planned.get(job.name)
        config = None if a is None else _same_config(job, a, nodes)
        if a is not None and config is not None:
            choice[job.name], node_of[job.name] = config, a.node
            kept.append(job.name)
        elif problem.objective == "completion-time":
            choice[job.name] = heuristic.priced_config(problem, job.name)
            new.append(job.name)
        else:
            policy = settings.k_policy if settings.k_policy == "knee" else "area"
            choice[job.name] = heuristic.choose_k(problem.options[job.name], policy,
                                                  knee_efficiency=settings.knee_efficiency)
            new.append(job.name)
    order = sorted(kept, key=lambda j: (planned[j].start, j))
    if problem.objective == "completion-time":
        # each new job goes before the first kept one it outranks (Smith's rule), so a short
        # arrival does not wait behind the whole kept queue until a fresh plan wins
        def rank(j: str) -> float:
            return problem.weights[j] / (choice[j].seconds * choice[j].devices)
        for name in sorted(new, key=lambda j: (-rank(j), j)):
            at = next((i for i, j in enumerate(order) if rank(j) < rank(name)), len(order))
            order.insert(at, name)
    else:
        order += sorted(new, key=lambda j: (-choice[j].seconds, j))
    assignments = heuristic.list_schedule(problem, choice, order, node_of=node_of)
    return types.Plan(tuple(sorted(assignments, key=lambda a: (a.start, a.job))),
                      heuristic.makespan_of(problem, assignments), current.solver,
                      lower_bound=heuristic.lower_bound(problem), kept_current=True,
                      objective=problem.objective, cost=heuristic.cost(problem, assignments))

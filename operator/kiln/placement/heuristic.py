"""The placement heuristic: GPU count per job, then longest-first list scheduling.

Its plan always comes first: its makespan is the MILP's horizon, its warm start and the
fallback. Also the shared normalised `Problem`, per-node `timelines` and the `lower_bound`.
No solver, no I/O, no torch, no kubernetes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from kiln.placement import timeline, types

# Local search budget, in job placements (one placement ~ a few microseconds per node).
LOCAL_SEARCH_PLACEMENTS = 60_000


@dataclasses.dataclass(frozen=True)
class Reservation:
    """GPUs held on a node over [start, end) (absolute seconds): a running or frozen job."""

    job: str
    node: str
    gpus: int
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class Problem:
    """A snapshot ready to plan.

    Attributes:
        now: planning time (absolute seconds).
        nodes: the cluster.
        jobs: queued jobs still to place (frozen ones excluded), in snapshot order.
        options: per job, its `types.candidates` that fit at least one node.
        release: per job, earliest start (absolute): max(now, arrival).
        reservations: running jobs (from now) and frozen assignments.
        fixed: frozen assignments, copied into every plan unchanged.
    """

    now: float
    nodes: tuple[types.Node, ...]
    jobs: tuple[types.JobRequest, ...]
    options: Mapping[str, tuple[types.Config, ...]]
    release: Mapping[str, float]
    reservations: tuple[Reservation, ...] = ()
    fixed: tuple[types.Assignment, ...] = ()


def problem_of(snapshot: types.Snapshot, *,
               fixed: Sequence[types.Assignment] = ()) -> Problem:
    """Normalise a snapshot: candidate configs, releases, reservations.

    Args:
        snapshot: the cluster state.
        fixed: assignments of queued jobs that keep their slot (the freeze window); they are
            not re-planned and hold their GPUs over [start, end).

    Raises:
        types.Unplaceable: a queued job has no config that fits any node (names every one).
        ValueError: duplicate job or node names, or a running job on an unknown node.
    """
    names = [j.name for j in snapshot.queued] + [r.job for r in snapshot.running]
    if len(set(names)) != len(names):
        raise ValueError(f"snapshot: job names must be unique (got {sorted(names)})")
    capacity = {n.name: n.gpus for n in snapshot.nodes}
    if len(capacity) != len(snapshot.nodes):
        raise ValueError("snapshot.nodes: node names must be unique")
    problems = types.unplaceable_reasons(snapshot)
    if problems:
        raise types.Unplaceable(problems)
    largest = max(capacity.values())
    reservations: list[Reservation] = []
    for r in snapshot.running:
        if r.node not in capacity:
            raise ValueError(f"running job {r.job}: unknown node {r.node}")
        end = snapshot.now + max(0.0, r.remaining_seconds)
        reservations.append(Reservation(r.job, r.node, r.gpus, snapshot.now, end))
    reservations += [Reservation(a.job, a.node, a.gpus, a.start, a.end) for a in fixed]
    frozen = {a.job for a in fixed}
    jobs = tuple(j for j in snapshot.queued if j.name not in frozen)
    return Problem(
        now=snapshot.now, nodes=snapshot.nodes, jobs=jobs,
        options={j.name: tuple(c for c in types.candidates(j) if c.gpus <= largest)
                 for j in jobs},
        release={j.name: max(snapshot.now, j.arrival) for j in jobs},
        reservations=tuple(reservations), fixed=tuple(fixed))


def timelines(problem: Problem) -> dict[str, timeline.Timeline]:
    """Per node, a timeline holding the problem's reservations."""
    lines = {n.name: timeline.Timeline(n.gpus) for n in problem.nodes}
    for r in problem.reservations:
        lines[r.node].add(r.start, r.end, r.gpus)
    return lines


def reserved_until(problem: Problem) -> float:
    """When the last reservation ends (at least `now`)."""
    return max([problem.now, *(r.end for r in problem.reservations)])


def list_schedule(problem: Problem, choice: Mapping[str, types.Config], order: Sequence[str],
                  *, node_of: Mapping[str, str] | None = None) -> list[types.Assignment]:
    """Serial list scheduling: each job in `order` takes the earliest-finishing fit.

    Args:
        problem: the instance (reservations pre-loaded).
        choice: per job, its config.
        order: job names, highest priority first.
        node_of: per job (any subset), a node to use (the MILP's decode, a kept plan);
            other jobs go where they finish earliest (ties: the earlier node in
            `problem.nodes`).

    Returns:
        The fixed assignments followed by one assignment per job in `order`.
    """
    lines = timelines(problem)
    out = list(problem.fixed)
    for name in order:
        config, release = choice[name], problem.release[name]
        nodes = ([node_of[name]] if node_of is not None and name in node_of else
                 [n.name for n in problem.nodes if n.gpus >= config.gpus])
        start, _, node = min((lines[n].earliest(config.gpus, config.seconds, release), i, n)
                             for i, n in enumerate(nodes))
        lines[node].add(start, start + config.seconds, config.gpus)
        out.append(types.Assignment(name, node, config.gpus, config.parallelism, start,
                                    config.seconds))
    return out


def makespan_of(problem: Problem, assignments: Sequence[types.Assignment]) -> float:
    """Absolute end of the last assignment or reservation."""
    return max([reserved_until(problem), *(a.end for a in assignments)])


def lower_bound(problem: Problem) -> float:
    """Absolute makespan lower bound: the deadline-aware area bound and the longest job.

    Longest: each job's release plus its fastest config; each reservation's end.
    Area: a schedule ending by C gives each job a config that finishes by C, so it holds at
    least a_j(C) = min{k d : release_j + d <= C} GPU-seconds, and all of it fits in the
    GPU-seconds from now to C: G (C - now) >= reserved + sum_j a_j(C). The smallest such C
    is found by bisection over the durations' breakpoints (a_j only changes there). With
    C unconstrained this is the plain minimum-area bound; the deadline makes jobs whose
    cheap configs are too slow pay for the GPUs they need.
    """
    total = sum(n.gpus for n in problem.nodes)
    now = problem.now
    reserved = sum(r.gpus * max(0.0, r.end - max(r.start, now)) for r in problem.reservations)
    longest = max([reserved_until(problem),
                   *(problem.release[j.name] + problem.options[j.name][-1].seconds
                     for j in problem.jobs)])
    jobs = [(problem.release[j.name], problem.options[j.name]) for j in problem.jobs]

    def area(deadline: float) -> float:
        return reserved + sum(min(c.gpus * c.seconds for c in options
                                  if release + c.seconds <= deadline + 1e-9)
                              for release, options in jobs)

    points = sorted({p for p in (release + c.seconds for release, options in jobs
                                 for c in options) if p >= longest} | {longest})
    lo, hi = 0, len(points) - 1  # f(points[-1]) >= 0 or the answer lies beyond it
    if total * (points[-1] - now) < area(points[-1]):
        return now + area(points[-1]) / total
    while lo < hi:  # first breakpoint where the GPUs from now suffice
        mid = (lo + hi) // 2
        if total * (points[mid] - now) >= area(points[mid]):
            hi = mid
        else:
            lo = mid + 1
    if lo == 0:
        return points[0]
    # between the previous breakpoint and this one the areas are those of the previous one
    return min(points[lo], max(points[lo - 1], now + area(points[lo - 1]) / total))


def choose_k(options: Sequence[types.Config], policy: str, *,
             knee_efficiency: float = 0.75) -> types.Config:
    """One config per job by a policy.

    Args:
        options: the job's candidates (increasing gpus, decreasing seconds).
        policy: "area" (minimum gpus * seconds, ties: faster), "knee" (grow k while each
            step keeps `knee_efficiency` of ideal speed-up), "fastest", or "k=<n>" (largest
            k <= n, else the smallest).

    Raises:
        ValueError: unknown policy.
    """
    if policy == "area":
        return min(options, key=lambda c: (c.gpus * c.seconds, c.seconds))
    if policy == "fastest":
        return options[-1]
    if policy == "knee":
        chosen = options[0]
        for nxt in options[1:]:
            speedup, ideal = chosen.seconds / nxt.seconds, nxt.gpus / chosen.gpus
            if speedup < knee_efficiency * ideal:
                break
            chosen = nxt
        return chosen
    if policy.startswith("k="):
        k = int(policy[2:])
        fitting = [c for c in options if c.gpus <= k]
        return fitting[-1] if fitting else options[0]
    raise ValueError(f"k policy: unknown {policy!r} (allowed area, knee, fastest, k=<n>)")


def _policies(problem: Problem, settings: types.Settings) -> list[str]:
    if settings.k_policy in ("area", "knee"):
        return [settings.k_policy]
    if settings.k_policy != "best":
        raise ValueError(f"settings.k_policy: unknown {settings.k_policy!r} "
                         "(allowed best, area, knee)")
    counts = sorted({c.gpus for opts in problem.options.values() for c in opts})
    return ["area", "knee", "fastest", *(f"k={k}" for k in counts)]


# Makespan targets, as multiples of the lower bound, for the "deadline" policy.
DEADLINE_FACTORS = (1.0, 1.02, 1.04, 1.06, 1.08, 1.1, 1.13, 1.16, 1.2, 1.25, 1.3)


def _choices(problem: Problem, settings: types.Settings, bound: float
             ) -> list[tuple[str, dict[str, types.Config]]]:
    """(policy name, config per job) for every policy to try.

    Besides `choose_k`'s policies, "best" tries deadlines: for a makespan target C (a
    multiple of the lower bound), each job takes its minimum-area config that ends by C
    (the configs the deadline-aware area bound charges; the fastest if none does).
    """
    out = [(policy, {j.name: choose_k(problem.options[j.name], policy,
                                      knee_efficiency=settings.knee_efficiency)
                     for j in problem.jobs})
           for policy in _policies(problem, settings)]
    if settings.k_policy != "best":
        return out
    for factor in DEADLINE_FACTORS:
        target = problem.now + factor * (bound - problem.now)
        choice = {}
        for j in problem.jobs:
            options = problem.options[j.name]
            fits = [c for c in options if problem.release[j.name] + c.seconds <= target]
            choice[j.name] = (min(fits, key=lambda c: (c.gpus * c.seconds, c.seconds))
                              if fits else options[-1])
        out.append((f"deadline {factor:g}x lower bound", choice))
    return out


ORDERS = ("duration", "area", "width")


def _lpt(problem: Problem, choice: Mapping[str, types.Config], key: str) -> list[str]:
    """Longest-first order by duration, by GPU-area, or widest (most GPUs) first, then
    longest (ties: name)."""
    def weight(name: str) -> tuple[float, float]:
        c = choice[name]
        if key == "width":
            return (-c.gpus, -c.seconds)
        return (-c.seconds if key == "duration" else -c.seconds * c.gpus, 0.0)
    return sorted((j.name for j in problem.jobs), key=lambda n: (*weight(n), n))


def _score(problem: Problem, assignments: Sequence[types.Assignment]) -> tuple[float, float]:
    return makespan_of(problem, assignments), sum(a.end for a in assignments)


def schedule(problem: Problem, settings: types.Settings) -> types.Plan:
    """The heuristic plan: best policy and order, then one-job local search.

    Choose k per job by minimum GPU-area (k * d) or by the knee of its speed-up curve,
    list-schedule longest first on the node where the job finishes earliest, keep the best of
    several policies (with `k_policy` "best" also every fixed k, and "deadline" choices: the
    cheapest config that ends by a multiple of the lower bound), then change one job's config
    at a time while the makespan drops. Saturn (VLDB'24) uses such heuristics only as
    baselines; here the plan is always built first.

    Returns:
        A plan with solver "heuristic"; `reason` names the policy, order and local-search
        moves; `lower_bound` is `lower_bound(problem)`.

    Raises:
        ValueError: unknown `settings.k_policy`.
    """
    bound = lower_bound(problem)
    if not problem.jobs:
        return types.Plan(tuple(problem.fixed), makespan_of(problem, problem.fixed),
                          "heuristic", "nothing to place", lower_bound=bound)
    best: tuple[tuple[float, float], str, dict[str, types.Config], str] | None = None
    for policy, choice in _choices(problem, settings, bound):
        for key in ORDERS:
            score = _score(problem, list_schedule(problem, choice, _lpt(problem, choice, key)))
            if best is None or score < best[0]:
                best = (score, policy, choice, key)
    assert best is not None
    score, policy, choice, key = best
    moves = 0
    if settings.k_policy == "best":
        score, choice, key, moves = _local_search(problem, choice, key, score)
    assignments = list_schedule(problem, choice, _lpt(problem, choice, key))
    reason = (f"heuristic: k by {policy}, list order {key}, {moves} local-search move(s)")
    return types.Plan(tuple(sorted(assignments, key=lambda a: (a.start, a.job))), score[0],
                      "heuristic", reason, lower_bound=bound)


def polish(problem: Problem, choice: Mapping[str, types.Config]) -> types.Plan:
    """List-schedule a given config per job in every order of ORDERS, then local search.

    Used on the MILP's configs (`milp.decode`): the solver picks good GPU counts, slot
    rounding spoils its timing, and this re-times them with true durations.
    """
    start = dict(choice)
    score, key = min((_score(problem, list_schedule(problem, start, _lpt(problem, start, k))),
                      k) for k in ORDERS)
    score, start, key, moves = _local_search(problem, start, key, score)
    assignments = list_schedule(problem, start, _lpt(problem, start, key))
    return types.Plan(tuple(sorted(assignments, key=lambda a: (a.start, a.job))), score[0],
                      "heuristic", f"polished: list order {key}, {moves} local-search move(s)",
                      lower_bound=lower_bound(problem))


def _local_search(problem: Problem, choice: dict[str, types.Config], key: str,
                  score: tuple[float, float]
                  ) -> tuple[tuple[float, float], dict[str, types.Config], str, int]:
    """First-improvement search over one job's config at a time.

    Each trial is list-scheduled in every order of ORDERS; a change is accepted when
    (makespan, sum of ends) drops. Stops after a pass without one or when
    LOCAL_SEARCH_PLACEMENTS job placements are spent (deterministic, no clock).
    """
    budget, moves, improved = LOCAL_SEARCH_PLACEMENTS, 0, True
    per_trial = len(problem.jobs) * len(problem.nodes) * len(ORDERS)
    while improved and budget > 0:
        improved = False
        for name in _lpt(problem, choice, key):
            for config in problem.options[name]:
                if config == choice[name] or budget <= 0:
                    continue
                budget -= per_trial
                trial = {**choice, name: config}
                for order in ORDERS:
                    trial_score = _score(problem, list_schedule(problem, trial,
                                                                _lpt(problem, trial, order)))
                    if trial_score < score:
                        score, choice, key, improved = trial_score, trial, order, True
                moves += choice is trial
    return score, choice, key, moves

"""Shared helpers for the placement tests: seeded random instances, plan checks, brute force.

The brute force is independent of the planner's code: for every config and node per job it
takes, per node, the best serial schedule over all job orders (earliest fit, integer data).
Serial earliest-fit scheduling over all orders reaches an optimal (active) schedule, so this is the
exact optimum for small instances.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence

from kiln.placement import types


def amdahl_configs(d1: float, serial: float, ks: Sequence[int] = (1, 2, 4, 8), *,
                   integer: bool = False) -> tuple[types.Config, ...]:
    """Configs d(k) = d1 (serial + (1 - serial) / k), "single" at k=1, else "ddp"."""
    out = []
    for k in ks:
        seconds = d1 * (serial + (1 - serial) / k)
        seconds = float(max(1, round(seconds))) if integer else seconds
        out.append(types.Config("single" if k == 1 else "ddp", k, seconds))
    return tuple(out)


def random_snapshot(seed: int, *, jobs: int, nodes: Sequence[int] = (8,),
                    integer: bool = False, scale: float = 100.0, running: int = 0,
                    arrivals: bool = False) -> types.Snapshot:
    """A seeded random instance: Amdahl jobs (serial 2-40%), optional running jobs."""
    rng = random.Random(seed)
    node_list = tuple(types.Node(f"n{i}", g) for i, g in enumerate(nodes))
    ks = sorted({k for k in (1, 2, 4, 8) if k <= max(nodes)})
    queued = []
    for i in range(jobs):
        d1 = rng.uniform(0.2, 1.0) * scale
        serial = rng.uniform(0.02, 0.4)
        arrival = float(rng.randint(0, int(scale // 4))) if arrivals else 0.0
        queued.append(types.JobRequest(f"job-{i}", amdahl_configs(d1, serial, ks,
                                                                  integer=integer), arrival))
    runs = []
    for i in range(running):
        node = rng.choice(node_list)
        gpus = rng.choice([k for k in ks if k <= node.gpus // 2] or [1])
        remaining = float(rng.randint(1, int(scale // 3)))
        runs.append(types.Running(f"run-{i}", node.name, gpus, "ddp", remaining))
    return types.Snapshot(0.0, node_list, tuple(queued), tuple(runs))


def usage_peaks(snapshot: types.Snapshot, plan: types.Plan) -> dict[str, int]:
    """Per node, the most devices held at any instant by running jobs plus the plan."""
    intervals: dict[str, list[tuple[float, float, int]]] = {n.name: [] for n in snapshot.nodes}
    for r in snapshot.running:
        intervals[r.node].append((snapshot.now, snapshot.now + r.remaining_seconds, r.gpus))
    for a in plan.assignments:
        intervals[a.node].append((a.start, a.end, a.gpus))
    peaks = {}
    for node, spans in intervals.items():
        points = {s for s, _, _ in spans}
        peaks[node] = max((sum(g for s, e, g in spans if s <= t < e) for t in points),
                          default=0)
    return peaks


def check_plan(snapshot: types.Snapshot, plan: types.Plan) -> None:
    """Assert: every queued job exactly once, with one of its own configs on a node that
    fits it, never before its arrival or now; capacity never exceeded; makespan consistent
    and >= the lower bound."""
    queued = {j.name: j for j in snapshot.queued}
    names = [a.job for a in plan.assignments]
    assert sorted(names) == sorted(queued), (names, sorted(queued))
    capacity = {n.name: n.gpus for n in snapshot.nodes}
    for a in plan.assignments:
        job = queued[a.job]
        assert any(c.gpus == a.gpus and c.parallelism == a.parallelism
                   and math.isclose(c.seconds, a.seconds) for c in job.configs), a
        assert a.gpus <= capacity[a.node], a
        assert a.start >= max(snapshot.now, job.arrival) - 1e-9, a
    for node, peak in usage_peaks(snapshot, plan).items():
        assert peak <= capacity[node], (node, peak)
    ends = [a.end for a in plan.assignments]
    ends += [snapshot.now + r.remaining_seconds for r in snapshot.running]
    assert math.isclose(plan.makespan, max([snapshot.now, *ends]), rel_tol=1e-9)
    assert plan.makespan >= plan.lower_bound - 1e-6


def _earliest(placed: Sequence[tuple[float, float, int]], release: float, seconds: float,
              gpus: int, capacity: int) -> float:
    """Earliest start >= release with `gpus` free over [start, start + seconds)."""
    for t in sorted({release, *(e for _, e, _ in placed if e > release)}):
        points = {t, *(s for s, _, _ in placed if t < s < t + seconds)}
        if all(sum(g for s, e, g in placed if s <= p < e) + gpus <= capacity for p in points):
            return t
    raise AssertionError("unreachable: after the last end everything is free")


def _best_serial(items: Sequence[tuple[float, float, int]], capacity: int,
                 busy: Sequence[tuple[float, float, int]], bound: float) -> float:
    """Min over all orders of the serial earliest-fit makespan (DFS, pruned)."""
    best = math.inf

    def visit(placed: list[tuple[float, float, int]], left: tuple[int, ...], end: float) -> None:
        nonlocal best
        if end >= best or best <= bound + 1e-9:
            return
        if not left:
            best = end
            return
        for i in left:
            release, seconds, gpus = items[i]
            t = _earliest(placed, release, seconds, gpus, capacity)
            visit([*placed, (t, t + seconds, gpus)], tuple(x for x in left if x != i),
                  max(end, t + seconds))

    visit(list(busy), tuple(range(len(items))), max([0.0, *(e for _, e, _ in busy)]))
    return best


def brute_force_makespan(snapshot: types.Snapshot) -> float:
    """Exact optimal makespan by exhaustive enumeration (<= 5 jobs, any config per job)."""
    jobs = list(snapshot.queued)
    assert len(jobs) <= 5
    capacity = {n.name: n.gpus for n in snapshot.nodes}
    busy: dict[str, list[tuple[float, float, int]]] = {n: [] for n in capacity}
    for r in snapshot.running:
        busy[r.node].append((snapshot.now, snapshot.now + r.remaining_seconds, r.gpus))
    memo: dict[tuple[str, frozenset[tuple[int, int]]], float] = {}

    def items_of(members: frozenset[tuple[int, int]]) -> list[tuple[float, float, int]]:
        return [(max(snapshot.now, jobs[j].arrival), jobs[j].configs[c].seconds,
                 jobs[j].configs[c].gpus) for j, c in sorted(members)]

    def node_bound(node: str, members: frozenset[tuple[int, int]]) -> float:
        """Longest job, reservations and the node's area bound."""
        items = items_of(members)
        busy_area = sum(g * (e - s) for s, e, g in busy[node])
        return max([snapshot.now, *(e for _, e, _ in busy[node]),
                    *(r + s for r, s, _ in items),
                    snapshot.now + (busy_area + sum(s * g for _, s, g in items))
                    / capacity[node]])

    def node_best(node: str, members: frozenset[tuple[int, int]]) -> float:
        key = (node, members)
        if key not in memo:
            memo[key] = _best_serial(items_of(members), capacity[node], busy[node],
                                     node_bound(node, members))
        return memo[key]

    options = [[(c, n) for c, config in enumerate(job.configs) for n in capacity
                if config.gpus <= capacity[n]] for job in jobs]
    best = math.inf
    for combo in itertools.product(*options):
        per_node = {n: frozenset((j, c) for j, (c, m) in enumerate(combo) if m == n)
                    for n in capacity}
        if max(node_bound(n, members) for n, members in per_node.items()) >= best:
            continue  # cannot beat the best found
        best = min(best, max(node_best(n, members) for n, members in per_node.items()))
    return best

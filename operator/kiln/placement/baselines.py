"""Baseline placements for benchmarks: whole-node FIFO, fixed-k FIFO, SJF (with or without a
per-owner GPU cap) and least attained service.

"Current DL practice" in Saturn's evaluation (VLDB'24): one parallelism, a fixed or whole-node
GPU allocation, strict FIFO (no job starts before an earlier arrival), each job on the node
where it starts earliest; plus shortest-job-first (with and without a per-owner GPU cap) and
least attained service per owner (Tiresias-like, without preemption), the strongest simple
queue policies. Running jobs are pinned as in the planner. No optimisation, no I/O.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping

from kiln.placement import heuristic, timeline, types


def _fifo_order(snapshot: types.Snapshot) -> list[types.JobRequest]:
    """Queued jobs by arrival (ties: snapshot order)."""
    return sorted(snapshot.queued, key=lambda j: j.arrival)


def _finite(job: types.JobRequest) -> list[types.Config]:
    return [c for c in job.configs if c.seconds != float("inf")]


def whole_node_fifo(snapshot: types.Snapshot) -> types.Plan:
    """Every job holds a whole node, in arrival order ("current practice").

    A job runs its fastest config that fits the node and holds all of the node's devices
    (`Assignment.gpus` is the node's count) for that config's duration.

    Raises:
        types.Unplaceable: a job has no config that fits any node.
    """
    def fastest(job: types.JobRequest, node: types.Node) -> types.Config | None:
        fitting = [c for c in _finite(job) if types.fits(c, node)]
        return min(fitting, key=lambda c: (c.seconds, -c.gpus)) if fitting else None

    return _fifo(snapshot, fastest, whole_node=True, solver="whole-node-fifo",
                 reason="baseline: whole node per job, arrival order")


def fixed_k_config(job: types.JobRequest, k: int, node_gpus: int,
                   device_type: str = "") -> types.Config | None:
    """The config a fixed-k user picks: fastest with exactly k devices, else the largest
    count below k, else the smallest count; None if nothing fits the node (`node_gpus`
    devices of GPU type `device_type`)."""
    fitting = [c for c in _finite(job) if types.fits(c, types.Node("", node_gpus, device_type))]
    if not fitting:
        return None
    exact = [c for c in fitting if c.gpus == k]
    below = [c for c in fitting if c.gpus < k]
    if exact:
        return min(exact, key=lambda c: c.seconds)
    if below:
        top = max(c.gpus for c in below)
        return min((c for c in below if c.gpus == top), key=lambda c: c.seconds)
    low = min(c.gpus for c in fitting)
    return min((c for c in fitting if c.gpus == low), key=lambda c: c.seconds)


def fixed_k_fifo(snapshot: types.Snapshot, k: int) -> types.Plan:
    """Every job uses k devices (`fixed_k_config`), in arrival order, earliest node.

    Raises:
        types.Unplaceable: a job has no config that fits any node.
    """
    return _fifo(snapshot, lambda job, node: fixed_k_config(job, k, node.gpus,
                                                            node.device_type),
                 whole_node=False, solver="fixed-k-fifo",
                 reason=f"baseline: k={k} per job, arrival order")


def _fifo(snapshot: types.Snapshot,
          pick: Callable[[types.JobRequest, types.Node], types.Config | None], *,
          whole_node: bool, solver: str, reason: str) -> types.Plan:
    """Arrival-order list scheduling: each job on the node where `pick`'s config starts
    first (ties: earlier end, then node order), never before the previous job's start;
    `whole_node` jobs hold every device of their node."""
    began = time.perf_counter()
    problem = heuristic.problem_of(snapshot)
    lines = heuristic.timelines(problem)
    out: list[types.Assignment] = []
    not_before = snapshot.now
    for job in _fifo_order(snapshot):
        best: tuple[float, float, int, types.Node, types.Config, int] | None = None
        for i, node in enumerate(snapshot.nodes):
            config = pick(job, node)
            if config is None:
                continue
            held = node.gpus if whole_node else config.gpus
            release = max(problem.release[job.name], not_before)
            start = lines[node.name].earliest(held, config.seconds, release)
            candidate = (start, start + config.seconds, i, node, config, held)
            if best is None or candidate[:3] < best[:3]:
                best = candidate
        assert best is not None  # problem_of raised Unplaceable otherwise
        start, end, _, node, config, held = best
        lines[node.name].add(start, end, held)
        out.append(types.Assignment(job.name, node.name, held, config.parallelism, start,
                                    config.seconds))
        not_before = start
    return types.Plan(tuple(out), heuristic.makespan_of(problem, out), solver, reason,
                      time.perf_counter() - began, heuristic.lower_bound(problem))


def sjf_fair_share(snapshot: types.Snapshot, *, k: int | None = None,
                   cap: bool = True) -> types.Plan:
    """Shortest job first (by estimate), no namespace above its GPU share while others wait
    (`cap` False: plain SJF, no share).

    Each job uses its asked GPU count (`JobRequest.asked_gpus`, else 1) or `k` when given,
    through `fixed_k_config`. Jobs are list-scheduled shortest first (ties: arrival, name),
    each on the node where it starts first, filling gaps (no FIFO barrier). While more than
    one namespace has jobs waiting, a namespace's planned usage (running jobs included) stays
    within ceil(total GPUs / waiting namespaces), or one job's GPUs when that is larger.
    Re-run at every arrival and completion, the share follows the waiting namespaces.

    Args:
        snapshot: the cluster; running jobs count against their namespace's share.
        k: GPUs per job for every job (None: each job's asked count).

    Raises:
        types.Unplaceable: a job has no config that fits any node.
    """
    began = time.perf_counter()
    problem = heuristic.problem_of(snapshot)
    lines = heuristic.timelines(problem)
    owner = {j.name: j.namespace for j in snapshot.queued}
    owner.update({r.job: r.namespace for r in snapshot.running})
    waiting = {j.namespace for j in snapshot.queued}
    total = sum(n.gpus for n in snapshot.nodes)
    share = math.ceil(total / len(waiting)) if len(waiting) > 1 and cap else total
    usage = {o: timeline.Timeline(share) for o in set(owner.values())}
    for r in snapshot.running:
        usage[owner[r.job]].add(snapshot.now, snapshot.now + max(0.0, r.remaining_seconds),
                                r.gpus)
    picks: dict[str, list[tuple[types.Node, types.Config]]] = {}
    for job in snapshot.queued:
        want = k if k is not None else (job.asked_gpus or 1)
        picks[job.name] = [(node, config) for node in snapshot.nodes
                           if (config := fixed_k_config(job, want, node.gpus,
                                                        node.device_type)) is not None]

    def length(job: types.JobRequest) -> tuple[float, float, str]:
        return (min(c.seconds for _, c in picks[job.name]), job.arrival, job.name)

    out: list[types.Assignment] = []
    for job in sorted(snapshot.queued, key=length):
        held = usage[owner[job.name]]
        best: tuple[float, float, int, types.Node, types.Config] | None = None
        for i, (node, config) in enumerate(picks[job.name]):
            # A job wider than the share may still run, alone within its namespace's usage.
            held.capacity = max(share, config.gpus)
            start = problem.release[job.name]
            while True:  # both step functions only move the start later: this converges
                start = lines[node.name].earliest(config.gpus, config.seconds, start)
                fair = held.earliest(config.gpus, config.seconds, start)
                if fair == start:
                    break
                start = fair
            candidate = (start, start + config.seconds, i, node, config)
            if best is None or candidate[:3] < best[:3]:
                best = candidate
        assert best is not None  # problem_of raised Unplaceable otherwise
        start, end, _, node, config = best
        lines[node.name].add(start, end, config.gpus)
        held.add(start, end, config.gpus)
        out.append(types.Assignment(job.name, node.name, config.gpus, config.parallelism,
                                    start, config.seconds))
    return types.Plan(tuple(out), heuristic.makespan_of(problem, out),
                      "sjf-fair-share" if cap else "sjf",
                      f"baseline: shortest first, namespace share {share} GPUs",
                      time.perf_counter() - began, heuristic.lower_bound(problem))


def least_attained_service(snapshot: types.Snapshot,
                           attained: Mapping[str, float]) -> types.Plan:
    """Least attained service: the next job is the oldest of the namespace that has received
    the fewest GPU-seconds (`attained`, plus what this plan gives it), on its asked count.

    Jobs are list-scheduled in that order on the node where they start first, filling gaps.
    Nothing is preempted (a simple baseline; Tiresias also preempts).

    Raises:
        types.Unplaceable: a job has no config that fits any node.
    """
    began = time.perf_counter()
    problem = heuristic.problem_of(snapshot)
    lines = heuristic.timelines(problem)
    given = dict(attained)
    left = sorted(snapshot.queued, key=lambda j: (j.arrival, j.name))
    out: list[types.Assignment] = []
    while left:
        job = min(left, key=lambda j: given.get(j.namespace, 0.0))
        left.remove(job)
        best: tuple[float, int, types.Node, types.Config] | None = None
        for i, node in enumerate(snapshot.nodes):
            config = fixed_k_config(job, job.asked_gpus or 1, node.gpus, node.device_type)
            if config is None:
                continue
            start = lines[node.name].earliest(config.gpus, config.seconds,
                                              problem.release[job.name])
            if best is None or (start + config.seconds, i) < (best[0] + best[3].seconds,
                                                              best[1]):
                best = (start, i, node, config)
        assert best is not None  # problem_of raised Unplaceable otherwise
        start, _, node, config = best
        lines[node.name].add(start, start + config.seconds, config.gpus)
        given[job.namespace] = given.get(job.namespace, 0.0) + config.gpus * config.seconds
        out.append(types.Assignment(job.name, node.name, config.gpus, config.parallelism,
                                    start, config.seconds))
    return types.Plan(tuple(out), heuristic.makespan_of(problem, out), "least-attained-service",
                      "baseline: least attained service per namespace",
                      time.perf_counter() - began, heuristic.lower_bound(problem))

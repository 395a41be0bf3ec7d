"""Discrete-event simulator: replay a workload on a cluster under a placement policy.

Jobs start as in the operator (`queues.NodeQueues`) and run for their *true* durations, which
the planner sees only through estimates. Reports makespan, mean completion time and GPU
utilisation, and keeps every decision. No real processes, no clock.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Sequence

from kiln.placement import baselines, planner, queues, types

Policy = Callable[[types.Snapshot, types.Plan | None], types.Plan]


class SimulationError(RuntimeError):
    """A policy returned a plan that loses, duplicates or cannot run a queued job."""


@dataclasses.dataclass(frozen=True)
class SimJob:
    """A job of the workload: true durations, estimates the planner sees, arrival (s)."""

    name: str
    true_configs: tuple[types.Config, ...]
    arrival: float = 0.0
    estimated_configs: tuple[types.Config, ...] | None = None  # None: the true ones

    @property
    def estimates(self) -> tuple[types.Config, ...]:
        return self.estimated_configs if self.estimated_configs is not None \
            else self.true_configs


@dataclasses.dataclass(frozen=True)
class JobRecord:
    """What happened to one job (absolute seconds)."""

    name: str
    node: str
    gpus: int
    parallelism: str
    arrival: float
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class Decision:
    """One policy call: the snapshot it saw, the plan before and the plan after."""

    snapshot: types.Snapshot
    previous: types.Plan | None
    plan: types.Plan
    trigger: str  # "arrival" | "completion" | "periodic"


@dataclasses.dataclass(frozen=True)
class Result:
    """Outcome of one replay."""

    policy: str
    makespan_seconds: float
    mean_completion_seconds: float
    gpu_utilisation: float
    jobs: tuple[JobRecord, ...]
    decisions: tuple[Decision, ...]
    swaps: int  # decisions after the first whose plan was not the kept current one
    solve_seconds: float  # total wall seconds inside the policy
    max_solve_seconds: float


def with_noise(jobs: Sequence[SimJob], *, sigma: float, seed: int) -> tuple[SimJob, ...]:
    """Estimates = true durations x exp(N(0, sigma)), drawn per job and config (seeded)."""
    rng = random.Random(seed)
    return tuple(dataclasses.replace(job, estimated_configs=tuple(
        dataclasses.replace(c, seconds=c.seconds * math.exp(rng.gauss(0.0, sigma)))
        for c in job.true_configs)) for job in jobs)


def true_seconds(job: SimJob, a: types.Assignment) -> float:
    """True duration of the assignment: its (parallelism, gpus) config; for a job holding
    more devices than its config uses (whole-node baseline), the fastest that fits."""
    exact = [c.seconds for c in job.true_configs
             if c.gpus == a.gpus and c.parallelism == a.parallelism]
    if exact:
        return min(exact)
    fitting = ([c.seconds for c in job.true_configs
                if c.gpus <= a.gpus and c.parallelism == a.parallelism]
               or [c.seconds for c in job.true_configs if c.gpus <= a.gpus])
    if not fitting:
        raise SimulationError(f"job {job.name}: no true duration for {a.gpus} x "
                              f"{a.parallelism}")
    return min(fitting)


def run(jobs: Sequence[SimJob], nodes: Sequence[types.Node], policy: Policy, *,
        name: str = "policy", replan_on_completion: bool = False,
        period_seconds: float | None = None) -> Result:
    """Replay `jobs` on `nodes` under `policy`.

    The policy sees running jobs with their true remaining time. Utilisation is GPU-seconds
    held / (capacity x makespan); a job's completion time is its end - arrival.

    Args:
        jobs: the workload.
        nodes: the cluster.
        policy: called on arrivals (always), completions and every `period_seconds`.
        name: label for the result.
        replan_on_completion: also call the policy when a job completes.
        period_seconds: also call it periodically (None: never).

    Raises:
        SimulationError: a plan misses or duplicates a queued job, or nothing can start.
    """
    nodes = tuple(nodes)
    by_name = {j.name: j for j in jobs}
    pending = sorted(jobs, key=lambda j: (j.arrival, j.name))
    queued: dict[str, SimJob] = {}
    running: dict[str, JobRecord] = {}
    free = {n.name: n.gpus for n in nodes}
    done: list[JobRecord] = []
    decisions: list[Decision] = []
    line = queues.NodeQueues()
    now = pending[0].arrival if pending else 0.0
    next_tick = now + period_seconds if period_seconds else math.inf
    while pending or queued or running:
        now = min([pending[0].arrival if pending else math.inf,
                   *(r.end for r in running.values()),
                   next_tick if (queued or running) else math.inf])
        if math.isinf(now):
            raise SimulationError(f"no job can start: queued {sorted(queued)}")
        trigger = ""
        for record in [r for r in running.values() if r.end <= now]:
            del running[record.name]
            free[record.node] += record.gpus
            done.append(record)
            trigger = "completion" if replan_on_completion else trigger
        if now >= next_tick:
            trigger = "periodic"
            while next_tick <= now:
                next_tick += period_seconds or math.inf
        while pending and pending[0].arrival <= now:
            arrived = pending.pop(0)
            queued[arrived.name] = arrived
            trigger = "arrival"
        if trigger and queued:
            snapshot = types.Snapshot(now, nodes, tuple(
                types.JobRequest(j.name, j.estimates, j.arrival) for j in queued.values()),
                tuple(types.Running(r.name, r.node, r.gpus, r.parallelism, r.end - now)
                      for r in running.values()))
            new = policy(snapshot, line.plan)
            placed = sorted(a.job for a in new.assignments)
            if placed != sorted(queued):
                raise SimulationError(f"{name} at {now:.1f} s: plan places {placed}, "
                                      f"queued are {sorted(queued)}")
            decisions.append(Decision(snapshot, line.plan, new, trigger))
            line.follow(new)
        for a in line.start_heads(free):
            job = queued.pop(a.job)
            running[job.name] = JobRecord(job.name, a.node, a.gpus, a.parallelism, job.arrival,
                                          now, now + true_seconds(by_name[job.name], a))
            free[a.node] -= a.gpus
    return _result(name, list(jobs), done, decisions, nodes)


def _result(name: str, jobs: list[SimJob], done: list[JobRecord], decisions: list[Decision],
            nodes: tuple[types.Node, ...]) -> Result:
    if not done:
        return Result(name, 0.0, 0.0, 0.0, (), tuple(decisions), 0, 0.0, 0.0)
    first = min(j.arrival for j in jobs)
    makespan = max(r.end for r in done) - first
    held = sum(r.gpus * (r.end - r.start) for r in done)
    capacity = sum(n.gpus for n in nodes)
    solve = [d.plan.solve_seconds for d in decisions]
    swaps = sum(1 for d in decisions[1:] if not d.plan.kept_current)
    return Result(name, makespan, sum(r.end - r.arrival for r in done) / len(done),
                  held / (capacity * makespan) if makespan > 0 else 0.0,
                  tuple(sorted(done, key=lambda r: (r.start, r.name))), tuple(decisions),
                  swaps, sum(solve), max(solve, default=0.0))


# Policies ----------------------------------------------------------------------------------

def whole_node_fifo() -> Policy:
    """Whole-node FIFO (re-derived from the queue at every call: FIFO order is stable)."""
    return lambda snapshot, _current: baselines.whole_node_fifo(snapshot)


def fixed_k_fifo(k: int) -> Policy:
    """FIFO with k devices per job."""
    return lambda snapshot, _current: baselines.fixed_k_fifo(snapshot, k)


def kiln_policy(settings: types.Settings, *, replanning: bool) -> Policy:
    """Kiln's planner: `planner.replan` (re-planning) or plan once, then `planner.extend`
    (new jobs inserted into the current plan, nothing re-optimised)."""
    if replanning:
        return lambda snapshot, current: planner.replan(current, snapshot, settings)
    return lambda snapshot, current: (planner.plan(snapshot, settings) if current is None
                                      else planner.extend(current, snapshot, settings))

"""Discrete-event simulator: replay a workload on a cluster under a placement policy.

As strict as the operator: the policy is called on every arrival, completion and start (and
periodically), jobs start only as queue heads (`queues.NodeQueues`), the planner sees
estimates (running jobs: estimate minus elapsed) while jobs run their *true* durations, and
moving a running job costs a restart. Keeps every decision. No real processes, no clock.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
from collections.abc import Callable, Sequence

from kiln.placement import baselines, planner, queues, types

# The operator's floor on a running job's remaining time (its cluster view, controller/):
# an overrunning job is seen as about to end, never as already done.
MIN_REMAINING_SECONDS = 5.0


class SimulationError(RuntimeError):
    """A policy returned a plan that loses, duplicates or cannot run a queued job, or a move
    that does not fit."""


@dataclasses.dataclass(frozen=True)
class SimJob:
    """A job of the workload: true durations, estimates the planner sees, arrival (s).

    Attributes:
        name: the job's key.
        true_configs: what each config really takes (seconds).
        arrival: when it is submitted (seconds).
        estimated_configs: what the planner sees (None: the true ones).
        owner: its namespace (the planner's quotas, fair-share baselines, fairness metrics).
        group: the sweep it belongs to ("": none), as `types.JobRequest.group`.
        asked_gpus: the count its user would ask for under current practice (None: any);
            baselines use it, Kiln chooses from the configs.
    """

    name: str
    true_configs: tuple[types.Config, ...]
    arrival: float = 0.0
    estimated_configs: tuple[types.Config, ...] | None = None  # None: the true ones
    owner: str = ""
    group: str = ""
    asked_gpus: int | None = None

    @property
    def estimates(self) -> tuple[types.Config, ...]:
        return self.estimated_configs if self.estimated_configs is not None \
            else self.true_configs


@dataclasses.dataclass(frozen=True)
class JobRecord:
    """What happened to one job (absolute seconds); node, gpus and parallelism are its last.

    `gpu_seconds` counts every GPU held, restarts included; `restarts` counts moves.
    """

    name: str
    node: str
    gpus: int
    parallelism: str
    arrival: float
    start: float
    end: float
    owner: str = ""
    gpu_seconds: float = 0.0
    restarts: int = 0

    @property
    def wait_seconds(self) -> float:
        """Seconds from arrival to first start."""
        return self.start - self.arrival


@dataclasses.dataclass(frozen=True)
class Move:
    """Restart a running job as `gpus` x `parallelism` on `node` (it keeps its progress)."""

    job: str
    node: str
    gpus: int
    parallelism: str


@dataclasses.dataclass(frozen=True)
class Step:
    """A policy's answer with moves of running jobs (a plain `types.Plan` means none)."""

    plan: types.Plan
    moves: tuple[Move, ...] = ()


Policy = Callable[[types.Snapshot, types.Plan | None], "types.Plan | Step"]


@dataclasses.dataclass(frozen=True)
class Decision:
    """One policy call: the snapshot it saw, the plan before and the plan after."""

    snapshot: types.Snapshot
    previous: types.Plan | None
    plan: types.Plan
    trigger: str  # "arrival" | "completion" | "start" | "periodic"
    moves: tuple[Move, ...] = ()


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
    restarts: int = 0


def with_noise(jobs: Sequence[SimJob], *, sigma: float, seed: int) -> tuple[SimJob, ...]:
    """Estimates = true durations x exp(N(0, sigma)), drawn per job and config (seeded)."""
    rng = random.Random(seed)
    return tuple(dataclasses.replace(job, estimated_configs=tuple(
        dataclasses.replace(c, seconds=c.seconds * math.exp(rng.gauss(0.0, sigma)))
        for c in job.true_configs)) for job in jobs)


def _seconds(configs: Sequence[types.Config], gpus: int, parallelism: str,
             device_type: str = "") -> float | None:
    """Duration of (parallelism, gpus) on a node of GPU type `device_type`; for more devices
    than a config uses (whole-node baseline), the fastest config that fits, same parallelism
    first."""
    configs = [c for c in configs if c.device_type in ("", device_type)]
    exact = [c.seconds for c in configs if c.gpus == gpus and c.parallelism == parallelism]
    if exact:
        return min(exact)
    fitting = ([c.seconds for c in configs if c.gpus <= gpus and c.parallelism == parallelism]
               or [c.seconds for c in configs if c.gpus <= gpus])
    return min(fitting) if fitting else None


def true_seconds(job: SimJob, a: types.Assignment | Move, device_type: str = "") -> float:
    """True duration of the assignment on a node of GPU type `device_type`: its (parallelism,
    gpus) config; for a job holding more devices than its config uses (whole-node
    baseline), the fastest that fits."""
    found = _seconds(job.true_configs, a.gpus, a.parallelism, device_type)
    if found is None:
        raise SimulationError(f"job {job.name}: no true duration for {a.gpus} x "
                              f"{a.parallelism}")
    return found


@dataclasses.dataclass
class _Running:
    """A running job's current segment: `left` of its work remains at `since`, the first
    `restart` seconds of the segment make no progress."""

    job: SimJob
    node: str
    gpus: int
    parallelism: str
    first_start: float
    since: float
    left: float
    restart: float
    true_total: float  # true seconds of the whole job in this config
    estimated_total: float
    gpu_seconds: float = 0.0
    restarts: int = 0

    @property
    def end(self) -> float:
        return self.since + self.restart + self.left * self.true_total

    def seen_remaining(self, now: float, true_remaining: bool) -> float:
        """What the planner is told: the truth, or as the operator without trainer reports
        (this segment's estimate minus its elapsed time, floored)."""
        if true_remaining:
            return self.end - now
        planned = self.restart + self.left * self.estimated_total
        return max(MIN_REMAINING_SECONDS, planned - (now - self.since))

    def record(self) -> JobRecord:
        end = self.end
        return JobRecord(self.job.name, self.node, self.gpus, self.parallelism,
                         self.job.arrival, self.first_start, end, self.job.owner,
                         self.gpu_seconds + self.gpus * (end - self.since), self.restarts)


def run(jobs: Sequence[SimJob], nodes: Sequence[types.Node], policy: Policy, *,
        name: str = "policy", replan_on_completion: bool = True,
        period_seconds: float | None = None, restart_seconds: float = 0.0,
        true_remaining: bool = False, replan_after_start: bool = True,
        moves: bool = False) -> Result:
    """Replay `jobs` on `nodes` under `policy`.

    Like the operator's placement loop, every wake-up re-plans the queued jobs and then
    starts the queue heads whose devices are free; starting jobs wakes it again, until a
    round starts nothing. Utilisation is GPU-seconds held / (capacity x makespan); a job's
    completion time is its end - arrival.

    Args:
        jobs: the workload.
        nodes: the cluster.
        policy: called on arrivals (always), completions, starts and every `period_seconds`
            while jobs are queued; it may return a `Step` with moves of running jobs.
        name: label for the result.
        replan_on_completion: also call the policy when a job completes (the operator does).
        period_seconds: also call it periodically (None: never).
        restart_seconds: what a move costs the moved job (checkpoint, new pods, reload).
        true_remaining: tell the policy running jobs' true remaining time (kinder than the
            operator, which knows only its estimate and the elapsed time).
        replan_after_start: call the policy again after a round that started jobs.
        moves: the policy moves running jobs, so it is also called with nothing queued while
            jobs run (the operator's loop introspects then too: a job grows into GPUs that a
            completion left idle).

    Raises:
        SimulationError: a plan misses or duplicates a queued job, nothing can start, or a
            move names a job that is not running or does not fit.
    """
    nodes = tuple(nodes)
    capacity = {n.name: n.gpus for n in nodes}
    type_of = {n.name: n.device_type for n in nodes}
    pending = sorted(jobs, key=lambda j: (j.arrival, j.name))
    queued: dict[str, SimJob] = {}
    running: dict[str, _Running] = {}
    free = dict(capacity)
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
        for r in [r for r in running.values() if r.end <= now]:
            del running[r.job.name]
            free[r.node] += r.gpus
            done.append(r.record())
            trigger = "completion" if replan_on_completion else trigger
        if now >= next_tick:
            trigger = "periodic"
            while next_tick <= now:
                next_tick += period_seconds or math.inf
        while pending and pending[0].arrival <= now:
            arrived = pending.pop(0)
            queued[arrived.name] = arrived
            trigger = "arrival"
        while trigger and (queued or moves and running):
            snapshot = types.Snapshot(now, nodes, tuple(
                types.JobRequest(j.name, j.estimates, j.arrival, j.asked_gpus,
                                 namespace=j.owner, group=j.group)
                for j in queued.values()), tuple(
                types.Running(r.job.name, r.node, r.gpus, r.parallelism,
                              r.seen_remaining(now, true_remaining), r.job.owner)
                for r in running.values()))
            answer = policy(snapshot, line.plan)
            step = answer if isinstance(answer, Step) else Step(answer)
            placed = sorted(a.job for a in step.plan.assignments)
            if placed != sorted(queued):
                raise SimulationError(f"{name} at {now:.1f} s: plan places {placed}, "
                                      f"queued are {sorted(queued)}")
            decisions.append(Decision(snapshot, line.plan, step.plan, trigger, step.moves))
            line.follow(step.plan)
            for move in step.moves:
                _move(running, free, capacity, move, now=now, restart_seconds=restart_seconds,
                      label=name, type_of=type_of)
            started = line.start_heads(free)
            for a in started:
                job = queued.pop(a.job)
                seconds = true_seconds(job, a, type_of.get(a.node, ""))
                estimated = _seconds(job.estimates, a.gpus, a.parallelism,
                                     type_of.get(a.node, "")) or seconds
                running[job.name] = _Running(job, a.node, a.gpus, a.parallelism, now, now, 1.0,
                                             0.0, seconds, estimated)
                free[a.node] -= a.gpus
            trigger = "start" if started and replan_after_start else ""
    return _result(name, list(jobs), done, decisions, nodes)


def _move(running: dict[str, _Running], free: dict[str, int], capacity: dict[str, int],
          move: Move, *, now: float, restart_seconds: float, label: str,
          type_of: dict[str, str]) -> None:
    """Restart a running job in its new config; its work done so far is kept."""
    r = running.get(move.job)
    if r is None:
        raise SimulationError(f"{label} at {now:.1f} s: moves {move.job}, which is not running")
    free[r.node] += r.gpus  # its own GPUs are free for its new config
    available = free.get(move.node, 0)
    if available < move.gpus:
        free[r.node] -= r.gpus
        raise SimulationError(
            f"{label} at {now:.1f} s: moves {move.job} to {move.gpus} GPUs on {move.node}, "
            f"which has {available} of {capacity.get(move.node, 0)} free; move it where "
            "enough GPUs are free")
    worked = max(0.0, now - r.since - r.restart)
    r.left = max(0.0, r.left - worked / r.true_total)
    r.gpu_seconds += r.gpus * (now - r.since)
    r.true_total = true_seconds(r.job, move, type_of.get(move.node, ""))
    r.estimated_total = _seconds(r.job.estimates, move.gpus, move.parallelism,
                                 type_of.get(move.node, "")) or r.true_total
    r.node, r.gpus, r.parallelism = move.node, move.gpus, move.parallelism
    r.since, r.restart, r.restarts = now, restart_seconds, r.restarts + 1
    free[move.node] -= move.gpus


def _result(name: str, jobs: list[SimJob], done: list[JobRecord], decisions: list[Decision],
            nodes: tuple[types.Node, ...]) -> Result:
    if not done:
        return Result(name, 0.0, 0.0, 0.0, (), tuple(decisions), 0, 0.0, 0.0, 0)
    first = min(j.arrival for j in jobs)
    makespan = max(r.end for r in done) - first
    held = sum(r.gpu_seconds for r in done)
    capacity = sum(n.gpus for n in nodes)
    solve = [d.plan.solve_seconds for d in decisions]
    swaps = sum(1 for d in decisions[1:] if not d.plan.kept_current)
    return Result(name, makespan, sum(r.end - r.arrival for r in done) / len(done),
                  held / (capacity * makespan) if makespan > 0 else 0.0,
                  tuple(sorted(done, key=lambda r: (r.start, r.name))), tuple(decisions),
                  swaps, sum(solve), max(solve, default=0.0), sum(r.restarts for r in done))


# Metrics -----------------------------------------------------------------------------------

def slowdowns(result: Result, jobs: Sequence[SimJob],
              nodes: Sequence[types.Node] = ()) -> dict[str, float]:
    """Per job, completion time / its true duration alone at its fastest feasible config
    (the fastest that fits one of `nodes`; every config when `nodes` is empty): more GPUs
    than asked never lower a job's own slowdown."""
    by_name = {j.name: j for j in jobs}
    out = {}
    for r in result.jobs:
        job = by_name[r.name]
        fitting = [c.seconds for c in job.true_configs
                   if not nodes or any(types.fits(c, n) for n in nodes)]
        alone = min(fitting or [c.seconds for c in job.true_configs])
        out[r.name] = (r.end - r.arrival) / alone
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank q-th percentile (0 < q <= 100) of a non-empty sequence."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def jain_index(values: Sequence[float]) -> float:
    """Jain's fairness index (sum x)^2 / (n sum x^2): 1 when all are equal, 1/n at worst."""
    squares = sum(v * v for v in values)
    return sum(values) ** 2 / (len(values) * squares) if squares > 0 else 1.0


def job_fairness(result: Result, jobs: Sequence[SimJob],
                 nodes: Sequence[types.Node] = ()) -> float:
    """Jain's index over jobs of their slowdowns (1: every job slowed alike)."""
    return jain_index(list(slowdowns(result, jobs, nodes).values()))


def owner_fairness(result: Result, jobs: Sequence[SimJob],
                   nodes: Sequence[types.Node] = ()) -> float:
    """Jain's index over owners of their jobs' mean slowdown (1: every owner slowed alike)."""
    slow = slowdowns(result, jobs, nodes)
    per_owner: dict[str, list[float]] = {}
    for r in result.jobs:
        per_owner.setdefault(r.owner, []).append(slow[r.name])
    return jain_index([statistics.fmean(v) for v in per_owner.values()])


# Policies ----------------------------------------------------------------------------------

def whole_node_fifo() -> Policy:
    """Whole-node FIFO (re-derived from the queue at every call: FIFO order is stable)."""
    return lambda snapshot, _current: baselines.whole_node_fifo(snapshot)


def fixed_k_fifo(k: int) -> Policy:
    """FIFO with k devices per job."""
    return lambda snapshot, _current: baselines.fixed_k_fifo(snapshot, k)


def sjf_fair_share(k: int | None = None, *, cap: bool = True) -> Policy:
    """Shortest job first by estimate, a GPU share per owner unless `cap` is False
    (`baselines.sjf_fair_share`)."""
    return lambda snapshot, _current: baselines.sjf_fair_share(snapshot, k=k, cap=cap)


def least_attained_service() -> Policy:
    """Least attained service per owner (`baselines.least_attained_service`): the GPU-seconds
    each owner's running jobs held, summed between calls (the simulator calls on every start
    and completion, so the running set is constant between calls)."""
    attained: dict[str, float] = {}
    last: list[types.Snapshot] = []

    def decide(snapshot: types.Snapshot, _current: types.Plan | None) -> types.Plan:
        if last:
            for r in last[0].running:
                attained[r.namespace] = (attained.get(r.namespace, 0.0)
                                         + r.gpus * (snapshot.now - last[0].now))
        last[:] = [snapshot]
        return baselines.least_attained_service(snapshot, attained)
    return decide


def kiln_policy(settings: types.Settings, *, replanning: bool) -> Policy:
    """Kiln's planner: `planner.replan` (re-planning) or plan once, then `planner.extend`
    (new jobs inserted into the current plan, nothing re-optimised)."""
    if replanning:
        return lambda snapshot, current: planner.replan(current, snapshot, settings)
    return lambda snapshot, current: (planner.plan(snapshot, settings) if current is None
                                      else planner.extend(current, snapshot, settings))

"""Placement value types: configs, jobs, nodes, cluster snapshots, plans, settings.

Times are seconds; `Snapshot.now`, `JobRequest.arrival`, `Assignment.start`, `Plan.makespan`
and `Plan.lower_bound` share one absolute clock. No solving, no I/O; never imports torch or
kubernetes.
"""

from __future__ import annotations

import dataclasses
import math

PARALLELISMS = ("single", "ddp", "fsdp")


@dataclasses.dataclass(frozen=True)
class Config:
    """One way to run a job: a parallelism on `gpus` devices of one node, and its duration.

    Attributes:
        parallelism: "single", "ddp" or "fsdp".
        gpus: devices used on one node (GPUs, or CPU worker slots locally), >= 1.
        seconds: estimated wall seconds of the whole job in this config (> 0); `math.inf`
            marks an infeasible config (Saturn's sentinel), which `candidates` drops.
        source: where the estimate came from ("given", "zoo", "profile", "flops", ...).

    Raises:
        ValueError: gpus < 1, or seconds not > 0 (NaN included).
    """

    parallelism: str
    gpus: int
    seconds: float
    source: str = "given"

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise ValueError(f"Config.gpus: must be >= 1 (got {self.gpus})")
        if not self.seconds > 0:  # also rejects NaN
            raise ValueError(f"Config.seconds: must be > 0 (got {self.seconds})")


@dataclasses.dataclass(frozen=True)
class JobRequest:
    """A queued job: its candidate configs and when it arrived (or becomes ready).

    Attributes:
        name: the job's key.
        configs: its candidate configs (`candidates` keeps the usable ones).
        arrival: when it arrived or becomes ready, seconds on the snapshot's clock.
        asked_gpus: its spec.resources.gpus (None: any count), so that a job no node can take
            is told why in its own terms.
    """

    name: str
    configs: tuple[Config, ...]
    arrival: float = 0.0
    asked_gpus: int | None = None


@dataclasses.dataclass(frozen=True)
class Node:
    """A node and its device count (GPUs, or CPU worker slots for the local runner)."""

    name: str
    gpus: int


@dataclasses.dataclass(frozen=True)
class Running:
    """A job already running: pinned on `node`, holding `gpus` for `remaining_seconds` more."""

    job: str
    node: str
    gpus: int
    parallelism: str
    remaining_seconds: float


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """What the planner sees: the clock, the nodes, queued and running jobs, and whether the
    nodes' devices are GPUs ("gpu") or CPU worker slots ("cpu")."""

    now: float
    nodes: tuple[Node, ...]
    queued: tuple[JobRequest, ...]
    running: tuple[Running, ...] = ()
    device: str = "gpu"


@dataclasses.dataclass(frozen=True)
class Assignment:
    """Where, how and when one queued job runs. `start` is absolute (Snapshot.now's clock)."""

    job: str
    node: str
    gpus: int
    parallelism: str
    start: float
    seconds: float

    @property
    def end(self) -> float:
        """Planned end, absolute seconds."""
        return self.start + self.seconds


@dataclasses.dataclass(frozen=True)
class Plan:
    """A placement of every queued job.

    Attributes:
        assignments: one per queued job (running jobs are not listed; they are pinned).
        makespan: absolute time at which the last queued or running job is planned to end.
        solver: which planner produced it: "heuristic", "milp", "whole-node-fifo",
            "fixed-k-fifo", "empty"; a plan kept by `planner.replan` keeps its producer's name.
        reason: why this plan (solver outcome, fallback reason, kept or replaced); for logs.
        solve_seconds: wall seconds spent planning.
        lower_bound: absolute lower bound on the makespan (area and longest-job bounds).
        kept_current: True when `planner.replan` kept the current plan (no swap).
    """

    assignments: tuple[Assignment, ...]
    makespan: float
    solver: str
    reason: str = ""
    solve_seconds: float = 0.0
    lower_bound: float = 0.0
    kept_current: bool = False

    def for_job(self, name: str) -> Assignment | None:
        """The assignment of job `name`, or None when the plan does not place it."""
        return next((a for a in self.assignments if a.job == name), None)


@dataclasses.dataclass(frozen=True)
class Settings:
    """Planner knobs.

    Attributes:
        time_limit_seconds: wall budget of one `planner.plan` call: the heuristic, the MILP
            worker's start, model build, solve and decode; the watchdog kills the worker when
            it runs out, so a call never takes longer (plus the kill itself).
        mip_rel_gap: HiGHS relative gap; profiles carry +-5-10% error, so 0.01-0.02.
        seed: HiGHS random seed.
        threads: HiGHS threads (its branch and bound is largely serial).
        slots: time slots T of the time-indexed model (48-64).
        replan_threshold: a new plan replaces the current one only when its remaining
            makespan is shorter by this fraction.
        freeze_window_seconds: assignments starting within this of `now` keep their slot.
        use_milp: False plans with the heuristic alone.
        k_policy: heuristic GPU-count choice: "best" (every policy, then local search),
            "area" (minimum GPU-area) or "knee" (knee of the speed-up curve).
        knee_efficiency: "knee" takes the next larger k while the step keeps at least this
            fraction of ideal speed-up.
        milp_max_jobs: more queued jobs than this skip the MILP (the heuristic is within a
            few % of the area bound there).
        slot_seconds: fixed slot length (None: derived from the heuristic horizon).
        watchdog_margin_seconds: the end of the budget kept back for the worker to hand its
            plan back: the solver's own deadline is this much before the watchdog (at most half
            the budget; HiGHS overshoots its limit by up to a branch-and-bound step).
    """

    time_limit_seconds: float = 10.0
    mip_rel_gap: float = 0.02
    seed: int = 0
    threads: int = 1
    slots: int = 48
    replan_threshold: float = 0.05
    freeze_window_seconds: float = 60.0
    use_milp: bool = True
    k_policy: str = "best"
    knee_efficiency: float = 0.75
    milp_max_jobs: int = 120
    slot_seconds: float | None = None
    watchdog_margin_seconds: float = 1.0


class Unplaceable(ValueError):
    """Some queued job has no config that fits any node (the operator reports NoFeasibleConfig).

    Attributes:
        jobs: names of the jobs that cannot be placed.
    """

    def __init__(self, problems: dict[str, str]) -> None:
        self.jobs = tuple(problems)
        super().__init__("; ".join(f"job {job}: {why}" for job, why in problems.items()))


def candidates(job: JobRequest) -> tuple[Config, ...]:
    """The job's useful configs: fastest parallelism per GPU count, dominated counts dropped.

    Saturn (VLDB'24) keeps only the fastest technique per k; a larger k that is no faster than
    a smaller one is dominated. Infeasible configs (infinite seconds) are dropped.

    Returns:
        Configs with strictly increasing `gpus` and strictly decreasing `seconds`.
    """
    fastest: dict[int, Config] = {}
    for config in job.configs:
        if math.isinf(config.seconds):
            continue
        best = fastest.get(config.gpus)
        if best is None or config.seconds < best.seconds:
            fastest[config.gpus] = config
    kept: list[Config] = []
    for gpus in sorted(fastest):
        if not kept or fastest[gpus].seconds < kept[-1].seconds:
            kept.append(fastest[gpus])
    return tuple(kept)


def unplaceable_reasons(snapshot: Snapshot) -> dict[str, str]:
    """Per queued job that fits no node, why (empty when every job fits somewhere)."""
    largest = max((n.gpus for n in snapshot.nodes), default=0)
    problems: dict[str, str] = {}
    for job in snapshot.queued:
        usable = candidates(job)
        asked = job.asked_gpus
        if asked and snapshot.device == "cpu":
            problems[job.name] = (
                f"asks for {asked} GPUs; no node has GPUs (only CPU nodes are Ready); add GPU "
                "nodes, or set spec.resources.gpus: 0 to train on CPU")
        elif asked and asked > largest:
            problems[job.name] = (
                f"asks for {asked} GPUs; the largest node has {largest}; lower "
                "spec.resources.gpus, or add a node with that many")
        elif not usable:
            problems[job.name] = (
                f"has no feasible config: no parallelism and device count that "
                f"spec.resources and batchSize allow fits a node (at most {largest} devices) "
                "and its device memory; use a smaller model or batch, or allow other counts")
        elif usable[0].gpus > largest:
            problems[job.name] = (f"its smallest config needs {usable[0].gpus} devices but the "
                                  f"largest node has {largest}")
    return problems

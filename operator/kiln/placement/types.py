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
    """One way to run a job: a parallelism on `gpus` devices of each of `node_count` nodes,
    and its duration.

    Attributes:
        parallelism: "single", "ddp" or "fsdp" ("ddp" or "fsdp" when `node_count` > 1).
        gpus: devices used on each node (GPUs, or CPU worker slots locally), >= 1.
        seconds: estimated wall seconds of the whole job in this config (> 0); `math.inf`
            marks an infeasible config (Saturn's sentinel), which `candidates` drops.
        source: where the estimate came from ("given", "zoo", "profile", "flops", ...).
        device_type: the node GPU type it was estimated for (`Node.device_type`); "" fits
            every node.
        nodes: the names of the nodes the job's scheduling constraints allow (nodeSelector,
            affinity, taints, CPU/memory); None fits every node.
        node_count: nodes it spans, one trainer pod each (a gang, started and restarted
            together); each holds `gpus`.

    Raises:
        ValueError: gpus < 1, node_count < 1, a single process on several nodes, or seconds
            not > 0 (NaN included).
    """

    parallelism: str
    gpus: int
    seconds: float
    source: str = "given"
    device_type: str = ""
    nodes: frozenset[str] | None = None
    node_count: int = 1

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise ValueError(f"Config.gpus: must be >= 1 (got {self.gpus})")
        if self.node_count < 1 or (self.node_count > 1 and self.parallelism == "single"):
            raise ValueError(f"Config.node_count: must be >= 1, and 1 for parallelism single "
                             f"(got {self.node_count}, {self.parallelism})")
        if not self.seconds > 0:  # also rejects NaN
            raise ValueError(f"Config.seconds: must be > 0 (got {self.seconds})")
        if self.nodes is not None and not isinstance(self.nodes, frozenset):
            object.__setattr__(self, "nodes", frozenset(self.nodes))  # as decoded: a tuple

    @property
    def devices(self) -> int:
        """Devices over all its nodes (what its GPU-seconds are counted in)."""
        return self.gpus * self.node_count


@dataclasses.dataclass(frozen=True)
class JobRequest:
    """A queued job: its candidate configs and when it arrived (or becomes ready).

    Attributes:
        name: the job's key.
        configs: its candidate configs (`candidates` keeps the usable ones).
        arrival: when it arrived or becomes ready, seconds on the snapshot's clock.
        asked_gpus: its spec.resources.gpus (None: any count), so that a job no node can take
            is told why in its own terms.
        weight: its priority weight (> 0) in the completion-time objective (1: normal).
        namespace: its namespace, for per-namespace GPU quotas ("" : none).
        group: the sweep it belongs to ("" : none); a queue whose jobs all share one group
            is planned for makespan under the "auto" objective.
    """

    name: str
    configs: tuple[Config, ...]
    arrival: float = 0.0
    asked_gpus: int | None = None
    weight: float = 1.0
    namespace: str = ""
    group: str = ""

    def __post_init__(self) -> None:
        if not (self.weight > 0 and math.isfinite(self.weight)):
            raise ValueError(f"JobRequest.weight: job {self.name} must have a finite weight "
                             f"> 0 (got {self.weight})")
        if not math.isfinite(self.arrival):
            raise ValueError(f"JobRequest.arrival: job {self.name} must arrive at a finite "
                             f"time (got {self.arrival})")


@dataclasses.dataclass(frozen=True)
class Node:
    """A node, its device count (GPUs, or CPU worker slots for the local runner) and its GPU
    type ("" : untyped; only configs of that type, or untyped ones, run on it)."""

    name: str
    gpus: int
    device_type: str = ""

    def __post_init__(self) -> None:
        if self.gpus < 0:
            raise ValueError(f"Node.gpus: node {self.name} must have >= 0 devices "
                             f"(got {self.gpus})")


def fits_somewhere(config: Config, nodes: tuple[Node, ...]) -> bool:
    """Whether `config` fits `config.node_count` distinct nodes of `nodes`."""
    return sum(fits(config, n) for n in nodes) >= config.node_count


def fits(config: Config, node: Node) -> bool:
    """Whether `config` can run on `node`: enough devices, its GPU type if it names one, and
    one of its allowed nodes if it lists them."""
    return (config.gpus <= node.gpus and config.device_type in ("", node.device_type)
            and (config.nodes is None or node.name in config.nodes))


@dataclasses.dataclass(frozen=True)
class Running:
    """A job already running: pinned on `node`, holding `gpus` for `remaining_seconds` more;
    `namespace` counts its GPUs against that namespace's quota."""

    job: str
    node: str
    gpus: int
    parallelism: str
    remaining_seconds: float
    namespace: str = ""


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """What the planner sees: the clock, the nodes, queued and running jobs, and whether the
    nodes' devices are GPUs ("gpu") or CPU worker slots ("cpu")."""

    now: float
    nodes: tuple[Node, ...]
    queued: tuple[JobRequest, ...]
    running: tuple[Running, ...] = ()
    device: str = "gpu"

    def __post_init__(self) -> None:
        if not math.isfinite(self.now):
            raise ValueError(f"Snapshot.now: must be a finite time (got {self.now})")


@dataclasses.dataclass(frozen=True)
class Assignment:
    """Where, how and when one queued job runs. `start` is absolute (Snapshot.now's clock).

    `gpus` are held on `node` and on each of `peer_nodes` (the other nodes of a multi-node
    config, in rank order after `node`, which runs rank 0).
    """

    job: str
    node: str
    gpus: int
    parallelism: str
    start: float
    seconds: float
    peer_nodes: tuple[str, ...] = ()

    @property
    def end(self) -> float:
        """Planned end, absolute seconds."""
        return self.start + self.seconds

    @property
    def all_nodes(self) -> tuple[str, ...]:
        """Every node it runs on, rank order."""
        return (self.node, *self.peer_nodes)

    @property
    def devices(self) -> int:
        """Devices over all its nodes."""
        return self.gpus * (1 + len(self.peer_nodes))


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
        objective: what it was planned for: "makespan" or "completion-time"; `planner.replan`
            judges a fresh plan against it on this objective.
        cost: its value on `objective` (`heuristic.cost`), lower is better.
        milp: how the MILP fared in the call that made it: "won" (its plan is used), "lost"
            (the heuristic's was no worse), "failed" (no usable MILP plan), or "skipped".
    """

    assignments: tuple[Assignment, ...]
    makespan: float
    solver: str
    reason: str = ""
    solve_seconds: float = 0.0
    lower_bound: float = 0.0
    kept_current: bool = False
    objective: str = "makespan"
    cost: float = 0.0
    milp: str = "skipped"

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
        replan_threshold: under makespan, a new plan replaces the current one only when it
            is better by this fraction (`planner.replan`); under completion time the new plan
            is always taken (queued jobs are not pinned).
        freeze_window_seconds: under makespan, assignments starting within this of `now`
            keep their slot (under completion time queued jobs are re-planned freely).
        use_milp: True also runs the MILP on small makespan batches (opt-in: on the placement
            benchmark it beat the heuristic in under half of the calls where it ran, by
            little, at many times the CPU).
        k_policy: heuristic GPU-count choice: "best" (every policy, then local search),
            "area" (minimum GPU-area) or "knee" (knee of the speed-up curve).
        knee_efficiency: "knee" takes the next larger k while the step keeps at least this
            fraction of ideal speed-up.
        milp_max_jobs: more queued jobs than this skip the MILP: on larger instances it beat
            the heuristic in about a fifth of the calls, by a median 1.6%, at about 20x the
            CPU; on small makespan instances it finds the optimum the heuristic misses.
        slot_seconds: fixed slot length (None: derived from the heuristic horizon).
        watchdog_margin_seconds: the end of the budget kept back for the worker to hand its
            plan back: the solver's own deadline is this much before the watchdog (at most half
            the budget; HiGHS overshoots its limit by up to a branch-and-bound step).
        objective: "auto", "makespan" or "completion-time". Completion time minimises the
            priority- and age-weighted sum of completion times plus a GPU-second cost;
            "auto" uses makespan for a sweep (every queued job in one `JobRequest.group`, or,
            with no groups, at least `sweep_min_jobs` jobs that arrived within
            `sweep_window_seconds` of each other while nothing of another batch runs) and
            completion time otherwise.
        aging_seconds: a queued job's weight grows by its priority weight every this many
            seconds it has waited, so long jobs behind a stream of short ones start.
        gpu_cost: scales the price of a GPU-second under completion time: taking k GPUs for
            d seconds delays the other queued jobs by about k d / (cluster GPUs) each, so it
            costs gpu_cost times their total weight times that; a larger k is chosen only when
            its speed-up pays for it.
        unseen_weight: the GPU price counts at least this many times the job's own weight as
            waiting: jobs that arrive while it runs, which no plan sees yet. Without it a job
            alone in a short queue takes a whole node and later arrivals wait behind it.
            Tuned on the placement benchmark's tuning traces (never its held-out ones): 8 gave
            p95 slowdown 1.27x the best baseline's, 16 gave 1.12x, both at mean JCT 0.96-0.97x.
        fair_share: how strongly a namespace's running GPUs lower its queued jobs' weights
            (completion time): by 1 / (1 + fair_share x held / its share of the cluster);
            0 turns it off.
        sweep_window_seconds: arrivals this close together count as one batch ("auto").
        sweep_min_jobs: fewer queued jobs than this are never taken for a sweep ("auto").
        namespace_gpu_quota: (namespace, GPUs) pairs: at most that many GPUs run at once for
            the namespace's jobs in a plan (running jobs count).
    """

    time_limit_seconds: float = 10.0
    mip_rel_gap: float = 0.02
    seed: int = 0
    threads: int = 1
    slots: int = 48
    replan_threshold: float = 0.05
    freeze_window_seconds: float = 60.0
    use_milp: bool = False
    k_policy: str = "best"
    knee_efficiency: float = 0.75
    milp_max_jobs: int = 30
    slot_seconds: float | None = None
    watchdog_margin_seconds: float = 1.0
    objective: str = "auto"
    aging_seconds: float = 1800.0
    gpu_cost: float = 1.0
    unseen_weight: float = 16.0
    fair_share: float = 1.0
    sweep_window_seconds: float = 60.0
    sweep_min_jobs: int = 2
    namespace_gpu_quota: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"Settings.objective: unknown {self.objective!r} (allowed "
                             f"{', '.join(OBJECTIVES)})")
        if not self.aging_seconds > 0:
            raise ValueError(f"Settings.aging_seconds: must be > 0 (got {self.aging_seconds})")
        if not self.gpu_cost >= 0:
            raise ValueError(f"Settings.gpu_cost: must be >= 0 (got {self.gpu_cost})")
        if not self.unseen_weight >= 0:
            raise ValueError(f"Settings.unseen_weight: must be >= 0 (got {self.unseen_weight})")
        for namespace, gpus in self.namespace_gpu_quota:
            if gpus < 1:
                raise ValueError(f"Settings.namespace_gpu_quota: namespace {namespace!r} needs "
                                 f"a quota >= 1 GPU (got {gpus})")


OBJECTIVES = ("auto", "makespan", "completion-time")


class Unplaceable(ValueError):
    """Some queued job has no config that fits any node (the operator reports NoFeasibleConfig).

    Attributes:
        jobs: names of the jobs that cannot be placed.
    """

    def __init__(self, problems: dict[str, str]) -> None:
        self.jobs = tuple(problems)
        super().__init__("; ".join(f"job {job}: {why}" for job, why in problems.items()))


def candidates(job: JobRequest) -> tuple[Config, ...]:
    """The job's useful configs: per GPU type, fastest parallelism per GPU count, dominated
    counts dropped.

    Saturn (VLDB'24) keeps only the fastest technique per k; a larger k that is no faster than
    a smaller one is dominated. Infeasible configs (infinite seconds) are dropped.

    Returns:
        Configs ordered by `gpus`, then `seconds`; those of one `device_type` and
        `node_count` have strictly increasing `gpus` and strictly decreasing `seconds` (with
        one type and one node each: all of them).
    """
    fastest: dict[tuple[str, int, int], Config] = {}
    for config in job.configs:
        if math.isinf(config.seconds):
            continue
        key = (config.device_type, config.node_count, config.gpus)
        best = fastest.get(key)
        if best is None or config.seconds < best.seconds:
            fastest[key] = config
    # Node counts are kept apart: a one-node config may fit no node where a multi-node one
    # does, so neither dominates the other.
    kept: dict[tuple[str, int], list[Config]] = {}
    for device_type, node_count, gpus in sorted(fastest):
        same = kept.setdefault((device_type, node_count), [])
        if not same or fastest[device_type, node_count, gpus].seconds < same[-1].seconds:
            same.append(fastest[device_type, node_count, gpus])
    return tuple(sorted((c for same in kept.values() for c in same),
                        key=lambda c: (c.gpus, c.seconds, c.node_count, c.device_type)))


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
        elif asked and asked > largest and not any(c.node_count > 1 for c in usable):
            problems[job.name] = (
                f"asks for {asked} GPUs; the largest node has {largest}; lower "
                "spec.resources.gpus, add a node with that many, or let it span nodes "
                f"(spec.resources.nodes, or gpusPerNode {largest})")
        elif not usable:
            problems[job.name] = (
                f"has no feasible config: no parallelism and device count that "
                f"spec.resources and batchSize allow fits a node (at most {largest} devices) "
                "and its device memory; use a smaller model or batch, or allow other counts")
        elif (any(fits(c, n) for c in usable for n in snapshot.nodes)
              and not any(fits_somewhere(c, snapshot.nodes) for c in usable)):
            wide = min(usable, key=lambda c: c.node_count)
            problems[job.name] = (
                f"needs {wide.node_count} nodes with {wide.gpus} free devices each, but only "
                f"{sum(fits(wide, n) for n in snapshot.nodes)} node(s) have that many; add "
                "nodes, or lower spec.resources.gpus / spec.resources.nodes")
        elif not any(fits(c, n) for c in usable for n in snapshot.nodes):
            allowed = [n for n in snapshot.nodes
                       if usable[0].nodes is None or n.name in usable[0].nodes]
            most = max((n.gpus for n in allowed), default=0)
            if usable[0].nodes is not None and usable[0].gpus > most:
                problems[job.name] = (
                    f"its smallest config needs {usable[0].gpus} devices but the nodes its "
                    f"scheduling constraints allow ({', '.join(n.name for n in allowed)}) "
                    f"have at most {most}; allow more nodes, or fewer GPUs")
                continue
            problems[job.name] = (f"its smallest config needs {usable[0].gpus} devices but the "
                                  f"largest node has {largest}" if usable[0].gpus > largest else
                                  f"no node has a GPU type it was estimated for "
                                  f"({', '.join(sorted({c.device_type for c in usable}))}); "
                                  "add such nodes, or check the GPU-type node label")
    return problems

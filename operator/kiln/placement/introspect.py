"""Introspection: at a re-plan, propose moves of running jobs (grow, shrink, move to a node).

A move is a checkpoint-restart at another device count; it is proposed only when its predicted
gain beats the job's restart cost by `Policy.min_gain` and the job has not moved recently.
Pure functions over placement types; the operator and the simulator apply the moves.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from kiln.placement import types

GROW, SHRINK, MOVE = "grow", "shrink", "move"
# Weight of the newest measurement in a job's restart cost (the rest is its history).
RESTART_COST_WEIGHT = 0.5


@dataclasses.dataclass(frozen=True)
class Policy:
    """When a running job may move.

    Attributes:
        min_gain: the time a move saves must be at least this many times its restart cost
            (>= 1; larger is more cautious).
        min_interval_seconds: a job moves again at the earliest this many seconds after its
            last move, so its measurements settle between moves and nothing flaps.
        default_restart_seconds: restart cost (stop to first step after the restart) of a job
            that has not restarted yet.
        short_job_weight: at most this many times a second of the shrunk job counts a second
            of wait a SHRINK saves a shorter queued job: each job's seconds are weighed by
            1 / its shortest duration (slowdown, as the tail and fairness are judged), capped
            here so that mean completion time is not traded away (1: plain seconds).
        grow_price: what a move onto more devices pays for each extra device-second it
            holds, in seconds of the job's own time times the pool's device count (the
            planner's `unseen_weight` x `gpu_cost`): devices taken while idle are likely
            wanted by jobs that arrive, and giving them back costs a restart; 0: free.
        grow_load_exponent: `grow_price` is scaled by the pool's busy share (devices that
            running jobs hold plus the fewest each queued job needs, over all devices) to
            this power: a device taken from a mostly idle pool is seldom one an arrival then
            waits for, and that chance climbs steeply as the pool fills (0: a fixed price).
    """

    min_gain: float = 2.0
    min_interval_seconds: float = 300.0
    default_restart_seconds: float = 60.0
    short_job_weight: float = 30.0
    grow_price: float = types.Settings.unseen_weight * types.Settings.gpu_cost
    grow_load_exponent: float = 2.0

    def __post_init__(self) -> None:
        if not self.min_gain >= 1.0:
            raise ValueError(f"Policy.min_gain: must be >= 1 (got {self.min_gain})")
        if not self.min_interval_seconds >= 0 or not self.default_restart_seconds >= 0:
            raise ValueError("Policy.min_interval_seconds and default_restart_seconds: must "
                             "be >= 0")
        if not self.grow_price >= 0:
            raise ValueError(f"Policy.grow_price: must be >= 0 (got {self.grow_price})")
        if not self.grow_load_exponent >= 0:
            raise ValueError(f"Policy.grow_load_exponent: must be >= 0 (got "
                             f"{self.grow_load_exponent})")
        if not self.short_job_weight >= 1.0:
            raise ValueError(f"Policy.short_job_weight: must be >= 1 (got "
                             f"{self.short_job_weight})")


@dataclasses.dataclass(frozen=True)
class JobState:
    """What introspection knows of a running job beyond its `types.Running` entry.

    Attributes:
        configs: its candidate configs (`types.candidates`), ideally refined by its measured
            throughput (`estimate.refine`); their ratios predict its remaining time at other k.
        last_move: absolute time of its last move (None: it has not moved).
        restart_seconds: its measured restart cost (`update_restart_cost`), or None.
        compute_scale: share of the estimated per-step compute it still does (< 1 once
            freezing cut its backward work), which makes its extra devices less useful.
    """

    configs: tuple[types.Config, ...]
    last_move: float | None = None
    restart_seconds: float | None = None
    compute_scale: float = 1.0


@dataclasses.dataclass(frozen=True)
class Move:
    """A proposed checkpoint-restart of a running job at another node or device count.

    Attributes:
        job: the job's key.
        kind: GROW, SHRINK (devices for queued jobs) or MOVE (to another node).
        from_node: where it runs now.
        from_gpus: devices it holds now.
        node: where it restarts.
        gpus: devices it restarts with.
        parallelism: its parallelism there.
        remaining_seconds: its predicted remaining time after the move, restart included.
        gain_seconds: predicted completion time saved over all jobs, net of the restart.
        restart_seconds: the restart cost assumed.
        helped: queued jobs a SHRINK lets start now.
    """

    job: str
    kind: str
    from_node: str
    from_gpus: int
    node: str
    gpus: int
    parallelism: str
    remaining_seconds: float
    gain_seconds: float
    restart_seconds: float
    helped: tuple[str, ...] = ()


def update_restart_cost(previous: float | None, observed: float) -> float:
    """A job's restart cost after one more measured restart (stop to first step), smoothed."""
    if previous is None:
        return observed
    return RESTART_COST_WEIGHT * observed + (1 - RESTART_COST_WEIGHT) * previous


def scale_compute(configs: tuple[types.Config, ...], scale: float) -> tuple[types.Config, ...]:
    """Configs of a job whose per-step compute shrank to `scale` of the estimate.

    Each config's seconds are read as serial + compute / k (fitted through the smallest and
    largest k); only the compute part shrinks, so larger k gain less than before.
    """
    if scale >= 1.0 or len(configs) < 2:
        return configs
    low, high = configs[0], configs[-1]
    per_device = (low.seconds - high.seconds) / (1 / low.gpus - 1 / high.gpus)
    compute = max(0.0, min(per_device, low.seconds * low.gpus))
    cut = (1 - max(0.0, scale)) * compute
    return tuple(dataclasses.replace(c, seconds=max(c.seconds - cut / c.gpus, c.seconds * 1e-3))
                 for c in configs)


def remaining_at(running: types.Running, configs: tuple[types.Config, ...],
                 config: types.Config) -> float | None:
    """The running job's remaining seconds in `config`: its remaining time now, scaled by the
    configs' ratio; None when its current device count has no config to scale from."""
    current = next((c for c in configs if c.gpus == running.gpus), None)
    if current is None:
        return None
    return running.remaining_seconds * config.seconds / current.seconds


def propose(snapshot: types.Snapshot, states: Mapping[str, JobState],
            policy: Policy) -> tuple[Move, ...]:
    """Moves worth their restart for the running jobs of `snapshot`, best first.

    For each running job that may move (in `states`, and `policy.min_interval_seconds` past
    its last move) the best of: another device count on its node or a count on another node, using
    devices no queued job could start on now (GROW / MOVE; saving its own remaining time, less
    `policy.grow_price` per extra device-second scaled by how busy the pool is), or
    fewer devices so that a queued job that fits nowhere starts now (SHRINK; saving that job's
    wait, less the time the shrunk job loses). A move is kept when the time saved is at least
    `policy.min_gain` times the restart cost; moves are taken greedily by net gain, each
    taking its devices, so two never count on the same free devices or the same queued job.

    Args:
        snapshot: the cluster now (nodes, running and queued jobs).
        states: running job key -> what introspection knows of it; jobs absent never move.
        policy: gain and interval thresholds.
    """
    free = {n.name: n.gpus for n in snapshot.nodes}
    for r in snapshot.running:
        if r.node in free:
            free[r.node] -= r.gpus
    needs = {q.name: cs[0].gpus for q in snapshot.queued if (cs := types.candidates(q))}
    devices = max(1, sum(n.gpus for n in snapshot.nodes))
    busy = sum(r.gpus for r in snapshot.running) + sum(needs.values())
    price = (policy.grow_price / devices
             * min(1.0, busy / devices) ** policy.grow_load_exponent)
    chosen: list[Move] = []
    moved: set[str] = set()
    helped: set[str] = set()
    while True:
        options = [m for r in snapshot.running if r.job in states and r.job not in moved
                   and r.node in free and _settled(states[r.job], snapshot.now, policy)
                   for m in _options(snapshot, r, states[r.job], free,
                                     {k: v for k, v in needs.items() if k not in helped},
                                     policy, price)]
        if not options:
            return tuple(chosen)
        best = max(options, key=lambda m: (m.gain_seconds, -m.gpus))
        chosen.append(best)
        moved.add(best.job)
        helped.update(best.helped)
        free[best.from_node] += best.from_gpus
        free[best.node] -= best.gpus
        for job in best.helped:
            free[best.node] -= needs[job]


def _settled(state: JobState, now: float, policy: Policy) -> bool:
    """Whether the job's last move (if any) is at least the policy's interval ago."""
    return state.last_move is None or now - state.last_move >= policy.min_interval_seconds


def _options(snapshot: types.Snapshot, running: types.Running, state: JobState,
             free: dict[str, int], needs: dict[str, int], policy: Policy,
             price: float) -> list[Move]:
    """Every move of one job that passes the gain threshold; `price`: what a grow pays per
    extra device-second, in seconds of the job's own time."""
    configs = scale_compute(types.candidates(types.JobRequest(running.job, state.configs)),
                            state.compute_scale)
    restart = (state.restart_seconds if state.restart_seconds is not None
               else policy.default_restart_seconds)
    now_left = remaining_at(running, configs, next(
        (c for c in configs if c.gpus == running.gpus), configs[0])) if configs else None
    if now_left is None:
        return []
    # Free devices a waiting job could start on now are theirs, not a running job's.
    claimed = {n for n, f in free.items() if any(need <= f for need in needs.values())}
    found: list[Move] = []
    for node, spare in free.items():
        own = node == running.node
        if node in claimed and not own:
            continue
        room = spare + (running.gpus if own else 0)
        for config in configs:
            if own and config.gpus == running.gpus or config.gpus > room:
                continue
            if not own and config.nodes is not None and node not in config.nodes:
                continue  # its scheduling constraints keep it off that node
            if own and node in claimed and config.gpus > running.gpus:
                continue
            after = remaining_at(running, configs, config)
            assert after is not None  # the current count has a config (checked above)
            saved = now_left - after - price * max(
                0.0, config.gpus * after - running.gpus * now_left)
            kind = MOVE if not own else GROW if config.gpus > running.gpus else SHRINK
            waiting: tuple[str, ...] = ()
            if kind == SHRINK:
                waiting, saved = _shrink_saving(snapshot, running, node, room - config.gpus,
                                                needs, saved, restart, configs,
                                                policy.short_job_weight)
            if saved < policy.min_gain * restart or saved - restart <= 0:
                continue
            found.append(Move(
                job=running.job, kind=kind, from_node=running.node, from_gpus=running.gpus,
                node=node, gpus=config.gpus, parallelism=config.parallelism,
                remaining_seconds=after + restart, gain_seconds=saved - restart,
                restart_seconds=restart, helped=waiting))
    return found


def _shrink_saving(snapshot: types.Snapshot, running: types.Running, node: str, room: int,
                   needs: dict[str, int], own_saving: float, restart: float,
                   configs: tuple[types.Config, ...],
                   short_job_weight: float) -> tuple[tuple[str, ...], float]:
    """(queued jobs that start in `room` freed devices, time saved net of the shrunk job's
    loss `-own_saving`); nothing when no waiting job fits there now and nowhere else.

    A queued job's saved wait counts in the shrunk job's seconds, weighed by the ratio of
    their shortest durations (at most `short_job_weight`): a minute's wait slows a short job
    by more than a minute's delay slows a long one."""
    own = min((c.seconds for c in configs), default=0.0)
    free_now = {n.name: n.gpus for n in snapshot.nodes}
    for r in snapshot.running:
        if r.node in free_now:
            free_now[r.node] -= r.gpus
    started: list[str] = []
    saved = own_saving
    for queued in snapshot.queued:  # in arrival order, as the queue serves them
        need = needs.get(queued.name)
        if need is None or need > room or any(need <= f for f in free_now.values()):
            continue
        started.append(queued.name)
        room -= need
        shortest = min(c.seconds for c in types.candidates(queued))
        weight = min(short_job_weight, max(1.0, own / shortest)) if shortest > 0 else 1.0
        # It would wait until enough devices free up somewhere, and at least as long again
        # as it has waited: a running job past its estimate is seen as about to end at every
        # call, so the estimates alone would promise it a start that keeps slipping. Now it
        # waits for the stop.
        wait = max(_wait_for(snapshot, need), snapshot.now - queued.arrival)
        saved += weight * max(0.0, wait - restart)
    return tuple(started), saved if started else -math.inf


def _wait_for(snapshot: types.Snapshot, need: int) -> float:
    """Seconds until some node has `need` free devices as its running jobs end."""
    best = math.inf
    for node in snapshot.nodes:
        here = sorted((r.remaining_seconds, r.gpus) for r in snapshot.running
                      if r.node == node.name)
        free = node.gpus - sum(g for _, g in here)
        if free >= need:
            return 0.0
        for left, gpus in here:
            free += gpus
            if free >= need:
                best = min(best, left)
                break
    return best

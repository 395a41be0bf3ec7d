"""The operator's placement loop: one asyncio task that plans queued jobs and starts them.

On every wake-up (a job queued or left, a trainer ended) and at least every interval it
re-plans each device pool (`cluster.pools`), starts jobs by the placement queue's rule
(`queues.NodeQueues`) and moves running jobs that introspection says gain (`introspect`). The
queue and the running jobs are in memory; kopf's resume handlers refill both after a restart.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kiln import api
from kiln.controller import cluster, feasible, jobs, kube, listing, metrics
from kiln.placement import introspect, queues, types
from kiln.zoo import records

if TYPE_CHECKING:  # it imports torch: the methods that use it import it, so the operator
    from kiln.placement import estimate  # starts without torch (its first job imports it)

_log = logging.getLogger(__name__)
PUBLISH_CONCURRENCY = 16
# A trainer's reported throughput, and the ETA it implies for its spec's samples left, are
# believed between these multiples of the job's own estimate at its device count (its profile,
# zoo relatives or model FLOPs). The estimate is optimistic (small models run far below their
# FLOPs' pace), so little room above it: a report of more makes its devices seem about to come
# free; below, room for any real job, none for a speed that makes the planner's numbers infinite.
SPEED_TRUST = (1e-4, 10.0)


@dataclasses.dataclass(frozen=True)
class Queued:
    """A job waiting for its plan to reach it.

    Attributes:
        ref: the job.
        job: the parsed job.
        warm_start: the warm-start decision made at admission.
        since: epoch seconds it was queued (its arrival for the planner).
        measured: its model as the profiling pod measured it (entrypoint models), or None.
    """

    ref: jobs.JobRef
    job: api.TrainingJob
    warm_start: api.WarmStartDecision
    since: float
    measured: estimate.ModelMeasurement | None = None
    grant: Grant | None = None


@dataclasses.dataclass(frozen=True)
class Grant:
    """What an outside quota system (Kueue) admitted a job to: Kiln places it only there.

    Attributes:
        node_labels: labels a node must carry to run it (its admitted flavors' node labels).
        gpus: the most GPUs per pod it may take (None: no cap).
    """

    node_labels: tuple[tuple[str, str], ...] = ()
    gpus: int | None = None

    def allows(self, node: Mapping[str, Any]) -> bool:
        """Whether `node` (a v1 Node) carries every admitted node label."""
        labels = (node.get("metadata") or {}).get("labels") or {}
        return all(labels.get(k) == v for k, v in self.node_labels)


Launch = Callable[[Queued, types.Assignment, str], Awaitable[bool]]
Publish = Callable[[Queued, types.Assignment, str], Awaitable[None]]
Unplaceable = Callable[[Queued, str], Awaitable[None]]
Resize = Callable[[jobs.JobRef, introspect.Move, str], Awaitable[bool]]


@dataclasses.dataclass(frozen=True)
class Placed:
    """A job this loop started, for introspection while it runs.

    Attributes:
        entry: its queue entry.
        device: "gpu" or "cpu".
        configs: its runtime estimates.
        last_move: epoch seconds of its last move (None: not moved).
    """

    entry: Queued
    device: str
    configs: tuple[types.Config, ...]
    last_move: float | None = None


@dataclasses.dataclass(frozen=True)
class LoopSettings:
    """Knobs of the loop: its slice of `settings.Options` (`main.loop_settings` makes it; no
    defaults here)."""

    interval_seconds: float
    cpu_slots: int
    max_gpus: int
    planner: types.Settings
    gpu_type: cluster.GpuType | None
    gpu_type_label: str
    # the extended resources that count as GPUs, in the order a node's is chosen
    gpu_resources: tuple[str, ...]
    resize: introspect.Policy | None  # None: running jobs never move
    # priorityClassName -> weight in the completion-time objective (others: 1)
    priority_weights: Mapping[str, float]


class PlacementLoop:
    """The queue and the loop (module docstring).

    `add` on admission and on resumption from suspension, `remove` on start, suspension and
    deletion. Status is written by the callbacks, never here.

    Args:
        client: API client (lists nodes and pods).
        settings: loop knobs.
        launch: starts an assignment; False when the job can no longer start.
        publish: records a queued job's planned node and start.
        unplaceable: reports a job that fits no node, with the reason.
        zoo_records: the zoo's records for runtime estimates (may raise nothing; [] if none).
        metrics: operator metrics.
        clock: epoch seconds.
        eta_seconds: job key -> seconds left as its trainer last reported.
        resize: restarts a running job as a move says; False when it no longer runs.
        hold: True for an entry that must not be queued yet (a job its admission gate has
            not admitted: `gates.Gate.holds`).
    """

    def __init__(self, *, client: kube.Client, settings: LoopSettings, launch: Launch,
                 publish: Publish, unplaceable: Unplaceable,
                 zoo_records: Callable[[], Sequence[records.ZooRecord]],
                 metrics: metrics.OperatorMetrics, clock: Callable[[], float],
                 eta_seconds: dict[str, float], resize: Resize | None = None,
                 leading: Callable[[], Awaitable[bool]] | None = None,
                 hold: Callable[[Queued], bool] | None = None) -> None:
        self._client = client
        self._hold = hold  # True: the entry waits for an outside admission (Kueue's)
        # None: standalone; else asked each round, so a replica that kopf paused (another
        # replica leads) starts no pod from a queue it filled while it led.
        self._leading = leading
        self._settings = settings
        self._launch, self._publish, self._unplaceable = launch, publish, unplaceable
        self._zoo_records = zoo_records
        self._metrics = metrics
        self._clock = clock
        self._eta = eta_seconds
        self._resize = resize
        self._placed: dict[str, Placed] = {}  # job key -> running job this loop started
        self._progress: dict[str, tuple[float, int | None]] = {}  # key -> (samples/s, step)
        self._restart_seconds: dict[str, float] = {}  # key -> measured restart cost
        self._stopped: dict[str, float] = {}  # key -> when a move stopped it, until it steps
        self._work: dict[str, estimate.Workload] = {}
        self._moving: dict[str, tuple[str, introspect.Move]] = {}  # key -> (pool, move)
        self._compute: dict[str, float] = {}  # key -> share of its compute freezing left
        self._distrusted: set[str] = set()  # keys whose reports were bounded (logged once)
        self._queue: dict[jobs.JobRef, Queued] = {}
        self._configs: dict[tuple[jobs.JobRef, str], tuple[types.Config, ...]] = {}
        # (ref, device) -> the GPU types its configs were estimated for
        self._kinds: dict[tuple[jobs.JobRef, str], tuple[str, ...]] = {}
        self._pools: dict[str, queues.NodeQueues] = {}  # device pool -> its queues
        self._gpu_resource: dict[str, str] = {}  # GPU node -> its GPUs' resource name
        # job -> the nodes its scheduling constraints allow, as of the last round
        self._allowed: dict[jobs.JobRef, frozenset[str]] = {}
        self._wake = asyncio.Event()
        self.ticks = 0

    def __len__(self) -> int:
        return len(self._queue)

    async def leads(self) -> bool:
        """Whether this replica leads (always, standalone); other periodic work asks too.

        Raises:
            kube.ApiError: the peering object could not be read.
        """
        return self._leading is None or await self._leading()

    def __contains__(self, ref: object) -> bool:
        return ref in self._queue

    def add(self, entry: Queued) -> None:
        """Queue a job (replacing an older entry for it) and wake the loop; a no-op for an
        entry that `hold` says waits for an outside admission."""
        if self._hold is not None and self._hold(entry):
            return
        self._queue[entry.ref] = entry
        self._metrics.queued_jobs.set(len(self._queue))
        self.wake()

    def remove(self, ref: jobs.JobRef) -> None:
        """Take a job out of the queue (no-op if absent) and wake the loop."""
        if self._queue.pop(ref, None) is not None:
            self._metrics.queued_jobs.set(len(self._queue))
        self._allowed.pop(ref, None)
        for key in [k for k in self._configs if k[0] == ref]:
            del self._configs[key]
            self._kinds.pop(key, None)
        self.wake()

    async def adopt(self, entry: Queued, device: str, *, since: float | None) -> None:
        """Know again a job placed before an operator restart (the resume handler reads it
        from its status), so that introspection may move it; a no-op for a known job.

        Args:
            entry: the job, as if queued.
            device: "gpu" or "cpu", as status.placement says.
            since: epoch seconds its current trainer has run since, counted as its last move
                so that its measurements settle first (None: movable now).
        """
        if entry.ref.key in self._placed:
            return
        loop = asyncio.get_running_loop()  # estimates may count a dataset folder's files
        configs = await loop.run_in_executor(None, self._estimate, entry, device)
        self._placed[entry.ref.key] = Placed(entry, device, configs, last_move=since)
        self.wake()

    def observe_progress(self, key: str, *, samples_per_second: float | None,
                         step: int | None, now: float,
                         compute_fraction: float | None = None) -> None:
        """A running job's trainer reported progress: its throughput refines its estimates,
        its first steps after a move measure its restart cost, and the share of its compute
        that freezing left (`introspect.JobState.compute_scale`) discounts extra devices."""
        if compute_fraction is not None and 0 < compute_fraction <= 1:
            self._compute[key] = compute_fraction
        if samples_per_second is None or not samples_per_second > 0:
            return
        self._progress[key] = (samples_per_second, step)
        stopped = self._stopped.pop(key, None)
        if stopped is not None:
            self._restart_seconds[key] = introspect.update_restart_cost(
                self._restart_seconds.get(key), max(0.0, now - stopped))

    def wake(self) -> None:
        """Plan again soon (a job arrived or left, devices were freed)."""
        self._wake.set()

    async def run(self) -> None:
        """Plan forever: on every wake-up, at least every interval. Errors are logged."""
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self._settings.interval_seconds)
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                await self.tick()
            except kube.ApiError as exc:
                self._metrics.reconcile_errors.labels(handler="placement").inc()
                _log.warning("placement: cluster not readable (%s); retrying in %.0f s", exc,
                             self._settings.interval_seconds)
            except Exception:  # noqa: BLE001  # a bug: keep planning, but loudly
                self._metrics.reconcile_errors.labels(handler="placement").inc()
                _log.exception("placement: unexpected error; retrying next interval")

    async def tick(self) -> None:
        """One round: list nodes and pods, then plan and start each device pool's jobs."""
        self.ticks += 1
        introspecting = self._settings.resize is not None and self._resize is not None
        if not self._queue and not (introspecting and self._placed):
            return
        if not await self.leads():
            return
        node_objects = await self._client.list(kube.Paths.nodes())
        pod_objects = await listing.placement_pods(self._client, cluster.gpu_node_names(
            node_objects, self._settings.gpu_resources))
        now = self._clock()
        pools = self._holding_moves(cluster.pools(
            node_objects, pod_objects, cpu_slots=self._settings.cpu_slots,
            gpu_type=self._settings.gpu_type, gpu_type_label=self._settings.gpu_type_label,
            gpu_resources=self._settings.gpu_resources, now=now, eta_seconds=self._eta))
        pools = dataclasses.replace(pools, running={
            p: tuple(self._bounded_eta(r) for r in rs) for p, rs in pools.running.items()})
        self._gpu_resource.update(pools.gpu_resource)
        requested = feasible.used(pod_objects)
        groups: dict[str, list[Queued]] = {}
        granted: dict[tuple[str, Grant], list[Queued]] = {}
        for entry in list(self._queue.values()):
            # Only the nodes the job's nodeSelector, affinity, tolerations and CPU/memory
            # requests allow: a pod pinned elsewhere would stay Pending, holding its devices.
            fit = feasible.fit(api.scheduling_of(entry.job.spec.template), node_objects,
                               requested)
            self._allowed[entry.ref] = fit.nodes
            pool = await self._pool_or_unplaceable(entry, fit, pools)
            if pool is None:
                continue
            if entry.grant is not None:
                granted.setdefault((pool, entry.grant), []).append(entry)
            else:
                groups.setdefault(pool, []).append(entry)
        started_in: set[str] = set()
        # Jobs an outside quota system admitted go first, each grant planned on the nodes it
        # allows; a pool where one started waits for the next round (an immediate wake-up),
        # so two plans never take the same free devices.
        for (pool, grant), entries in granted.items():
            view = _granted_pools(pools, pool, grant, node_objects)
            if not view.nodes[pool]:
                for entry in entries:
                    await self._unplaceable(entry, (
                        f"Kueue admitted it to nodes labelled {dict(grant.node_labels)}, and "
                        "no Ready, schedulable node carries those labels"))
            elif pool not in started_in and await self._plan_pool(
                    pool, entries, view, now, line_key=f"{pool}/{grant}"):
                started_in.add(pool)
        for pool, entries in groups.items():
            if pool not in started_in and await self._plan_pool(pool, entries, pools, now):
                started_in.add(pool)
        started = bool(started_in)
        if introspecting and not started:  # else the listing is stale: next round
            await self._introspect(pools, groups, now)

    async def _plan_pool(self, pool: str, entries: list[Queued], pools: cluster.Pools,
                         now: float, *, line_key: str | None = None) -> bool:
        """Re-plan one pool's queued jobs, start the queue heads whose devices are free, and
        publish the others' planned node and start; True when a job was started.

        Configs are estimated once per job and device type, in a worker thread (the zoo's
        records come from the warm-start index: no extra listing). Jobs that fit no node are
        reported unplaceable and stay queued. A granted job keeps only configs within its
        grant's GPUs; `line_key` names the placement queue (default: the pool's).
        """
        device = "gpu" if pool == cluster.GPU_POOL else "cpu"
        by_key = {e.ref.key: e for e in entries}
        kinds = tuple(sorted({n.device_type for n in pools.nodes[pool]}))
        missing = [e for e in entries if (e.ref, device) not in self._configs
                   or self._kinds.get((e.ref, device)) != kinds]
        if missing:  # one worker-thread hop for all new jobs (or new GPU types)
            loop = asyncio.get_running_loop()
            found = await loop.run_in_executor(
                None, lambda: [self._estimate(e, device, kinds) for e in missing])
            self._configs.update({(e.ref, device): c for e, c in zip(missing, found,
                                                                   strict=True)})
            self._kinds.update({(e.ref, device): kinds for e in missing})
        requests = [types.JobRequest(e.ref.key, self._constrained(
                                         e, _within_grant(e, self._configs[(e.ref, device)],
                                                          device), pools.nodes[pool]),
                                     arrival=e.since, asked_gpus=e.job.spec.resources.gpus,
                                     weight=self._weight(e), namespace=e.ref.namespace)
                    for e in entries]
        snapshot = types.Snapshot(now=now, nodes=pools.nodes[pool], queued=tuple(requests),
                                  running=pools.running.get(pool, ()), device=device)
        problems = types.unplaceable_reasons(snapshot)
        for key, why in problems.items():
            await self._unplaceable(by_key[key], why)
        snapshot = dataclasses.replace(
            snapshot, queued=tuple(r for r in requests if r.name not in problems))
        if not snapshot.queued:
            return False
        line = self._pools.setdefault(line_key or pool, queues.NodeQueues())
        loop = asyncio.get_running_loop()  # the planner may run the MILP: off the event loop
        plan = await loop.run_in_executor(None, line.replan, snapshot, self._settings.planner)
        self._metrics.placement_solve_seconds.labels(solver=plan.solver).observe(
            plan.solve_seconds)
        _log.debug("placement %s: %d queued, %s (%s)", pool, len(snapshot.queued), plan.solver,
                   plan.reason)
        free = {n.name: pools.free_devices(pool, n.name) for n in pools.nodes[pool]}
        started = False
        for assignment in line.start_heads(free):
            chosen = by_key[assignment.job]
            if chosen.ref not in self._queue:  # left while an earlier launch was awaited
                continue
            if await self._launch(chosen, assignment, device):
                if not assignment.peer_nodes:  # introspection moves one-node jobs only
                    self._placed[chosen.ref.key] = Placed(chosen, device, self._constrained(
                        chosen, self._configs[(chosen.ref, device)], pools.nodes[pool]))
                started = True
            else:  # suspended or deleted
                _log.debug("placement: %s can no longer start", assignment.job)
            self.remove(chosen.ref)  # and wake: freed or untaken devices are re-planned soon
        waiting = line.waiting()
        limit = asyncio.Semaphore(PUBLISH_CONCURRENCY)

        async def publish(assignment: types.Assignment) -> None:
            async with limit:
                await self._publish(by_key[assignment.job], assignment, device)

        await asyncio.gather(*(publish(a) for a in waiting))
        return started

    def _holding_moves(self, pools: cluster.Pools) -> cluster.Pools:
        """`pools` with each moved job holding its new devices until its new pod is listed
        (it is created once the old pod is gone), so no queued job is started on them."""
        running = {pool: list(rs) for pool, rs in pools.running.items()}
        used = dict(pools.used)
        for key, (pool, move) in list(self._moving.items()):
            listed = [r for r in running.get(pool, []) if r.job == key]
            if any(r.node == move.node and r.gpus == move.gpus for r in listed):
                del self._moving[key]  # its new pod holds them now
                continue
            running.setdefault(pool, []).append(types.Running(
                job=key, node=move.node, gpus=move.gpus, parallelism=move.parallelism,
                remaining_seconds=move.remaining_seconds))
            used[(pool, move.node)] = used.get((pool, move.node), 0) + move.gpus
        return dataclasses.replace(pools, running={p: tuple(rs) for p, rs in running.items()},
                                   used=used)

    async def _introspect(self, pools: cluster.Pools, groups: dict[str, list[Queued]],
                          now: float) -> None:
        """Move the running jobs whose predicted gain is worth their restart
        (`introspect.propose`), each pool on its running jobs and its still-queued jobs."""
        policy = self._settings.resize
        assert policy is not None and self._resize is not None
        running_now = {r.job for rs in pools.running.values() for r in rs}
        for key in [k for k in self._placed if k not in running_now]:  # ended or stopped
            for memo in (self._placed, self._progress, self._restart_seconds, self._stopped,
                         self._work, self._moving, self._compute):
                memo.pop(key, None)
            self._distrusted.discard(key)
        for pool, running in pools.running.items():
            device = "gpu" if pool == cluster.GPU_POOL else "cpu"
            if pool not in pools.nodes:
                continue
            refreshed = tuple(self._refresh(r) for r in running)
            # A job an outside quota system admitted stays within its grant: never moved.
            states = {r.job: self._state(r) for r in refreshed if r.job in self._placed
                      and self._placed[r.job].device == device
                      and self._placed[r.job].entry.grant is None}
            if not states:
                continue
            queued = tuple(types.JobRequest(e.ref.key, self._configs[(e.ref, device)],
                                            arrival=e.since)
                           for e in groups.get(pool, ())
                           if e.ref in self._queue and (e.ref, device) in self._configs)
            snapshot = types.Snapshot(now=now, nodes=pools.nodes[pool], queued=queued,
                                      running=refreshed, device=device)
            for move in introspect.propose(snapshot, states, policy):
                placed = self._placed[move.job]
                if not await self._resize(placed.entry.ref, move, device):
                    continue
                self.wake()  # queued jobs a shrink made room for start on the next round
                _log.info("placement: %s %s from %d on %s to %d on %s (gain %.0f s)", move.job,
                          move.kind, move.from_gpus, move.from_node, move.gpus, move.node,
                          move.gain_seconds)
                self._placed[move.job] = dataclasses.replace(placed, last_move=now)
                self._stopped[move.job] = now
                self._moving[move.job] = (pool, move)
                self._eta.pop(move.job, None)
                self._progress.pop(move.job, None)

    def _refresh(self, running: types.Running) -> types.Running:
        """The running job with its remaining time from its measured progress, when its
        trainer reported no ETA (`estimate.remaining_seconds`)."""
        placed = self._placed.get(running.job)
        progress = self._believed(running)
        rate, step = progress if progress is not None else (0.0, None)
        if running.job in self._eta or placed is None or step is None:
            return running
        from kiln.placement import estimate

        work = self._workload(placed)
        left = estimate.remaining_seconds(work, samples_done=step * work.batch_size,
                                          measured_samples_per_second=rate)
        return dataclasses.replace(running,
                                   remaining_seconds=max(cluster.MIN_REMAINING_SECONDS, left))

    def _state(self, running: types.Running) -> introspect.JobState:
        """What introspection knows of a job this loop started: its estimates rescaled by its
        measured throughput (`estimate.refine`), its last move and its restart cost."""
        from kiln.placement import estimate

        placed = self._placed[running.job]
        configs = placed.configs
        current = next((c for c in configs if c.gpus == running.gpus), None)
        progress = self._believed(running)
        if current is not None and progress is not None:
            configs = estimate.refine(
                configs, work=self._workload(placed), running=current,
                measured_samples_per_second=progress[0],
                device=estimate.device_model("cuda" if placed.device == "gpu" else "cpu"))
        return introspect.JobState(configs, last_move=placed.last_move,
                                   restart_seconds=self._restart_seconds.get(running.job),
                                   compute_scale=self._compute.get(running.job, 1.0))

    def _speed_bounds(self, running: types.Running) -> tuple[float, float] | None:
        """The samples/s a trainer's report is believed within (`SPEED_TRUST` times the
        job's estimate at its device count); None for a job this loop did not start or
        without a finite estimate there."""
        from kiln.placement import estimate

        placed = self._placed.get(running.job)
        current = None if placed is None else next(
            (c for c in placed.configs if c.gpus == running.gpus), None)
        if placed is None or current is None or not math.isfinite(current.seconds):
            return None
        work = self._workload(placed)
        device = estimate.device_model("cuda" if placed.device == "gpu" else "cpu")
        estimated = work.batch_size / estimate.step_of(work, current.seconds, device)
        return estimated * SPEED_TRUST[0], estimated * SPEED_TRUST[1]

    def _believed(self, running: types.Running) -> tuple[float, int | None] | None:
        """The job's reported (samples/s, step), its speed held within `_speed_bounds`."""
        progress = self._progress.get(running.job)
        bounds = self._speed_bounds(running)
        if progress is None or bounds is None:
            return progress
        rate, step = progress
        believed = min(max(rate, bounds[0]), bounds[1])
        if believed != rate:
            self._distrust(running.job, f"{rate:g} samples/s, planned as {believed:g} "
                           f"(believed within {bounds[0]:g}..{bounds[1]:g} on "
                           f"{running.gpus} device(s))")
        return believed, None if step is None else max(0, step)

    def _bounded_eta(self, running: types.Running) -> types.Running:
        """The running job with its reported ETA held to the time its spec's samples left
        take within `_speed_bounds` (after its reported step, else all of them)."""
        from kiln.placement import estimate

        eta = self._eta.get(running.job)
        bounds = self._speed_bounds(running)
        if eta is None or bounds is None:
            return running
        work = self._workload(self._placed[running.job])
        progress = self._progress.get(running.job)
        step = progress[1] if progress is not None and progress[1] is not None else 0
        done = min(max(0, step) * work.batch_size, work.total_train_samples)
        low, high = (estimate.remaining_seconds(work, samples_done=done,
                                                measured_samples_per_second=speed)
                     for speed in reversed(bounds))
        believed = min(max(eta, low), high)
        if believed == eta:
            return running
        self._distrust(running.job, f"an ETA of {eta:g} s, planned as {believed:g} s (its "
                       f"spec's samples left at {bounds[1]:g}..{bounds[0]:g} samples/s)")
        return dataclasses.replace(running, remaining_seconds=max(
            cluster.MIN_REMAINING_SECONDS, believed))

    def _distrust(self, key: str, what: str) -> None:
        """Log, once per job while it runs here, that its trainer's report was bounded."""
        if key not in self._distrusted:
            self._distrusted.add(key)
            _log.warning("placement: %s: its trainer reported %s", key, what)

    def _workload(self, placed: Placed) -> estimate.Workload:
        """The job's workload, sized once (`estimate.workload` may count a folder's files)."""
        from kiln.placement import estimate

        key = placed.entry.ref.key
        if key not in self._work:
            self._work[key] = estimate.workload(placed.entry.job)
        return self._work[key]

    async def _pool_or_unplaceable(self, entry: Queued, fit: feasible.Fit,
                                   pools: cluster.Pools) -> str | None:
        """The device pool the job is planned in, among the nodes `fit` allows; None, after
        reporting the job unplaceable with the reason, when there is none for it."""
        pool = pools.pool_for(entry.job.spec.resources.gpus != 0, among=fit.nodes)
        gpu_nodes = [n.name for n in pools.nodes.get(cluster.GPU_POOL, ())]
        if pool is None:
            await self._unplaceable(entry, fit.reason() if not fit.nodes else (
                f"the nodes its scheduling constraints allow ({', '.join(sorted(fit.nodes))}) "
                "have no devices Kiln places on (GPUs of --gpu-resource and --gpu-type, or CPU "
                "slots)"))
        elif entry.job.spec.resources.gpus and pool == cluster.CPU_POOL and gpu_nodes:
            await self._unplaceable(entry, (  # there are GPUs, just none it may use
                "it asks for GPUs, and no GPU node passes its scheduling constraints: "
                + fit.among(gpu_nodes).reason()))
            pool = None
        return pool

    def _constrained(self, entry: Queued, configs: tuple[types.Config, ...],
                     nodes: Sequence[types.Node]) -> tuple[types.Config, ...]:
        """`configs` limited to the nodes the job's scheduling constraints allowed in this
        round (`types.Config.nodes`); unchanged when they allow every node of the pool."""
        allowed = self._allowed.get(entry.ref)
        names = frozenset(n.name for n in nodes)
        if allowed is None or names <= allowed:
            return configs
        return tuple(dataclasses.replace(c, nodes=allowed & names) for c in configs)

    async def gpu_resource(self, node: str) -> str:
        """The extended resource `node`'s GPUs are (the first of --gpu-resource it has), from
        the last round, or from a fresh node listing when the node is new to this loop."""
        if node not in self._gpu_resource:
            for listed in await self._client.list(kube.Paths.nodes()):
                resource = cluster.gpu_resource_of(listed, self._settings.gpu_resources)
                if resource:
                    self._gpu_resource[str(listed["metadata"]["name"])] = resource
        return self._gpu_resource.get(node, self._settings.gpu_resources[0])

    def _weight(self, entry: Queued) -> float:
        """The job's placement weight: its priorityClassName's (unknown or unset: 1)."""
        name = entry.job.spec.run_policy.priority_class_name
        return self._settings.priority_weights.get(name, 1.0) if name else 1.0

    def _estimate(self, entry: Queued, device: str,
                  kinds: Sequence[str] = ("",)) -> tuple[types.Config, ...]:
        """Runtime estimates of a queued job on `device` ("gpu" or "cpu"): on GPUs, once per
        GPU type in `kinds` ("" : untyped nodes, the generic "cuda" model), each config
        tagged with its type."""
        from kiln.placement import estimate

        if device != "gpu":
            return estimate.configs(entry.job, zoo=None, profile_cache=None, max_gpus=1,
                                    device_type="cpu", zoo_records=self._zoo_records(),
                                    measured=entry.measured)
        return tuple(dataclasses.replace(c, device_type=kind) for kind in kinds
                     for c in estimate.configs(
                         entry.job, zoo=None, profile_cache=None,
                         max_gpus=self._settings.max_gpus, device_type=kind or "cuda",
                         zoo_records=self._zoo_records(), measured=entry.measured))


def _granted_pools(pools: cluster.Pools, pool: str, grant: Grant,
                   node_objects: Sequence[Mapping[str, Any]]) -> cluster.Pools:
    """`pools` with `pool` cut to the nodes `grant` allows (and the jobs running there)."""
    allowed = {str((n.get("metadata") or {}).get("name")) for n in node_objects
               if grant.allows(n)}
    return dataclasses.replace(
        pools, nodes={**pools.nodes, pool: tuple(n for n in pools.nodes.get(pool, ())
                                                 if n.name in allowed)},
        running={**pools.running, pool: tuple(r for r in pools.running.get(pool, ())
                                              if r.node in allowed)})


def _within_grant(entry: Queued, configs: tuple[types.Config, ...],
                  device: str) -> tuple[types.Config, ...]:
    """The configs of `entry` within its grant's GPUs (all of them without a grant)."""
    cap = entry.grant.gpus if entry.grant is not None else None
    if cap is None or device != "gpu":
        return configs
    return tuple(c for c in configs if c.gpus <= cap)

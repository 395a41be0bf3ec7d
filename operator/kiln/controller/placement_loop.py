"""The operator's placement loop: one asyncio task that plans queued jobs and starts them.

On every wake-up (a job queued or left, a trainer ended) and at least every interval it
re-plans each device pool (`cluster.pools`) and starts jobs by the placement queue's rule
(`queues.NodeQueues`). The queue is in memory; kopf's resume handlers refill it after a restart.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Sequence

from kiln import api
from kiln.controller import cluster, jobs, kube, metrics
from kiln.placement import estimate, queues, types
from kiln.warmstart import select
from kiln.zoo import records

_log = logging.getLogger(__name__)
PUBLISH_CONCURRENCY = 16


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
    warm_start: select.Decision
    since: float
    measured: estimate.ModelMeasurement | None = None


Launch = Callable[[Queued, types.Assignment, str], Awaitable[bool]]
Publish = Callable[[Queued, types.Assignment, str], Awaitable[None]]
Unplaceable = Callable[[Queued, str], Awaitable[None]]


@dataclasses.dataclass(frozen=True)
class LoopSettings:
    """Knobs of the loop (from `settings.Options`)."""

    interval_seconds: float
    cpu_slots: int
    max_gpus: int
    planner: types.Settings
    gpu_type: cluster.GpuType | None = None


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
    """

    def __init__(self, *, client: kube.Client, settings: LoopSettings, launch: Launch,
                 publish: Publish, unplaceable: Unplaceable,
                 zoo_records: Callable[[], Sequence[records.ZooRecord]],
                 metrics: metrics.OperatorMetrics, clock: Callable[[], float],
                 eta_seconds: dict[str, float]) -> None:
        self._client = client
        self._settings = settings
        self._launch, self._publish, self._unplaceable = launch, publish, unplaceable
        self._zoo_records = zoo_records
        self._metrics = metrics
        self._clock = clock
        self._eta = eta_seconds
        self._queue: dict[jobs.JobRef, Queued] = {}
        self._configs: dict[tuple[jobs.JobRef, str], tuple[types.Config, ...]] = {}
        self._pools: dict[str, queues.NodeQueues] = {}  # device pool -> its queues
        self._wake = asyncio.Event()
        self.ticks = 0

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, ref: object) -> bool:
        return ref in self._queue

    def add(self, entry: Queued) -> None:
        """Queue a job (replacing an older entry for it) and wake the loop."""
        self._queue[entry.ref] = entry
        self._metrics.queued_jobs.set(len(self._queue))
        self.wake()

    def remove(self, ref: jobs.JobRef) -> None:
        """Take a job out of the queue (no-op if absent) and wake the loop."""
        if self._queue.pop(ref, None) is not None:
            self._metrics.queued_jobs.set(len(self._queue))
        for key in [k for k in self._configs if k[0] == ref]:
            del self._configs[key]
        self.wake()

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
        if not self._queue:
            return
        node_objects = await self._client.list(kube.Paths.nodes())
        pod_objects = await self._client.list(kube.Paths.pods())
        now = self._clock()
        pools = cluster.pools(node_objects, pod_objects, cpu_slots=self._settings.cpu_slots,
                              gpu_type=self._settings.gpu_type,
                              now=now, eta_seconds=self._eta)
        groups: dict[str, list[Queued]] = {}
        for entry in list(self._queue.values()):
            pool = pools.pool_for(entry.job.spec.resources.gpus != 0)
            if pool is None:
                await self._unplaceable(entry, "the cluster has no Ready, schedulable node")
                continue
            groups.setdefault(pool, []).append(entry)
        for pool, entries in groups.items():
            await self._plan_pool(pool, entries, pools, now)

    async def _plan_pool(self, pool: str, entries: list[Queued], pools: cluster.Pools,
                         now: float) -> None:
        """Re-plan one pool's queued jobs, start the queue heads whose devices are free, and
        publish the others' planned node and start.

        Configs are estimated once per job and device type, in a worker thread (the zoo's
        records come from the warm-start index: no extra listing). Jobs that fit no node are
        reported unplaceable and stay queued.
        """
        device = "gpu" if pool == cluster.GPU_POOL else "cpu"
        by_key = {e.ref.key: e for e in entries}
        missing = [e for e in entries if (e.ref, device) not in self._configs]
        if missing:  # one worker-thread hop for all new jobs
            loop = asyncio.get_running_loop()
            found = await loop.run_in_executor(
                None, lambda: [self._estimate(e, device) for e in missing])
            self._configs.update({(e.ref, device): c for e, c in zip(missing, found,
                                                                   strict=True)})
        requests = [types.JobRequest(e.ref.key, self._configs[(e.ref, device)],
                                     arrival=e.since, asked_gpus=e.job.spec.resources.gpus)
                    for e in entries]
        snapshot = types.Snapshot(now=now, nodes=pools.nodes[pool], queued=tuple(requests),
                                  running=pools.running.get(pool, ()), device=device)
        problems = types.unplaceable_reasons(snapshot)
        for key, why in problems.items():
            await self._unplaceable(by_key[key], why)
        snapshot = dataclasses.replace(
            snapshot, queued=tuple(r for r in requests if r.name not in problems))
        if not snapshot.queued:
            return
        line = self._pools.setdefault(pool, queues.NodeQueues())
        loop = asyncio.get_running_loop()  # the planner may run the MILP: off the event loop
        plan = await loop.run_in_executor(None, line.replan, snapshot, self._settings.planner)
        self._metrics.placement_solve_seconds.labels(solver=plan.solver).observe(
            plan.solve_seconds)
        _log.debug("placement %s: %d queued, %s (%s)", pool, len(snapshot.queued), plan.solver,
                   plan.reason)
        free = {n.name: pools.free_devices(pool, n.name) for n in pools.nodes[pool]}
        for assignment in line.start_heads(free):
            chosen = by_key[assignment.job]
            if chosen.ref not in self._queue:  # left while an earlier launch was awaited
                continue
            if not await self._launch(chosen, assignment, device):  # suspended or deleted
                _log.debug("placement: %s can no longer start", assignment.job)
            self.remove(chosen.ref)  # and wake: freed or untaken devices are re-planned soon
        waiting = line.waiting()
        limit = asyncio.Semaphore(PUBLISH_CONCURRENCY)

        async def publish(assignment: types.Assignment) -> None:
            async with limit:
                await self._publish(by_key[assignment.job], assignment, device)

        await asyncio.gather(*(publish(a) for a in waiting))

    def _estimate(self, entry: Queued, device: str) -> tuple[types.Config, ...]:
        """Runtime estimates of a queued job on `device` ("gpu" or "cpu")."""
        kind = "cuda" if device == "gpu" else "cpu"
        max_gpus = self._settings.max_gpus if device == "gpu" else 1
        return estimate.configs(entry.job, zoo=None, profile_cache=None, max_gpus=max_gpus,
                                device_type=kind, zoo_records=self._zoo_records(),
                                measured=entry.measured)

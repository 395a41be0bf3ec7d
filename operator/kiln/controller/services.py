"""What the operator's handlers share: one `Services` object on kopf's memo.

`Services.create(options, connection)` wires the API client, the status writer (`jobs`), the
warm-start chooser (`parents`, on the zoo store), the placement loop and the metrics; the
startup handler calls `start` (the placement loop task, the HTTP session for progress reads)
and the cleanup handler `stop`. No globals: tests and `kiln operator` each build their own.

Callers: `kiln.controller.main` (create), `kiln.controller.handlers` (start, stop, and every
handler through ``memo.services``). Non-goals: no decisions.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp
import kopf

from kiln import api
from kiln.controller import jobs as job_store
from kiln.controller import (
    kube,
    lifecycle,
    metrics,
    parents,
    placement_loop,
    pods,
    settings,
    status,
)
from kiln.placement import types
from kiln.warmstart import index as zoo_index
from kiln.zoo import records, store

_log = logging.getLogger(__name__)
C, R = api.ConditionType, api.Reason


@dataclasses.dataclass
class Services:
    """The operator's shared services (module docstring)."""

    options: settings.Options
    connection: kopf.ConnectionInfo
    metrics: metrics.OperatorMetrics
    client: kube.Client
    jobs: job_store.Jobs
    parents: parents.ParentChooser
    pod_settings: pods.PodSettings
    clock: Callable[[], float]
    eta_seconds: dict[str, float]
    placement: placement_loop.PlacementLoop = dataclasses.field(init=False)
    http: aiohttp.ClientSession | None = dataclasses.field(default=None, init=False)
    _task: asyncio.Task[None] | None = dataclasses.field(default=None, init=False)
    _published: dict[job_store.JobRef, dict[str, Any]] = dataclasses.field(
        default_factory=dict, init=False)
    _unplaceable: dict[job_store.JobRef, str] = dataclasses.field(default_factory=dict, init=False)

    @classmethod
    def create(cls, options: settings.Options, connection: kopf.ConnectionInfo, *,
               clock: Callable[[], float] = time.time) -> Services:
        """Build the services; nothing is contacted yet.

        Raises:
            ValueError: the zoo URI or the zoo settings in the environment are unusable.
        """
        registry = metrics.OperatorMetrics()
        client = kube.Client(connection, relogin=lambda: kube.connection_info(
            kubeconfig=options.kubeconfig))
        env = dict(os.environ)
        if options.zoo_endpoint:
            env[store.ENDPOINT_ENV] = options.zoo_endpoint
        elif env.get(store.ENDPOINT_ENV):  # trainer pods must reach the zoo the operator uses
            options = dataclasses.replace(options, zoo_endpoint=env[store.ENDPOINT_ENV])
        zoo = parents.open_zoo(options.zoo_uri, env=env, retry=store.RetryPolicy(
            attempts=options.zoo_request_attempts, first_backoff_seconds=0.5))
        chooser = parents.ParentChooser(
            zoo, metrics=registry, refresh_seconds=options.zoo_refresh_seconds,
            query_timeout_seconds=options.zoo_query_timeout_seconds,
            index_settings=zoo_index.IndexSettings(start_method="forkserver"))
        svc = cls(options=options, connection=connection, metrics=registry, client=client,
                  jobs=job_store.Jobs(client, metrics=registry, clock=clock), parents=chooser,
                  pod_settings=settings.pod_settings(options), clock=clock, eta_seconds={})
        svc.placement = placement_loop.PlacementLoop(
            client=client,
            settings=placement_loop.LoopSettings(
                interval_seconds=options.placement_interval_seconds,
                start_tolerance_seconds=options.placement_start_tolerance_seconds,
                cpu_slots=options.cpu_slots_per_node, max_gpus=options.max_gpus_per_job,
                planner=settings.placement_settings(options),
                gpu_type=settings.gpu_type(options)),
            launch=svc._launch, publish=svc._publish, unplaceable=svc._mark_unplaceable,
            zoo_records=svc._zoo_records, metrics=registry, clock=clock,
            eta_seconds=svc.eta_seconds)
        return svc

    async def start(self) -> None:
        """Start the placement loop and the HTTP session (call from the startup handler)."""
        self.http = aiohttp.ClientSession()
        self._task = asyncio.create_task(self.placement.run(), name="kiln placement loop")

    async def stop(self) -> None:
        """Stop what `start` started and close the clients (idempotent)."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self.http is not None:
            await self.http.close()
            self.http = None
        await self.client.close()
        self.parents.close()

    # -- placement callbacks ----------------------------------------------------------------

    async def _launch(self, entry: placement_loop.Queued, assignment: types.Assignment,
                      device: str) -> bool:
        self._published.pop(entry.ref, None)
        self._unplaceable.pop(entry.ref, None)
        return await lifecycle.launch(self, entry, assignment, device)

    async def _publish(self, entry: placement_loop.Queued, assignment: types.Assignment,
                       device: str) -> None:
        """Record a waiting job's planned node and start in status.placement (if changed)."""
        placement = {
            "node": assignment.node,
            "gpus": assignment.gpus if device == "gpu" else 0,
            "parallelism": assignment.parallelism,
            "estimatedStart": status.rfc3339(max(assignment.start, self.clock())),
            "estimatedSeconds": round(assignment.seconds, 1),
        }
        if self._published.get(entry.ref) == placement:
            return
        async with self.jobs.lock(entry.ref):
            if entry.ref not in self.placement:  # started, suspended or deleted meanwhile
                return
            path = kube.Paths.job(entry.ref.namespace, entry.ref.name, status=True)
            if await self.client.merge_patch(path, {"status": {"placement": placement}}):
                self._published[entry.ref] = placement

    async def _mark_unplaceable(self, entry: placement_loop.Queued, why: str) -> None:
        """Placed=False/NoFeasibleConfig (once per distinct reason); the job stays queued."""
        if self._unplaceable.get(entry.ref) == why:
            return
        message = (f"No node can run this job: {why}. It stays queued and is planned again "
                   "when nodes change; or lower spec.resources.gpus / gpusPerNode.")
        now = self.clock()
        async with self.jobs.edit(entry.ref) as e:
            if e.body is not None and entry.ref in self.placement:
                e.condition(C.PLACED, False, R.NO_FEASIBLE_CONFIG, message, now=now,
                            event="Warning")
        self._unplaceable[entry.ref] = why

    def _zoo_records(self) -> Sequence[records.ZooRecord]:
        """The zoo's records as the warm-start index last saw them (no extra listing)."""
        return self.parents.records()

"""What the operator's handlers share: one `Services` object on kopf's memo.

Holds the clients, the status writer, the warm-start chooser, the placement loop and the
metrics; `kiln.controller.main` builds it. No globals and no decisions.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Coroutine
from typing import Any

import aiohttp
import kopf

from kiln.controller import jobs as job_store
from kiln.controller import kube, metrics, parents, placement_loop, pods, settings


@dataclasses.dataclass
class Services:
    """The operator's shared services.

    Attributes:
        eta_seconds: job key -> seconds left as its trainer last reported (read by the planner).
        published: status.placement last written per waiting job (skips identical patches).
        unplaceable: the NoFeasibleConfig reason last reported per job (reported once each).
        profiles: status.profile of built-in models profiled on the cluster, by
            `profiling.cache_key` (namespace, model, batch, GPU type): later jobs of the
            namespace reuse them.
        refused_reports: (job uid, zoo ids) of warm-start reports refused with an event,
            so a report the trainer repeats is refused silently.
    """

    options: settings.Options
    connection: kopf.ConnectionInfo
    metrics: metrics.OperatorMetrics
    client: kube.Client
    jobs: job_store.Jobs
    parents: parents.ParentChooser
    pod_settings: pods.PodSettings
    clock: Callable[[], float]
    eta_seconds: dict[str, float]
    # Set right after construction: the loop's callbacks take these services.
    placement: placement_loop.PlacementLoop = dataclasses.field(init=False)
    http: aiohttp.ClientSession | None = dataclasses.field(default=None, init=False)
    published: dict[job_store.JobRef, dict[str, Any]] = dataclasses.field(
        default_factory=dict, init=False)
    unplaceable: dict[job_store.JobRef, str] = dataclasses.field(default_factory=dict, init=False)
    profiles: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict, init=False)
    refused_reports: set[tuple[str, ...]] = dataclasses.field(default_factory=set, init=False)
    # Job uid -> when its zoo access was signed and when it expires (`zoo_access.due`).
    zoo_access_expiry: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict,
                                                                          init=False)
    # Job uid -> (refused creations of its pods in a row, when to try again): `lifecycle`.
    create_retry: dict[str, tuple[int, float]] = dataclasses.field(default_factory=dict,
                                                                   init=False)
    # Held while a profiling pod chooses and takes its device, so two never take the same one.
    profiling_lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock, init=False)
    _task: asyncio.Task[None] | None = dataclasses.field(default=None, init=False)
    _background: list[asyncio.Task[None]] = dataclasses.field(default_factory=list, init=False)

    async def start(self) -> None:
        """Start the placement loop, the HTTP session and, in the background, a warm-start
        graph worker (call from the startup handler)."""
        self.http = aiohttp.ClientSession()
        self._task = asyncio.create_task(self.placement.run(), name="kiln placement loop")
        self.parents.warm_up()

    def run_in_background(self, work: Coroutine[Any, Any, None], *, name: str) -> None:
        """Run `work` (a loop that never returns) until `stop`."""
        self._background.append(asyncio.create_task(work, name=name))

    async def stop(self) -> None:
        """Stop what `start` started and close the clients (idempotent)."""
        for task in (self._task, *self._background):
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        self._task, self._background = None, []
        if self.http is not None:
            await self.http.close()
            self.http = None
        await self.client.close()
        self.parents.close()

"""What the operator holds in memory about its jobs, besides the placement queue.

Caches only: each is rebuilt or simply refilled after a restart. No API calls, no decisions.
"""

from __future__ import annotations

import asyncio
import dataclasses

from kiln import api
from kiln.controller import jobs


@dataclasses.dataclass
class Caches:
    """The operator's per-job memory.

    Attributes:
        eta_seconds: job key -> seconds left as its trainer last reported (read by the planner).
        published: status.placement last written per waiting job (skips identical patches).
        unplaceable: the NoFeasibleConfig reason last reported per job (reported once each).
        profiles: status.profile of built-in models profiled on the cluster, by
            `profiling.cache_key` (namespace, model, batch, GPU type): later jobs of the
            namespace reuse them.
        refused_reports: (job uid, zoo ids) of warm-start reports refused with an event,
            so a report the trainer repeats is refused silently.
        create_retry: job uid -> (refused creations of its pods in a row, when to try again).
        profiling_lock: held while a profiling pod chooses and takes its device, so two never
            take the same one.
    """

    eta_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    published: dict[jobs.JobRef, api.PlacementStatus] = dataclasses.field(default_factory=dict)
    unplaceable: dict[jobs.JobRef, str] = dataclasses.field(default_factory=dict)
    profiles: dict[str, api.ProfileStatus] = dataclasses.field(default_factory=dict)
    refused_reports: set[tuple[str, ...]] = dataclasses.field(default_factory=set)
    create_retry: dict[str, tuple[int, float]] = dataclasses.field(default_factory=dict)
    profiling_lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)

"""What the operator holds in memory about its jobs and sweeps, besides the placement queue.

Caches only: each is rebuilt or simply refilled after a restart. No API calls, no decisions.
"""

from __future__ import annotations

import asyncio
import dataclasses

from kiln import api, sweep
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
        sweep_searches: sweep uid -> its search, built from its status.history when missing
            (after a restart, or dropped after a failed reconcile).
        sweep_locks: sweep (namespace, name) -> the lock its reconciles run under.
        sweep_pending: sweeps whose reconcile waits for that lock (a trigger meanwhile adds
            nothing: the waiting one reads the sweep afresh).
        sweeps: the sweeps seen, by (namespace, name) -> uid, and whether they had ended.
    """

    eta_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    published: dict[jobs.JobRef, api.PlacementStatus] = dataclasses.field(default_factory=dict)
    unplaceable: dict[jobs.JobRef, str] = dataclasses.field(default_factory=dict)
    profiles: dict[str, api.ProfileStatus] = dataclasses.field(default_factory=dict)
    refused_reports: set[tuple[str, ...]] = dataclasses.field(default_factory=set)
    create_retry: dict[str, tuple[int, float]] = dataclasses.field(default_factory=dict)
    profiling_lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    sweep_searches: dict[str, sweep.Search] = dataclasses.field(default_factory=dict)
    sweep_locks: dict[tuple[str, str], asyncio.Lock] = dataclasses.field(default_factory=dict)
    sweep_pending: set[tuple[str, str]] = dataclasses.field(default_factory=set)
    sweeps: dict[tuple[str, str], tuple[str, bool]] = dataclasses.field(default_factory=dict)

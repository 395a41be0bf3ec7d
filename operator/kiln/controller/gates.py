"""Admission gates: what must admit a queued job, besides Kiln, before it is placed.

`Open` admits every job at once; Kueue (`kueue.Kueue`, under --kueue) admits the jobs of its
queues by quota. Admission, the handlers and the placement queue ask the gate, never Kueue.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import kopf

from kiln import api
from kiln.controller import jobs, placement_loop

# Wraps a kopf handler as `handlers` wraps its own (metrics, errors surfaced), by name.
Wrap = Callable[[str, Callable[..., Awaitable[Any]]], Callable[..., Awaitable[Any]]]


class Gate(Protocol):
    """An outside admission a queued job waits for."""

    def manages(self, job: api.TrainingJob) -> bool:
        """Whether the gate admits this job (else it is placed as soon as it is queued). A
        managed job's profiling pod runs only within the gate's admission too: admission asks
        for it (`queued`), and the gate starts the pod once it is given."""
        ...

    def holds(self, entry: placement_loop.Queued) -> bool:
        """Whether a queue entry must wait: a managed job the gate has not admitted."""
        ...

    def waiting(self, job: api.TrainingJob, uid: str) -> tuple[api.Reason, str] | None:
        """The Queued condition's reason and message of a managed job that waits for the
        gate (None: not managed)."""
        ...

    async def queued(self, body: dict[str, Any], job: api.TrainingJob) -> None:
        """A job was queued, or queued again after a restart: ask for its admission."""
        ...

    async def suspended(self, ref: jobs.JobRef, suspended: bool) -> None:
        """spec.runPolicy.suspend of the job changed to `suspended`."""
        ...

    async def pod_event(self, pod: dict[str, Any], event_type: str | None) -> None:
        """A trainer or profiling pod changed or vanished."""
        ...

    def register(self, registry: kopf.OperatorRegistry, wrap: Wrap) -> None:
        """Register the gate's own kopf handlers (each wrapped by `wrap`)."""
        ...


class Open:
    """No gate: every job is Kiln's to place at once."""

    def manages(self, job: api.TrainingJob) -> bool:
        return False

    def holds(self, entry: placement_loop.Queued) -> bool:
        return False

    def waiting(self, job: api.TrainingJob, uid: str) -> tuple[api.Reason, str] | None:
        return None

    async def queued(self, body: dict[str, Any], job: api.TrainingJob) -> None:
        return None

    async def suspended(self, ref: jobs.JobRef, suspended: bool) -> None:
        return None

    async def pod_event(self, pod: dict[str, Any], event_type: str | None) -> None:
        return None

    def register(self, registry: kopf.OperatorRegistry, wrap: Wrap) -> None:
        return None

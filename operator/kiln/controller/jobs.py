"""The one way the operator changes a TrainingJob's status, and posts its events.

Callers decide; `Jobs` reads, writes one merge patch under the job's lock, and posts events.
No retries: kopf retries the handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import logging
import socket
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

from kiln import api
from kiln.controller import kube, metrics
from kiln.controller import status as job_status

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, order=True)
class JobRef:
    """A TrainingJob's identity."""

    namespace: str
    name: str

    @property
    def key(self) -> str:
        """``namespace/name``: the job's name for the planner and in logs."""
        return f"{self.namespace}/{self.name}"

    @classmethod
    def of(cls, body: kube.Object) -> JobRef:
        meta = body.get("metadata") or {}
        return cls(str(meta.get("namespace") or "default"), str(meta.get("name")))

    @classmethod
    def parse(cls, key: str) -> JobRef:
        namespace, name = key.split("/", 1)
        return cls(namespace, name)


@dataclasses.dataclass
class Edit:
    """A job read under its lock, and the status being changed (see `Jobs.edit`).

    Attributes:
        body: the job as read (None when it no longer exists).
        status: a deep copy of its status to change in place: its wire form, whose parts are
            built and read as the `api` status types (`kiln.controller.status`).
        events: events to post once the change is written.
    """

    body: kube.Object | None
    status: kube.Object
    jobs: Jobs
    events: list[job_status.Event] = dataclasses.field(default_factory=list)

    async def commit(self) -> None:
        """Write the status and post the events now (the lock stays held)."""
        if self.body is None:
            return
        self.body = await self.jobs.write(self.body, self.status, self.events)
        self.events = []
        if self.body is not None:
            self.status = copy.deepcopy(self.body.get("status") or {})

    @property
    def generation(self) -> int | None:
        value = ((self.body or {}).get("metadata") or {}).get("generation")
        return int(value) if isinstance(value, int) else None

    def condition(self, type_: api.ConditionType, value: bool | None, reason: api.Reason,
                  message: str, *, now: float, event: str | None = None) -> bool:
        """Set a condition; when it changed and `event` is "Normal"/"Warning", post one."""
        changed = job_status.set_condition(self.status, type_, value, reason, message, now=now,
                                       generation=self.generation)
        if changed and event:
            self.events.append(job_status.Event(event, reason, message))
        return changed


class Jobs:
    """Reads jobs and writes their status under per-job locks.

    Several parts of the operator act on one job: kopf handlers, pod events and the placement
    loop. Conditions are a list, and a JSON merge patch replaces a list whole, so two writers
    computing from different snapshots would drop each other's conditions. Hence every status
    change reads the job under its asyncio lock, lets the caller change a copy of the status
    (the pure helpers of `kiln.controller.status`), and sends one merge patch of the
    difference to the status subresource; kopf's own `patch` is never used for status.

    Args:
        client: the API client.
        metrics: the operator's metrics (phase gauge).
        clock: epoch seconds (event timestamps).
    """

    def __init__(self, client: kube.Client, *, metrics: metrics.OperatorMetrics,
                 clock: Callable[[], float]) -> None:
        self.client = client
        self.metrics = metrics
        self.clock = clock
        self._locks: dict[JobRef, asyncio.Lock] = {}
        self._instance = socket.gethostname()

    def lock(self, ref: JobRef) -> asyncio.Lock:
        """The job's lock (created on first use)."""
        found = self._locks.get(ref)
        if found is None:
            found = self._locks[ref] = asyncio.Lock()
        return found

    def forget(self, ref: JobRef) -> None:
        """Drop what is kept about a deleted job."""
        self._locks.pop(ref, None)
        self.metrics.set_phase(ref.namespace, ref.name, None)

    async def fetch(self, ref: JobRef) -> kube.Object | None:
        """The job as the API server has it now, or None."""
        return await self.client.get(kube.Paths.job(ref.namespace, ref.name))

    @contextlib.asynccontextmanager
    async def edit(self, ref: JobRef) -> AsyncIterator[Edit]:
        """Hold the job's lock, read it, and write the changed status on exit.

        `Edit.commit` writes earlier, e.g. before creating a pod under the same lock.

        Example:
            >>> async with jobs.edit(ref) as edit:                # doctest: +SKIP
            ...     if edit.body is None:
            ...         return
            ...     edit.condition(api.ConditionType.QUEUED, True, api.Reason.PLANNED, "...",
            ...                    now=clock(), event="Normal")

        Raises:
            kube.ApiError: reading or writing failed (nothing else was done).
        """
        async with self.lock(ref):
            body = await self.fetch(ref)
            edit = Edit(body, copy.deepcopy((body or {}).get("status") or {}), self)
            yield edit
            await edit.commit()

    async def write(self, body: kube.Object, new_status: kube.Object,
                    events: Sequence[job_status.Event] = ()) -> kube.Object | None:
        """Patch the job's status to `new_status` (phase derived), then post `events`.

        Call with the job's lock held. Returns the job as written, None when it is gone.
        """
        ref = JobRef.of(body)
        old = body.get("status") or {}
        new = job_status.with_phase(new_status)
        patch = job_status.merge_patch(old, new)
        written: kube.Object | None = body
        if patch:
            written = await self.client.merge_patch(
                kube.Paths.job(ref.namespace, ref.name, status=True), {"status": patch})
            if written is None:
                return None
            written = {**written, "status": new}
        # The phase gauge follows the status at once; events may take a while to post.
        self.metrics.set_phase(ref.namespace, ref.name, api.Phase(new["phase"]))
        for event in events:
            await self.post_event(body, event)
        return written

    async def post_event(self, body: kube.Object, event: job_status.Event) -> None:
        """Post a core/v1 Event about the job (best effort: failures are logged).

        Not `kopf.info`: kopf's poster only exists inside kopf's per-object tasks, and the
        placement loop is not one. Events are named ``<job>.<random hex>`` (kubectl's
        convention) and carry the condition's reason.
        """
        await self.post(body, event.type, event.reason.value, event.message)

    async def post(self, body: kube.Object, type_: str, reason: str, message: str) -> None:
        """Post a core/v1 Event about `body`, a TrainingJob or a TrainingSweep (its kind is
        the involved object's), best effort."""
        meta = body.get("metadata") or {}
        ref = JobRef.of(body)
        now = job_status.rfc3339(self.clock())
        manifest = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{ref.name}.{uuid.uuid4().hex[:16]}",
                         "namespace": ref.namespace},
            "involvedObject": {"apiVersion": body.get("apiVersion") or api.API_VERSION,
                               "kind": body.get("kind") or api.KIND,
                               "name": ref.name, "namespace": ref.namespace,
                               "uid": meta.get("uid")},
            "type": type_,
            "reason": reason,
            "message": job_status.cap(message, job_status.EVENT_MESSAGE_MAX_BYTES),
            "source": {"component": "kiln-operator"},
            "reportingComponent": "kiln.dev/operator",
            "reportingInstance": self._instance,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            await self.client.create(kube.Paths.events(ref.namespace), manifest)
        except kube.ApiError as exc:
            _log.warning("%s: could not post event %s (%s)", ref.key, reason, exc)

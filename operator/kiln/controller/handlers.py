"""The kopf handlers: thin adapters from kopf's causes to one domain call each.

Status is never written through kopf's `patch`: every status change goes through
`kiln.controller.jobs`, the one writer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any

import aiohttp
import kopf

from kiln import api
from kiln.controller import (
    admission,
    gates,
    housekeeping,
    jobs,
    kube,
    lifecycle,
    profiling,
    status,
    sweeper,
    sweeps,
)
from kiln.controller import settings as operator_settings

JOBS = (api.GROUP, api.VERSION, api.PLURAL)
FINALIZER = "kiln.dev/finalizer"
ANNOTATION_PREFIX = "kiln.dev"
API_RETRY_DELAY_SECONDS = 5.0
# A handler with a `give_up` step tries this often after unexpected errors, waiting
# UNEXPECTED_RETRY_DELAY_SECONDS (doubling) in between, then gives up on the object.
UNEXPECTED_ATTEMPTS = 3
UNEXPECTED_RETRY_DELAY_SECONDS = 2.0

Handler = Callable[..., Awaitable[Any]]


@dataclasses.dataclass
class Operator:
    """The running operator's parts, which the handlers reach on kopf's memo
    (``memo.operator``); `kiln.controller.main.build` makes them.

    Attributes:
        deps: what the job steps use.
        gate: the admission gate (`gates.Open`, or Kueue's under --kueue).
        http: the session trainers' metrics are read with, from `start` to `stop`.
    """

    deps: lifecycle.Deps
    gate: gates.Gate
    http: aiohttp.ClientSession | None = None
    _tasks: list[asyncio.Task[None]] = dataclasses.field(default_factory=list)

    async def start(self) -> None:
        """Start the placement loop and the HTTP session. (The warm-start graph worker starts
        with the first job to admit, `admit`: an operator that admits none spends no
        process importing torch.)"""
        self.http = aiohttp.ClientSession()
        self.run_in_background(self.deps.placement.run(), name="kiln placement loop")

    def run_in_background(self, work: Coroutine[Any, Any, None], *, name: str) -> None:
        """Run `work` (a loop that never returns) until `stop`."""
        self._tasks.append(asyncio.create_task(work, name=name))

    async def stop(self) -> None:
        """Stop what `start` started and close the clients (idempotent)."""
        for task in self._tasks:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._tasks = []
        if self.http is not None:
            await self.http.close()
            self.http = None
        await self.deps.client.close()
        self.deps.parents.close()


def register(registry: kopf.OperatorRegistry, options: operator_settings.Options,
             gate: gates.Gate) -> None:
    """Register every handler of the operator into `registry`.

    | handler (id) | kopf cause | domain call |
    |---|---|---|
    | login | operator login (and after a 401) | `kube.connection_info` |
    | startup / cleanup | operator start / stop | kopf settings; `Operator.start` / `stop` |
    | admit | TrainingJob created | `admission.admit` (validate, warm start, queue) |
    | resume | operator (re)started, job exists | `admission.requeue` |
    | suspend | spec.runPolicy.suspend changed | `lifecycle.suspend` / `unsuspend` |
    | spec-edit | spec changed | `admission.edited` (a Warning event for ignored edits) |
    | cleanup-job | TrainingJob deleted: with --finalizer, before it goes; else its DELETED
    event (the garbage collector deletes its pods) | `lifecycle.forget` (delete its pods) |
    | pods | any event of a pod labelled kiln.dev/job-name | `lifecycle.observe_pod`; a
    profiling pod's: `admission.profiled`; then the gate's `pod_event` |
    | housekeeping | timer per placed or TTL-bound job (--finalizer); else an index of those
    jobs, swept by `sweeper.run` | `housekeeping.tick` |
    | the gate's | as `gate` registers them (Kueue: Workload events, the end of
    queue-labelled jobs) | `gate`'s (`kueue.Kueue.observe`, `finish`) |
    | sweeps / sweep-trials | any event of a TrainingSweep, or of a job labelled
    kiln.dev/sweep | `sweeps.reconcile` (also every few seconds: `sweeps.resync_forever`) |

    Each job handler is wrapped by `_surfaced`; the timer's interval comes from `options`.
    """

    def login(**_: Any) -> kopf.ConnectionInfo:
        # Re-read on every call: kopf logs in again after a 401 (rotated service-account token).
        return kube.connection_info(kubeconfig=options.kubeconfig)

    kopf.on.login(registry=registry, id="login")(login)
    kopf.on.startup(registry=registry, id="startup")(startup)
    kopf.on.cleanup(registry=registry, id="cleanup")(cleanup)
    kopf.on.create(*JOBS, registry=registry, id="admit")(
        _surfaced("admit", admit, give_up=admission.give_up))
    kopf.on.resume(*JOBS, registry=registry, id="resume")(_surfaced("resume", resume))
    kopf.on.update(*JOBS, registry=registry, id="suspend", field="spec.runPolicy.suspend")(
        _surfaced("suspend", suspend))
    kopf.on.update(*JOBS, registry=registry, id="spec-edit", field="spec")(
        _surfaced("spec-edit", spec_edited))
    if options.finalizer:
        kopf.on.delete(*JOBS, registry=registry, id="cleanup-job")(_surfaced("cleanup", delete))
    else:  # no delete handler, so kopf adds no finalizer (and removes one left by --finalizer)
        kopf.on.event(*JOBS, registry=registry, id="cleanup-job")(
            _surfaced("cleanup", deleted))
    kopf.on.event("v1", "pods", registry=registry, id="pods",
                  labels={api.JOB_NAME_LABEL: kopf.PRESENT})(_surfaced("pods", pod_event))
    if options.finalizer:
        kopf.timer(*JOBS, registry=registry, id="housekeeping",
                   interval=options.housekeeping_interval_seconds, when=housekeeping.needed)(
            _surfaced("housekeeping", housekeeping_tick))
    else:  # kopf's timers always add a finalizer: `sweeper` ticks the indexed jobs instead
        kopf.index(*JOBS, registry=registry, id=sweeper.INDEX_ID, when=housekeeping.needed)(
            sweeper.index_job)
    gate.register(registry, _surfaced)
    sweeps.register(registry)


async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **kwargs: Any) -> None:
    """Configure kopf and start the operator (`Operator.start`, and its background loops).

    Finalizer ``kiln.dev/finalizer`` (used only with --finalizer), progress and diff-base
    annotations under ``kiln.dev/``; the pod watch selects Kiln's pods by label on the API
    server; standalone unless --peering names a peering object (then
    kopf pauses every replica but the leader); kopf's log-to-event posting off (events are
    posted explicitly); namespace scanning off unless a watched namespace is a glob.
    """
    op: Operator = memo.operator
    options = op.deps.options
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration")
    settings.peering.standalone = options.peering is None
    # kopf filters handlers by label on its side; this makes the API server send only Kiln's
    # pods, instead of every pod of the cluster, to the pod watch.
    settings.watching.label_selectors["v1", "pods"] = api.JOB_NAME_LABEL
    settings.posting.enabled = False
    settings.scanning.disabled = not any(
        ch in ns for ns in options.namespaces for ch in "*?[!")
    await op.start()
    if sweeper.INDEX_ID in kwargs:  # --no-finalizer: the index kopf passes by its id
        op.run_in_background(sweeper.run(
            kwargs[sweeper.INDEX_ID], tick=functools.partial(_tick, op),
            leads=op.deps.placement.leads, counts=op.deps.metrics,
            interval_seconds=options.housekeeping_interval_seconds), name="kiln housekeeping")
    if options.zoo_capacity is not None:
        op.run_in_background(housekeeping.collect_zoo_forever(op.deps), name="kiln zoo eviction")
    op.run_in_background(sweeps.resync_forever(op.deps), name="kiln sweeps")


async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    """Stop what startup started."""
    op: Operator = memo.operator
    await op.stop()


async def admit(body: kopf.Body, retry: int, memo: kopf.Memo, **_: Any) -> None:
    """Validate a new TrainingJob, choose its warm-start parent, and queue it."""
    op: Operator = memo.operator
    op.deps.parents.warm_up()  # in the background, while the job is validated
    await admission.admit(op.deps, op.gate, dict(body), retry=retry)


async def resume(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Put an existing job back where it was (queue, or its pod) after an operator restart."""
    op: Operator = memo.operator
    await admission.requeue(op.deps, op.gate, jobs.JobRef.of(dict(body)))


async def suspend(body: kopf.Body, new: Any, memo: kopf.Memo, **_: Any) -> None:
    """Suspend or resume a job when spec.runPolicy.suspend flips."""
    op: Operator = memo.operator
    ref = jobs.JobRef.of(dict(body))
    if new:
        await lifecycle.suspend(op.deps, ref)
    else:
        await lifecycle.unsuspend(op.deps, ref)
    await op.gate.suspended(ref, bool(new))


async def spec_edited(body: kopf.Body, old: Any, memo: kopf.Memo, **_: Any) -> None:
    """An admitted job's spec changed: name what does not take effect."""
    await admission.edited(memo.operator.deps, dict(body), old)


async def delete(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A job is being deleted: delete its pods and forget it."""
    await lifecycle.forget(memo.operator.deps, jobs.JobRef.of(dict(body)),
                           str(body.meta.uid or ""))


async def deleted(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A job is gone (no finalizer): delete its pods, should the garbage collector lag, and
    forget it."""
    if type == "DELETED":
        await lifecycle.forget(memo.operator.deps, jobs.JobRef.of(dict(body)),
                               str(body.meta.uid or ""))


async def pod_event(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A trainer or profiling pod appeared, changed or vanished."""
    op: Operator = memo.operator
    if profiling.is_profiling_pod(body):
        await admission.profiled(op.deps, op.gate, dict(body), type)
    else:
        await lifecycle.observe_pod(op.deps, dict(body), type)
    await op.gate.pod_event(dict(body), type)  # a profiling pod runs within the gate's admission


async def housekeeping_tick(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """TTL, deadline and progress of one job."""
    await _tick(memo.operator, body)


async def _tick(op: Operator, body: Mapping[str, Any]) -> None:
    await housekeeping.tick(op.deps, body, http=op.http)


GiveUp = Callable[[lifecycle.Deps, kube.Object, Exception, int], Awaitable[None]]


def _surfaced(name: str, handler: Handler, *, give_up: GiveUp | None = None) -> Handler:
    """`handler` with its wall time in kiln_reconcile_seconds and its errors surfaced.

    API errors worth retrying become `kopf.TemporaryError`; anything unexpected is counted,
    posted as an UnexpectedError Warning event on the job, and re-raised for kopf to retry.
    With `give_up`, unexpected errors are retried UNEXPECTED_ATTEMPTS times in all, with
    short backoffs, and then `give_up(deps, body, error, attempts)` ends the job.
    """

    @functools.wraps(handler)
    async def wrapped(**kwargs: Any) -> Any:
        deps: lifecycle.Deps = kwargs["memo"].operator.deps
        started = time.perf_counter()
        try:
            return await handler(**kwargs)
        except (kopf.TemporaryError, kopf.PermanentError):
            raise
        except kube.ApiError as exc:
            deps.metrics.reconcile_errors.labels(handler=name).inc()
            if exc.retryable:
                raise kopf.TemporaryError(f"API server: {exc}",
                                          delay=API_RETRY_DELAY_SECONDS) from exc
            raise
        except Exception as exc:
            deps.metrics.reconcile_errors.labels(handler=name).inc()
            body = kwargs.get("body")
            if body is None or body.get("kind") != api.KIND:
                raise
            attempt = int(kwargs.get("retry") or 0) + 1
            if give_up is not None and attempt >= UNEXPECTED_ATTEMPTS:
                await give_up(deps, dict(body), exc, attempt)
                return None
            limit = f" (attempt {attempt} of {UNEXPECTED_ATTEMPTS})" if give_up else ""
            await deps.jobs.post_event(dict(body), status.Event.warning(
                api.Reason.UNEXPECTED_ERROR,
                f"Unexpected error in the operator's {name} handler: "
                f"{type(exc).__name__}: {exc}; it is retried{limit}. Please report it."))
            if give_up is None:
                raise
            delay = UNEXPECTED_RETRY_DELAY_SECONDS * 2.0 ** (attempt - 1)
            raise kopf.TemporaryError(f"{type(exc).__name__}: {exc}", delay=delay) from exc
        finally:
            deps.metrics.reconcile_seconds.labels(handler=name).observe(
                time.perf_counter() - started)

    return wrapped

"""Per-job periodic checks: TTL after the end, the active deadline, the pod start timeout,
and live progress; and the zoo-wide one, eviction down to --zoo-capacity (with the unusable
records of jobs that no longer run).

The runPolicy fields are read from the raw spec, so an invalid job (which has no parsed spec)
still honours its TTL.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Mapping
from typing import Any

import aiohttp

from kiln import api
from kiln.controller import (
    jobs,
    kube,
    lifecycle,
    pods,
    policy,
    progress,
    status,
)
from kiln.zoo import eviction, records, store

C = api.ConditionType
_log = logging.getLogger(__name__)


def needed(status: Mapping[str, Any], spec: Mapping[str, Any], **_: Any) -> bool:
    """Whether a job needs the timer: placed and active, or finished with a TTL.

    kopf runs timers only while this holds, so a thousand queued jobs cost no timers.
    """
    phase = (status or {}).get("phase")  # written with every status change (cheap to read)
    if phase in (api.Phase.SUCCEEDED, api.Phase.FAILED):
        return _int(((spec or {}).get("runPolicy") or {}).get("ttlSecondsAfterFinished")) \
            is not None
    return phase != api.Phase.SUSPENDED and int((status or {}).get("attempts") or 0) > 0


async def tick(deps: lifecycle.Deps, body: Mapping[str, Any], *,
               http: aiohttp.ClientSession | None) -> None:
    """One round of checks for one job.

    * finished with ``ttlSecondsAfterFinished``: once completionTime + TTL has passed, the job
      is deleted (its finalizer then deletes its pods);
    * active with ``activeDeadlineSeconds``: once startTime + deadline has passed, the job
      fails with DeadlineExceeded (startTime is set when the job is placed and again when it
      resumes from suspension: queueing time does not count);
    * placed but not running: once the pod has waited ``--pod-start-timeout-seconds`` since its
      launch (an image that cannot be pulled, a missing Secret, no node for it), the pod is
      deleted, releasing its devices, and the job fails with PodStartTimeout: such a cause
      does not go away by itself. A multi-node job starts whole or not at all: this covers
      each of its pods, also once rank 0 runs (it would hold its devices, waiting for the
      others). Missing pods of the attempt are created (`lifecycle.ensure_pod`: their
      earlier pods have gone, or their creation was refused and its back-off has passed);
    * running: the trainer's metrics are read into status.progress; its ETA, throughput and
      first steps after a move feed the planner's introspection;
    * placed or running under ``--zoo-pod-access presigned``: its zoo access is signed again
      when less than half its lifetime is left (`zoo_access.ZooAccess.refresh`).
    """
    if lifecycle.deleting(dict(body)):
        return
    ref = jobs.JobRef.of(dict(body))
    st = body.get("status") or {}
    run_policy = (body.get("spec") or {}).get("runPolicy") or {}
    now = deps.clock()
    if status.is_terminal(st):
        deps.zoo_access.forget(str((body.get("metadata") or {}).get("uid")))
        ttl = _int(run_policy.get("ttlSecondsAfterFinished"))
        if policy.ttl_expired(status.parse_rfc3339(st.get("completionTime")), ttl, now):
            await _delete_finished(deps, ref, ttl)
        return
    if status.is_true(st, C.SUSPENDED):
        return
    deadline = _int(run_policy.get("activeDeadlineSeconds"))
    started = status.parse_rfc3339(st.get("startTime"))
    if policy.deadline_passed(started, deadline, now):
        await lifecycle.fail(deps, ref, api.Reason.DEADLINE_EXCEEDED, (
            f"The job ran past spec.runPolicy.activeDeadlineSeconds {deadline} s (started "
            f"{st.get('startTime')}); its trainer was stopped. Raise the deadline or shorten "
            "the training to finish in time."))
        return
    if status.is_true(st, C.PLACED) or status.is_true(st, C.RUNNING):
        await deps.zoo_access.refresh(body)  # before its pods' presigned URLs expire
    if status.is_true(st, C.RUNNING):
        await _read_progress(deps, ref, body, http)
        if lifecycle.spans_nodes(st):  # rank 0 runs; every other pod must start too
            await _check_start(deps, body, now)
    elif status.is_true(st, C.PLACED):
        await _check_start(deps, body, now)


async def _check_start(deps: lifecycle.Deps, body: Mapping[str, Any], now: float) -> None:
    """Fail the job if a pod of its current attempt has not started within the start timeout
    (deleting the late pods; cleanPodPolicy takes the others); create the attempt's pods that
    are missing."""
    ref = jobs.JobRef.of(dict(body))
    placement = status.part(body.get("status") or {}, "placement", api.PlacementStatus)
    expected = max(1, len(placement.nodes or []))
    current = await lifecycle.current_pods(deps.client, dict(body))
    if len(current) < expected:
        await lifecycle.ensure_pod(deps, ref)
        return
    timeout_seconds = deps.options.pod_start_timeout_seconds
    late = [p for p in current if policy.start_timed_out(p, timeout_seconds, now)]
    if not late:
        return
    message = policy.start_timeout_message(late[0], timeout_seconds)
    if expected > 1:
        message += (f" A multi-node job starts all its {expected} pods or none, so the "
                    "others were stopped too.")
    await lifecycle.fail(deps, ref, api.Reason.POD_START_TIMEOUT, message,
                         delete_pods=tuple(p.name for p in late))


async def _delete_finished(deps: lifecycle.Deps, ref: jobs.JobRef, ttl: int | None) -> None:
    """Delete a job whose TTL passed, once (the timer's body may predate the deletion)."""
    async with deps.jobs.lock(ref):
        if lifecycle.deleting(await deps.jobs.fetch(ref)):
            return
        _log.info("%s: ttlSecondsAfterFinished %s s passed; deleting the job", ref.key, ttl)
        await deps.client.delete(kube.Paths.job(ref.namespace, ref.name))


async def _read_progress(deps: lifecycle.Deps, ref: jobs.JobRef, body: Mapping[str, Any],
                         http: aiohttp.ClientSession | None) -> None:
    st = body.get("status") or {}
    attempt = int(st.get("attempts") or 0) - 1
    pod = await deps.client.get(kube.Paths.pod(ref.namespace, pods.pod_name(ref.name, attempt)))
    if pod is None:
        return
    where = progress.address(deps.options.progress_address, pods.pod_state(pod), ref.namespace)
    if where is None:
        return
    if http is None:
        return
    text = await progress.read(http, where,
                               timeout_seconds=deps.options.progress_timeout_seconds)
    if text is None:
        return
    running = api.running_doc(body).get("spec") or {}  # the admitted epochs, whatever edits say
    epochs = int((running.get("training") or {}).get("epochs") or 1)
    rejected: dict[str, float] = {}
    try:
        found = progress.parse(text, epochs=epochs, rejected=rejected)
        verdict = progress.warm_start_decision(text)
    except ValueError as exc:
        _log.warning("%s: unreadable trainer metrics at %s (%s)", ref.key, where, exc)
        return
    if rejected:
        _log.warning("%s: ignoring trainer metrics no trainer reports: %s", ref.key,
                     ", ".join(f"{k}={v!r}" for k, v in sorted(rejected.items())))
    if found is None:
        return
    if found.eta_seconds is not None:
        deps.caches.eta_seconds[ref.key] = found.eta_seconds
    deps.placement.observe_progress(ref.key, samples_per_second=found.samples_per_second,
                                   step=found.step, now=deps.clock(),
                                   compute_fraction=found.compute_fraction)
    async with deps.jobs.edit(ref) as e:
        if (lifecycle.deleting(e.body) or not status.is_true(e.status, C.RUNNING)
                or int(e.status.get("attempts") or 0) - 1 != attempt):
            return
        e.status["progress"] = api.to_wire(found.model_copy(
            update={"last_updated_time": status.rfc3339(deps.clock())}))
        if verdict is not None:
            await lifecycle.take_trainer_decision(
                deps, e, _with_admission(e.status.get("warmStart") or {}, verdict),
                pod=pods.pod_name(ref.name, attempt), now=deps.clock())


def _with_admission(warm: Mapping[str, Any], live: dict[str, Any]) -> dict[str, Any]:
    """The trainer's live warm-start verdict (outcome, parent, reason, probe scores) completed
    from the decision in status.warmStart, which its metrics do not repeat: the admitted
    parent's similarity and tensor counts when it kept that parent or started cold, its metric
    only when it kept it; the alternatives always."""
    admitted = api.WarmStartDecision.model_validate(warm).model_dump(mode="json")
    kept = live.get("parent") is not None and live.get("parent") == admitted["parent"]
    inherited = ["alternatives"]
    if kept or live.get("parent") is None:
        inherited += ["similarity", "matched_tensors", "total_tensors"]
    if kept:
        inherited.append("parent_metric")
    return {**{name: admitted[name] for name in inherited}, **live}


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


async def collect_zoo_forever(deps: lifecycle.Deps) -> None:
    """Hold the zoo to --zoo-capacity every --zoo-gc-interval-seconds (first right away).

    A round that cannot list the jobs or reach the zoo evicts nothing and only warns: without
    knowing every live job's parent, nothing may go.
    """
    while True:
        try:
            await collect_zoo(deps)
        except (kube.ApiError, store.StoreUnavailable, store.StoreMisconfigured) as exc:
            _log.warning("zoo eviction skipped this round: %s", exc)
        await asyncio.sleep(deps.options.zoo_gc_interval_seconds)


async def collect_zoo(deps: lifecycle.Deps) -> eviction.Plan | None:
    """One eviction round: protect what live jobs use, then delete what the plan evicts and
    the unusable records reserved for jobs that no longer run (`eviction.abandoned`).

    Returns:
        The plan carried out, or None when no --zoo-capacity is set.

    Raises:
        kube.ApiError: the jobs could not be listed.
        store.StoreUnavailable: the zoo failed (records already deleted stay deleted).
    """
    if deps.options.zoo_capacity is None:
        return None
    protect, running = await live_zoo_use(deps)
    now = datetime.datetime.fromtimestamp(deps.clock(), datetime.UTC)
    capacity_bytes = eviction.parse_size(deps.options.zoo_capacity)
    zoo = deps.parents.zoo

    # A zoo may be shared with operators of other namespaces, whose live jobs this one never
    # lists: only records reserved in namespaces it lists may be judged abandoned.
    listed = _listed(deps.options.namespaces)

    def watched(namespace: str) -> bool:
        return not listed or namespace in listed

    def collect() -> tuple[eviction.Plan, list[str]]:  # store I/O: off the event loop
        chosen = eviction.plan(eviction.survey(
            zoo, now=now, half_life_seconds=deps.options.zoo_hit_half_life_seconds,
            protect=protect, live_jobs=running), capacity_bytes=capacity_bytes)
        eviction.carry_out(zoo, chosen)
        return chosen, eviction.abandoned(zoo, chosen.entries, live_jobs=running,
                                          watched=watched)

    chosen, stale = await asyncio.to_thread(collect)
    if stale:
        # A job created since the listing above reserved its id before any pod of it could
        # write there: list again and re-check each folder, so no record being written goes.
        _, running = await live_zoo_use(deps)

        def drop() -> list[str]:
            gone = []
            for record_id in stale:
                if records.claims_of(zoo, record_id) & running or not records.unusable(
                        zoo, record_id):
                    continue
                records.delete_record(zoo, record_id)
                gone.append(record_id)
            return gone

        for record_id in await asyncio.to_thread(drop):
            _log.info("zoo: deleted unusable record %s (half-written by a pod that failed, or "
                      "naming another job than the one it was reserved for); its job no longer "
                      "runs", record_id)
    for entry in chosen.evict:
        _log.info("zoo eviction: deleted %s (%d bytes, %d hits, value %.3g) to keep %s within "
                  "--zoo-capacity %s", entry.record.id, entry.size_bytes, entry.hits,
                  entry.value, zoo.describe(), deps.options.zoo_capacity)
    if chosen.over_capacity:
        _log.warning("zoo %s holds %d bytes, over --zoo-capacity %s (%d bytes), but the rest "
                     "is in use by live jobs", zoo.describe(), chosen.after_bytes,
                     deps.options.zoo_capacity, chosen.capacity_bytes)
    return chosen


def _listed(namespaces: tuple[str, ...]) -> tuple[str, ...]:
    """The namespaces whose jobs `live_zoo_use` lists; empty: every one (no --namespace, or
    patterns, which kopf matches cluster-wide then)."""
    return () if any(ch in ns for ns in namespaces for ch in "*?[!") else namespaces


async def live_zoo_use(deps: lifecycle.Deps
                       ) -> tuple[dict[str, str], set[tuple[str, str]]]:
    """What unfinished jobs use: record id -> why it stays (their parents, decided or pinned,
    and the alternatives their trainer may fall back to), and their (namespace, name) pairs
    (their provisional records stay).

    Raises:
        kube.ApiError: the jobs could not be listed.
    """
    namespaces = _listed(deps.options.namespaces)
    listed: list[kube.Object] = []
    for namespace in namespaces or (None,):
        listed += await deps.client.list(kube.Paths.jobs(namespace))
    protect: dict[str, str] = {}
    running: set[tuple[str, str]] = set()
    for body in listed:
        if status.is_terminal(body.get("status") or {}):
            continue
        meta = body.get("metadata") or {}
        name = str(meta.get("name") or "")
        running.add((str(meta.get("namespace") or ""), name))
        warm = (body.get("status") or {}).get("warmStart") or {}
        # A pinned parent until admission decided (then status holds what was checked: a
        # spec edited later, or a pod's report, protects nothing).
        pinned = None if warm else (((body.get("spec") or {}).get("warmStart") or {}).get(
            "parent"))
        if isinstance(pinned, str) and pinned != "auto" and not await asyncio.to_thread(
                records.visible_ids, deps.parents.zoo, [pinned], str(meta.get("namespace") or "")):
            pinned = None  # another namespace's private model: naming it keeps nothing
        used = [warm.get("parent"), *(warm.get("alternatives") or []), pinned]
        for record_id in used:
            if isinstance(record_id, str) and record_id != "auto":
                protect.setdefault(record_id, f"parent of live job {meta.get('namespace')}/{name}")
    return protect, running


"""A job's life after admission: its plan, launch, pod events, restarts, the end, suspension.

Each step runs under the job's lock through `jobs.Jobs.edit`, writing status before pods, so a
crash in between is repaired on resume by `ensure_pod`. No admission, no planning.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

from kiln import api, contract
from kiln.controller import (
    cache,
    gang,
    jobs,
    kube,
    listing,
    metrics,
    parents,
    placement_loop,
    pods,
    policy,
    profiling,
    reports,
    settings,
    status,
    zoo_access,
)
from kiln.placement import introspect, types
from kiln.warmstart import select
from kiln.zoo import records, store

C, R = api.ConditionType, api.Reason
_log = logging.getLogger(__name__)
RESIZED_ANNOTATION = "kiln.dev/resized"
# The longest wait between two tries to create a pod the API server refused (a ResourceQuota),
# as the Job controller's back-off.
CREATE_RETRY_MAX_SECONDS = 360.0


@dataclasses.dataclass(frozen=True)
class Deps:
    """What a job's steps use (here, in `admission` and in `housekeeping`).

    Attributes:
        options: the operator's settings.
        pod_settings: the pod builder's slice of them.
        client: the API client.
        jobs: the status writer.
        placement: the placement queue.
        caches: the operator's per-job memory.
        parents: the warm-start chooser, and the zoo it reads.
        zoo_access: signs pods' zoo access.
        metrics: the operator's metrics.
        clock: epoch seconds.
    """

    options: settings.Options
    pod_settings: pods.PodSettings
    client: kube.Client
    jobs: jobs.Jobs
    placement: placement_loop.PlacementLoop
    caches: cache.Caches
    parents: parents.ParentChooser
    zoo_access: zoo_access.ZooAccess
    metrics: metrics.OperatorMetrics
    clock: Callable[[], float]


def parse(body: kube.Object) -> api.TrainingJob:
    """The job as it runs: once admitted, on its admitted spec with the edits that take effect
    (`api.parse_running`); status itself is the operator's and not checked.

    Raises:
        api.InvalidSpec: the spec does not parse or validate.
    """
    ref = jobs.JobRef.of(body)
    return api.parse_running(body, source=ref.key)


def deleting(body: kube.Object | None) -> bool:
    return body is None or bool((body.get("metadata") or {}).get("deletionTimestamp"))


def waiting(st: Mapping[str, Any]) -> bool:
    """Queued for placement: not placed, not suspended, not finished."""
    return (status.is_true(st, C.QUEUED) and not status.is_true(st, C.SUSPENDED)
            and not status.is_terminal(st))


def queued_entry(body: kube.Object, job: api.TrainingJob, *,
                 now: float) -> placement_loop.Queued:
    """The queue entry of an admitted job, from its status."""
    st = body.get("status") or {}
    queued = status.condition(st, C.QUEUED)
    since = status.parse_rfc3339(queued.last_transition_time if queued else None)
    return placement_loop.Queued(jobs.JobRef.of(body), job,
                                 status.part(st, "warmStart", api.WarmStartDecision), since or now,
                                 measured=profiling.measurement(
                                     status.part(st, "profile", api.ProfileStatus)))


async def publish_plan(deps: Deps, entry: placement_loop.Queued,
                       assignment: types.Assignment, device: str) -> None:
    """Record a waiting job's planned node and start in status.placement (if changed)."""
    placement = _placement(assignment, device, start=max(assignment.start, deps.clock()))
    if deps.caches.published.get(entry.ref) == placement:
        return
    async with deps.jobs.lock(entry.ref):
        if entry.ref not in deps.placement:  # started, suspended or deleted meanwhile
            return
        path = kube.Paths.job(entry.ref.namespace, entry.ref.name, status=True)
        if await deps.client.merge_patch(path, {"status": {"placement": api.to_wire(placement)}}):
            deps.caches.published[entry.ref] = placement


async def mark_unplaceable(deps: Deps, entry: placement_loop.Queued,
                           why: str) -> None:
    """Placed=False/NoFeasibleConfig (once per distinct reason); the job stays queued."""
    if deps.caches.unplaceable.get(entry.ref) == why:
        return
    message = (f"No node can run this job: {why}. It stays queued and is planned again "
               "when nodes change; or lower spec.resources.gpus / gpusPerNode.")
    now = deps.clock()
    async with deps.jobs.edit(entry.ref) as e:
        if e.body is not None and entry.ref in deps.placement:
            e.condition(C.PLACED, False, R.NO_FEASIBLE_CONFIG, message, now=now,
                        event="Warning")
    deps.caches.unplaceable[entry.ref] = why


async def launch(deps: Deps, entry: placement_loop.Queued,
                 assignment: types.Assignment, device: str) -> bool:
    """Start a job the plan reached: status Placed, placement, attempts + 1 and startTime,
    then the pod ``<job>-trainer-<attempt>`` (a multi-node job's pods), at once or, when a pod
    of an earlier attempt still runs or terminates, once it has gone (`_start_attempt`).
    False when the job is no longer waiting."""
    deps.caches.published.pop(entry.ref, None)
    deps.caches.unplaceable.pop(entry.ref, None)
    now = deps.clock()
    async with deps.jobs.edit(entry.ref) as e:
        if deleting(e.body) or not waiting(e.status):
            return False
        attempt = int(e.status.get("attempts") or 0)
        gpus = assignment.gpus if device == "gpu" else 0
        e.status["placement"] = api.to_wire(
            _placement(assignment, device, start=max(assignment.start, now)))
        e.status["attempts"] = attempt + 1
        e.status["startTime"] = status.rfc3339(now)
        held = f"{gpus} GPU(s)" if gpus else "1 CPU slot"
        if assignment.peer_nodes:
            message = (f"Placed on nodes {', '.join(assignment.all_nodes)} with {held} each "
                       f"({assignment.parallelism}, one trainer pod per node), estimated "
                       f"{assignment.seconds:.0f} s; starting pods "
                       f"{gang.pod_name(entry.ref.name, attempt, 0)} to "
                       f"{gang.pod_name(entry.ref.name, attempt, len(assignment.peer_nodes))}.")
        else:
            message = (f"Placed on node {assignment.node} with {held} "
                       f"({assignment.parallelism}), estimated {assignment.seconds:.0f} s; "
                       f"starting pod {pods.pod_name(entry.ref.name, attempt)}.")
        states = await job_pod_states(deps.client, entry.ref)
        earlier = _blocking(states, e.body, attempt)
        if earlier:  # after a suspension or an eviction: its trainer is still checkpointing
            message = message[:-1] + (
                f" once the pods before it have stopped ({', '.join(p.name for p in earlier)}): "
                "two trainers of one job never run at once.")
        e.condition(C.PLACED, True, R.PLANNED, message, now=now, event="Normal")
        e.condition(C.QUEUED, False, R.PLANNED, message, now=now)
        await e.commit()
        if e.body is None:
            return False
        deps.metrics.queue_wait_seconds.observe(max(0.0, now - entry.since))
        planned = None if assignment.peer_nodes else pods.Launch(  # a gang's: from status
            node=assignment.node, devices=assignment.gpus, parallelism=assignment.parallelism,
            device=device, warm_start=entry.warm_start, estimated_seconds=assignment.seconds,
            started=now)
        await _start_attempt(deps, e, states=states, launch_=planned)
    return True


def _placement(assignment: types.Assignment, device: str, *,
               start: float) -> api.PlacementStatus:
    """status.placement of an assignment: gpus over all its nodes, and `nodes` when several."""
    return api.PlacementStatus(
        node=assignment.node, nodes=list(assignment.all_nodes) if assignment.peer_nodes else None,
        gpus=assignment.devices if device == "gpu" else 0, parallelism=assignment.parallelism,
        estimated_start=status.rfc3339(start), estimated_seconds=round(assignment.seconds, 1))


async def resize(deps: Deps, ref: jobs.JobRef, move: introspect.Move,
                 device: str) -> bool:
    """Move a running job by checkpoint-restart: status.placement and attempts + 1, the
    Restarting condition and a Resized event, the job's kiln.dev/resized annotation, then the
    old pod deleted with the grace period (its trainer checkpoints and exits). The new
    attempt's pod, on the new node and device count, is created once the old pod is gone
    (`ensure_pod`), so it resumes from the last checkpoint. No restart of the backoff limit
    is spent. False when the job no longer runs where the move says.
    """
    now = deps.clock()
    async with deps.jobs.edit(ref) as e:
        st = e.status
        placement = status.part(st, "placement", api.PlacementStatus)
        if (deleting(e.body) or status.is_terminal(st) or status.is_true(st, C.SUSPENDED)
                or not status.is_true(st, C.RUNNING) or e.body is None
                or placement.node != move.from_node
                or (placement.gpus or 0) != (move.from_gpus if device == "gpu" else 0)):
            return False
        attempt = int(st.get("attempts") or 0)
        e.status["placement"] = api.to_wire(api.PlacementStatus(
            node=move.node, gpus=move.gpus if device == "gpu" else 0,
            parallelism=move.parallelism, estimated_start=status.rfc3339(now),
            estimated_seconds=round(move.remaining_seconds, 1)))
        e.status["attempts"] = attempt + 1
        message = (f"Resized ({move.kind}) from {move.from_gpus} to {move.gpus} device(s), node "
                   f"{move.from_node} to {move.node} ({move.parallelism}): predicted to save "
                   f"{move.gain_seconds:.0f} s net of a {move.restart_seconds:.0f} s restart; "
                   f"trainer pod {pods.pod_name(ref.name, attempt)} checkpoints and "
                   f"{pods.pod_name(ref.name, attempt + 1)} resumes from it.")
        e.condition(C.RESTARTING, True, R.RESIZED, message, now=now, event="Normal")
        e.condition(C.RUNNING, False, R.RESIZED, message, now=now)
        await e.commit()
        if e.body is None:
            return False
        deps.caches.eta_seconds.pop(ref.key, None)
        await deps.client.merge_patch(kube.Paths.job(ref.namespace, ref.name), {
            "metadata": {"annotations": {RESIZED_ANNOTATION: json.dumps({
                "from": {"node": move.from_node, "gpus": move.from_gpus},
                "to": {"node": move.node, "gpus": move.gpus, "parallelism": move.parallelism},
                "gainSeconds": round(move.gain_seconds, 1), "time": status.rfc3339(now)},
                separators=(",", ":"))}}})
        await _delete_pods(deps, ref.namespace, [pods.pod_name(ref.name, attempt - 1)])
    return True


async def ensure_pod(deps: Deps, ref: jobs.JobRef) -> None:
    """Create the current attempt's missing pods of a placed, active job once no earlier pod
    of it runs (`_start_attempt`).

    Starts a new attempt whose earlier pods have just gone (a move, a restart after a
    deletion, a resumption), retries a refused creation after its back-off, and repairs an
    operator crash between the status write and the pod creation, and a pod deleted while the
    operator was down.
    """
    async with deps.jobs.edit(ref) as e:
        await _start_attempt(deps, e)


async def observe_pod(deps: Deps, pod: kube.Object, event_type: str | None) -> None:
    """React to a change of a trainer pod.

    Only the current attempt's pod counts. Pending and stuck (a container waiting on its
    image or config, or no node for it) -> Running=False with why, once per problem; Running
    -> Running=True; exit 0 -> Succeeded with the trainer's result (its termination message;
    a zoo model or warm-start parent it was not granted is left out, `reports`);
    a retryable exit with restarts left -> Restarting and a new pod on the same placement (the
    trainer resumes from its checkpoint); otherwise Failed (`policy.after_exit`). A pod deleted
    under a running job counts as a retryable exit; a pod Kubernetes disrupted (its
    DisruptionTarget condition: preemption, eviction, drain) that did not succeed restarts
    without spending backoffLimit (`policy.after_disruption`). A zoo model that a trainer registered
    after its job failed is deleted: a failed job never registers a model. When a pod of an
    earlier attempt, or of a deleted job of the same name, is gone, the current attempt's pods
    may start (`_start_attempt`); when a deleted job's last pod is gone, so is its checkpoint.
    """
    state = pods.pod_state(pod)
    namespace = str((pod.get("metadata") or {}).get("namespace") or "")
    if not state.job or not namespace:
        return
    ref = jobs.JobRef(namespace, state.job)
    gone = event_type == "DELETED"
    async with deps.jobs.edit(ref) as e:
        st = e.status
        if (deleting(e.body) or state.attempt != int(st.get("attempts") or 0) - 1
                or not _owned(state, e.body)):
            if gone and state.owner_uid and (deleting(e.body) or not _owned(state, e.body)):
                await _drop_checkpoint(deps, ref, state.owner_uid)  # a deleted job's pod
            if gone and not deleting(e.body):
                await _start_attempt(deps, e)  # the new attempt's pods waited for this one
            return  # the job is going, or an older attempt's (or a deleted job's) pod
        if gone and await deps.client.get(kube.Paths.pod(namespace, state.name)) is not None:
            return  # an older object of the pod's name: the pod was created again meanwhile
        if status.is_terminal(st):
            if status.is_true(st, C.FAILED) and state.finished and not gone:
                await _discard_late_model(deps, e.body or {}, state)
            return
        if status.is_true(st, C.SUSPENDED):
            if state.active and not gone:  # created just before the suspension
                await _delete_pods(deps, namespace, [state.name])
            return
        if waiting(st):  # stopped to wait again (Kueue evicted it): its pod's end is no exit
            return
        now = deps.clock()
        if state.disruption is not None and (gone or state.deleting or (
                state.finished and state.phase != "Succeeded")):
            verdict = policy.after_disruption(
                state.name, state.disruption,
                "deleted before the trainer finished" if gone or not state.finished else
                policy.describe_exit(state.exit_code if state.exit_code is not None else 1,
                                     state.container_reason),
                restarts=int(st.get("restarts") or 0),
                backoff_limit=parse(e.body or {}).spec.run_policy.backoff_limit)
        elif gone or state.deleting:
            verdict = policy.after_exit(
                143, "Deleted", f"pod {state.name} was deleted before the trainer finished",
                restarts=int(st.get("restarts") or 0),
                backoff_limit=parse(e.body or {}).spec.run_policy.backoff_limit)
        elif pods.rank_of(pod) > 0 and state.phase in ("Running", "Succeeded"):
            return  # rank 0's pod speaks for the gang; another rank's exit 0 ends nothing
        elif state.phase == "Running":
            message = f"Trainer pod {state.name} is running on node {state.node}."
            e.condition(C.RUNNING, True, R.TRAINER_STARTED, message, now=now, event="Normal")
            if status.condition(st, C.RESTARTING) is not None:
                e.condition(C.RESTARTING, False, R.TRAINER_STARTED, message, now=now)
            return
        elif state.phase == "Pending":
            stuck = policy.not_started(state)
            if stuck is not None and not _told(st, stuck):
                e.condition(C.RUNNING, False, stuck.reason, stuck.message, now=now,
                            event="Warning")
            return
        elif state.finished:
            exit_code = state.exit_code if state.exit_code is not None else (
                0 if state.phase == "Succeeded" else 1)
            verdict = policy.after_exit(
                exit_code, state.container_reason, _trainer_words(state.message),
                restarts=int(st.get("restarts") or 0),
                backoff_limit=parse(e.body or {}).spec.run_policy.backoff_limit,
                reported=_result(state.message) is not None)
        else:
            return
        await _apply(deps, e, state, verdict, now)


async def _apply(deps: Deps, e: jobs.Edit, state: pods.PodState, verdict: policy.Verdict,
                 now: float) -> None:
    ref = jobs.JobRef.of(e.body or {})
    job = parse(e.body or {})
    if verdict.action is policy.Action.RESTART:
        attempt = int(e.status.get("attempts") or 0)
        if verdict.spends_restart:
            e.status["restarts"] = int(e.status.get("restarts") or 0) + 1
        e.status["attempts"] = attempt + 1
        e.condition(C.RESTARTING, True, verdict.reason, verdict.message, now=now,
                    event="Warning")
        e.condition(C.RUNNING, False, verdict.reason, verdict.message, now=now)
        await e.commit()
        if e.body is not None:
            deps.metrics.count_restart(ref.namespace)
            if spans_nodes(e.status):  # the whole gang restarts: its pods hang without a peer
                await _delete_pods(deps, ref.namespace, [
                    p.name for p in await job_pod_states(deps.client, ref)
                    if p.attempt == attempt - 1])
            await _start_attempt(deps, e)  # at once, unless an old pod is still stopping
        return
    if verdict.action is policy.Action.SUCCEED:
        result = await _granted_result(deps, e, job, state)
        if result is not None:
            e.status["result"] = api.to_wire(_result_status(result))
            e.status["progress"] = api.to_wire(_final_progress(
                status.part(e.status, "progress", api.ProgressStatus), result))
            await take_trainer_decision(deps, e, result.warm_start_decision,
                                        pod=state.name, now=now)
        message = _success_message(job, result)
        e.condition(C.SUCCEEDED, True, R.TRAINING_COMPLETED, message, now=now, event="Normal")
        e.condition(C.RUNNING, False, R.TRAINING_COMPLETED, message, now=now)
    else:
        e.condition(C.FAILED, True, verdict.reason, verdict.message, now=now, event="Warning")
        if status.condition(e.status, C.RUNNING) is not None:
            e.condition(C.RUNNING, False, verdict.reason, verdict.message, now=now)
    if status.is_true(e.status, C.RESTARTING):
        e.condition(C.RESTARTING, False, verdict.reason, verdict.message, now=now)
    await _finish(deps, e, job, now=now)


async def fail(deps: Deps, ref: jobs.JobRef, reason: api.Reason, message: str, *,
               delete_pods: tuple[str, ...] = ()) -> None:
    """Fail an active job for `reason` (e.g. DeadlineExceeded), stop its trainer and apply
    cleanPodPolicy; `delete_pods` are deleted whatever the policy (a pod that never started
    has no log worth keeping and holds its devices)."""
    now = deps.clock()
    async with deps.jobs.edit(ref) as e:
        if deleting(e.body) or status.is_terminal(e.status):
            return
        e.condition(C.FAILED, True, reason, message, now=now, event="Warning")
        for type_ in (C.RUNNING, C.QUEUED, C.RESTARTING):
            if status.is_true(e.status, type_):
                e.condition(type_, False, reason, message, now=now)
        await _finish(deps, e, parse(e.body or {}), now=now, delete_pods=delete_pods)


async def _finish(deps: Deps, e: jobs.Edit, job: api.TrainingJob, *, now: float,
                  delete_pods: tuple[str, ...] = ()) -> None:
    """Write a terminal status, then apply cleanPodPolicy and stop the trainers of the pods it
    keeps (lock held).

    Every terminal path ends here, so cleanPodPolicy always applies and no trainer trains on
    (or registers a model) for a finished job.
    """
    ref = jobs.JobRef.of(e.body or {})
    e.status["completionTime"] = status.rfc3339(now)
    await e.commit()
    deps.placement.remove(ref)
    deps.caches.eta_seconds.pop(ref.key, None)
    result = "succeeded" if status.is_true(e.status, C.SUCCEEDED) else "failed"
    deps.metrics.count_finished(ref.namespace, result)
    if result == "succeeded":
        deps.metrics.count_seconds_saved(ref.namespace, parents.seconds_saved(
            deps.parents.records(), status.part(e.status, "warmStart", api.WarmStartDecision)))
    job_pods = await job_pod_states(deps.client, ref)
    clean_pod_policy = job.spec.run_policy.clean_pod_policy
    deleted = list(dict.fromkeys([*policy.pods_to_clean(job_pods, clean_pod_policy),
                                  *delete_pods]))
    await _delete_pods(deps, ref.namespace, deleted)
    await _stop_pods(deps.client, ref.namespace, [
        name for name in policy.pods_to_stop(job_pods, clean_pod_policy) if name not in deleted])


async def suspend(deps: Deps, ref: jobs.JobRef) -> None:
    """spec.runPolicy.suspend became true: delete the active pod with the grace period
    (SIGTERM: the trainer checkpoints and exits) and leave the queue."""
    now = deps.clock()
    async with deps.jobs.edit(ref) as e:
        if deleting(e.body) or status.is_terminal(e.status) or status.is_true(
                e.status, C.SUSPENDED):
            return
        message = (f"Suspended by spec.runPolicy.suspend: the trainer was asked to checkpoint "
                   f"and stop ({deps.options.termination_grace_seconds} s grace); set it to "
                   "false to resume.")
        e.condition(C.SUSPENDED, True, R.SUSPENDED_BY_USER, message, now=now, event="Normal")
        for type_ in (C.RUNNING, C.QUEUED, C.PLACED, C.RESTARTING):
            if status.is_true(e.status, type_):
                e.condition(type_, False, R.SUSPENDED_BY_USER, message, now=now)
        e.status.pop("startTime", None)  # the deadline clock stops while suspended
        await e.commit()
        deps.placement.remove(ref)
        # A profiling pod finishes its short measurement; the job stays suspended after it.
        active = [p.name for p in await job_pod_states(deps.client, ref)
                  if p.active and p.name != profiling.pod_name(ref.name)]
        await _delete_pods(deps, ref.namespace, active)


async def unsuspend(deps: Deps, ref: jobs.JobRef) -> None:
    """spec.runPolicy.suspend became false: queue the job again (a new attempt resumes from the
    checkpoint; the deadline clock restarts)."""
    now = deps.clock()
    async with deps.jobs.edit(ref) as e:
        if (deleting(e.body) or status.is_terminal(e.status)
                or not status.is_true(e.status, C.SUSPENDED) or e.body is None):
            return
        message = "Resumed: queued for placement; the trainer continues from its checkpoint."
        e.condition(C.SUSPENDED, False, R.RESUMED, message, now=now, event="Normal")
        admitted = status.condition(e.status, C.WARM_STARTED) is not None
        if admitted:
            e.condition(C.QUEUED, True, R.WAITING_FOR_PLACEMENT, message, now=now)
        await e.commit()
        if admitted and e.body is not None:
            deps.placement.add(queued_entry(e.body, parse(e.body), now=now))


async def forget(deps: Deps, ref: jobs.JobRef, uid: str) -> None:
    """The job (of uid `uid`) is being deleted: delete its pods, drop it from memory, and
    delete its checkpoint once its pods are gone (`_drop_checkpoint`: now, or on the last
    one's deletion event)."""
    async with deps.jobs.lock(ref):
        deps.placement.remove(ref)
        deps.caches.eta_seconds.pop(ref.key, None)
        deps.caches.create_retry.pop(uid, None)
        owned = [p.name for p in await job_pod_states(deps.client, ref)
                 if p.owner_uid in (uid, None)]
        await _delete_pods(deps, ref.namespace, owned)
        if not owned and uid:
            await _drop_checkpoint(deps, ref, uid)
    deps.jobs.forget(ref)


async def _drop_checkpoint(deps: Deps, ref: jobs.JobRef, uid: str) -> None:
    """Delete a deleted job's checkpoint once no pod of it is left (a stopping trainer writes
    a last one). No later job reads it (its key has the uid, `records.checkpoint_key`): it
    would only take space. A zoo that fails keeps it, with a warning in the log."""
    if any(p.owner_uid == uid for p in await job_pod_states(deps.client, ref)):
        return
    try:
        key = records.checkpoint_key(ref.namespace, ref.name, uid)
        await asyncio.to_thread(records.delete_checkpoint, deps.parents.zoo, key)
    except (ValueError, store.StoreUnavailable, store.StoreMisconfigured) as exc:
        _log.warning("%s: the deleted job's checkpoint (uid %s) was kept: %s", ref.key, uid, exc)


async def job_pod_states(client: kube.Client, ref: jobs.JobRef) -> list[pods.PodState]:
    """The job's pods (by label selector; filtered here too, as a check)."""
    listed = await listing.kiln_pods(client, ref.namespace, job=ref.name)
    states = [pods.pod_state(p) for p in listed]
    return [s for s in states if s.job == ref.name]


async def _delete_pods(deps: Deps, namespace: str, names: list[str]) -> None:
    for name in names:
        await deps.client.delete(kube.Paths.pod(namespace, name),
                                grace_period_seconds=deps.options.termination_grace_seconds)


async def _stop_pods(client: kube.Client, namespace: str, names: list[str]) -> None:
    """Have the kubelet stop these pods' containers (with the grace period) but keep the pods."""
    for name in names:
        await client.merge_patch(kube.Paths.pod(namespace, name), pods.stop_patch())


def _told(st: Mapping[str, Any], stuck: policy.NotStarted) -> bool:
    """Whether Running=False already tells this problem (the kubelet's words may differ)."""
    old = status.condition(st, C.RUNNING)
    return (old is not None and old.status == "False" and old.reason == stuck.reason.value
            and old.message.startswith(stuck.problem))


async def _discard_late_model(deps: Deps, body: kube.Object,
                              state: pods.PodState) -> None:
    """Delete the zoo model in a failed job's trainer result, and say so in an event.

    The trainer is stopped when its job fails; this catches one that registered its model
    before the stop reached it. Seen again (the pod's status repeats), it finds nothing left.
    Only the record reserved for the job, holding a model of the job, is deleted
    (`reports.model_problem`); a result naming any other gets a ReportRefused event.
    """
    result = _result(state.message)
    model = result.zoo_model if result is not None else None
    if not model:
        return
    zoo = deps.parents.zoo
    try:
        problem = await reports.model_problem(zoo, body, parse(body), model)
        if problem is not None:
            await deps.jobs.post_event(body, reports.refused_event(
                state.name, f"zoo model {model}", problem, "nothing was deleted"))
            return
        await asyncio.to_thread(records.delete_record, zoo, model)
    except (store.ObjectNotFound, api.InvalidSpec):
        return  # deleted already; or the spec was changed into one that does not parse
    except (store.StoreUnavailable, store.StoreMisconfigured) as exc:
        await deps.jobs.post_event(body, status.Event.warning(R.MODEL_DISCARDED, (
            f"Trainer pod {state.name} registered zoo model {model} after the job failed, "
            f"and deleting it failed ({exc}); delete it with: kiln zoo rm {model}")))
        return
    await deps.jobs.post_event(body, status.Event.normal(R.MODEL_DISCARDED, (
        f"Trainer pod {state.name} registered zoo model {model} after the job had failed; "
        "a failed job keeps no model, so it was deleted from the zoo.")))


async def _create_pod(deps: Deps, e: jobs.Edit, job: api.TrainingJob, attempt: int,
                      launch_: pods.Launch) -> None:
    """Create the attempt's pod, or a multi-node job's headless Service and pods, one per
    node, together (an existing one is kept: the names are deterministic).

    A pod the API server refuses as invalid (400/422: e.g. a bad spec.template) fails the job
    as InvalidSpec with the server's words; one it forbids (403: a ResourceQuota, a Pod
    Security level) is a FailedCreate, tried again with back-off (`_refused`); other errors
    propagate (retried). On GPUs the pod asks for the resource its node's GPUs are
    (--gpu-resource: nvidia.com/gpu, a MIG slice, amd.com/gpu).
    """
    body = e.body or {}
    ref = jobs.JobRef.of(body)
    if launch_.device == "gpu":
        launch_ = dataclasses.replace(
            launch_, gpu_resource=await deps.placement.gpu_resource(launch_.node))
    await deps.zoo_access.prepare(body, job, decided=launch_.warm_start)
    manifests = gang.build_pods(body, job, attempt=attempt, launch=launch_,
                                settings=deps.pod_settings)
    manifest = manifests[0]
    try:
        if launch_.peer_nodes:
            await deps.client.create(kube.Paths.services(ref.namespace),
                                    gang.build_service(body, job))
        for manifest in manifests:
            await deps.client.create(kube.Paths.pods(ref.namespace), manifest)
    except kube.ApiError as exc:
        if exc.status == 403:
            _refused(deps, e, manifest["metadata"]["name"], exc)
            return
        if exc.status not in (400, 422):
            raise
        message = (f"The API server refused trainer pod {manifest['metadata']['name']}: {exc}; "
                   "fix spec.template and create the job again.")
        now = deps.clock()
        e.condition(C.FAILED, True, R.INVALID_SPEC, message, now=now, event="Warning")
        for type_ in (C.RUNNING, C.RESTARTING):
            if status.is_true(e.status, type_):
                e.condition(type_, False, R.INVALID_SPEC, message, now=now)
        e.status["completionTime"] = status.rfc3339(now)
        deps.placement.remove(ref)
    else:
        deps.caches.create_retry.pop(_uid(body), None)


def create_retry_delay(interval_seconds: float, refusals: int) -> float:
    """Seconds until a refused pod is created again: `interval_seconds`, doubled for each
    refusal in a row, at most `CREATE_RETRY_MAX_SECONDS`."""
    # The count grows for as long as the refusals last (days, at the cap): 2.0 ** 1024 would
    # overflow, and any count past 64 is at the cap already.
    return min(CREATE_RETRY_MAX_SECONDS, interval_seconds * 2.0 ** min(refusals, 64))


def _refused(deps: Deps, e: jobs.Edit, pod: str, exc: kube.ApiError) -> None:
    """The API server forbade creating `pod`: Running=False/FailedCreate with its words (a
    Warning event, as the Job controller's FailedCreate), and a retry once the back-off has
    passed: --housekeeping-interval-seconds, doubling with each refusal in a row up to
    `CREATE_RETRY_MAX_SECONDS` (`_start_attempt`)."""
    uid = _uid(e.body or {})
    refusals, _ = deps.caches.create_retry.get(uid, (0, 0.0))
    delay = create_retry_delay(deps.options.housekeeping_interval_seconds, refusals)
    deps.caches.create_retry[uid] = (refusals + 1, deps.clock() + delay)
    advice = ("raise the namespace's ResourceQuota or end some of its pods"
              if "exceeded quota" in exc.message else "see the message")
    message = (f"The API server refused to create trainer pod {pod}: {exc.message}. It is "
               f"created once the server allows it (tried again with back-off, up to every "
               f"{CREATE_RETRY_MAX_SECONDS // 60:.0f} min); {advice}.")
    e.condition(C.RUNNING, False, R.FAILED_CREATE, message, now=deps.clock(), event="Warning")


def _uid(body: kube.Object) -> str:
    return str((body.get("metadata") or {}).get("uid") or "")


def _owned(state: pods.PodState, body: kube.Object | None) -> bool:
    """Whether the pod belongs to this job object, not to a deleted job of its name (a pod
    without an owner reference is taken as the job's)."""
    uid = _uid(body or {})
    return state.owner_uid is None or not uid or state.owner_uid == uid


def _blocking(states: list[pods.PodState], body: kube.Object | None,
              attempt: int) -> list[pods.PodState]:
    """The pods that must be gone before `attempt`'s are created: an earlier attempt's still
    running or terminating (its trainer holds the devices and writes the checkpoint the new
    one resumes from), and any pod of a deleted job of the same name (its names are taken)."""
    return [p for p in states if not _owned(p, body)
            or (p.attempt < attempt and (p.active or p.deleting))]


def _launch_from_status(st: Mapping[str, Any], *, now: float) -> pods.Launch:
    """The current placement again (restarts stay on their nodes, config and warm start)."""
    placement = status.part(st, "placement", api.PlacementStatus)
    gpus = placement.gpus or 0
    nodes = placement.nodes or [str(placement.node)]
    return pods.Launch(
        node=nodes[0], devices=max(1, gpus // len(nodes)),
        parallelism=placement.parallelism or "single",
        device="gpu" if gpus else "cpu",
        warm_start=status.part(st, "warmStart", api.WarmStartDecision),
        estimated_seconds=placement.estimated_seconds or 0.0, started=now,
        peer_nodes=tuple(nodes[1:]))


def spans_nodes(st: Mapping[str, Any]) -> bool:
    """Whether the job's placement spans several nodes (a gang of pods)."""
    return len(status.part(st, "placement", api.PlacementStatus).nodes or []) > 1


async def current_pods(client: kube.Client, body: kube.Object) -> list[pods.PodState]:
    """The pods of the job's current attempt (of this job object)."""
    attempt = int((body.get("status") or {}).get("attempts") or 0) - 1
    return [p for p in await job_pod_states(client, jobs.JobRef.of(body))
            if p.attempt == attempt and _owned(p, body)]


async def _start_attempt(deps: Deps, e: jobs.Edit, *,
                         states: list[pods.PodState] | None = None,
                         launch_: pods.Launch | None = None) -> None:
    """Create the current attempt's missing pods of a placed, active job (one, or a
    multi-node job's gang, together) once no pod of an earlier attempt runs or terminates,
    and no pod of a deleted job of its name is left (lock held; `_blocking`).

    So two trainers of one job never run at once: a new attempt (a restart, a move, a
    resumption) resumes from the checkpoint the old trainer writes as it stops, needs the
    devices it holds, and a gang's new pods must not meet old ones in the rendezvous (they
    share hostnames). The pod events of the old pods and the housekeeping rounds call this
    again; a creation the API server refused waits for its back-off (`_refused`).

    Args:
        states: the job's pods, when just listed.
        launch_: the plan's launch of a new attempt (default: the placement in status).
    """
    st = e.status
    attempts = int(st.get("attempts") or 0)
    if (deleting(e.body) or e.body is None or status.is_terminal(st) or attempts == 0
            or status.is_true(st, C.SUSPENDED) or not status.is_true(st, C.PLACED)):
        return
    if deps.clock() < deps.caches.create_retry.get(_uid(e.body), (0, 0.0))[1]:
        return
    if states is None:
        states = await job_pod_states(deps.client, jobs.JobRef.of(e.body))
    if _blocking(states, e.body, attempts - 1):
        return
    launch_ = launch_ or _launch_from_status(st, now=deps.clock())
    current = [p for p in states if p.attempt == attempts - 1]
    if len(current) < 1 + len(launch_.peer_nodes):
        await _create_pod(deps, e, parse(e.body), attempts - 1, launch_)


def _result(message: str) -> contract.Result | None:
    """The trainer's result from its termination message (None when there is none)."""
    event = contract.read_termination_message(message)
    return event if isinstance(event, contract.Result) else None


async def _granted_result(deps: Deps, e: jobs.Edit, job: api.TrainingJob,
                          state: pods.PodState) -> contract.Result | None:
    """The trainer's result (None when none), without a zoo model that is not the job's own
    (`reports.model_problem`; a ReportRefused event says so): it is neither shown in
    status.result nor named as the job's."""
    result = _result(state.message)
    model = result.zoo_model if result is not None else None
    if result is None or not model:
        return result
    try:
        problem = await reports.model_problem(deps.parents.zoo, e.body or {}, job, model)
    except store.ObjectNotFound:
        problem = "no such record is in the zoo"
    except (store.StoreUnavailable, store.StoreMisconfigured):
        problem = None  # the job's reserved id, whose record cannot be read just now
    if problem is None:
        return result
    e.events.append(reports.refused_event(state.name, f"zoo model {model}", problem,
                                          "it is not shown as the job's model"))
    return dataclasses.replace(result, zoo_model=None)


async def take_trainer_decision(deps: Deps, e: jobs.Edit,
                                report: api.WarmStartDecision | Mapping[str, Any] | None, *,
                                pod: str, now: float) -> None:
    """`record_trainer_decision` for a report whose parents the job may name
    (`reports.parents_problem`: the ones status.warmStart grants it, or when its decision was
    left to the trainer, records its namespace may see). Any other report gets one
    ReportRefused Warning event per operator run, and status keeps what it says."""
    ids: tuple[str, ...] = ()
    problem: str | None
    try:
        chosen = select.from_report(report)
    except ValueError as exc:
        chosen, problem = None, f"its warm-start decision is malformed ({exc})"
    else:
        if chosen is None:
            return
        warm = e.status.get("warmStart") or {}
        ids = reports.decision_ids(chosen)
        granted = reports.granted_ids(warm)
        problem = await reports.parents_problem(
            deps.parents.zoo, jobs.JobRef.of(e.body or {}).namespace,
            [i for i in ids if i not in granted],  # the others were checked before
            granted=None if warm.get("outcome") == api.WarmStartOutcome.IN_TRAINER else granted)
    if problem is None and chosen is not None:
        record_trainer_decision(e, report, now=now)
        return
    key = (str(((e.body or {}).get("metadata") or {}).get("uid") or ""), *ids)
    if key not in deps.caches.refused_reports:
        deps.caches.refused_reports.add(key)
        e.events.append(reports.refused_event(pod, "a warm-start decision" + (
            f" naming {', '.join(ids)}" if ids else ""), str(problem),
            "status.warmStart keeps what the operator decided"))


def record_trainer_decision(e: jobs.Edit,
                            report: api.WarmStartDecision | Mapping[str, Any] | None, *,
                            now: float) -> None:
    """Record in status.warmStart and WarmStarted the warm start the trainer did: the decision
    an entrypoint job's trainer made itself (admission left it to the trainer, which can import
    the model), and the probe guard's verdict on any decision (its losses, maybe a cold start
    or an alternative parent).

    Called with the trainer's live metrics while it runs and with its result at the end: an
    event is posted once, when the verdict first shows (WarmStartGuarded when the guard
    refused the admitted parent), not again when the result repeats it.

    Args:
        e: the job's edit.
        report: the trainer's decision (`select.from_report`; None: no report).
        now: epoch seconds.
    """
    warm = e.status.get("warmStart") or {}
    chosen = select.from_report(report)
    if chosen is None:
        return
    probed = chosen.probe_loss is not None or chosen.cold_probe_loss is not None
    if warm.get("outcome") != api.WarmStartOutcome.IN_TRAINER and not probed:
        return
    recorded = api.to_wire(chosen)
    seen = all(warm.get(k) == recorded.get(k)
               for k in ("outcome", "parent", "probeLoss", "coldProbeLoss"))
    admitted = (warm.get("parent") if warm.get("outcome") != api.WarmStartOutcome.IN_TRAINER
                else None)
    guarded = not seen and admitted is not None and admitted != chosen.parent
    e.status["warmStart"] = recorded
    message = "In the trainer pod, before its first step: " + chosen.reason.rstrip(".") + "."
    e.condition(C.WARM_STARTED, not chosen.cold_start, chosen.condition_reason, message, now=now,
                event=None if seen or guarded else "Normal")
    if guarded:
        e.events.append(status.Event.normal(R.WARM_START_GUARDED, (
            f"The trainer's probe guard refused parent {admitted}, chosen at admission; "
            + (f"it started from {chosen.parent}" if chosen.parent else "it started cold")
            + f": {chosen.reason.rstrip('.')}.")))


def _trainer_words(message: str) -> str:
    """One line of the trainer's own explanation (its error event, else the log's last line)."""
    event = contract.read_termination_message(message)
    if isinstance(event, contract.Failure) and event.message:
        return event.message[:500]
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return lines[-1][:500] if lines else ""


def _result_status(result: contract.Result) -> api.ResultStatus:
    """status.result: the result's fields that `api.ResultStatus` declares (same names)."""
    wire = result.to_json()  # non-finite numbers as None
    return api.ResultStatus.model_validate(
        {name: wire[name] for name in api.ResultStatus.model_fields})


def _final_progress(live: api.ProgressStatus, result: contract.Result) -> api.ProgressStatus:
    """status.progress at the end: the result's numbers over the last live reading, so a job
    that finished between two progress reads still shows where it ended."""
    wire = result.to_json()  # non-finite numbers as None
    final = {"epoch": wire["epochs_run"], "step": wire["steps"],
             "validation_accuracy": wire["validation_accuracy"],
             "validation_loss": wire["validation_loss"],
             "samples_per_second": wire["samples_per_second"], "eta_seconds": 0.0}
    return live.model_copy(update={k: v for k, v in final.items() if v is not None})


def _success_message(job: api.TrainingJob, result: contract.Result | None) -> str:
    if result is None:
        return "Training completed (the trainer left no result)."
    value = result.metric
    shown = (f"{result.metric_name} {value:.4f}" if isinstance(value, float)
             else f"{result.metric_name} {value}")
    parts = [(f"Training completed: {shown} after {result.epochs_run} epoch(s) in "
              f"{result.wall_seconds or 0:.1f} s")]
    if job.spec.target is not None:
        parts.append("target reached" if result.target_reached else "target not reached")
    if result.zoo_model:
        parts.append(f"registered zoo model {result.zoo_model}")
    return "; ".join(parts) + "."

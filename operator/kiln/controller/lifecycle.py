"""A job's life after admission: its plan, launch, pod events, restarts, the end, suspension.

Each step runs under the job's lock through `jobs.Jobs.edit`, writing status before pods, so a
crash in between is repaired on resume by `ensure_pod`. No admission, no planning.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Mapping
from typing import Any

from kiln import api, contract
from kiln.controller import (
    gang,
    jobs,
    kube,
    listing,
    parents,
    placement_loop,
    pods,
    policy,
    profiling,
    reports,
    services,
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


def parse(body: dict[str, Any]) -> api.TrainingJob:
    """The job as it runs: once admitted, on its admitted spec with the edits that take effect
    (`api.parse_running`); status itself is the operator's and not checked.

    Raises:
        api.InvalidSpec: the spec does not parse or validate.
    """
    ref = jobs.JobRef.of(body)
    return api.parse_running(body, source=ref.key)


def deleting(body: dict[str, Any] | None) -> bool:
    return body is None or bool((body.get("metadata") or {}).get("deletionTimestamp"))


def waiting(st: dict[str, Any]) -> bool:
    """Queued for placement: not placed, not suspended, not finished."""
    return (status.is_true(st, C.QUEUED) and not status.is_true(st, C.SUSPENDED)
            and not status.is_terminal(st))


def queued_entry(body: dict[str, Any], job: api.TrainingJob, *,
                 now: float) -> placement_loop.Queued:
    """The queue entry of an admitted job, from its status."""
    st = body.get("status") or {}
    since = status.parse_rfc3339((status.condition(st, C.QUEUED) or {}).get(
        "lastTransitionTime"))
    return placement_loop.Queued(jobs.JobRef.of(body), job,
                                 parents.from_status(st.get("warmStart")), since or now,
                                 measured=profiling.measurement(st.get("profile")))


async def publish_plan(svc: services.Services, entry: placement_loop.Queued,
                       assignment: types.Assignment, device: str) -> None:
    """Record a waiting job's planned node and start in status.placement (if changed)."""
    placement = _placement(assignment, device, start=max(assignment.start, svc.clock()))
    if svc.published.get(entry.ref) == placement:
        return
    async with svc.jobs.lock(entry.ref):
        if entry.ref not in svc.placement:  # started, suspended or deleted meanwhile
            return
        path = kube.Paths.job(entry.ref.namespace, entry.ref.name, status=True)
        if await svc.client.merge_patch(path, {"status": {"placement": placement}}):
            svc.published[entry.ref] = placement


async def mark_unplaceable(svc: services.Services, entry: placement_loop.Queued,
                           why: str) -> None:
    """Placed=False/NoFeasibleConfig (once per distinct reason); the job stays queued."""
    if svc.unplaceable.get(entry.ref) == why:
        return
    message = (f"No node can run this job: {why}. It stays queued and is planned again "
               "when nodes change; or lower spec.resources.gpus / gpusPerNode.")
    now = svc.clock()
    async with svc.jobs.edit(entry.ref) as e:
        if e.body is not None and entry.ref in svc.placement:
            e.condition(C.PLACED, False, R.NO_FEASIBLE_CONFIG, message, now=now,
                        event="Warning")
    svc.unplaceable[entry.ref] = why


async def launch(svc: services.Services, entry: placement_loop.Queued,
                 assignment: types.Assignment, device: str) -> bool:
    """Start a job the plan reached: status Placed, placement, attempts + 1 and startTime,
    then the pod ``<job>-trainer-<attempt>`` (a multi-node job's pods), at once or, when a pod
    of an earlier attempt still runs or terminates, once it has gone (`_start_attempt`).
    False when the job is no longer waiting."""
    svc.published.pop(entry.ref, None)
    svc.unplaceable.pop(entry.ref, None)
    now = svc.clock()
    async with svc.jobs.edit(entry.ref) as e:
        if deleting(e.body) or not waiting(e.status):
            return False
        attempt = int(e.status.get("attempts") or 0)
        gpus = assignment.gpus if device == "gpu" else 0
        e.status["placement"] = _placement(assignment, device, start=max(assignment.start, now))
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
        states = await job_pod_states(svc, entry.ref)
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
        svc.metrics.queue_wait_seconds.observe(max(0.0, now - entry.since))
        planned = None if assignment.peer_nodes else pods.Launch(  # a gang's: from status
            node=assignment.node, devices=assignment.gpus, parallelism=assignment.parallelism,
            device=device, warm_start=entry.warm_start, estimated_seconds=assignment.seconds,
            started=now)
        await _start_attempt(svc, e, states=states, launch_=planned)
    return True


def _placement(assignment: types.Assignment, device: str, *, start: float) -> dict[str, Any]:
    """status.placement of an assignment: gpus over all its nodes, and `nodes` when several."""
    placement: dict[str, Any] = {
        "node": assignment.node, "gpus": assignment.devices if device == "gpu" else 0,
        "parallelism": assignment.parallelism, "estimatedStart": status.rfc3339(start),
        "estimatedSeconds": round(assignment.seconds, 1)}
    if assignment.peer_nodes:
        placement["nodes"] = list(assignment.all_nodes)
    return placement


async def resize(svc: services.Services, ref: jobs.JobRef, move: introspect.Move,
                 device: str) -> bool:
    """Move a running job by checkpoint-restart: status.placement and attempts + 1, the
    Restarting condition and a Resized event, the job's kiln.dev/resized annotation, then the
    old pod deleted with the grace period (its trainer checkpoints and exits). The new
    attempt's pod, on the new node and device count, is created once the old pod is gone
    (`ensure_pod`), so it resumes from the last checkpoint. No restart of the backoff limit
    is spent. False when the job no longer runs where the move says.
    """
    now = svc.clock()
    async with svc.jobs.edit(ref) as e:
        st = e.status
        placement = st.get("placement") or {}
        if (deleting(e.body) or status.is_terminal(st) or status.is_true(st, C.SUSPENDED)
                or not status.is_true(st, C.RUNNING) or e.body is None
                or placement.get("node") != move.from_node
                or int(placement.get("gpus") or 0) != (move.from_gpus if device == "gpu" else 0)):
            return False
        attempt = int(st.get("attempts") or 0)
        gpus = move.gpus if device == "gpu" else 0
        e.status["placement"] = {
            "node": move.node, "gpus": gpus, "parallelism": move.parallelism,
            "estimatedStart": status.rfc3339(now),
            "estimatedSeconds": round(move.remaining_seconds, 1)}
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
        svc.eta_seconds.pop(ref.key, None)
        await svc.client.merge_patch(kube.Paths.job(ref.namespace, ref.name), {
            "metadata": {"annotations": {RESIZED_ANNOTATION: json.dumps({
                "from": {"node": move.from_node, "gpus": move.from_gpus},
                "to": {"node": move.node, "gpus": move.gpus, "parallelism": move.parallelism},
                "gainSeconds": round(move.gain_seconds, 1), "time": status.rfc3339(now)},
                separators=(",", ":"))}}})
        await _delete_pods(svc, ref.namespace, [pods.pod_name(ref.name, attempt - 1)])
    return True


async def ensure_pod(svc: services.Services, ref: jobs.JobRef) -> None:
    """Create the current attempt's missing pods of a placed, active job once no earlier pod
    of it runs (`_start_attempt`).

    Starts a new attempt whose earlier pods have just gone (a move, a restart after a
    deletion, a resumption), retries a refused creation after its back-off, and repairs an
    operator crash between the status write and the pod creation, and a pod deleted while the
    operator was down.
    """
    async with svc.jobs.edit(ref) as e:
        await _start_attempt(svc, e)


async def observe_pod(svc: services.Services, pod: dict[str, Any], event_type: str | None) -> None:
    """React to a change of a trainer pod.

    Only the current attempt's pod counts. Pending and stuck (a container waiting on its
    image or config, or no node for it) -> Running=False with why, once per problem; Running
    -> Running=True; exit 0 -> Succeeded with the trainer's result (its termination message;
    a zoo model or warm-start parent it was not granted is left out, `reports`);
    a retryable exit with restarts left -> Restarting and a new pod on the same placement (the
    trainer resumes from its checkpoint); otherwise Failed (`policy.after_exit`). A pod deleted
    under a running job counts as a retryable exit. A zoo model that a trainer registered
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
    async with svc.jobs.edit(ref) as e:
        st = e.status
        if (deleting(e.body) or state.attempt != int(st.get("attempts") or 0) - 1
                or not _owned(state, e.body)):
            if gone and state.owner_uid and (deleting(e.body) or not _owned(state, e.body)):
                await _drop_checkpoint(svc, ref, state.owner_uid)  # a deleted job's pod
            if gone and not deleting(e.body):
                await _start_attempt(svc, e)  # the new attempt's pods waited for this one
            return  # the job is going, or an older attempt's (or a deleted job's) pod
        if gone and await svc.client.get(kube.Paths.pod(namespace, state.name)) is not None:
            return  # an older object of the pod's name: the pod was created again meanwhile
        if status.is_terminal(st):
            if status.is_true(st, C.FAILED) and state.finished and not gone:
                await _discard_late_model(svc, e.body or {}, state)
            return
        if status.is_true(st, C.SUSPENDED):
            if state.active and not gone:  # created just before the suspension
                await _delete_pods(svc, namespace, [state.name])
            return
        if waiting(st):  # stopped to wait again (Kueue evicted it): its pod's end is no exit
            return
        now = svc.clock()
        if gone or state.deleting:
            verdict = policy.after_exit(
                143, "Deleted", f"pod {state.name} was deleted before the trainer finished",
                restarts=int(st.get("restarts") or 0),
                backoff_limit=parse(e.body or {}).spec.run_policy.backoff_limit)
        elif gang.rank_of(pod) > 0 and state.phase in ("Running", "Succeeded"):
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
                reported=bool(_result(state.message)))
        else:
            return
        await _apply(svc, e, state, verdict, now)


async def _apply(svc: services.Services, e: jobs.Edit, state: pods.PodState, verdict: policy.Verdict,
                 now: float) -> None:
    ref = jobs.JobRef.of(e.body or {})
    job = parse(e.body or {})
    if verdict.action is policy.Action.RESTART:
        attempt = int(e.status.get("attempts") or 0)
        e.status["restarts"] = int(e.status.get("restarts") or 0) + 1
        e.status["attempts"] = attempt + 1
        e.condition(C.RESTARTING, True, verdict.reason, verdict.message, now=now,
                    event="Warning")
        e.condition(C.RUNNING, False, verdict.reason, verdict.message, now=now)
        await e.commit()
        if e.body is not None:
            svc.metrics.count_restart(ref.namespace)
            if spans_nodes(e.status):  # the whole gang restarts: its pods hang without a peer
                await _delete_pods(svc, ref.namespace, [
                    p.name for p in await job_pod_states(svc, ref) if p.attempt == attempt - 1])
            await _start_attempt(svc, e)  # at once, unless an old pod is still stopping
        return
    if verdict.action is policy.Action.SUCCEED:
        result = await _granted_result(svc, e, job, state)
        if result:
            e.status["result"] = _result_status(result)
            e.status["progress"] = _final_progress(e.status.get("progress") or {}, result)
            await take_trainer_decision(svc, e, result.get("warm_start_decision"),
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
    await _finish(svc, e, job, now=now)


async def fail(svc: services.Services, ref: jobs.JobRef, reason: api.Reason, message: str, *,
               delete_pods: tuple[str, ...] = ()) -> None:
    """Fail an active job for `reason` (e.g. DeadlineExceeded), stop its trainer and apply
    cleanPodPolicy; `delete_pods` are deleted whatever the policy (a pod that never started
    has no log worth keeping and holds its devices)."""
    now = svc.clock()
    async with svc.jobs.edit(ref) as e:
        if deleting(e.body) or status.is_terminal(e.status):
            return
        e.condition(C.FAILED, True, reason, message, now=now, event="Warning")
        for type_ in (C.RUNNING, C.QUEUED, C.RESTARTING):
            if status.is_true(e.status, type_):
                e.condition(type_, False, reason, message, now=now)
        await _finish(svc, e, parse(e.body or {}), now=now, delete_pods=delete_pods)


async def _finish(svc: services.Services, e: jobs.Edit, job: api.TrainingJob, *, now: float,
                  delete_pods: tuple[str, ...] = ()) -> None:
    """Write a terminal status, then apply cleanPodPolicy and stop the trainers of the pods it
    keeps (lock held).

    Every terminal path ends here, so cleanPodPolicy always applies and no trainer trains on
    (or registers a model) for a finished job.
    """
    ref = jobs.JobRef.of(e.body or {})
    e.status["completionTime"] = status.rfc3339(now)
    await e.commit()
    svc.placement.remove(ref)
    svc.eta_seconds.pop(ref.key, None)
    result = "succeeded" if status.is_true(e.status, C.SUCCEEDED) else "failed"
    svc.metrics.count_finished(ref.namespace, result)
    if result == "succeeded":
        svc.metrics.count_seconds_saved(ref.namespace, parents.seconds_saved(
            svc.parents.records(), e.status.get("warmStart")))
    job_pods = await job_pod_states(svc, ref)
    clean_pod_policy = job.spec.run_policy.clean_pod_policy
    deleted = list(dict.fromkeys([*policy.pods_to_clean(job_pods, clean_pod_policy),
                                  *delete_pods]))
    await _delete_pods(svc, ref.namespace, deleted)
    await _stop_pods(svc, ref.namespace, [
        name for name in policy.pods_to_stop(job_pods, clean_pod_policy) if name not in deleted])


async def suspend(svc: services.Services, ref: jobs.JobRef) -> None:
    """spec.runPolicy.suspend became true: delete the active pod with the grace period
    (SIGTERM: the trainer checkpoints and exits) and leave the queue."""
    now = svc.clock()
    async with svc.jobs.edit(ref) as e:
        if deleting(e.body) or status.is_terminal(e.status) or status.is_true(
                e.status, C.SUSPENDED):
            return
        message = (f"Suspended by spec.runPolicy.suspend: the trainer was asked to checkpoint "
                   f"and stop ({svc.options.termination_grace_seconds} s grace); set it to "
                   "false to resume.")
        e.condition(C.SUSPENDED, True, R.SUSPENDED_BY_USER, message, now=now, event="Normal")
        for type_ in (C.RUNNING, C.QUEUED, C.PLACED, C.RESTARTING):
            if status.is_true(e.status, type_):
                e.condition(type_, False, R.SUSPENDED_BY_USER, message, now=now)
        e.status.pop("startTime", None)  # the deadline clock stops while suspended
        await e.commit()
        svc.placement.remove(ref)
        # A profiling pod finishes its short measurement; the job stays suspended after it.
        active = [p.name for p in await job_pod_states(svc, ref)
                  if p.active and p.name != profiling.pod_name(ref.name)]
        await _delete_pods(svc, ref.namespace, active)


async def unsuspend(svc: services.Services, ref: jobs.JobRef) -> None:
    """spec.runPolicy.suspend became false: queue the job again (a new attempt resumes from the
    checkpoint; the deadline clock restarts)."""
    now = svc.clock()
    async with svc.jobs.edit(ref) as e:
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
            svc.placement.add(queued_entry(e.body, parse(e.body), now=now))


async def forget(svc: services.Services, ref: jobs.JobRef, uid: str) -> None:
    """The job (of uid `uid`) is being deleted: delete its pods, drop it from memory, and
    delete its checkpoint once its pods are gone (`_drop_checkpoint`: now, or on the last
    one's deletion event)."""
    async with svc.jobs.lock(ref):
        svc.placement.remove(ref)
        svc.eta_seconds.pop(ref.key, None)
        svc.create_retry.pop(uid, None)
        owned = [p.name for p in await job_pod_states(svc, ref) if p.owner_uid in (uid, None)]
        await _delete_pods(svc, ref.namespace, owned)
        if not owned and uid:
            await _drop_checkpoint(svc, ref, uid)
    svc.jobs.forget(ref)


async def _drop_checkpoint(svc: services.Services, ref: jobs.JobRef, uid: str) -> None:
    """Delete a deleted job's checkpoint once no pod of it is left (a stopping trainer writes
    a last one). No later job reads it (its key has the uid, `records.checkpoint_key`): it
    would only take space. A zoo that fails keeps it, with a warning in the log."""
    if any(p.owner_uid == uid for p in await job_pod_states(svc, ref)):
        return
    try:
        key = records.checkpoint_key(ref.namespace, ref.name, uid)
        await asyncio.to_thread(svc.parents.zoo.delete, key)
    except (ValueError, store.StoreUnavailable, store.StoreMisconfigured) as exc:
        _log.warning("%s: the deleted job's checkpoint (uid %s) was kept: %s", ref.key, uid, exc)


async def job_pod_states(svc: services.Services, ref: jobs.JobRef) -> list[pods.PodState]:
    """The job's pods (by label selector; filtered here too, as a check)."""
    listed = await listing.kiln_pods(svc.client, ref.namespace, job=ref.name)
    states = [pods.pod_state(p) for p in listed]
    return [s for s in states if s.job == ref.name]


async def _delete_pods(svc: services.Services, namespace: str, names: list[str]) -> None:
    for name in names:
        await svc.client.delete(kube.Paths.pod(namespace, name),
                                grace_period_seconds=svc.options.termination_grace_seconds)


async def _stop_pods(svc: services.Services, namespace: str, names: list[str]) -> None:
    """Have the kubelet stop these pods' containers (with the grace period) but keep the pods."""
    for name in names:
        await svc.client.merge_patch(kube.Paths.pod(namespace, name), pods.stop_patch())


def _told(st: dict[str, Any], stuck: policy.NotStarted) -> bool:
    """Whether Running=False already tells this problem (the kubelet's words may differ)."""
    old = status.condition(st, C.RUNNING) or {}
    return (old.get("status") == "False" and old.get("reason") == stuck.reason.value
            and str(old.get("message") or "").startswith(stuck.problem))


async def _discard_late_model(svc: services.Services, body: dict[str, Any],
                              state: pods.PodState) -> None:
    """Delete the zoo model in a failed job's trainer result, and say so in an event.

    The trainer is stopped when its job fails; this catches one that registered its model
    before the stop reached it. Seen again (the pod's status repeats), it finds nothing left.
    Only the record reserved for the job, holding a model of the job, is deleted
    (`reports.model_problem`); a result naming any other gets a ReportRefused event.
    """
    model = str(_result(state.message).get("zoo_model") or "")
    if not model:
        return
    zoo = svc.parents.zoo
    try:
        problem = await reports.model_problem(zoo, body, parse(body), model)
        if problem is not None:
            await svc.jobs.post_event(body, reports.refused_event(
                state.name, f"zoo model {model}", problem, "nothing was deleted"))
            return
        await asyncio.to_thread(records.delete_record, zoo, model)
    except (store.ObjectNotFound, api.InvalidSpec):
        return  # deleted already; or the spec was changed into one that does not parse
    except (store.StoreUnavailable, store.StoreMisconfigured) as exc:
        await svc.jobs.post_event(body, status.Event.warning(R.MODEL_DISCARDED, (
            f"Trainer pod {state.name} registered zoo model {model} after the job failed, "
            f"and deleting it failed ({exc}); delete it with: kiln zoo rm {model}")))
        return
    await svc.jobs.post_event(body, status.Event.normal(R.MODEL_DISCARDED, (
        f"Trainer pod {state.name} registered zoo model {model} after the job had failed; "
        "a failed job keeps no model, so it was deleted from the zoo.")))


async def _create_pod(svc: services.Services, e: jobs.Edit, job: api.TrainingJob, attempt: int,
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
            launch_, gpu_resource=await svc.placement.gpu_resource(launch_.node))
    await zoo_access.prepare(svc, body, job, decided=launch_.warm_start)
    manifests = gang.build_pods(body, job, attempt=attempt, launch=launch_,
                                settings=svc.pod_settings)
    manifest = manifests[0]
    try:
        if launch_.peer_nodes:
            await svc.client.create(kube.Paths.services(ref.namespace),
                                    gang.build_service(body, job))
        for manifest in manifests:
            await svc.client.create(kube.Paths.pods(ref.namespace), manifest)
    except kube.ApiError as exc:
        if exc.status == 403:
            _refused(svc, e, manifest["metadata"]["name"], exc)
            return
        if exc.status not in (400, 422):
            raise
        message = (f"The API server refused trainer pod {manifest['metadata']['name']}: {exc}; "
                   "fix spec.template and create the job again.")
        now = svc.clock()
        e.condition(C.FAILED, True, R.INVALID_SPEC, message, now=now, event="Warning")
        for type_ in (C.RUNNING, C.RESTARTING):
            if status.is_true(e.status, type_):
                e.condition(type_, False, R.INVALID_SPEC, message, now=now)
        e.status["completionTime"] = status.rfc3339(now)
        svc.placement.remove(ref)
    else:
        svc.create_retry.pop(_uid(body), None)


def _refused(svc: services.Services, e: jobs.Edit, pod: str, exc: kube.ApiError) -> None:
    """The API server forbade creating `pod`: Running=False/FailedCreate with its words (a
    Warning event, as the Job controller's FailedCreate), and a retry once the back-off has
    passed: --housekeeping-interval-seconds, doubling with each refusal in a row up to
    `CREATE_RETRY_MAX_SECONDS` (`_start_attempt`)."""
    uid = _uid(e.body or {})
    refusals, _ = svc.create_retry.get(uid, (0, 0.0))
    delay = min(CREATE_RETRY_MAX_SECONDS,
                svc.options.housekeeping_interval_seconds * 2.0 ** refusals)
    svc.create_retry[uid] = (refusals + 1, svc.clock() + delay)
    advice = ("raise the namespace's ResourceQuota or end some of its pods"
              if "exceeded quota" in exc.message else "see the message")
    message = (f"The API server refused to create trainer pod {pod}: {exc.message}. It is "
               f"created once the server allows it (tried again with back-off, up to every "
               f"{CREATE_RETRY_MAX_SECONDS // 60:.0f} min); {advice}.")
    e.condition(C.RUNNING, False, R.FAILED_CREATE, message, now=svc.clock(), event="Warning")


def _uid(body: dict[str, Any]) -> str:
    return str((body.get("metadata") or {}).get("uid") or "")


def _owned(state: pods.PodState, body: dict[str, Any] | None) -> bool:
    """Whether the pod belongs to this job object, not to a deleted job of its name (a pod
    without an owner reference is taken as the job's)."""
    uid = _uid(body or {})
    return state.owner_uid is None or not uid or state.owner_uid == uid


def _blocking(states: list[pods.PodState], body: dict[str, Any] | None,
              attempt: int) -> list[pods.PodState]:
    """The pods that must be gone before `attempt`'s are created: an earlier attempt's still
    running or terminating (its trainer holds the devices and writes the checkpoint the new
    one resumes from), and any pod of a deleted job of the same name (its names are taken)."""
    return [p for p in states if not _owned(p, body)
            or (p.attempt < attempt and (p.active or p.deleting))]


def _launch_from_status(st: dict[str, Any], *, now: float) -> pods.Launch:
    """The current placement again (restarts stay on their nodes, config and warm start)."""
    placement = st.get("placement") or {}
    gpus = int(placement.get("gpus") or 0)
    nodes = [str(n) for n in placement.get("nodes") or []] or [str(placement.get("node"))]
    return pods.Launch(
        node=nodes[0], devices=max(1, gpus // len(nodes)),
        parallelism=str(placement.get("parallelism") or "single"),
        device="gpu" if gpus else "cpu", warm_start=parents.from_status(st.get("warmStart")),
        estimated_seconds=float(placement.get("estimatedSeconds") or 0.0), started=now,
        peer_nodes=tuple(nodes[1:]))


def spans_nodes(st: dict[str, Any]) -> bool:
    """Whether the job's placement spans several nodes (a gang of pods)."""
    return len((st.get("placement") or {}).get("nodes") or []) > 1


async def current_pods(svc: services.Services, body: dict[str, Any]) -> list[pods.PodState]:
    """The pods of the job's current attempt (of this job object)."""
    attempt = int((body.get("status") or {}).get("attempts") or 0) - 1
    return [p for p in await job_pod_states(svc, jobs.JobRef.of(body))
            if p.attempt == attempt and _owned(p, body)]


async def _start_attempt(svc: services.Services, e: jobs.Edit, *,
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
    if svc.clock() < svc.create_retry.get(_uid(e.body), (0, 0.0))[1]:
        return
    if states is None:
        states = await job_pod_states(svc, jobs.JobRef.of(e.body))
    if _blocking(states, e.body, attempts - 1):
        return
    launch_ = launch_ or _launch_from_status(st, now=svc.clock())
    current = [p for p in states if p.attempt == attempts - 1]
    if len(current) < 1 + len(launch_.peer_nodes):
        await _create_pod(svc, e, parse(e.body), attempts - 1, launch_)


def _result(message: str) -> dict[str, Any]:
    """The trainer's result from its termination message ({} when there is none)."""
    event = contract.read_termination_message(message)
    return event.to_json() if isinstance(event, contract.Result) else {}


async def _granted_result(svc: services.Services, e: jobs.Edit, job: api.TrainingJob,
                          state: pods.PodState) -> dict[str, Any]:
    """The trainer's result ({} when none), without a zoo model that is not the job's own
    (`reports.model_problem`; a ReportRefused event says so): it is neither shown in
    status.result nor named as the job's."""
    result = _result(state.message)
    model = str(result.get("zoo_model") or "")
    if not model:
        return result
    try:
        problem = await reports.model_problem(svc.parents.zoo, e.body or {}, job, model)
    except store.ObjectNotFound:
        problem = "no such record is in the zoo"
    except (store.StoreUnavailable, store.StoreMisconfigured):
        problem = None  # the job's reserved id, whose record cannot be read just now
    if problem is None:
        return result
    e.events.append(reports.refused_event(state.name, f"zoo model {model}", problem,
                                          "it is not shown as the job's model"))
    return {**result, "zoo_model": None}


async def take_trainer_decision(svc: services.Services, e: jobs.Edit,
                                report: Mapping[str, Any] | None, *, pod: str,
                                now: float) -> None:
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
            svc.parents.zoo, jobs.JobRef.of(e.body or {}).namespace,
            [i for i in ids if i not in granted],  # the others were checked before
            granted=None if warm.get("outcome") == select.Outcome.IN_TRAINER else granted)
    if problem is None and chosen is not None:
        record_trainer_decision(e, report, now=now)
        return
    key = (str(((e.body or {}).get("metadata") or {}).get("uid") or ""), *ids)
    if key not in svc.refused_reports:
        svc.refused_reports.add(key)
        e.events.append(reports.refused_event(pod, "a warm-start decision" + (
            f" naming {', '.join(ids)}" if ids else ""), str(problem),
            "status.warmStart keeps what the operator decided"))


def record_trainer_decision(e: jobs.Edit, report: Mapping[str, Any] | None, *,
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
        report: the keys of `contract.Result.warm_start_decision` (None: no report).
        now: epoch seconds.
    """
    warm = e.status.get("warmStart") or {}
    chosen = select.from_report(report)
    if chosen is None:
        return
    probed = chosen.probe_loss is not None or chosen.cold_probe_loss is not None
    if warm.get("outcome") != select.Outcome.IN_TRAINER and not probed:
        return
    recorded = parents.to_status(chosen)
    seen = all(warm.get(k) == recorded.get(k)
               for k in ("outcome", "parent", "probeLoss", "coldProbeLoss"))
    admitted = warm.get("parent") if warm.get("outcome") != select.Outcome.IN_TRAINER else None
    guarded = not seen and admitted is not None and admitted != chosen.parent_id
    e.status["warmStart"] = recorded
    message = "In the trainer pod, before its first step: " + chosen.reason.rstrip(".") + "."
    e.condition(C.WARM_STARTED, not chosen.cold_start, chosen.condition_reason, message, now=now,
                event=None if seen or guarded else "Normal")
    if guarded:
        e.events.append(status.Event.normal(R.WARM_START_GUARDED, (
            f"The trainer's probe guard refused parent {admitted}, chosen at admission; "
            + (f"it started from {chosen.parent_id}" if chosen.parent_id else "it started cold")
            + f": {chosen.reason.rstrip('.')}.")))


def _trainer_words(message: str) -> str:
    """One line of the trainer's own explanation (its error event, else the log's last line)."""
    event = contract.read_termination_message(message)
    if isinstance(event, contract.Failure) and event.message:
        return event.message[:500]
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return lines[-1][:500] if lines else ""


def _result_status(result: dict[str, Any]) -> dict[str, Any]:
    wire = {
        "metric": result.get("metric"),
        "validationAccuracy": result.get("validation_accuracy"),
        "validationLoss": result.get("validation_loss"),
        "zooModel": result.get("zoo_model"),
        "wallSeconds": result.get("wall_seconds"),
        "timeToTargetSeconds": result.get("time_to_target_seconds"),
    }
    return {k: v for k, v in wire.items() if v is not None}


def _final_progress(live: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """status.progress at the end: the result's numbers over the last live reading, so a job
    that finished between two progress reads still shows where it ended."""
    final = {
        "epoch": result.get("epochs_run"),
        "step": result.get("steps"),
        "validationAccuracy": result.get("validation_accuracy"),
        "validationLoss": result.get("validation_loss"),
        "samplesPerSecond": result.get("samples_per_second"),
        "etaSeconds": 0.0,
    }
    return {**live, **{k: v for k, v in final.items() if v is not None}}


def _success_message(job: api.TrainingJob, result: dict[str, Any]) -> str:
    if not result:
        return "Training completed (the trainer left no result)."
    metric, value = result.get("metric_name"), result.get("metric")
    shown = f"{metric} {value:.4f}" if isinstance(value, float) else f"{metric} {value}"
    parts = [(f"Training completed: {shown} after {result.get('epochs_run')} epoch(s) in "
             f"{float(result.get('wall_seconds') or 0):.1f} s")]
    if job.spec.target is not None:
        parts.append("target reached" if result.get("target_reached") else "target not reached")
    if result.get("zoo_model"):
        parts.append(f"registered zoo model {result['zoo_model']}")
    return "; ".join(parts) + "."

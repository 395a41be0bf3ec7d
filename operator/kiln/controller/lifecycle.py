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


def parse(body: dict[str, Any]) -> api.TrainingJob:
    """The job without its status (which the operator owns and the parser need not check).

    Raises:
        api.InvalidSpec: the spec does not parse or validate.
    """
    ref = jobs.JobRef.of(body)
    return api.parse_job({k: v for k, v in body.items() if k != "status"}, source=ref.key)


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
    then the pod ``<job>-trainer-<attempt>``. False when the job is no longer waiting."""
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
        e.condition(C.PLACED, True, R.PLANNED, message, now=now, event="Normal")
        e.condition(C.QUEUED, False, R.PLANNED, message, now=now)
        await e.commit()
        if e.body is None:
            return False
        svc.metrics.queue_wait_seconds.observe(max(0.0, now - entry.since))
        if assignment.peer_nodes:  # after a suspension, once the old gang is gone
            await _ensure_gang(svc, e)
            return True
        await _create_pod(svc, e, entry.job, attempt, pods.Launch(
            node=assignment.node, devices=assignment.gpus, parallelism=assignment.parallelism,
            device=device, warm_start=entry.warm_start, estimated_seconds=assignment.seconds,
            started=now))
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
    (`finish_move`), so it resumes from the last checkpoint. No restart of the backoff limit
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


async def finish_move(svc: services.Services, ref: jobs.JobRef) -> None:
    """Create the pod of a moved job's new attempt once its previous pod is gone (its trainer
    has written its checkpoint), and the pods of a multi-node job's new attempt once its
    previous pods are gone; no-op for a job that is neither."""
    async with svc.jobs.edit(ref) as e:
        await _finish_move(svc, e)
        await _ensure_gang(svc, e)


async def _finish_move(svc: services.Services, e: jobs.Edit) -> None:
    """`finish_move` with the job's lock held."""
    st = e.status
    attempts = int(st.get("attempts") or 0)
    moving = (status.condition(st, C.RESTARTING) or {}).get("reason") == R.RESIZED
    if (deleting(e.body) or e.body is None or status.is_terminal(st) or not moving
            or not status.is_true(st, C.RESTARTING) or status.is_true(st, C.SUSPENDED)
            or attempts < 2):
        return
    ref = jobs.JobRef.of(e.body)
    for attempt in (attempts - 2, attempts - 1):  # the old pod must be gone, the new absent
        name = pods.pod_name(ref.name, attempt)
        if await svc.client.get(kube.Paths.pod(ref.namespace, name)) is not None:
            return
    await _create_pod(svc, e, parse(e.body), attempts - 1,
                      _launch_from_status(st, now=svc.clock()))


async def ensure_pod(svc: services.Services, ref: jobs.JobRef) -> None:
    """Recreate the current attempt's pod of a placed, active job if it is missing.

    Repairs an operator crash between the status write and the pod creation, and a pod
    deleted while the operator was down.
    """
    async with svc.jobs.edit(ref) as e:
        st = e.status
        attempts = int(st.get("attempts") or 0)
        if (deleting(e.body) or status.is_terminal(st) or status.is_true(st, C.SUSPENDED)
                or attempts == 0 or not status.is_true(st, C.PLACED) or e.body is None):
            return
        if _spans_nodes(st):
            await _ensure_gang(svc, e)
            return
        name = pods.pod_name(ref.name, attempts - 1)
        if await svc.client.get(kube.Paths.pod(ref.namespace, name)) is None:
            await _create_pod(svc, e, parse(e.body), attempts - 1,
                              _launch_from_status(st, now=svc.clock()))


async def observe_pod(svc: services.Services, pod: dict[str, Any], event_type: str | None) -> None:
    """React to a change of a trainer pod.

    Only the current attempt's pod counts. Pending and stuck (a container waiting on its
    image or config, or no node for it) -> Running=False with why, once per problem; Running
    -> Running=True; exit 0 -> Succeeded with the trainer's result (its termination message);
    a retryable exit with restarts left -> Restarting and a new pod on the same placement (the
    trainer resumes from its checkpoint); otherwise Failed (`policy.after_exit`). A pod deleted
    under a running job counts as a retryable exit. A zoo model that a trainer registered
    after its job failed is deleted: a failed job never registers a model.
    """
    state = pods.pod_state(pod)
    namespace = str((pod.get("metadata") or {}).get("namespace") or "")
    if not state.job or not namespace:
        return
    ref = jobs.JobRef(namespace, state.job)
    gone = event_type == "DELETED"
    async with svc.jobs.edit(ref) as e:
        st = e.status
        if deleting(e.body) or state.attempt != int(st.get("attempts") or 0) - 1:
            if gone and not deleting(e.body):
                if state.attempt == int(st.get("attempts") or 0) - 2:
                    await _finish_move(svc, e)  # a move's old pod: start the new one
                await _ensure_gang(svc, e)  # a gang's new pods, once all older ones are gone
            return  # the job is going, or an older attempt's pod
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
            if _spans_nodes(e.status):  # the whole gang restarts: its pods hang without a peer
                await _delete_pods(svc, ref.namespace, [
                    p.name for p in await job_pod_states(svc, ref) if p.attempt == attempt - 1])
                await _ensure_gang(svc, e)
            else:
                await _create_pod(svc, e, job, attempt,
                                  _launch_from_status(e.status, now=now))
        return
    if verdict.action is policy.Action.SUCCEED:
        result = _result(state.message)
        if result:
            e.status["result"] = _result_status(result)
            e.status["progress"] = _final_progress(e.status.get("progress") or {}, result)
            record_trainer_decision(e, result.get("warm_start_decision"), now=now)
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


async def forget(svc: services.Services, ref: jobs.JobRef) -> None:
    """The job is being deleted: delete its pods, drop it from memory."""
    async with svc.jobs.lock(ref):
        svc.placement.remove(ref)
        svc.eta_seconds.pop(ref.key, None)
        await _delete_pods(svc, ref.namespace, [p.name for p in await job_pod_states(svc, ref)])
    svc.jobs.forget(ref)


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
    Only a record the job produced (by its name) is deleted.
    """
    model = str(_result(state.message).get("zoo_model") or "")
    if not model:
        return
    zoo = svc.parents.zoo
    try:
        record = await asyncio.to_thread(records.read_record, zoo, model)
        if record.job_name != state.job:
            _log.warning("%s: trainer result names zoo model %s of job %s; kept", state.name,
                         model, record.job_name)
            return
        await asyncio.to_thread(records.delete_record, zoo, model)
    except store.ObjectNotFound:
        return  # deleted already
    except ValueError as exc:  # not a record id, or not a readable record: not ours to delete
        _log.warning("%s: trainer result names zoo model %r: %s", state.name, model, exc)
        return
    except store.StoreUnavailable as exc:
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
    as InvalidSpec with the server's words; other errors propagate (retried). On GPUs the pod
    asks for the resource its node's GPUs are (--gpu-resource: nvidia.com/gpu, a MIG slice,
    amd.com/gpu).
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


def _spans_nodes(st: dict[str, Any]) -> bool:
    """Whether the job's placement spans several nodes (a gang of pods)."""
    return len((st.get("placement") or {}).get("nodes") or []) > 1


async def _ensure_gang(svc: services.Services, e: jobs.Edit) -> None:
    """Create the current attempt's pods of an active multi-node job once no pod of an
    earlier attempt is left running or terminating (lock held).

    A restarted gang starts together and only then: its new pods need the devices the old
    ones hold, and must not meet them in the rendezvous (they share hostnames). A no-op for
    other jobs, and when the current pods exist.
    """
    st = e.status
    attempts = int(st.get("attempts") or 0)
    if (deleting(e.body) or e.body is None or status.is_terminal(st) or attempts == 0
            or status.is_true(st, C.SUSPENDED) or not _spans_nodes(st)
            or not status.is_true(st, C.PLACED)):
        return
    ref = jobs.JobRef.of(e.body)
    states = await job_pod_states(svc, ref)
    if any(p.attempt < attempts - 1 and (p.active or p.deleting) for p in states):
        return
    current = {p.name for p in states if p.attempt == attempts - 1}
    launch_ = _launch_from_status(st, now=svc.clock())
    if len(current) < 1 + len(launch_.peer_nodes):
        await _create_pod(svc, e, parse(e.body), attempts - 1, launch_)


def _result(message: str) -> dict[str, Any]:
    """The trainer's result from its termination message ({} when there is none)."""
    event = contract.read_termination_message(message)
    return event.to_json() if isinstance(event, contract.Result) else {}


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

"""Admission of a new TrainingJob: validate, profile user-code models, decide warm start, queue.

`admit` is the create handler's domain call; `profiled` takes a profiling pod's report;
`requeue` is the resume handler's, which after an operator restart puts a job back in the queue,
its profiling pod back, or makes sure a placed one still has its trainer pod.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import kopf

from kiln import api, contract
from kiln.controller import (
    cluster,
    feasible,
    gates,
    jobs,
    kube,
    lifecycle,
    listing,
    metrics,
    parents,
    placement_loop,
    pods,
    policy,
    profiling,
    reports,
    runtimes,
    settings,
    status,
)
from kiln.warmstart import select
from kiln.zoo import records, store

C, R = api.ConditionType, api.Reason


async def validate(body: kube.Object, *, gpu_resources: Sequence[str] = ()
                   ) -> tuple[api.TrainingJob | None, list[str]]:
    """The parsed job and every problem with it ([] when admissible).

    Exactly what `kiln validate` runs: `api.parse_job`, then `models.check_job` (which never
    imports an entrypoint model), and besides the accelerators the operator knows: any of
    `gpu_resources` (its --gpu-resource names) in spec.template's resources is refused too.
    The registry checks build a model on the meta device (tenths of a second, cached per
    model and dataset), so they run in a worker thread.
    """
    loop = asyncio.get_running_loop()
    try:
        job = lifecycle.parse(body)
    except api.InvalidSpec as exc:  # schema problems, with the registry's about the rest
        problems = await loop.run_in_executor(None, _check_job, exc)
        parsed = exc.job if isinstance(exc.job, api.TrainingJob) else None
        return None, _with_accelerators(parsed, gpu_resources, problems)
    except (ValueError, ArithmeticError) as exc:  # a parser gap: this job fails, not the handler
        return None, [f"spec: cannot be read ({exc.__class__.__name__}: {exc})"]
    problems = await loop.run_in_executor(None, _check_job, job)
    return job, _with_accelerators(job, gpu_resources, problems)


def _check_job(job: api.TrainingJob | api.InvalidSpec) -> list[str]:
    """`models.check_job`, the registry (and torch, seconds of CPU) imported by the first
    call, in its worker thread: an operator's start does without them."""
    from kiln import models

    return models.check_job(job)


def _with_accelerators(job: api.TrainingJob | None, gpu_resources: Sequence[str],
                       problems: list[str]) -> list[str]:
    """`problems`, with the template's accelerators counted with `gpu_resources` too (one
    problem per resources field, naming every accelerator in it)."""
    if job is None or not gpu_resources:
        return problems
    found = api.accelerator_problems(job.spec.template, gpu_resources)
    fields = {p.split(":", 1)[0] for p in found}
    return [p for p in problems if p.split(":", 1)[0] not in fields] + found


def admitted(st: Mapping[str, Any]) -> bool:
    """Admission finished before (a warm-start decision is recorded, or the job ended)."""
    warm = status.condition(st, C.WARM_STARTED)
    return status.is_terminal(st) or (warm is not None
                                      and warm.reason != R.ZOO_UNAVAILABLE.value)


async def admit(deps: lifecycle.Deps, gate: gates.Gate, body: kube.Object, *, retry: int) -> None:
    """Admit a new job.

    0. A spec.runtimeRef: `runtimes.resolve` records the runtime in status.runtime (the job
       runs on it from then on), or fails the job (RuntimeNotFound, or InvalidSpec naming a
       locked field).
    1. Validate: `api.parse_job` (schema and cross-field rules), `models.check_job` (registry:
       architecture, modality, builder arguments). Any problem ->
       Failed/InvalidSpec naming every problem, and a Warning event; nothing is retried.
    2. A model from user code (spec.model.entrypoint; `profiling.needed`): its profiling pod
       is started (Profiled=Unknown) and admission ends here; `profiled` continues it with
       the pod's report, which carries the warm-start decision made in the job's image.
       A built-in model that may use GPUs (`--profile-unmeasured`): when the cluster has a
       GPU type no job of the same namespace, model and batch was profiled on
       (`cache.Caches.profiles`), its profiling pod takes one free GPU of that type, as above
       (none free, or none left in the namespace's quota: no pod); else a cached profile is
       reused as the job's status.profile, Profiled=True, and no pod runs.
       Otherwise, warm start: `parents.ParentChooser.decide`. The zoo unreachable ->
       WarmStarted=False/ZooUnavailable, a Warning event, and `kopf.TemporaryError` with a
       delay that doubles per attempt; after `zoo_retry_limit` attempts the job cold-starts,
       said plainly. Zoo credentials the store refuses (`store.StoreMisconfigured`) cold-start
       the job at once with the store's message (a Warning event). A pinned parent missing
       from the zoo is an invalid spec.
    3. Queue: Created=True, WarmStarted with the decision, warmStart in status; then Queued
       (the placement loop takes it) or, with spec.runPolicy.suspend, Suspended.

    Args:
        deps: what the job steps use.
        gate: the admission gate.
        body: the job as kopf saw it.
        retry: how many times kopf already retried this handler (0 the first time).

    Raises:
        kopf.TemporaryError: the zoo is unreachable and attempts are left.
    """
    ref = jobs.JobRef.of(body)
    st = body.get("status") or {}
    if admitted(st):  # a repeated create: the operator restarted before kopf noted it done
        if not (lifecycle.waiting(st) and ref in deps.placement):
            await requeue(deps, gate, ref)
        return
    body, refused, problems = await runtimes.resolve(deps, body)
    if refused is not None:
        await (reject(deps, ref, problems) if refused is R.INVALID_SPEC
               else _fail(deps, ref, refused, f"{'; '.join(problems)}."))
        return
    job, problems = await validate(body, gpu_resources=deps.options.gpu_resources)
    if job is None or problems:
        await reject(deps, ref, problems)
        return
    if deps.options.profile_entrypoint_models and profiling.needed(job):
        if gate.manages(job):
            await _profile_when_admitted(deps, gate, ref, job)
        else:
            await start_profiling(deps, ref, job)
        return
    reused: tuple[str, api.ProfileStatus] | None = None
    if deps.options.profile_unmeasured and profiling.builtin_on_gpus(job):
        missing, reused = await _unmeasured_type(deps, job)
        # A gate's job has no quota for a pod of the cache's: it reuses a profile, if any.
        if (missing is not None and not gate.manages(job)
                and await start_profiling(deps, ref, job, device_type=missing)):
            return
    outcome_label = ""
    try:
        decision = await deps.parents.decide(job)
    except store.StoreUnavailable as exc:
        attempt = retry + 1
        if attempt < deps.options.zoo_retry_limit:
            await _zoo_unavailable(deps, ref, exc, attempt)
        decision = select.cold_start(
            api.WarmStartOutcome.COLD_EMPTY,
            f"cold start: the model zoo stayed unreachable after {attempt} attempts ({exc})")
        outcome_label = metrics.ZOO_UNAVAILABLE_OUTCOME
    except store.StoreMisconfigured as exc:  # the operator's zoo settings: retrying won't help
        decision = select.cold_start(api.WarmStartOutcome.COLD_EMPTY, f"cold start: {exc}")
        outcome_label = metrics.ZOO_UNAVAILABLE_OUTCOME
    except api.InvalidSpec as exc:  # a pinned parent that is not in the zoo
        await reject(deps, ref, list(exc.problems))
        return
    await _queue(deps, gate, ref, job, decision, outcome=outcome_label or decision.outcome.value,
                 before=_reuse_profile(job, *reused) if reused is not None else None)


async def _unmeasured_type(deps: lifecycle.Deps, job: api.TrainingJob
                           ) -> tuple[str | None, tuple[str, api.ProfileStatus] | None]:
    """(a GPU type of the cluster without a cached profile of the job's model and batch, or
    None; (a type, its cached profile) for one that has one, or None)."""
    options = deps.options
    pools = cluster.pools(await deps.client.list(kube.Paths.nodes()), [],
                          cpu_slots=options.cpu_slots_per_node, now=deps.clock(),
                          gpu_type=settings.gpu_type(options),
                          gpu_type_label=options.gpu_type_label,
                          gpu_resources=options.gpu_resources)
    kinds = sorted({n.device_type for n in pools.nodes.get(cluster.GPU_POOL, ())})
    cached = [(kind, deps.caches.profiles[key]) for kind in kinds
              if (key := profiling.cache_key(job, kind)) in deps.caches.profiles]
    missing = next((kind for kind in kinds
                    if profiling.cache_key(job, kind) not in deps.caches.profiles),
                   None)
    return missing, cached[0] if cached else None


def _reuse_profile(job: api.TrainingJob, device_type: str,
                   profile: api.ProfileStatus) -> Callable[[jobs.Edit, float], None]:
    """Records a cached profile as the job's own (status.profile, Profiled=True)."""
    where = device_type.removeprefix("cuda:") or "a GPU node"
    message = (f"Reused the profile of {job.spec.model.label} at batch "
               f"{job.spec.training.batch_size} measured on {where} for an earlier job: no "
               "profiling pod.")

    def record(e: jobs.Edit, now: float) -> None:
        e.status["profile"] = api.to_wire(profile)
        e.condition(C.PROFILED, True, R.MODEL_PROFILED, message, now=now, event="Normal")
    return record


async def _zoo_unavailable(deps: lifecycle.Deps, ref: jobs.JobRef, exc: Exception,
                           attempt: int) -> None:
    """Record a failed zoo attempt and ask kopf to retry later (raises)."""
    delay = deps.options.zoo_retry_delay(attempt - 1)
    message = (f"The model zoo is unreachable ({exc}); attempt {attempt} of "
               f"{deps.options.zoo_retry_limit}, next in {delay:.0f} s; the job cold-starts "
               "after the last one. Check the zoo endpoint and credentials.")
    now = deps.clock()
    async with deps.jobs.edit(ref) as e:
        if not lifecycle.deleting(e.body):
            e.condition(C.CREATED, True, R.JOB_CREATED, "Accepted: the spec is valid.", now=now)
            if e.condition(C.WARM_STARTED, False, R.ZOO_UNAVAILABLE, message, now=now,
                           event="Warning"):
                deps.metrics.zoo_unavailable.inc()
    raise kopf.TemporaryError(message, delay=delay)


async def _profile_when_admitted(deps: lifecycle.Deps, gate: gates.Gate, ref: jobs.JobRef,
                                 job: api.TrainingJob) -> None:
    """A job the gate manages is profiled within the gate's admission: Profiled=Unknown
    (WaitingForKueueAdmission), and the gate asked for the job's admission; once it reserves
    quota it calls `profile_admitted`."""
    if await deps.client.get(kube.Paths.pod(ref.namespace, profiling.pod_name(ref.name))):
        return  # a repeated create, or a restart: its pod reports through the watch
    now = deps.clock()
    async with deps.jobs.edit(ref) as e:
        if lifecycle.deleting(e.body) or admitted(e.status) or e.body is None:
            return
        uid = str((e.body.get("metadata") or {}).get("uid") or "")
        waits = (gate.waiting(job, uid) or (R.WAITING_FOR_KUEUE, ""))[1]
        e.condition(C.CREATED, True, R.JOB_CREATED, "Accepted: the spec is valid.", now=now)
        e.status.setdefault(api.ADMITTED_SPEC_STATUS, api.admitted_spec(job))
        e.condition(C.PROFILED, None, R.WAITING_FOR_KUEUE,
                    f"The model of {job.spec.model.label} is profiled once the job is "
                    f"admitted, in a pod that runs within the job's quota. {waits}", now=now,
                    event="Normal")
        if job.spec.run_policy.suspend and not status.is_true(e.status, C.SUSPENDED):
            e.condition(C.SUSPENDED, True, R.SUSPENDED_BY_USER,
                        "Created suspended (spec.runPolicy.suspend): nothing is admitted or "
                        "profiled; set it to false to start.", now=now, event="Normal")
        await e.commit()
        body = e.body
    if body is not None:  # after the lock: the gate may edit the job too
        await gate.queued(body, job)


async def profile_admitted(deps: lifecycle.Deps, ref: jobs.JobRef,
                           grant: placement_loop.Grant) -> None:
    """The gate reserved quota for a job whose profiling waited for it
    (`profiling.waits_for_quota`): start its profiling pod within `grant`."""
    body = await deps.jobs.fetch(ref)
    if body is None or lifecycle.deleting(body) or not profiling.waits_for_quota(
            body.get("status") or {}):
        return
    try:
        job = lifecycle.parse(body)
    except api.InvalidSpec:
        return  # its spec changed under it; admission already judged the original
    await start_profiling(deps, ref, job, grant=grant)


async def start_profiling(deps: lifecycle.Deps, ref: jobs.JobRef, job: api.TrainingJob, *,
                          device_type: str | None = None,
                          grant: placement_loop.Grant | None = None) -> bool:
    """Create the job's profiling pod (Profiled=Unknown) unless it exists.

    It borrows one free device of the pool the job would run in (`profiling.choose_device`),
    taken under `cache.Caches.profiling_lock` so two profiling pods never take the same one; a GPU
    only while the namespace's --namespace-gpu-quota has one left. A pod
    the API server refuses as invalid fails the job as InvalidSpec with the server's words.
    With `device_type` (a built-in model measured for the cluster's profile cache) the device
    is a free GPU of that type, and with none free no pod is made. With `grant` (what the
    admission gate reserved for the job) the device is on a node the grant allows, a GPU only
    if it grants one, and the job's profiling must still wait for it.

    Returns:
        False when no pod was made for want of a free GPU of `device_type` (admission goes on
        without profiling); True otherwise.
    """
    async with deps.caches.profiling_lock:
        options = deps.options
        if any(profiling.is_profiling_pod(p) for p in await listing.kiln_pods(
                deps.client, ref.namespace, job=ref.name)):
            return True  # a repeated create, or a restart: its pod reports through the watch
        node_objects = await deps.client.list(kube.Paths.nodes())
        pod_objects = await listing.placement_pods(deps.client, cluster.gpu_node_names(
            node_objects, options.gpu_resources))
        pools = cluster.pools(node_objects, pod_objects,
                              cpu_slots=options.cpu_slots_per_node, now=deps.clock(),
                              gpu_type=settings.gpu_type(options),
                              gpu_type_label=options.gpu_type_label,
                              gpu_resources=options.gpu_resources)
        allowed = feasible.fit(api.scheduling_of(job.spec.template), node_objects,
                               feasible.used(pod_objects)).nodes
        # Its GPU counts against the namespace's quota, as a trainer's does.
        quota = dict(settings.placement_settings(options).namespace_gpu_quota).get(
            ref.namespace)
        left = None if quota is None else quota - pools.held_gpus(ref.namespace)
        if grant is not None:  # within what the gate reserved for the job
            allowed = frozenset(str((n.get("metadata") or {}).get("name")) for n in node_objects
                                if grant.allows(n)) & allowed
            granted = grant.gpus or 0
            left = granted if left is None else min(left, granted)
        device = profiling.choose_device(pools, job, device_type, among=allowed, gpus_left=left)
        if device_type is not None and (device.devices < 1 or device.device != "gpu"):
            return False
        name = profiling.pod_name(ref.name)
        none_left = ("the job's admission grants no GPU" if grant is not None and not grant.gpus
                     else f"namespace {ref.namespace}'s --namespace-gpu-quota of {quota} GPU(s) "
                     "is in use" if left is not None and left < 1 else "none free")
        held = ("1 GPU" if device.device == "gpu" else "1 CPU slot") if device.devices else \
            f"no device held ({none_left}): the step is timed on a CPU"
        where = f"on node {device.node}, {held}" if device.node else held
        now = deps.clock()
        async with deps.jobs.edit(ref) as e:
            if lifecycle.deleting(e.body) or admitted(e.status) or e.body is None or (
                    grant is not None and not profiling.waits_for_quota(e.status)):
                return True
            e.condition(C.CREATED, True, R.JOB_CREATED, "Accepted: the spec is valid.", now=now)
            e.status.setdefault(api.ADMITTED_SPEC_STATUS, api.admitted_spec(job))
            e.condition(C.PROFILED, None, R.PROFILING,
                        f"Measuring the model of {job.spec.model.label} in pod {name} "
                        f"({where}) before placement: its graph, FLOPs, parameters and step "
                        "time; its warm start is decided there.", now=now, event="Normal")
            await e.commit()
            if e.body is None:
                return True
            await deps.zoo_access.prepare(e.body, job, decided=None)
            manifest = profiling.build_pod(e.body, job, device, settings=deps.pod_settings,
                                           timeout_seconds=options.profile_timeout_seconds,
                                           now=now, device_type=device_type,
                                           node_labels=dict(grant.node_labels) if grant else None)
            try:
                await deps.client.create(kube.Paths.pods(ref.namespace), manifest)
            except kube.ApiError as exc:
                if exc.status == 409:  # made by an earlier attempt of this handler
                    return True
                if exc.status not in (400, 422):
                    raise
                message = (f"The API server refused profiling pod {name}: {exc}; fix "
                           "spec.template and create the job again.")
                e.condition(C.FAILED, True, R.INVALID_SPEC, message, now=now, event="Warning")
                e.status["completionTime"] = status.rfc3339(now)
    return True


async def profiled(deps: lifecycle.Deps, gate: gates.Gate, pod: kube.Object,
                   event_type: str | None) -> None:
    """Continue admission when a job's profiling pod ended (or vanished).

    A `contract.Profile` -> status.profile, Profiled=True with the numbers, and the job queued
    with the warm-start decision made in the pod, if every parent it names is one the job's
    namespace may see (`reports.parents_problem`; else a ReportRefused event, and its trainer
    decides). A profile with a timed step on a GPU type feeds the namespace's profile cache.
    The model's code failed (exit 2) -> Failed/InvalidSpec with the pod's message (the user's
    file and line): permanent. Anything else (a malformed report, a crash, out of memory,
    past --profile-timeout-seconds, the pod deleted) -> Profiled=False/ProfilingFailed with
    what went wrong, a Warning event, and the job queued on a nominal estimate with its warm
    start decided by its trainer.
    """
    state = pods.pod_state(pod)
    namespace = str((pod.get("metadata") or {}).get("namespace") or "")
    gone = event_type == "DELETED" or state.deleting
    if not state.job or not namespace:
        return
    ref = jobs.JobRef(namespace, state.job)
    if state.phase == "Pending" and not gone:
        await _profiling_pending(deps, ref, state)
        return
    if not (state.finished or gone):
        return
    body = await deps.jobs.fetch(ref)
    if body is None or lifecycle.deleting(body):
        return
    st = body.get("status") or {}
    profiling_now = status.condition(st, C.PROFILED)
    if profiling_now is None or profiling_now.status != "Unknown" or admitted(st):
        return
    if profiling.waits_for_quota(st):  # stopped by an eviction; profiled again when admitted
        if gone:  # the gate may have admitted it again while the pod was going
            with contextlib.suppress(api.InvalidSpec):
                await gate.queued(body, lifecycle.parse(body))
        return
    try:
        job = lifecycle.parse(body)
    except api.InvalidSpec:
        return  # its spec changed under it; admission already judged the original
    malformed = ""
    try:
        report = profiling.read(state) if state.finished else None
    except ValueError as exc:  # user code can write anything there
        report, malformed = None, str(exc)
    if isinstance(report, contract.Profile) and state.phase == "Succeeded":
        if report.zoo_key != records.profile_key(namespace, job.name):  # only its own object
            report = dataclasses.replace(report, zoo_key=None)
        in_trainer = select.cold_start(api.WarmStartOutcome.IN_TRAINER, parents.IN_TRAINER_REASON)
        decision = select.from_report(report.warm_start_decision) or in_trainer
        ids = reports.decision_ids(decision)
        refused = await reports.parents_problem(deps.parents.zoo, namespace, ids, granted=None)
        if refused is not None:
            decision = in_trainer
        message = profiling.summary(report, state.name)
        measured_type = ((pod.get("metadata") or {}).get("annotations") or {}).get(
            profiling.DEVICE_TYPE_ANNOTATION)
        # Timed on a GPU of that type: later jobs of the namespace reuse it.
        if measured_type is not None and state.devices >= 1 and profiling.cacheable(report):
            deps.caches.profiles[profiling.cache_key(job, measured_type)] = profiling.to_status(
                report)

        def record(e: jobs.Edit, now: float) -> None:
            e.status["profile"] = api.to_wire(profiling.to_status(report))
            e.condition(C.PROFILED, True, R.MODEL_PROFILED, message, now=now, event="Normal")
            if refused is not None:
                e.events.append(reports.refused_event(
                    state.name, f"a warm-start decision naming {', '.join(ids)}", refused,
                    "its trainer decides its warm start itself"))

        await _queue(deps, gate, ref, job, decision, outcome=decision.outcome.value, before=record)
        return
    if state.exit_code == contract.EXIT_INVALID and isinstance(report, contract.Failure):
        problem = (f"the profiling pod {state.name} could not build or run the model: "
                   f"{report.message}")
        await reject(deps, ref, [problem])
        return
    why = f"reported a malformed profile ({malformed})" if malformed else _profiling_failure(
        state, pod, report, gone=gone, timeout_seconds=deps.options.profile_timeout_seconds)
    warning = (f"Profiling pod {state.name} {why}; the job is placed on a nominal estimate "
               "and its trainer decides its warm start itself.")

    def record_failure(e: jobs.Edit, now: float) -> None:
        e.condition(C.PROFILED, False, R.PROFILING_FAILED, warning, now=now, event="Warning")

    await _queue(deps, gate, ref, job,
                 select.cold_start(api.WarmStartOutcome.IN_TRAINER, parents.IN_TRAINER_REASON),
                 outcome=api.WarmStartOutcome.IN_TRAINER.value, before=record_failure)


async def _profiling_pending(deps: lifecycle.Deps, ref: jobs.JobRef,
                             state: pods.PodState) -> None:
    """A profiling pod that has not started: say why once (a Warning event), and past
    --pod-start-timeout-seconds delete it and fail the job, as for a trainer pod (the trainer
    would need the same image, volumes and scheduling)."""
    now = deps.clock()
    timeout = deps.options.pod_start_timeout_seconds
    stuck = policy.not_started(state, role="Profiling")
    timed_out = policy.start_timed_out(state, timeout, now)
    if stuck is None and not timed_out:
        return
    async with deps.jobs.edit(ref) as e:
        current = status.condition(e.status, C.PROFILED)
        if (lifecycle.deleting(e.body) or admitted(e.status) or current is None
                or not profiling.running(e.status)):
            return
        if timed_out:
            message = policy.start_timeout_message(state, timeout, role="Profiling")
            e.condition(C.PROFILED, False, R.POD_START_TIMEOUT, message, now=now)
            e.condition(C.FAILED, True, R.POD_START_TIMEOUT, message, now=now, event="Warning")
            e.status["completionTime"] = status.rfc3339(now)
        elif stuck is not None and not current.message.startswith(stuck.problem):
            e.condition(C.PROFILED, None, stuck.reason, stuck.message, now=now,
                        event="Warning")
            return
        else:
            return
    deps.metrics.count_finished(ref.namespace, "failed")
    await deps.client.delete(kube.Paths.pod(ref.namespace, state.name),
                            grace_period_seconds=deps.options.termination_grace_seconds)


def _profiling_failure(state: pods.PodState, pod: kube.Object,
                       report: contract.Profile | contract.Failure | None, *, gone: bool,
                       timeout_seconds: float) -> str:
    """How a profiling pod ended without a profile, as a phrase."""
    if (pod.get("status") or {}).get("reason") == "DeadlineExceeded":
        return f"ran past --profile-timeout-seconds ({timeout_seconds:.0f} s) and was stopped"
    if gone and not state.finished:
        return "was deleted before it reported"
    detail = report.message if isinstance(report, contract.Failure) else (
        state.container_reason or "no report")
    return f"exited with code {state.exit_code} ({detail})"


async def _queue(deps: lifecycle.Deps, gate: gates.Gate, ref: jobs.JobRef, job: api.TrainingJob,
                 decision: api.WarmStartDecision, *, outcome: str,
                 before: Callable[[jobs.Edit, float], None] | None = None) -> None:
    """Record the warm-start decision and queue the job (or suspend it), in one status write;
    `before` adds to that write (the profiling outcome). A job the admission `gate` manages
    waits for it instead (`gates.Gate.queued` asks for its admission)."""
    now = deps.clock()
    queued: kube.Object | None = None
    async with deps.jobs.edit(ref) as e:
        if lifecycle.deleting(e.body) or admitted(e.status):
            return
        # Read under the lock: a suspension may have come while the job was profiled.
        suspended = job.spec.run_policy.suspend or status.is_true(e.status, C.SUSPENDED)
        if before is not None:
            before(e, now)
        deps.metrics.warm_starts.labels(outcome=outcome).inc()
        if decision.parent is not None and decision.similarity is not None:
            deps.metrics.warm_start_similarity.observe(decision.similarity)
        e.condition(C.CREATED, True, R.JOB_CREATED, "Accepted: the spec is valid.", now=now)
        e.status.setdefault(api.ADMITTED_SPEC_STATUS, api.admitted_spec(job))  # it runs on it
        e.status["warmStart"] = api.to_wire(decision)
        if decision.parent is not None:
            e.condition(C.WARM_STARTED, True, R.PARENT_SELECTED, _sentence(decision.reason),
                        now=now, event="Normal")
        elif decision.outcome is api.WarmStartOutcome.IN_TRAINER:
            e.condition(C.WARM_STARTED, None, R.DECIDED_IN_TRAINER, _sentence(decision.reason),
                        now=now, event="Normal")
        else:
            reason = (R.WARM_START_DISABLED if decision.outcome is api.WarmStartOutcome.DISABLED
                      else R.COLD_START)
            e.condition(C.WARM_STARTED, False, reason, _sentence(decision.reason), now=now,
                        event="Warning" if outcome == metrics.ZOO_UNAVAILABLE_OUTCOME else "Normal")
        gated = gate.waiting(job, str(((e.body or {}).get("metadata") or {}).get("uid") or ""))
        if suspended:
            if not status.is_true(e.status, C.SUSPENDED):  # else suspended while profiled
                e.condition(C.SUSPENDED, True, R.SUSPENDED_BY_USER,
                            "Created suspended (spec.runPolicy.suspend); set it to false to "
                            "start.", now=now, event="Normal")
        elif gated is not None:
            e.condition(C.QUEUED, True, *gated, now=now, event="Normal")
        else:
            e.condition(C.QUEUED, True, R.WAITING_FOR_PLACEMENT,
                        "Waiting for the placement plan to reach this job.", now=now)
        await e.commit()
        if not suspended and e.body is not None:
            deps.placement.add(lifecycle.queued_entry(e.body, job, now=now))
        queued = e.body
    if queued is not None:  # after the lock: the gate may edit the job too
        await gate.queued(queued, job)


async def edited(deps: lifecycle.Deps, body: kube.Object, old: Any) -> None:
    """An admitted job's spec changed from `old`: a Warning event (SpecEditIgnored) names each
    edit that does not take effect (`api.ignored_edits`), and scheduling directives of the
    template that do not validate (the admitted ones stay). The job runs on as admitted, so no
    later restart meets a spec admission never checked."""
    st = body.get("status") or {}
    if (lifecycle.deleting(body) or status.is_terminal(st)
            or not isinstance(st.get(api.ADMITTED_SPEC_STATUS), dict)):
        return
    fixed, scheduling = api.edited_parts(old, body.get("spec"))
    sentences = []
    ignored = api.ignored_edits(body) if fixed else []
    if ignored:
        shown = ", ".join(ignored[:_EDITS_SHOWN]) + (
            f" and {len(ignored) - _EDITS_SHOWN} more" if len(ignored) > _EDITS_SHOWN else "")
        sentences.append(
            f"The edit of {shown} does not take effect: the job runs on the spec it was admitted "
            f"with (status.{api.ADMITTED_SPEC_STATUS}), and only spec.runPolicy and "
            f"spec.template's {', '.join(api.MUTABLE_TEMPLATE_KEYS)} may change once it is "
            "admitted; create a new TrainingJob to train with the new values.")
    try:
        if scheduling:
            api.parse_job(api.running_doc(body))
    except api.InvalidSpec as exc:
        sentences.append(f"The edited spec is invalid ({'; '.join(exc.problems)}); the job keeps "
                         "its admitted spec.template.")
    if sentences:
        await deps.jobs.post_event(body, status.Event.warning(R.SPEC_EDIT_IGNORED,
                                                             " ".join(sentences)))


_EDITS_SHOWN = 5


async def reject(deps: lifecycle.Deps, ref: jobs.JobRef, problems: list[str]) -> None:
    """Fail the job as InvalidSpec, naming every problem (no retries: the spec must change)."""
    await _fail(deps, ref, R.INVALID_SPEC, (
        "Invalid spec: " + "; ".join(problems) +
        ". Fix the job and create it again (kiln validate FILE checks it locally)."))


async def give_up(deps: lifecycle.Deps, body: kube.Object, exc: Exception,
                  attempts: int) -> None:
    """Fail a job whose admission raised an unexpected error `attempts` times in a row
    (Failed/PermanentError naming the error): a job that cannot be admitted must not be
    retried forever."""
    await _fail(deps, jobs.JobRef.of(body), R.PERMANENT_ERROR, (
        f"Admission failed {attempts} times with an unexpected error "
        f"({type(exc).__name__}: {str(exc)[:500]}); the job is not retried. Please report it; "
        "meanwhile, create the job again or change its model."))


async def _fail(deps: lifecycle.Deps, ref: jobs.JobRef, reason: api.Reason,
                message: str) -> None:
    """End a job that never got past admission: Failed with `reason`, a Warning event."""
    now = deps.clock()
    async with deps.jobs.edit(ref) as e:
        if lifecycle.deleting(e.body) or status.is_terminal(e.status):
            return
        e.condition(C.FAILED, True, reason, message, now=now, event="Warning")
        e.status["completionTime"] = status.rfc3339(now)
    deps.metrics.count_finished(ref.namespace, "failed")


async def requeue(deps: lifecycle.Deps, gate: gates.Gate, ref: jobs.JobRef) -> None:
    """After an operator restart: queue a waiting job again, or make sure a placed one runs."""
    body = await deps.jobs.fetch(ref)
    if lifecycle.deleting(body) or body is None:
        return
    st = body.get("status") or {}
    profiling_now = status.condition(st, C.PROFILED)
    if (not admitted(st) and profiling_now is not None
            and profiling_now.status == "Unknown"):
        await _resume_profiling(deps, gate, ref, body)
        return
    if (status.is_terminal(st) or status.is_true(st, C.SUSPENDED) or not admitted(st)):
        return
    if int(st.get("attempts") or 0) > 0 and status.is_true(st, C.PLACED):
        await lifecycle.ensure_pod(deps, ref)
        job, problems = await validate(body)
        placement = status.part(st, "placement", api.PlacementStatus)
        spans = len(placement.nodes or []) > 1  # never moved
        # The loop may move it again, unless it spans nodes or a gate admitted it (a move could
        # leave what the gate admitted).
        if (job is not None and not problems and not spans
                and not gate.manages(job)):
            running = status.condition(st, C.RUNNING)
            await deps.placement.adopt(
                lifecycle.queued_entry(body, job, now=deps.clock()),
                "gpu" if placement.gpus else "cpu",
                since=status.parse_rfc3339(running.last_transition_time if running else None))
    elif lifecycle.waiting(st):
        job, problems = await validate(body)
        if job is not None and not problems:
            deps.placement.add(lifecycle.queued_entry(body, job, now=deps.clock()))
            await gate.queued(body, job)
    deps.metrics.set_phase(ref.namespace, ref.name, status.phase_of(st))


async def _resume_profiling(deps: lifecycle.Deps, gate: gates.Gate, ref: jobs.JobRef,
                            body: kube.Object) -> None:
    """After a restart: read a profiling pod that ended meanwhile, or start a missing one."""
    pod = await deps.client.get(kube.Paths.pod(ref.namespace, profiling.pod_name(ref.name)))
    if pod is not None:
        await profiled(deps, gate, pod, None)
        return
    job, problems = await validate(body)
    if job is None or problems:
        return
    if profiling.needed(job) and gate.manages(job):
        await _profile_when_admitted(deps, gate, ref, job)  # admitted already: the gate says so
        return
    if profiling.needed(job):
        await start_profiling(deps, ref, job)
        return
    missing, _ = await _unmeasured_type(deps, job)  # a built-in model's pod went missing
    if missing is None or gate.manages(job) or not await start_profiling(
            deps, ref, job, device_type=missing):
        warning = (f"Profiling pod {profiling.pod_name(ref.name)} went missing and no GPU of "
                   "an unprofiled type is free; the job is placed on its estimate and its "
                   "trainer decides its warm start itself.")

        def record_failure(e: jobs.Edit, now: float) -> None:
            e.condition(C.PROFILED, False, R.PROFILING_FAILED, warning, now=now,
                        event="Warning")

        await _queue(deps, gate, ref, job,
                     select.cold_start(api.WarmStartOutcome.IN_TRAINER, parents.IN_TRAINER_REASON),
                     outcome=api.WarmStartOutcome.IN_TRAINER.value, before=record_failure)


def _sentence(reason: str) -> str:
    """A decision's reason as a sentence: capitalised, with a full stop."""
    text = reason.strip()
    if not text:
        return text
    text = text[0].upper() + text[1:]
    return text if text.endswith(".") else text + "."

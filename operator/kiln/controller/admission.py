"""Admission of a new TrainingJob: validate, choose its warm-start parent, queue it.

`admit` is the create handler's domain call; `requeue` the resume handler's, which after an
operator restart puts a job back in the queue or makes sure a placed one still has its pod.
"""

from __future__ import annotations

import asyncio
from typing import Any

import kopf

from kiln import api, models
from kiln.controller import jobs, lifecycle, metrics, parents, services, status
from kiln.warmstart import select
from kiln.zoo import store

C, R = api.ConditionType, api.Reason


async def validate(body: dict[str, Any]) -> tuple[api.TrainingJob | None, list[str]]:
    """The parsed job and every problem with it ([] when admissible).

    Exactly what `kiln validate` runs: `api.parse_job`, then `models.check_job` (which never
    imports an entrypoint model). The registry checks build a model on the meta device (tenths
    of a second, cached per model and dataset), so they run in a worker thread.
    """
    try:
        job = lifecycle.parse(body)
    except api.InvalidSpec as exc:
        return None, list(exc.problems)
    loop = asyncio.get_running_loop()
    return job, await loop.run_in_executor(None, models.check_job, job)


def admitted(st: dict[str, Any]) -> bool:
    """Admission finished before (a warm-start decision is recorded, or the job ended)."""
    warm = status.condition(st, C.WARM_STARTED)
    return status.is_terminal(st) or (warm is not None
                                      and warm.get("reason") != R.ZOO_UNAVAILABLE.value)


async def admit(svc: services.Services, body: dict[str, Any], *, retry: int) -> None:
    """Admit a new job.

    1. Validate: `api.parse_job` (schema and cross-field rules), `models.check_job` (registry:
       architecture, modality, builder arguments). Any problem ->
       Failed/InvalidSpec naming every problem, and a Warning event; nothing is retried.
    2. Warm start: `parents.ParentChooser.decide`. The zoo unreachable ->
       WarmStarted=False/ZooUnavailable, a Warning event, and `kopf.TemporaryError` with a
       delay that doubles per attempt; after `zoo_retry_limit` attempts the job cold-starts,
       said plainly. A pinned parent missing from the zoo is an invalid spec.
    3. Queue: Created=True, WarmStarted with the decision, warmStart in status; then Queued
       (the placement loop takes it) or, with spec.runPolicy.suspend, Suspended.

    Args:
        svc: the operator's services.
        body: the job as kopf saw it.
        retry: how many times kopf already retried this handler (0 the first time).

    Raises:
        kopf.TemporaryError: the zoo is unreachable and attempts are left.
    """
    ref = jobs.JobRef.of(body)
    st = body.get("status") or {}
    if admitted(st):  # a repeated create: the operator restarted before kopf noted it done
        if not (lifecycle.waiting(st) and ref in svc.placement):
            await requeue(svc, ref)
        return
    job, problems = await validate(body)
    if job is None or problems:
        await reject(svc, ref, problems)
        return
    outcome_label = ""
    try:
        decision = await svc.parents.decide(job)
    except store.StoreUnavailable as exc:
        attempt = retry + 1
        if attempt < svc.options.zoo_retry_limit:
            await _zoo_unavailable(svc, ref, exc, attempt)
        decision = select.cold_start(
            select.Outcome.COLD_EMPTY,
            f"cold start: the model zoo stayed unreachable after {attempt} attempts ({exc})")
        outcome_label = metrics.ZOO_UNAVAILABLE_OUTCOME
    except api.InvalidSpec as exc:  # a pinned parent that is not in the zoo
        await reject(svc, ref, list(exc.problems))
        return
    await _queue(svc, ref, job, decision, outcome=outcome_label or decision.outcome.value)


async def _zoo_unavailable(svc: services.Services, ref: jobs.JobRef, exc: Exception,
                           attempt: int) -> None:
    """Record a failed zoo attempt and ask kopf to retry later (raises)."""
    delay = svc.options.zoo_retry_delay(attempt - 1)
    message = (f"The model zoo is unreachable ({exc}); attempt {attempt} of "
               f"{svc.options.zoo_retry_limit}, next in {delay:.0f} s; the job cold-starts "
               "after the last one. Check the zoo endpoint and credentials.")
    now = svc.clock()
    async with svc.jobs.edit(ref) as e:
        if not lifecycle.deleting(e.body):
            e.condition(C.CREATED, True, R.JOB_CREATED, "Accepted: the spec is valid.", now=now)
            if e.condition(C.WARM_STARTED, False, R.ZOO_UNAVAILABLE, message, now=now,
                           event="Warning"):
                svc.metrics.zoo_unavailable.inc()
    raise kopf.TemporaryError(message, delay=delay)


async def _queue(svc: services.Services, ref: jobs.JobRef, job: api.TrainingJob,
                 decision: select.Decision, *, outcome: str) -> None:
    now = svc.clock()
    suspended = job.spec.run_policy.suspend
    async with svc.jobs.edit(ref) as e:
        if lifecycle.deleting(e.body) or admitted(e.status):
            return
        svc.metrics.warm_starts.labels(outcome=outcome).inc()
        if decision.parent_id is not None and decision.similarity is not None:
            svc.metrics.warm_start_similarity.observe(decision.similarity)
        e.condition(C.CREATED, True, R.JOB_CREATED, "Accepted: the spec is valid.", now=now)
        e.status["warmStart"] = parents.to_status(decision)
        if decision.parent_id is not None:
            e.condition(C.WARM_STARTED, True, R.PARENT_SELECTED, _sentence(decision.reason),
                        now=now, event="Normal")
        elif decision.outcome is select.Outcome.IN_TRAINER:
            e.condition(C.WARM_STARTED, None, R.DECIDED_IN_TRAINER, _sentence(decision.reason),
                        now=now, event="Normal")
        else:
            reason = (R.WARM_START_DISABLED if decision.outcome is select.Outcome.DISABLED
                      else R.COLD_START)
            e.condition(C.WARM_STARTED, False, reason, _sentence(decision.reason), now=now,
                        event="Warning" if outcome == metrics.ZOO_UNAVAILABLE_OUTCOME else "Normal")
        if suspended:
            e.condition(C.SUSPENDED, True, R.SUSPENDED_BY_USER,
                        "Created suspended (spec.runPolicy.suspend); set it to false to start.",
                        now=now, event="Normal")
        else:
            e.condition(C.QUEUED, True, R.WAITING_FOR_PLACEMENT,
                        "Waiting for the placement plan to reach this job.", now=now)
        await e.commit()
        if not suspended and e.body is not None:
            svc.placement.add(lifecycle.queued_entry(e.body, job, now=now))


async def reject(svc: services.Services, ref: jobs.JobRef, problems: list[str]) -> None:
    """Fail the job as InvalidSpec, naming every problem (no retries: the spec must change)."""
    now = svc.clock()
    message = ("Invalid spec: " + "; ".join(problems) +
               ". Fix the job and create it again (kiln validate FILE checks it locally).")
    async with svc.jobs.edit(ref) as e:
        if lifecycle.deleting(e.body) or status.is_terminal(e.status):
            return
        e.condition(C.FAILED, True, R.INVALID_SPEC, message, now=now, event="Warning")
        e.status["completionTime"] = status.rfc3339(now)
    svc.metrics.finished.labels(namespace=ref.namespace, result="failed").inc()


async def requeue(svc: services.Services, ref: jobs.JobRef) -> None:
    """After an operator restart: queue a waiting job again, or make sure a placed one runs."""
    body = await svc.jobs.fetch(ref)
    if lifecycle.deleting(body) or body is None:
        return
    st = body.get("status") or {}
    if (status.is_terminal(st) or status.is_true(st, C.SUSPENDED) or not admitted(st)):
        return
    if int(st.get("attempts") or 0) > 0 and status.is_true(st, C.PLACED):
        await lifecycle.ensure_pod(svc, ref)
    elif lifecycle.waiting(st):
        job, problems = await validate(body)
        if job is not None and not problems:
            svc.placement.add(lifecycle.queued_entry(body, job, now=svc.clock()))
    svc.metrics.set_phase(ref.namespace, ref.name, status.phase_of(st))


def _sentence(reason: str) -> str:
    """A decision's reason as a sentence: capitalised, with a full stop."""
    text = reason.strip()
    if not text:
        return text
    text = text[0].upper() + text[1:]
    return text if text.endswith(".") else text + "."

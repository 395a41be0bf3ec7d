"""TrainingSweeps on the cluster: validate, keep parallelTrials trial jobs, prune, end.

One level-triggered reconcile per sweep (`reconcile`), run on every event of the sweep or of a
job labelled with it, and every few seconds while it runs (`resync_forever`): read the sweep
and its trial jobs, record in status.history what the jobs' status says, then act.
"""

# Restarts. A trial is recorded in status.history (state Running) before its job is created,
# under a deterministic name (<sweep>-t<index>): after a crash in between, the next reconcile
# finds a Running trial without a job and creates it (a trial job deleted by hand is created
# again too, as a Job's pod is: a trial is never lost). A job the sweep controls that history
# lacks is adopted with the values its annotation records. Pruning is recorded before the
# trial's spec.runPolicy.suspend is set, and a pruned trial whose job is not suspended is
# suspended again. The search (`kiln.sweep.Search`) is kept per sweep uid and rebuilt from
# status.history when missing: after a restart, and after any reconcile that failed midway.

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import kopf

from kiln import api, sweep
from kiln.controller import jobs, kube, lifecycle, status, trials

S = api.sweep
SWEEPS = (api.GROUP, api.VERSION, S.SWEEP_PLURAL)
JOBS = (api.GROUP, api.VERSION, api.PLURAL)
HANDLER = "sweeps"  # the handler label of its errors (kiln_reconcile_errors_total)
RESYNC_SECONDS = 5.0
# A trial job the API server refuses with these (400 BadRequest, 422 Invalid) is never made:
# the trial fails. Others (a quota's 403, throttling, server errors) are tried again.
REFUSED_FOR_GOOD = (400, 422)
ACCEPTED = "Accepted"
HISTORY_CONFLICT = "HistoryConflict"  # the recorded trials do not fit the sweep's spec now
_log = logging.getLogger(__name__)


def register(registry: kopf.OperatorRegistry) -> None:
    """Reconcile a sweep on any event of it, and on any event of a job carrying its label
    (whose ownerReference the reconcile then checks)."""
    kopf.on.event(*SWEEPS, registry=registry, id="sweeps")(sweep_event)
    kopf.on.event(*JOBS, registry=registry, id="sweep-trials",
                  labels={S.SWEEP_LABEL: kopf.PRESENT})(trial_event)


async def sweep_event(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    deps: lifecycle.Deps = memo.operator.deps
    ref = jobs.JobRef.of(dict(body))
    if type == "DELETED":
        forget(deps, ref)
        return
    await reconcile(deps, ref)


async def trial_event(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    meta = body.get("metadata") or {}
    name = (meta.get("labels") or {}).get(S.SWEEP_LABEL)
    if isinstance(name, str) and name:
        await reconcile(memo.operator.deps, jobs.JobRef(str(meta.get("namespace")), name))


def forget(deps: lifecycle.Deps, ref: jobs.JobRef) -> None:
    """Drop what is kept about a deleted sweep (its trials go with it: they are owned)."""
    uid, _ = deps.caches.sweeps.pop((ref.namespace, ref.name), ("", False))
    deps.caches.sweep_searches.pop(uid, None)
    deps.caches.sweep_locks.pop((ref.namespace, ref.name), None)
    deps.metrics.forget_sweep(ref.namespace, ref.name)


async def resync_forever(deps: lifecycle.Deps, *, interval_seconds: float = RESYNC_SECONDS
                         ) -> None:
    """Reconcile every unfinished sweep seen, each interval, while this replica leads: what
    an event missed, or a reconcile that failed, is done here."""
    while True:
        await asyncio.sleep(interval_seconds)
        try:
            if not await deps.placement.leads():
                continue
        except kube.ApiError:
            continue
        for (namespace, name), (_, ended) in list(deps.caches.sweeps.items()):
            if not ended:
                await reconcile(deps, jobs.JobRef(namespace, name))


async def reconcile(deps: lifecycle.Deps, ref: jobs.JobRef) -> None:
    """Bring sweep `ref` up to date (`_reconcile`), one reconcile per sweep at a time; a
    trigger while one waits adds nothing. Errors are logged and counted, and the sweep's search
    dropped (rebuilt from status next time); `resync_forever` tries again."""
    key = (ref.namespace, ref.name)
    caches = deps.caches
    if key in caches.sweep_pending:
        return
    caches.sweep_pending.add(key)
    lock = caches.sweep_locks.setdefault(key, asyncio.Lock())
    try:
        async with lock:
            caches.sweep_pending.discard(key)
            await _reconcile(deps, ref)
    except Exception as exc:  # noqa: BLE001  # one sweep's trouble never stops the others
        caches.sweep_pending.discard(key)
        uid, _ = caches.sweeps.get(key, ("", False))
        caches.sweep_searches.pop(uid, None)
        deps.metrics.reconcile_errors.labels(handler=HANDLER).inc()
        if isinstance(exc, kube.ApiError):
            _log.warning("sweep %s: %s; tried again shortly", ref.key, exc)
        else:
            _log.exception("sweep %s: unexpected error; tried again shortly", ref.key)


@dataclasses.dataclass
class _Plan:
    """What one reconcile does after writing the sweep's status."""

    create: list[S.Trial] = dataclasses.field(default_factory=list)
    suspend: list[str] = dataclasses.field(default_factory=list)  # trial job names
    events: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)


async def _reconcile(deps: lifecycle.Deps, ref: jobs.JobRef) -> None:
    body = await deps.client.get(kube.Paths.sweep(ref.namespace, ref.name))
    if lifecycle.deleting(body):
        return
    assert body is not None
    meta = body.get("metadata") or {}
    uid = str(meta.get("uid") or "")
    old = body.get("status") or {}
    ended = old.get("phase") in trials.ENDED
    deps.caches.sweeps[(ref.namespace, ref.name)] = (uid, ended)
    listed = await deps.client.list(kube.Paths.jobs(ref.namespace),
                                    label_selector=f"{S.SWEEP_LABEL}={ref.name}")
    owned = trials.owned(uid, ref.name, listed)
    history = trials.history_of(old)
    new = dict(old)
    plan = _Plan()
    now = deps.clock()
    parsed: S.TrainingSweep | None = None
    problems: list[str] = []
    if not ended:  # an ended sweep: only its pruned trials' stops are made sure of, below
        parsed, problems = await _validate(
            body, checked=trials.is_true(old, S.SweepConditionType.CREATED))
    known = {t.index for t in history}
    # A job of the sweep that status lacks: the search must include it, if its annotation
    # gives values of the sweep's parameters (a copied or hand-made job may not). One that
    # does not is left alone, its index never reused.
    adopted = [S.Trial(index=i, name=job["metadata"]["name"], params=trials.params_of(job),
                       state=S.TrialState.RUNNING) for i, job in owned.items() if i not in known]
    if parsed is not None:
        adopted = [t for t in adopted if sweep.misfit_of(parsed.spec, t.params) is None]
    if adopted:
        history = sorted(history + adopted, key=lambda t: t.index)
        deps.caches.sweep_searches.pop(uid, None)
    if not ended:
        if parsed is None or problems:
            _invalid(new, history, owned, plan, problems, now=now)
        else:
            await _advance(deps, parsed, new, history, owned, plan, now=now)
    for trial in history:  # a stop recorded before a crash, or asked while the job was busy
        job = owned.get(trial.index)
        if (trial.state is S.TrialState.PRUNED and job is not None
                and trial.name not in plan.suspend):
            reading = trials.read(job, S.Objective())  # its state and spec only
            if reading.state is S.TrialState.RUNNING and not reading.suspended:
                plan.suspend.append(trial.name)
    patch = status.merge_patch(old, new)
    if patch and await deps.client.merge_patch(
            kube.Paths.sweep(ref.namespace, ref.name, status=True), {"status": patch}) is None:
        return  # deleted meanwhile
    deps.caches.sweeps[(ref.namespace, ref.name)] = (uid, new.get("phase") in trials.ENDED)
    best = new.get("best")
    deps.metrics.set_sweep(ref.namespace, ref.name, status.part(new, "trials", S.TrialCounts),
                           best.get("metric") if isinstance(best, Mapping) else None)
    for type_, reason, message in plan.events:
        await deps.jobs.post(body, type_, reason, message)
    if plan.create and parsed is not None:
        preferred = sweep.own_models(parsed.spec.objective, history)
        refused: dict[int, str] = {}
        for trial in plan.create:
            doc = sweep.trial_job(parsed, trial.index, trial.params, preferred=preferred)
            try:
                await deps.client.create(kube.Paths.jobs(ref.namespace), doc)  # 409: made before
            except kube.ApiError as exc:
                if exc.status not in REFUSED_FOR_GOOD:
                    raise
                refused[trial.index] = (
                    f"The API server refused trial job {trial.name}: {exc.message}. Fix "
                    "spec.template or the parameters' ranges so that every trial is valid.")
        if refused:
            await _refused(deps, ref, body, new, refused)
    for name in plan.suspend:
        await deps.client.merge_patch(kube.Paths.job(ref.namespace, name),
                                      {"spec": {"runPolicy": {"suspend": True}}})


async def _refused(deps: lifecycle.Deps, ref: jobs.JobRef, body: kube.Object,
                   written: dict[str, Any], refused: Mapping[int, str]) -> None:
    """Trials whose job the API server refused for good (a rule of its own that the sweep's
    checks lack, such as a CRD validation rule) fail with its words: the sweep goes on, or
    fails at maxFailedTrials, instead of creating that job forever. The next reconcile counts
    them and rebuilds the search from this status."""
    history = [t if t.index not in refused else t.model_copy(update={
        "state": S.TrialState.FAILED,
        "message": status.cap(refused[t.index], S.TRIAL_MESSAGE_MAX_BYTES)})
        for t in trials.history_of(written)]
    after = {**written, "history": [api.to_wire(t) for t in history]}
    uid = str((body.get("metadata") or {}).get("uid") or "")
    deps.caches.sweep_searches.pop(uid, None)
    patch = status.merge_patch(written, after)
    if patch:
        await deps.client.merge_patch(kube.Paths.sweep(ref.namespace, ref.name, status=True),
                                      {"status": patch})
    for message in refused.values():
        await deps.jobs.post(body, "Warning", "TrialRejected", message)


async def _validate(body: Mapping[str, Any], *, checked: bool
                    ) -> tuple[S.TrainingSweep | None, list[str]]:
    """The parsed sweep and its problems: `api.sweep.parse_sweep`, then (once, until the sweep
    is Created) `models.check_sweep`, which builds models on the meta device in a thread."""
    meta = {k: v for k, v in (body.get("metadata") or {}).items() if k != "managedFields"}
    doc = {**{k: v for k, v in body.items() if k != "status"}, "metadata": meta}
    ref = jobs.JobRef.of(dict(body))
    try:
        parsed = S.parse_sweep(doc, source=ref.key)
    except api.InvalidSpec as exc:
        return None, list(exc.problems)
    except (ValueError, ArithmeticError) as exc:  # a parser gap: this sweep fails, not us
        return None, [f"spec: cannot be read ({exc.__class__.__name__}: {exc})"]
    if checked:
        return parsed, []
    loop = asyncio.get_running_loop()
    return parsed, await loop.run_in_executor(None, _check_sweep, parsed)


def _check_sweep(parsed: api.sweep.TrainingSweep) -> list[str]:
    """`models.check_sweep`, importing the registry (and torch) in its worker thread."""
    from kiln import models

    return models.check_sweep(parsed)


def _invalid(new: dict[str, Any], history: list[S.Trial], owned: Mapping[int, Any],
             plan: _Plan, problems: list[str], *, now: float) -> None:
    """Failed/InvalidSpec naming every problem (and a Warning event); trials it made stop."""
    message = ("Invalid TrainingSweep: " + "; ".join(problems)
               + ". Fix the spec and create the sweep again.")
    reason = api.Reason.INVALID_SPEC.value
    trials.set_condition(new, S.SweepConditionType.CREATED, False, reason, message, now=now)
    _fail(new, history, owned, plan, reason, message, now=now)


def _fail(new: dict[str, Any], history: list[S.Trial], owned: Mapping[int, Any], plan: _Plan,
          reason: str, message: str, *, now: float) -> None:
    """Phase Failed for `reason` (and a Warning event); the trials still running stop."""
    _stop_running(history, owned, plan, reason)
    trials.set_condition(new, S.SweepConditionType.RUNNING, False, reason, message, now=now)
    trials.set_condition(new, S.SweepConditionType.FAILED, True, reason, message, now=now)
    new["phase"] = S.SweepPhase.FAILED.value
    new["completionTime"] = status.rfc3339(now)
    if history:
        new["history"] = [api.to_wire(t) for t in history]
        states = [t.state for t in history]
        new["trials"] = api.to_wire(S.TrialCounts(
            total=len(states), **{s.value.lower(): states.count(s) for s in S.TrialState}))
    plan.events.append(("Warning", reason, message))


def _stop_running(history: list[S.Trial], owned: Mapping[int, Any], plan: _Plan,
                  why: str) -> None:
    for i, trial in enumerate(history):
        if trial.state is S.TrialState.RUNNING:
            history[i] = trials.stopped(trial, why)
            if trial.index in owned:
                plan.suspend.append(trial.name)


async def _advance(deps: lifecycle.Deps, parsed: S.TrainingSweep, new: dict[str, Any],
                   history: list[S.Trial], owned: Mapping[int, dict[str, Any]], plan: _Plan,
                   *, now: float) -> None:
    """Record what the trial jobs say, tell the search, prune, start trials, or end."""
    spec, uid = parsed.spec, str(parsed.metadata.uid or "")
    objective = spec.objective
    search = deps.caches.sweep_searches.get(uid)
    if search is None:
        try:
            search = sweep.Search(spec, history)
        except ValueError as exc:
            # The recorded trials do not fit the spec (its parameters were edited, or the
            # history was): no later reconcile can rebuild the search, so the sweep ends.
            _fail(new, history, owned, plan, HISTORY_CONFLICT, (
                f"The search cannot be rebuilt from status.history: {exc}. Create the sweep "
                "again under a new name (its trials' zoo records stay)."), now=now)
            return
        deps.caches.sweep_searches[uid] = search
    zoo_ids = {record.id for record in deps.parents.records()}
    for i, trial in enumerate(history):
        job = owned.get(trial.index)
        if job is None or trial.state is not S.TrialState.RUNNING:
            continue
        reading = trials.read(job, objective, zoo_ids=zoo_ids)
        history[i] = trial = trial.model_copy(update={
            "parent": reading.parent or trial.parent,
            "similarity": reading.similarity if reading.parent else trial.similarity,
            "zoo_model": reading.zoo_model or trial.zoo_model})
        last = trial.evaluations[-1][0] if trial.evaluations else 0
        if reading.evaluation is not None and reading.evaluation[0] > last:
            epoch, value = reading.evaluation
            # Seconds since the sweep started: when this sweep saw it (benchmarks' clock).
            began = status.parse_rfc3339(new.get("startTime")) or now
            seen = round(max(0.0, now - began), 1)
            history[i] = trial = trial.model_copy(update={
                "evaluations": [*trial.evaluations, [float(epoch), value, seen]],
                "metric": value})
            verdict = search.report(trial.index, epoch, value,
                                    sweep.inheritance(trial.parent, trial.similarity))
            if verdict is not None and reading.state is S.TrialState.RUNNING:
                history[i] = trial.model_copy(update={"state": S.TrialState.PRUNED,
                                                      "pruned_at": verdict.pruned_at()})
                search.tell(trial.index, S.TrialState.PRUNED, value)
                plan.suspend.append(trial.name)
                plan.events.append(("Normal", "TrialPruned", (
                    f"Trial {trial.name} stopped at epoch {epoch} "
                    f"({trials.metric_text(objective, value)}): behind {verdict.against}.")))
                continue
        if reading.state is not S.TrialState.RUNNING:
            metric = reading.metric if reading.metric is not None else trial.metric
            history[i] = trial.model_copy(update={
                "state": reading.state, "metric": metric,
                "message": status.cap(reading.message, S.TRIAL_MESSAGE_MAX_BYTES)})
            search.tell(trial.index, reading.state, metric)
    standing = sweep.standing(spec, history, exhausted=search.exhausted)
    for _ in range(0 if standing.ended else standing.to_start):
        params = search.ask()
        if params is None:
            break
        index = max(trials.next_index(history), max(owned, default=-1) + 1)
        history.append(S.Trial(index=index, name=S.trial_name(parsed.name, index),
                               params=params, state=S.TrialState.RUNNING))
    standing = sweep.standing(spec, history, exhausted=search.exhausted)
    for trial in history:
        if trial.state is S.TrialState.RUNNING and trial.index not in owned:
            await _claim(deps, parsed, trial, history, search)
    if standing.ended:
        _stop_running(history, owned, plan, standing.message.rstrip("."))
        ended = sweep.standing(spec, history, exhausted=search.exhausted)
        standing = dataclasses.replace(standing, counts=ended.counts, best=ended.best)
    plan.create = [t for t in history
                   if t.state is S.TrialState.RUNNING and t.index not in owned]
    _write(new, parsed, history, standing, plan, now=now)


async def _claim(deps: lifecycle.Deps, parsed: S.TrainingSweep, trial: S.Trial,
                 history: list[S.Trial], search: sweep.Search) -> None:
    """A trial about to be created whose name another job holds fails, saying so; its own
    job, unlisted because its labels were edited, gets them back (and is read once listed)."""
    existing = await deps.client.get(kube.Paths.job(parsed.namespace, trial.name))
    if existing is None:
        return
    if trials.owner_uid(existing) == parsed.metadata.uid:
        labels = {S.SWEEP_LABEL: parsed.name, S.TRIAL_LABEL: str(trial.index)}
        have = (existing.get("metadata") or {}).get("labels") or {}
        if any(have.get(k) != v for k, v in labels.items()):
            await deps.client.merge_patch(kube.Paths.job(parsed.namespace, trial.name),
                                          {"metadata": {"labels": labels}})
        return
    message = (f"TrainingJob {trial.name} already exists and is not this sweep's trial; the "
               "trial could not start (delete or rename that job).")
    at = next(i for i, t in enumerate(history) if t.index == trial.index)
    history[at] = trial.model_copy(update={"state": S.TrialState.FAILED, "message": message})
    search.tell(trial.index, S.TrialState.FAILED, None)


def _write(new: dict[str, Any], parsed: S.TrainingSweep, history: list[S.Trial],
           standing: sweep.Standing, plan: _Plan, *, now: float) -> None:
    """The sweep's status from its standing, and the events of what changed."""
    objective = parsed.spec.objective
    old_best = new.get("best") or {}
    new["phase"] = standing.phase.value
    new["trials"] = api.to_wire(standing.counts)
    new["history"] = [api.to_wire(t) for t in history]
    new.setdefault("startTime", status.rfc3339(now))
    if standing.best is not None:
        new["best"] = api.to_wire(standing.best)
        if old_best.get("index") != standing.best.index:
            plan.events.append(("Normal", "NewBestTrial", (
                f"Trial {standing.best.trial} is the best so far: "
                f"{trials.metric_text(objective, standing.best.metric)} with "
                f"{trials.params_text(standing.best.params)}"
                + (f"; zoo model {standing.best.zoo_model}" if standing.best.zoo_model else "")
                + ".")))
    else:  # the provisional best failed since: none stands now, as in a local sweep's status
        new.pop("best", None)
    C = S.SweepConditionType
    trials.set_condition(new, C.CREATED, True, ACCEPTED, (
        f"Accepted: the spec is valid; up to {parsed.spec.trial_budget} trials, "
        f"{parsed.spec.parallel_trials} at once."), now=now)
    if standing.ended:
        succeeded = standing.phase is S.SweepPhase.SUCCEEDED
        trials.set_condition(new, C.RUNNING, False, standing.reason, standing.message, now=now)
        trials.set_condition(new, C.SUCCEEDED if succeeded else C.FAILED, True,
                             standing.reason, standing.message, now=now)
        new["completionTime"] = status.rfc3339(now)
        plan.events.append(("Normal" if succeeded else "Warning", standing.reason,
                            standing.message))
    else:
        trials.set_condition(new, C.RUNNING, standing.counts.running > 0, standing.reason,
                             standing.message, now=now)

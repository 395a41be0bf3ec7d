"""Kueue integration (``--kueue``): Kueue admits a queue-labelled TrainingJob by quota, Kiln
places it within that admission.

Kiln acts as a Kueue external framework: one Workload per job, no placement before Kueue's
admission, PodsReady as its pods become Ready, Finished at the end, pods stopped on eviction.
It never writes Kueue's decisions.
"""

# A Workload moves through Kueue's conditions: QuotaReserved and Admitted (Kueue's scheduler
# sets them with status.admission), Evicted (Kueue wants the job stopped: preemption, an
# inactive Workload, a stopped queue...), Finished (the job's controller, here Kiln, says the
# job ended, and Kueue releases the quota). After an eviction the job's controller stops the
# job and then clears the admission (QuotaReserved=False, no status.admission), which requeues
# the Workload in Kueue. Kiln does each of these steps as Kueue's job reconciler does for its
# built-in integrations. PodsReady (the job's controller says whether all its pods are Ready) is
# what Kueue's waitForPodsReady times: an admitted Workload without PodsReady=True in time is
# evicted with PodsReadyTimeout, and an absent condition counts as not ready.

from __future__ import annotations

import dataclasses
import enum
import hashlib
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import kopf

from kiln import api
from kiln.controller import (
    cluster,
    gates,
    jobs,
    kube,
    lifecycle,
    placement_loop,
    pods,
    profiling,
    settings,
    status,
)

C, R = api.ConditionType, api.Reason
_log = logging.getLogger(__name__)

GROUP = "kueue.x-k8s.io"
# The Workload API versions Kiln speaks, preferred first: v1beta2 (Kueue's storage version from
# v0.16, where v1beta1 is deprecated) and v1beta1 (every release with external frameworks).
VERSIONS = ("v1beta2", "v1beta1")
AUTO = "auto"  # the operator's --kueue-api-version default: the first of VERSIONS served
WORKLOADS = "workloads"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_CLASS_LABEL = "kueue.x-k8s.io/priority-class"  # a WorkloadPriorityClass
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
# The entry of Kueue's `integrations.externalFrameworks` (Kind.version.group).
FRAMEWORK = f"{api.KIND}.{api.VERSION}.{api.GROUP}"
POD_SET = "trainer"
POD_PRIORITY_SOURCE = "scheduling.k8s.io/priorityclass"
WORKLOAD_PRIORITY_SOURCE = "kueue.x-k8s.io/workloadpriorityclass"
# v1beta2 names the class by group and kind (priorityClassRef) where v1beta1 had one source.
PRIORITY_CLASS_REFS = {POD_PRIORITY_SOURCE: ("scheduling.k8s.io", "PriorityClass"),
                       WORKLOAD_PRIORITY_SOURCE: (GROUP, "WorkloadPriorityClass")}
# Kueue's Workload condition types.
QUOTA_RESERVED, ADMITTED, EVICTED, REQUEUED, FINISHED, PODS_READY = (
    "QuotaReserved", "Admitted", "Evicted", "Requeued", "Finished", "PodsReady")
# PodsReady's reasons: False before the pods were first all Ready (WaitForStart) or after one
# stopped being Ready (WaitForRecovery, which Kueue times with its recoveryTimeout); True the
# first time (Started) and after a recovery (Recovered).
WAIT_FOR_START, WAIT_FOR_RECOVERY, STARTED, RECOVERED = (
    "WaitForStart", "WaitForRecovery", "Started", "Recovered")
# Evictions after which Kueue requeues the Workload at once (Requeued=True); after the others
# (an inactive Workload, a stopped queue, a pods-ready timeout) Kueue decides when.
REQUEUED_AT_ONCE = ("Preempted", "NodeFailures")
NAME_PREFIX_MAX = 253 - 6  # room for "-" and a 5-character hash


class State(enum.StrEnum):
    """Where a Workload stands, as far as running its job goes."""

    PENDING = "Pending"  # no admission (yet, or any more): the job must not run
    ADMITTED = "Admitted"  # QuotaReserved and Admitted: Kiln may place it
    EVICTED = "Evicted"  # Kueue wants it stopped; Kiln clears the admission once it is
    FINISHED = "Finished"  # the job ended


@dataclasses.dataclass(frozen=True)
class Priority:
    """The Workload's priority: a PriorityClass or WorkloadPriorityClass and its value."""

    name: str
    source: str
    value: int


def choose_version(served: Sequence[str], setting: str = AUTO) -> tuple[str, str]:
    """The Workload API version to speak, and a warning ("" when none).

    Args:
        served: the versions the API server serves of kueue.x-k8s.io (`served_versions`).
        setting: a version of VERSIONS, or AUTO for the first of them the server serves.
    """
    if setting != AUTO:
        return setting, "" if setting in served else (
            f"{GROUP}/{setting} is not served (served: {', '.join(served) or 'none'}); "
            "Kiln's Workloads are refused until it is")
    found = next((v for v in VERSIONS if v in served), None)
    if found is not None:
        return found, ""
    return VERSIONS[0], (
        f"the API server serves no Workload API of {GROUP} ({' or '.join(VERSIONS)}): is Kueue "
        f"installed? Kiln uses {VERSIONS[0]}; restart the operator once Kueue is installed, "
        "or set --kueue-api-version")


async def served_versions(connection: kopf.ConnectionInfo) -> list[str]:
    """The versions of kueue.x-k8s.io the API server serves (its API group discovery, which
    every authenticated user may read); [] when it serves none or does not say."""
    client = kube.Client(connection)
    try:
        found = await client.get(f"/apis/{GROUP}")
    except kube.ApiError as exc:
        _log.warning("kueue: API discovery of %s failed (%s)", GROUP, exc)
        found = None
    finally:
        await client.close()
    return [str(v.get("version")) for v in (found or {}).get("versions") or []]


@dataclasses.dataclass(frozen=True)
class Paths:
    """URL paths of Kueue's objects in one API `version` (and of PriorityClasses)."""

    version: str

    def workloads(self, namespace: str) -> str:
        return f"/apis/{GROUP}/{self.version}/namespaces/{namespace}/{WORKLOADS}"

    def workload(self, namespace: str, name: str, *, status: bool = False) -> str:
        path = f"{self.workloads(namespace)}/{name}"
        return path + "/status" if status else path

    def flavor(self, name: str) -> str:
        return f"/apis/{GROUP}/{self.version}/resourceflavors/{name}"

    def workload_priority_class(self, name: str) -> str:
        return f"/apis/{GROUP}/{self.version}/workloadpriorityclasses/{name}"

    @staticmethod
    def priority_class(name: str) -> str:
        return f"/apis/scheduling.k8s.io/v1/priorityclasses/{name}"


def queue_name(job: api.TrainingJob) -> str | None:
    """The job's LocalQueue (its kueue.x-k8s.io/queue-name label), or None."""
    return job.metadata.labels.get(QUEUE_LABEL) or None


def workload_name(job_name: str, uid: str) -> str:
    """The Workload's name: ``trainingjob-<job>-<hash of name, uid and kind>``, as Kueue
    names the Workloads of its own integrations (deterministic: a retried create finds it)."""
    digest = hashlib.sha1(f"{job_name}/{uid}/{FRAMEWORK}".encode()).hexdigest()[:5]
    prefix = f"{api.KIND.lower()}-{job_name}"[:NAME_PREFIX_MAX].rstrip("-.")
    return f"{prefix}-{digest}"


def requests(job: api.TrainingJob, *, gpus: int,
             gpu_resource: str = pods.GPU_RESOURCE) -> dict[str, str]:
    """What one trainer pod requests, for Kueue's quota: `gpus` GPUs (as `gpu_resource`) and the
    CPU and memory of spec.template.resources (a limit stands for a missing request, as
    Kubernetes defaults)."""
    resources = job.spec.template.get("resources") or {}
    wanted = {str(k): str(v) for k, v in {**(resources.get("limits") or {}),
                                           **(resources.get("requests") or {})}.items()
              if k != gpu_resource}
    if gpus:
        wanted[gpu_resource] = str(gpus)
    return wanted


def build_workload(owner: Mapping[str, Any], job: api.TrainingJob, *, gpus: int,
                   image: str, priority: Priority | None, active: bool,
                   version: str = VERSIONS[0],
                   gpu_resource: str = pods.GPU_RESOURCE) -> dict[str, Any]:
    """The Workload of `job`: one pod set of its trainer pods (one per node: spec.resources.
    nodes, else one), owned by the job.

    Args:
        owner: the TrainingJob as the API returned it (needs metadata.uid).
        job: the parsed job.
        gpus: GPUs of the whole job to ask Kueue for (0: none), split evenly over its pods.
        image: the trainer image (Kueue ignores it; it keeps the pod template complete).
        priority: the Workload's priority, or None.
        active: False keeps Kueue from admitting it (a suspended job).
        version: the Workload API version (VERSIONS): v1beta2 names the priority class in
            priorityClassRef, v1beta1 in priorityClassName and priorityClassSource.
        gpu_resource: the extended resource the GPUs are requested as (the operator's first
            --gpu-resource).

    Returns:
        A kueue.x-k8s.io/`version` Workload manifest.
    """
    count = job.spec.resources.nodes or 1
    meta = owner.get("metadata") or {}
    uid = str(meta.get("uid") or "")
    template = job.spec.template
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "containers": [{"name": api.CONTAINER_NAME, "image": image,
                        "resources": {"requests": requests(job, gpus=gpus // count,
                                                           gpu_resource=gpu_resource)}}],
    }
    # Kueue matches flavors against the pod's own scheduling constraints.
    for key in ("nodeSelector", "affinity", "tolerations", "priorityClassName"):
        if template.get(key):
            pod_spec[key] = template[key]
    spec: dict[str, Any] = {
        "queueName": queue_name(job),
        "active": active,
        "podSets": [{"name": POD_SET, "count": count,
                     "template": {"metadata": {"labels": {api.JOB_NAME_LABEL: job.name}},
                                  "spec": pod_spec}}],
    }
    if priority is not None and version == "v1beta1":
        spec.update(priorityClassName=priority.name, priorityClassSource=priority.source,
                    priority=priority.value)
    elif priority is not None:
        group, kind = PRIORITY_CLASS_REFS[priority.source]
        spec.update(priorityClassRef={"group": group, "kind": kind, "name": priority.name},
                    priority=priority.value)
    return {
        "apiVersion": f"{GROUP}/{version}",
        "kind": "Workload",
        "metadata": {
            "name": workload_name(job.name, uid),
            "namespace": str(meta.get("namespace") or "default"),
            "labels": {JOB_UID_LABEL: uid, api.JOB_NAME_LABEL: job.name},
            "ownerReferences": [{"apiVersion": f"{api.GROUP}/{api.VERSION}", "kind": api.KIND,
                                 "name": job.name, "uid": uid, "controller": True,
                                 "blockOwnerDeletion": True}],
        },
        "spec": spec,
    }


def _condition(workload: Mapping[str, Any], type_: str) -> dict[str, Any] | None:
    for found in (workload.get("status") or {}).get("conditions") or []:
        if found.get("type") == type_:
            return dict(found)
    return None


def _true(workload: Mapping[str, Any], type_: str) -> bool:
    return (_condition(workload, type_) or {}).get("status") == "True"


def state_of(workload: Mapping[str, Any]) -> State:
    """Where the Workload stands (Finished over Evicted over Admitted over Pending)."""
    if _true(workload, FINISHED):
        return State.FINISHED
    if _true(workload, EVICTED):
        return State.EVICTED
    admission = (workload.get("status") or {}).get("admission")
    if admission and _true(workload, QUOTA_RESERVED) and _true(workload, ADMITTED):
        return State.ADMITTED
    return State.PENDING


def reserved(workload: Mapping[str, Any]) -> bool:
    """Whether Kueue still holds quota for it (QuotaReserved, or an admission)."""
    return _true(workload, QUOTA_RESERVED) or bool(
        (workload.get("status") or {}).get("admission"))


def assignment(workload: Mapping[str, Any]) -> dict[str, Any]:
    """The admission's assignment of the trainer pod set ({} when there is none)."""
    admission = (workload.get("status") or {}).get("admission") or {}
    for found in admission.get("podSetAssignments") or []:
        if found.get("name") == POD_SET:
            return dict(found)
    return {}


def may_profile(st: Mapping[str, Any], workload: Mapping[str, Any]) -> bool:
    """Whether a job's profiling pod may be made now: its profiling waits for quota
    (`profiling.waits_for_quota`) and its Workload is admitted (quota reserved). Before that
    no profiling pod exists, so none runs outside Kueue's quota. A suspended job waits for
    its resumption too (its Workload is being deactivated)."""
    return (profiling.waits_for_quota(st) and not status.is_true(st, C.SUSPENDED)
            and state_of(workload) is State.ADMITTED)


def grant_of(workload: Mapping[str, Any], flavor_labels: Mapping[str, Mapping[str, str]],
             gpu_resources: Sequence[str] = (pods.GPU_RESOURCE,)) -> placement_loop.Grant:
    """Where and with how many GPUs Kiln may place the job Kueue admitted.

    Args:
        workload: an admitted Workload.
        flavor_labels: ResourceFlavor name -> its spec.nodeLabels, for the flavors the
            admission names.
        gpu_resources: the extended resources that count as GPUs (--gpu-resource).

    Returns:
        The union of the admitted flavors' node labels, and the GPUs admitted for the whole
        job, over all its pods and any GPU resource (None when the admission counts none).
    """
    assigned = assignment(workload)
    labels: dict[str, str] = {}
    for flavor in sorted(set((assigned.get("flavors") or {}).values())):
        labels.update(flavor_labels.get(flavor) or {})
    # resourceUsage totals the pod set's `count` pods.
    usage = [value for name, value in (assigned.get("resourceUsage") or {}).items()
             if name in gpu_resources]
    gpus = sum(int(float(str(value))) for value in usage) if usage else None
    return placement_loop.Grant(node_labels=tuple(sorted(labels.items())), gpus=gpus)


def _set(conditions: list[dict[str, Any]], type_: str, value: bool, reason: str, message: str,
         *, now: float, generation: int | None) -> None:
    """Set a Kueue-style condition in `conditions` (its time moves only when status flips)."""
    wanted = "True" if value else "False"
    old = next((c for c in conditions if c.get("type") == type_), None)
    new = {"type": type_, "status": wanted, "reason": reason, "message": message[:32768],
           "lastTransitionTime": (old or {}).get("lastTransitionTime")
           if old is not None and old.get("status") == wanted else status.rfc3339(now)}
    if generation is not None:
        new["observedGeneration"] = generation
    if old is None:
        conditions.append(new)
    else:
        conditions[conditions.index(old)] = new


def pods_ready(workload: Mapping[str, Any], ready: bool) -> tuple[bool, str, str]:
    """The Workload's PodsReady condition (status, reason, message) when every pod of its job's
    current attempt is Ready (`ready`) or not, moving from the condition it has as Kueue's job
    reconciler moves it: not admitted -> WaitForStart; ready -> Started, or Recovered after a
    WaitForRecovery; not ready -> WaitForRecovery once it was ready, else WaitForStart."""
    old = _condition(workload, PODS_READY)
    if state_of(workload) is not State.ADMITTED:
        return False, WAIT_FOR_START, "The job is not admitted, so none of its pods runs."
    if ready:
        recovered = old is not None and old.get("reason") in (WAIT_FOR_RECOVERY, RECOVERED)
        return True, RECOVERED if recovered else STARTED, (
            "Every pod of the job is Ready; the job is running.")
    if old is not None and (old.get("status") == "True" or old.get("reason") == WAIT_FOR_RECOVERY):
        return False, WAIT_FOR_RECOVERY, (
            "A pod of the job stopped being Ready; waiting for all to be Ready again.")
    return False, WAIT_FOR_START, "Not every pod of the job is Ready yet."


def gang_ready(st: Mapping[str, Any], current: Sequence[pods.PodState]) -> bool:
    """Whether every pod of a placed job's current attempt (`current`: one per node of its
    placement) is Ready, or has succeeded."""
    expected = len(status.part(st, "placement", api.PlacementStatus).nodes or []) or 1
    return (not lifecycle.waiting(st) and len(current) >= expected
            and all(p.phase == "Succeeded" or (p.ready and not p.deleting) for p in current))


def pods_ready_patch(workload: Mapping[str, Any], *, ready: bool,
                     now: float) -> dict[str, Any] | None:
    """The status patch that sets PodsReady (`pods_ready`), or None when it says so already."""
    value, reason, message = pods_ready(workload, ready)
    old = _condition(workload, PODS_READY) or {}
    if old.get("status") == ("True" if value else "False") and old.get("reason") == reason:
        return None
    generation = (workload.get("metadata") or {}).get("generation")
    conditions = [dict(c) for c in (workload.get("status") or {}).get("conditions") or []]
    _set(conditions, PODS_READY, value, reason, message, now=now,
         generation=generation if isinstance(generation, int) else None)
    return _status_patch(workload, conditions)


def _status_patch(workload: Mapping[str, Any], conditions: list[dict[str, Any]],
                  **status_fields: Any) -> dict[str, Any]:
    """A merge patch of the Workload's status, guarded by its resourceVersion (a write Kueue
    made meanwhile makes it fail with 409 instead of being overwritten)."""
    meta = workload.get("metadata") or {}
    patch: dict[str, Any] = {"status": {"conditions": conditions, **status_fields}}
    if meta.get("resourceVersion"):
        patch["metadata"] = {"resourceVersion": meta["resourceVersion"]}
    return patch


def release_patch(workload: Mapping[str, Any], *, now: float) -> dict[str, Any]:
    """The status patch that hands an evicted Workload back to Kueue once its job stopped:
    no admission, QuotaReserved=False and Admitted=False, and Requeued as Kueue sets it."""
    evicted = _condition(workload, EVICTED) or {}
    reason = str(evicted.get("reason") or "Evicted")
    message = str(evicted.get("message") or "The workload was evicted")
    generation = (workload.get("metadata") or {}).get("generation")
    generation = generation if isinstance(generation, int) else None
    conditions = [dict(c) for c in (workload.get("status") or {}).get("conditions") or []]
    _set(conditions, REQUEUED, reason in REQUEUED_AT_ONCE, reason, message, now=now,
         generation=generation)
    _set(conditions, QUOTA_RESERVED, False, "Pending", message, now=now, generation=generation)
    _set(conditions, ADMITTED, False, "NoReservation", "The workload has no reservation",
         now=now, generation=generation)
    _set(conditions, PODS_READY, False, WAIT_FOR_START,
         "The job is not admitted, so none of its pods runs.", now=now, generation=generation)
    return _status_patch(workload, conditions, admission=None)


def finish_patch(workload: Mapping[str, Any], *, succeeded: bool, message: str,
                 now: float) -> dict[str, Any]:
    """The status patch that marks a Workload Finished (Kueue then releases its quota)."""
    generation = (workload.get("metadata") or {}).get("generation")
    conditions = [dict(c) for c in (workload.get("status") or {}).get("conditions") or []]
    _set(conditions, FINISHED, True, "Succeeded" if succeeded else "Failed",
         message or ("Job finished successfully" if succeeded else "Job failed"), now=now,
         generation=generation if isinstance(generation, int) else None)
    return _status_patch(workload, conditions)


def waiting_message(job: api.TrainingJob, workload: str) -> str:
    """The Queued message of a job waiting for Kueue."""
    return (f"Waiting for Kueue admission: Workload {workload} in LocalQueue "
            f"{queue_name(job)} has no quota reserved yet; Kiln places the job once Kueue "
            "admits it (kubectl get workload shows why it waits).")


def owner_of(workload: Mapping[str, Any]) -> jobs.JobRef | None:
    """The TrainingJob that owns the Workload, or None for another kind's."""
    meta = workload.get("metadata") or {}
    for ref in meta.get("ownerReferences") or []:
        if ref.get("kind") == api.KIND and ref.get("apiVersion") == f"{api.GROUP}/{api.VERSION}":
            return jobs.JobRef(str(meta.get("namespace") or "default"), str(ref.get("name")))
    return None


class Kueue:
    """The Kueue admission gate (`gates.Gate`): Kueue admits the jobs labelled with a
    LocalQueue, through one Workload each.

    Args:
        client: the API client.
        jobs: the status writer.
        placement: the placement queue (admitted jobs enter it with their grant).
        options: the operator's settings.
        clock: epoch seconds.
        profile: starts the profiling pod of an admitted job whose profiling waited for
            Kueue, within the grant (`admission.profile_admitted`).
    """

    def __init__(self, *, client: kube.Client, jobs: jobs.Jobs,
                 placement: placement_loop.PlacementLoop, options: settings.Options,
                 clock: Callable[[], float],
                 profile: Callable[[jobs.JobRef, placement_loop.Grant], Awaitable[None]]
                 | None = None) -> None:
        self.client = client
        self.profile = profile
        self.jobs = jobs
        self.placement = placement
        self.options = options
        self.clock = clock
        # `run` resolved AUTO by discovery already; a Kueue built without it speaks the newest.
        self.version = (options.kueue_api_version if options.kueue_api_version in VERSIONS
                        else VERSIONS[0])
        self.paths = Paths(self.version)

    def manages(self, job: api.TrainingJob) -> bool:
        """Whether Kueue admits this job: it names a LocalQueue."""
        return queue_name(job) is not None

    def holds(self, entry: placement_loop.Queued) -> bool:
        """Whether a queue entry must wait: a managed job without Kueue's admission."""
        return entry.grant is None and self.manages(entry.job)

    def waiting(self, job: api.TrainingJob, uid: str) -> tuple[api.Reason, str] | None:
        """WaitingForKueue, naming the job's Workload and LocalQueue (None: not managed)."""
        if not self.manages(job):
            return None
        return R.WAITING_FOR_KUEUE, waiting_message(job, workload_name(job.name, uid))

    async def queued(self, body: dict[str, Any], job: api.TrainingJob) -> None:
        """A managed job waits for Kueue: make its Workload (`ensure_workload`)."""
        if self.manages(job):
            await self.ensure_workload(body, job)

    async def suspended(self, ref: jobs.JobRef, suspended: bool) -> None:
        """Follow spec.runPolicy.suspend (`set_active`)."""
        await self.set_active(ref, not suspended)

    def register(self, registry: kopf.OperatorRegistry, wrap: gates.Wrap) -> None:
        """Watch Workloads (`observe`), and the end of queue-labelled jobs (`finish`)."""

        async def workload_event(type: str | None, body: kopf.Body, **_: Any) -> None:
            await self.observe(dict(body), type)

        async def finished_event(type: str | None, body: kopf.Body, **_: Any) -> None:
            if type != "DELETED":
                await self.finish(dict(body))

        def ended(body: kopf.Body, **_: Any) -> bool:
            return status.is_terminal(dict(body.get("status") or {}))

        kopf.on.event(GROUP, self.version, WORKLOADS, registry=registry, id="kueue-workloads")(
            wrap("kueue", workload_event))
        kopf.on.event(api.GROUP, api.VERSION, api.PLURAL, registry=registry, id="kueue-finish",
                      labels={QUEUE_LABEL: kopf.PRESENT}, when=ended)(
            wrap("kueue", finished_event))

    async def ensure_workload(self, body: dict[str, Any],
                              job: api.TrainingJob) -> None:
        """Create the job's Workload if it has none, else act on the one it has (`observe`).

        A cluster without Kueue's Workload API leaves the job queued with a Warning that says so.
        """
        meta = body.get("metadata") or {}
        ref = jobs.JobRef.of(body)
        name = workload_name(job.name, str(meta.get("uid") or ""))
        found = await self.client.get(self.paths.workload(ref.namespace, name))
        if found is not None:
            await self.observe(found, None)
            return
        st = body.get("status") or {}
        gpus = job.spec.resources.gpus
        if gpus is None:  # "auto": the least it runs on; set spec.resources.gpus to ask for more
            nodes = await self.client.list(kube.Paths.nodes())
            gpus = 1 if cluster.pools(nodes, (), cpu_slots=1, now=self.clock()).nodes.get(
                cluster.GPU_POOL) else 0
        priority, problem = await self._priority(job)
        manifest = build_workload(
            body, job, gpus=gpus, image=str(job.spec.template.get("image")
                                             or self.options.default_image),
            priority=priority, active=not status.is_true(st, C.SUSPENDED), version=self.version,
            gpu_resource=self.options.gpu_resources[0])
        try:
            await self.client.create(self.paths.workloads(ref.namespace), manifest)
        except kube.ApiError as exc:
            if exc.status not in (404, 400, 422):
                raise
            problem = (f"the API server refused Workload {name} ({exc}); "
                       + (f"install Kueue (its Workload API {GROUP}/{self.version}) or run the "
                          "operator without --kueue" if exc.status == 404 else
                          "check the job's kueue.x-k8s.io labels and spec.template"))
        if problem:
            await self.jobs.post_event(body, status.Event.warning(R.WAITING_FOR_KUEUE, (
                f"Kueue: {problem}.")))


    async def _priority(self, job: api.TrainingJob
                        ) -> tuple[Priority | None, str]:
        """The Workload's priority, as Kueue's own integrations pick it: the job's
        kueue.x-k8s.io/priority-class label (a WorkloadPriorityClass), else
        spec.runPolicy.priorityClassName (a PriorityClass); and a problem, if the class is
        missing."""
        label = job.metadata.labels.get(PRIORITY_CLASS_LABEL)
        name, source, path = (
            (label, WORKLOAD_PRIORITY_SOURCE, self.paths.workload_priority_class(label)) if label else
            (job.spec.run_policy.priority_class_name, POD_PRIORITY_SOURCE,
             Paths.priority_class(job.spec.run_policy.priority_class_name or "")))
        if not name:
            return None, ""
        found = await self.client.get(path)
        if found is None or not isinstance(found.get("value"), int):
            return None, (f"priority class {name} ({source}) does not exist, so the Workload has "
                          "the default priority; create it, or fix the job's priority class")
        return Priority(name, source, int(found["value"])), ""


    async def observe(self, workload: dict[str, Any],
                      event_type: str | None) -> None:
        """Act on a Workload of a TrainingJob as it changes.

        Admitted -> the job enters Kiln's placement queue with a `placement_loop.Grant` (the
        admitted flavors' node labels, the admitted GPUs). Evicted, or no admission any more ->
        the job is stopped (its pods deleted with the grace period, so the trainer checkpoints)
        and waits again; an evicted Workload whose job has stopped gets its admission cleared,
        which hands it back to Kueue. A deleted Workload of a live job is created again.
        """
        ref = owner_of(workload)
        if ref is None:
            return
        body = await self.jobs.fetch(ref)
        st = (body or {}).get("status") or {}
        if body is None or lifecycle.deleting(body) or status.is_terminal(st):
            return
        try:
            job = lifecycle.parse(body)
        except api.InvalidSpec:
            return
        if not self.manages(job):
            return
        if event_type == "DELETED":
            await self._stop(ref, job, "Its Kueue Workload was deleted; a new one is created "
                             "and the job waits for Kueue to admit it.", evicted=False)
            await self.ensure_workload(body, job)
            return
        state = state_of(workload)
        if state is State.ADMITTED:
            if lifecycle.waiting(st):  # else placed already, or not queued yet (admission ends
                await self._admitted(ref, job, workload)  # with `ensure_workload`: it comes back)
            elif may_profile(st, workload) and self.profile is not None:
                await self.profile(ref, await self._grant(workload))
            await self.pods_ready(body, workload)
        elif state is State.EVICTED:
            evicted = _condition(workload, EVICTED) or {}
            await self._stop(ref, job, (
                f"Kueue evicted Workload {workload['metadata']['name']} "
                f"({evicted.get('reason')}: {evicted.get('message')}); the trainer was asked to "
                "checkpoint and stop, and the job waits for Kueue to admit it again."),
                evicted=True)
            await self.release(ref, workload)
        elif state is State.PENDING:
            why = str((_condition(workload, QUOTA_RESERVED) or {}).get("message") or "")
            await self._stop(ref, job, waiting_message(job, workload["metadata"]["name"])
                        + (f" Kueue: {why}" if why else ""), evicted=False)


    async def _admitted(self, ref: jobs.JobRef, job: api.TrainingJob,
                        workload: dict[str, Any]) -> None:
        """Queue an admitted job for placement within its grant (once)."""
        if ref in self.placement:
            return
        flavors = sorted(set((assignment(workload).get("flavors") or {}).values()))
        grant = await self._grant(workload)
        cluster_queue = ((workload.get("status") or {}).get("admission") or {}).get("clusterQueue")
        now = self.clock()
        async with self.jobs.edit(ref) as e:
            if e.body is None or not lifecycle.waiting(e.status):
                return
            where = (f"nodes labelled {dict(grant.node_labels)}" if grant.node_labels
                     else "any node")
            held_gpus = f"at most {grant.gpus} GPU(s)" if grant.gpus is not None else "no GPUs"
            e.condition(C.QUEUED, True, R.ADMITTED_BY_KUEUE, (
                f"Kueue admitted Workload {workload['metadata']['name']} (ClusterQueue "
                f"{cluster_queue}, flavor(s) {', '.join(flavors) or 'none'}); Kiln places it on "
                f"{where} with {held_gpus}."), now=now, event="Normal")
            await e.commit()
            if e.body is not None:
                self.placement.add(dataclasses.replace(
                    lifecycle.queued_entry(e.body, job, now=now), grant=grant))


    async def _grant(self, workload: dict[str, Any]) -> placement_loop.Grant:
        """The admitted Workload's grant (`grant_of`), its flavors read from the API."""
        labels: dict[str, dict[str, str]] = {}
        for flavor in sorted(set((assignment(workload).get("flavors") or {}).values())):
            found = await self.client.get(self.paths.flavor(flavor))
            labels[flavor] = dict(((found or {}).get("spec") or {}).get("nodeLabels") or {})
        return grant_of(workload, labels, self.options.gpu_resources)

    async def _stop(self, ref: jobs.JobRef, job: api.TrainingJob, message: str,
                    *, evicted: bool) -> None:
        """Take the job out of placement and stop its trainer; it waits for Kueue again
        (Queued=True: the pod events of its stopping trainer then change nothing)."""
        now = self.clock()
        reason = R.EVICTED_BY_KUEUE if evicted else R.WAITING_FOR_KUEUE
        async with self.jobs.edit(ref) as e:
            if (lifecycle.deleting(e.body) or status.is_terminal(e.status)
                    or status.is_true(e.status, C.SUSPENDED) or e.body is None):
                return
            self.placement.remove(ref)
            active = status.is_true(e.status, C.PLACED)
            if profiling.running(e.status):  # within the admission: it waits for the next
                e.condition(C.PROFILED, None, R.WAITING_FOR_KUEUE, message + (
                    " Its profiling pod was stopped; it runs again once Kueue admits the job."),
                    now=now, event="Warning" if evicted else None)
            elif not active and not status.is_true(e.status, C.QUEUED):
                return  # not admitted by Kiln yet: admission queues it, held for Kueue
            else:
                for type_ in (C.RUNNING, C.PLACED, C.RESTARTING):
                    if status.is_true(e.status, type_):
                        e.condition(type_, False, reason, message, now=now)
                e.condition(C.QUEUED, True, reason, message, now=now,
                            event="Warning" if evicted and active else None)
            if active:
                e.status.pop("startTime", None)  # the deadline clock stops while evicted
            await e.commit()
            # The profiling pod too: it runs within the admission.
            names = [p.name for p in await lifecycle.job_pod_states(self.client, ref)
                     if p.active]
            for name in names:
                await self.client.delete(kube.Paths.pod(ref.namespace, name),
                                        grace_period_seconds=self.options.termination_grace_seconds)


    async def release(self, ref: jobs.JobRef, workload: dict[str, Any]) -> None:
        """Clear an evicted Workload's admission once none of its job's trainers runs (a pod
        being deleted still holds its devices while its trainer checkpoints)."""
        if state_of(workload) is not State.EVICTED or not reserved(workload):
            return
        if any(not p.finished for p in await lifecycle.job_pod_states(self.client, ref)):
            return  # `pod_event` comes back when they are gone
        name = workload["metadata"]["name"]
        try:
            await self.client.merge_patch(self.paths.workload(ref.namespace, name, status=True),
                                          release_patch(workload, now=self.clock()))
        except kube.ApiError as exc:
            if exc.status != 409:
                raise
            _log.info("kueue: Workload %s/%s changed meanwhile; its next event retries",
                      ref.namespace, name)


    async def pod_event(self, pod: dict[str, Any], event_type: str | None) -> None:
        """A trainer or profiling pod of a Kueue-managed job changed: write its admitted
        Workload's PodsReady (`pods_ready`); if the pod stopped or vanished, hand its evicted
        Workload back to Kueue if it was the last active one."""
        state = pods.pod_state(pod)
        namespace = str((pod.get("metadata") or {}).get("namespace") or "")
        if not state.job or not namespace:
            return
        ref = jobs.JobRef(namespace, state.job)
        found = await self._managed(ref)
        if found is None:
            return
        body, workload = found
        await self.pods_ready(body, workload)  # only while admitted: `release` only once evicted
        if event_type == "DELETED" or state.finished:
            await self.release(ref, workload)


    async def pods_ready(self, body: dict[str, Any], workload: dict[str, Any]) -> None:
        """Write an admitted Workload's PodsReady condition as its job's current pods stand."""
        st = body.get("status") or {}
        if state_of(workload) is not State.ADMITTED or status.is_terminal(st):
            return  # Kueue reads PodsReady of admitted Workloads only; Finished follows the end
        trainers = [p for p in await lifecycle.current_pods(self.client, body)
                    if p.attempt >= 0]  # a profiling pod has no attempt: it is not the gang
        ready = not lifecycle.waiting(st) and gang_ready(st, trainers)
        patch = pods_ready_patch(workload, ready=ready, now=self.clock())
        if patch is None:
            return
        name = workload["metadata"]["name"]
        try:
            await self.client.merge_patch(
                self.paths.workload(str(workload["metadata"].get("namespace") or "default"), name,
                               status=True), patch)
        except kube.ApiError as exc:
            if exc.status != 409:
                raise
            _log.info("kueue: Workload %s changed meanwhile; its next event writes PodsReady",
                      name)


    async def _managed(self, ref: jobs.JobRef) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """A Kueue-managed job and its Workload (None: the job is gone, unmanaged or has
        none)."""
        body = await self.jobs.fetch(ref)
        if body is None:
            return None
        try:
            job = lifecycle.parse(body)
        except api.InvalidSpec:
            return None
        if not self.manages(job):
            return None
        uid = str((body.get("metadata") or {}).get("uid") or "")
        workload = await self.client.get(
            self.paths.workload(ref.namespace, workload_name(job.name, uid)))
        return None if workload is None else (body, workload)


    async def _workload_of(self, ref: jobs.JobRef) -> dict[str, Any] | None:
        """The Workload of a Kueue-managed job (None: the job is gone, unmanaged or has none)."""
        found = await self._managed(ref)
        return None if found is None else found[1]


    async def finish(self, body: dict[str, Any]) -> None:
        """Mark a finished job's Workload Finished (once), so Kueue releases its quota."""
        ref = jobs.JobRef.of(body)
        st = body.get("status") or {}
        if not status.is_terminal(st):
            return
        workload = await self._workload_of(ref)
        if workload is None or state_of(workload) is State.FINISHED:
            return
        succeeded = status.is_true(st, C.SUCCEEDED)
        ended = status.condition(st, C.SUCCEEDED if succeeded else C.FAILED)
        try:
            await self.client.merge_patch(
                self.paths.workload(ref.namespace, workload["metadata"]["name"], status=True),
                finish_patch(workload, succeeded=succeeded, message=ended.message if ended else "",
                             now=self.clock()))
        except kube.ApiError as exc:
            if exc.status != 409:
                raise


    async def set_active(self, ref: jobs.JobRef, active: bool) -> None:
        """Follow spec.runPolicy.suspend: a suspended job's Workload is inactive (Kueue evicts it
        and releases its quota), a resumed one active again (Kueue queues it)."""
        workload = await self._workload_of(ref)
        if workload is not None and (workload.get("spec") or {}).get("active", True) != active:
            await self.client.merge_patch(
                self.paths.workload(ref.namespace, workload["metadata"]["name"]),
                {"spec": {"active": active}})

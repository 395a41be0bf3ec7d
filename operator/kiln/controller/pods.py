"""Trainer pods as data: the pod a placed job runs in, and what a pod says about its trainer.

`build_pod` writes the pod for one attempt of a job; `pod_state` reads one back. No API calls.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Mapping
from typing import Any, cast

import kopf

from kiln import api, contract
from kiln.zoo import records, sources

NODE_ANNOTATION = "kiln.dev/node"
GPUS_ANNOTATION = "kiln.dev/gpus"
PARALLELISM_ANNOTATION = "kiln.dev/parallelism"
DEVICE_ANNOTATION = "kiln.dev/device"
ESTIMATED_SECONDS_ANNOTATION = "kiln.dev/estimated-seconds"
STARTED_ANNOTATION = "kiln.dev/started-epoch-seconds"
KUEUE_LABEL_PREFIX = "kueue.x-k8s.io/"
KILN_PREFIX = f"{api.GROUP}/"  # of the labels and annotations Kiln puts on its pods
GPU_RESOURCE = "nvidia.com/gpu"
HOSTNAME_LABEL = "kubernetes.io/hostname"
METRICS_PORT_NAME = "metrics"
# --zoo-pod-access presigned: the job's Secret of presigned URLs, mounted read-only.
ZOO_ACCESS_VOLUME = "kiln-zoo-access"
ZOO_ACCESS_URI = (f"{contract.ZOO_ACCESS_SCHEME}:{contract.ZOO_ACCESS_DIR}/"
                  f"{contract.ZOO_ACCESS_FILE}")
SCRAPE_PORT_ANNOTATION = "prometheus.io/port"

FINISHED_PHASES = ("Succeeded", "Failed")
# The pod condition Kubernetes adds before it ends a pod for a reason outside the pod:
# preemption, an eviction (API or node pressure), a taint or a drain, pod garbage collection.
DISRUPTION_TARGET = "DisruptionTarget"
# Waiting reasons of a container that is still being set up (not stuck, unless for too long).
STARTING_REASONS = frozenset({"ContainerCreating", "PodInitializing"})
# spec.activeDeadlineSeconds the operator sets to stop a pod it keeps: the kubelet then stops
# the containers (SIGTERM, SIGKILL after the grace period) and leaves the pod object, Failed
# with reason DeadlineExceeded, for its logs. Counted from the pod's start, so 1 is "now".
STOP_DEADLINE_SECONDS = 1
# Default security contexts of trainer pods: non-root without a fixed uid (the image's numeric
# USER, or the uid OpenShift assigns from the namespace's range), so both Pod Security
# "restricted" and OpenShift's restricted-v2 SCC admit the pod unchanged.
POD_SECURITY_CONTEXT: Mapping[str, Any] = {
    "runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY_CONTEXT: Mapping[str, Any] = {
    "runAsNonRoot": True, "allowPrivilegeEscalation": False, "privileged": False,
    "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}


@dataclasses.dataclass(frozen=True)
class PodSettings:
    """Operator-wide pod settings: the pod builder's slice of `kiln.controller.settings.Options`
    (`settings.pod_settings` makes it; no defaults here).

    Attributes:
        default_image: trainer image when spec.template.image is not set.
        image_pull_policy: default imagePullPolicy.
        zoo_uri: zoo store URI for the trainer, e.g. s3://kiln-zoo.
        zoo_endpoint: S3 endpoint for the trainer, or None.
        zoo_secret: name of a Secret in the job's namespace holding the zoo credentials, or
            None (anonymous, or a directory zoo).
        zoo_secret_access_key: key of the access key in that Secret.
        zoo_secret_secret_key: key of the secret key in that Secret.
        zoo_secret_session_token: key of an optional session token in that Secret (temporary
            credentials).
        zoo_share: who sees a job's registered model when its spec.zoo.share is unset:
            ``private`` (its namespace) or ``shared`` (every namespace).
        zoo_pod_access: ``presigned``: an s3:// zoo is reached through the job's
            ``<job>-zoo-access`` Secret of presigned URLs (`zoo_access`), mounted read-only,
            and pods get no zoo credential; ``credentials``: through `zoo_secret`.
        metrics_port: the trainer's Prometheus port inside the pod.
        termination_grace_seconds: how long a deleted pod's trainer has to checkpoint.
        pod_security_context: the pod's securityContext unless spec.template sets
            podSecurityContext.
        container_security_context: the trainer container's securityContext, under
            spec.template.securityContext (the job's keys win).
        service_account: service account of trainer pods, or None for the namespace default.
        kueue_labels: copy the job's ``kueue.x-k8s.io/*`` labels onto its pods; False under
            --kueue, where the job's Workload stands for them (a queue-name label on a pod
            would let Kueue's pod integration gate it as a second workload).
    """

    default_image: str
    zoo_uri: str
    image_pull_policy: str
    zoo_endpoint: str | None
    zoo_secret: str | None
    zoo_secret_access_key: str
    zoo_secret_secret_key: str
    zoo_secret_session_token: str
    zoo_share: str
    zoo_pod_access: str
    metrics_port: int
    termination_grace_seconds: int
    pod_security_context: Mapping[str, Any]
    container_security_context: Mapping[str, Any]
    service_account: str | None
    kueue_labels: bool

    @property
    def presigned_zoo(self) -> bool:
        """Whether pods reach the zoo through their job's presigned URLs only."""
        return self.zoo_pod_access == "presigned" and self.zoo_uri.startswith("s3://")


@dataclasses.dataclass(frozen=True)
class Launch:
    """Where and how the plan runs one attempt.

    Attributes:
        node: the planned node.
        devices: GPUs (device "gpu") or CPU slots (device "cpu") held on it.
        parallelism: "single", "ddp" or "fsdp".
        device: "gpu" or "cpu".
        warm_start: the warm-start decision made at admission; the trainer applies it.
        estimated_seconds: the plan's duration estimate.
        started: epoch seconds when the attempt was launched.
        gpu_resource: the extended resource the node's GPUs are (`cluster.gpu_resource_of`),
            which the trainer container's limits ask for.
        peer_nodes: the other nodes of a job spanning several, rank order after `node`
            (`devices` on each; `kiln.controller.gang` builds their pods).
    """

    node: str
    devices: int
    parallelism: str
    device: str
    warm_start: api.WarmStartDecision
    estimated_seconds: float
    started: float
    gpu_resource: str = GPU_RESOURCE
    peer_nodes: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Waiting:
    """A container that has not started, as the kubelet reports it.

    Attributes:
        container: the container's name.
        reason: the kubelet's waiting reason (ImagePullBackOff, CreateContainerConfigError...).
        message: the kubelet's words ("" when none).
        image: the container's image (from the pod's spec, else its status).
        init: whether it is an init container.
    """

    container: str
    reason: str
    message: str
    image: str
    init: bool = False


@dataclasses.dataclass(frozen=True)
class PodState:
    """What a pod says about its trainer.

    Attributes:
        name: pod name.
        job: the job it belongs to (kiln.dev/job-name label).
        attempt: the attempt number (kiln.dev/attempt label), -1 when unreadable.
        phase: Pending, Running, Succeeded, Failed or Unknown.
        node: spec.nodeName, else the planned node, else None.
        pod_ip: status.podIP or None.
        devices: devices held (kiln.dev/gpus annotation).
        device: "gpu" or "cpu" (kiln.dev/device annotation).
        parallelism: kiln.dev/parallelism annotation.
        estimated_seconds: the plan's estimate for the attempt.
        started: epoch seconds the attempt was launched, or None.
        exit_code: the trainer container's exit code once terminated, else None.
        container_reason: its terminated reason (Completed, Error, OOMKilled, ...).
        message: its termination message ("" when none).
        metrics_port: port of the trainer's /metrics (prometheus.io/port), or None.
        deleting: the pod has a deletionTimestamp.
        waiting: the first container (init containers first) waiting for another reason than
            `STARTING_REASONS`, or None.
        starting: the first container still being set up (`STARTING_REASONS`), or None.
        unschedulable: the scheduler's message while PodScheduled is False/Unschedulable,
            else None.
        pod_reason: status.reason of the pod (DeadlineExceeded, Evicted...), or None.
        owner_uid: the uid of the TrainingJob that controls it (its controller
            ownerReference), or None: tells a pod of a deleted job from one of a new job of
            the same name.
        ready: its Ready condition is True.
        disruption: "<reason>: <message>" of its DisruptionTarget=True condition (the pod was
            preempted, evicted or drained), or None.
    """

    name: str
    job: str
    attempt: int
    phase: str
    node: str | None
    pod_ip: str | None
    devices: int
    device: str
    parallelism: str
    estimated_seconds: float
    started: float | None
    exit_code: int | None
    container_reason: str | None
    message: str
    metrics_port: int | None
    deleting: bool
    waiting: Waiting | None = None
    starting: Waiting | None = None
    unschedulable: str | None = None
    pod_reason: str | None = None
    owner_uid: str | None = None
    ready: bool = False
    disruption: str | None = None

    @property
    def finished(self) -> bool:
        return self.phase in FINISHED_PHASES

    @property
    def active(self) -> bool:
        """Still holding its devices: not finished and not being deleted."""
        return not self.finished and not self.deleting


def zoo_access_secret(job_name: str) -> str:
    """The name of the Secret holding `job_name`'s presigned zoo access."""
    return f"{job_name}-zoo-access"


def pod_name(job_name: str, attempt: int) -> str:
    """The deterministic name of `job_name`'s trainer pod for `attempt` (0-based)."""
    return f"{job_name}-trainer-{attempt}"


def build_pod(owner: Mapping[str, Any], job: api.TrainingJob, *, attempt: int, launch: Launch,
              settings: PodSettings) -> dict[str, Any]:
    """The pod for one attempt of `job`.

    Named ``<job>-trainer-<attempt>`` (deterministic, so a retried create finds the pod it
    made) and owned by the job (`kopf.adopt`); image from ``spec.template.image`` or the
    operator's default; GPU limits (``launch.gpu_resource``) and a required node affinity
    from the plan; the trainer's command and environment from `kiln.contract`; labels
    ``kiln.dev/job-name``, ``kiln.dev/attempt`` and the job's ``kueue.x-k8s.io/*`` (not
    under --kueue);
    Prometheus scrape annotations; the operator's security contexts (by default non-root without a fixed uid, no privilege
    escalation, all capabilities dropped, seccomp RuntimeDefault: OpenShift's restricted SCC
    and the Pod Security "restricted" level admit it).
    ``spec.template`` (checked by `api.validate`) adds to this: an own image, command and args
    (run instead of Kiln's trainer, with Kiln's environment), env and envFrom (never KILN_*:
    Kiln's values win, and Kubernetes puts env above envFrom), volumes and volumeMounts beside
    Kiln's /dev/shm, init containers, the pod's podSecurityContext (instead of the operator's),
    the trainer container's securityContext (merged over the operator's), resources, scheduling keys, labels and annotations.

    Args:
        owner: the TrainingJob object as the API returned it (needs metadata.uid).
        job: the parsed job.
        attempt: 0-based attempt number (restarts and resumptions each add one).
        launch: the plan's node, devices and parallelism, and the warm-start parent.
        settings: operator-wide pod settings.

    Returns:
        A v1 Pod manifest, owned by `owner`.
    """
    template = job.spec.template
    labels = {
        api.JOB_NAME_LABEL: job.name,
        api.ATTEMPT_LABEL: str(attempt),
        "app.kubernetes.io/name": "kiln-trainer",
        "app.kubernetes.io/managed-by": "kiln-operator",
        **{k: v for k, v in job.metadata.labels.items() if k.startswith(KUEUE_LABEL_PREFIX)},
        **_not_kilns(template.get("labels")),
    }
    labels[api.JOB_NAME_LABEL], labels[api.ATTEMPT_LABEL] = job.name, str(attempt)
    annotations = {
        **_not_kilns(template.get("annotations")),
        "prometheus.io/scrape": "true",
        SCRAPE_PORT_ANNOTATION: str(settings.metrics_port),
        "prometheus.io/path": "/metrics",
        NODE_ANNOTATION: launch.node,
        GPUS_ANNOTATION: str(launch.devices),
        PARALLELISM_ANNOTATION: launch.parallelism,
        DEVICE_ANNOTATION: launch.device,
        ESTIMATED_SECONDS_ANNOTATION: f"{launch.estimated_seconds:.1f}",
        STARTED_ANNOTATION: f"{launch.started:.3f}",
    }
    pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": pod_name(job.name, attempt), "labels": labels,
                     "annotations": annotations},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": settings.termination_grace_seconds,
            "securityContext": copy.deepcopy(dict(
                template.get("podSecurityContext") or settings.pod_security_context)),
            "affinity": _affinity(template.get("affinity"), launch.node),
            "containers": [_container(job, launch, settings)],
            "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}},
                        *copy.deepcopy(template.get("volumes") or [])],
        },
    }
    if settings.presigned_zoo:  # the manifest `zoo_access` signs; only the operator writes it
        pod["spec"]["volumes"].append({"name": ZOO_ACCESS_VOLUME, "secret": {
            "secretName": zoo_access_secret(job.name), "defaultMode": 0o444}})
    spec = pod["spec"]
    uid = str((owner.get("metadata") or {}).get("uid") or "")
    if uid:  # the one record the job's trainer registers, and its result may name
        spec["containers"][0]["env"].append({"name": contract.Env.ZOO_RECORD.value, "value": (
            records.job_record_id(job.spec.model.label, uid))})
    if template.get("initContainers"):
        spec["initContainers"] = copy.deepcopy(template["initContainers"])
    _add_initializer(job, spec)
    for key in ("nodeSelector", "tolerations", "priorityClassName", "schedulerName",
                "imagePullSecrets"):
        if key in template:
            spec[key] = copy.deepcopy(template[key])
    account = template.get("serviceAccountName") or settings.service_account
    if account:
        spec["serviceAccountName"] = account
    kopf.adopt(pod, owner=cast(kopf.Body, dict(owner)))  # owner reference, namespace, the job's labels
    # After adopt, which copies every label of the job: kiln.dev/* labels route and describe
    # Kiln's pods, so only Kiln's own reach them (admission refuses the job's, but labels can
    # be added later); kueue.x-k8s.io/* ones not under --kueue.
    pod["metadata"]["labels"] = {
        k: v for k, v in pod["metadata"]["labels"].items()
        if (k in (api.JOB_NAME_LABEL, api.ATTEMPT_LABEL) or not k.startswith(KILN_PREFIX))
        and (settings.kueue_labels or not k.startswith(KUEUE_LABEL_PREFIX))}
    return pod


SOURCES_VOLUME = "kiln-sources"
SOURCE_CACHE_VOLUME = "kiln-source-cache"
SECRET_VOLUME_PREFIX = "kiln-secret-"


def _add_initializer(job: api.TrainingJob, spec: dict[str, Any]) -> None:
    """Give a pod whose job downloads sources (`sources.job_sources`) Kiln's initializer: an
    init container of the trainer's image, with the trainer's environment (the job, the zoo's
    endpoint and credentials), that fetches them into the cache and writes the manifest the
    trainer reads.

    The manifest lives in an emptyDir both containers mount at `contract.SOURCES_DIR`; the
    cache beside it, or in spec.initializer.cacheClaim's volume at `contract.SOURCE_CACHE_DIR`
    (shared across pods and jobs: entries are named by content). Each secretRef's Secret is
    mounted in the initializer alone, at ``SECRETS_DIR/<name>``.
    """
    found = sources.job_sources(job.spec)
    if not found:
        return
    trainer = spec["containers"][0]
    claim = job.spec.initializer.cache_claim
    cache = contract.SOURCE_CACHE_DIR if claim else f"{contract.SOURCES_DIR}/cache"
    shared = [{"name": SOURCES_VOLUME, "mountPath": contract.SOURCES_DIR}]
    spec["volumes"].append({"name": SOURCES_VOLUME, "emptyDir": {}})
    if claim:
        shared.append({"name": SOURCE_CACHE_VOLUME, "mountPath": contract.SOURCE_CACHE_DIR})
        spec["volumes"].append({"name": SOURCE_CACHE_VOLUME,
                                "persistentVolumeClaim": {"claimName": claim}})
    secrets = sorted({secret for _, _, secret in found if secret})
    mounts = [{"name": f"{SECRET_VOLUME_PREFIX}{i}", "readOnly": True,
               "mountPath": f"{contract.SECRETS_DIR}/{name}"} for i, name in enumerate(secrets)]
    spec["volumes"] += [{"name": f"{SECRET_VOLUME_PREFIX}{i}",
                         "secret": {"secretName": name, "defaultMode": 0o400}}
                        for i, name in enumerate(secrets)]
    manifest = {"name": contract.Env.SOURCES.value,
                "value": f"{contract.SOURCES_DIR}/{contract.SOURCES_MANIFEST}"}
    trainer["volumeMounts"] += [{**m, "readOnly": True} for m in shared]
    trainer["env"].append(manifest)
    if claim:  # the manifest's paths lie in the claim; the env names the mount it reads
        trainer["env"].append({"name": contract.Env.DATA_CACHE.value, "value": cache})
    kept = {contract.Env.JOB, contract.Env.ZOO_ENDPOINT, contract.Env.ZOO_ACCESS_KEY,
            contract.Env.ZOO_SECRET_KEY, contract.Env.ZOO_SESSION_TOKEN}
    spec.setdefault("initContainers", []).append({
        "name": contract.INITIALIZER_CONTAINER,
        "image": trainer["image"],
        "imagePullPolicy": trainer["imagePullPolicy"],
        "command": contract.initializer_command(python="python"),
        "env": [copy.deepcopy(e) for e in trainer["env"] if e["name"] in kept] + [
            manifest, {"name": contract.Env.DATA_CACHE.value, "value": cache},
            {"name": contract.Env.SECRETS_DIR.value, "value": contract.SECRETS_DIR},
            {"name": "PYTHONUNBUFFERED", "value": "1"}],
        "securityContext": copy.deepcopy(trainer["securityContext"]),
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": copy.deepcopy(shared) + mounts,
    })


def _not_kilns(keys: Mapping[str, Any] | None) -> dict[str, Any]:
    """A template's labels or annotations without kiln.dev/* ones (Kiln's)."""
    return {k: v for k, v in (keys or {}).items() if not str(k).startswith(KILN_PREFIX)}


def _container(job: api.TrainingJob, launch: Launch, settings: PodSettings) -> dict[str, Any]:
    template = job.spec.template
    resources = copy.deepcopy(template.get("resources") or {})
    if launch.device == "gpu":
        resources.setdefault("limits", {})[launch.gpu_resource] = str(launch.devices)
    container: dict[str, Any] = {
        "name": api.CONTAINER_NAME,
        "image": template.get("image") or settings.default_image,
        "imagePullPolicy": template.get("imagePullPolicy") or settings.image_pull_policy,
        # An own command runs instead of Kiln's trainer, with the same environment, so a loop
        # using kiln_trainer as a library finds its job, zoo and metrics port.
        "command": list(template.get("command") or _command(launch)),
        "env": _env(job, launch, settings),
        "ports": [{"name": METRICS_PORT_NAME, "containerPort": settings.metrics_port,
                   "protocol": "TCP"}],
        "resources": resources,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {
            **copy.deepcopy(dict(settings.container_security_context)),
            **copy.deepcopy(template.get("securityContext") or {}),
        },
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"},
                         *copy.deepcopy(template.get("volumeMounts") or [])],
    }
    if settings.presigned_zoo:
        container["volumeMounts"].append({"name": ZOO_ACCESS_VOLUME, "readOnly": True,
                                          "mountPath": contract.ZOO_ACCESS_DIR})
    if template.get("args"):
        container["args"] = list(template["args"])
    if template.get("envFrom"):
        container["envFrom"] = copy.deepcopy(template["envFrom"])
    return container


def _command(launch: Launch) -> list[str]:
    """``python -m kiln_trainer``, under torchrun with ``--parallelism`` for several devices."""
    processes = max(1, launch.devices)  # one worker process per GPU (or CPU slot)
    argv = [contract.Flag.PARALLELISM.value, launch.parallelism] if processes > 1 else []
    return contract.trainer_command(processes, argv, python="python")  # the image's python


def _env(job: api.TrainingJob, launch: Launch, settings: PodSettings) -> list[dict[str, Any]]:
    """The trainer's settings (`kiln.contract.Env`); zoo credentials only as secretKeyRef."""
    # The uid tells this job from a later one of the same name (its checkpoint's key).
    meta = {"name": job.name, "namespace": job.metadata.namespace, "uid": job.metadata.uid}
    wire = {"apiVersion": api.API_VERSION, "kind": api.KIND,
            "metadata": {k: v for k, v in meta.items() if v},
            "spec": api.to_wire(job.spec)}
    env: list[dict[str, Any]] = [
        {"name": contract.Env.JOB.value, "value": json.dumps(wire, separators=(",", ":"))},
        {"name": contract.Env.ZOO.value, "value": ZOO_ACCESS_URI if settings.presigned_zoo
         else settings.zoo_uri},
        {"name": contract.Env.METRICS_PORT.value, "value": str(settings.metrics_port)},
        {"name": contract.Env.WARM_START.value,
         "value": launch.warm_start.model_dump_json()},
        {"name": contract.Env.PARALLELISM.value, "value": launch.parallelism},
        {"name": contract.Env.DEVICES.value, "value": str(launch.devices)},
        {"name": contract.Env.ZOO_SHARE.value, "value": settings.zoo_share},
        {"name": contract.Env.TRAINER_IMAGE.value,
         "value": job.spec.template.get("image") or settings.default_image},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    if settings.zoo_endpoint:  # presigned URLs carry it, but s3:// datasets read it too
        env.append({"name": contract.Env.ZOO_ENDPOINT.value, "value": settings.zoo_endpoint})
    if settings.zoo_secret and not settings.presigned_zoo:
        for name, key in ((contract.Env.ZOO_ACCESS_KEY.value, settings.zoo_secret_access_key),
                          (contract.Env.ZOO_SECRET_KEY.value, settings.zoo_secret_secret_key)):
            env.append({"name": name, "valueFrom": {"secretKeyRef": {
                "name": settings.zoo_secret, "key": key}}})
        env.append({"name": contract.Env.ZOO_SESSION_TOKEN.value, "valueFrom": {"secretKeyRef": {
            "name": settings.zoo_secret, "key": settings.zoo_secret_session_token,
            "optional": True}}})  # present only with temporary credentials
    # api.validate refuses KILN_* names in the template, so a user's env only adds variables
    # (or replaces PYTHONUNBUFFERED).
    overrides = [dict(e) for e in job.spec.template.get("env") or []]
    names = {e.get("name") for e in overrides}
    return [e for e in env if e["name"] not in names] + overrides


def _affinity(template_affinity: Any, node: str) -> dict[str, Any]:
    """The template's affinity with a required ``kubernetes.io/hostname In [node]`` ANDed in."""
    affinity = copy.deepcopy(template_affinity) if isinstance(template_affinity, dict) else {}
    pin = {"key": HOSTNAME_LABEL, "operator": "In", "values": [node]}
    node_affinity = affinity.setdefault("nodeAffinity", {})
    required = node_affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.get("nodeSelectorTerms") or [{}]
    for term in terms:
        term.setdefault("matchExpressions", []).append(pin)
    required["nodeSelectorTerms"] = terms
    return affinity


def planned_node(pod: Mapping[str, Any]) -> str | None:
    """spec.nodeName once scheduled, else the node the plan pinned it to."""
    spec = pod.get("spec") or {}
    if spec.get("nodeName"):
        return str(spec["nodeName"])
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    return annotations.get(NODE_ANNOTATION)


def rank_of(pod: Mapping[str, Any]) -> int:
    """A trainer pod's rank (its kiln.dev/rank label); 0 for one-node jobs' pods and
    unreadable labels."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    try:
        return max(0, int(labels.get(api.RANK_LABEL, 0)))
    except (TypeError, ValueError):
        return 0


def pod_state(pod: Mapping[str, Any]) -> PodState:
    """Read a trainer pod: phase, node, IP, the trainer container's exit code, reason and
    termination message, and why it has not started yet (waiting containers, scheduling)."""
    meta = pod.get("metadata") or {}
    labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
    status = pod.get("status") or {}
    terminated = _terminated(status)
    waiting = _waiting(pod)
    return PodState(
        name=str(meta.get("name", "")),
        job=str(labels.get(api.JOB_NAME_LABEL, "")),
        attempt=_int(labels.get(api.ATTEMPT_LABEL), -1),
        phase=str(status.get("phase") or "Pending"),
        node=planned_node(pod),
        pod_ip=status.get("podIP") or None,
        devices=_int(annotations.get(GPUS_ANNOTATION), 1),
        device=str(annotations.get(DEVICE_ANNOTATION, "gpu")),
        parallelism=str(annotations.get(PARALLELISM_ANNOTATION, "single")),
        estimated_seconds=_float(annotations.get(ESTIMATED_SECONDS_ANNOTATION), 0.0),
        started=_float(annotations.get(STARTED_ANNOTATION), None),
        exit_code=_int(terminated.get("exitCode"), None) if terminated else None,
        container_reason=terminated.get("reason") if terminated else None,
        message=str(terminated.get("message") or "") if terminated else "",
        metrics_port=_int(annotations.get(SCRAPE_PORT_ANNOTATION), None),
        deleting=bool(meta.get("deletionTimestamp")),
        waiting=next((w for w in waiting if w.reason not in STARTING_REASONS), None),
        starting=next((w for w in waiting if w.reason in STARTING_REASONS), None),
        unschedulable=_unschedulable(status),
        pod_reason=status.get("reason") or None,
        owner_uid=next((str(o["uid"]) for o in meta.get("ownerReferences") or []
                        if isinstance(o, dict) and o.get("controller") and o.get("uid")), None),
        ready=any(c.get("type") == "Ready" and c.get("status") == "True"
                  for c in _conditions(status)),
        disruption=next((f"{c.get('reason') or DISRUPTION_TARGET}: {c.get('message') or ''}"
                         .rstrip(": ") for c in _conditions(status)
                         if c.get("type") == DISRUPTION_TARGET and c.get("status") == "True"),
                        None),
    )


def stop_patch() -> dict[str, Any]:
    """The merge patch that has the kubelet stop a pod's containers but keep the pod."""
    return {"spec": {"activeDeadlineSeconds": STOP_DEADLINE_SECONDS}}


def _waiting(pod: Mapping[str, Any]) -> list[Waiting]:
    """Every waiting container, init containers first, with its image."""
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    found = []
    for init, statuses, containers in (
            (True, status.get("initContainerStatuses"), spec.get("initContainers")),
            (False, status.get("containerStatuses"), spec.get("containers"))):
        images = {c.get("name"): c.get("image") for c in containers or []}
        for container in statuses or []:
            waiting = (container.get("state") or {}).get("waiting")
            if not isinstance(waiting, dict) or not waiting.get("reason"):
                continue
            name = str(container.get("name") or "")
            found.append(Waiting(
                container=name, reason=str(waiting["reason"]),
                message=str(waiting.get("message") or ""),
                image=str(images.get(name) or container.get("image") or ""), init=init))
    return found


def _conditions(status: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [c for c in status.get("conditions") or [] if isinstance(c, dict)]


def _unschedulable(status: Mapping[str, Any]) -> str | None:
    for condition in _conditions(status):
        if (condition.get("type") == "PodScheduled" and condition.get("status") == "False"
                and condition.get("reason") == "Unschedulable"):
            return str(condition.get("message") or "no node fits the pod")
    return None


def _terminated(status: Mapping[str, Any]) -> dict[str, Any]:
    """The trainer container's terminated state; else a failed init container's (the pod
    fails with it, and its termination message says why, as the trainer's would)."""
    for container in status.get("containerStatuses") or []:
        if container.get("name") == api.CONTAINER_NAME:
            state = container.get("state") or {}
            if state.get("terminated"):
                return dict(state["terminated"])
    for container in status.get("initContainerStatuses") or []:
        ended = (container.get("state") or {}).get("terminated") or {}
        if _int(ended.get("exitCode"), 0) != 0:
            return dict(ended)
    return {}


def _int(value: Any, default: Any) -> Any:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _float(value: Any, default: Any) -> Any:
    try:
        return float(value)
    except (TypeError, ValueError):
        return default

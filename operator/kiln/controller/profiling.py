"""The profiling pod: a model measured in the job's own image before placement.

The operator never imports user code, so ``python -m kiln_trainer --profile`` runs in the job's
image to trace the model's graph, count its FLOPs and parameters, time a step on one device and
decide its warm start; a built-in model is profiled too on a GPU type it has no measurement
of. Here: the pod, the device it borrows, and reading what it reports.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kiln import api, contract
from kiln.controller import cluster, pods, status
from kiln.placement import profilecache
from kiln.warmstart import select

if TYPE_CHECKING:
    from kiln.placement import estimate  # imports torch: `measurement` imports it when used

ROLE_LABEL = "kiln.dev/role"
ROLE = "profile"
# The GPU type (`types.Node.device_type`) a built-in model's profiling pod measures.
DEVICE_TYPE_ANNOTATION = "kiln.dev/profile-device-type"


def needed(job: api.TrainingJob) -> bool:
    """Whether the job's model is user code (spec.model.entrypoint): the operator cannot build
    it, so only a profiling pod can measure it."""
    return job.spec.model.entrypoint is not None


def builtin_on_gpus(job: api.TrainingJob) -> bool:
    """Whether the job trains a built-in model and may use GPUs: a profile measured on the GPU
    type it would run on replaces the operator's own estimate (`estimate.configs`)."""
    return job.spec.model.entrypoint is None and job.spec.resources.gpus != 0


def cache_key(job: api.TrainingJob, device_type: str) -> str:
    """The profile cache key: the job's namespace, its model and batch, and the GPU type.

    Per namespace: a profile is measured in the job's own image, which may report anything,
    so it is reused only by jobs of the same namespace (`cacheable`).
    """
    return job.namespace + "/" + profilecache.cache_key(
        job.spec.model, batch_size=job.spec.training.batch_size, parallelism="single", gpus=1,
        kind=device_type)


def cacheable(profile: contract.Profile) -> bool:
    """Whether later jobs may reuse `profile`: a step that was timed. Out of memory is no
    fact about the model: a busy or MIG-sliced GPU runs out too, so the next job measures
    again."""
    return profile.step_status == "ok" and profile.step_seconds is not None


def waits_for_quota(st: Mapping[str, Any]) -> bool:
    """Whether the job's profiling waits for its admission gate to reserve quota
    (Profiled=Unknown, WaitingForKueueAdmission): no profiling pod may exist until it does."""
    found = status.condition(st, api.ConditionType.PROFILED)
    return (found is not None and found.status == "Unknown" and not status.is_terminal(st)
            and found.reason == api.Reason.WAITING_FOR_KUEUE.value)


def running(st: Mapping[str, Any]) -> bool:
    """Whether the job's profiling pod was made and has not reported (Profiled=Unknown, not
    waiting for quota)."""
    found = status.condition(st, api.ConditionType.PROFILED)
    return (found is not None and found.status == "Unknown" and not status.is_terminal(st)
            and found.reason != api.Reason.WAITING_FOR_KUEUE.value)


def pod_name(job_name: str) -> str:
    """The deterministic name of a job's profiling pod."""
    return f"{job_name}-profile"


def is_profiling_pod(pod: Mapping[str, Any]) -> bool:
    """Whether `pod` is a profiling pod (by its kiln.dev/role label)."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return bool(labels.get(ROLE_LABEL) == ROLE)


@dataclasses.dataclass(frozen=True)
class Device:
    """What the profiling pod borrows: one free GPU or CPU slot on `node`, or nothing pinned
    (`node` None: the scheduler picks a node and the step is timed on its CPU)."""

    node: str | None
    device: str  # "gpu" or "cpu"
    devices: int  # 1, or 0 when nothing is held
    gpu_resource: str = pods.GPU_RESOURCE  # the resource the node's GPUs are


def choose_device(pools: cluster.Pools, job: api.TrainingJob,
                  device_type: str | None = None, *,
                  among: frozenset[str] | None = None, gpus_left: int | None = None) -> Device:
    """The device the profiling pod times its step on.

    The pool the job itself would run in (GPUs when it may use them); there, the node with the
    most free devices (of GPU type `device_type` when given; among the nodes its scheduling
    constraints allow, `among`, when given), holding one of them so the
    planner counts it busy. With none free, or no GPU left in the namespace's quota
    (`gpus_left`: what --namespace-gpu-quota leaves it; None: no quota), the pod holds nothing
    and times the step on a CPU: the graph, FLOPs and parameter count still replace the
    nominal estimate, and the running trainer's throughput refines it later.
    """
    pool = pools.pool_for(job.spec.resources.gpus != 0, among=among)
    if pool == cluster.GPU_POOL and gpus_left is not None and gpus_left < 1:
        pool = None
    if pool is not None:
        free = sorted(((pools.free_devices(pool, n.name), n.name) for n in pools.nodes[pool]
                       if (device_type is None or n.device_type == device_type)
                       and (among is None or n.name in among)),
                      key=lambda pair: (-pair[0], pair[1]))
        if free and free[0][0] >= 1:
            node = free[0][1]
            return Device(node, "gpu" if pool == cluster.GPU_POOL else "cpu", 1,
                          pools.gpu_resource.get(node, pods.GPU_RESOURCE))
    return Device(None, "cpu", 0)


def build_pod(owner: Mapping[str, Any], job: api.TrainingJob, device: Device, *,
              settings: pods.PodSettings, timeout_seconds: float, now: float,
              device_type: str | None = None,
              node_labels: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The profiling pod of `job`: the trainer pod's image, environment, volumes and security
    settings (`pods.build_pod`), running ``python -m kiln_trainer --profile`` instead of the
    trainer or an own command, under ``activeDeadlineSeconds`` = `timeout_seconds`, with no
    warm-start decision (it makes one), the kiln.dev/role=profile label and, when it measures
    a GPU type for the cluster's profile cache, that type (`DEVICE_TYPE_ANNOTATION`). Holding
    nothing, it goes where the scheduler puts it among nodes with `node_labels` (an admission
    gate's grant)."""
    launch = pods.Launch(node=device.node or "", devices=device.devices, parallelism="single",
                         device=device.device,
                         warm_start=select.cold_start(api.WarmStartOutcome.IN_TRAINER, ""),
                         estimated_seconds=timeout_seconds, started=now,
                         gpu_resource=device.gpu_resource)
    pod = pods.build_pod(owner, job, attempt=0, launch=launch, settings=settings)
    meta, spec = pod["metadata"], pod["spec"]
    meta["name"] = pod_name(job.name)
    meta["labels"].pop(api.ATTEMPT_LABEL, None)
    meta["labels"][ROLE_LABEL] = ROLE
    meta["annotations"]["prometheus.io/scrape"] = "false"  # it serves no metrics
    if device_type is not None:
        meta["annotations"][DEVICE_TYPE_ANNOTATION] = device_type
    if device.node is None:  # nothing held: let the scheduler place it
        del meta["annotations"][pods.NODE_ANNOTATION]
        affinity = job.spec.template.get("affinity")
        if affinity:
            spec["affinity"] = copy.deepcopy(affinity)
        else:
            spec.pop("affinity", None)
        if node_labels:
            spec["nodeSelector"] = {**(spec.get("nodeSelector") or {}), **node_labels}
    spec["activeDeadlineSeconds"] = max(1, int(timeout_seconds))
    container = spec["containers"][0]
    container["command"] = contract.trainer_command(1, [contract.Flag.PROFILE], python="python")
    container.pop("args", None)
    container["env"] = [e for e in container["env"] if e["name"] != contract.Env.WARM_START]
    return pod


def read(state: pods.PodState) -> contract.Profile | contract.Failure | None:
    """The profiling pod's report: its Profile, its Failure, or None (none readable).

    Raises:
        ValueError: a profile or error event with fields missing or of the wrong type, or
            a profile whose warm-start decision is malformed (the message names the field).
    """
    event = contract.from_line(state.message)
    return event if isinstance(event, contract.Profile | contract.Failure) else None


def to_status(profile: contract.Profile) -> api.ProfileStatus:
    """``status.profile`` for a profile: its fields that `api.ProfileStatus` declares."""
    wire = profile.to_json()  # non-finite numbers as None
    return api.ProfileStatus.model_validate(
        {name: wire[name] for name in api.ProfileStatus.model_fields})


def measurement(profile: api.ProfileStatus | None) -> estimate.ModelMeasurement | None:
    """The placement estimate's input from ``status.profile`` (None without one)."""
    if profile is None or profile.parameters is None:
        return None
    from kiln.placement import estimate

    return estimate.ModelMeasurement(
        parameters=profile.parameters,
        flops_per_sample=_positive(profile.flops_per_sample),
        device_type=profile.device or "cpu",
        batch_size=profile.batch_size or 0,
        step_seconds=_positive(profile.step_seconds) if profile.step_status == "ok" else None,
        out_of_memory=profile.step_status == "oom")


def summary(profile: contract.Profile, pod: str) -> str:
    """One sentence with the numbers, for the Profiled condition and its event."""
    parts = [f"{profile.parameters:,} parameters"]
    if profile.flops_per_sample is not None:
        parts.append(f"{profile.flops_per_sample / 1e6:,.1f} MFLOPs per sample")
    parts.append(f"a graph of {profile.graph_nodes} nodes" if profile.graph_nodes is not None
                 else f"no graph ({profile.untraceable or 'untraceable'}: the job starts cold)")
    if profile.step_status == "ok" and profile.step_seconds is not None:
        parts.append(f"{profile.step_seconds * 1000:,.1f} ms per step at batch "
                     f"{profile.batch_size} on {profile.device}")
    elif profile.step_status == "oom":
        parts.append(f"batch {profile.batch_size} does not fit one device ({profile.device})")
    else:
        parts.append(f"no step timing ({profile.step_detail or profile.step_status})")
    return f"Profiled in pod {pod}: " + ", ".join(parts) + "."


def _positive(value: float | None) -> float | None:
    return value if value is not None and value > 0 else None

"""The cluster as the planner sees it: device pools, free devices, jobs already running.

Pure functions of listed Node and Pod objects: no API calls, no planning.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kiln import api
from kiln.controller import pods
from kiln.placement import types

GPU_POOL = "gpu"
CPU_POOL = "cpu"
# A running job whose estimate has run out still holds its devices until it ends; the planner
# is told it needs at least this much longer.
MIN_REMAINING_SECONDS = 5.0


@dataclasses.dataclass(frozen=True)
class Pools:
    """Device pools and who holds what.

    Attributes:
        nodes: pool name -> planner nodes with their usable device counts.
        running: pool name -> Kiln jobs holding devices there.
        used: (pool, node) -> devices held by active Kiln pods.
        gpu_resource: GPU node -> the extended resource its GPUs are (nvidia.com/gpu,
            amd.com/gpu, nvidia.com/mig-1g.10gb...): what a pod there asks for.
    """

    nodes: dict[str, tuple[types.Node, ...]]
    running: dict[str, tuple[types.Running, ...]]
    used: dict[tuple[str, str], int]
    gpu_resource: dict[str, str] = dataclasses.field(default_factory=dict)

    def free_devices(self, pool: str, node: str) -> int:
        """Devices of `node` in `pool` not held by an active Kiln pod.

        Checked before a planned start: a job starts when it reaches the head of its node's
        queue and its devices are free.
        """
        capacity = next((n.gpus for n in self.nodes.get(pool, ()) if n.name == node), 0)
        return capacity - self.used.get((pool, node), 0)

    def held_gpus(self, namespace: str) -> int:
        """GPUs the namespace's active Kiln pods hold (trainer and profiling pods alike)."""
        return sum(r.gpus for r in self.running.get(GPU_POOL, ()) if r.namespace == namespace)

    def pool_for(self, wants_gpus: bool, among: frozenset[str] | None = None) -> str | None:
        """The pool a job runs in: GPUs when it wants them and there are GPU nodes, else CPU;
        counting only the nodes in `among` when given (those its constraints allow)."""
        def has(pool: str) -> bool:
            return any(among is None or n.name in among for n in self.nodes.get(pool, ()))

        if wants_gpus and has(GPU_POOL):
            return GPU_POOL
        if has(CPU_POOL):
            return CPU_POOL
        return GPU_POOL if has(GPU_POOL) else None


@dataclasses.dataclass(frozen=True)
class GpuType:
    """The GPU type Kiln places jobs on: node label `label` must equal `value`."""

    value: str
    label: str = "nvidia.com/gpu.product"

    def matches(self, node: Mapping[str, Any]) -> bool:
        """Whether `node` (a v1 Node) carries this GPU type's label value."""
        labels = (node.get("metadata") or {}).get("labels") or {}
        return bool(labels.get(self.label) == self.value)


def job_key(namespace: str, name: str) -> str:
    """The planner's job name: ``namespace/name`` (unique across the cluster)."""
    return f"{namespace}/{name}"


def pools(
    node_objects: Iterable[Mapping[str, Any]],
    pod_objects: Iterable[Mapping[str, Any]],
    *,
    cpu_slots: int,
    now: float,
    eta_seconds: Mapping[str, float] | None = None,
    gpu_type: GpuType | None = None,
    gpu_type_label: str = "nvidia.com/gpu.product",
    gpu_resources: Sequence[str] = (pods.GPU_RESOURCE,),
) -> Pools:
    """The pools of a cluster.

    A node that is Ready, schedulable and has allocatable GPUs (`gpu_resource_of`) joins the
    "gpu" pool with its GPUs minus those requested by pods Kiln does not own (other workloads); with
    `gpu_type` set, only GPU nodes whose GPU-type label equals it do (other GPU nodes join no
    pool). A GPU node's `gpu_type_label` value becomes its `types.Node.device_type`
    (`estimate.gpu_device_type`; "" without the label), so the planner can pick the GPU type
    a job runs fastest on. A node without GPUs joins the "cpu" pool with `cpu_slots` slots: CPU-only clusters
    are valid, and a CPU job holds one slot and runs single-process. Kiln's own active trainer
    pods become `types.Running` entries (pinned by the planner) with the remaining seconds
    their plan estimated, refined by the trainer's reported ETA.

    Args:
        node_objects: v1 Node objects.
        pod_objects: v1 Pod objects of all namespaces: Kiln's, and at least the active ones
            of other workloads on GPU nodes (`listing.placement_pods`).
        cpu_slots: slots per GPU-less node.
        now: epoch seconds (the planner's clock).
        eta_seconds: job key -> seconds left as the trainer last reported.
        gpu_type: the only GPU type Kiln places on (None: any).
        gpu_type_label: the node label naming a node's GPU product.
        gpu_resources: the extended resources that count as GPUs (`gpu_resource_of`).
    """
    eta_seconds = eta_seconds or {}
    gpu_nodes: dict[str, int] = {}
    gpu_types: dict[str, str] = {}
    resource_of: dict[str, str] = {}
    cpu_nodes: list[str] = []
    for node in node_objects:
        if not _usable(node):
            continue
        name = str(node["metadata"]["name"])
        resource = gpu_resource_of(node, gpu_resources)
        gpus = _quantity((node.get("status") or {}).get("allocatable", {}).get(resource))
        if resource and gpus > 0:
            if gpu_type is None or gpu_type.matches(node):
                gpu_nodes[name] = gpus
                resource_of[name] = resource
                product = ((node.get("metadata") or {}).get("labels") or {}).get(
                    gpu_type_label)
                gpu_types[name] = ""
                if product:  # (estimate imports torch: a GPU node's operator needs it anyway)
                    from kiln.placement import estimate

                    gpu_types[name] = estimate.gpu_device_type(str(product))
        else:
            cpu_nodes.append(name)
    foreign_gpus: dict[str, int] = {}
    used: dict[tuple[str, str], int] = {}
    running: dict[str, list[types.Running]] = {GPU_POOL: [], CPU_POOL: []}
    for pod in pod_objects:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        if ((pod.get("status") or {}).get("phase") in pods.FINISHED_PHASES
                or meta.get("deletionTimestamp")):
            continue
        if api.JOB_NAME_LABEL not in labels:
            bound = str((pod.get("spec") or {}).get("nodeName") or "")
            if bound in gpu_nodes:
                foreign_gpus[bound] = foreign_gpus.get(bound, 0) + _requested_gpus(
                    pod, resource_of[bound])
            continue
        state = pods.pod_state(pod)
        pool = CPU_POOL if state.device == "cpu" else GPU_POOL
        if state.node is None or state.devices <= 0:  # a profiling pod that holds no device
            continue
        used[(pool, state.node)] = used.get((pool, state.node), 0) + state.devices
        key = job_key(str(meta.get("namespace", "")), state.job)
        rank = pods.rank_of(pod)  # a multi-node job holds devices on each of its nodes
        running[pool].append(types.Running(
            job=f"{key}#{rank}" if rank else key, node=state.node, gpus=state.devices,
            parallelism=state.parallelism,
            remaining_seconds=_remaining(state, now, eta_seconds.get(key)),
            namespace=str(meta.get("namespace", ""))))
    nodes = {
        GPU_POOL: tuple(types.Node(n, max(0, g - foreign_gpus.get(n, 0)), gpu_types[n])
                        for n, g in sorted(gpu_nodes.items())),
        CPU_POOL: tuple(types.Node(n, cpu_slots) for n in sorted(cpu_nodes)),
    }
    return Pools(nodes={k: v for k, v in nodes.items() if v},
                 running={k: tuple(v) for k, v in running.items()}, used=used,
                 gpu_resource=resource_of)


def gpu_resource_of(node: Mapping[str, Any], gpu_resources: Sequence[str]) -> str:
    """The first of `gpu_resources` that `node` (a v1 Node) has allocatable, "" for none.

    A node offers one kind of GPU device in practice (whole GPUs, or with the MIG "mixed"
    strategy MIG slices, or AMD GPUs); the operator's --gpu-resource order breaks a tie.
    """
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    return next((r for r in gpu_resources if _quantity(allocatable.get(r)) > 0), "")


def gpu_node_names(node_objects: Iterable[Mapping[str, Any]],
                   gpu_resources: Sequence[str] = (pods.GPU_RESOURCE,)) -> list[str]:
    """Names of the Ready, schedulable nodes with allocatable GPUs (any of `gpu_resources`):
    where other workloads' pods can take GPUs from the pools."""
    return [str(node["metadata"]["name"]) for node in node_objects
            if _usable(node) and gpu_resource_of(node, gpu_resources)]


def _remaining(state: pods.PodState, now: float, eta: float | None) -> float:
    if eta is not None:
        return max(MIN_REMAINING_SECONDS, eta)
    elapsed = now - state.started if state.started is not None else 0.0
    return max(MIN_REMAINING_SECONDS, state.estimated_seconds - elapsed)


def _usable(node: Mapping[str, Any]) -> bool:
    if (node.get("spec") or {}).get("unschedulable"):
        return False
    for condition in (node.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Ready":
            return bool(condition.get("status") == "True")
    return True  # no Ready condition reported: assume usable


def _requested_gpus(pod: Mapping[str, Any], resource: str) -> int:
    total = 0
    for container in (pod.get("spec") or {}).get("containers") or []:
        resources = container.get("resources") or {}
        value = (resources.get("limits") or {}).get(resource) or (
            resources.get("requests") or {}).get(resource)
        total += _quantity(value)
    return total


def _quantity(value: Any) -> int:
    """A whole-device resource quantity ("4", 4); 0 when absent or unreadable."""
    try:
        return int(str(value)) if value is not None else 0
    except ValueError:
        return 0

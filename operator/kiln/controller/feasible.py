"""Which nodes can run a job's trainer pod, by the rules the Kubernetes scheduler applies.

Pure functions of listed Node and Pod objects: nodeSelector, required node affinity,
NoSchedule/NoExecute taints, cordoned or not-Ready nodes, and CPU/memory requests against
allocatable minus what the pods already there request. No API calls, no planning.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from decimal import Decimal
from typing import Any

from kiln import api
from kiln.controller import pods

# Nodes named per reason in a message; the rest are counted.
NAMED_NODES = 3
MESSAGE_MAX_CHARS = 1024  # events are capped at 1 KiB
_SINGULAR = {"are ": "is ", "do not ": "does not ", "have ": "has "}


@dataclasses.dataclass(frozen=True)
class Fit:
    """The nodes a job may run on now, and why each other node may not.

    Attributes:
        nodes: names of the nodes that pass every rule.
        barred: node name -> the first rule it fails, in words ("does not match nodeSelector
            gpu=a100").
    """

    nodes: frozenset[str]
    barred: Mapping[str, str]

    def among(self, names: Iterable[str]) -> Fit:
        """This fit restricted to the nodes called `names` (e.g. the GPU nodes)."""
        wanted = set(names)
        return Fit(self.nodes & wanted, {n: w for n, w in self.barred.items() if n in wanted})

    def reason(self) -> str:
        """Why no node can run the job, grouping the nodes by the first rule they fail, e.g.
        "2 nodes do not match nodeSelector gpu=a100 (a, b); 1 node has taint
        dedicated=ml:NoSchedule not tolerated (c); change spec.template ..."."""
        by_reason: dict[str, list[str]] = {}
        for node, why in sorted(self.barred.items()):
            by_reason.setdefault(why, []).append(node)
        parts = []
        for why, names in sorted(by_reason.items(), key=lambda item: (-len(item[1]), item[0])):
            shown = ", ".join(names[:NAMED_NODES]) + (
                f" and {len(names) - NAMED_NODES} more" if len(names) > NAMED_NODES else "")
            if len(names) == 1:  # the reasons are worded for several nodes
                why = next((one + why[len(many):] for many, one in _SINGULAR.items()
                            if why.startswith(many)), why)
            parts.append(f"{len(names)} node{'s' if len(names) > 1 else ''} {why} ({shown})")
        if not parts:
            return "the cluster has no Ready, schedulable node"
        text = "; ".join(parts) + (
            "; change spec.template (nodeSelector, affinity, tolerations, resources) or the "
            "nodes (labels, taints, cordons)")
        return text if len(text) <= MESSAGE_MAX_CHARS else text[:MESSAGE_MAX_CHARS - 3] + "..."


def requested(pod: Mapping[str, Any]) -> dict[str, Decimal]:
    """CPU (cores) and memory (bytes) a pod requests, as the scheduler counts them: the larger
    of its containers' sum and any one init container (a limit alone counts as the request),
    plus its overhead. Unreadable quantities count as 0."""
    spec = pod.get("spec") or {}

    def of(container: Any) -> dict[str, Decimal]:
        resources = (container.get("resources") or {}) if isinstance(container, dict) else {}
        amounts = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
        return {r: _quantity(amounts.get(r)) for r in api.REQUESTED_RESOURCES}

    total = {r: Decimal(0) for r in api.REQUESTED_RESOURCES}
    for container in spec.get("containers") or []:
        for r, amount in of(container).items():
            total[r] += amount
    for container in spec.get("initContainers") or []:
        for r, amount in of(container).items():
            total[r] = max(total[r], amount)
    overhead = spec.get("overhead") or {}
    return {r: amount + _quantity(overhead.get(r)) for r, amount in total.items()}


def used(pod_objects: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Decimal]]:
    """Node name -> CPU and memory requested by the pods bound (or, Kiln's, pinned) to it that
    are neither finished nor being deleted."""
    found: dict[str, dict[str, Decimal]] = {}
    for pod in pod_objects:
        meta = pod.get("metadata") or {}
        if ((pod.get("status") or {}).get("phase") in pods.FINISHED_PHASES
                or meta.get("deletionTimestamp")):
            continue
        node = pods.planned_node(pod)
        if not node:
            continue
        here = found.setdefault(node, {})
        for r, amount in requested(pod).items():
            here[r] = here.get(r, Decimal(0)) + amount
    return found


def fit(scheduling: api.Scheduling, node_objects: Iterable[Mapping[str, Any]],
        used_by_node: Mapping[str, Mapping[str, Decimal]]) -> Fit:
    """The nodes `scheduling` lets the job's pod run on now.

    A node passes when it is schedulable (not cordoned) and Ready, carries every nodeSelector
    label, meets a required node affinity term (In, NotIn, Exists, DoesNotExist, Gt, Lt; or
    matchFields on its name), has no NoSchedule or NoExecute taint the job does not tolerate,
    and has room for its CPU and memory requests: allocatable minus `used_by_node` (a node
    that does not report a resource is not limited by it).

    Args:
        scheduling: the job's constraints (`api.scheduling_of(spec.template)`).
        node_objects: v1 Node objects.
        used_by_node: node -> resources already requested there (`used`).
    """
    ok: set[str] = set()
    barred: dict[str, str] = {}
    for node in node_objects:
        meta = node.get("metadata") or {}
        name = str(meta.get("name", ""))
        why = _barred(scheduling, node, name, meta.get("labels") or {},
                      used_by_node.get(name, {}))
        if why is None:
            ok.add(name)
        else:
            barred[name] = why
    return Fit(frozenset(ok), barred)


def _barred(scheduling: api.Scheduling, node: Mapping[str, Any], name: str,
            labels: Mapping[str, str], used_here: Mapping[str, Decimal]) -> str | None:
    """The first rule `node` fails for the job, in words; None when it passes all."""
    spec, status = node.get("spec") or {}, node.get("status") or {}
    if spec.get("unschedulable"):
        return "are cordoned (spec.unschedulable)"
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    if ready is not None and ready.get("status") != "True":
        return "are not Ready"
    missing = scheduling.selector_misses(labels)
    if missing:
        return f"do not match nodeSelector {', '.join(missing)}"
    if not scheduling.affinity_matches(name, labels):
        terms = " or ".join("(" + " and ".join(map(str, t)) + ")" for t in scheduling.node_terms)
        return f"do not match the required node affinity {terms}"
    taints = scheduling.untolerated(spec.get("taints"))
    if taints:
        return f"have taint {', '.join(taints)} not tolerated"
    allocatable = status.get("allocatable") or {}
    for resource, amount in scheduling.requests:
        if resource not in allocatable or amount <= 0:
            continue
        total = _quantity(allocatable[resource])
        free = total - used_here.get(resource, Decimal(0))
        if amount > free:
            return (f"have too little {resource} free for its request {_show(resource, amount)} "
                    f"(free {_show(resource, max(free, Decimal(0)))} of "
                    f"{_show(resource, total)} allocatable)")
    return None


def _show(resource: str, amount: Decimal) -> str:
    if resource == "memory":
        return f"{float(amount) / 2**30:.3g}Gi"
    return f"{float(amount):.3g}"


def _quantity(value: Any) -> Decimal:
    if value is None:
        return Decimal(0)
    try:
        return api.parse_quantity(value)
    except ValueError:
        return Decimal(0)

"""The API calls the operator makes, as least-privilege RBAC rules. Makes no API calls.

The e2e tests check `RULES` against the calls the API emulator records; the Helm chart's roles
are checked against both.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kiln import api


@dataclasses.dataclass(frozen=True)
class Rule:
    """One RBAC rule: a resource of an API group and the verbs allowed on it."""

    group: str
    resource: str
    verbs: tuple[str, ...]


# Every (verb, group, resource) the operator sends, through kopf or `kiln.controller.kube`.
RULES: tuple[Rule, ...] = (
    # kopf watches and patches (finalizer, progress annotations); the status writer reads;
    # the TTL deletes.
    Rule(api.GROUP, api.PLURAL, ("get", "list", "watch", "create", "patch", "delete")),
    Rule(api.GROUP, f"{api.PLURAL}/status", ("patch",)),  # every status change
    # TrainingSweeps (`kiln.controller.sweeps`): kopf watches them, the reconcile reads one and
    # writes its status; it creates the trial jobs (above) and suspends pruned ones (patch).
    Rule(api.GROUP, api.sweep.SWEEP_PLURAL, ("get", "list", "watch")),
    Rule(api.GROUP, f"{api.sweep.SWEEP_PLURAL}/status", ("patch",)),
    # The runtime a new job's spec.runtimeRef names, read once at admission
    # (`kiln.controller.runtimes`).
    Rule(api.GROUP, api.runtime.RUNTIME_PLURAL, ("get",)),
    Rule(api.GROUP, api.runtime.CLUSTER_RUNTIME_PLURAL, ("get",)),
    # Trainer pods; the placement loop lists all namespaces' pods for free GPUs; a pod kept by
    # cleanPodPolicy is stopped by patching its spec.activeDeadlineSeconds.
    Rule("", "pods", ("get", "list", "watch", "create", "patch", "delete")),
    Rule("", "nodes", ("list",)),  # allocatable GPUs and CPU slots
    Rule("", "events", ("create",)),  # one per condition change worth telling
    # A multi-node job's headless Service (its pods' DNS names); owned by the job, so the
    # garbage collector deletes it.
    Rule("", "services", ("create",)),
    # Each job's <job>-zoo-access Secret of presigned zoo URLs (`zoo_access`): created, and
    # patched when signed again; owned by the job, so the garbage collector deletes it.
    Rule("", "secrets", ("create", "patch")),
)
# Not calls: what the API server's OwnerReferencesPermissionEnforcement admission plugin (on in
# OpenShift) checks when an object the operator creates names its owner with
# blockOwnerDeletion: true, as `kopf.adopt` sets for trainer pods, Services and Secrets, and
# the operator for Workloads (owned by their TrainingJob) and trial jobs (by their
# TrainingSweep). The chart grants them with `RULES`.
OWNER_REFERENCE_RULES: tuple[Rule, ...] = (
    Rule(api.GROUP, f"{api.PLURAL}/finalizers", ("update",)),
    Rule(api.GROUP, f"{api.sweep.SWEEP_PLURAL}/finalizers", ("update",)),
)
# Needed cluster-wide even when only some namespaces are watched: nodes and
# ClusterTrainingRuntimes are cluster-scoped,
# and the placement loop lists Kiln's pods (by label) and other pods on each GPU node (by
# field selector) in all namespaces to know which GPUs are free (`kiln.controller.listing`).
CLUSTER_WIDE_RULES: tuple[Rule, ...] = (
    Rule("", "nodes", ("list",)),
    Rule("", "pods", ("list",)),
    Rule(api.GROUP, api.runtime.CLUSTER_RUNTIME_PLURAL, ("get",)),  # cluster-scoped
)
# Only with --kueue (`kiln.controller.kueue`): each Kueue-managed job's Workload (kopf watches
# them; the status patch marks Finished or hands an evicted one back), and the cluster-scoped
# objects its admission and priority name.
KUEUE_RULES: tuple[Rule, ...] = (
    Rule("kueue.x-k8s.io", "workloads", ("get", "list", "watch", "create", "patch")),
    Rule("kueue.x-k8s.io", "workloads/status", ("patch",)),
    Rule("kueue.x-k8s.io", "resourceflavors", ("get",)),
    Rule("kueue.x-k8s.io", "workloadpriorityclasses", ("get",)),
    Rule("scheduling.k8s.io", "priorityclasses", ("get",)),
)
# Of those, the cluster-scoped objects (a ClusterRole even when only some namespaces are
# watched).
KUEUE_CLUSTER_RULES: tuple[Rule, ...] = KUEUE_RULES[2:]
# Only with --peering (the chart's replicaCount above 1): kopf watches and patches the peering
# object, and the placement loop reads it (`kiln.controller.leadership`). Cluster-wide: one
# ClusterKopfPeering; with --namespace: a KopfPeering in each watched namespace.
PEERING_CLUSTER_RULES: tuple[Rule, ...] = (
    Rule("kopf.dev", "clusterkopfpeerings", ("get", "list", "watch", "patch")),)
PEERING_NAMESPACED_RULES: tuple[Rule, ...] = (
    Rule("kopf.dev", "kopfpeerings", ("get", "list", "watch", "patch")),)
# Only when a --namespace is a glob: kopf then scans namespaces.
NAMESPACE_SCANNING_RULES: tuple[Rule, ...] = (Rule("", "namespaces", ("list", "watch")),)


def triples(rules: tuple[Rule, ...] = RULES) -> set[tuple[str, str, str]]:
    """(group, resource, verb) for every verb of every rule."""
    return {(r.group, r.resource, verb) for r in rules for verb in r.verbs}


def cluster_role(name: str = "kiln-operator", *, namespace_globs: bool = False
                 ) -> dict[str, Any]:
    """A ClusterRole manifest granting exactly `RULES` and `OWNER_REFERENCE_RULES` (plus
    namespace scanning if asked)."""
    rules = RULES + OWNER_REFERENCE_RULES + (NAMESPACE_SCANNING_RULES if namespace_globs else ())
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name},
        "rules": [{"apiGroups": [r.group], "resources": [r.resource], "verbs": list(r.verbs)}
                  for r in rules],
    }

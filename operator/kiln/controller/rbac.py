"""The API calls the operator makes, as RBAC rules (least privilege, issue 7).

Every (verb, group, resource) the operator sends, through kopf or `kiln.controller.kube`:

| group | resource | verbs | why |
|---|---|---|---|
| kiln.dev | trainingjobs | get, list, watch, patch, delete | kopf watches and patches (finalizer, progress annotations); status writer reads; TTL deletes |
| kiln.dev | trainingjobs/status | patch | every status change |
| "" | pods | get, list, watch, create, delete | trainer pods; the placement loop lists all namespaces' pods for free GPUs |
| "" | nodes | list | allocatable GPUs and CPU slots |
| "" | events | create | one per condition change worth telling |
| "" | namespaces | list, watch | only when a ``--namespace`` is a glob (kopf then scans namespaces) |

Nodes and the cluster-wide pod list make a ClusterRole necessary. When the operator watches
listed namespaces, the rest can be a Role in each of them; `CLUSTER_WIDE_RULES` is what must
stay in the ClusterRole then. The e2e tests record what the operator really sends to the API
emulator and check it against `RULES` (tests/e2e/test_rbac_usage.py); the Helm chart's roles
(helm/kiln/templates/rbac.yaml) are checked against both (tests/helm/test_rbac.py).

Callers: tests; the Helm chart's RBAC test. Non-goals: no API calls.
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


RULES: tuple[Rule, ...] = (
    Rule(api.GROUP, api.PLURAL, ("get", "list", "watch", "patch", "delete")),
    Rule(api.GROUP, f"{api.PLURAL}/status", ("patch",)),
    Rule("", "pods", ("get", "list", "watch", "create", "delete")),
    Rule("", "nodes", ("list",)),
    Rule("", "events", ("create",)),
)
# Needed cluster-wide even when only some namespaces are watched: nodes are cluster-scoped,
# and the placement loop counts every pod's GPU requests to know which GPUs are free.
CLUSTER_WIDE_RULES: tuple[Rule, ...] = (
    Rule("", "nodes", ("list",)),
    Rule("", "pods", ("list",)),
)
NAMESPACE_SCANNING_RULES: tuple[Rule, ...] = (Rule("", "namespaces", ("list", "watch")),)


def triples(rules: tuple[Rule, ...] = RULES) -> set[tuple[str, str, str]]:
    """(group, resource, verb) for every verb of every rule."""
    return {(r.group, r.resource, verb) for r in rules for verb in r.verbs}


def cluster_role(name: str = "kiln-operator", *, namespace_globs: bool = False
                 ) -> dict[str, Any]:
    """A ClusterRole manifest granting exactly `RULES` (plus namespace scanning if asked)."""
    rules = RULES + (NAMESPACE_SCANNING_RULES if namespace_globs else ())
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name},
        "rules": [{"apiGroups": [r.group], "resources": [r.resource], "verbs": list(r.verbs)}
                  for r in rules],
    }

"""Which API calls the operator made: (verb, group, resource) as RBAC names them.

The e2e tests write the union of every run's calls to ``api-calls.json`` (`write`); the Helm
chart's RBAC test compares its roles with such a file (`read`).
"""

# The emulator logs every request with its User-Agent; the operator's are kopf's
# (``kopf/...``) and its own client's (``kiln-operator/...``). Each resource request maps to an
# RBAC verb: GET of a collection is ``list`` (``watch`` with ``?watch=true``), GET of an object
# ``get``, POST ``create``, PATCH ``patch``, PUT ``update``, DELETE ``delete``; subresources are
# named ``resource/subresource`` (``trainingjobs/status``). Discovery requests (``/api``,
# ``/apis/...`` without a resource) need no rules and are left out. Whether a call was
# cluster-wide (no namespace in the URL) is kept too: a Role cannot grant those.

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from pathlib import Path

import pytest

from kubesim import emulator

OPERATOR_USER_AGENTS = ("kopf/", "kiln-operator/")
# How many e2e tests were collected before -k/-m deselection (set by tests/e2e/conftest.py).
E2E_TESTS_COLLECTED = pytest.StashKey[int]()


@dataclasses.dataclass(frozen=True, order=True)
class ApiCall:
    """One kind of call: RBAC verb, API group ("" for core), resource[/subresource].

    Attributes:
        verb: get, list, watch, create, patch, update, delete.
        group: the API group, "" for the core group.
        resource: plural resource, or ``resource/subresource``.
        cluster_wide: True when made without a namespace (needs a ClusterRole).
    """

    verb: str
    group: str
    resource: str
    cluster_wide: bool


def verb_of(request: emulator.LoggedRequest) -> str | None:
    """The RBAC verb of a logged request, None for discovery and non-resource URLs."""
    if request.resource is None:
        return None
    return {"WATCH": "watch", "LIST": "list", "FETCH": "get", "CREATE": "create",
            "DELETE": "delete"}.get(request.action or "") or {
        "PATCH": "patch", "PUT": "update"}.get(request.method)


def api_calls(requests: Iterable[emulator.LoggedRequest], *,
              user_agents: tuple[str, ...] = OPERATOR_USER_AGENTS) -> set[ApiCall]:
    """The distinct calls among `requests` sent by the operator."""
    calls = set()
    for request in requests:
        if not request.user_agent.startswith(user_agents):
            continue
        verb = verb_of(request)
        if verb is None or request.resource is None:
            continue
        resource = request.resource + (f"/{request.subresource}" if request.subresource else "")
        calls.add(ApiCall(verb, request.group or "", resource, request.namespace is None))
    return calls


def write(path: Path, calls: Iterable[ApiCall]) -> Path:
    """Write calls as a sorted JSON list of {verb, group, resource, clusterWide}."""
    rows = [{"verb": c.verb, "group": c.group, "resource": c.resource,
             "clusterWide": c.cluster_wide} for c in sorted(set(calls))]
    path.write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    return path


def read(path: Path) -> set[ApiCall]:
    """Calls written by `write`."""
    rows = json.loads(path.read_text(encoding="utf-8"))
    return {ApiCall(r["verb"], r["group"], r["resource"], r["clusterWide"]) for r in rows}


def rbac_pairs(calls: Iterable[ApiCall]) -> set[tuple[str, str, str]]:
    """(group, resource, verb) triples, scope dropped: what a ClusterRole rule lists."""
    return {(c.group, c.resource, c.verb) for c in calls}

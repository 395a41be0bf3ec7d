"""Which API calls the operator made: (verb, group, resource) as RBAC names them.

Also a pytest plugin (tests/conftest.py loads it): at the end of a run, the union of every
process's calls must lie within `kiln.controller.rbac.RULES`, and use them all when every e2e
test ran.
"""

# The emulator logs every request with its User-Agent; the operator's are kopf's
# (``kopf/...``) and its own client's (``kiln-operator/...``). Each resource request maps to an
# RBAC verb: GET of a collection is ``list`` (``watch`` with ``?watch=true``), GET of an object
# ``get``, POST ``create``, PATCH ``patch``, PUT ``update``, DELETE ``delete``; subresources are
# named ``resource/subresource`` (``trainingjobs/status``). Discovery requests (``/api``,
# ``/apis/...`` without a resource) need no rules and are left out. Whether a call was
# cluster-wide (no namespace in the URL) is kept too: a Role cannot grant those.

# The e2e fixtures add each emulator's calls to the process's set (`recorded`). Under
# pytest-xdist every worker has its own emulators and operators, so no one test sees them all:
# each worker hands its set to the controller (xdist's ``workeroutput``), and the process that
# ends the run checks the union (`pytest_sessionfinish`), failing the run with the rules that
# were not used or the calls that no rule declares. The union is written to
# $KILN_E2E_API_CALLS when set. Whether the chart grants exactly `RULES` is tests/helm's.

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from kubesim import emulator

OPERATOR_USER_AGENTS = ("kopf/", "kiln-operator/")
_RECORDED = pytest.StashKey[set["ApiCall"]]()
_E2E_TESTS_COLLECTED = pytest.StashKey[int]()  # before any -k/-m deselection
_EVERY_E2E_TEST = pytest.StashKey[bool]()  # on the xdist controller: every worker's verdict
_PROBLEMS = pytest.StashKey[list[str]]()
_WORKER_OUTPUT = "kiln_operator_api_calls"


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


def _rows(calls: Iterable[ApiCall]) -> list[dict[str, Any]]:
    return [{"verb": c.verb, "group": c.group, "resource": c.resource,
             "clusterWide": c.cluster_wide} for c in sorted(set(calls))]


def _calls(rows: Iterable[dict[str, Any]]) -> set[ApiCall]:
    return {ApiCall(r["verb"], r["group"], r["resource"], r["clusterWide"]) for r in rows}


def write(path: Path, calls: Iterable[ApiCall]) -> Path:
    """Write calls as a sorted JSON list of {verb, group, resource, clusterWide}."""
    path.write_text(json.dumps(_rows(calls), indent=2) + "\n", encoding="utf-8")
    return path


def read(path: Path) -> set[ApiCall]:
    """Calls written by `write`."""
    return _calls(json.loads(path.read_text(encoding="utf-8")))


def rbac_pairs(calls: Iterable[ApiCall]) -> set[tuple[str, str, str]]:
    """(group, resource, verb) triples, scope dropped: what a ClusterRole rule lists."""
    return {(c.group, c.resource, c.verb) for c in calls}


def recorded(config: pytest.Config) -> set[ApiCall]:
    """This process's operator calls: the e2e fixtures add every emulator's to this set."""
    return config.stash.setdefault(_RECORDED, set())


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Count the e2e tests before -k or -m deselects any."""
    config.stash[_E2E_TESTS_COLLECTED] = sum(1 for item in items if "e2e" in item.path.parts)


def _every_e2e_test(session: pytest.Session) -> bool:
    """Whether this process selected every test of every e2e file (no -k, -m or file subset)."""
    e2e = [item for item in session.items if "e2e" in item.path.parts]
    if not e2e or len(e2e) != session.config.stash.get(_E2E_TESTS_COLLECTED, 0):
        return False
    return {item.path for item in e2e} == set(e2e[0].path.parent.glob("test_*.py"))


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """On the xdist controller: add a finished worker's calls to the union."""
    config = node.config
    output = getattr(node, "workeroutput", {}).get(_WORKER_OUTPUT)
    if output is None or error is not None:  # a worker that died sent no complete set
        config.stash[_EVERY_E2E_TEST] = False
        return
    recorded(config).update(_calls(output["calls"]))
    config.stash[_EVERY_E2E_TEST] = (config.stash.get(_EVERY_E2E_TEST, True)
                                     and output["everyE2eTest"])


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A worker hands its calls on; the process that ends the run checks the union."""
    config = session.config
    if hasattr(config, "workeroutput"):  # an xdist worker
        config.workeroutput[_WORKER_OUTPUT] = {
            "calls": _rows(recorded(config)), "everyE2eTest": _every_e2e_test(session)}
        return
    calls = recorded(config)
    if not calls:
        return
    if os.environ.get("KILN_E2E_API_CALLS"):
        write(Path(os.environ["KILN_E2E_API_CALLS"]), calls)
    from kiln.controller import rbac  # only here: a run without e2e tests needs no kiln import

    used, declared = rbac_pairs(calls), rbac.triples()
    problems = []
    if used - declared:
        problems.append("the operator made calls kiln.controller.rbac.RULES does not declare "
                        f"(declare them, or stop making them): {sorted(used - declared)}")
    # The workers' verdict on the xdist controller (it collects nothing), else this process's;
    # a run that failed or was interrupted may not have reached every call.
    every = config.stash.get(_EVERY_E2E_TEST, None)
    if every is None:
        every = _every_e2e_test(session)
    if every and exitstatus == pytest.ExitCode.OK and declared - used:
        problems.append("kiln.controller.rbac.RULES declares calls no e2e test made (drop them "
                        f"from the rules and the chart, or test what needs them): "
                        f"{sorted(declared - used)}")
    if problems:
        config.stash[_PROBLEMS] = problems
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """Say why the run failed when the union of the operator's calls did not match RULES."""
    problems = config.stash.get(_PROBLEMS, [])
    if problems:
        terminalreporter.section("operator RBAC usage", red=True, bold=True)
        for problem in problems:
            terminalreporter.line(problem, red=True)

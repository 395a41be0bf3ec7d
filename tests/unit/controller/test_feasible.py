"""Which nodes a job's pod may run on: Kubernetes' scheduling rules on listed Node and Pod
objects, and the reason given when none may."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from kiln import api
from kiln.controller import feasible


def _node(name: str, *, labels: dict[str, str] | None = None,
          taints: list[dict[str, str]] | None = None, cpu: str = "8", memory: str = "32Gi",
          unschedulable: bool = False, ready: str = "True") -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels or {}},
            "spec": {"taints": taints or [], "unschedulable": unschedulable},
            "status": {"allocatable": {"cpu": cpu, "memory": memory},
                       "conditions": [{"type": "Ready", "status": ready}]}}


def _allowed(template: dict[str, Any], nodes: list[dict[str, Any]],
             pods: list[dict[str, Any]] | None = None) -> set[str]:
    assert api.scheduling.scheduling_problems(template) == []
    return set(feasible.fit(api.scheduling_of(template), nodes,
                            feasible.used(pods or [])).nodes)


def _affinity(*requirements: dict[str, Any]) -> dict[str, Any]:
    return {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": list(requirements)}]}}}}


NODES = [_node("a100-big", labels={"gpu": "a100", "mem": "80"}),
         _node("a100-small", labels={"gpu": "a100", "mem": "40"}),
         _node("t4", labels={"gpu": "t4", "mem": "16"}),
         _node("bare")]


@pytest.mark.parametrize(("template", "expected"), [
    pytest.param({}, {"a100-big", "a100-small", "t4", "bare"}, id="no-constraints"),
    pytest.param({"nodeSelector": {"gpu": "a100"}}, {"a100-big", "a100-small"},
                 id="nodeSelector"),
    pytest.param({"nodeSelector": {"gpu": "a100", "mem": "40"}}, {"a100-small"},
                 id="nodeSelector-all-labels"),
    pytest.param(_affinity({"key": "gpu", "operator": "In", "values": ["t4", "h100"]}), {"t4"},
                 id="In"),
    pytest.param(_affinity({"key": "gpu", "operator": "NotIn", "values": ["t4"]}),
                 {"a100-big", "a100-small", "bare"}, id="NotIn-includes-unlabelled"),
    pytest.param(_affinity({"key": "gpu", "operator": "Exists"}),
                 {"a100-big", "a100-small", "t4"}, id="Exists"),
    pytest.param(_affinity({"key": "gpu", "operator": "DoesNotExist"}), {"bare"},
                 id="DoesNotExist"),
    pytest.param(_affinity({"key": "mem", "operator": "Gt", "values": ["40"]}), {"a100-big"},
                 id="Gt"),
    pytest.param(_affinity({"key": "mem", "operator": "Lt", "values": ["41"]}),
                 {"a100-small", "t4"}, id="Lt-skips-unlabelled"),
    pytest.param(_affinity({"key": "gpu", "operator": "Exists"},
                           {"key": "mem", "operator": "Lt", "values": ["20"]}), {"t4"},
                 id="requirements-of-a-term-all-hold"),
    pytest.param({"affinity": {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["t4"]}]},
            {"matchFields": [{"key": "metadata.name", "operator": "In",
                              "values": ["bare"]}]}]}}}}, {"t4", "bare"},
        id="terms-are-ored-and-matchFields-names-the-node"),
])
def test_selector_and_required_affinity_pick_the_nodes(template: dict[str, Any],
                                                       expected: set[str]) -> None:
    assert _allowed(template, NODES) == expected


TAINTED = [_node("ml", taints=[{"key": "dedicated", "value": "ml", "effect": "NoSchedule"}]),
           _node("draining", taints=[{"key": "maintenance", "effect": "NoExecute"}]),
           _node("prefer", taints=[{"key": "spot", "effect": "PreferNoSchedule"}])]


@pytest.mark.parametrize(("tolerations", "expected"), [
    pytest.param([], {"prefer"}, id="PreferNoSchedule-does-not-bar"),
    pytest.param([{"key": "dedicated", "operator": "Equal", "value": "ml",
                   "effect": "NoSchedule"}], {"ml", "prefer"}, id="Equal"),
    pytest.param([{"key": "dedicated", "operator": "Equal", "value": "cv"}], {"prefer"},
                 id="Equal-other-value"),
    pytest.param([{"key": "dedicated", "operator": "Exists"}], {"ml", "prefer"},
                 id="Exists-any-value-and-effect"),
    pytest.param([{"key": "dedicated", "operator": "Exists", "effect": "NoExecute"}],
                 {"prefer"}, id="other-effect"),
    pytest.param([{"operator": "Exists"}], {"ml", "draining", "prefer"},
                 id="empty-key-tolerates-everything"),
])
def test_only_tolerated_hard_taints_admit(tolerations: list[dict[str, Any]],
                                          expected: set[str]) -> None:
    assert _allowed({"tolerations": tolerations}, TAINTED) == expected


def test_cordoned_and_not_ready_nodes_are_never_candidates() -> None:
    nodes = [_node("ok"), _node("cordoned", unschedulable=True), _node("down", ready="False")]
    fit = feasible.fit(api.scheduling_of({}), nodes, {})
    assert fit.nodes == {"ok"}
    assert fit.barred == {"cordoned": "are cordoned (spec.unschedulable)",
                          "down": "are not Ready"}


def _pod(node: str, *, cpu: str | None = None, memory: str | None = None, phase: str = "Running",
         init_cpu: str | None = None) -> dict[str, Any]:
    requests = {k: v for k, v in (("cpu", cpu), ("memory", memory)) if v is not None}
    spec: dict[str, Any] = {"nodeName": node,
                            "containers": [{"resources": {"requests": requests}}]}
    if init_cpu is not None:
        spec["initContainers"] = [{"resources": {"limits": {"cpu": init_cpu}}}]
    return {"metadata": {"name": f"p-{node}"}, "spec": spec, "status": {"phase": phase}}


def test_requests_must_fit_allocatable_minus_what_running_pods_request() -> None:
    nodes = [_node("busy", cpu="8", memory="32Gi"), _node("idle", cpu="8", memory="32Gi"),
             _node("small", cpu="2", memory="4Gi")]
    pods = [_pod("busy", cpu="6500m", memory="1Gi"),
            _pod("idle", cpu="8", phase="Succeeded")]  # a finished pod holds nothing
    template = {"resources": {"requests": {"cpu": "2", "memory": "8Gi"}}}
    assert _allowed(template, nodes, pods) == {"idle"}
    fit = feasible.fit(api.scheduling_of(template), nodes, feasible.used(pods))
    assert fit.barred["busy"] == ("have too little cpu free for its request 2 (free 1.5 of 8 "
                                  "allocatable)")
    assert fit.barred["small"] == ("have too little memory free for its request 8Gi (free 4Gi "
                                   "of 4Gi allocatable)")


def test_a_limit_alone_counts_as_the_request_and_init_containers_count_their_peak() -> None:
    assert api.scheduling_of({"resources": {"limits": {"cpu": "3"}}}).requests == (
        ("cpu", Decimal(3)),)
    used = feasible.used([_pod("n", cpu="1", init_cpu="4")])
    assert used["n"]["cpu"] == 4


def test_the_reason_groups_nodes_by_the_first_rule_they_fail() -> None:
    nodes = [_node("a", labels={"gpu": "t4"}), _node("b"), _node("c", labels={"gpu": "t4"}),
             _node("d", labels={"gpu": "a100"},
                   taints=[{"key": "dedicated", "value": "ml", "effect": "NoSchedule"}]),
             _node("e", labels={"gpu": "a100"}, unschedulable=True)]
    fit = feasible.fit(api.scheduling_of({"nodeSelector": {"gpu": "a100"}}), nodes, {})
    assert fit.nodes == frozenset()
    assert fit.reason() == (
        "3 nodes do not match nodeSelector gpu=a100 (a, b, c); 1 node is cordoned "
        "(spec.unschedulable) (e); 1 node has taint dedicated=ml:NoSchedule not tolerated (d); "
        "change spec.template (nodeSelector, affinity, tolerations, resources) or the "
        "nodes (labels, taints, cordons)")


def test_the_reason_names_a_few_nodes_and_counts_the_rest() -> None:
    nodes = [_node(f"n{i}") for i in range(6)]
    reason = feasible.fit(api.scheduling_of({"nodeSelector": {"gpu": "h100"}}), nodes,
                          {}).reason()
    assert reason.startswith("6 nodes do not match nodeSelector gpu=h100 (n0, n1, n2 and 3 "
                             "more)")

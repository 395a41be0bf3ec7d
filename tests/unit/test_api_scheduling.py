"""`kiln.api`'s scheduling checks: spec.template's nodeSelector, required node affinity,
tolerations and resource quantities, in Kubernetes' shapes, each problem naming its field."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from kiln import api

TERM = ("spec.template.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
        ".nodeSelectorTerms")


def _job(**template: Any) -> dict[str, Any]:
    return {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": "x"},
            "spec": {"model": {"architecture": "small_cnn", "inputShape": [1, 8, 8]},
                     "template": template}}


def _required(*terms: Any) -> dict[str, Any]:
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": list(terms)}}}


@pytest.mark.parametrize(("template", "field", "message"), [
    pytest.param({"nodeSelector": {"gpus": 8}}, "spec.template.nodeSelector.gpus",
                 "must be a string label value", id="selector-value-not-a-string"),
    pytest.param({"affinity": _required({"matchExpressions": [
        {"key": "gpu", "operator": "Equals", "values": ["a100"]}]})},
        f"{TERM}[0].matchExpressions[0].operator",
        "must be one of In, NotIn, Exists, DoesNotExist, Gt, Lt (got 'Equals')",
        id="unknown-operator"),
    pytest.param({"affinity": _required({"matchExpressions": [
        {"key": "mem", "operator": "Gt", "values": ["40", "80"]}]})},
        f"{TERM}[0].matchExpressions[0].values", "Gt needs exactly one integer",
        id="gt-two-values"),
    pytest.param({"affinity": _required({"matchExpressions": [
        {"key": "gpu", "operator": "In"}]})},
        f"{TERM}[0].matchExpressions[0].values", "In needs at least one value",
        id="in-without-values"),
    pytest.param({"affinity": _required({"matchExpressions": [
        {"key": "spot", "operator": "Exists", "values": ["true"]}]})},
        f"{TERM}[0].matchExpressions[0].values", "Exists takes no values",
        id="exists-with-values"),
    pytest.param({"affinity": _required({"matchFields": [
        {"key": "metadata.labels", "operator": "In", "values": ["a"]}]})},
        f"{TERM}[0].matchFields[0].key", "matchFields supports only metadata.name",
        id="match-fields-other-field"),
    pytest.param({"affinity": _required({})}, f"{TERM}[0]",
                 "needs matchExpressions or matchFields", id="empty-term"),
    pytest.param({"affinity": _required()}, TERM, "required, a non-empty list of terms",
                 id="no-terms"),
    pytest.param({"tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml",
                                   "effect": "NoScheduling"}]},
                 "spec.template.tolerations[0].effect",
                 "must be one of NoSchedule, PreferNoSchedule, NoExecute", id="bad-effect"),
    pytest.param({"tolerations": [{"key": "dedicated", "operator": "Exists", "value": "ml"}]},
                 "spec.template.tolerations[0].value", "operator Exists takes no value",
                 id="exists-with-value"),
    pytest.param({"tolerations": [{"operator": "Equal", "value": "ml"}]},
                 "spec.template.tolerations[0].key", "an empty key needs operator Exists",
                 id="equal-without-key"),
    pytest.param({"tolerations": [{"key": "a", "operator": "In"}]},
                 "spec.template.tolerations[0].operator", "must be Equal or Exists",
                 id="toleration-operator"),
    pytest.param({"resources": {"requests": {"memory": "4GB"}}},
                 "spec.template.resources.requests.memory", "not a Kubernetes quantity",
                 id="bad-quantity"),
    pytest.param({"resources": {"requests": {"cpu": "1e1000000"}}},
                 "spec.template.resources.requests.cpu", "not a Kubernetes quantity",
                 id="quantity-overflow"),
    pytest.param({"resources": {"requests": {"cpu": "-1"}}},
                 "spec.template.resources.requests.cpu", "must not be negative",
                 id="negative-quantity"),
    pytest.param({"resources": {"requests": {"cpu": "4"}, "limits": {"cpu": "2"}}},
                 "spec.template.resources.requests.cpu", "4 exceeds the limit 2",
                 id="request-above-limit"),
    pytest.param({"resources": {"request": {"cpu": "4"}}}, "spec.template.resources.request",
                 "unknown; use limits or requests", id="misspelt-requests"),
])
def test_scheduling_problem_names_the_field(template: dict[str, Any], field: str,
                                            message: str) -> None:
    with pytest.raises(api.InvalidSpec) as caught:
        api.parse_job(_job(**template))
    (problem,) = caught.value.problems
    assert problem.startswith(f"{field}: ") and message in problem, problem


@pytest.mark.parametrize(("text", "value"), [
    ("500m", Decimal("0.5")), ("2", Decimal(2)), ("1.5", Decimal("1.5")), (8, Decimal(8)),
    ("4Gi", Decimal(4 * 2**30)), ("512Mi", Decimal(512 * 2**20)), ("1k", Decimal(1000)),
    ("2e3", Decimal(2000)), ("100M", Decimal(10**8)),
])
def test_quantities_read_as_kubernetes_does(text: str | int, value: Decimal) -> None:
    assert api.parse_quantity(text) == value


@pytest.mark.parametrize("text", ["4GB", "", "one", "1.2.3", True, "Gi", "1e1000000",
                                  "9e999999Ei"])
def test_not_a_quantity(text: str | bool) -> None:
    with pytest.raises(ValueError, match="not a quantity"):
        api.parse_quantity(text)


def test_the_constraints_are_read_from_the_template() -> None:
    job = api.parse_job(_job(
        nodeSelector={"gpu": "a100"},
        affinity=_required({"matchExpressions": [{"key": "mem", "operator": "Gt",
                                                  "values": ["40"]}]}),
        tolerations=[{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
        resources={"requests": {"cpu": "3500m"}, "limits": {"cpu": "8", "memory": "16Gi"}}))
    scheduling = api.scheduling_of(job.spec.template)
    assert scheduling.node_selector == (("gpu", "a100"),)
    assert scheduling.node_terms == ((api.Requirement("mem", "Gt", ("40",)),),)
    assert scheduling.tolerations == (api.Toleration("dedicated", "Exists", "", "NoSchedule"),)
    assert scheduling.requests == (("cpu", Decimal("3.5")), ("memory", Decimal(16 * 2**30)))

"""Two operator replicas: leader election through kopf peering, as the chart installs it.

The chart is linted with ``replicaCount: 2`` and installed into the API emulator in both RBAC
modes; the Deployment's arguments are parsed by the operator's own parser. What the emulator
cannot show: two live replicas pausing each other (kopf's peering, not Kiln's code).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubesim import helm

from kiln.controller import main, rbac

pytestmark = pytest.mark.xdist_group(__name__)  # one worker builds its module fixtures

KUBERNETES_VERSION = "1.30.0"


@pytest.fixture(scope="module")
def two_replicas() -> helm.Release:
    return helm.install({"replicaCount": 2})


def _operator(release: helm.Release) -> dict[str, Any]:
    deployment = release.one("Deployment", "kiln")
    return dict(deployment["spec"]["template"]["spec"]["containers"][0])


def test_the_chart_lints_clean_with_two_replicas(tmp_path: Path) -> None:
    chart = tmp_path / "kiln"
    shutil.copytree(helm.CHART, chart)
    values = yaml.safe_load((chart / "values.yaml").read_text(encoding="utf-8"))
    values["replicaCount"] = 2
    (chart / "values.yaml").write_text(yaml.safe_dump(values), encoding="utf-8")
    result = helm.lint(chart)
    assert not result.get("Errors"), result
    assert [m for m in result.get("Messages") or [] if m["Severity"] >= 2] == [], result


def test_two_replicas_elect_a_leader_through_one_cluster_peering(
        two_replicas: helm.Release) -> None:
    deployment = two_replicas.one("Deployment", "kiln")
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    container = _operator(two_replicas)
    options = main.options_from_args(main.build_parser().parse_args(container["args"][1:]))
    (peering,) = two_replicas.of_kind("ClusterKopfPeering")
    assert options.peering == peering["metadata"]["name"]
    assert {"name": "POD_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in (
        container["env"])
    assert ("kopf.dev/v1/ClusterKopfPeering", "", peering["metadata"]["name"]) in (
        two_replicas.created)
    assert two_replicas.grants() == rbac.triples(
        rbac.RULES + rbac.OWNER_REFERENCE_RULES + rbac.PEERING_CLUSTER_RULES)
    for document in [deployment, *two_replicas.crds]:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
    kinds = {c["spec"]["names"]["kind"] for c in two_replicas.crds}
    assert {"ClusterKopfPeering", "KopfPeering"} <= kinds


def test_listed_namespaces_get_a_peering_object_and_its_rule_each() -> None:
    release = helm.install({"replicaCount": 2,
                            "operator": {"watchNamespaces": ["team-a", "team-b"]}})
    peerings = release.of_kind("KopfPeering")
    assert sorted(p["metadata"]["namespace"] for p in peerings) == ["team-a", "team-b"]
    assert not release.of_kind("ClusterKopfPeering")
    for role in release.of_kind("Role"):
        assert rbac.triples(rbac.PEERING_NAMESPACED_RULES) <= helm.rule_grants(role["rules"])
    (cluster_role,) = release.of_kind("ClusterRole")
    assert not {t for t in helm.rule_grants(cluster_role["rules"]) if t[0] == "kopf.dev"}


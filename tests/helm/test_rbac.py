"""The chart's RBAC grants exactly the API calls the operator makes.

`kiln.controller.rbac.RULES` is the declared set; tests/e2e/test_rbac_usage.py checks it equals
what the real operator sent to the API emulator over the whole e2e suite, and compares the
chart's default grants with those recorded calls. Here the rendered roles are compared with
the declared rules in both install modes: all namespaces (one ClusterRole) and listed
namespaces (a Role in each, plus a ClusterRole for what only cluster-wide calls can read).
Besides the calls, the roles grant the finalizers updates that owner references with
blockOwnerDeletion need (`rbac.OWNER_REFERENCE_RULES`).
"""

from __future__ import annotations

from typing import Any

import pytest
from kubesim import helm

from kiln.controller import rbac

pytestmark = pytest.mark.xdist_group(__name__)  # one worker builds its module fixtures
GRANTED = rbac.RULES + rbac.OWNER_REFERENCE_RULES


@pytest.fixture(scope="module")
def namespaced_release() -> helm.Release:
    return helm.install({"operator": {"watchNamespaces": ["team-a", "team-b"]}})


@pytest.fixture(scope="module")
def cluster_release() -> helm.Release:
    return helm.install()


def _subject_is_operator(binding: dict[str, Any], release: helm.Release) -> None:
    deployment = release.one("Deployment", "kiln")
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account, "namespace": "kiln-system"}]


def test_all_namespaces_one_cluster_role_with_exactly_the_operator_rules(
        cluster_release: helm.Release) -> None:
    (role,) = cluster_release.of_kind("ClusterRole")
    assert helm.rule_grants(role["rules"]) == rbac.triples(GRANTED)
    assert not cluster_release.of_kind("Role")
    (binding,) = cluster_release.of_kind("ClusterRoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io",
                                  "kind": "ClusterRole", "name": role["metadata"]["name"]}
    _subject_is_operator(binding, cluster_release)


def test_listed_namespaces_get_roles_and_the_cluster_role_keeps_only_cluster_wide_reads(
        namespaced_release: helm.Release) -> None:
    (cluster_role,) = namespaced_release.of_kind("ClusterRole")
    assert helm.rule_grants(cluster_role["rules"]) == rbac.triples(rbac.CLUSTER_WIDE_RULES)
    roles = namespaced_release.of_kind("Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    namespaced = rbac.triples(GRANTED) - {t for t in rbac.triples(rbac.CLUSTER_WIDE_RULES)
                                          if t[1] in ("nodes", "clustertrainingruntimes")}
    for role in roles:
        assert helm.rule_grants(role["rules"]) == namespaced
    bindings = namespaced_release.of_kind("RoleBinding")
    assert sorted((b["metadata"]["namespace"], b["roleRef"]["name"]) for b in bindings) == [
        ("team-a", roles[0]["metadata"]["name"]), ("team-b", roles[0]["metadata"]["name"])]
    for binding in bindings + namespaced_release.of_kind("ClusterRoleBinding"):
        _subject_is_operator(binding, namespaced_release)
    assert namespaced_release.grants() == rbac.triples(GRANTED)


def test_rbac_and_service_account_can_be_left_to_the_platform() -> None:
    release = helm.install({"rbac": {"create": False},
                            "serviceAccount": {"create": False, "name": "platform-kiln"}})
    assert not release.of_kind("ClusterRole") and not release.of_kind("ServiceAccount")
    deployment = release.one("Deployment", "kiln")
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "platform-kiln"


@pytest.mark.parametrize("watch", [pytest.param([], id="all-namespaces"),
                                   pytest.param(["team-a"], id="listed-namespaces")])
def test_kueue_enabled_adds_the_flag_and_exactly_the_kueue_rules(watch: list[str]) -> None:
    release = helm.install({"kueue": {"enabled": True},
                            "operator": {"watchNamespaces": watch}})
    args = release.one("Deployment", "kiln")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--kueue" in args
    assert release.grants() == rbac.triples(GRANTED + rbac.KUEUE_RULES)
    (cluster_role,) = release.of_kind("ClusterRole")
    assert rbac.triples(rbac.KUEUE_CLUSTER_RULES) <= helm.rule_grants(cluster_role["rules"])
    for role in release.of_kind("Role"):  # Workloads live in the jobs' namespaces
        assert helm.rule_grants(role["rules"]) >= rbac.triples(
            rbac.KUEUE_RULES[:2])


@pytest.mark.parametrize("watch", [pytest.param([], id="all-namespaces"),
                                   pytest.param(["team-a"], id="listed-namespaces")])
def test_every_role_that_lets_the_operator_create_owned_objects_grants_finalizers_update(
        watch: list[str]) -> None:
    # Trainer pods, Services, Secrets and Workloads name their TrainingJob, and trial jobs
    # their TrainingSweep, with blockOwnerDeletion: true; OwnerReferencesPermissionEnforcement
    # then refuses the creation unless the creator may update the owner's finalizers.
    release = helm.install({"kueue": {"enabled": True}, "operator": {"watchNamespaces": watch}})
    roles = release.of_kind("Role") if watch else release.of_kind("ClusterRole")
    assert roles
    for role in roles:
        grants = helm.rule_grants(role["rules"])
        assert {("", "pods", "create"), ("kueue.x-k8s.io", "workloads", "create"),
                ("kiln.dev", "trainingjobs", "create")} <= grants
        assert {("kiln.dev", "trainingjobs/finalizers", "update"),
                ("kiln.dev", "trainingsweeps/finalizers", "update")} <= grants

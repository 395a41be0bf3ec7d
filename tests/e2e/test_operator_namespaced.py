"""An operator that watches one namespace needs only what the chart's namespaced RBAC grants.

Runs the real operator with ``--namespace`` against its own emulator, trains one tiny job, and
checks every call: those without a namespace against the ClusterRole (which keeps only
`kiln.controller.rbac.CLUSTER_WIDE_RULES`), the rest against the namespace's Role.
"""

from __future__ import annotations

import uuid
from pathlib import Path

from kubesim import emulator, helm, kubelet, operator_process, scenario, usage


def test_an_operator_watching_one_namespace_stays_within_the_charts_roles(
    zoo: scenario.Zoo, operator_args: list[str], zoo_secret: tuple[str, dict[str, str]],
    api_calls: set[usage.ApiCall], tmp_path: Path,
) -> None:
    namespace = f"team-{uuid.uuid4().hex[:6]}"
    with emulator.Emulator() as cluster:
        cluster.client.create_node("cpu-node-1")
        cluster.client.create_secret(namespace, *zoo_secret)
        node = kubelet.Kubelet(cluster.url, tmp_path / "kubelet")
        node.start()
        operator = operator_process.OperatorProcess(
            cluster, tmp_path / "operator", env=zoo.operator_env,
            args=[*operator_args, "--namespace", namespace])
        try:
            operator.start()
            cluster.client.create_job(namespace, scenario.tiny_job("digits-team"))
            scenario.wait_phase(cluster, namespace, "digits-team", "Succeeded",
                                details=operator.log_tail)
        finally:
            operator.stop()
            node.stop()
        calls = usage.api_calls(cluster.requests)
    api_calls |= calls
    assert not node.errors, node.errors

    release = helm.install({"operator": {"watchNamespaces": [namespace]}})
    (cluster_role,) = release.of_kind("ClusterRole")
    (role,) = release.of_kind("Role")
    assert role["metadata"]["namespace"] == namespace
    cluster_wide = usage.rbac_pairs(c for c in calls if c.cluster_wide)
    in_namespace = usage.rbac_pairs(c for c in calls if not c.cluster_wide)
    assert cluster_wide, "the placement loop lists nodes and pods cluster-wide"
    assert cluster_wide <= helm.rule_grants(cluster_role["rules"]), sorted(
        cluster_wide - helm.rule_grants(cluster_role["rules"]))
    assert in_namespace <= helm.rule_grants(role["rules"]), sorted(
        in_namespace - helm.rule_grants(role["rules"]))

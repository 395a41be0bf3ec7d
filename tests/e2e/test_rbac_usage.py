"""The API calls the operator really made are exactly what its RBAC rules declare.

Every call this process's operators made so far must be declared in
`kiln.controller.rbac.RULES` and granted by the chart's roles. That every rule is also used
needs every e2e test's calls, spread over the xdist workers: `kubesim.usage` checks their union
at the end of a run that selected every e2e test, and fails the run naming an unused rule.
"""

from __future__ import annotations

from kubesim import emulator, helm, operator_process, usage

from kiln.controller import rbac


def test_every_api_call_the_operator_made_is_declared_in_its_rbac_rules(
    cluster: emulator.Emulator, operator: operator_process.OperatorProcess,
    api_calls: set[usage.ApiCall],
) -> None:
    recorded = usage.rbac_pairs(api_calls | usage.api_calls(cluster.requests))
    assert recorded, "the operator made no API calls in this session"
    assert recorded <= rbac.triples(), sorted(recorded - rbac.triples())
    chart = helm.install().grants()  # the default: all namespaces, one ClusterRole
    assert recorded <= chart, f"the chart does not grant {sorted(recorded - chart)}"

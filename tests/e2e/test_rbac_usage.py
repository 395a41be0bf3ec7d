"""The API calls the operator really made are exactly what its RBAC rules declare.

Runs last in the e2e directory (file order), after the other tests drove the operator through
every path. Every call must be declared in `kiln.controller.rbac.RULES` and granted by the
chart's roles; after a whole e2e run, every rule and grant must also have been used.
"""

from __future__ import annotations

import pytest
from kubesim import emulator, helm, usage

from kiln.controller import rbac


def test_every_api_call_the_operator_made_is_declared_in_its_rbac_rules(
    cluster: emulator.Emulator, api_calls: set[usage.ApiCall],
    request: pytest.FixtureRequest,
) -> None:
    recorded = usage.rbac_pairs(api_calls | usage.api_calls(cluster.requests))
    assert recorded, "the operator made no API calls in this session"
    assert recorded <= rbac.triples(), sorted(recorded - rbac.triples())
    chart = helm.install().grants()  # the default: all namespaces, one ClusterRole
    assert recorded <= chart, f"the chart does not grant {sorted(recorded - chart)}"
    selected = sum(1 for item in request.session.items if "e2e" in item.path.parts)
    if selected == request.config.stash.get(usage.E2E_TESTS_COLLECTED, -1):
        assert rbac.triples() <= recorded, sorted(rbac.triples() - recorded)
        assert chart == recorded, f"the chart grants unused {sorted(chart - recorded)}"


"""The API calls the operator really made are exactly what its RBAC rules declare.

Runs last in the e2e directory (file order), after the other tests drove the operator through
every path (success, restarts, suspension, deadline, TTL, deletion, zoo outage). Every call
recorded must be declared in `kiln.controller.rbac.RULES` (least privilege: nothing used is
missing); when the whole e2e suite ran, every declared rule must also have been used (nothing
granted that is not needed). The recorded set is what the Helm chart's roles are tested with.
"""

from __future__ import annotations

import pytest
from kubesim import emulator, usage

from kiln.controller import rbac


def test_every_api_call_the_operator_made_is_declared_in_its_rbac_rules(
    cluster: emulator.Emulator, api_calls: set[usage.ApiCall],
    request: pytest.FixtureRequest,
) -> None:
    recorded = usage.rbac_pairs(api_calls | usage.api_calls(cluster.requests))
    assert recorded, "the operator made no API calls in this session"
    assert recorded <= rbac.triples(), sorted(recorded - rbac.triples())
    selected = sum(1 for item in request.session.items if "e2e" in item.path.parts)
    if selected == request.config.stash.get(usage.E2E_TESTS_COLLECTED, -1):
        assert rbac.triples() <= recorded, sorted(rbac.triples() - recorded)

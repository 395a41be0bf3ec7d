"""The job lifecycle's pure rules: the back-off of a trainer pod the API server refuses."""

from __future__ import annotations

from kiln.controller import lifecycle


def test_a_pod_refused_for_days_is_retried_at_the_cap_without_overflow() -> None:
    assert lifecycle.create_retry_delay(10.0, 0) == 10.0
    assert lifecycle.create_retry_delay(10.0, 2) == 40.0
    for refusals in (40, 1024, 10**6):  # 2.0 ** 1024 raised OverflowError in the handler
        assert lifecycle.create_retry_delay(10.0, refusals) == lifecycle.CREATE_RETRY_MAX_SECONDS

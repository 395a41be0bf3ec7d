"""runPolicy decisions of kiln.controller.policy (pure)."""

from __future__ import annotations

import dataclasses

import pytest

from kiln import api
from kiln.controller import pods, policy


@pytest.mark.parametrize(("code", "reason", "kind"), [
    pytest.param(0, "Completed", policy.ExitKind.SUCCEEDED, id="ok"),
    pytest.param(1, "Error", policy.ExitKind.PERMANENT, id="unexpected-error"),
    pytest.param(2, "Error", policy.ExitKind.PERMANENT, id="invalid-job"),
    pytest.param(3, "Error", policy.ExitKind.RETRYABLE, id="store-unavailable"),
    pytest.param(137, "Error", policy.ExitKind.RETRYABLE, id="sigkill"),
    pytest.param(143, "Error", policy.ExitKind.RETRYABLE, id="sigterm"),
    pytest.param(1, "OOMKilled", policy.ExitKind.RETRYABLE, id="oom-killed"),
])
def test_exit_codes_are_classified(code: int, reason: str, kind: policy.ExitKind) -> None:
    assert policy.classify_exit(code, reason) == kind


def test_a_retryable_exit_restarts_while_restarts_are_left() -> None:
    verdict = policy.after_exit(137, "Error", "", restarts=1, backoff_limit=3)
    assert verdict.action == policy.Action.RESTART
    assert verdict.reason == api.Reason.TRAINER_EXITED
    assert "restart 2 of 3" in verdict.message and "SIGKILL" in verdict.message


def test_a_retryable_exit_past_the_backoff_limit_fails() -> None:
    verdict = policy.after_exit(143, "Error", "", restarts=3, backoff_limit=3)
    assert (verdict.action, verdict.reason) == (policy.Action.FAIL,
                                                api.Reason.BACKOFF_LIMIT_EXCEEDED)


def test_a_permanent_exit_fails_at_once_whatever_the_backoff_limit() -> None:
    verdict = policy.after_exit(2, "Error", "no such dataset", restarts=0, backoff_limit=10)
    assert (verdict.action, verdict.reason) == (policy.Action.FAIL, api.Reason.PERMANENT_ERROR)
    assert "no such dataset" in verdict.message


def test_exit_0_without_a_result_fails_at_once_naming_ctx_finish() -> None:
    verdict = policy.after_exit(0, "Completed", "", restarts=0, backoff_limit=10,
                                reported=False)
    assert (verdict.action, verdict.reason) == (policy.Action.FAIL, api.Reason.PERMANENT_ERROR)
    assert "without reporting a result" in verdict.message and "ctx.finish" in verdict.message
    assert policy.after_exit(0, "Completed", "", restarts=0, backoff_limit=10).action \
        is policy.Action.SUCCEED


def test_deadline_and_ttl() -> None:
    assert policy.deadline_passed(100.0, 10, now=110.0)
    assert not policy.deadline_passed(100.0, 10, now=109.0)
    assert not policy.deadline_passed(None, 10, now=1e9)
    assert policy.ttl_expired(50.0, 0, now=50.0)
    assert not policy.ttl_expired(50.0, None, now=1e9)


def _state(name: str, phase: str) -> pods.PodState:
    return pods.PodState(name=name, job="j", attempt=0, phase=phase, node="n", pod_ip=None,
                         devices=1, device="cpu", parallelism="single", estimated_seconds=1.0,
                         started=None, exit_code=None, container_reason=None, message="",
                         metrics_port=None, deleting=False)


@pytest.mark.parametrize(("clean", "deleted"), [
    pytest.param(api.CleanPodPolicy.ALL, ["a", "b"], id="all"),
    pytest.param(api.CleanPodPolicy.RUNNING, ["b"], id="running"),
    pytest.param(api.CleanPodPolicy.NONE, [], id="none"),
])
def test_clean_pod_policy(clean: api.CleanPodPolicy, deleted: list[str]) -> None:
    states = [_state("a", "Failed"), _state("b", "Running")]
    assert policy.pods_to_clean(states, clean) == deleted
    assert dataclasses.replace(states[1], deleting=True).active is False

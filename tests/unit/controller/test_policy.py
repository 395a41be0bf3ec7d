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


def test_a_disruption_restarts_without_spending_the_backoff_limit() -> None:
    verdict = policy.after_disruption(
        "digits-trainer-0", "EvictionByEvictionAPI: Eviction API: evicting",
        policy.describe_exit(143, "Error"), restarts=0, backoff_limit=0)
    assert (verdict.action, verdict.reason) == (policy.Action.RESTART,
                                                api.Reason.POD_DISRUPTED)
    assert not verdict.spends_restart
    assert "EvictionByEvictionAPI" in verdict.message and "SIGTERM" in verdict.message
    # The same exit without the DisruptionTarget condition spends the last restart.
    counted = policy.after_exit(143, "Error", "", restarts=0, backoff_limit=0)
    assert counted.action == policy.Action.FAIL and counted.spends_restart


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


@pytest.mark.parametrize(("clean", "stopped"), [
    pytest.param(api.CleanPodPolicy.ALL, [], id="all"),
    pytest.param(api.CleanPodPolicy.RUNNING, [], id="running"),
    pytest.param(api.CleanPodPolicy.NONE, ["b", "c"], id="none"),
])
def test_every_active_pod_the_policy_keeps_is_stopped(clean: api.CleanPodPolicy,
                                                      stopped: list[str]) -> None:
    states = [_state("a", "Failed"), _state("b", "Running"), _state("c", "Pending"),
              dataclasses.replace(_state("d", "Running"), deleting=True)]
    assert policy.pods_to_stop(iter(states), clean) == stopped


def _waiting(reason: str, message: str = "", *, phase: str = "Pending",
             started: float | None = 100.0) -> pods.PodState:
    return dataclasses.replace(
        _state("j-trainer-0", phase), started=started,
        waiting=pods.Waiting("trainer", reason, message, "reg.example/kiln:9"))


def test_a_pull_error_and_its_back_off_are_one_problem_naming_the_image() -> None:
    pulled = policy.not_started(_waiting("ErrImagePull", "not found"))
    backing_off = policy.not_started(_waiting("ImagePullBackOff", 'Back-off pulling image'))
    assert pulled is not None and backing_off is not None
    assert pulled.reason == backing_off.reason == api.Reason.POD_PENDING
    assert pulled.problem == backing_off.problem
    assert "reg.example/kiln:9" in pulled.problem and "j-trainer-0" in pulled.problem
    assert "ErrImagePull: not found" in pulled.message
    assert "ImagePullBackOff" in backing_off.message
    assert "spec.template.image" in pulled.message


@pytest.mark.parametrize(("reason", "words"), [
    pytest.param("CreateContainerConfigError", "Secret or ConfigMap", id="config"),
    pytest.param("InvalidImageName", "invalid image name reg.example/kiln:9", id="bad-name"),
    pytest.param("SomethingNew", "is waiting with SomethingNew", id="unknown"),
])
def test_other_waiting_reasons_say_what_is_wrong(reason: str, words: str) -> None:
    stuck = policy.not_started(_waiting(reason))
    assert stuck is not None and stuck.reason == api.Reason.POD_PENDING
    assert words in stuck.message and reason in stuck.message


def test_an_unschedulable_pod_carries_the_schedulers_words() -> None:
    state = dataclasses.replace(_state("j-trainer-0", "Pending"),
                                unschedulable="0/1 nodes are available: 1 node(s) had taint")
    stuck = policy.not_started(state)
    assert stuck is not None and stuck.reason == api.Reason.UNSCHEDULABLE
    assert "1 node(s) had taint" in stuck.message and "tolerations" in stuck.message


def test_a_pod_being_set_up_or_running_is_not_stuck() -> None:
    assert policy.not_started(_state("j-trainer-0", "Pending")) is None
    assert policy.not_started(_waiting("ErrImagePull", phase="Running")) is None
    setting_up = dataclasses.replace(
        _state("j-trainer-0", "Pending"),
        starting=pods.Waiting("trainer", "ContainerCreating", "", "reg.example/kiln:9"))
    assert policy.not_started(setting_up) is None
    assert "still ContainerCreating" in policy.start_timeout_message(setting_up, 600)


def test_the_start_timeout_counts_from_the_launch_of_a_pending_pod() -> None:
    stuck = _waiting("ImagePullBackOff")
    assert not policy.start_timed_out(stuck, 600, now=699.0)
    assert policy.start_timed_out(stuck, 600, now=700.0)
    assert not policy.start_timed_out(stuck, 0, now=1e9)  # 0: wait forever
    assert not policy.start_timed_out(_waiting("ErrImagePull", phase="Running"), 600, now=1e9)
    assert not policy.start_timed_out(_waiting("ErrImagePull", started=None), 600, now=1e9)
    message = policy.start_timeout_message(stuck, 600)
    assert "600 s" in message and "ImagePullBackOff" in message
    assert "reg.example/kiln:9" in message and "deleted" in message

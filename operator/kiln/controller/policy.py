"""runPolicy as decisions: exit codes, restarts, deadline, TTL and which pods to clean.

Pure functions: no I/O, no clock of their own.
"""

from __future__ import annotations

import dataclasses
import enum
import signal
from collections.abc import Iterable

from kiln import api, contract
from kiln.controller import pods

RETRYABLE_EXIT_CODES = frozenset({contract.EXIT_STORE_UNAVAILABLE})
RETRYABLE_CONTAINER_REASONS = frozenset({"OOMKilled", "Evicted", "DeadlineExceeded"})
SIGNAL_EXIT_CODE_MIN = 128


class ExitKind(enum.StrEnum):
    SUCCEEDED = "succeeded"
    RETRYABLE = "retryable"
    PERMANENT = "permanent"


class Action(enum.StrEnum):
    SUCCEED = "succeed"
    RESTART = "restart"
    FAIL = "fail"


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What to do after a trainer exited.

    Attributes:
        action: succeed, restart, or fail.
        reason: the condition reason to record.
        message: one sentence with the exit code, restarts used and the next step.
    """

    action: Action
    reason: api.Reason
    message: str


def classify_exit(exit_code: int, container_reason: str | None) -> ExitKind:
    """Succeeded, retryable or permanent (Kubeflow's `ExitCode` restart policy).

    0 succeeded; 128 and above (killed by a signal: 137 SIGKILL or OOM-kill, 143 SIGTERM after
    a checkpoint) retryable; the container reasons in `RETRYABLE_CONTAINER_REASONS` retryable;
    the trainer's 3 (store unavailable: the checkpoint is kept and a rerun continues)
    retryable; any other code (1 unexpected error, 2 invalid job or data) permanent.
    """
    if exit_code == 0:
        return ExitKind.SUCCEEDED
    if container_reason in RETRYABLE_CONTAINER_REASONS:
        return ExitKind.RETRYABLE
    if exit_code >= SIGNAL_EXIT_CODE_MIN or exit_code in RETRYABLE_EXIT_CODES:
        return ExitKind.RETRYABLE
    return ExitKind.PERMANENT


def describe_exit(exit_code: int, container_reason: str | None) -> str:
    """"exit code 137 (SIGKILL)", "exit code 2", "exit code 137 (OOMKilled)"."""
    details = []
    if container_reason and container_reason not in ("Error", "Completed"):
        details.append(container_reason)
    if exit_code >= SIGNAL_EXIT_CODE_MIN:
        try:
            details.append(signal.Signals(exit_code - SIGNAL_EXIT_CODE_MIN).name)
        except ValueError:
            pass
    return f"exit code {exit_code}" + (f" ({', '.join(details)})" if details else "")


def after_exit(
    exit_code: int,
    container_reason: str | None,
    trainer_message: str,
    *,
    restarts: int,
    backoff_limit: int,
    reported: bool = True,
) -> Verdict:
    """The verdict on a finished trainer pod.

    Retryable with restarts left -> restart (resume from the checkpoint); retryable with none
    left -> Failed/BackoffLimitExceeded; permanent -> Failed/PermanentError at once, whatever
    the backoff limit (a job must never stay Restarting forever). Exit 0 without a result (an
    own loop that never reported) is permanent too: rerunning it would not report either.

    Args:
        exit_code: the container's exit code.
        container_reason: the container's terminated reason (Completed, Error, OOMKilled...).
        trainer_message: the trainer's own words (termination message), may be empty.
        restarts: restarts already used by the job.
        backoff_limit: spec.runPolicy.backoffLimit.
        reported: whether the trainer left its result (in the termination message).
    """
    kind = classify_exit(exit_code, container_reason)
    how = describe_exit(exit_code, container_reason)
    said = f": {trainer_message}" if trainer_message else ""
    if kind is ExitKind.SUCCEEDED and not reported:
        return Verdict(Action.FAIL, api.Reason.PERMANENT_ERROR,
                       "Trainer exited 0 without reporting a result; an own training loop ends "
                       "with ctx.finish(model) (ctx = kiln_trainer.job_context()), which writes "
                       "it; fix the loop and create the job again.")
    if kind is ExitKind.SUCCEEDED:
        return Verdict(Action.SUCCEED, api.Reason.TRAINING_COMPLETED, "Training completed.")
    if kind is ExitKind.PERMANENT:
        return Verdict(Action.FAIL, api.Reason.PERMANENT_ERROR,
                       f"Trainer failed with {how}, which is not retryable{said}; fix the job "
                       "and create it again.")
    if restarts >= backoff_limit:
        return Verdict(Action.FAIL, api.Reason.BACKOFF_LIMIT_EXCEEDED,
                       f"Trainer exited with retryable {how} after {restarts} of "
                       f"{backoff_limit} restarts (backoffLimit){said}; raise "
                       "spec.runPolicy.backoffLimit or look at the pod's log.")
    return Verdict(Action.RESTART, api.Reason.TRAINER_EXITED,
                   f"Trainer exited with retryable {how}{said}; restart {restarts + 1} of "
                   f"{backoff_limit}, resuming from the last checkpoint.")


def deadline_passed(start_seconds: float | None, deadline_seconds: int | None,
                    now: float) -> bool:
    """Whether an active job has run past activeDeadlineSeconds.

    `start_seconds` is status.startTime: set when the job is placed, reset when it resumes
    from suspension.
    """
    return (start_seconds is not None and deadline_seconds is not None
            and now >= start_seconds + deadline_seconds)


def ttl_expired(completion_seconds: float | None, ttl_seconds: int | None, now: float) -> bool:
    """Whether a finished job has outlived ttlSecondsAfterFinished."""
    return (completion_seconds is not None and ttl_seconds is not None
            and now >= completion_seconds + ttl_seconds)


def pods_to_clean(job_pods: Iterable[pods.PodState], policy: api.CleanPodPolicy) -> list[str]:
    """Names of the pods cleanPodPolicy deletes when the job ends.

    All: every pod of the job; Running: those not yet finished; None: none.
    """
    if policy == api.CleanPodPolicy.NONE:
        return []
    return [p.name for p in job_pods
            if policy == api.CleanPodPolicy.ALL or not p.finished]

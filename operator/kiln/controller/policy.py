"""runPolicy as decisions: exit codes, restarts, deadline, TTL, pods to clean or stop, and
pods that do not start.

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
# Waiting reasons of a container whose image cannot be pulled (the kubelet alternates the
# first two while it backs off, so they are one problem: reported once).
IMAGE_PULL_REASONS = frozenset({"ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull",
                                "RegistryUnavailable", "SignatureValidationFailed"})
# What a stuck container's waiting reason asks of the user: (what is wrong, how to fix it).
_WAITING_ADVICE = {
    "InvalidImageName": ("has an invalid image name {image}",
                         "fix spec.template.image (or the operator's --default-image)"),
    "CreateContainerConfigError": (
        "cannot be configured",
        ("a Secret or ConfigMap it references (env, envFrom, volumes, the zoo credentials "
         "Secret) is missing or lacks the key; create it")),
    "CreateContainerError": ("cannot be created",
                             "check spec.template (command, volumes, securityContext)"),
    "RunContainerError": ("cannot be run",
                          "check the image's entrypoint and spec.template.command"),
    "CrashLoopBackOff": ("keeps crashing",
                         "read its log with kubectl logs --previous and fix the cause"),
}


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
        spends_restart: whether a restart spends one of spec.runPolicy.backoffLimit (not
            after a disruption).
    """

    action: Action
    reason: api.Reason
    message: str
    spends_restart: bool = True


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


def after_disruption(pod: str, disruption: str, how: str, *, restarts: int,
                     backoff_limit: int) -> Verdict:
    """The verdict on a trainer pod that Kubernetes ended for a reason outside it (its
    DisruptionTarget condition: preemption, eviction, node drain): restart from the checkpoint,
    spending no restart of the backoff limit, as the Job controller's podFailurePolicy `Ignore`
    on DisruptionTarget does.

    Args:
        pod: the pod's name.
        disruption: its DisruptionTarget condition's "reason: message".
        how: how the trainer ended (`describe_exit`, or that the pod was deleted).
        restarts: restarts already used by the job.
        backoff_limit: spec.runPolicy.backoffLimit.
    """
    return Verdict(Action.RESTART, api.Reason.POD_DISRUPTED,
                   f"Trainer pod {pod} was disrupted ({disruption}; {how}); it resumes from "
                   f"the last checkpoint, and a disruption spends no restart of backoffLimit "
                   f"({restarts} of {backoff_limit} used).", spends_restart=False)


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


@dataclasses.dataclass(frozen=True)
class NotStarted:
    """Why a job's pod has not started, as the job's Running=False condition tells it.

    Attributes:
        reason: PodPending (a container is stuck waiting) or Unschedulable.
        problem: the message's first clause, the same for as long as the problem is (the
            kubelet's changing words come after it), so the user hears of it once.
        message: the problem, the kubelet's or scheduler's words, and how to fix it.
    """

    reason: api.Reason
    problem: str
    message: str


def not_started(state: pods.PodState, *, role: str = "Trainer") -> NotStarted | None:
    """What keeps a Pending pod from starting: a stuck container or the scheduler; None while
    it is merely being set up (pulling, creating containers) or once it is no longer Pending.
    """
    if state.phase != "Pending" or state.deleting:
        return None
    waiting = state.waiting
    if waiting is not None:
        which = f"{'init container' if waiting.init else 'container'} {waiting.container}"
        said = f"{waiting.reason}: {waiting.message}" if waiting.message else waiting.reason
        if waiting.reason in IMAGE_PULL_REASONS:
            what = f"cannot pull image {waiting.image}"
            fix = ("fix spec.template.image (or the operator's --default-image), or give the "
                   "registry's credentials in spec.template.imagePullSecrets")
        else:
            what, fix = _WAITING_ADVICE.get(waiting.reason, (
                f"is waiting with {waiting.reason}", "see kubectl describe pod"))
            what = what.format(image=waiting.image)
        problem = f"{role} pod {state.name} has not started: {which} {what}"
        return NotStarted(api.Reason.POD_PENDING, problem,
                          f"{problem} ({said}); {fix}, then create the job again.")
    if state.unschedulable is not None:
        problem = f"{role} pod {state.name} cannot be scheduled"
        return NotStarted(api.Reason.UNSCHEDULABLE, problem, (
            f"{problem}: {state.unschedulable}; check spec.template's nodeSelector, "
            "tolerations and affinity against the nodes' labels, taints and free resources."))
    return None


def start_timed_out(state: pods.PodState, timeout_seconds: float, now: float) -> bool:
    """Whether a pod is still not running `timeout_seconds` after its launch (0: never)."""
    return (timeout_seconds > 0 and state.phase == "Pending" and not state.deleting
            and state.started is not None and now >= state.started + timeout_seconds)


def start_timeout_message(state: pods.PodState, timeout_seconds: float, *,
                          role: str = "Trainer") -> str:
    """Why a job failed because its `role` pod did not start in time, and how to fix it."""
    stuck = not_started(state, role=role)
    if stuck is not None:
        why = stuck.message
    elif state.starting is not None:
        why = (f"Its container {state.starting.container} (image {state.starting.image}) was "
               f"still {state.starting.reason}; check its volumes and image size, or raise "
               "the operator's --pod-start-timeout-seconds.")
    else:
        why = ("It was still Pending; kubectl describe pod shows why, or raise the operator's "
               "--pod-start-timeout-seconds.")
    return (f"{role} pod {state.name} was not running {timeout_seconds:g} s after its launch "
            f"(--pod-start-timeout-seconds), so it was deleted and its devices released. "
            f"{why}")


def pods_to_stop(job_pods: Iterable[pods.PodState], policy: api.CleanPodPolicy) -> list[str]:
    """Names of the pods whose trainers are stopped, not deleted, when the job ends.

    cleanPodPolicy decides which pod objects remain for their logs, never whether a trainer
    keeps running: every active pod it keeps is stopped.
    """
    listed = list(job_pods)
    cleaned = set(pods_to_clean(listed, policy))
    return [p.name for p in listed if p.active and p.name not in cleaned]


def pods_to_clean(job_pods: Iterable[pods.PodState], policy: api.CleanPodPolicy) -> list[str]:
    """Names of the pods cleanPodPolicy deletes when the job ends.

    All: every pod of the job; Running: those not yet finished; None: none.
    """
    if policy == api.CleanPodPolicy.NONE:
        return []
    return [p.name for p in job_pods
            if policy == api.CleanPodPolicy.ALL or not p.finished]

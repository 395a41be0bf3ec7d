"""The API's vocabulary: identity, name rules, closed sets of wire strings, the error, the base.

`ApiModel`, the base of every wire type, holds the one snake_case to camelCase mapping.
"""

from __future__ import annotations

import enum
import functools
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic.alias_generators import to_camel

GROUP = "kiln.dev"
# How the operator labels a job's trainer pods, which `kiln logs` selects by.
JOB_NAME_LABEL = "kiln.dev/job-name"
ATTEMPT_LABEL = "kiln.dev/attempt"
RANK_LABEL = "kiln.dev/rank"  # of a multi-node job's pods
CONTAINER_NAME = "trainer"  # the trainer pod's container
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "TrainingJob"
PLURAL = "trainingjobs"
SINGULAR = "trainingjob"
SHORT_NAMES = ("tj", "kjob")
CATEGORIES = ("all", "kiln")

# Kubernetes object names for pods derive from the job name, so keep DNS-1123 labels. The
# namespace is one too (RFC 1123 label); both also name local files and store keys.
NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
NAME_MAX_LENGTH = 63
# A PriorityClass name is a DNS-1123 subdomain (dots allowed), written without a group.
SUBDOMAIN_PATTERN = r"^[a-z0-9]$|^[a-z0-9][-a-z0-9.]*[a-z0-9]$"


def non_ascii(value: str) -> str | None:
    """"has a non-ASCII character 'е' (U+0435) at position 2" for the first one in `value`
    (positions count from 1), or None: look-alike letters are invisible in a message."""
    for position, char in enumerate(value, start=1):
        if not char.isascii():
            return f"has a non-ASCII character {char!r} (U+{ord(char):04X}) at position {position}"
    return None

# spec.warmStart.parent: "auto" or a zoo model id. The id rule is kiln.zoo.records' (one safe
# key component); repeated here because api sits below zoo in the layers.
# spec.model.pretrained.uri and spec.dataset.uri: an s3:// key, an hf:// repository or a path.
SOURCE_URI_MAX_LENGTH = 1024
PARENT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
PARENT_MAX_LENGTH = 128

# spec.model.entrypoint and spec.dataset.entrypoint: "package.module:callable", dotted Python
# identifiers on both sides of one colon (the callable may be an attribute path, Class.method).
ENTRYPOINT_PATTERN = (r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"
                      r":[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
ENTRYPOINT_MAX_LENGTH = 256

# Largest H, W or sequence length in spec.model.inputShape: beyond it one sample alone takes
# gigabytes, and shape arithmetic in the model builders overflows.
INPUT_DIM_MAX = 16384

# spec.dataset.torchvisionClass values: the torchvision dataset classes the trainer knows how to
# open as a labelled training split (`kiln_trainer.data` keeps the matching constructor table).
TORCHVISION_CLASSES = (
    "MNIST", "FashionMNIST", "KMNIST", "QMNIST", "USPS", "CIFAR10", "CIFAR100", "SVHN", "STL10",
)


class InvalidSpec(ValueError):
    """A job document failed validation; `problems` lists every one, one line each.

    Attributes:
        problems: every problem found, one ``field.path: what is wrong`` line each.
        source: where the document came from (a file, a namespace/name), or "".
        job: the document as far as it parses (a TrainingJob, or a TrainingSweep for kind
            TrainingSweep), each field the schema rejected reset to its default, so the checks that do not read those fields can still run; None when even
            that does not parse (or nothing was parsed).
        rejected: the field paths the schema rejected (an unknown key's parent object).
        kind: the document's kind, named in the message (TrainingJob or TrainingSweep).
    """

    def __init__(self, problems: list[str], *, source: str = "", job: Any = None,
                 rejected: tuple[str, ...] = (), kind: str = KIND) -> None:
        self.problems = problems
        self.source = source
        self.job = job
        self.rejected = rejected
        where = f"{source}: " if source else ""
        self.kind = kind
        super().__init__(where + f"invalid {kind}:\n  " + "\n  ".join(problems))


class Phase(enum.StrEnum):
    """Coarse job state shown in `kubectl get`; derived from conditions, never set directly."""

    PENDING = "Pending"
    QUEUED = "Queued"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    SUSPENDED = "Suspended"


class ConditionType(enum.StrEnum):
    """The closed set of condition types (Kubeflow vocabulary plus Kiln's own)."""

    CREATED = "Created"  # the job was accepted and validated
    PROFILED = "Profiled"  # an entrypoint model was measured in its own image before placement
    WARM_STARTED = "WarmStarted"  # True: a zoo parent was chosen; False: cold start (reason says why)
    QUEUED = "Queued"  # waiting for the placement plan to reach it
    PLACED = "Placed"  # the planner gave it a node, GPU count and parallelism
    RUNNING = "Running"  # trainer pod(s) running
    RESTARTING = "Restarting"  # trainer exited with a retryable code and is being restarted
    SUCCEEDED = "Succeeded"  # training finished and the model was registered
    FAILED = "Failed"  # terminal failure; reason says which
    SUSPENDED = "Suspended"  # runPolicy.suspend is true


class Reason(enum.StrEnum):
    """CamelCase reasons, grouped by the condition they explain; events reuse them."""

    # Created
    JOB_CREATED = "JobCreated"
    # Profiled
    PROFILING = "Profiling"  # Unknown: the profiling pod is running
    MODEL_PROFILED = "ModelProfiled"
    PROFILING_FAILED = "ProfilingFailed"  # False: placement uses estimates, the trainer decides
    # WarmStarted
    PARENT_SELECTED = "ParentSelected"
    COLD_START = "ColdStart"
    WARM_START_DISABLED = "WarmStartDisabled"
    DECIDED_IN_TRAINER = "DecidedInTrainer"  # Unknown until an entrypoint job's trainer reports
    WARM_START_GUARDED = "WarmStartGuarded"  # event: the probe guard refused the admitted parent
    ZOO_UNAVAILABLE = "ZooUnavailable"
    # Placed / Queued
    WAITING_FOR_PLACEMENT = "WaitingForPlacement"
    PLANNED = "Planned"
    NO_FEASIBLE_CONFIG = "NoFeasibleConfig"
    WAITING_FOR_KUEUE = "WaitingForKueueAdmission"  # Queued: its Workload has no admission yet
    ADMITTED_BY_KUEUE = "AdmittedByKueue"  # Queued: Kueue admitted it; Kiln places it there
    EVICTED_BY_KUEUE = "EvictedByKueue"  # Queued again: Kueue evicted its Workload
    SOLVED_WITHIN_TIME_LIMIT = "SolvedWithinTimeLimit"
    # Running / Restarting
    TRAINER_STARTED = "TrainerStarted"
    TRAINER_EXITED = "TrainerExited"
    POD_DISRUPTED = "PodDisrupted"  # Restarting: preempted, evicted or drained (no backoff)
    POD_PENDING = "PodPending"  # False: a container of the pod is stuck waiting (image, config)
    UNSCHEDULABLE = "Unschedulable"  # False: the scheduler cannot bind the pod
    RESIZED = "Resized"  # Restarting: checkpoint-restart at another device count or node
    FAILED_CREATE = "FailedCreate"  # False: the API server refused the pod (a ResourceQuota)
    # Succeeded
    TRAINING_COMPLETED = "TrainingCompleted"
    # Failed
    INVALID_SPEC = "InvalidSpec"
    RUNTIME_NOT_FOUND = "RuntimeNotFound"  # spec.runtimeRef names no runtime
    BACKOFF_LIMIT_EXCEEDED = "BackoffLimitExceeded"
    PERMANENT_ERROR = "PermanentError"
    DEADLINE_EXCEEDED = "DeadlineExceeded"
    POD_START_TIMEOUT = "PodStartTimeout"  # the pod was not running within the start timeout
    MODEL_DISCARDED = "ModelDiscarded"  # event: a failed job's late zoo model was deleted
    # Suspended
    SUSPENDED_BY_USER = "SuspendedByUser"
    RESUMED = "Resumed"
    UNEXPECTED_ERROR = "UnexpectedError"
    SPEC_EDIT_IGNORED = "SpecEditIgnored"  # event: an edit that a running job does not take
    REPORT_REFUSED = "ReportRefused"  # event: a pod reported what its job was not granted


class WarmStartOutcome(enum.StrEnum):
    """What a warm-start decision is, for conditions and metrics (its reason says why)."""

    WARM = "warm"  # a parent was selected by the policy
    PINNED = "pinned"  # the spec pinned the parent
    COLD_EMPTY = "cold_empty"  # the zoo has no models
    COLD_INCOMPATIBLE = "cold_incompatible"  # no model with the child's modality and task
    COLD_BELOW_MIN_SIMILARITY = "cold_below_min_similarity"
    COLD_FEW_TENSORS = "cold_few_tensors"  # < 10% of the child's weight tensors transfer
    COLD_UNTRACEABLE = "cold_untraceable"  # the child's architecture graph cannot be extracted
    COLD_UNREADABLE_PARENT = "cold_unreadable_parent"  # the parent record is corrupt or gone
    COLD_OTHER_FAMILY = "cold_other_family"  # residual vs plain: no function transfers
    COLD_GUARD = "cold_guard"  # the warm child was no better than a cold one on the probe
    DISABLED = "disabled"  # spec.warmStart.enabled is false
    IN_TRAINER = "in_trainer"  # an entrypoint model: the trainer decides, before its first step
    INIT_STATE = "init_state"  # the run's own code set the initial weights; nothing was decided


class ModelTask(enum.StrEnum):
    """What a model's output means, so Kiln's loop knows its loss and metrics."""

    CLASSIFICATION = "classification"  # logits Tensor[B, K]: cross-entropy over classes, accuracy
    LANGUAGE_MODEL = "language_model"  # logits Tensor[B, T, V]: next-token cross-entropy


class TargetMetric(enum.StrEnum):
    VALIDATION_ACCURACY = "validation_accuracy"
    VALIDATION_LOSS = "validation_loss"


def metric_problem(metric: str, value: float) -> str | None:
    """What is wrong with `value` as a `metric`, or None: an accuracy is a fraction in [0, 1]
    (an own loop may report a percentage), a loss is a cross-entropy, at least 0. A trainer's
    report, an imported model's --metric and a record all pass this: a value out of range
    would end a sweep at its target or rank a parent first."""
    if metric == TargetMetric.VALIDATION_ACCURACY and not 0.0 <= value <= 1.0:
        return f"an accuracy is a fraction in [0, 1] (got {value}); write 0.91, not 91"
    if metric == TargetMetric.VALIDATION_LOSS and value < 0.0:
        return f"a loss is a cross-entropy, at least 0 (got {value})"
    return None


class DatasetName(enum.StrEnum):
    DIGITS = "digits"  # scikit-learn's bundled handwritten digits (1,797 8x8 images)
    IMAGEFOLDER = "imagefolder"  # torchvision ImageFolder at `path`
    TORCHVISION = "torchvision"  # a torchvision dataset class (`torchvisionClass`) with root `path`
    TEXT = "text"  # a UTF-8 text file at `path`, byte-level characters


class Augmentation(enum.StrEnum):
    NONE = "none"  # deterministic inputs (frozen-prefix outputs may be cached)
    FLIP_CROP = "flip-crop"  # random horizontal flip and padded crop (images only)


class OptimizerName(enum.StrEnum):
    SGD = "sgd"
    ADAM = "adam"
    ADAMW = "adamw"


class ScheduleName(enum.StrEnum):
    CONSTANT = "constant"
    COSINE = "cosine"
    STEP = "step"


class Parallelism(enum.StrEnum):
    AUTO = "auto"
    SINGLE = "single"
    DDP = "ddp"
    FSDP = "fsdp"


class Precision(enum.StrEnum):
    FP32 = "fp32"  # no autocast
    BF16 = "bf16"  # autocast to bfloat16 (CUDA and CPU)
    FP16 = "fp16"  # autocast to float16 with a gradient scaler


class CleanPodPolicy(enum.StrEnum):
    ALL = "All"
    RUNNING = "Running"
    NONE = "None"


class FreezingMode(enum.StrEnum):
    AUTO = "auto"  # int8 reference where quantization works, else fp32 (logged)
    FP32 = "fp32"  # always an fp32 reference copy (more CPU, no quantization noise)


class CacheMode(enum.StrEnum):
    AUTO = "auto"  # cache frozen-prefix outputs when the inputs are deterministic
    OFF = "off"


class FreezingTest(enum.StrEnum):
    PLASTICITY = "plasticity"  # Egeria: activations drift little from a reference copy
    GRADIENT_NORM = "gradientNorm"  # AutoFreeze: gradient norms change little per interval


class TransferredMode(enum.StrEnum):
    JUDGE = "judge"  # copied modules may freeze from the first decision, no bootstrap wait
    FREEZE = "freeze"  # copied modules start frozen at step 0 and thaw on a measured rise
    IGNORE = "ignore"  # the warm start's copies are treated as any other module


class ZooShare(enum.StrEnum):
    PRIVATE = "private"  # only jobs of the record's namespace see it
    SHARED = "shared"  # every namespace sees it


class ApiModel(BaseModel):
    """Base of every wire type: camelCase on the wire, unknown fields rejected, immutable."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        use_enum_values=False,
    )

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """Drop nulls of fields that have a default and are not nullable, so the default applies.

        The API server does the same (structural-schema defaulting replaces such a null with the
        field's default), so `dataset: null` is accepted by `kubectl apply` and by `parse_job`.
        """
        if not isinstance(data, dict):
            return data
        defaulted = _null_defaulted(cls)
        return {k: v for k, v in data.items() if v is not None or k not in defaulted}


@functools.cache
def _null_defaulted(model: type[BaseModel]) -> frozenset[str]:
    """Wire and Python names of `model`'s fields that have a default and do not accept null."""
    names: set[str] = set()
    for name, field in model.model_fields.items():
        nullable = field.annotation is None or type(None) in typing.get_args(field.annotation)
        if not field.is_required() and not nullable:
            names |= {name, field.alias or name}
    return frozenset(names)

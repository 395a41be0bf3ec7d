"""TrainingJob API (kiln.dev/v1alpha1): spec and status types, defaults, validation.

The single source of truth for the job format. `kiln.crd` generates the CRD's
structural schema from these types; the CLI, the local runner, the trainer and
the operator all parse jobs through `parse_job`. Python names are snake_case,
the wire names camelCase (one alias generator, below).

Two kinds of checks:
  * single-field checks (types, enums, bounds, unknown fields) live in the types
    and therefore also in the CRD schema; `check_schema` runs exactly these;
  * cross-field checks live in `validate` and report every problem as
    ``field.path: what is wrong (got X); fix``.

Non-goals: no I/O beyond reading YAML text, never imports torch or kopf.
"""

from __future__ import annotations

import difflib
import enum
import functools
import json
import math
import re
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

GROUP = "kiln.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "TrainingJob"
PLURAL = "trainingjobs"
SINGULAR = "trainingjob"
SHORT_NAMES = ("tj", "kjob")
CATEGORIES = ("all", "kiln")

# Kubernetes object names for pods derive from the job name, so keep DNS-1123 labels.
NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
NAME_MAX_LENGTH = 63

# spec.warmStart.parent: "auto" or a zoo model id. The id rule is kiln.zoo.records' (one safe
# key component); repeated here because api sits below zoo in the layers.
PARENT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
PARENT_MAX_LENGTH = 128

# Largest H, W or sequence length in spec.model.inputShape: beyond it one sample alone takes
# gigabytes, and shape arithmetic in the model builders overflows.
INPUT_DIM_MAX = 16384

# spec.dataset.torchvisionClass values: the torchvision dataset classes the trainer knows how to
# open as a labelled training split (`kiln_trainer.data` keeps the matching constructor table).
TORCHVISION_CLASSES = (
    "MNIST", "FashionMNIST", "KMNIST", "QMNIST", "USPS", "CIFAR10", "CIFAR100", "SVHN", "STL10",
)


class InvalidSpec(ValueError):
    """A job document failed validation; `problems` lists every one, one line each."""

    def __init__(self, problems: list[str], *, source: str = "") -> None:
        self.problems = problems
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(where + "invalid TrainingJob:\n  " + "\n  ".join(problems))


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
    # WarmStarted
    PARENT_SELECTED = "ParentSelected"
    COLD_START = "ColdStart"
    WARM_START_DISABLED = "WarmStartDisabled"
    ZOO_UNAVAILABLE = "ZooUnavailable"
    # Placed / Queued
    WAITING_FOR_PLACEMENT = "WaitingForPlacement"
    PLANNED = "Planned"
    NO_FEASIBLE_CONFIG = "NoFeasibleConfig"
    SOLVED_WITHIN_TIME_LIMIT = "SolvedWithinTimeLimit"
    # Running / Restarting
    TRAINER_STARTED = "TrainerStarted"
    TRAINER_EXITED = "TrainerExited"
    # Succeeded
    TRAINING_COMPLETED = "TrainingCompleted"
    # Failed
    INVALID_SPEC = "InvalidSpec"
    BACKOFF_LIMIT_EXCEEDED = "BackoffLimitExceeded"
    PERMANENT_ERROR = "PermanentError"
    DEADLINE_EXCEEDED = "DeadlineExceeded"
    # Suspended
    SUSPENDED_BY_USER = "SuspendedByUser"
    RESUMED = "Resumed"
    UNEXPECTED_ERROR = "UnexpectedError"


class TargetMetric(enum.StrEnum):
    VALIDATION_ACCURACY = "validation_accuracy"
    VALIDATION_LOSS = "validation_loss"


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


class CleanPodPolicy(enum.StrEnum):
    ALL = "All"
    RUNNING = "Running"
    NONE = "None"


class _Api(BaseModel):
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


PositiveInt = Annotated[int, Field(ge=1)]
InputDim = Annotated[int, Field(ge=1, le=INPUT_DIM_MAX)]


# ----------------------------------------------------------------------------------------------
# spec


class ModelSpec(_Api):
    architecture: str = Field(
        min_length=1,
        description="architecture: registry name, e.g. resnet18, small_resnet, char_transformer "
        "(`kiln models` lists them).",
    )
    args: dict[str, Any] = Field(
        default_factory=dict,
        description="args: keyword arguments of the architecture builder, e.g. num_classes, depth.",
    )
    input_shape: list[InputDim] = Field(
        min_length=1,
        max_length=3,
        description="inputShape: one sample's shape without the batch: [C, H, W] for images, "
        f"[sequenceLength] for text; each at most {INPUT_DIM_MAX}.",
    )


class DatasetSpec(_Api):
    name: DatasetName = Field(
        default=DatasetName.DIGITS,
        description="name: the loader: digits, imagefolder, torchvision or text.",
    )
    path: str | None = Field(
        default=None,
        description="path: dataset location: ImageFolder directory, torchvision root, or a text "
        "file or folder of text files.",
    )
    torchvision_class: str | None = Field(
        default=None,
        description="torchvisionClass: torchvision dataset class when name is torchvision: "
        f"{', '.join(TORCHVISION_CLASSES)}.",
    )
    download: bool = Field(
        default=False,
        description="download: let a torchvision dataset download itself (off: data must exist).",
    )
    validation_fraction: float = Field(
        default=0.2,
        gt=0.0,
        lt=1.0,
        description="validationFraction: share of samples held out for validation, split by seed.",
    )
    augmentation: Augmentation = Field(
        default=Augmentation.NONE,
        description="augmentation: none (deterministic) or flip-crop (random, images only).",
    )
    max_samples: int | None = Field(
        default=None,
        ge=1,
        description="maxSamples: use at most this many samples (text: characters / length).",
    )
    split_seed: int = Field(
        default=0,
        ge=0,
        description="splitSeed: seeds the train/validation split (and the maxSamples subset); "
        "keep it equal across jobs on one dataset so a zoo parent never trained on a child's "
        "validation samples.",
    )


class OptimizerSpec(_Api):
    name: OptimizerName = Field(default=OptimizerName.SGD, description="name: sgd, adam or adamw.")
    lr: float = Field(default=0.1, gt=0.0, le=10.0, description="lr: base learning rate.")
    momentum: float = Field(default=0.9, ge=0.0, lt=1.0, description="momentum: SGD momentum.")
    weight_decay: float = Field(
        default=5e-4, ge=0.0, le=1.0, description="weightDecay: L2 penalty (decoupled for adamw)."
    )
    nesterov: bool = Field(default=False, description="nesterov: Nesterov momentum for SGD.")


class LrScheduleSpec(_Api):
    name: ScheduleName = Field(
        default=ScheduleName.COSINE, description="name: constant, cosine or step."
    )
    warmup_epochs: int = Field(
        default=0, ge=0, description="warmupEpochs: linear warm-up epochs before the schedule."
    )
    step_epochs: int = Field(
        default=10, ge=1, description="stepEpochs: epochs between decays (step schedule)."
    )
    gamma: float = Field(
        default=0.1, gt=0.0, lt=1.0, description="gamma: decay factor (step schedule)."
    )


class TrainingSpec(_Api):
    epochs: int = Field(default=30, ge=1, le=100000, description="epochs: upper bound on epochs.")
    batch_size: int = Field(
        default=128, ge=1, le=65536, description="batchSize: global mini-batch size in samples."
    )
    optimizer: OptimizerSpec = Field(
        default_factory=OptimizerSpec, description="optimizer: optimizer and its settings."
    )
    lr_schedule: LrScheduleSpec = Field(
        default_factory=LrScheduleSpec, description="lrSchedule: learning-rate schedule."
    )
    seed: int = Field(default=0, ge=0, description="seed: seeds initialisation and shuffling.")
    eval_every_steps: int | None = Field(
        default=None,
        ge=1,
        description="evalEverySteps: also evaluate every N optimizer steps (default: per epoch).",
    )
    grad_clip_norm: float | None = Field(
        default=None, gt=0.0, description="gradClipNorm: clip the global gradient norm."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="device: auto uses CUDA when present."
    )


class TargetSpec(_Api):
    metric: TargetMetric = Field(
        default=TargetMetric.VALIDATION_ACCURACY,
        description="metric: validation_accuracy (higher is better) or validation_loss (lower).",
    )
    value: float = Field(
        description="value: the goal; accuracy in (0, 1], loss > 0.",
    )
    stop_at_target: bool = Field(
        default=True, description="stopAtTarget: stop training once the target is reached."
    )


class WarmStartSpec(_Api):
    enabled: bool = Field(default=True, description="enabled: start from the most similar model.")
    parent: str = Field(
        default="auto",
        min_length=1,
        max_length=PARENT_MAX_LENGTH,
        pattern=PARENT_PATTERN,
        description="parent: auto, or a pinned zoo model id from `kiln zoo ls`, e.g. "
        "small_resnet-7f3c2a1b.",
    )
    min_similarity: float = Field(
        default=0.3,
        ge=0.0,
        le=1.0,
        description="minSimilarity: below this architectural similarity, cold start.",
    )


class FreezingMode(enum.StrEnum):
    AUTO = "auto"  # int8 reference where quantization works, else fp32 (logged)
    FP32 = "fp32"  # always an fp32 reference copy (more CPU, no quantization noise)


class CacheMode(enum.StrEnum):
    AUTO = "auto"  # cache frozen-prefix outputs when the inputs are deterministic
    OFF = "off"


class FreezingSpec(_Api):
    """Egeria layer freezing (EuroSys'23); defaults follow the research digest's design."""

    enabled: bool = Field(
        default=True, description="enabled: freeze front layers once they stop learning."
    )
    check_every_steps: int | None = Field(
        default=None,
        ge=1,
        description="checkEverySteps: steps between plasticity probes (default: 8 per "
        "epoch, at least 10 steps apart).",
    )
    window: int = Field(
        default=5, ge=3, le=100, description="window: probes per reference refresh and slope fit."
    )
    tolerance: float = Field(
        default=0.1,
        gt=0.0,
        le=10.0,
        description="tolerance: normalised plasticity slope below which a module is converged.",
    )
    patience: int = Field(
        default=2, ge=1, le=20, description="patience: converged windows in a row before freezing."
    )
    probe_batch_size: int = Field(
        default=32, ge=2, le=1024, description="probeBatchSize: samples in the fixed probe batch."
    )
    max_frozen_fraction: float = Field(
        default=0.8,
        gt=0.0,
        lt=1.0,
        description="maxFrozenFraction: cap on the share of modules frozen (the head never is).",
    )
    reference: FreezingMode = Field(
        default=FreezingMode.AUTO, description="reference: auto (int8 when possible) or fp32."
    )
    reference_threads: int = Field(
        default=1, ge=1, le=64, description="referenceThreads: CPU threads of the reference model."
    )
    cache: CacheMode = Field(
        default=CacheMode.AUTO, description="cache: auto or off (frozen-prefix output cache)."
    )
    cache_memory_mib: int = Field(
        default=1024,
        ge=0,
        alias="cacheMemoryMiB",
        description="cacheMemoryMiB: RAM for the cache; beyond it, a memory-mapped file.",
    )


class ResourcesSpec(_Api):
    gpus: int | None = Field(
        default=None,
        ge=0,
        le=64,
        description="gpus: GPUs per job; omit to let the planner choose (0 = CPU only).",
    )
    parallelism: Parallelism = Field(
        default=Parallelism.AUTO, description="parallelism: auto, single, ddp or fsdp."
    )
    gpus_per_node: int | None = Field(
        default=None, ge=1, le=64, description="gpusPerNode: cap on GPUs taken on one node."
    )


class ZooSpec(_Api):
    register_model: bool = Field(
        default=True, alias="register", description="register: add the trained model to the zoo."
    )


class RunPolicySpec(_Api):
    backoff_limit: int = Field(
        default=3, ge=0, le=100, description="backoffLimit: retries after retryable failures."
    )
    active_deadline_seconds: int | None = Field(
        default=None, ge=1, description="activeDeadlineSeconds: fail the job after this long."
    )
    ttl_seconds_after_finished: int | None = Field(
        default=None, ge=0, description="ttlSecondsAfterFinished: delete the job this long after."
    )
    clean_pod_policy: CleanPodPolicy = Field(
        default=CleanPodPolicy.RUNNING,
        description="cleanPodPolicy: pods deleted when the job ends: All, Running or None.",
    )
    suspend: bool = Field(default=False, description="suspend: stop pods and hold the job.")


class TrainingJobSpec(_Api):
    model: ModelSpec = Field(description="model: architecture, builder arguments, input shape.")
    dataset: DatasetSpec = Field(default_factory=DatasetSpec, description="dataset: data source.")
    training: TrainingSpec = Field(
        default_factory=TrainingSpec, description="training: epochs, batch, optimizer, schedule."
    )
    target: TargetSpec | None = Field(
        default=None, description="target: metric goal for time-to-target and early stop."
    )
    warm_start: WarmStartSpec = Field(
        default_factory=WarmStartSpec, description="warmStart: model-zoo warm start."
    )
    freezing: FreezingSpec = Field(
        default_factory=FreezingSpec, description="freezing: layer freezing."
    )
    resources: ResourcesSpec = Field(
        default_factory=ResourcesSpec, description="resources: GPUs and parallelism."
    )
    zoo: ZooSpec = Field(default_factory=ZooSpec, description="zoo: registration of the result.")
    run_policy: RunPolicySpec = Field(
        default_factory=RunPolicySpec, description="runPolicy: restarts, deadline, TTL, cleanup."
    )
    template: dict[str, Any] = Field(
        default_factory=dict,
        description="template: pod template overrides (image, nodeSelector, tolerations, env).",
    )


class ObjectMeta(_Api):
    """Kubernetes object metadata: what a job file carries plus the fields the server sets.

    Unknown keys are rejected (as `kubectl apply` does with strict field validation), so a typo
    such as `lables` is an error rather than silently ignored.
    """

    name: str = Field(
        min_length=1,
        max_length=NAME_MAX_LENGTH,
        pattern=NAME_PATTERN,
        description="name: DNS-1123 label (lowercase letters, digits, '-'; at most 63 characters).",
    )
    generate_name: str | None = Field(default=None, description="generateName: name prefix.")
    namespace: str | None = Field(default=None, description="namespace: the job's namespace.")
    self_link: str | None = Field(default=None, description="selfLink: set by the server.")
    uid: str | None = Field(default=None, description="uid: set by the server.")
    resource_version: str | None = Field(default=None, description="resourceVersion: server.")
    generation: int | None = Field(default=None, description="generation: spec generation.")
    creation_timestamp: str | None = Field(
        default=None, description="creationTimestamp: RFC 3339, set by the server."
    )
    deletion_timestamp: str | None = Field(
        default=None, description="deletionTimestamp: RFC 3339, set by the server."
    )
    deletion_grace_period_seconds: int | None = Field(
        default=None, description="deletionGracePeriodSeconds: set by the server."
    )
    labels: dict[str, str] = Field(default_factory=dict, description="labels: string map.")
    annotations: dict[str, str] = Field(
        default_factory=dict, description="annotations: string map."
    )
    owner_references: list[dict[str, Any]] | None = Field(
        default=None, description="ownerReferences: owning objects."
    )
    finalizers: list[str] | None = Field(default=None, description="finalizers: pending cleanup.")
    managed_fields: list[dict[str, Any]] | None = Field(
        default=None, description="managedFields: server-side apply bookkeeping."
    )


# ----------------------------------------------------------------------------------------------
# status (every field the operator writes must be declared: a structural schema prunes the rest)


class Condition(_Api):
    type: ConditionType = Field(description="type: one of the Kiln condition types.")
    status: Literal["True", "False", "Unknown"] = Field(description="status: True/False/Unknown.")
    reason: str = Field(default="", description="reason: CamelCase cause.")
    message: str = Field(default="", description="message: one sentence with numbers.")
    last_transition_time: str | None = Field(
        default=None, description="lastTransitionTime: RFC 3339 time the status last flipped."
    )
    observed_generation: int | None = Field(
        default=None, description="observedGeneration: spec generation the condition saw."
    )


class WarmStartStatus(_Api):
    parent: str | None = Field(default=None, description="parent: zoo model id, null if cold.")
    similarity: float | None = Field(default=None, description="similarity: in [0, 1].")
    parent_metric: float | None = Field(default=None, description="parentMetric: parent's metric.")
    matched_tensors: int | None = Field(default=None, description="matchedTensors: transferred.")
    total_tensors: int | None = Field(default=None, description="totalTensors: child's tensors.")
    reason: str | None = Field(default=None, description="reason: why this parent or cold start.")


class PlacementStatus(_Api):
    node: str | None = Field(default=None, description="node: planned node.")
    gpus: int | None = Field(default=None, description="gpus: planned GPU count.")
    parallelism: str | None = Field(default=None, description="parallelism: single/ddp/fsdp.")
    estimated_start: str | None = Field(default=None, description="estimatedStart: RFC 3339.")
    estimated_seconds: float | None = Field(default=None, description="estimatedSeconds: run.")


class ProgressStatus(_Api):
    epoch: int | None = Field(default=None, description="epoch: current epoch (1-based).")
    step: int | None = Field(default=None, description="step: optimizer steps so far.")
    train_loss: float | None = Field(default=None, description="trainLoss: recent training loss.")
    validation_accuracy: float | None = Field(default=None, description="validationAccuracy.")
    validation_loss: float | None = Field(default=None, description="validationLoss.")
    frozen_modules: int | None = Field(default=None, description="frozenModules: frozen prefix.")
    samples_per_second: float | None = Field(default=None, description="samplesPerSecond.")
    eta_seconds: float | None = Field(default=None, description="etaSeconds: time left.")


class ResultStatus(_Api):
    metric: float | None = Field(default=None, description="metric: final target metric.")
    validation_accuracy: float | None = Field(default=None, description="validationAccuracy.")
    validation_loss: float | None = Field(default=None, description="validationLoss.")
    zoo_model: str | None = Field(default=None, description="zooModel: registered zoo id.")
    wall_seconds: float | None = Field(default=None, description="wallSeconds: training time.")
    time_to_target_seconds: float | None = Field(
        default=None, description="timeToTargetSeconds: wall seconds until the target was met."
    )


class TrainingJobStatus(_Api):
    phase: Phase | None = Field(default=None, description="phase: derived from conditions.")
    conditions: list[Condition] = Field(default_factory=list, description="conditions.")
    warm_start: WarmStartStatus | None = Field(default=None, description="warmStart: decision.")
    placement: PlacementStatus | None = Field(default=None, description="placement: plan.")
    progress: ProgressStatus | None = Field(default=None, description="progress: live.")
    result: ResultStatus | None = Field(default=None, description="result: final numbers.")
    restarts: int | None = Field(default=None, description="restarts: trainer restarts so far.")
    attempts: int | None = Field(
        default=None,
        description="attempts: trainer pods created so far (each restart and resumption adds "
        "one); the current pod is <name>-trainer-<attempts - 1>.",
    )
    start_time: str | None = Field(
        default=None,
        description="startTime: when the trainer was launched (reset on resumption); "
        "activeDeadlineSeconds counts from here.",
    )
    completion_time: str | None = Field(default=None, description="completionTime: terminal.")


class TrainingJob(_Api):
    """TrainingJob: trains one model on one dataset; Kiln warm-starts, places and freezes it."""

    api_version: Literal["kiln.dev/v1alpha1"] = Field(description="apiVersion: kiln.dev/v1alpha1")
    kind: Literal["TrainingJob"] = Field(description="kind: TrainingJob")
    metadata: ObjectMeta = Field(description="metadata: standard object metadata.")
    spec: TrainingJobSpec = Field(description="spec: what to train and how.")
    status: TrainingJobStatus | None = Field(
        default=None, description="status: written by the operator (phase, conditions, results)."
    )

    @property
    def name(self) -> str:
        return self.metadata.name


# ----------------------------------------------------------------------------------------------
# parsing and cross-field validation


def parse_job(doc: Any, *, source: str = "") -> TrainingJob:
    """Parse and validate one job document (a dict as decoded from YAML/JSON).

    Raises:
        InvalidSpec: with every problem found: unknown fields (with a did-you-mean), wrong types,
            bounds, enums, wrong apiVersion/kind, invalid metadata.name, and `validate`'s checks.
    """
    job, problems = _check_schema(doc)
    if job is None:
        raise InvalidSpec(problems, source=source)
    problems += validate(job)
    if problems:
        raise InvalidSpec(problems, source=source)
    return job


def check_schema(doc: Any) -> list[str]:
    """The single-field problems of a job document: exactly what the CRD's schema also rejects.

    Unknown fields (with a did-you-mean), wrong types, bounds, enums, wrong apiVersion/kind, an
    invalid metadata.name, numbers JSON cannot carry. `validate`'s cross-field rules are not run.

    Args:
        doc: one document as decoded from YAML/JSON.

    Returns:
        One ``field.path: what is wrong (got X)`` line per problem; [] when the schema accepts it.
    """
    return _check_schema(doc)[1]


def _check_schema(doc: Any) -> tuple[TrainingJob | None, list[str]]:
    """`check_schema`'s problems and the parsed job (None when the types reject the document)."""
    if not isinstance(doc, dict):
        return None, [f"<document>: expected a mapping, got {type(doc).__name__}"]
    problems = _unknown_fields(TrainingJob, doc, "")
    number_problems: list[str] = []
    wire = _as_kubectl_sends(doc, "", number_problems)
    if number_problems:
        return None, problems + number_problems
    try:
        # Strict JSON-mode validation: YAML types are taken as the API server takes them
        # ("5" is not an integer, "yes" is not a boolean), so the CRD and this agree.
        job = TrainingJob.model_validate_json(json.dumps(wire), strict=True)
    except ValidationError as exc:
        errors = exc.errors()
        shown = [e for e in errors if e["type"] != "extra_forbidden"] if problems else errors
        return None, problems + [_format_error(e) for e in shown]
    return job, problems


def validate(job: TrainingJob) -> list[str]:
    """Cross-field checks the schema cannot express; [] when the job is consistent."""
    spec, problems = job.spec, []
    shape, ds = spec.model.input_shape, spec.dataset
    image = ds.name in (DatasetName.DIGITS, DatasetName.IMAGEFOLDER, DatasetName.TORCHVISION)
    if image and (len(shape) != 3 or shape[0] not in (1, 3)):
        problems.append(
            f"spec.model.inputShape: dataset {ds.name} gives images, so use [C, H, W] with C 1 "
            f"or 3 (got {shape})"
        )
    if image and len(shape) == 3 and min(shape[1:]) < 8:
        problems.append(f"spec.model.inputShape: images need H, W >= 8 (got {shape})")
    if ds.name == DatasetName.TEXT and len(shape) != 1:
        problems.append(
            f"spec.model.inputShape: text takes [sequenceLength], e.g. [64] (got {shape})"
        )
    if ds.name == DatasetName.TEXT and ds.augmentation != Augmentation.NONE:
        problems.append("spec.dataset.augmentation: text has no augmentation; use none")
    if ds.name in (DatasetName.IMAGEFOLDER, DatasetName.TORCHVISION, DatasetName.TEXT) and not ds.path:
        problems.append(f"spec.dataset.path: required for dataset {ds.name}; set the data location")
    if ds.name == DatasetName.DIGITS and ds.path:
        problems.append("spec.dataset.path: digits is bundled with scikit-learn; remove path")
    if ds.name == DatasetName.TORCHVISION and not ds.torchvision_class:
        problems.append("spec.dataset.torchvisionClass: required for torchvision, e.g. CIFAR10")
    if ds.name != DatasetName.TORCHVISION and ds.torchvision_class:
        problems.append("spec.dataset.torchvisionClass: only for name torchvision; remove it")
    tv_class = ds.torchvision_class
    if ds.name == DatasetName.TORCHVISION and tv_class and tv_class not in TORCHVISION_CLASSES:
        problems.append(
            f"spec.dataset.torchvisionClass: {tv_class!r} is not a supported torchvision dataset; "
            f"{_did_you_mean(tv_class, TORCHVISION_CLASSES)}use one of "
            f"{', '.join(TORCHVISION_CLASSES)}"
        )
    if spec.target is not None:
        t = spec.target
        if t.metric == TargetMetric.VALIDATION_ACCURACY and not 0.0 < t.value <= 1.0:
            problems.append(
                f"spec.target.value: accuracy is a fraction in (0, 1], e.g. 0.95 (got {t.value})"
            )
        if t.metric == TargetMetric.VALIDATION_LOSS and t.value <= 0.0:
            problems.append(f"spec.target.value: a loss target must be > 0 (got {t.value})")
    sched = spec.training.lr_schedule
    if sched.warmup_epochs >= spec.training.epochs:
        problems.append(
            f"spec.training.lrSchedule.warmupEpochs: must be < epochs {spec.training.epochs} "
            f"(got {sched.warmup_epochs})"
        )
    res = spec.resources
    if res.gpus is not None and res.gpus_per_node is not None and res.gpus > res.gpus_per_node:
        problems.append(
            f"spec.resources.gpus: {res.gpus} exceeds gpusPerNode {res.gpus_per_node}; jobs run "
            "on one node"
        )
    # The planner's shapes (kiln.placement.estimate): single is k = 1, ddp and fsdp k >= 2,
    # gpus 0 is one CPU process, and the global batch splits evenly over the k devices.
    most = res.gpus if res.gpus is not None else res.gpus_per_node
    if res.parallelism in (Parallelism.DDP, Parallelism.FSDP) and most is not None and most < 2:
        problems.append(
            f"spec.resources.parallelism: {res.parallelism.value} needs 2 or more GPUs (gpus "
            f"{res.gpus}, gpusPerNode {res.gpus_per_node}); use single or auto, or allow 2+ GPUs"
            " (gpus 0 is one CPU process)"
        )
    if res.parallelism == Parallelism.SINGLE and res.gpus is not None and res.gpus > 1:
        problems.append(
            f"spec.resources.parallelism: single trains one process on one device, not gpus "
            f"{res.gpus}; use ddp, fsdp or auto, or gpus 1"
        )
    if res.gpus and res.gpus > 1 and spec.training.batch_size % res.gpus:
        problems.append(
            f"spec.training.batchSize: {spec.training.batch_size} does not split evenly over gpus "
            f"{res.gpus} (the global batch is divided among them); use a multiple of {res.gpus}"
        )
    return problems


def to_wire(model: BaseModel) -> dict[str, Any]:
    """A type as its camelCase JSON-compatible dict (defaults included, nulls dropped)."""
    return model.model_dump(mode="json", by_alias=True, exclude_none=True)


def _unknown_fields(model: type[BaseModel], data: Any, path: str) -> list[str]:
    """Unknown keys anywhere under `data`, each with the closest known wire name."""
    if not isinstance(data, dict) or model.model_config.get("extra") == "allow":
        return []
    fields = {(f.alias or n): f for n, f in model.model_fields.items()}
    problems = []
    for key, value in data.items():
        where = f"{path}.{key}" if path else str(key)
        field = fields.get(key)
        if field is None:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(fields)}"
            problems.append(f"{where}: unknown field{hint}")
            continue
        for sub in _model_types(field.annotation):
            if isinstance(value, list):
                for i, item in enumerate(value):
                    problems += _unknown_fields(sub, item, f"{where}[{i}]")
            else:
                problems += _unknown_fields(sub, value, where)
    return problems


def _as_kubectl_sends(value: Any, where: str, problems: list[str]) -> Any:
    """`value` as `kubectl apply` sends it: YAML decoded, then encoded as JSON by Go.

    Whole floats become integers (Go writes 5.0 as 5, so `epochs: 5.0` is an integer on the
    server), other scalars (dates) become strings, keys become strings. Infinities and NaN cannot
    be sent at all; each is appended to `problems` naming its field.
    """
    if isinstance(value, dict):
        return {
            str(k): _as_kubectl_sends(v, f"{where}.{k}" if where else str(k), problems)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_as_kubectl_sends(v, f"{where}[{i}]", problems) for i, v in enumerate(value)]
    if isinstance(value, float):
        if not math.isfinite(value):
            problems.append(f"{where}: must be a finite number; JSON cannot carry it (got {value})")
            return value
        return int(value) if value.is_integer() and abs(value) < 2**53 else value
    if value is None or isinstance(value, str | int):  # bool is an int
        return value
    return str(value)


@functools.cache
def _null_defaulted(model: type[BaseModel]) -> frozenset[str]:
    """Wire and Python names of `model`'s fields that have a default and do not accept null."""
    names: set[str] = set()
    for name, field in model.model_fields.items():
        nullable = field.annotation is None or type(None) in typing.get_args(field.annotation)
        if not field.is_required() and not nullable:
            names |= {name, field.alias or name}
    return frozenset(names)


def _did_you_mean(value: str, choices: typing.Sequence[str]) -> str:
    """"did you mean 'X'? " for the closest of `choices` (case-insensitive), or ""."""
    by_lower = {c.lower(): c for c in choices}
    close = difflib.get_close_matches(value.lower(), list(by_lower), n=1, cutoff=0.6)
    return f"did you mean {by_lower[close[0]]!r}? " if close else ""


def _model_types(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [t for arg in getattr(annotation, "__args__", ()) for t in _model_types(arg)]


def _format_error(error: Any) -> str:
    loc = error["loc"]
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts[-1:] = [f"{parts[-1]}[{item}]"] if parts else [f"[{item}]"]
        elif re.fullmatch(r"[a-z]+\[.*\]|function-.*|[a-z-]+-[a-z-]+", str(item)) is None:
            parts.append(str(item))
    where = ".".join(parts) or "<document>"
    message = error["msg"]
    if error["type"] == "missing":
        return f"{where}: required field is missing"
    if where == "metadata.name" and error["type"] == "string_pattern_mismatch":
        message = "must be a DNS-1123 label: lowercase letters, digits and '-', e.g. digits-resnet"
    if where == "spec.warmStart.parent" and error["type"] == "string_pattern_mismatch":
        message = ("must be auto or a zoo model id (letters, digits, '_', '.', '-'), e.g. "
                   "small_resnet-7f3c2a1b; `kiln zoo ls` lists them")
    if where in ("apiVersion", "kind"):
        message = f"must be {API_VERSION if where == 'apiVersion' else KIND}"
    shown = error.get("input")
    got = f" (got {shown!r})" if shown is not None and not isinstance(shown, dict | list) else ""
    return f"{where}: {message}{got}"

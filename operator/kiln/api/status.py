"""TrainingJob status types, and `TrainingJob` itself (metadata, spec and status in one object).

Every field the operator writes must be declared here: the CRD's structural schema prunes the
rest. Status logic (conditions, phase) lives in `kiln.controller.status`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, StrictFloat, StrictInt, StrictStr, model_validator

from kiln.api import names
from kiln.api import spec as spec_mod


class Condition(names.ApiModel):
    type: names.ConditionType = Field(description="type: one of the Kiln condition types.")
    status: Literal["True", "False", "Unknown"] = Field(description="status: True/False/Unknown.")
    reason: str = Field(default="", description="reason: CamelCase cause.")
    message: str = Field(default="", description="message: one sentence with numbers.")
    last_transition_time: str | None = Field(
        default=None, description="lastTransitionTime: RFC 3339 time the status last flipped."
    )
    observed_generation: int | None = Field(
        default=None, description="observedGeneration: spec generation the condition saw."
    )


class WarmStartDecision(names.ApiModel):
    """The warm-start decision: the zoo model that seeds the job, or why it starts cold.

    One type wherever it goes: made at admission (`kiln.warmstart.select`) or in the trainer,
    status.warmStart by alias, the trainer's ``--warm-start`` and its report by field name.
    Types are checked strictly (no "0.5" for a number): reports come from the user's code.
    """

    # Trainers of other versions (a user's own image) report it too: unknown keys are ignored.
    model_config = ConfigDict(extra="ignore")

    parent: StrictStr | None = Field(
        default=None, description="parent: zoo model id, null if cold.")
    similarity: StrictFloat | None = Field(
        default=None, ge=0.0, le=1.0,
        description="similarity: in [0, 1], to the parent (on a cold start, the best match).")
    parent_metric: StrictFloat | None = Field(
        default=None, description="parentMetric: parent's metric.")
    metric_name: StrictStr | None = Field(
        default=None, description="metricName: the name of parentMetric.")
    matched_tensors: StrictInt | None = Field(
        default=None, ge=0, description="matchedTensors: transferred.")
    total_tensors: StrictInt | None = Field(
        default=None, ge=0, description="totalTensors: child's tensors.")
    reason: StrictStr = Field(default="", description="reason: why this parent or cold start.")
    # Never None once validated (`_outcome_of_older_operators` derives it); no default in the
    # CRD, where status documents of older operators have none.
    outcome: names.WarmStartOutcome = Field(  # type: ignore[assignment]
        default=None, description="outcome: warm, pinned, cold_* (why cold), disabled, "
        "in_trainer (left to the trainer) or init_state (weights set by the run's own code).")
    candidates_considered: StrictInt = Field(
        default=0, ge=0, description="candidatesConsidered: zoo models left after the "
        "compatibility and outlier filters.")
    dropped_incompatible: StrictInt = Field(
        default=0, ge=0, description="droppedIncompatible: of another modality or task.")
    dropped_outliers: StrictInt = Field(
        default=0, ge=0, description="droppedOutliers: metric outliers or non-finite metrics.")
    alternatives: list[StrictStr] = Field(
        default_factory=list,
        description="alternatives: parents the trainer's probe guard tries next.")
    probe_loss: StrictFloat | None = Field(
        default=None, description="probeLoss: the started model's loss on the probe batch.")
    cold_probe_loss: StrictFloat | None = Field(
        default=None, description="coldProbeLoss: a cold-initialised model's probe loss.")
    probe_accuracy: StrictFloat | None = Field(
        default=None, ge=0.0, le=1.0,
        description="probeAccuracy: the started model's probe accuracy.")
    cold_probe_accuracy: StrictFloat | None = Field(
        default=None, ge=0.0, le=1.0,
        description="coldProbeAccuracy: a cold model's probe accuracy.")
    trained_probe_loss: StrictFloat | None = Field(
        default=None, description="trainedProbeLoss: the warm model's mean training loss "
        "over the last probe steps, when the guard trained it (spec.warmStart.probeSteps).")
    cold_trained_probe_loss: StrictFloat | None = Field(
        default=None, description="coldTrainedProbeLoss: the cold twin's, on the same batches.")
    guard_steps: StrictInt | None = Field(
        default=None, ge=0, description="guardSteps: training steps the guard spent before "
        "the job's first step (warm and cold, every parent tried; a batch of "
        "spec.training.batchSize each); null: no guard ran.")
    calibration_samples: StrictInt | None = Field(
        default=None, ge=0, description="calibrationSamples: probe samples the guard passed "
        "forward to re-estimate batch-norm statistics of the warm weights (every parent tried); "
        "0: none (no batch norm, or spec.warmStart.calibrateNorms false); null: no guard ran.")

    @model_validator(mode="before")
    @classmethod
    def _outcome_of_older_operators(cls, data: Any) -> Any:
        """No outcome (status.warmStart as older operators wrote it): a warm start when a parent
        is named, else a cold one."""
        if isinstance(data, dict) and data.get("outcome") is None:
            warm = data.get("parent") is not None
            return {**data, "outcome": names.WarmStartOutcome.WARM if warm
                    else names.WarmStartOutcome.COLD_EMPTY}
        return data

    @property
    def cold_start(self) -> bool:
        """True when no parent weights are to be loaded."""
        return self.parent is None

    @property
    def condition_reason(self) -> names.Reason:
        """The WarmStarted condition's reason: ParentSelected, ColdStart or WarmStartDisabled."""
        if self.outcome == names.WarmStartOutcome.DISABLED:
            return names.Reason.WARM_START_DISABLED
        return names.Reason.COLD_START if self.cold_start else names.Reason.PARENT_SELECTED


class ProfileStatus(names.ApiModel):
    parameters: int | None = Field(default=None, description="parameters: the model's count.")
    flops_per_sample: float | None = Field(
        default=None, description="flopsPerSample: forward FLOPs of one sample.")
    graph_nodes: int | None = Field(
        default=None, description="graphNodes: architecture graph size; null if untraceable.")
    untraceable: str | None = Field(
        default=None, description="untraceable: why no tracer could trace the model.")
    device: str | None = Field(default=None, description="device: where the step was timed.")
    batch_size: int | None = Field(default=None, description="batchSize: of the timed step.")
    step_seconds: float | None = Field(
        default=None, description="stepSeconds: one optimizer step on one device.")
    step_status: str | None = Field(default=None, description="stepStatus: ok, oom or failed.")
    zoo_key: str | None = Field(default=None, description="zooKey: the full profile's object.")


class PlacementStatus(names.ApiModel):
    node: str | None = Field(default=None, description="node: planned node (of rank 0).")
    nodes: list[str] | None = Field(
        default=None, description="nodes: every node of a job spanning several, in rank "
        "order (one trainer pod each).")
    gpus: int | None = Field(default=None, description="gpus: planned GPU count (all nodes).")
    parallelism: str | None = Field(default=None, description="parallelism: single/ddp/fsdp.")
    estimated_start: str | None = Field(default=None, description="estimatedStart: RFC 3339.")
    estimated_seconds: float | None = Field(default=None, description="estimatedSeconds: run.")


class ProgressStatus(names.ApiModel):
    epoch: int | None = Field(default=None, description="epoch: current epoch (1-based).")
    step: int | None = Field(default=None, description="step: optimizer steps so far.")
    train_loss: float | None = Field(default=None, description="trainLoss: recent training loss.")
    validation_accuracy: float | None = Field(default=None, description="validationAccuracy.")
    validation_loss: float | None = Field(default=None, description="validationLoss.")
    frozen_modules: int | None = Field(default=None, description="frozenModules: frozen prefix.")
    compute_fraction: float | None = Field(
        default=None, description="computeFraction: share of the whole model's per-step "
        "compute still done (below 1 once freezing skips backward work).")
    samples_per_second: float | None = Field(default=None, description="samplesPerSecond.")
    eta_seconds: float | None = Field(default=None, description="etaSeconds: time left.")
    last_updated_time: str | None = Field(
        default=None, description="lastUpdatedTime: RFC 3339 time the operator last read the "
        "trainer's metrics; an old one means progress is stale (trainer unreachable).")


class ResultStatus(names.ApiModel):
    metric: float | None = Field(default=None, description="metric: final target metric.")
    validation_accuracy: float | None = Field(default=None, description="validationAccuracy.")
    validation_loss: float | None = Field(default=None, description="validationLoss.")
    zoo_model: str | None = Field(default=None, description="zooModel: registered zoo id.")
    wall_seconds: float | None = Field(default=None, description="wallSeconds: training time.")
    time_to_target_seconds: float | None = Field(
        default=None, description="timeToTargetSeconds: wall seconds until the target was met."
    )


class TrainingJobStatus(names.ApiModel):
    phase: names.Phase | None = Field(default=None, description="phase: derived from conditions.")
    conditions: list[Condition] = Field(default_factory=list, description="conditions.")
    warm_start: WarmStartDecision | None = Field(default=None, description="warmStart: decision.")
    profile: ProfileStatus | None = Field(
        default=None, description="profile: an entrypoint model as measured before placement.")
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
    runtime: dict[str, Any] | None = Field(
        default=None,
        description="runtime: the runtime spec.runtimeRef named, as resolved at admission "
        "(kind, name, uid, resourceVersion, template, locked); the job runs on it, whatever "
        "later edits of the runtime say.",
    )
    admitted_spec: dict[str, Any] | None = Field(
        default=None,
        description="admittedSpec: the spec the job was admitted with (defaults filled in), "
        "which it runs on: a later edit takes effect only in spec.runPolicy and in "
        "spec.template's nodeSelector, affinity, tolerations, labels and annotations.",
    )


class TrainingJob(names.ApiModel):
    """TrainingJob: trains one model on one dataset; Kiln warm-starts, places and freezes it."""

    api_version: Literal["kiln.dev/v1alpha1"] = Field(description="apiVersion: kiln.dev/v1alpha1")
    kind: Literal["TrainingJob"] = Field(description="kind: TrainingJob")
    metadata: spec_mod.ObjectMeta = Field(description="metadata: standard object metadata.")
    spec: spec_mod.TrainingJobSpec = Field(description="spec: what to train and how.")
    status: TrainingJobStatus | None = Field(
        default=None, description="status: written by the operator (phase, conditions, results)."
    )

    @property
    def name(self) -> str:
        return self.metadata.name

    @property
    def namespace(self) -> str:
        """The job's namespace; ``default`` for a job file without one (as kubectl does)."""
        return self.metadata.namespace or "default"

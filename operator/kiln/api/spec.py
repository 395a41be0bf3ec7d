"""TrainingJob spec types: every field the user writes, with its default, bounds and doc.

Each field's description starts with its wire name and becomes the CRD's description;
single-field checks (types, enums, bounds) live here and so also in the CRD schema.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from kiln.api import names

PositiveInt = Annotated[int, Field(ge=1)]
InputDim = Annotated[int, Field(ge=1, le=names.INPUT_DIM_MAX)]
ParentId = Annotated[str, Field(min_length=1, max_length=names.PARENT_MAX_LENGTH,
                                pattern=names.PARENT_PATTERN)]
MAX_PREFERRED_PARENTS = 32
# Seeds are 32-bit, as NumPy's: the trainer derives per-epoch and per-rank generator seeds from
# them, which must stay within torch's 64-bit range.
SEED_MAX = 2**32 - 1


class SecretRef(names.ApiModel):
    name: str = Field(
        min_length=1,
        max_length=253,  # a DNS subdomain, as Kubernetes names objects
        pattern=names.SUBDOMAIN_PATTERN,
        description="name: a Secret in the job's namespace holding the S3 server's address "
        "and credentials under the keys endpoint (host:port or http(s)://host:port), "
        "accessKey and secretKey (both or neither: anonymous), and optionally sessionToken and "
        "region. Only the initializer mounts it; `kiln run` reads the same keys as files in "
        "$KILN_SECRETS_DIR/<name>/ (default ~/.kiln/secrets/<name>/).",
    )


class PretrainedSpec(names.ApiModel):
    uri: str = Field(
        min_length=1,
        max_length=names.SOURCE_URI_MAX_LENGTH,
        description="uri: the weights the job starts from: s3://bucket/key-or-prefix, "
        "hf://org/name, or a path the trainer sees (a volume); a .safetensors file, a torch "
        "state dict (.pt, .pth, .bin) or a Hugging Face directory (config.json and "
        "model.safetensors, and a tokenizer.json that text datasets then use). s3:// is "
        "downloaded once, before training, into a content-keyed cache; the job then starts "
        "from these weights instead of a zoo parent (a LoRA job: they are its base).",
    )
    secret_ref: SecretRef | None = Field(
        default=None,
        description="secretRef: the Secret with the S3 endpoint and credentials of an s3:// "
        "uri; unset: the zoo's endpoint, and its credentials only where pods hold them (not "
        "with the operator's default presigned zoo access: there a private bucket needs it).",
    )


class InitializerSpec(names.ApiModel):
    cache_claim: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        pattern=names.SUBDOMAIN_PATTERN,
        description="cacheClaim: a PersistentVolumeClaim in the job's namespace that caches "
        "downloaded s3:// sources (spec.model.pretrained.uri, spec.dataset.uri) across pods "
        "and jobs, keyed by content (object keys, sizes, ETags); unset: an emptyDir, so each "
        "pod downloads again.",
    )


class ModelSpec(names.ApiModel):
    architecture: str | None = Field(
        default=None,
        min_length=1,
        description="architecture: registry name, e.g. resnet18, small_resnet, char_transformer "
        "(`kiln models` lists them); set this or entrypoint.",
    )
    entrypoint: str | None = Field(
        default=None,
        max_length=names.ENTRYPOINT_MAX_LENGTH,
        pattern=names.ENTRYPOINT_PATTERN,
        description="entrypoint: your model as package.module:callable, e.g. mynets.mixer:mixer; "
        "called with args as keyword arguments, it returns a torch.nn.Module. The trainer imports "
        "it (the module must be importable in the trainer image); the operator never does. Set "
        "this or architecture.",
    )
    args: dict[str, Any] = Field(
        default_factory=dict,
        description="args: keyword arguments of the architecture builder or entrypoint, e.g. "
        "num_classes, depth.",
    )
    task: names.ModelTask | None = Field(
        default=None,
        description="task: classification (cross-entropy over classes, accuracy) or "
        "language_model (next-token cross-entropy); default: the registry's for an architecture, "
        "classification for an entrypoint.",
    )
    input_shape: list[InputDim] = Field(
        min_length=1,
        max_length=3,
        description="inputShape: one sample's shape without the batch: [C, H, W] for images, "
        f"[sequenceLength] for text; each at most {names.INPUT_DIM_MAX}.",
    )
    pretrained: PretrainedSpec | None = Field(
        default=None,
        description="pretrained: weights to fine-tune from, downloaded before training.",
    )

    @property
    def label(self) -> str:
        """The model's name for people and keys: the architecture, else the entrypoint."""
        return self.architecture or self.entrypoint or ""


class DatasetSpec(names.ApiModel):
    name: names.DatasetName | None = Field(
        default=None,
        description="name: a built-in loader: digits, imagefolder, torchvision or text; set this "
        "or entrypoint (neither: digits).",
    )
    entrypoint: str | None = Field(
        default=None,
        max_length=names.ENTRYPOINT_MAX_LENGTH,
        pattern=names.ENTRYPOINT_PATTERN,
        description="entrypoint: your dataset as package.module:callable, e.g. mynets.data:shapes; "
        "called with args as keyword arguments, it returns (train, validation), each a map-style "
        "torch Dataset of (input, target) pairs. The trainer imports it and checks the first "
        "samples against the model; the operator never does. Set this or name.",
    )
    args: dict[str, Any] = Field(
        default_factory=dict,
        description="args: keyword arguments of the dataset entrypoint, e.g. root, size.",
    )
    uri: str | None = Field(
        default=None,
        min_length=1,
        max_length=names.SOURCE_URI_MAX_LENGTH,
        description="uri: where the data comes from: s3://bucket/key-or-prefix (any S3 server: "
        "secretRef), hf://org/name, or a path the trainer sees; s3:// is downloaded once, "
        "before training, into a content-keyed cache. The local copy is the built-in loader's "
        "path (imagefolder, torchvision, text), or an entrypoint's path keyword argument. "
        "Set this or path.",
    )
    secret_ref: SecretRef | None = Field(
        default=None,
        description="secretRef: the Secret with the S3 endpoint and credentials of an s3:// "
        "uri; unset: the zoo's endpoint, and its credentials only where pods hold them (not "
        "with the operator's default presigned zoo access: there a private bucket needs it).",
    )
    path: str | None = Field(
        default=None,
        description="path: dataset location: ImageFolder directory, torchvision root, or a text "
        "file or folder of text files; imagefolder and text also read s3://bucket/prefix (the "
        "zoo's endpoint and credentials), downloaded once into a local cache.",
    )
    validation_path: str | None = Field(
        default=None,
        description="validationPath: a separate validation set for imagefolder or text, laid out "
        "like path (a directory, a text file, or s3://bucket/prefix); then all of path trains and "
        "validationFraction is unused.",
    )
    torchvision_class: str | None = Field(
        default=None,
        description="torchvisionClass: torchvision dataset class when name is torchvision: "
        f"{', '.join(names.TORCHVISION_CLASSES)}.",
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
    augmentation: names.Augmentation = Field(
        default=names.Augmentation.NONE,
        description="augmentation: none (deterministic) or flip-crop (random, images only).",
    )
    max_samples: int | None = Field(
        default=None,
        ge=20,  # the trainer's validation split needs 10 samples, and so does training
        description="maxSamples: use at most this many samples (text: characters / length); "
        "at least 20, so that each split keeps 10.",
    )
    fingerprint: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        pattern=r"^[^\x00-\x1f\x7f]+$",  # printed in reasons and logs: no control characters
        description="fingerprint: your id of the data's content, e.g. a version or hash; "
        "recorded with the model, and warm start prefers parents with the same one. Unset: "
        "admission compares a hash of this dataset spec, and the trainer records a hash of "
        "the content it loaded (files, arrays, or an entrypoint's first samples); set, the "
        "trainer hashes nothing.",
    )
    split_seed: int = Field(
        default=0,
        ge=0,
        le=SEED_MAX,
        description="splitSeed: seeds the train/validation split (and the maxSamples subset); "
        "keep it equal across jobs on one dataset so a zoo parent never trained on a child's "
        "validation samples.",
    )

    @property
    def loader(self) -> names.DatasetName | None:
        """The built-in loader: name, digits when neither name nor entrypoint is set, None for
        an entrypoint."""
        if self.name is None and self.entrypoint is not None:
            return None
        return self.name or names.DatasetName.DIGITS

    @property
    def source(self) -> str:
        """The loader's name, or the entrypoint: what logs and tables call this dataset."""
        return str(self.loader) if self.loader is not None else str(self.entrypoint)


class OptimizerSpec(names.ApiModel):
    name: names.OptimizerName = Field(
        default=names.OptimizerName.SGD, description="name: sgd, adam or adamw."
    )
    lr: float = Field(default=0.1, gt=0.0, le=10.0, description="lr: base learning rate.")
    momentum: float = Field(default=0.9, ge=0.0, lt=1.0, description="momentum: SGD momentum.")
    weight_decay: float = Field(
        default=5e-4, ge=0.0, le=1.0, description="weightDecay: L2 penalty (decoupled for adamw)."
    )
    nesterov: bool = Field(default=False, description="nesterov: Nesterov momentum for SGD.")


class LrScheduleSpec(names.ApiModel):
    name: names.ScheduleName = Field(
        default=names.ScheduleName.COSINE, description="name: constant, cosine or step."
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


class PeftSpec(names.ApiModel):
    """Parameter-efficient fine-tuning through the peft library: the base stays frozen and
    only a small adapter trains; the zoo stores the adapter beside a reference to its base."""

    method: Literal["lora"] = Field(
        default="lora", description="method: lora (low-rank adapters, Hu et al. 2021).")
    rank: int = Field(default=8, ge=1, le=1024,
                      description="rank: the adapters' rank r (at least 1).")
    alpha: float = Field(default=16.0, gt=0.0,
                         description="alpha: scale; the update is (alpha / rank) B A x.")
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0,
                           description="dropout: dropout on the adapters' input, in [0, 1).")
    target_modules: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(
        min_length=1, max_length=256,
        description="targetModules: module names the adapters wrap, each a full name or the "
        "end of one after a dot (head.2, or fc wraps every module called fc); each must be "
        "a Linear, Conv or Embedding of the built model (`kiln validate` checks registry "
        "models).",
    )


class TrainingSpec(names.ApiModel):
    epochs: int = Field(default=30, ge=1, le=100000, description="epochs: upper bound on epochs.")
    batch_size: int = Field(
        default=128, ge=1, le=65536, description="batchSize: global mini-batch size in samples."
    )
    gradient_accumulation_steps: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="gradientAccumulationSteps: mini-batches whose gradients add up before "
        "each optimizer step; the effective batch is batchSize x this (batchSize need not "
        "divide by it). Learning-rate schedule, evalEverySteps, freezing and progress count "
        "optimizer steps.",
    )
    optimizer: OptimizerSpec = Field(
        default_factory=OptimizerSpec, description="optimizer: optimizer and its settings."
    )
    lr_schedule: LrScheduleSpec = Field(
        default_factory=LrScheduleSpec, description="lrSchedule: learning-rate schedule."
    )
    seed: int = Field(default=0, ge=0, le=SEED_MAX,
                      description="seed: seeds initialisation and shuffling.")
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
    precision: names.Precision = Field(
        default=names.Precision.FP32,
        description="precision: fp32 (no autocast), bf16 (autocast to bfloat16, CUDA or CPU) "
        "or fp16 (autocast to float16 with a gradient scaler).",
    )
    peft: PeftSpec | None = Field(
        default=None,
        description="peft: train a LoRA adapter on the pinned spec.warmStart.parent (a full "
        "model, or an adapter on the same base, whose adapter is loaded), or on "
        "spec.model.pretrained.uri (imported into the zoo once as the base; the best adapter "
        "on it with these settings is continued), instead of every weight; layer freezing is "
        "off (the base is frozen by design).",
    )


class TargetSpec(names.ApiModel):
    metric: names.TargetMetric = Field(
        default=names.TargetMetric.VALIDATION_ACCURACY,
        description="metric: validation_accuracy (higher is better) or validation_loss (lower).",
    )
    value: float = Field(
        description="value: the goal; accuracy in (0, 1], loss > 0.",
    )
    stop_at_target: bool = Field(
        default=True, description="stopAtTarget: stop training once the target is reached."
    )


class WarmStartSpec(names.ApiModel):
    enabled: bool = Field(default=True, description="enabled: start from the most similar model.")
    parent: str = Field(
        default="auto",
        min_length=1,
        max_length=names.PARENT_MAX_LENGTH,
        pattern=names.PARENT_PATTERN,
        description="parent: auto, or a pinned zoo model id from `kiln zoo ls`, e.g. "
        "small_resnet-7f3c2a1b.",
    )
    min_similarity: float = Field(
        default=0.3,
        ge=0.0,
        le=1.0,
        description="minSimilarity: below this architectural similarity, cold start.",
    )
    preferred: list[ParentId] = Field(
        default_factory=list,
        max_length=MAX_PREFERRED_PARENTS,
        description="preferred: zoo model ids, best first, favoured when parent is auto: "
        "among the candidates within 0.05 similarity of the best match, the first one listed "
        "wins (a sweep lists its own trials' models); ids this job cannot see are ignored.",
    )
    probe_steps: int = Field(
        default=10,
        ge=0,
        le=1000,
        description="probeSteps: when the warm model's step-0 loss is not clearly below a "
        "cold one's, the trainer's guard trains both this many steps side by side on the "
        "same batches and keeps the parent only if the warm loss is then lower (a new layer "
        "starts random, so step 0 undersells a parent); costs up to this many steps per "
        "parent tried plus as many for the cold twin; 0: judge on step-0 loss alone.",
    )
    calibrate_norms: bool = Field(
        default=True,
        description="calibrateNorms: before the guard scores a warm model, re-estimate its "
        "batch-norm running statistics on the probe's samples (forward passes only: the "
        "transform changes what a batch norm sees, and its running statistics would lag for "
        "many steps); false keeps the parent's statistics.",
    )


class FreezingSpec(names.ApiModel):
    """Egeria layer freezing (Wang et al., EuroSys'23).

    A module counts as converged in a reference cycle (``window`` probes) when any of three
    tests holds: its plasticity's slope is flat (``tolerance``), its plasticity per unit of
    learning rate fell far below its peak (``peakFraction``), or, when ``plateauRatio`` is set,
    it stopped falling within the learning-rate phase. Leading modules converged for
    ``patience`` cycles in a row freeze together, up to a fifth of the backward work per
    decision and one decision per ``patience`` cycles; the prefix stays frozen across
    learning-rate drops. ``test: gradientNorm`` replaces these tests by AutoFreeze's (Liu et
    al. 2021), which reads gradient norms and needs no reference process.
    """

    enabled: bool = Field(
        default=True, description="enabled: freeze front layers once they stop learning."
    )
    test: names.FreezingTest = Field(
        default=names.FreezingTest.PLASTICITY,
        description="test: when a front module stopped learning: plasticity (the default: "
        "Egeria's test, its activations drift little from a reference copy, measured in "
        "another process) or gradientNorm (AutoFreeze's: the relative change of its summed "
        "gradient norm between two intervals of window x checkEverySteps steps is within "
        "gradientPercentile of the trainable modules' changes; no reference process, never "
        "thaws).",
    )
    gradient_percentile: float = Field(
        default=50.0,
        gt=0.0,
        le=100.0,
        description="gradientPercentile: with test gradientNorm, the percentile of the "
        "trainable modules' gradient-norm changes below which the front modules freeze "
        "(higher freezes sooner).",
    )
    check_every_steps: int | None = Field(
        default=None,
        ge=1,
        le=1_000_000,
        description="checkEverySteps: steps between plasticity probes early in each "
        "learning-rate phase, twice that later (default: 8 per epoch or 200 per step budget, "
        "whichever is denser, at least 5 steps apart).",
    )
    window: int = Field(
        default=3, ge=3, le=100, description="window: probes per reference refresh and slope fit."
    )
    tolerance: float = Field(
        default=0.1,
        gt=0.0,
        le=10.0,
        description="tolerance: a module is converged in a reference cycle when its plasticity "
        "stopped growing: the least-squares slope over the cycle's probes, normalised as "
        "abs(slope) x window / mean (dimensionless), is below this.",
    )
    peak_fraction: float = Field(
        default=0.1,
        gt=0.0,
        le=1.0,
        description="peakFraction: a module is also converged in a reference cycle when its "
        "plasticity per unit of learning rate fell to this fraction of its highest value "
        "(dimensionless; 0.1: it moves at a tenth of its most plastic pace; 1: always).",
    )
    plateau_ratio: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="plateauRatio: a module is also converged in a reference cycle when, within "
        "one learning-rate phase, the median of its last two cycles' plasticity per unit of "
        "learning rate is at least this fraction of the median of the two before: it stopped "
        "falling, and only drifts with the gradient noise (0, the default, turns this test "
        "off; 0.5 freezes far earlier and trades accuracy for time, see the freezing docs).",
    )
    patience: int = Field(
        default=2, ge=1, le=20, description="patience: converged windows in a row before freezing."
    )
    probe_batch_size: int = Field(
        default=16, ge=2, le=1024, description="probeBatchSize: samples in the fixed probe batch."
    )
    max_frozen_fraction: float = Field(
        default=0.8,
        gt=0.0,
        lt=1.0,
        description="maxFrozenFraction: cap on the share of modules frozen (the head never is).",
    )
    reference: names.FreezingMode = Field(
        default=names.FreezingMode.AUTO,
        description="reference: auto (int8 or fp32, whichever is measured cheaper) or fp32.",
    )
    reference_threads: int = Field(
        default=1, ge=1, le=64, description="referenceThreads: CPU threads of the reference model."
    )
    cache: names.CacheMode = Field(
        default=names.CacheMode.AUTO, description="cache: auto or off (frozen-prefix output cache)."
    )
    cache_memory_mib: int = Field(
        default=1024,
        ge=0,
        le=1 << 24,
        alias="cacheMemoryMiB",
        description="cacheMemoryMiB: RAM for the cache; beyond it, a memory-mapped file.",
    )
    transferred: names.TransferredMode = Field(
        default=names.TransferredMode.IGNORE,
        description="transferred: what freezing makes of the front modules a warm start copied "
        "unchanged from its parent (or from imported pretrained weights): ignore (the default: "
        "as for a cold start), judge (they may freeze at the first decision, without the "
        "bootstrap wait, judged against the parent's weights as the first reference) or "
        "freeze (they start frozen at step 0 and thaw when the module behind them measurably "
        "moves faster).",
    )


class ResourcesSpec(names.ApiModel):
    gpus: int | None = Field(
        default=None,
        ge=0,
        le=64,
        description="gpus: GPUs per job; omit to let the planner choose (0 = CPU only).",
    )
    parallelism: names.Parallelism = Field(
        default=names.Parallelism.AUTO, description="parallelism: auto, single, ddp or fsdp."
    )
    gpus_per_node: int | None = Field(
        default=None, ge=1, le=64, description="gpusPerNode: cap on GPUs taken on one node."
    )
    nodes: int | None = Field(
        default=None, ge=1, le=64, description="nodes: nodes the job spans, one trainer pod "
        "each with gpus / nodes GPUs (ddp or fsdp); omit for one node, or, when gpus is above "
        "gpusPerNode, as many as the planner picks."
    )


class ZooSpec(names.ApiModel):
    register_model: bool = Field(
        default=True, alias="register", description="register: add the trained model to the zoo."
    )
    provisional_every_evaluations: int | None = Field(
        default=None,
        ge=1,
        le=10_000,
        description="provisionalEveryEvaluations: while training, register the best model so "
        "far as a provisional zoo record at most every N evaluations, so other jobs (a sweep) "
        "warm-start from it; the final model replaces it under the same id. Unset: only the "
        "final model is registered.",
    )
    share: names.ZooShare | None = Field(
        default=None,
        description="share: who may warm-start from the registered model: private (jobs of "
        "this namespace) or shared (every namespace); unset: the operator's --zoo-share.",
    )


class RunPolicySpec(names.ApiModel):
    backoff_limit: int = Field(
        default=3, ge=0, le=100,
        description=("backoffLimit: retries after retryable failures (a disrupted pod, its "
                     "DisruptionTarget condition set, spends none).")
    )
    active_deadline_seconds: int | None = Field(
        default=None, ge=1, description="activeDeadlineSeconds: fail the job after this long."
    )
    ttl_seconds_after_finished: int | None = Field(
        default=None, ge=0, description="ttlSecondsAfterFinished: delete the job this long after."
    )
    clean_pod_policy: names.CleanPodPolicy = Field(
        default=names.CleanPodPolicy.RUNNING,
        description="cleanPodPolicy: pods deleted when the job ends: All, Running or None.",
    )
    suspend: bool = Field(default=False, description="suspend: stop pods and hold the job.")
    priority_class_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=names.NAME_MAX_LENGTH,
        pattern=names.SUBDOMAIN_PATTERN,
        description="priorityClassName: the job's priority in placement; its weight comes "
        "from the operator's --priority-weight name=W (unknown or unset: weight 1).",
    )


class RuntimeRef(names.ApiModel):
    kind: Literal["TrainingRuntime", "ClusterTrainingRuntime"] = Field(
        default="ClusterTrainingRuntime",
        description="kind: ClusterTrainingRuntime (cluster-wide, the default) or "
        "TrainingRuntime (in the job's namespace).",
    )
    name: str = Field(
        min_length=1,
        max_length=253,  # a DNS subdomain, as Kubernetes names objects
        pattern=names.SUBDOMAIN_PATTERN,
        description="name: the runtime's metadata.name.",
    )


class TrainingJobSpec(names.ApiModel):
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
    runtime_ref: RuntimeRef | None = Field(
        default=None,
        description="runtimeRef: the TrainingRuntime or ClusterTrainingRuntime whose pod "
        "template and defaults the job starts from; spec.template adds to it and overrides "
        "what the runtime does not lock. Resolved once, at admission (status.runtime).",
    )
    initializer: InitializerSpec = Field(
        default_factory=InitializerSpec,
        description="initializer: where the downloaded s3:// sources are cached.",
    )
    template: dict[str, Any] = Field(
        default_factory=dict,
        description="template: pod template overrides: image, command, args, env, envFrom, "
        "volumes, volumeMounts, initContainers, securityContext (the trainer container's), "
        "podSecurityContext (the pod's), resources, nodeSelector, "
        "tolerations, affinity and more (`kiln validate` lists them); Kiln keeps the trainer "
        "container's name, GPU limits, node placement and its KILN_* environment.",
    )


class ObjectMeta(names.ApiModel):
    """Kubernetes object metadata: what a job file carries plus the fields the server sets.

    Unknown keys are rejected (as `kubectl apply` does with strict field validation), so a typo
    such as `lables` is an error rather than silently ignored.
    """

    name: str = Field(
        min_length=1,
        max_length=names.NAME_MAX_LENGTH,
        pattern=names.NAME_PATTERN,
        description="name: DNS-1123 label (lowercase letters, digits, '-'; at most 63 characters).",
    )
    generate_name: str | None = Field(default=None, description="generateName: name prefix.")
    namespace: str | None = Field(
        default=None,
        min_length=1,
        max_length=names.NAME_MAX_LENGTH,
        pattern=names.NAME_PATTERN,
        description="namespace: the job's namespace, an RFC 1123 label (as metadata.name).",
    )
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

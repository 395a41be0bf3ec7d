"""Parsing and validating job documents: `parse_job`, `check_schema`, `validate`, `to_wire`.

Single-field checks live in the types (and so in the CRD schema); `check_schema` runs exactly
these. Cross-field checks live in `validate`. `parse_job` reports both layers at once, skipping
only the checks that read a field the schema rejected (`unaffected`).
"""

from __future__ import annotations

import copy
import difflib
import fnmatch
import json
import math
import re
import typing
from typing import Any

from pydantic import BaseModel, ValidationError

from kiln.api import bounds, names, podschema, scheduling, status
from kiln.api import spec as spec_types

M = typing.TypeVar("M", bound=BaseModel)


def parse_job(doc: Any, *, source: str = "") -> status.TrainingJob:
    """Parse and validate one job document (a dict as decoded from YAML/JSON).

    Raises:
        InvalidSpec: with every problem found: unknown fields (with a did-you-mean), wrong types,
            bounds, enums, wrong apiVersion/kind, invalid metadata.name or namespace, and
            `validate`'s checks, the latter run on the document with each rejected field reset
            to its default and reported where they read no rejected field (`unaffected`). The
            exception carries that job and the rejected fields, for further checks
            (`kiln.models.check_job`). A document nested deeper than `bounds.MAX_DEPTH` or
            with a spec above `bounds.MAX_SPEC_BYTES` is refused before anything else reads
            it, with those problems alone.
    """
    too_large = bounds.problems(doc)
    if too_large:
        raise names.InvalidSpec(too_large, source=source)
    job, problems, errors = _check_schema_errors(doc)
    rejected: tuple[str, ...] = ()
    if job is None and errors is not None:
        job, rejected = without_rejected(doc, errors, misspelt(problems), status.TrainingJob)
    if job is not None:
        problems += unaffected(validate(job), rejected)
    if problems:
        raise names.InvalidSpec(problems, source=source, job=job, rejected=rejected)
    return job  # type: ignore[return-value]  # None only with problems


# Fields the cross-field and registry checks read together: once one of a group is rejected
# (and so reset to its default), the problems of the others may be artefacts of that default.
_READ_TOGETHER = (
    ("spec.model", "spec.dataset"),
    ("spec.training.epochs", "spec.training.lrSchedule"),
    ("spec.training.batchSize", "spec.resources"),
)


def unaffected(problems: list[str], rejected: typing.Sequence[str]) -> list[str]:
    """The `problems` that read no field in `rejected`.

    A problem (``field.path: ...``) reads its own field, the fields above and below it, and the
    fields `_READ_TOGETHER` with it. A field rejected by the schema was checked at its default,
    so problems reading it would describe that default, not the document.
    """
    def reads(field: str, other: str) -> bool:
        return _nested(field, other) or any(
            any(_nested(field, g) for g in group) and any(_nested(other, g) for g in group)
            for group in _READ_TOGETHER
        )

    return [p for p in problems
            if not any(reads(p.split(":", 1)[0], field) for field in rejected)]


def _nested(a: str, b: str) -> bool:
    """One field path is the other or lies under it (``spec.model`` and ``spec.model.args``)."""
    return any(x == y or x.startswith((y + ".", y + "[")) for x, y in
               ((a, b), (b, a)))


def misspelt(problems: list[str]) -> dict[str, str]:
    """Unknown field path -> the field it probably meant (its did-you-mean), from `problems`."""
    found = (re.fullmatch(r"(.*\.)?([^.:]+): unknown field; did you mean '([^']+)'\?", p)
             for p in problems)
    return {f"{m[1] or ''}{m[2]}": f"{m[1] or ''}{m[3]}" for m in found if m}


def without_rejected(doc: Any, errors: list[Any], meant: dict[str, str], model: type[M]
                     ) -> tuple[M | None, tuple[str, ...]]:
    """`doc` with every field the schema rejected defaulted (removed) or stood in for
    (`_STAND_INS`), parsed as `model` (a TrainingJob or TrainingSweep), and those fields'
    paths; None when it still does not parse. An unknown key is removed, and the field it was
    probably meant as (`meant`, from `misspelt`) counts as rejected: it was left at its
    default."""
    wire = copy.deepcopy(_as_kubectl_sends(doc, "", []))
    rejected: list[str] = []
    for _ in range(3):  # a removed field can expose another error (a required one missing)
        for error in errors:
            path = _reject(wire, error["loc"], error["type"])
            if error["type"] != "extra_forbidden":
                rejected.append(path)
            elif path in meant:
                rejected.append(meant[path])
        try:
            return (model.model_validate_json(json.dumps(wire), strict=True),
                    tuple(dict.fromkeys(rejected)))
        except ValidationError as exc:
            errors = exc.errors()
    return None, tuple(dict.fromkeys(rejected))


# Required fields have no default to fall back on: a stand-in keeps the rest of the document
# checkable. It is never judged, since `unaffected` drops every problem reading a rejected field.
_STAND_INS: dict[tuple[str, ...], Any] = {
    ("metadata", "name"): "rejected-name",
    ("spec", "model", "inputShape"): [1, 8, 8],
}


def _reject(wire: dict[str, Any], loc: typing.Sequence[Any], kind: str) -> str:
    """Take the field at pydantic's `loc` out of `wire` (a list field as a whole; a missing
    field without a stand-in takes its object along, e.g. spec.target without value); returns
    its path."""
    parent: Any = None
    node: Any = wire
    keys: list[str] = []
    for item in loc:
        if isinstance(node, dict) and isinstance(item, str) and item in node:
            parent, node = node, node[item]
            keys.append(item)
        elif isinstance(node, list):
            break
    field = tuple(keys)
    if kind == "missing" and loc and isinstance(loc[-1], str) and isinstance(node, dict):
        field = (*keys, loc[-1])
        if field in _STAND_INS:
            node[loc[-1]] = copy.deepcopy(_STAND_INS[field])
            return ".".join(field)
    elif field in _STAND_INS:
        parent[keys[-1]] = copy.deepcopy(_STAND_INS[field])
        return ".".join(field)
    if parent is not None and keys:
        del parent[keys[-1]]
    return ".".join(field)


def check_schema(doc: Any) -> list[str]:
    """The single-field problems of a job document: exactly what the CRD's schema also rejects.

    Unknown fields (with a did-you-mean), wrong types, bounds, enums, wrong apiVersion/kind, an
    invalid metadata.name, numbers JSON cannot carry. `validate`'s cross-field rules are not run.

    Args:
        doc: one document as decoded from YAML/JSON.

    Returns:
        One ``field.path: what is wrong (got X)`` line per problem; [] when the schema accepts it.
    """
    return _check_schema_errors(doc)[1]


def _check_schema_errors(doc: Any
                         ) -> tuple[status.TrainingJob | None, list[str], list[Any] | None]:
    """`check_schema`'s problems, the parsed job (None when the types reject the document) and
    the types' errors (None when the document could not even be offered to them)."""
    if not isinstance(doc, dict):
        return None, [f"<document>: expected a mapping, got {type(doc).__name__}"], None
    problems = unknown_fields(status.TrainingJob, doc, "")
    number_problems: list[str] = []
    wire = _as_kubectl_sends(doc, "", number_problems)
    if number_problems:
        return None, problems + number_problems, None
    try:
        # Strict JSON-mode validation: YAML types are taken as the API server takes them
        # ("5" is not an integer, "yes" is not a boolean), so the CRD and this agree.
        job = status.TrainingJob.model_validate_json(json.dumps(wire), strict=True)
    except ValidationError as exc:
        errors = exc.errors()
        shown = [e for e in errors if e["type"] != "extra_forbidden"] if problems else errors
        return None, problems + [_format_error(e) for e in shown], errors
    return job, problems, None


def validate(job: status.TrainingJob) -> list[str]:
    """Cross-field checks the schema cannot express; [] when the job is consistent.

    Every problem reads ``field.path: what is wrong (got X); fix``.
    """
    spec, problems = job.spec, []
    shape, ds = spec.model.input_shape, spec.dataset
    if (spec.model.architecture is None) == (spec.model.entrypoint is None):
        problems.append(
            "spec.model: set exactly one of architecture (a registry name, `kiln models` lists "
            "them) or entrypoint (your model as package.module:callable) (got "
            f"{'both' if spec.model.architecture else 'neither'})"
        )
    image = ds.loader in (
        names.DatasetName.DIGITS, names.DatasetName.IMAGEFOLDER, names.DatasetName.TORCHVISION
    )
    if image and (len(shape) != 3 or shape[0] not in (1, 3)):
        problems.append(
            f"spec.model.inputShape: dataset {ds.loader} gives images, so use [C, H, W] with C 1 "
            f"or 3 (got {shape})"
        )
    if image and len(shape) == 3 and min(shape[1:]) < 8:
        problems.append(f"spec.model.inputShape: images need H, W >= 8 (got {shape})")
    if ds.loader == names.DatasetName.TEXT and len(shape) != 1:
        problems.append(
            f"spec.model.inputShape: text takes [sequenceLength], e.g. [64] (got {shape})"
        )
    if ds.loader == names.DatasetName.TEXT and ds.augmentation != names.Augmentation.NONE:
        problems.append("spec.dataset.augmentation: text has no augmentation; use none")
    needs_path = (
        names.DatasetName.IMAGEFOLDER, names.DatasetName.TORCHVISION, names.DatasetName.TEXT
    )
    if ds.loader in needs_path and not ds.path and not ds.uri:
        problems.append(f"spec.dataset.path: required for dataset {ds.loader}; set the data "
                        "location (or spec.dataset.uri to download it first)")
    if ds.loader == names.DatasetName.DIGITS and ds.path:
        problems.append("spec.dataset.path: digits is bundled with scikit-learn; remove path")
    if ds.loader == names.DatasetName.TORCHVISION and not ds.torchvision_class:
        problems.append("spec.dataset.torchvisionClass: required for torchvision, e.g. CIFAR10")
    if ds.loader != names.DatasetName.TORCHVISION and ds.torchvision_class:
        problems.append("spec.dataset.torchvisionClass: only for name torchvision; remove it")
    tv_class = ds.torchvision_class
    torchvision = ds.loader == names.DatasetName.TORCHVISION
    if torchvision and tv_class and tv_class not in names.TORCHVISION_CLASSES:
        problems.append(
            f"spec.dataset.torchvisionClass: {tv_class!r} is not a supported torchvision dataset; "
            f"{_did_you_mean(tv_class, names.TORCHVISION_CLASSES)}use one of "
            f"{', '.join(names.TORCHVISION_CLASSES)}"
        )
    if spec.target is not None:
        t = spec.target
        if t.metric == names.TargetMetric.VALIDATION_ACCURACY and not 0.0 < t.value <= 1.0:
            problems.append(
                f"spec.target.value: accuracy is a fraction in (0, 1], e.g. 0.95 (got {t.value})"
            )
        if t.metric == names.TargetMetric.VALIDATION_LOSS and t.value <= 0.0:
            problems.append(f"spec.target.value: a loss target must be > 0 (got {t.value})")
    sched = spec.training.lr_schedule
    if sched.warmup_epochs >= spec.training.epochs:
        problems.append(
            f"spec.training.lrSchedule.warmupEpochs: must be < epochs {spec.training.epochs} "
            f"(got {sched.warmup_epochs})"
        )
    transferred = spec.freezing.transferred
    if transferred != names.TransferredMode.IGNORE and not spec.freezing.enabled:
        problems.append(
            f"spec.freezing.transferred: {transferred.value} needs spec.freezing.enabled: true "
            "(got enabled: false); enable freezing, or leave transferred at ignore")
    if transferred != names.TransferredMode.IGNORE and spec.training.peft is not None:
        problems.append(
            f"spec.freezing.transferred: a LoRA job (spec.training.peft) trains only its "
            f"adapter, so nothing of it freezes (got {transferred.value}); leave transferred at "
            "ignore")
    if spec.freezing.test != names.FreezingTest.PLASTICITY and not spec.freezing.enabled:
        problems.append(
            f"spec.freezing.test: {spec.freezing.test.value} needs spec.freezing.enabled: true "
            "(got enabled: false); enable freezing, or leave test at plasticity")
    if spec.freezing.test != names.FreezingTest.PLASTICITY and spec.training.peft is not None:
        problems.append(
            f"spec.freezing.test: a LoRA job (spec.training.peft) trains only its adapter, so "
            f"nothing of it freezes (got {spec.freezing.test.value}); leave test at plasticity")
    res = spec.resources
    problems += _nodes_problems(res)
    # The planner's shapes (kiln.placement.estimate): single is k = 1, ddp and fsdp k >= 2,
    # gpus 0 is one CPU process, and the global batch splits evenly over the k devices.
    most = res.gpus if res.gpus is not None else res.gpus_per_node
    several = (names.Parallelism.DDP, names.Parallelism.FSDP)
    if res.parallelism in several and most is not None and most < 2:
        problems.append(
            f"spec.resources.parallelism: {res.parallelism.value} needs 2 or more GPUs (gpus "
            f"{res.gpus}, gpusPerNode {res.gpus_per_node}); use single or auto, or allow 2+ GPUs"
            " (gpus 0 is one CPU process)"
        )
    if res.parallelism == names.Parallelism.SINGLE and res.gpus is not None and res.gpus > 1:
        problems.append(
            f"spec.resources.parallelism: single trains one process on one device, not gpus "
            f"{res.gpus}; use ddp, fsdp or auto, or gpus 1"
        )
    if res.gpus and res.gpus > 1 and spec.training.batch_size % res.gpus:
        problems.append(
            f"spec.training.batchSize: {spec.training.batch_size} does not split evenly over gpus "
            f"{res.gpus} (the global batch is divided among them); use a multiple of {res.gpus}"
        )
    if (res.parallelism in several and res.gpus is None
            and spec.training.batch_size % 2):
        problems.append(
            f"spec.training.batchSize: {spec.training.batch_size} is odd, but "
            f"{res.parallelism.value} splits the global batch evenly over 2, 4 or 8 GPUs; use "
            "an even batch size"
        )
    if (spec.model.pretrained is not None and spec.training.peft is not None
            and spec.warm_start.parent != "auto"):
        problems.append(
            "spec.warmStart.parent: a LoRA job on spec.model.pretrained.uri has that as its "
            "base, and continues the best adapter on it by itself; remove the pin (or remove "
            "spec.model.pretrained to train on the pinned zoo model)")
    pretrained = spec.model.pretrained
    if pretrained is not None:
        problems += source_problems(pretrained.uri, pretrained.secret_ref,
                                    "spec.model.pretrained")
    return problems + _dataset_problems(ds) + template_problems(spec.template)


class SourceUri(typing.NamedTuple):
    """A parsed spec.model.pretrained.uri or spec.dataset.uri (`split_source`).

    Attributes:
        scheme: "s3", "hf" or "path".
        bucket: the S3 bucket, or the Hugging Face organisation; "" for a path.
        key: the S3 key or prefix ("" for the whole bucket), the Hugging Face repository name,
            or the path.
    """

    scheme: str
    bucket: str
    key: str


SOURCE_SCHEMES = "s3://bucket/key-or-prefix, hf://org/name or a path the trainer sees"
# S3 bucket names: 3 to 63 lowercase letters, digits, dots and hyphens (AWS's rules).
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
# A Hugging Face repository id: org/name, letters, digits, '-', '_' and '.'.
_HF_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
_SCHEME_TYPO = re.compile(r"(?i)(s3|hf):")


def split_source(uri: str) -> SourceUri:
    """Parse a source URI: ``s3://bucket/key-or-prefix``, ``hf://org/name``, ``file:///path``
    or a path.

    Raises:
        ValueError: an unknown scheme, a bad bucket, an hf:// id that is not org/name, or
            control characters; the message says what to write instead.
    """
    if any(ord(c) < 32 or ord(c) == 127 for c in uri):
        raise ValueError("contains control characters")
    scheme, sep, rest = uri.partition("://")
    if not sep:
        if _SCHEME_TYPO.match(uri):  # "s3:/b/k" would be read as a local folder named "s3:"
            raise ValueError(f"write {uri.partition(':')[0].lower()}:// with two slashes "
                             f"(got {uri!r}); use {SOURCE_SCHEMES}")
        return SourceUri("path", "", uri)
    if scheme == "file":
        if not rest.startswith("/"):
            raise ValueError(f"write file:///absolute/path, or just a path (got {uri!r})")
        return SourceUri("path", "", rest)
    if scheme == "s3":
        bucket, _, key = rest.partition("/")
        if not _BUCKET.fullmatch(bucket) or ".." in bucket:
            raise ValueError(f"{bucket!r} is not an S3 bucket name (3-63 lowercase letters, "
                             f"digits, '.' and '-'); write s3://bucket/key-or-prefix (got {uri!r})")
        if any(part in (".", "..") for part in key.split("/")):
            raise ValueError(f"'.' and '..' are not parts of an S3 key (got {uri!r})")
        return SourceUri("s3", bucket, key.strip("/"))
    if scheme == "hf":
        parts = rest.strip("/").split("/")
        if len(parts) != 2 or not all(_HF_PART.fullmatch(p) for p in parts):
            raise ValueError(f"write hf://org/name, a Hugging Face Hub repository (got {uri!r})")
        return SourceUri("hf", parts[0], parts[1])
    raise ValueError(f"unsupported scheme {scheme!r} (got {uri!r}); use {SOURCE_SCHEMES}")


def source_problems(uri: str, secret_ref: spec_types.SecretRef | None, at: str) -> list[str]:
    """The problems of the source at `at` (spec.model.pretrained or spec.dataset): its uri
    parses (`split_source`), and a secretRef goes with an s3:// uri only."""
    try:
        scheme = split_source(uri).scheme
    except ValueError as exc:
        return [f"{at}.uri: {exc}"]
    if secret_ref is not None and scheme != "s3":
        return [f"{at}.secretRef: only an s3:// uri reads a Secret (got uri {uri!r}); "
                + "remove secretRef"]
    return []


def _nodes_problems(res: spec_types.ResourcesSpec) -> list[str]:
    """spec.resources.nodes: a job spanning nodes splits its GPUs evenly, one pod per node
    (parallelism single is refused by the gpus > 1 rule).

    Without nodes, gpus above gpusPerNode spans as many nodes as the planner picks, each with
    at most gpusPerNode.
    """
    problems: list[str] = []
    if res.nodes is None or res.nodes == 1:
        return problems
    if not res.gpus:
        got = "gpus is not set" if res.gpus is None else f"got gpus {res.gpus}"
        problems.append(
            f"spec.resources.nodes: {res.nodes} nodes need spec.resources.gpus, the total over "
            f"all nodes ({got}); set gpus to a multiple of {res.nodes}, or remove "
            "nodes (CPU jobs run on one node)")
    elif res.gpus % res.nodes:
        problems.append(f"spec.resources.gpus: {res.gpus} does not split evenly over nodes "
                        f"{res.nodes} (each node's pod takes gpus / nodes); use a multiple of "
                        f"{res.nodes}")
    elif res.gpus_per_node is not None and res.gpus // res.nodes > res.gpus_per_node:
        problems.append(f"spec.resources.nodes: {res.nodes} nodes put {res.gpus // res.nodes} "
                        f"GPUs on each, above gpusPerNode {res.gpus_per_node}; use more nodes "
                        "or fewer GPUs")
    return problems


def _dataset_problems(ds: spec_types.DatasetSpec) -> list[str]:
    """spec.dataset: a built-in loader or an entrypoint, and where each reads its data."""
    problems = []
    if ds.name is not None and ds.entrypoint is not None:
        problems.append(
            f"spec.dataset: set name (a built-in loader) or entrypoint (your dataset as "
            f"package.module:callable), not both (got name {ds.name}, entrypoint {ds.entrypoint})"
        )
    if ds.entrypoint is None and ds.args:
        problems.append(
            "spec.dataset.args: keyword arguments of a dataset entrypoint, but none is set; "
            "set spec.dataset.entrypoint or remove args"
        )
    if ds.entrypoint is not None:
        augmented = ds.augmentation if ds.augmentation != names.Augmentation.NONE else None
        for field, value in (("path", ds.path), ("validationPath", ds.validation_path),
                             ("torchvisionClass", ds.torchvision_class),
                             ("maxSamples", ds.max_samples), ("augmentation", augmented)):
            if value is not None:
                problems.append(
                    f"spec.dataset.{field}: only for the built-in loaders; a dataset entrypoint "
                    "reads its own data and Kiln uses its datasets as returned, so do this in "
                    f"your callable through spec.dataset.args (got {str(value)!r})"
                )
    if ds.uri is not None:
        problems += source_problems(ds.uri, ds.secret_ref, "spec.dataset")
        if ds.path is not None:
            problems.append(f"spec.dataset.uri: the local copy of uri becomes the data's path; "
                            f"set uri or path, not both (got path {ds.path!r})")
        if ds.loader == names.DatasetName.DIGITS:
            problems.append("spec.dataset.uri: digits is bundled with scikit-learn; remove uri "
                            "or name the loader that reads it (imagefolder, torchvision, text)")
        if ds.entrypoint is not None and "path" in ds.args:
            problems.append("spec.dataset.args.path: the entrypoint gets the local copy of "
                            "spec.dataset.uri as its path argument; remove args.path")
    elif ds.secret_ref is not None:
        problems.append("spec.dataset.secretRef: reads the S3 server of spec.dataset.uri, which "
                        "is not set; set uri or remove secretRef")
    remote = names.DatasetName.IMAGEFOLDER, names.DatasetName.TEXT
    for field, value in (("path", ds.path), ("validationPath", ds.validation_path)):
        if value is None or ds.entrypoint is not None:
            continue
        if value.startswith("s3://") and ds.loader not in remote:
            problems.append(
                f"spec.dataset.{field}: only imagefolder and text read from s3:// (got {value!r} "
                f"for {ds.loader}); copy the data to a volume and mount it"
            )
        elif value.startswith("s3://") and not value[len("s3://"):].split("/")[0]:
            problems.append(f"spec.dataset.{field}: name the bucket, as in s3://bucket/prefix "
                            f"(got {value!r})")
        elif "://" in value and not value.startswith("s3://"):
            problems.append(f"spec.dataset.{field}: a local path or s3://bucket/prefix "
                            f"(got {value!r})")
    if ds.validation_path is not None and ds.entrypoint is None and ds.loader not in remote:
        problems.append(
            f"spec.dataset.validationPath: only imagefolder and text take a separate validation "
            f"set (got dataset {ds.loader}); remove it and use validationFraction"
        )
    return problems


# spec.template keys a job may set; the rest of the pod (the trainer container's name, GPU
# limits, node pinning, KILN_* environment) belongs to the operator.
TEMPLATE_KEYS = (
    "image", "imagePullPolicy", "command", "args", "env", "envFrom", "resources", "volumes",
    "volumeMounts", "initContainers", "securityContext", "nodeSelector", "tolerations",
    "affinity", "serviceAccountName", "priorityClassName", "schedulerName", "labels",
    "annotations", "imagePullSecrets", "podSecurityContext",
)
# Names the operator's pod already uses: the trainer container, and its /dev/shm volume.
TRAINER_CONTAINER = "trainer"
SHM_VOLUME, SHM_MOUNT_PATH = "dshm", "/dev/shm"
KILN_VOLUME_PREFIX = "kiln-"  # the initializer's volumes (kiln.controller.pods)
RESERVED_ENV_PREFIX = "KILN_"
# The prefix of the labels and annotations Kiln puts on its pods (job name, attempt, role...).
KILN_PREFIX = f"{names.GROUP}/"
# Device plugins' names for accelerators (shell patterns): GPUs and their MIG or shared slices,
# AMD, Intel, Gaudi, Trainium/Inferentia and TPU devices.
ACCELERATOR_RESOURCES = (
    "*/gpu", "*/gpu.shared", "nvidia.com/*", "amd.com/*", "gpu.intel.com/*", "habana.ai/*",
    "aws.amazon.com/neuron*", "google.com/tpu*",
)
# The environment variable names Kubernetes accepts.
ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")
_STRINGS = ("image", "imagePullPolicy", "serviceAccountName", "priorityClassName",
            "schedulerName")
_LISTS = ("command", "args", "env", "envFrom", "volumes", "volumeMounts", "initContainers",
          "tolerations", "imagePullSecrets")
_MAPPINGS = ("resources", "nodeSelector", "affinity", "labels", "annotations",
             "securityContext", "podSecurityContext")


def template_problems(template: dict[str, Any]) -> list[str]:
    """Problems of spec.template, each ``spec.template.<path>: what is wrong; fix``.

    Known keys only (`TEMPLATE_KEYS`), each of its type; command and args lists of strings
    (args only with command); valid env names outside KILN_* with string values; envFrom
    naming a ConfigMap or Secret, its prefix outside KILN_*; no accelerator resources
    (`accelerator_problems`); no kiln.dev/* labels or annotations (Kiln's);
    volumes named, unique and not Kiln's dshm; every volumeMount (the trainer's or an init
    container's) naming one of those volumes at an absolute, unique mountPath; init containers
    with a unique name and an image; scheduling keys and resource quantities in Kubernetes'
    shapes (`scheduling.scheduling_problems`); and every key at any depth one Kubernetes' pod
    schema knows (`podschema`). A rejected key leaves the others checked: all show at once.
    """
    where = "spec.template"
    problems = []
    rejected: set[str] = set()
    for key, value in template.items():
        if key not in TEMPLATE_KEYS:
            problems.append(f"{where}.{key}: not a pod setting Kiln passes through; "
                            f"{_did_you_mean(str(key), TEMPLATE_KEYS)}use one of "
                            f"{', '.join(TEMPLATE_KEYS)}")
            rejected.add(key)
            continue
        kind, fits = (("a non-empty string", isinstance(value, str) and bool(value))
                      if key in _STRINGS else ("a list", isinstance(value, list))
                      if key in _LISTS else ("a mapping", isinstance(value, dict)))
        if not fits:
            problems.append(f"{where}.{key}: must be {kind} (got {value!r})")
            rejected.add(key)
    # The rest is checked without the rejected keys, so that every problem shows at once.
    template = {k: v for k, v in template.items() if k not in rejected}
    schema = _schema_problems(template)
    for key in ("command", "args"):
        value = template.get(key)
        if value is not None and not all(isinstance(v, str) for v in value):
            problems.append(f"{where}.{key}: must be a list of strings, e.g. [python, train.py] "
                            f"(got {value!r})")
    if template.get("command") == []:
        problems.append(f"{where}.command: empty; give the program and its arguments, e.g. "
                        "[python, train.py], or remove it to run Kiln's trainer")
    if "args" in template and "command" not in template:
        problems.append(f"{where}.args: only with spec.template.command (Kiln's own trainer "
                        "takes no extra arguments); set command too, or remove args")
    problems += _env_problems(template)
    problems += scheduling.scheduling_problems(template)
    problems += accelerator_problems(template)
    for key in ("labels", "annotations"):
        for name in template.get(key) or {}:
            if str(name).startswith(KILN_PREFIX):
                problems.append(f"{where}.{key}.{name}: {KILN_PREFIX}* {key} are Kiln's (it "
                                "tells its pods apart by them); remove it or use another prefix")
    volumes = _volume_problems(template.get("volumes") or [], problems)
    problems += _mount_problems(f"{where}.volumeMounts", template.get("volumeMounts") or [],
                                volumes, trainer=True)
    seen: set[str] = set()
    for i, init in enumerate(template.get("initContainers") or []):
        at = f"{where}.initContainers[{i}]"
        if not isinstance(init, dict):
            problems.append(f"{at}: must be a container mapping (got {type(init).__name__})")
            continue
        name = init.get("name")
        if not (isinstance(name, str) and name):
            problems.append(f"{at}.name: required; give the init container a name")
        elif name == TRAINER_CONTAINER or name in seen:
            problems.append(f"{at}.name: {name!r} is already taken (by "
                            f"{'Kiln' if name == TRAINER_CONTAINER else 'another init container'}"
                            "); choose another name")
        seen.add(str(name))
        if not (isinstance(init.get("image"), str) and init["image"]):
            problems.append(f"{at}.image: required; name the image the init container runs, "
                            "e.g. busybox:1.36")
        mounts = init.get("volumeMounts") or []
        if isinstance(mounts, list):
            problems += _mount_problems(f"{at}.volumeMounts", mounts, volumes, trainer=False)
        else:
            problems.append(f"{at}.volumeMounts: must be a list (got {type(mounts).__name__})")
    # Kiln's own message wins where both speak of one field, or of a value's shape above or
    # below it; a misspelt key is news unless Kiln named that very key.
    said = [p.split(":", 1)[0] for p in problems]

    def news(problem: str) -> bool:
        at, misspelt = problem.split(":", 1)[0], ": unknown field" in problem
        return not any(field == at or (not misspelt and _nested(field, at)) for field in said)

    return problems + [p for p in schema if news(p)]


def _schema_problems(template: dict[str, Any]) -> list[str]:
    """spec.template against the Kubernetes pod schema (`podschema`): unknown keys at any
    depth (``affinity.nodeAfinity``, ``tolerations[0].efect``) and values of the wrong shape."""
    if not template:
        return []
    types = podschema.template_pod_types()
    return [problem for key, value in template.items()
            for problem in podschema.pod_schema_problems(value, types[key],
                                                              f"spec.template.{key}")]


def accelerator_problems(template: dict[str, Any], extra: typing.Sequence[str] = ()
                         ) -> list[str]:
    """The accelerators spec.template asks for in its resources or an init container's: any
    resource named in ACCELERATOR_RESOURCES or `extra` (the operator's --gpu-resource names).
    The pod would get those devices outside the planner's count, so only spec.resources asks.
    """
    inits = template.get("initContainers")
    containers = [("spec.template", template)] + [
        (f"spec.template.initContainers[{i}]", init)
        for i, init in enumerate(inits if isinstance(inits, list) else [])]
    problems = []
    for at, container in containers:
        resources = container.get("resources") if isinstance(container, dict) else None
        for part, amounts in (resources or {}).items() if isinstance(resources, dict) else ():
            found = sorted(str(k) for k in amounts or {} if _accelerator(str(k), extra)) if (
                isinstance(amounts, dict)) else []
            if found:
                problems.append(
                    f"{at}.resources.{part}: {', '.join(found)} "
                    f"{'is an accelerator' if len(found) == 1 else 'are accelerators'}, which "
                    "only Kiln asks for (as many as the planner gives the job); remove "
                    f"{'it' if len(found) == 1 else 'them'} and set spec.resources.gpus")
    return problems


def _accelerator(resource: str, extra: typing.Sequence[str]) -> bool:
    return resource in extra or any(fnmatch.fnmatchcase(resource, pattern)
                                    for pattern in ACCELERATOR_RESOURCES)


def _env_problems(template: dict[str, Any]) -> list[str]:
    problems = []
    for i, item in enumerate(template.get("env") or []):
        name = item.get("name") if isinstance(item, dict) else None
        if not (isinstance(name, str) and name):
            problems.append(f"spec.template.env[{i}]: needs a name (got {item!r})")
        elif not ENV_NAME.fullmatch(name):
            problems.append(
                f"spec.template.env[{i}].name: {name!r} is not a valid variable name; use "
                "letters, digits, '_', '-' and '.', not starting with a digit, e.g. NCCL_DEBUG"
            )
        elif name.startswith(RESERVED_ENV_PREFIX):
            problems.append(
                f"spec.template.env[{i}].name: {name} is reserved: Kiln sets the {RESERVED_ENV_PREFIX}"
                "* variables of the trainer (job, zoo, metrics port); rename it, or set the "
                "matching spec field"
            )
        if isinstance(item, dict) and "value" in item and not isinstance(item["value"], str):
            problems.append(
                f"spec.template.env[{i}].value: must be a string (got {item['value']!r}); quote "
                "it, e.g. value: \"8\""
            )
    for i, item in enumerate(template.get("envFrom") or []):
        refs = [item.get(k) for k in ("configMapRef", "secretRef")] if isinstance(
            item, dict) else []
        if not any(isinstance(r, dict) and r.get("name") for r in refs):
            problems.append(
                f"spec.template.envFrom[{i}]: needs configMapRef or secretRef with a name, e.g. "
                f"{{secretRef: {{name: s3-credentials}}}} (got {item!r})"
            )
        prefix = item.get("prefix") if isinstance(item, dict) else None
        if isinstance(prefix, str) and prefix.startswith(RESERVED_ENV_PREFIX):
            problems.append(
                f"spec.template.envFrom[{i}].prefix: {prefix} would name variables "
                f"{RESERVED_ENV_PREFIX}*, which Kiln sets for the trainer; choose another prefix"
            )
    return problems


def _volume_problems(volumes: list[Any], problems: list[str]) -> set[str]:
    """Append the volumes' problems to `problems`; returns the volume names."""
    found: set[str] = set()
    for i, volume in enumerate(volumes):
        at = f"spec.template.volumes[{i}]"
        name = volume.get("name") if isinstance(volume, dict) else None
        if not (isinstance(name, str) and name):
            problems.append(f"{at}.name: required; name the volume so a volumeMount can use it")
            continue
        if name == SHM_VOLUME:
            problems.append(f"{at}.name: {SHM_VOLUME} is Kiln's shared-memory volume; choose "
                            "another name")
        elif name.startswith(KILN_VOLUME_PREFIX):
            problems.append(f"{at}.name: {KILN_VOLUME_PREFIX}* names Kiln's own volumes (the "
                            "initializer's sources, cache and Secrets); choose another name")
        elif name in found:
            problems.append(f"{at}.name: {name!r} is used by another volume; names must be "
                            "unique")
        elif len(volume) < 2:
            problems.append(f"{at}: {name!r} has no source; add one, e.g. persistentVolumeClaim: "
                            "{claimName: data}, hostPath: {path: /data} or emptyDir: {}")
        found.add(name)
    return found


def _mount_problems(at: str, mounts: list[Any], volumes: set[str], *, trainer: bool
                    ) -> list[str]:
    problems, paths = [], {SHM_MOUNT_PATH} if trainer else set()
    for i, mount in enumerate(mounts):
        here = f"{at}[{i}]"
        if not isinstance(mount, dict):
            problems.append(f"{here}: must be a mapping with name and mountPath (got {mount!r})")
            continue
        name, path = mount.get("name"), mount.get("mountPath")
        if name not in volumes:
            have = f"volumes: {', '.join(sorted(volumes))}" if volumes else "no volumes"
            problems.append(
                f"{here}.name: {name!r} names no volume in spec.template.volumes ({have}); add "
                "a volume of that name or fix the mount's name"
            )
        if not (isinstance(path, str) and path.startswith("/")):
            problems.append(f"{here}.mountPath: must be an absolute path, e.g. /data "
                            f"(got {path!r})")
        elif path.rstrip("/") in paths:
            taken = " (Kiln mounts shared memory there)" if path == SHM_MOUNT_PATH else ""
            problems.append(f"{here}.mountPath: {path} is mounted already{taken}; use another "
                            "path")
        else:
            paths.add(path.rstrip("/"))
    return problems


def problems_of(exc: ValidationError) -> list[str]:
    """Each error of `exc` as one ``field.path: what is wrong (got value)`` line."""
    return [_format_error(e) for e in exc.errors()]


def to_wire(model: BaseModel) -> dict[str, Any]:
    """A type as its camelCase JSON-compatible dict (defaults included, nulls dropped)."""
    return model.model_dump(mode="json", by_alias=True, exclude_none=True)


def unknown_fields(model: type[BaseModel], data: Any, path: str = "") -> list[str]:
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
        for sub in bounds.model_types(field.annotation):
            if isinstance(value, list):
                for i, item in enumerate(value):
                    problems += unknown_fields(sub, item, f"{where}[{i}]")
            else:
                problems += unknown_fields(sub, value, where)
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


def _did_you_mean(value: str, choices: typing.Sequence[str]) -> str:
    """"did you mean 'X'? " for the closest of `choices` (case-insensitive), or ""."""
    by_lower = {c.lower(): c for c in choices}
    close = difflib.get_close_matches(value.lower(), list(by_lower), n=1, cutoff=0.6)
    return f"did you mean {by_lower[close[0]]!r}? " if close else ""


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
    if where == "metadata.namespace" and error["type"] == "string_pattern_mismatch":
        message = ("must be an RFC 1123 label (it also names local files and store keys): "
                   "lowercase letters, digits and '-', e.g. team-vision")
    if where == "spec.warmStart.parent" and error["type"] == "string_pattern_mismatch":
        message = ("must be auto or a zoo model id (letters, digits, '_', '.', '-'), e.g. "
                   "small_resnet-7f3c2a1b; `kiln zoo ls` lists them")
    if where.endswith(".entrypoint") and error["type"] == "string_pattern_mismatch":
        message = ("must be package.module:callable, dotted Python names on both sides of one "
                   "colon, e.g. mynets.mixer:mixer")
    if where in ("apiVersion", "kind"):
        message = f"must be {names.API_VERSION if where == 'apiVersion' else names.KIND}"
    shown = error.get("input")
    look_alike = names.non_ascii(shown) if isinstance(shown, str) else None
    if look_alike is not None and error["type"] == "string_pattern_mismatch":
        return f"{where}: {shown!r} {look_alike}; {message}"
    got = f" (got {shown!r})" if shown is not None and not isinstance(shown, dict | list) else ""
    if isinstance(shown, bool) and error["type"] == "enum":
        # YAML 1.1 (PyYAML, kubectl) reads an unquoted off/on/yes/no as a boolean.
        got += "; YAML reads an unquoted off, on, yes or no as true/false: quote it, e.g. \"off\""
    return f"{where}: {message}{got}"

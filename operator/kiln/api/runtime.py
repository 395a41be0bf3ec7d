"""TrainingRuntime and ClusterTrainingRuntime: pod settings a platform team sets once.

A job names one in spec.runtimeRef; admission records it in the job's status.runtime
(`record`), and wherever the job is read its spec.template is merged over that record
(`resolve`). A key the runtime locks is the runtime's alone: a job that sets it is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import Field, ValidationError

from kiln.api import bounds, names, status, validation
from kiln.api import spec as spec_types

RUNTIME_KIND, CLUSTER_RUNTIME_KIND = "TrainingRuntime", "ClusterTrainingRuntime"
RUNTIME_PLURAL, CLUSTER_RUNTIME_PLURAL = "trainingruntimes", "clustertrainingruntimes"
RUNTIME_SINGULAR, CLUSTER_RUNTIME_SINGULAR = "trainingruntime", "clustertrainingruntime"
RUNTIME_SHORT_NAMES, CLUSTER_RUNTIME_SHORT_NAMES = ("trt",), ("ctrt",)
RUNTIME_STATUS = "runtime"  # its key in a job's status
# How a job's unlocked template key combines with the runtime's: lists of keyed entries by
# that key, as Kubernetes merges them (the job's entry wins; a mount is its path, so a job
# mounting a runtime's volume elsewhere adds a mount), lists of whole entries by adding the
# job's new ones, maps by key; anything else is the job's whole value when it sets one.
BY_FIELD = {"env": "name", "volumes": "name", "volumeMounts": "mountPath",
            "initContainers": "name"}
ADDED = ("tolerations", "envFrom", "imagePullSecrets")
BY_KEY = ("nodeSelector", "labels", "annotations")


class TrainingRuntimeSpec(names.ApiModel):
    template: dict[str, Any] = Field(
        default_factory=dict,
        description="template: the pod settings every job on this runtime starts from, with "
        f"the keys of a TrainingJob's spec.template: {', '.join(validation.TEMPLATE_KEYS)}.",
    )
    locked: list[str] = Field(
        default_factory=list,
        max_length=len(validation.TEMPLATE_KEYS),
        # In the CRD too, so that kubectl refuses a runtime locking no key rather than every
        # job on it failing at admission.
        json_schema_extra={"items": {"type": "string", "enum": list(validation.TEMPLATE_KEYS)}},
        description="locked: spec.template keys a job on this runtime may not set, e.g. "
        "[image, securityContext]; the runtime's value (or none) holds. An unlocked key the "
        "job sets: env, volumes and initContainers merge by name, volumeMounts by mountPath "
        "(the job's entry wins), tolerations, envFrom and imagePullSecrets add the job's entries, "
        "nodeSelector, labels and annotations merge by key; any other key is the job's value.",
    )


class TrainingRuntime(names.ApiModel):
    """TrainingRuntime: pod settings jobs of its namespace name in spec.runtimeRef."""

    api_version: Literal["kiln.dev/v1alpha1"] = Field(description="apiVersion: kiln.dev/v1alpha1")
    kind: Literal["TrainingRuntime"] = Field(description="kind: TrainingRuntime")
    metadata: spec_types.ObjectMeta = Field(description="metadata: standard object metadata.")
    spec: TrainingRuntimeSpec = Field(description="spec: the pod template and what is locked.")


class ClusterTrainingRuntime(names.ApiModel):
    """ClusterTrainingRuntime: pod settings jobs of every namespace name in spec.runtimeRef."""

    api_version: Literal["kiln.dev/v1alpha1"] = Field(description="apiVersion: kiln.dev/v1alpha1")
    kind: Literal["ClusterTrainingRuntime"] = Field(description="kind: ClusterTrainingRuntime")
    metadata: spec_types.ObjectMeta = Field(description="metadata: standard object metadata.")
    spec: TrainingRuntimeSpec = Field(description="spec: the pod template and what is locked.")


AnyRuntime = TrainingRuntime | ClusterTrainingRuntime


def is_runtime(doc: Any) -> bool:
    """Whether a document is a TrainingRuntime or ClusterTrainingRuntime (by its kind)."""
    return isinstance(doc, dict) and doc.get("kind") in (RUNTIME_KIND, CLUSTER_RUNTIME_KIND)


def parse_runtime(doc: Any, *, source: str = "") -> AnyRuntime:
    """Parse and check one runtime document: its schema, its template as a job's
    spec.template is checked, and its locked keys.

    Raises:
        InvalidSpec: every problem, each ``<Kind> <name>: field: what is wrong; fix``.
    """
    given = doc if isinstance(doc, dict) else {}
    model = ClusterTrainingRuntime if given.get("kind") == CLUSTER_RUNTIME_KIND else TrainingRuntime
    kind = model.__name__
    label = f"{kind} {(given.get('metadata') or {}).get('name', '')}"
    # Every job on it carries its template (status.runtime, the trainer pod's spec): a job's
    # bounds hold for it too.
    too_large = bounds.problems(doc)
    if too_large:
        raise names.InvalidSpec([f"{label.strip()}: {p}" for p in too_large], source=source,
                                kind=kind)
    try:
        runtime = model.model_validate(doc)
    except ValidationError as exc:
        # Unknown keys as a job's are named (with a did-you-mean), not as pydantic says them.
        found = validation.unknown_fields(model, doc) + [
            p for p in validation.problems_of(exc)
            if "extra inputs are not permitted" not in p.lower()]
        raise names.InvalidSpec([f"{label.strip()}: {p}" for p in found],
                                source=source, kind=kind) from None
    found = validation.template_problems(runtime.spec.template)
    for i, key in enumerate(runtime.spec.locked):
        if key not in validation.TEMPLATE_KEYS:
            found.append(f"spec.locked[{i}]: {key!r} is not a spec.template key; use one of "
                         f"{', '.join(validation.TEMPLATE_KEYS)}")
    if found:
        raise names.InvalidSpec([f"{label}: {p}" for p in found], source=source, kind=kind)
    return runtime


def record(runtime: AnyRuntime) -> dict[str, Any]:
    """What a job's status.runtime keeps of the runtime it was admitted on."""
    meta = runtime.metadata
    found = {"kind": runtime.kind, "name": meta.name, "uid": meta.uid,
             "resourceVersion": meta.resource_version,
             "template": runtime.spec.template, "locked": list(runtime.spec.locked)}
    return {k: v for k, v in found.items() if v is not None}


def lock_problems(job_template: Mapping[str, Any], recorded: Mapping[str, Any]) -> list[str]:
    """The job's own spec.template keys that its runtime locks, each named with the fix."""
    locked = recorded.get("locked") or []
    return [f"spec.template.{key}: locked by {recorded.get('kind')} {recorded.get('name')}; "
            "remove it from the job (the runtime sets it)" for key in job_template
            if key in locked]


def merge(runtime_template: Mapping[str, Any], locked: list[str],
          job_template: Mapping[str, Any]) -> dict[str, Any]:
    """The pod template a job runs with: the job's over the runtime's (see `BY_FIELD`,
    `ADDED`, `BY_KEY`); a locked key is the runtime's. Merging twice gives the same."""
    merged = dict(runtime_template)
    for key, value in job_template.items():
        base = runtime_template.get(key)
        if key in locked:
            continue
        if base is None:
            merged[key] = value
        elif key in BY_FIELD and isinstance(base, list) and isinstance(value, list):
            merged[key] = _by_field(BY_FIELD[key], base, value)
        elif key in ADDED and isinstance(base, list) and isinstance(value, list):
            merged[key] = [*base, *(v for v in value if v not in base)]
        elif key in BY_KEY and isinstance(base, dict) and isinstance(value, dict):
            merged[key] = {**base, **value}
        else:
            merged[key] = value
    return merged


def _by_field(field: str, base: list[Any], extra: list[Any]) -> list[Any]:
    """`base` with each entry replaced by `extra`'s of the same `field` value, then `extra`'s
    others."""
    named = {e.get(field): e for e in extra if isinstance(e, dict)}
    kept = [named.get(e.get(field), e) if isinstance(e, dict) else e for e in base]
    return [*kept, *(e for e in extra if e not in kept)]


def resolve(doc: dict[str, Any], recorded: Any) -> dict[str, Any]:
    """The job document `doc` with its spec.template merged over `recorded` (a
    status.runtime); `doc` itself when there is none."""
    spec = doc.get("spec")
    if not isinstance(recorded, dict) or not isinstance(spec, dict):
        return doc
    template = spec.get("template")
    runtime_template = recorded.get("template")
    merged = merge(runtime_template if isinstance(runtime_template, dict) else {},
                   [str(k) for k in recorded.get("locked") or []],
                   template if isinstance(template, dict) else {})
    return {**doc, "spec": {**spec, "template": merged}}


def parse_job_on(doc: Mapping[str, Any], recorded: Mapping[str, Any], *,
                 source: str = "") -> status.TrainingJob:
    """The job document `doc` as written, checked on the runtime `recorded` (a `record`).

    Raises:
        InvalidSpec: the keys it sets that the runtime locks, then the problems of the job
            with its template merged over the runtime's (a mount of the runtime's volume is
            fine; a typo in the job's own keys is not).
    """
    spec = doc.get("spec")
    template = spec.get("template") if isinstance(spec, dict) else None
    written = template if isinstance(template, dict) else {}
    locked = lock_problems(written, recorded)
    try:
        job = validation.parse_job(resolve(dict(doc), dict(recorded)), source=source)
    except names.InvalidSpec as exc:
        raise names.InvalidSpec(locked + exc.problems, source=source, job=exc.job,
                                rejected=exc.rejected) from None
    if locked:
        raise names.InvalidSpec(locked, source=source, job=job)
    return job.model_copy(update={"spec": job.spec.model_copy(update={"template": written})})


def template_problems_on(job_spec: Mapping[str, Any], recorded: Mapping[str, Any],
                         name: str) -> list[str]:
    """The problems of a job spec (a sweep's spec.template, as the wire has it) on the
    runtime `recorded`, each under the sweep's ``spec.template``: what every trial would be
    refused for at admission."""
    doc = {"apiVersion": names.API_VERSION, "kind": names.KIND, "metadata": {"name": name},
           "spec": dict(job_spec)}
    try:
        parse_job_on(doc, recorded)
    except names.InvalidSpec as exc:
        return [f"spec.template.{p.removeprefix('spec.')}" for p in exc.problems]
    return []


def on(job: status.TrainingJob, recorded: Mapping[str, Any]) -> status.TrainingJob:
    """`job` with its spec.template merged over the runtime `recorded`: the job as it runs."""
    merged = merge(recorded.get("template") or {}, list(recorded.get("locked") or []),
                   job.spec.template)
    return job.model_copy(update={"spec": job.spec.model_copy(update={"template": merged})})


def ref_of(doc: Any) -> spec_types.RuntimeRef | None:
    """The spec.runtimeRef of a job document, or None (absent, or not valid: the job's
    own checks say why)."""
    spec = doc.get("spec") if isinstance(doc, dict) else None
    wanted = spec.get("runtimeRef") if isinstance(spec, dict) else None
    try:
        return spec_types.RuntimeRef.model_validate(wanted) if wanted is not None else None
    except ValidationError:
        return None


def find(ref: spec_types.RuntimeRef | None, runtimes: Sequence[AnyRuntime],
         namespace: str | None = None) -> AnyRuntime | None:
    """The runtime of `runtimes` that `ref` names (by kind and name), or None. A
    TrainingRuntime of another namespace than the job's (`namespace`, both set) is not the
    one the operator finds."""
    if ref is None:
        return None
    return next((r for r in runtimes if (r.kind, r.metadata.name) == (ref.kind, ref.name)
                 and not (r.kind == RUNTIME_KIND and namespace and r.metadata.namespace
                          and r.metadata.namespace != namespace)), None)

"""A job runs on the spec the operator admitted, recorded in status.admittedSpec.

After admission only the run policy and the pod template's scheduling directives (`MUTABLE_*`)
take effect, as in a Kubernetes Job; `running_doc` is the job as it runs and `ignored_edits`
names what else an edit changed (so no later restart runs a spec nobody validated).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from kiln.api import bounds, names, runtime, spec, status, validation

ADMITTED_SPEC_STATUS = "admittedSpec"  # its key in status
MUTABLE_FIELDS = ("runPolicy",)
MUTABLE_TEMPLATE_KEYS = ("nodeSelector", "affinity", "tolerations", "labels", "annotations")


def admitted_spec(job: status.TrainingJob) -> dict[str, Any]:
    """What status.admittedSpec records of an admitted job: its spec, defaults filled in."""
    return validation.to_wire(job.spec)


def running_doc(body: Mapping[str, Any], *, template_edits: bool = True) -> dict[str, Any]:
    """The job document `body` (an object as read from the API) runs as, without status.

    Once admitted: the admitted spec, with the current spec.runPolicy and (with
    `template_edits`) the current spec.template scheduling directives. Before: as it is.
    Either way its spec.template is merged over the runtime recorded in status.runtime.
    """
    doc = {k: v for k, v in body.items() if k != "status"}
    meta = doc.get("metadata")
    if isinstance(meta, dict) and "managedFields" in meta:
        # The API server's bookkeeping, shaped like the spec; Kiln never reads it.
        doc["metadata"] = {k: v for k, v in meta.items() if k != "managedFields"}
    recorded = (body.get("status") or {}).get(runtime.RUNTIME_STATUS)
    admitted = (body.get("status") or {}).get(ADMITTED_SPEC_STATUS)
    if not isinstance(admitted, dict):
        return runtime.resolve(doc, recorded)
    spec_now = doc.get("spec")
    current: dict[str, Any] = spec_now if isinstance(spec_now, dict) else {}
    running = {k: v for k, v in admitted.items() if k not in MUTABLE_FIELDS}
    running.update({k: current[k] for k in MUTABLE_FIELDS if k in current})
    template = {k: v for k, v in (admitted.get("template") or {}).items()
                if k not in MUTABLE_TEMPLATE_KEYS}
    template_now = current.get("template")
    now: dict[str, Any] = template_now if isinstance(template_now, dict) else {}
    scheduling = now if template_edits else admitted.get("template") or {}
    template.update({k: v for k, v in scheduling.items() if k in MUTABLE_TEMPLATE_KEYS})
    running["template"] = template
    doc["spec"] = running
    return runtime.resolve(doc, recorded)


def parse_running(body: Mapping[str, Any], *, source: str = "") -> status.TrainingJob:
    """The job `body` runs as (`running_doc`), parsed. An edit of the template's scheduling
    directives that does not validate is left out: the admitted ones stay in effect.

    Raises:
        InvalidSpec: the job does not parse (before admission, or its run policy).
    """
    try:
        return validation.parse_job(running_doc(body), source=source)
    except names.InvalidSpec:
        if not isinstance((body.get("status") or {}).get(ADMITTED_SPEC_STATUS), dict):
            raise
        return validation.parse_job(running_doc(body, template_edits=False), source=source)


def ignored_edits(body: Mapping[str, Any]) -> list[str]:
    """The fields of the spec that differ from the admitted one and so do not take effect,
    each named as deep as the two differ (``spec.model.args.width``); [] before admission."""
    admitted = (body.get("status") or {}).get(ADMITTED_SPEC_STATUS)
    current = body.get("spec")
    if not isinstance(admitted, dict):
        return []
    if not isinstance(current, dict):
        return ["spec"]
    # The admitted template holds the runtime's keys too; so must what it is compared with.
    current = runtime.resolve({"spec": current},
                              body["status"].get(runtime.RUNTIME_STATUS))["spec"]
    too_large = bounds.problems({"spec": current})
    if too_large:
        return sorted({p.split(":", 1)[0] for p in too_large})
    found: list[str] = []
    for name, field in spec.TrainingJobSpec.model_fields.items():
        key = field.alias or name
        if key in MUTABLE_FIELDS:
            continue
        if key == "template":
            found += _template_edits(admitted.get(key) or {}, current.get(key))
            continue
        candidate = {k: v for k, v in admitted.items() if k != key}
        if key in current:
            candidate[key] = current[key]
        try:  # the field as the admitted one was written: defaults filled, nulls dropped
            wire = validation.to_wire(spec.TrainingJobSpec.model_validate_json(
                json.dumps(candidate), strict=True))
        except ValidationError:
            found.append(f"spec.{key}")
            continue
        found += _differences(admitted.get(key), wire.get(key), f"spec.{key}")
    return found


def edited_parts(before: Any, after: Any) -> tuple[bool, bool]:
    """Between two versions of a spec: (whether what is fixed after admission changed, whether
    the template's scheduling directives did)."""
    def parts(spec: Any) -> tuple[Any, Any]:
        if not isinstance(spec, dict):
            return spec, None
        found = spec.get("template")
        template: dict[str, Any] = found if isinstance(found, dict) else {}
        fixed = {k: v for k, v in spec.items() if k not in (*MUTABLE_FIELDS, "template")}
        fixed["template"] = {k: v for k, v in template.items() if k not in MUTABLE_TEMPLATE_KEYS}
        return fixed, {k: v for k, v in template.items() if k in MUTABLE_TEMPLATE_KEYS}

    (fixed_before, scheduling_before), (fixed_after, scheduling_after) = parts(before), parts(
        after)
    return fixed_before != fixed_after, scheduling_before != scheduling_after


def _template_edits(admitted: Mapping[str, Any], current: Any) -> list[str]:
    if not isinstance(current, dict):
        return ["spec.template"]
    return [f"spec.template.{k}" for k in sorted(set(admitted) | set(current))
            if k not in MUTABLE_TEMPLATE_KEYS and admitted.get(k) != current.get(k)]


def _differences(before: Any, after: Any, path: str) -> list[str]:
    """Paths under `path` where `before` and `after` differ (into mappings, lists whole)."""
    found, stack = [], [(before, after, path)]
    while stack:
        a, b, at = stack.pop()
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            stack.extend((a.get(k), b.get(k), f"{at}.{k}") for k in sorted(set(a) | set(b),
                                                                          reverse=True))
        else:
            found.append(at)
    return found

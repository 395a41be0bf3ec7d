"""The TrainingJob CustomResourceDefinition, generated from `kiln.api`.

Role: turn the pydantic types of `kiln.api` (the single source of truth) into an
`apiextensions.k8s.io/v1` CRD whose `openAPIV3Schema` is *structural*: every node has a `type`,
every object lists its `properties`, no `$ref`/`anyOf`/`oneOf`/`allOf`; optional fields are
`nullable`, bounds use OpenAPI v3's boolean `exclusiveMinimum`/`exclusiveMaximum`, defaults are
declared so the API server applies them, and only the free-form maps (`spec.model.args`,
`spec.template`) keep unknown fields. Every status field is declared, because a structural schema
silently prunes what it does not declare.

Callers: `kiln crd` (writes `crds/trainingjob.yaml` and the Helm chart's copy) and the tests,
which regenerate and compare byte for byte and check that the schema and `api.check_schema`
agree on a corpus of documents.

Non-goals: no cluster access; no CEL rules (cross-field checks stay in `api.validate`, which the
operator runs); never imports kopf or kubernetes.
"""

from __future__ import annotations

import copy
import typing
from typing import Any

import yaml
from pydantic import BaseModel

from kiln import api

HEADER = "# Generated from operator/kiln/api/ by `kiln crd`; do not edit.\n"
PRESERVE_UNKNOWN = "x-kubernetes-preserve-unknown-fields"

# (column name, JSON path, description, priority); the type is read from the schema at that
# path, except for timestamps (`_DATES`), which kubectl shows as an age. Priority 1 columns
# show with `kubectl get -o wide` only.
PRINTER_COLUMNS = (
    ("Phase", ".status.phase", "Coarse job state, derived from conditions.", 0),
    ("Epoch", ".status.progress.epoch", "Epoch in progress (1-based).", 0),
    ("ETA", ".status.progress.etaSeconds", "Estimated seconds left for the remaining epochs.",
     0),
    ("Parent", ".status.warmStart.parent", "Zoo model the job warm-started from.", 0),
    ("GPUs", ".status.placement.gpus", "GPUs the planner gave the job.", 0),
    ("Node", ".status.placement.node", "Node the planner placed the job on.", 1),
    ("Accuracy", ".status.result.validationAccuracy", "Final validation accuracy.", 0),
    ("Progress-Read", ".status.progress.lastUpdatedTime",
     "When the operator last read the trainer's progress (old: stale).", 1),
    ("Age", ".metadata.creationTimestamp", "", 0),
)
_DATES = (".metadata.creationTimestamp", ".status.progress.lastUpdatedTime")

# Key order inside one schema node, so the YAML reads top-down and never reorders by itself.
_KEY_ORDER = (
    "description", "type", "nullable", "enum", "default", "minimum", "exclusiveMinimum",
    "maximum", "exclusiveMaximum", "minLength", "maxLength", "pattern", "minItems", "maxItems",
    "items", "required", "properties", "additionalProperties", PRESERVE_UNKNOWN,
)
# JSON-schema keywords pydantic may emit that carry no meaning for the API server.
_DROPPED = ("title", "$defs")
_NULL = {"type": "null"}


class UnsupportedSchema(ValueError):
    """A type in `kiln.api` has no structural-schema form (e.g. a union of two types)."""


def build() -> dict[str, Any]:
    """The CRD as a dict, ready to dump as YAML or send to the API server.

    Returns:
        An `apiextensions.k8s.io/v1` CustomResourceDefinition for kiln.dev/v1alpha1 TrainingJob.

    Raises:
        UnsupportedSchema: a type in `kiln.api` cannot be written as a structural schema.
    """
    schema = openapi_schema()
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{api.PLURAL}.{api.GROUP}"},
        "spec": {
            "group": api.GROUP,
            "names": {
                "kind": api.KIND,
                "listKind": f"{api.KIND}List",
                "plural": api.PLURAL,
                "singular": api.SINGULAR,
                "shortNames": list(api.SHORT_NAMES),
                "categories": list(api.CATEGORIES),
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": api.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": _printer_columns(schema),
                    "schema": {"openAPIV3Schema": schema},
                }
            ],
        },
    }


def openapi_schema() -> dict[str, Any]:
    """The structural `openAPIV3Schema` of a TrainingJob, derived from `api.TrainingJob`.

    Raises:
        UnsupportedSchema: a type in `kiln.api` cannot be written as a structural schema.
    """
    raw = api.TrainingJob.model_json_schema(by_alias=True, mode="validation")
    schema = _structural(_inline_refs(raw, raw.get("$defs", {})), "")
    _add_factory_defaults(api.TrainingJob, schema)
    props = schema["properties"]
    # The server routes on apiVersion and kind and owns metadata: only metadata.name may be
    # restricted (no description on metadata itself, or the CRD is refused).
    for key in ("apiVersion", "kind"):
        props[key] = {"description": props[key]["description"], "type": "string"}
    name = props["metadata"]["properties"]["name"]
    props["metadata"] = {"type": "object", "properties": {"name": name}}
    schema["required"] = ["spec"]
    return schema


def render() -> str:
    """The CRD as YAML text with the generated-file header; same input, same bytes."""
    body: str = yaml.safe_dump(build(), sort_keys=False, width=100, allow_unicode=True)
    return HEADER + body



def _inline_refs(node: Any, defs: dict[str, Any]) -> Any:
    """`node` with every `$ref` replaced by its definition; sibling keys (description, default)
    override the definition's."""
    if isinstance(node, list):
        return [_inline_refs(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    out = {k: _inline_refs(v, defs) for k, v in node.items() if k not in ("$ref", "$defs")}
    if "$ref" in node:
        target = _inline_refs(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
        out = {**target, **out}
    return out


def _structural(node: dict[str, Any], where: str) -> dict[str, Any]:
    """One JSON-schema node (refs inlined) as a structural OpenAPI v3 node.

    Raises:
        UnsupportedSchema: a union of two non-null types, or a keyword this converter
            does not know (so nothing is silently dropped).
    """
    node = dict(node)
    for key in ("allOf", "anyOf", "oneOf"):
        options = node.pop(key, None)
        if options is None:
            continue
        kept = [o for o in options if o != _NULL]
        if key != "allOf" and len(kept) < len(options):
            node["nullable"] = True
        if len(kept) != 1:
            raise UnsupportedSchema(f"{where or '<root>'}: {key} of {len(kept)} types")
        node = {**kept[0], **node}  # the outer description/default win
    node = {k: v for k, v in node.items() if k not in _DROPPED}
    out: dict[str, Any] = {}
    if "const" in node:
        node.setdefault("enum", [node.pop("const")])
    for bound, inclusive in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if bound in node and not isinstance(node[bound], bool):
            node[inclusive], node[bound] = node[bound], True
    if node.get("nullable") and "enum" in node and None not in node["enum"]:
        # OpenAPI v3: an enum is the whole set of allowed values, null included; the API server
        # checks the enum even for a nullable null.
        node["enum"] = [*node["enum"], None]
    if "default" in node and node["default"] is None:
        del node["default"]  # absent and null mean the same to kiln.api
    if node.get("type") == "object":
        _structural_object(node, out, where)
    elif node.get("type") == "array":
        out["items"] = _structural(node.pop("items"), f"{where}[]")
    elif "type" not in node:
        raise UnsupportedSchema(f"{where or '<root>'}: no type")
    for key, value in node.items():
        if key in ("properties", "additionalProperties", "items"):
            continue  # converted above
        if key not in _KEY_ORDER:
            raise UnsupportedSchema(f"{where or '<root>'}: keyword {key!r} has no structural form")
        out[key] = value
    return {k: out[k] for k in _KEY_ORDER if k in out}


def _structural_object(node: dict[str, Any], out: dict[str, Any], where: str) -> None:
    """Fill `out` with an object node's properties, or mark a free-form map."""
    extra = node.get("additionalProperties")
    if "properties" in node:
        out["properties"] = {
            key: _structural(prop, f"{where}.{key}" if where else key)
            for key, prop in node["properties"].items()
        }
    elif isinstance(extra, dict) and extra:
        out["additionalProperties"] = _structural(extra, f"{where}.*")
    elif extra is False:  # a model without fields
        out["properties"] = {}
    else:  # dict[str, Any]: free-form, kept as written
        out[PRESERVE_UNKNOWN] = True


def _add_factory_defaults(model: type[BaseModel], node: dict[str, Any]) -> None:
    """Declare `default_factory` defaults (pydantic leaves them out of its JSON schema).

    A nested spec object defaults to `{}`, which the API server then fills from the nested
    properties' own defaults, exactly as pydantic builds the default object.
    """
    for name, field in model.model_fields.items():
        prop = node["properties"][field.alias or name]
        if field.default_factory is not None:
            value = field.get_default(call_default_factory=True)
            if isinstance(value, BaseModel):
                if value != type(value)():
                    raise UnsupportedSchema(f"{name}: default differs from its type's defaults")
                prop["default"] = {}
            else:
                prop["default"] = copy.deepcopy(value)
            prop.update({k: prop.pop(k) for k in _KEY_ORDER if k in prop})  # keep key order
        for sub in _model_types(field.annotation):
            _add_factory_defaults(sub, prop["items"] if prop["type"] == "array" else prop)


def _model_types(annotation: Any) -> list[type[BaseModel]]:
    """The BaseModel classes inside a type annotation (X, X | None, list[X])."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [t for arg in typing.get_args(annotation) for t in _model_types(arg)]


def _printer_columns(schema: dict[str, Any]) -> list[dict[str, Any]]:
    """`kubectl get` columns; each column's type comes from the schema node at its path."""
    columns = []
    for name, path, description, priority in PRINTER_COLUMNS:
        node = schema
        if path != ".metadata.creationTimestamp":  # metadata's schema is the API server's
            for part in path.strip(".").split("."):
                node = node["properties"][part]
        kind = "date" if path in _DATES else node["type"]
        column: dict[str, Any] = {"name": name, "type": kind, "jsonPath": path}
        if description:
            column["description"] = description
        if priority:
            column["priority"] = priority
        columns.append(column)
    return columns

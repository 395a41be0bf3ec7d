"""Kiln's CustomResourceDefinitions (jobs, sweeps, runtimes), generated from `kiln.api`.

Role: turn the pydantic types of `kiln.api` (the single source of truth) into
`apiextensions.k8s.io/v1` CRDs (one `Resource` each: `JOB`, `SWEEP`, `RUNTIME`, `CLUSTER_RUNTIME`) whose `openAPIV3Schema` is *structural*: every node has a `type`,
every object lists its `properties`, no `$ref`/`anyOf`/`oneOf`/`allOf`; optional fields are
`nullable`, bounds use OpenAPI v3's boolean `exclusiveMinimum`/`exclusiveMaximum`, defaults are
declared so the API server applies them, and only the free-form maps (`spec.model.args`,
`spec.template`) keep unknown fields. Every status field is declared, because a structural schema
silently prunes what it does not declare.

Callers: `kiln crd` (prints them; `--write` regenerates `crds/<kind>.yaml` and the Helm chart's
copies) and the tests, which regenerate and compare byte for byte and check that the schemas
agree with `api.check_schema` and `api.sweep.parse_sweep` on corpora of documents.

The API server also checks the cross-field rules that CEL can say (`VALIDATIONS`,
`SWEEP_VALIDATIONS`), and refuses changes to the spec parts a running job or sweep cannot take.
No cluster access; never imports kopf or kubernetes.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import typing
from typing import Any

import yaml
from pydantic import BaseModel

from kiln import api

VALIDATIONS_KEY = "x-kubernetes-validations"
HEADER = "# Generated from operator/kiln/api/ by `kiln crd`; do not edit.\n"
PRESERVE_UNKNOWN = "x-kubernetes-preserve-unknown-fields"

# (column name, JSON path, description, priority); the type is read from the schema at that
# path, except for timestamps (`_DATES`), which kubectl shows as an age. Priority 1 columns
# show with `kubectl get -o wide` only.
Column = tuple[str, str, str, int]
# (schema node, CEL rule, message, fieldPath); the node is a dotted path of properties.
Validation = tuple[str, str, str, str]
PRINTER_COLUMNS: tuple[Column, ...] = (
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
SWEEP_PRINTER_COLUMNS: tuple[Column, ...] = (
    ("Phase", ".status.phase", "Pending, Running, Succeeded or Failed.", 0),
    ("Done", ".status.trials.succeeded", "Trials that finished.", 0),
    ("Running", ".status.trials.running", "Trials running now.", 0),
    ("Pruned", ".status.trials.pruned", "Trials stopped early, behind the others.", 0),
    ("Failed", ".status.trials.failed", "Trials that failed.", 0),
    ("Best", ".status.best.metric", "The best trial's objective so far.", 0),
    ("Best-Trial", ".status.best.trial", "The best trial's TrainingJob.", 0),
    ("Age", ".metadata.creationTimestamp", "", 0),
)
_DATES = (".metadata.creationTimestamp", ".status.progress.lastUpdatedTime")

# Key order inside one schema node, so the YAML reads top-down and never reorders by itself.
_KEY_ORDER = (
    "description", "type", "nullable", "enum", "default", "minimum", "exclusiveMinimum",
    "maximum", "exclusiveMaximum", "minLength", "maxLength", "pattern", "minItems", "maxItems",
    "items", "required", "properties", "additionalProperties", PRESERVE_UNKNOWN,
    VALIDATIONS_KEY,
)
# JSON-schema keywords pydantic may emit that carry no meaning for the API server.
_DROPPED = ("title", "$defs")
_NULL = {"type": "null"}
_JSON_SCALARS = ("boolean", "integer", "number", "string")


class UnsupportedSchema(ValueError):
    """A type in `kiln.api` has no structural-schema form (e.g. a union of two types)."""


@dataclasses.dataclass(frozen=True)
class Resource:
    """What one CRD is generated from: its root type in `kiln.api`, names, columns, rules.

    Attributes:
        model: the pydantic type of a whole object (apiVersion, kind, metadata, spec, status).
        kind, plural, singular, short_names: its names.
        columns: `kubectl get` columns.
        validations: CEL rules, each at the schema node its path names.
        name_max_length: metadata.name's bound (a sweep's leaves room for its trials' names).
        scope: Namespaced or Cluster.
    """

    model: type[BaseModel]
    kind: str
    plural: str
    singular: str
    short_names: tuple[str, ...]
    columns: tuple[Column, ...]
    validations: tuple[Validation, ...]
    name_max_length: int = api.NAME_MAX_LENGTH
    scope: str = "Namespaced"

    @property
    def file(self) -> str:
        """Its CRD file, from the repository root (the Helm chart keeps a copy of each)."""
        return f"crds/{self.singular}.yaml"


def build(resource: Resource | None = None) -> dict[str, Any]:
    """A CRD as a dict, ready to dump as YAML or send to the API server.

    Args:
        resource: `JOB` (the default) or `SWEEP`.

    Returns:
        An `apiextensions.k8s.io/v1` CustomResourceDefinition for its kiln.dev/v1alpha1 kind.

    Raises:
        UnsupportedSchema: a type in `kiln.api` cannot be written as a structural schema.
    """
    resource = resource or JOB
    schema = openapi_schema(resource)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{resource.plural}.{api.GROUP}"},
        "spec": {
            "group": api.GROUP,
            "names": {
                "kind": resource.kind,
                "listKind": f"{resource.kind}List",
                "plural": resource.plural,
                "singular": resource.singular,
                "shortNames": list(resource.short_names),
                "categories": list(api.CATEGORIES),
            },
            "scope": resource.scope,
            "versions": [
                {
                    "name": api.VERSION,
                    "served": True,
                    "storage": True,
                    **({"subresources": {"status": {}}}
                       if "status" in schema["properties"] else {}),
                    "additionalPrinterColumns": _printer_columns(schema, resource.columns),
                    "schema": {"openAPIV3Schema": schema},
                }
            ],
        },
    }


def openapi_schema(resource: Resource | None = None) -> dict[str, Any]:
    """The structural `openAPIV3Schema` of `resource` (default `JOB`), from its `kiln.api` type.

    Raises:
        UnsupportedSchema: a type in `kiln.api` cannot be written as a structural schema.
    """
    resource = resource or JOB
    raw = resource.model.model_json_schema(by_alias=True, mode="validation")
    schema = _structural(_inline_refs(raw, raw.get("$defs", {})), "")
    _add_factory_defaults(resource.model, schema)
    props = schema["properties"]
    # The server routes on apiVersion and kind and owns metadata: only metadata.name may be
    # restricted (no description on metadata itself, or the CRD is refused).
    for key in ("apiVersion", "kind"):
        props[key] = {"description": props[key]["description"], "type": "string"}
    name = props["metadata"]["properties"]["name"]
    if resource.name_max_length != name["maxLength"]:
        name["maxLength"] = resource.name_max_length
        name["description"] = re.sub(r"at most \d+ characters",
                                     f"at most {resource.name_max_length} characters",
                                     name["description"])
    props["metadata"] = {"type": "object", "properties": {"name": name}}
    schema["required"] = ["spec"]
    for path, rule, message, field_path in resource.validations:
        node = schema
        for part in path.split("."):
            node = node["properties"][part]
        entry = {"rule": rule, "message": message}
        if field_path:
            entry["fieldPath"] = field_path
        node.setdefault(VALIDATIONS_KEY, []).append(entry)
    return schema


def _set(path: str) -> str:
    """CEL: the field at `path` (under ``self``) is set (the API server's CEL sees a null field
    as absent, as `kiln.api` does)."""
    return f"has(self.{path})"


def _is(path: str, *values: str) -> str:
    """CEL: the field at `path` is set to one of `values` (enum strings)."""
    listed = ", ".join(f"'{v}'" for v in values)
    return f"({_set(path)} && self.{path} in [{listed}])"


# What the loader of spec.dataset reads: images (digits is the default loader), or text.
_IMAGES = (f"({_is('dataset.name', 'digits', 'imagefolder', 'torchvision')} || "
           f"(!{_set('dataset.name')} && !{_set('dataset.entrypoint')}))")
_TEXT = _is("dataset.name", "text")
_SHAPE = "self.model.inputShape"
_SEVERAL = ("ddp", "fsdp")

# (schema node, CEL rule, message, fieldPath): the rules of `api.validate` that CEL can say,
# checked by the API server on create and update (after defaulting), so `kubectl apply` fails
# at once. `api.validate` keeps every rule (the operator and `kiln validate` run it); what CEL
# cannot say well (registry names, template keys, URI schemes) stays there alone, as does
# anything reading the free-form maps (model and dataset args, template): the API server's CEL
# cannot see their content. Rules with ``oldSelf`` run on updates only: the spec a job was
# admitted with cannot change, except runPolicy (suspend, deadlines, TTL, priority) and the
# free-form maps, whose content CEL cannot see: the operator runs a job on its admitted spec
# (status.admittedSpec, `api.running_doc`) whatever they say later, bar the template's
# scheduling directives (so a queueing system may set node selectors).
_IMMUTABLE = ("model", "dataset", "training", "warmStart", "freezing", "resources", "zoo",
              "initializer")
_JOB_FIXED = "cannot change once the job exists; create a new TrainingJob instead"
_SWEEP_FIXED = "cannot change once the sweep exists; create a new TrainingSweep instead"
VALIDATIONS: tuple[Validation, ...] = (
    ("spec.model", f"{_set('architecture')} != {_set('entrypoint')}",
     ("spec.model: set exactly one of architecture (a registry name, `kiln models` lists them) "
     "or entrypoint (your model as package.module:callable)"), ""),
    ("spec.dataset", f"!({_set('name')} && {_set('entrypoint')})",
     ("spec.dataset: set name (a built-in loader) or entrypoint (your dataset as "
     "package.module:callable), not both"), ""),
    ("spec.dataset", f"!{_is('name', 'torchvision')} || {_set('torchvisionClass')}",
     "spec.dataset.torchvisionClass: required for torchvision, e.g. CIFAR10",
     ".torchvisionClass"),
    ("spec.dataset", f"!{_set('torchvisionClass')} || {_is('name', 'torchvision')}",
     "spec.dataset.torchvisionClass: only for name torchvision; remove it", ".torchvisionClass"),
    ("spec.dataset",
     (f"!({_set('path')} && ({_is('name', 'digits')} || "
     f"(!{_set('name')} && !{_set('entrypoint')})))"),
     "spec.dataset.path: digits is bundled with scikit-learn; remove path", ".path"),
    ("spec.dataset",
     (f"!{_is('name', 'imagefolder', 'torchvision', 'text')} || "
     f"({_set('path')} && self.path != '') || {_set('uri')}"),
     ("spec.dataset.path: required for datasets imagefolder, torchvision and text; set the "
     "data location (or spec.dataset.uri to download it first)"), ".path"),
    ("spec.dataset", f"!({_set('uri')} && {_set('path')})",
     "spec.dataset.uri: the local copy of uri becomes the data's path; set uri or path, not both",
     ".uri"),
    ("spec.dataset",
     (f"!{_set('entrypoint')} || !({_set('path')} || {_set('validationPath')} || "
     f"{_set('torchvisionClass')} || {_set('maxSamples')} || "
     f"(has(self.augmentation) && self.augmentation != 'none'))"),
     ("spec.dataset: path, validationPath, torchvisionClass, maxSamples and augmentation are "
     "only for the built-in loaders; a dataset entrypoint reads its own data (pass settings "
     "through spec.dataset.args)"), ""),
    ("spec.dataset",
     f"!{_set('validationPath')} || {_set('entrypoint')} || {_is('name', 'imagefolder', 'text')}",
     ("spec.dataset.validationPath: only imagefolder and text take a separate validation set; "
      "remove it and use validationFraction"), ".validationPath"),
    ("spec.training",
     ("!has(self.lrSchedule) || !has(self.lrSchedule.warmupEpochs) || !has(self.epochs) || "
     "self.lrSchedule.warmupEpochs < self.epochs"),
     "spec.training.lrSchedule.warmupEpochs: must be < epochs", ".lrSchedule.warmupEpochs"),
    ("spec.target",
     ("!has(self.metric) || self.metric != 'validation_accuracy' || "
     "(self.value > 0.0 && self.value <= 1.0)"),
     "spec.target.value: accuracy is a fraction in (0, 1], e.g. 0.95", ".value"),
    ("spec.target", "!has(self.metric) || self.metric != 'validation_loss' || self.value > 0.0",
     "spec.target.value: a loss target must be > 0", ".value"),
    ("spec.resources", f"!({_is('parallelism', 'single')} && {_set('gpus')} && self.gpus > 1)",
     ("spec.resources.parallelism: single trains one process on one device; use ddp, fsdp or "
     "auto, or gpus 1"), ".parallelism"),
    ("spec.resources",
     (f"!{_is('parallelism', *_SEVERAL)} || ({_set('gpus')} ? self.gpus >= 2 : "
     f"(!{_set('gpusPerNode')} || self.gpusPerNode >= 2))"),
     ("spec.resources.parallelism: ddp and fsdp need 2 or more GPUs; use single or auto, or "
     "allow 2+ GPUs (gpus 0 is one CPU process)"), ".parallelism"),
    ("spec",
     (f"!{_set('resources.gpus')} || self.resources.gpus <= 1 || !has(self.training) || "
     "!has(self.training.batchSize) || self.training.batchSize % self.resources.gpus == 0"),
     ("spec.training.batchSize: the global batch is divided among the GPUs; use a multiple of "
     "spec.resources.gpus"), ".training.batchSize"),
    ("spec",
     (f"!({_is('resources.parallelism', *_SEVERAL)} && !{_set('resources.gpus')} && "
     "has(self.training) && has(self.training.batchSize) && self.training.batchSize % 2 == 1)"),
     ("spec.training.batchSize: ddp and fsdp split the global batch evenly over 2, 4 or 8 GPUs; "
     "use an even batch size"), ".training.batchSize"),
    ("spec",
     f"!{_IMAGES} || (size({_SHAPE}) == 3 && {_SHAPE}[0] in [1, 3])",
     "spec.model.inputShape: the dataset gives images, so use [C, H, W] with C 1 or 3",
     ".model.inputShape"),
    ("spec",
     f"!({_IMAGES} && size({_SHAPE}) == 3) || ({_SHAPE}[1] >= 8 && {_SHAPE}[2] >= 8)",
     "spec.model.inputShape: images need H, W >= 8", ".model.inputShape"),
    ("spec", f"!{_TEXT} || size({_SHAPE}) == 1",
     "spec.model.inputShape: text takes [sequenceLength], e.g. [64]", ".model.inputShape"),
    ("spec",
     f"!{_TEXT} || !has(self.dataset.augmentation) || self.dataset.augmentation == 'none'",
     "spec.dataset.augmentation: text has no augmentation; use none", ".dataset.augmentation"),
    *((f"spec.{field}", "self == oldSelf",
       f"spec.{field} {_JOB_FIXED}", "") for field in _IMMUTABLE),
    ("spec",
     ("has(self.target) == has(oldSelf.target) && "
      "(!has(self.target) || self.target == oldSelf.target)"),
     f"spec.target {_JOB_FIXED}",
     ".target"),
    ("spec",
     ("has(self.runtimeRef) == has(oldSelf.runtimeRef) && "
      "(!has(self.runtimeRef) || self.runtimeRef == oldSelf.runtimeRef)"),
     f"spec.runtimeRef {_JOB_FIXED}",
     ".runtimeRef"),
)




def _in_template(rules: tuple[Validation, ...]) -> tuple[Validation, ...]:
    """A TrainingJob's rules on its spec, moved to a sweep's spec.template (every trial's spec
    starts from it). What a running job's spec cannot change, the template cannot either (its
    trials so far were made from it), and the message says so of the sweep."""
    return tuple((path.replace("spec", "spec.template", 1), rule,
                  re.sub(r"\bspec\.", "spec.template.", message).replace(_JOB_FIXED, _SWEEP_FIXED),
                  field_path)
                 for path, rule, message, field_path in rules)


def _each_parameter(condition: str) -> str:
    """CEL over spec.parameters: `condition` (on ``p``) holds for every parameter."""
    return f"self.all(p, {condition})"


# The cross-field rules of `api.sweep.problems` that CEL can say. Not here: paths (CEL cannot
# read the TrainingJob schema), a value's effect on the trial's spec, grid size, and anything of
# `categorical` (a list of any scalars has no declared type, so the API server hides it from
# CEL: a parameter with none of categorical, int or float passes the CRD). What the trials so far were drawn and judged by
# cannot change once the sweep exists; the budget (maxTrials, parallelTrials, maxFailedTrials)
# may. The parameters are left out of that: CEL cannot see their categorical values.
_SEARCH = ("objective", "algorithm", "earlyStopping", "warmStart")
SWEEP_VALIDATIONS: tuple[Validation, ...] = (
    ("spec.parameters", _each_parameter("!(has(p.int) && has(p.float))"),
     "spec.parameters: each parameter sets exactly one of categorical, int or float", ""),
    ("spec.parameters", "self.all(p, self.exists_one(q, q.path == p.path))",
     "spec.parameters: each path may be set by one parameter only", ""),
    ("spec.parameters", _each_parameter("!has(p.int) || p.int.max >= p.int.min"),
     "spec.parameters: an int range is empty: max is below min", ""),
    ("spec.parameters", _each_parameter("!has(p.float) || p.float.max > p.float.min"),
     "spec.parameters: a float range is empty: max is not above min", ""),
    ("spec.parameters",
     _each_parameter("!has(p.float) || !has(p.float.log) || !p.float.log || p.float.min > 0.0"),
     "spec.parameters: a float range on a log scale needs min above 0", ""),
    ("spec.parameters",
     _each_parameter("!has(p.int) || !has(p.int.log) || !p.int.log || p.int.min >= 1"),
     "spec.parameters: an int range on a log scale needs min at least 1", ""),
    ("spec.parameters",
     _each_parameter("!has(p.int) || !has(p.int.log) || !p.int.log || !has(p.int.step) || "
                     "p.int.step == 1"),
     "spec.parameters: an int range takes step or log, not both", ""),
    ("spec", ("!has(self.algorithm) || !has(self.algorithm.name) || self.algorithm.name != "
     "'grid' || self.parameters.all(p, !has(p.float))"),
     ("spec.algorithm.name: grid needs a finite set per parameter; a float range has none "
     "(give categorical values, or use random or tpe)"), ".algorithm.name"),
    ("spec", ("!has(self.earlyStopping) || !has(self.earlyStopping.name) || "
     "self.earlyStopping.name == 'none' || !has(self.earlyStopping.minEpochs) || "
     "!has(self.template.training) || !has(self.template.training.epochs) || "
     "self.earlyStopping.minEpochs < self.template.training.epochs"),
     ("spec.earlyStopping.minEpochs: must be below spec.template.training.epochs, or nothing "
     "is left to stop"), ".earlyStopping.minEpochs"),
    ("spec.objective", ("!has(self.goal) || !has(self.metric) || "
     "(self.goal == 'maximize') == (self.metric == 'validation_accuracy')"),
     "spec.objective.goal: maximize an accuracy, minimize a loss", ".goal"),
    ("spec.objective", ("!has(self.target) || !has(self.metric) || "
     "self.metric != 'validation_accuracy' || (self.target > 0.0 && self.target <= 1.0)"),
     "spec.objective.target: an accuracy is a fraction in (0, 1], e.g. 0.92", ".target"),
    ("spec.objective", ("!has(self.target) || !has(self.metric) || "
     "self.metric != 'validation_loss' || self.target > 0.0"),
     "spec.objective.target: a loss target must be > 0", ".target"),
    *_in_template(VALIDATIONS),
    *((f"spec.{field}", "self == oldSelf",
       f"spec.{field} {_SWEEP_FIXED}", "") for field in _SEARCH),
)

JOB = Resource(api.TrainingJob, api.KIND, api.PLURAL, api.SINGULAR, api.SHORT_NAMES, PRINTER_COLUMNS,
               VALIDATIONS)
SWEEP = Resource(api.sweep.TrainingSweep, api.sweep.SWEEP_KIND, api.sweep.SWEEP_PLURAL, api.sweep.SWEEP_SINGULAR,
                 api.sweep.SWEEP_SHORT_NAMES, SWEEP_PRINTER_COLUMNS, SWEEP_VALIDATIONS,
                 name_max_length=api.sweep.SWEEP_NAME_MAX_LENGTH)
_RUNTIME_COLUMNS: tuple[Column, ...] = (("Age", ".metadata.creationTimestamp", "", 0),)
RUNTIME = Resource(api.runtime.TrainingRuntime, api.runtime.RUNTIME_KIND,
                   api.runtime.RUNTIME_PLURAL, api.runtime.RUNTIME_SINGULAR,
                   api.runtime.RUNTIME_SHORT_NAMES, _RUNTIME_COLUMNS, ())
CLUSTER_RUNTIME = Resource(api.runtime.ClusterTrainingRuntime, api.runtime.CLUSTER_RUNTIME_KIND,
                           api.runtime.CLUSTER_RUNTIME_PLURAL,
                           api.runtime.CLUSTER_RUNTIME_SINGULAR,
                           api.runtime.CLUSTER_RUNTIME_SHORT_NAMES, _RUNTIME_COLUMNS, (),
                           scope="Cluster")
RESOURCES = (JOB, SWEEP, RUNTIME, CLUSTER_RUNTIME)


def render(resource: Resource | None = None) -> str:
    """A CRD (default `JOB`) as YAML text with the generated-file header; same input, same
    bytes."""
    body: str = yaml.safe_dump(build(resource), sort_keys=False, width=100, allow_unicode=True)
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
    elif node.get("type") == "array" and _scalars(node["items"]):
        # A list of any scalars (categorical values): no one type, so the items keep what they
        # hold. The API server hides such a list from CEL; `kiln.api` refuses maps and lists.
        del node["items"]
        out["items"] = {PRESERVE_UNKNOWN: True}
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


def _scalars(node: dict[str, Any]) -> bool:
    """Whether a JSON-schema node is a union of two or more scalar types (and nothing else)."""
    options = node.get("anyOf", [])
    return len(options) > 1 and all(set(o) == {"type"} and o["type"] in _JSON_SCALARS
                                    for o in options)


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


def _printer_columns(schema: dict[str, Any], wanted: tuple[Column, ...]
                     ) -> list[dict[str, Any]]:
    """`kubectl get` columns; each column's type comes from the schema node at its path."""
    columns = []
    for name, path, description, priority in wanted:
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

"""`kiln.crd`: the committed CRDs are regenerated from `kiln.api`, are structural, and agree with
it (the TrainingSweep's own agreement corpus is in test_crd_sweep.py).

The agreement corpus (tests/data/jobs/{valid,invalid,crossfield}/) runs every document through
(a) the CRD's schema as an API server with fieldValidation=Strict applies it, emulated below with
jsonschema, and (b) `api.check_schema`: both must accept, or both reject, each document.
Cross-field documents must pass the CRD's schema and fail `api.validate` (the CRD's CEL rules
are run in test_crd_cel.py).
"""

from __future__ import annotations

import copy
import inspect
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from jobcorpus import corpus
from pydantic import BaseModel

from kiln import api, cli, crd
from kiln.api import jobfile, validation

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / crd.JOB.file
CHART_COPY = REPO / "helm" / "kiln" / crd.JOB.file
PRESERVE = crd.PRESERVE_UNKNOWN
KINDS = [pytest.param(r, id=r.kind) for r in crd.RESOURCES]
REGENERATE = "run `kiln crd --write` in the repository root to regenerate it and the Helm chart's copy"


# ----------------------------------------------------------------------------------------------
# the API server, emulated: kubectl's YAML -> JSON, strict fields, null pruning, defaulting,
# OpenAPI v3 validation, apiVersion/kind routing, ObjectMeta


def _kubectl_json(value: Any, where: str, problems: list[str]) -> Any:
    """What kubectl sends: Go's JSON encoder writes 5.0 as 5 and refuses NaN and infinities."""
    if isinstance(value, dict):
        return {str(k): _kubectl_json(v, f"{where}.{k}", problems) for k, v in value.items()}
    if isinstance(value, list):
        return [_kubectl_json(v, f"{where}[{i}]", problems) for i, v in enumerate(value)]
    if isinstance(value, float) and not math.isfinite(value):
        problems.append(f"{where.lstrip('.')}: json: unsupported value: {value}")
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return value if value is None or isinstance(value, str | int | float) else str(value)


def _prune_and_default(value: Any, node: dict[str, Any]) -> None:
    """Structural defaulting, in place: a non-nullable null takes the default or is pruned,
    an absent field with a default gets it; then the same inside (defaults included)."""
    if node.get(PRESERVE):
        return
    if isinstance(value, dict) and "properties" in node:
        for key, prop in node["properties"].items():
            if key in value and value[key] is None and not prop.get("nullable"):
                if "default" in prop:
                    value[key] = copy.deepcopy(prop["default"])
                else:
                    del value[key]
            elif key not in value and "default" in prop:
                value[key] = copy.deepcopy(prop["default"])
        for key, sub in value.items():
            if key in node["properties"]:
                _prune_and_default(sub, node["properties"][key])
    if isinstance(value, list) and "items" in node:
        for item in value:
            _prune_and_default(item, node["items"])


def _json_schema(node: dict[str, Any]) -> dict[str, Any]:
    """An OpenAPI v3 (CRD) node as JSON Schema 2020-12, as a strict API server reads it."""
    skip = ("nullable", "default", "description", PRESERVE, "properties", "items",
            "additionalProperties", "exclusiveMinimum", "exclusiveMaximum")
    out = {k: v for k, v in node.items() if k not in skip}
    if node.get("nullable"):
        out["type"] = [node["type"], "null"]  # the enum must still list null itself
    for bound, limit in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if node.get(bound) is True:
            out[bound] = out.pop(limit)
    if "properties" in node:
        out["properties"] = {k: _json_schema(v) for k, v in node["properties"].items()}
        if not node.get(PRESERVE):
            out["additionalProperties"] = False  # fieldValidation=Strict: unknown is an error
    if "items" in node:
        out["items"] = _json_schema(node["items"])
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = _json_schema(node["additionalProperties"])
    return out


def _object_meta(name: dict[str, Any]) -> dict[str, Any]:
    """The API server's own ObjectMeta schema, with the CRD's restrictions on name."""
    text, whole = {"type": ["string", "null"]}, {"type": ["integer", "null"]}
    strings = {"type": ["object", "null"], "additionalProperties": {"type": "string"}}
    objects = {"type": ["array", "null"], "items": {"type": "object"}}
    fields = {
        "name": name, "generateName": text, "namespace": text, "selfLink": text, "uid": text,
        "resourceVersion": text, "generation": whole, "creationTimestamp": text,
        "deletionTimestamp": text, "deletionGracePeriodSeconds": whole, "labels": strings,
        "annotations": strings, "ownerReferences": objects, "managedFields": objects,
        "finalizers": {"type": ["array", "null"], "items": {"type": "string"}},
    }
    return {"type": "object", "properties": fields, "required": ["name"],
            "additionalProperties": False}


class StrictApiServer:
    """kube-apiserver admitting a TrainingJob with fieldValidation=Strict, given the CRD."""

    def __init__(self, definition: dict[str, Any]) -> None:
        spec = definition["spec"]
        version = spec["versions"][0]
        self.api_version = f"{spec['group']}/{version['name']}"
        self.kind = spec["names"]["kind"]
        self.openapi = version["schema"]["openAPIV3Schema"]
        schema = _json_schema(self.openapi)
        schema["properties"]["metadata"] = _object_meta(schema["properties"]["metadata"]
                                                        ["properties"]["name"])
        jsonschema.Draft202012Validator.check_schema(schema)
        self.validator = jsonschema.Draft202012Validator(schema)

    def admit(self, doc: Any) -> tuple[Any, list[str]]:
        """The object as stored (defaults applied) and the problems; [] means accepted."""
        problems: list[str] = []
        obj = _kubectl_json(doc, "", problems)
        if problems:
            return None, problems
        if not isinstance(obj, dict):
            return None, [f"<document>: must be an object, got {type(obj).__name__}"]
        if obj.get("apiVersion") != self.api_version or obj.get("kind") != self.kind:
            problems.append(f"no matches for kind {obj.get('kind')!r} in {obj.get('apiVersion')!r}")
        _prune_and_default(obj, self.openapi)
        for error in sorted(self.validator.iter_errors(obj), key=lambda e: list(map(str, e.path))):
            where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.path)
            problems.append(f"{where.lstrip('.') or '<document>'}: {error.message}")
        return obj, problems


@pytest.fixture(scope="module")
def server() -> StrictApiServer:
    return StrictApiServer(yaml.safe_load(COMMITTED.read_text(encoding="utf-8")))


# ----------------------------------------------------------------------------------------------
# the generated file


@pytest.mark.parametrize("resource", KINDS)
@pytest.mark.parametrize("where", [REPO, REPO / "helm" / "kiln"], ids=["crds", "helm-chart"])
def test_committed_crd_is_regenerated_from_api(resource: crd.Resource, where: Path) -> None:
    committed = where / resource.file
    assert committed.exists(), f"{committed} is missing; {REGENERATE}"
    assert crd.render(resource) == committed.read_text(encoding="utf-8"), (
        f"{committed} is stale; {REGENERATE}")


@pytest.mark.parametrize("resource", KINDS)
def test_render_starts_with_the_generated_header_and_is_stable(resource: crd.Resource) -> None:
    text = crd.render(resource)
    assert text.startswith("# Generated from operator/kiln/api/ by `kiln crd`; do not edit.\n")
    assert text == crd.render(resource)
    assert yaml.safe_load(text) == crd.build(resource)


def test_kiln_crd_writes_every_crd_as_one_stream_to_every_path(tmp_path: Path) -> None:
    paths = [tmp_path / "crds" / "all.yaml", tmp_path / "helm" / "crds" / "kiln.yaml"]
    assert cli.main(["crd", *(f"--out={p}" for p in paths)]) == cli.EXIT_OK
    texts = [p.read_text(encoding="utf-8") for p in paths]
    assert texts == ["---\n".join(crd.render(r) for r in crd.RESOURCES)] * 2
    assert list(yaml.safe_load_all(texts[0])) == [crd.build(r) for r in crd.RESOURCES]


def test_kiln_crd_kind_writes_that_kinds_crd_alone(tmp_path: Path) -> None:
    out = tmp_path / "tsw.yaml"
    assert cli.main(["crd", "--kind", "TrainingSweep", f"--out={out}"]) == cli.EXIT_OK
    assert out.read_text(encoding="utf-8") == crd.render(crd.SWEEP)


def test_kiln_crd_write_regenerates_the_helm_charts_copy_where_the_chart_is(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "helm" / "kiln" / "crds").mkdir(parents=True)
    assert cli.main(["crd", "--write"]) == cli.EXIT_OK
    for resource in crd.RESOURCES:
        for written in (resource.file, f"helm/kiln/{resource.file}"):
            assert (tmp_path / written).read_text(encoding="utf-8") == crd.render(resource)


@pytest.mark.parametrize("resource", KINDS)
def test_crd_is_a_valid_apiextensions_v1_object(resource: crd.Resource) -> None:
    """Kubernetes' own schema for CustomResourceDefinition (boolean exclusiveMinimum, etc.)."""
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="pip install -e '.[test]' installs kubernetes-validate")
    version = kubernetes_validate.latest_version()
    kubernetes_validate.validate(crd.build(resource), version, strict=True)


def test_crd_names_scope_and_version_come_from_api() -> None:
    spec = crd.build()["spec"]
    assert crd.build()["metadata"]["name"] == "trainingjobs.kiln.dev"
    assert (spec["group"], spec["scope"]) == (api.GROUP, "Namespaced")
    assert spec["names"] == {
        "kind": api.KIND, "listKind": "TrainingJobList", "plural": api.PLURAL,
        "singular": api.SINGULAR, "shortNames": list(api.SHORT_NAMES),
        "categories": list(api.CATEGORIES),
    }
    (version,) = spec["versions"]
    assert (version["name"], version["served"], version["storage"]) == (api.VERSION, True, True)
    assert version["subresources"] == {"status": {}}


def test_printer_columns_point_at_declared_fields_of_the_right_type() -> None:
    version = crd.build()["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]
    columns = {c["name"]: c for c in version["additionalPrinterColumns"]}
    assert list(columns) == ["Phase", "Epoch", "ETA", "Parent", "GPUs", "Node", "Accuracy",
                             "Progress-Read", "Age"]
    age = {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}
    assert columns["Age"] == age
    expected = {
        "Phase": ("status.phase", "string"),
        "Epoch": ("status.progress.epoch", "integer"),
        "ETA": ("status.progress.etaSeconds", "number"),
        "Parent": ("status.warmStart.parent", "string"),
        "GPUs": ("status.placement.gpus", "integer"),
        "Node": ("status.placement.node", "string"),
        "Accuracy": ("status.result.validationAccuracy", "number"),
        "Progress-Read": ("status.progress.lastUpdatedTime", "string"),
    }
    for name, (path, kind) in expected.items():
        node = schema
        for part in path.split("."):
            node = node["properties"][part]
        shown = "date" if name == "Progress-Read" else kind  # kubectl shows a time as its age
        assert (columns[name]["jsonPath"], columns[name]["type"], node["type"]) == (
            f".{path}", shown, kind)
    # -o wide only: where the job runs and when its progress was last read.
    wide = {name for name, column in columns.items() if column.get("priority") == 1}
    assert wide == {"Node", "Progress-Read"}
    assert all(column.get("priority", 0) in (0, 1) for column in columns.values())


# ----------------------------------------------------------------------------------------------
# the schema is structural and complete


def _nodes(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for key, sub in node.get("properties", {}).items():
        yield from _nodes(sub, f"{path}.{key}" if path else key)
    if "items" in node:
        yield from _nodes(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _nodes(node["additionalProperties"], f"{path}.*")


@pytest.mark.parametrize("resource", KINDS)
def test_schema_is_structural(resource: crd.Resource) -> None:
    for path, node in _nodes(crd.openapi_schema(resource)):
        where = path or "<root>"
        assert not {"$ref", "$defs", "anyOf", "oneOf", "allOf", "not", "const", "title"} & set(
            node), f"{where}: {sorted(node)}"
        if node.get(PRESERVE) and path.endswith("[]") and set(node) == {PRESERVE}:
            continue  # list items of any scalar (a sweep's categorical values): no one type
        assert node.get("type") in ("object", "array", "string", "integer", "number", "boolean"), (
            f"{where}: no type")
        if node["type"] == "object":
            assert "properties" in node or node.get(PRESERVE) or "additionalProperties" in node, (
                f"{where}: an object must list its properties")
            assert not ("properties" in node and "additionalProperties" in node), where
        for bound in ("exclusiveMinimum", "exclusiveMaximum"):
            assert isinstance(node.get(bound, True), bool), f"{where}: {bound} must be boolean"
        if node.get("nullable") and "enum" in node:
            assert None in node["enum"], f"{where}: a nullable enum must list null"


def test_only_the_free_form_maps_and_the_admitted_spec_keep_unknown_fields() -> None:
    kept = [path for path, node in _nodes(crd.openapi_schema()) if node.get(PRESERVE)]
    # status.runtime and status.admittedSpec are what the operator validated before writing
    assert kept == ["spec.model.args", "spec.dataset.args", "spec.template",
                    "status.runtime", "status.admittedSpec"]


def test_metadata_restricts_only_the_name() -> None:
    metadata = crd.openapi_schema()["properties"]["metadata"]
    assert set(metadata) == {"type", "properties"} and list(metadata["properties"]) == ["name"]
    name = metadata["properties"]["name"]
    assert (name["maxLength"], name["pattern"]) == (api.NAME_MAX_LENGTH, api.NAME_PATTERN)


@pytest.mark.parametrize("resource", KINDS)
def test_every_property_description_starts_with_its_wire_name(resource: crd.Resource) -> None:
    for path, node in _nodes(crd.openapi_schema(resource)):
        wire = path.rsplit(".", 1)[-1]
        if not path or path == "metadata" or wire.endswith("[]") or wire == "*":
            continue  # the root, server-owned metadata (no description allowed) and list items
        assert re.match(rf"{re.escape(wire)}[:.]", node.get("description", "")), (
            f"{path}: description {node.get('description')!r} must start with '{wire}:'")


def _declared(model: type[BaseModel], node: dict[str, Any], path: str) -> Iterator[str]:
    """Wire paths of `model`'s fields missing from the schema `node`, recursively."""
    for name, field in model.model_fields.items():
        wire = field.alias or name
        prop = node.get("properties", {}).get(wire)
        if prop is None:
            yield f"{path}.{wire}"
            continue
        for sub in crd._model_types(field.annotation):
            yield from _declared(sub, prop["items"] if prop["type"] == "array" else prop,
                                 f"{path}.{wire}")


@pytest.mark.parametrize(("resource", "model", "path"), [
    pytest.param(crd.JOB, api.TrainingJobSpec, "spec", id="spec"),
    pytest.param(crd.JOB, api.TrainingJobStatus, "status", id="status"),
    pytest.param(crd.SWEEP, api.sweep.TrainingSweepSpec, "spec", id="sweep-spec"),
    pytest.param(crd.SWEEP, api.sweep.TrainingSweepStatus, "status", id="sweep-status"),
])
def test_every_api_field_is_declared_so_nothing_is_pruned(
    resource: crd.Resource, model: type[BaseModel], path: str
) -> None:
    schema = crd.openapi_schema(resource)["properties"][path]
    assert list(_declared(model, schema, path)) == []


def test_spec_requires_model_and_a_target_requires_its_value() -> None:
    schema = crd.openapi_schema()
    spec = schema["properties"]["spec"]
    assert schema["required"] == ["spec"] and spec["required"] == ["model"]
    assert spec["properties"]["model"]["required"] == ["inputShape"]  # + architecture XOR entrypoint
    assert spec["properties"]["target"]["required"] == ["value"]


@pytest.mark.parametrize("resource", KINDS)
def test_every_default_is_valid_against_its_own_schema(resource: crd.Resource) -> None:
    for path, node in _nodes(crd.openapi_schema(resource)):
        if "default" in node:
            errors = list(jsonschema.Draft202012Validator(_json_schema(node)).iter_errors(
                node["default"]))
            assert errors == [], path


# ----------------------------------------------------------------------------------------------
# agreement with kiln.api


@pytest.mark.parametrize(("doc", "field", "message"), corpus("valid") + corpus("invalid"))
def test_crd_and_api_agree_on_every_document(
    server: StrictApiServer, doc: Any, field: str, message: str
) -> None:
    _, crd_problems = server.admit(doc)
    api_problems = api.check_schema(doc)
    assert bool(crd_problems) == bool(api_problems), (
        f"disagreement: CRD says {crd_problems or 'valid'}, api says {api_problems or 'valid'}")
    assert bool(api_problems) == bool(field), "valid/ documents pass, invalid/ ones fail"


@pytest.mark.parametrize(("doc", "field", "message"), corpus("valid"))
def test_crd_defaults_equal_api_defaults(
    server: StrictApiServer, doc: Any, field: str, message: str
) -> None:
    stored, problems = server.admit(doc)
    assert problems == []
    wire = api.to_wire(api.parse_job(doc))
    for part in ("spec", "status"):
        assert _without_nulls(stored.get(part)) == _without_nulls(wire.get(part)), part


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    return value


@pytest.mark.parametrize(("doc", "field", "message"), corpus("crossfield"))
def test_crd_accepts_cross_field_problems_that_api_validate_rejects(
    server: StrictApiServer, doc: Any, field: str, message: str
) -> None:
    assert server.admit(doc)[1] == [] and api.check_schema(doc) == []
    with pytest.raises(api.InvalidSpec) as caught:
        api.parse_job(doc)
    (problem,) = caught.value.problems
    assert problem.startswith(f"{field}: ") and message in problem


def test_every_cross_field_rule_of_api_validate_has_one_corpus_case() -> None:
    # api.validate and the helpers it calls sit between validate() and to_wire().
    source = inspect.getsource(validation)
    rules = source[source.index("def validate("):source.index("def to_wire(")].count(
        "problems.append(")
    messages = set()
    for param in corpus("crossfield"):
        doc = param.values[0]
        for problem in api.validate(api.TrainingJob.model_validate(doc)):
            messages.add(re.sub(r"\d+|\(got .*\)|\[.*\]", "#", problem))
    assert len(messages) == rules == len(corpus("crossfield")), sorted(messages)


EXAMPLES = sorted((REPO / "examples").glob("**/*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES or [pytest.param(None, marks=pytest.mark.skip(
    reason="examples/ holds no job yet"))], ids=[p.stem for p in EXAMPLES] or ["none"])
def test_every_example_passes_the_crd_and_api(path: Path) -> None:
    servers = {r.kind: StrictApiServer(crd.build(r)) for r in crd.RESOURCES}
    for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
        assert servers[doc["kind"]].admit(doc)[1] == [], path.name
    assert jobfile.load_documents(path)


def test_strict_server_emulation_rejects_what_a_server_rejects(server: StrictApiServer) -> None:
    """The oracle itself: unknown fields, wrong routing, bad names, NaN never pass."""
    ok = {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": "a"},
          "spec": {"model": {"architecture": "x", "inputShape": [1, 8, 8]}}}
    assert server.admit(ok)[1] == []
    for bad in ({"extra": 1}, {"kind": "Pod"}, {"metadata": {"name": "A"}},
                {"spec": {"model": {"architecture": "x", "inputShape": [math.nan]}}}):
        assert server.admit({**ok, **bad})[1], bad
    assert json.dumps(server.admit(ok)[0]["spec"]["training"]["optimizer"]) == (
        '{"name": "sgd", "lr": 0.1, "momentum": 0.9, "weightDecay": 0.0005, "nesterov": false}')

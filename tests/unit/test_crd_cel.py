"""The CRD's CEL rules (`x-kubernetes-validations`), evaluated with cel-python.

The API emulator has no admission, so the rules are run here as the API server runs them: on
the stored object (defaults applied), each at its schema node with ``self`` typed by the schema
(``number`` fields as doubles, null fields absent, the content of free-form maps unseen),
transition rules (``oldSelf``) on updates only, an evaluation error counting as a rejection.
They must agree with `api.validate`: never reject a job it accepts, and catch the cross-field
problems they were written for. Not checked here: the API server's own type checking and cost
estimate of each rule when the CRD is applied.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml
from jobcorpus import corpus
from unit.test_crd import COMMITTED, StrictApiServer

from kiln import api, crd

REPO = Path(__file__).resolve().parents[2]
ENV = celpy.Environment()


def _exposed(node: dict[str, Any]) -> bool:
    """Whether the API server shows a field of this schema to CEL: not when it has no type
    (a list of any scalars), nor a list of such items."""
    if node.get("type") == "array":
        return _exposed(node.get("items", {}))
    return "type" in node


def _typed(value: Any, node: dict[str, Any]) -> Any:
    """`value` as the API server hands it to CEL: numbers of a ``number`` field are doubles,
    null fields are absent, a free-form map's unknown fields are not visible, nor are fields of
    no declared type."""
    if node.get(crd.PRESERVE_UNKNOWN) and "properties" not in node:
        return {}
    if node.get("type") == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, dict) and "properties" in node:
        return {k: _typed(v, node["properties"][k]) for k, v in value.items()
                if v is not None and k in node["properties"] and _exposed(node["properties"][k])}
    if isinstance(value, dict) and isinstance(node.get("additionalProperties"), dict):
        return {k: _typed(v, node["additionalProperties"]) for k, v in value.items()}
    if isinstance(value, list) and "items" in node:
        return [_typed(v, node["items"]) for v in value]
    return value


def _nodes(node: dict[str, Any], value: Any, old: Any, path: str
           ) -> Iterator[tuple[str, dict[str, Any], Any, Any]]:
    """(path, schema node, value, old value) for every node present in `value`, list items
    included (an item has no old value: the API server pairs items only in keyed lists)."""
    yield path, node, value, old
    if isinstance(value, dict) and "properties" in node:
        for key, sub in node["properties"].items():
            if value.get(key) is not None:
                before = old.get(key) if isinstance(old, dict) else None
                yield from _nodes(sub, value[key], before, f"{path}.{key}".lstrip("."))
    if isinstance(value, list) and "items" in node:
        for i, item in enumerate(value):
            yield from _nodes(node["items"], item, None, f"{path}[{i}]")


@functools.cache
def _schema() -> dict[str, Any]:
    return crd.openapi_schema()


@functools.cache
def _program(rule: str) -> Any:
    return ENV.program(ENV.compile(rule))


def rejections(obj: dict[str, Any], old: dict[str, Any] | None = None,
               schema: dict[str, Any] | None = None) -> list[str]:
    """The messages of the rules `obj` fails (an update from `old` when given), under the CRD
    schema `schema` (default: the TrainingJob's)."""
    schema = schema or _schema()
    failed = []
    for _, node, value, before in _nodes(schema, obj, old, ""):
        for rule in node.get(crd.VALIDATIONS_KEY, []):
            transition = "oldSelf" in rule["rule"]
            if transition and before is None:
                continue  # a create, or the field is new: the API server skips the rule
            activation = {"self": celpy.json_to_cel(_typed(value, node))}
            if transition:
                activation["oldSelf"] = celpy.json_to_cel(_typed(before, node))
            try:
                ok = _program(rule["rule"]).evaluate(activation)
            except celpy.CELEvalError as exc:  # the API server rejects on an evaluation error
                ok = exc
            if ok is not True and ok != celpy.celtypes.BoolType(True):
                failed.append(rule["message"])
    return failed


@pytest.fixture(scope="module")
def server() -> StrictApiServer:
    return StrictApiServer(yaml.safe_load(COMMITTED.read_text(encoding="utf-8")))


def stored(server: StrictApiServer, doc: Any) -> dict[str, Any]:
    obj, problems = server.admit(copy.deepcopy(doc))
    assert problems == [], problems
    return dict(obj)


def test_every_rule_compiles_and_its_message_starts_with_the_field() -> None:
    for path, rule, message, field_path in crd.VALIDATIONS:
        ENV.compile(rule)
        assert message.startswith(path + field_path), (message, path, field_path)


VALID = corpus("valid")
EXAMPLES = sorted((REPO / "examples").glob("**/*.yaml"))


@pytest.mark.parametrize("doc", [p.values[0] for p in VALID], ids=[p.id for p in VALID])
def test_no_rule_rejects_a_job_api_validate_accepts(server: StrictApiServer, doc: Any) -> None:
    assert rejections(stored(server, doc)) == []


def test_no_rule_rejects_an_example(server: StrictApiServer) -> None:
    for path in EXAMPLES:
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if isinstance(doc, dict) and doc.get("kind") == api.KIND:
                assert rejections(stored(server, doc)) == [], path.name


# The cross-field cases CEL says too; the others (template keys, URI schemes, GPUs per node,
# dataset args: CEL cannot see into free-form maps) stay with `api.validate` alone.
CAUGHT = {
    "accuracy-target-above-one", "batch-not-divisible-by-gpus",
    "dataset-entrypoint-with-path", "dataset-name-and-entrypoint", "ddp-odd-batch",
    "digits-with-path", "fsdp-without-gpus", "image-shape-channels", "image-too-small",
    "loss-target-not-positive", "model-architecture-and-entrypoint", "path-required",
    "single-with-several-gpus", "text-augmentation", "text-shape",
    "torchvision-class-only-for-torchvision", "torchvision-class-required",
    "warmup-not-below-epochs", "dataset-validation-path-for-digits",
}


@pytest.mark.parametrize(("doc", "field", "message"), corpus("crossfield"))
def test_rules_catch_cross_field_problems_with_api_validates_field(
    server: StrictApiServer, request: pytest.FixtureRequest, doc: Any, field: str, message: str
) -> None:
    case = str(request.node.callspec.id)
    found = rejections(stored(server, doc))
    if case in CAUGHT:
        assert found, f"{case}: no CEL rule rejects it ({field}: {message})"
    for text in found:  # the field api.validate names, or the object holding it
        named = text.split(":")[0]
        assert field == named or field.startswith(named + "."), (case, text, field)


def _job(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": "a"},
            "spec": {"model": {"architecture": "resnet18", "inputShape": [3, 32, 32]},
                     "target": {"metric": "validation_accuracy", "value": 0.9}, **spec}}


@pytest.mark.parametrize(("change", "refused"), [
    ({"model": {"architecture": "resnet34", "inputShape": [3, 32, 32]}}, "spec.model"),
    ({"training": {"epochs": 3}}, "spec.training"),
    ({"resources": {"gpus": 2}}, "spec.resources"),
    ({"target": {"metric": "validation_accuracy", "value": 0.8}}, "spec.target"),
    ({"target": None}, "spec.target"),
    ({"runtimeRef": {"name": "other"}}, "spec.runtimeRef"),
])
def test_a_running_jobs_spec_cannot_change(server: StrictApiServer, change: dict[str, Any],
                                           refused: str) -> None:
    old = stored(server, _job())
    new = stored(server, _job(**change))
    found = rejections(new, old)
    assert len(found) == 1 and found[0].startswith(f"{refused} can"), found


def test_run_policy_and_the_template_may_change(server: StrictApiServer) -> None:
    running = stored(server, _job())
    suspended = stored(server, _job(runPolicy={"suspend": True}))
    assert rejections(suspended, running) == []
    assert rejections(stored(server, _job(runPolicy={"backoffLimit": 1})), running) == []
    moved = stored(server, _job(runPolicy={"suspend": True},
                                template={"nodeSelector": {"pool": "a"}}))
    assert rejections(moved, suspended) == []  # e.g. a queue's admission sets node selectors


def test_an_explicit_null_is_unset_to_the_rules(server: StrictApiServer) -> None:
    doc = _job(resources={"gpus": None, "parallelism": "single"})
    doc["spec"]["model"]["entrypoint"] = None
    assert rejections(stored(server, doc)) == []


def test_the_crd_refuses_edits_of_every_typed_section_the_operator_keeps_as_admitted() -> None:
    # The free-form maps (model and dataset args, the template) are beyond CEL: the operator
    # runs a job on status.admittedSpec whatever they say later (`api.running_doc`).
    guarded = {(path + field_path).split(".")[1] for path, rule, _, field_path in crd.VALIDATIONS
               if "oldSelf" in rule}
    sections = {f.alias or n for n, f in api.TrainingJobSpec.model_fields.items()}
    assert guarded == sections - {"runPolicy", "template"}
    running = api.running_doc({"spec": {"model": {"args": {"width": 64}}},
                               "status": {"admittedSpec": {"model": {"args": {"width": 8}}}}})
    assert running["spec"]["model"] == {"args": {"width": 8}}

"""The TrainingSweep CRD agrees with `api.sweep.parse_sweep` on a corpus of sweeps.

Each document goes through the API server as test_crd.py emulates it (strict fields, defaults,
OpenAPI v3) and then the CRD's CEL rules as test_crd_cel.py runs them. The CRD must never refuse
a sweep `parse_sweep` accepts; what it refuses, `parse_sweep` refuses too, naming the same field;
and the cases marked as the CRD's are refused at `kubectl apply`. The rest (paths, a value's
effect on a trial, anything of categorical values, which CEL cannot see) is `parse_sweep`'s and
the operator's alone.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from unit.test_crd import StrictApiServer
from unit.test_crd_cel import ENV, rejections

from kiln import api, crd
from kiln.api import validation

REPO = Path(__file__).resolve().parents[2]
SCHEMA = crd.openapi_schema(crd.SWEEP)

SWEEP: dict[str, Any] = {
    "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSweep", "metadata": {"name": "s"},
    "spec": {
        "template": {"model": {"architecture": "small_cnn", "args": {"num_classes": 10},
                               "inputShape": [1, 8, 8]},
                     "training": {"epochs": 4, "batchSize": 32}},
        "parameters": [
            {"path": "training.optimizer.lr", "float": {"min": 0.001, "max": 0.3, "log": True}},
            {"path": "model.args.depth", "int": {"min": 1, "max": 3}},
            {"path": "model.args.width", "categorical": [8, 16]},
        ],
    },
}


@pytest.fixture(scope="module")
def server() -> StrictApiServer:
    return StrictApiServer(yaml.safe_load((REPO / crd.SWEEP.file).read_text(encoding="utf-8")))


_GONE = object()


def _edit(*changes: tuple[str, Any]) -> dict[str, Any]:
    """SWEEP with each ``path`` (dotted; ``parameters[1]`` indexes a list) set to its value, or
    removed for `_GONE`."""
    doc = copy.deepcopy(SWEEP)
    for path, value in changes:
        keys: list[Any] = [int(k) if k.isdigit() else k for k in re.findall(r"[^.\[\]]+", path)]
        node: Any = doc
        for key in keys[:-1]:
            node = node[key] if isinstance(key, int) else node.setdefault(key, {})
        if value is _GONE:
            del node[keys[-1]]
        else:
            node[keys[-1]] = value
    return doc


def crd_refusals(server: StrictApiServer, doc: Any, old: Any = None) -> list[str]:
    """What the API server says to `doc` (an update from `old`): schema problems, else the
    messages of the CEL rules it fails."""
    stored, problems = server.admit(copy.deepcopy(doc))
    if problems:
        return problems
    before = server.admit(copy.deepcopy(old))[0] if old is not None else None
    return rejections(stored, before, schema=SCHEMA)


def _parse_problems(doc: Any) -> list[str]:
    try:
        api.sweep.parse_sweep(doc)
    except api.InvalidSpec as exc:
        assert exc.kind == "TrainingSweep"
        return list(exc.problems)
    return []


VALID = [
    pytest.param(SWEEP, id="base"),
    pytest.param(_edit(("spec.algorithm", {"name": "grid"}),
                       ("spec.parameters[0]", {"path": "training.optimizer.lr",
                                               "categorical": [0.01, 0.1]})), id="grid"),
    pytest.param(_edit(("spec.parameters[1].int", {"min": 1, "max": 8, "log": True}),
                       ("spec.parameters[2]", {"path": "training.optimizer.name",
                                               "categorical": ["sgd", "adam"]})), id="log-int"),
    pytest.param(_edit(("spec.parameters[2]", {"path": "training.optimizer.nesterov",
                                               "categorical": [True, False]}),
                       ("spec.parameters[1].int", {"min": 1, "max": 3, "step": 2})),
                 id="booleans-and-step"),
    pytest.param(_edit(("spec.objective", {"metric": "validation_loss", "goal": "minimize",
                                           "target": 0.2}),
                       ("spec.earlyStopping", {"name": "median", "minEpochs": 2})),
                 id="loss-median"),
    pytest.param(_edit(("spec.earlyStopping", {"name": "asha", "minEpochs": 3}),
                       ("spec.maxTrials", 200), ("spec.parallelTrials", 64),
                       ("spec.warmStart", "independent")), id="asha-budget"),
    pytest.param(_edit(("metadata.name", "a" * api.sweep.SWEEP_NAME_MAX_LENGTH)),
                 id="longest-name"),
]

# (document, the field parse_sweep names, whether the CRD refuses it too)
INVALID = [
    pytest.param(_edit(("spec.parameters[0].path", "training.learningRate")),
                 "spec.parameters[0].path", False, id="unknown-path"),
    pytest.param(_edit(("spec.parameters[0].path", "training")),
                 "spec.parameters[0].path", False, id="path-is-an-object"),
    pytest.param(_edit(("spec.parameters[0].path", "training..lr")),
                 "spec.parameters[0].path", True, id="path-pattern"),
    pytest.param(_edit(("spec.parameters[1].int", {"min": 4, "max": 1})),
                 "spec.parameters[1].int", True, id="empty-int-range"),
    pytest.param(_edit(("spec.parameters[0].float", {"min": 0.3, "max": 0.001})),
                 "spec.parameters[0].float", True, id="empty-float-range"),
    pytest.param(_edit(("spec.parameters[0].float", {"min": 0.0, "max": 0.3, "log": True})),
                 "spec.parameters[0].float.log", True, id="float-log-from-zero"),
    pytest.param(_edit(("spec.parameters[1].int", {"min": 0, "max": 3, "log": True})),
                 "spec.parameters[1].int.log", True, id="int-log-from-zero"),
    pytest.param(_edit(("spec.parameters[1].int", {"min": 1, "max": 8, "log": True, "step": 2})),
                 "spec.parameters[1].int", True, id="int-step-and-log"),
    pytest.param(_edit(("spec.parameters[1].float", {"min": 1.0, "max": 3.0})),
                 "spec.parameters[1]", True, id="int-and-float"),
    pytest.param(_edit(("spec.parameters[1].int", _GONE)),
                 "spec.parameters[1]", False, id="no-values"),
    pytest.param(_edit(("spec.parameters[2].int", {"min": 8, "max": 16})),
                 "spec.parameters[2]", False, id="categorical-and-int"),
    pytest.param(_edit(("spec.parameters[2].categorical", [{"width": 8}])),
                 "spec.parameters[2].categorical[0]", False, id="categorical-map"),
    pytest.param(_edit(("spec.parameters[2].categorical", [8, 8])),
                 "spec.parameters[2].categorical", False, id="categorical-twice"),
    pytest.param(_edit(("spec.parameters[2].path", "model.args.depth")),
                 "spec.parameters[2].path", True, id="path-twice"),
    pytest.param(_edit(("spec.parameters", [])), "spec.parameters", True, id="no-parameters"),
    pytest.param(_edit(("spec.objective", {"metric": "train_loss"})),
                 "spec.objective.metric", True, id="objective-never-reported"),
    pytest.param(_edit(("spec.objective", {"goal": "minimize"})),
                 "spec.objective.goal", True, id="minimize-accuracy"),
    pytest.param(_edit(("spec.objective", {"target": 1.5})),
                 "spec.objective.target", True, id="accuracy-target-above-one"),
    pytest.param(_edit(("spec.objective", {"metric": "validation_loss", "target": 0.0})),
                 "spec.objective.target", True, id="loss-target-zero"),
    pytest.param(_edit(("spec.parameters[0]", {"path": "training.epochs",
                                               "float": {"min": 1.0, "max": 4.0}})),
                 "spec.parameters[0].float", False, id="float-range-on-an-int-field"),
    pytest.param(_edit(("spec.algorithm", {"name": "grid"})),
                 "spec.algorithm.name", True, id="grid-over-a-float-range"),
    pytest.param(_edit(("spec.algorithm", {"name": "grid"}),
                       ("spec.parameters[0]", {"path": "training.seed",
                                               "int": {"min": 0, "max": 999}})),
                 "spec.maxTrials", False, id="grid-above-max-trials"),
    pytest.param(_edit(("spec.algorithm", {"name": "grid"}), ("spec.maxTrials", 10),
                       ("spec.parameters[0]", {"path": "training.seed",
                                               "int": {"min": 0, "max": 10**12}})),
                 "spec.parameters", False, id="grid-too-large-to-list"),
    pytest.param(_edit(("spec.earlyStopping", {"name": "asha", "minEpochs": 4})),
                 "spec.earlyStopping.minEpochs", True, id="min-epochs-not-below-epochs"),
    pytest.param(_edit(("spec.template.training.epoch", 3)),
                 "spec.template.training.epoch", True, id="template-unknown-field"),
    pytest.param(_edit(("spec.template.training.lrSchedule", {"warmupEpochs": 4})),
                 "spec.template.training.lrSchedule.warmupEpochs", True,
                 id="template-cross-field"),
    pytest.param(_edit(("spec.parameters[2]", {"path": "training.batchSize",
                                               "categorical": [32, 0]})),
                 "spec.parameters[2]", False, id="value-makes-an-invalid-trial"),
    pytest.param(_edit(("metadata.name", "a" * (api.sweep.SWEEP_NAME_MAX_LENGTH + 1))),
                 "metadata.name", True, id="name-leaves-no-room-for-trials"),
    pytest.param(_edit(("spec.maxTrials", api.sweep.MAX_TRIALS + 1)),
                 "spec.maxTrials", True, id="too-many-trials"),
    pytest.param(_edit(("spec.template", _GONE)), "spec.template", True, id="no-template"),
]


@pytest.mark.parametrize("doc", VALID)
def test_crd_and_parse_sweep_accept_the_same_sweeps(server: StrictApiServer, doc: Any) -> None:
    assert _parse_problems(doc) == []
    assert crd_refusals(server, doc) == []


@pytest.mark.parametrize(("doc", "field", "by_crd"), INVALID)
def test_crd_refuses_no_more_than_parse_sweep_and_names_the_same_field(
    server: StrictApiServer, doc: Any, field: str, by_crd: bool
) -> None:
    problems = _parse_problems(doc)
    assert any(p.startswith(field) for p in problems), problems
    refused = crd_refusals(server, doc)
    assert bool(refused) == by_crd, refused
    for text in refused:  # the field, the object holding it, or (schema) a field inside it
        named = text.split(":")[0]
        assert field.startswith(named) or named.startswith(field), (text, field)


@pytest.mark.parametrize("doc", VALID)
def test_crd_defaults_equal_parse_sweeps(server: StrictApiServer, doc: Any) -> None:
    stored, problems = server.admit(copy.deepcopy(doc))
    assert problems == []
    assert stored["spec"] == validation.to_wire(api.sweep.parse_sweep(doc).spec)


def test_the_search_cannot_change_but_the_budget_and_run_policy_may(
        server: StrictApiServer) -> None:
    for change, refused in [
        (("spec.objective", {"target": 0.5}), "spec.objective"),
        (("spec.algorithm", {"seed": 1}), "spec.algorithm"),
        (("spec.earlyStopping", {"name": "asha"}), "spec.earlyStopping"),
        (("spec.warmStart", "independent"), "spec.warmStart"),
        (("spec.template.training.epochs", 5), "spec.template.training"),
        (("spec.template.target", {"value": 0.9}), "spec.template.target"),
    ]:
        found = crd_refusals(server, _edit(change), old=SWEEP)
        assert found == [f"{refused} {crd._SWEEP_FIXED}"], (change, found)
    for change in [("spec.maxTrials", 40), ("spec.parallelTrials", 4),
                   ("spec.maxFailedTrials", 0), ("spec.template.runPolicy", {"suspend": True})]:
        assert crd_refusals(server, _edit(change), old=SWEEP) == [], change


def test_the_templates_rules_are_the_jobs_moved_under_spec_template() -> None:
    """Every TrainingJob rule checks the template, written for it: at spec.template.X, its
    message naming spec.template.X and, for what cannot change, the sweep."""
    moved = [rule for rule in crd.SWEEP_VALIDATIONS if rule[0].startswith("spec.template")]
    assert len(moved) == len(crd.VALIDATIONS)
    for (path, rule, message, field_path), job in zip(moved, crd.VALIDATIONS, strict=True):
        assert (path, rule, field_path) == (job[0].replace("spec", "spec.template", 1), job[1],
                                            job[3])
        assert message.startswith(path + field_path) and "TrainingJob" not in message
        assert "spec." not in message.replace("spec.template.", "")
    own = [rule for rule in crd.SWEEP_VALIDATIONS if not rule[0].startswith("spec.template")]
    assert not any(rule in crd.VALIDATIONS for rule in own)


def test_every_rule_compiles_reads_only_what_cel_sees_and_names_its_field() -> None:
    for path, rule, message, field_path in crd.SWEEP_VALIDATIONS:
        ENV.compile(rule)
        assert message.startswith(path + field_path), (message, path, field_path)
        # A list of any scalars has no declared type: the API server hides it from CEL, and a
        # rule reading it would not compile there.
        assert "categorical" not in rule, rule


def test_names_columns_and_subresources() -> None:
    definition = crd.build(crd.SWEEP)
    assert definition["metadata"]["name"] == "trainingsweeps.kiln.dev"
    assert definition["spec"]["names"] == {
        "kind": "TrainingSweep", "listKind": "TrainingSweepList", "plural": "trainingsweeps",
        "singular": "trainingsweep", "shortNames": ["tsw"], "categories": ["all", "kiln"]}
    (version,) = definition["spec"]["versions"]
    assert version["subresources"] == {"status": {}}
    columns = [(c["name"], c["jsonPath"], c["type"]) for c in version["additionalPrinterColumns"]]
    assert columns == [
        ("Phase", ".status.phase", "string"), ("Done", ".status.trials.succeeded", "integer"),
        ("Running", ".status.trials.running", "integer"),
        ("Pruned", ".status.trials.pruned", "integer"),
        ("Failed", ".status.trials.failed", "integer"), ("Best", ".status.best.metric", "number"),
        ("Best-Trial", ".status.best.trial", "string"),
        ("Age", ".metadata.creationTimestamp", "date")]
    name = SCHEMA["properties"]["metadata"]["properties"]["name"]
    assert name["maxLength"] == api.sweep.SWEEP_NAME_MAX_LENGTH
    assert f"at most {api.sweep.SWEEP_NAME_MAX_LENGTH} characters" in name["description"]


def _sweep_examples() -> list[Path]:
    def sweeps(path: Path) -> bool:
        return any(api.sweep.is_sweep(d) for d in yaml.safe_load_all(path.read_text()))
    return [p for p in sorted((REPO / "examples").glob("**/*.yaml")) if sweeps(p)]


@pytest.mark.parametrize("path", _sweep_examples() or [pytest.param(
    None, marks=pytest.mark.skip(reason="examples/ holds no sweep yet"))])
def test_every_example_sweep_passes_the_crd(server: StrictApiServer, path: Path) -> None:
    for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
        if api.sweep.is_sweep(doc):
            assert crd_refusals(server, doc) == [], path.name


"""`kiln.api.sweep` and `kiln validate` on sweep files: good sweeps parse with their defaults,
bad ones are refused naming the field and the fix, `apply` sets a trial's values, paths are
checked against the TrainingJob schema, and grid sizes are counted without listing."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from kiln import api, cli
from kiln.api import jobfile
from kiln.api import sweep as sw

SWEEP = """\
apiVersion: kiln.dev/v1alpha1
kind: TrainingSweep
metadata: {name: digits-search}
spec:
  template:
    model: {architecture: small_cnn, args: {num_classes: 10}, inputShape: [1, 8, 8]}
    training: {epochs: 4, batchSize: 32}
  parameters:
    - path: training.optimizer.lr
      float: {min: 0.001, max: 0.3, log: true}
    - path: model.args.depth
      int: {min: 1, max: 3}
    - path: model.args.width
      categorical: [8, 16]
  earlyStopping: {name: asha}
"""
JOB = """\
apiVersion: kiln.dev/v1alpha1
kind: TrainingJob
metadata: {name: digits-small}
spec:
  model: {architecture: small_cnn, args: {num_classes: 10}, inputShape: [1, 8, 8]}
  training: {epochs: 2, batchSize: 32}
"""


def _doc(text: str = SWEEP, **spec: Any) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(text)
    doc["spec"].update(spec)
    return doc


def _problems(doc: Any) -> list[str]:
    with pytest.raises(api.InvalidSpec) as caught:
        sw.parse_sweep(doc, source="s.yaml")
    assert caught.value.kind == "TrainingSweep" and "s.yaml: invalid TrainingSweep" in str(
        caught.value)
    return list(caught.value.problems)


# ---------------------------------------------------------------------------- parse_sweep


def test_a_good_sweep_parses_with_its_defaults() -> None:
    sweep = sw.parse_sweep(_doc())
    spec = sweep.spec
    assert (sweep.name, sweep.namespace) == ("digits-search", "default")
    assert spec.template.training.epochs == 4 and spec.template.model.architecture == "small_cnn"
    assert [p.path for p in spec.parameters] == [
        "training.optimizer.lr", "model.args.depth", "model.args.width"]
    assert spec.parameters[0].float_range == sw.FloatRange(min=0.001, max=0.3, log=True)
    assert spec.parameters[1].int_range == sw.IntRange(min=1, max=3)
    assert spec.parameters[2].categorical == [8, 16]
    assert spec.objective.metric is api.TargetMetric.VALIDATION_ACCURACY and spec.objective.maximize
    assert spec.algorithm == sw.AlgorithmSpec(name=sw.Algorithm.RANDOM, seed=0)
    assert spec.early_stopping.name is sw.EarlyStoppingName.ASHA
    assert (spec.trial_budget, spec.parallel_trials, spec.max_failed_trials) == (16, 2, 3)
    assert spec.warm_start is sw.SweepWarmStart.CHAIN
    assert sw.is_sweep(_doc()) and not sw.is_sweep(yaml.safe_load(JOB))


def test_a_loss_objective_minimizes_by_default() -> None:
    spec = sw.parse_sweep(_doc(objective={"metric": "validation_loss", "target": 0.1})).spec
    assert not spec.objective.maximize and spec.objective.goal is None


@pytest.mark.parametrize(("spec", "expected"), [
    pytest.param({"parameters": [{"path": "training.learningRate", "float": {"min": 0.1,
                                                                             "max": 1.0}}]},
                 "spec.parameters[0].path: 'training.learningRate' is not a TrainingJob field: "
                 "training has no 'learningRate'; known: batchSize", id="unknown-path"),
    pytest.param({"parameters": [{"path": "model.args", "categorical": [1]}]},
                 "spec.parameters[0].path: model.args is a map; name a key below it",
                 id="path-is-a-map"),
    pytest.param({"parameters": [{"path": "training.optimizer", "categorical": [1]}]},
                 "spec.parameters[0].path: training.optimizer is an object", id="path-is-an-object"),
    pytest.param({"parameters": [{"path": "training.epochs.max", "categorical": [1]}]},
                 "spec.parameters[0].path: training.epochs is a value, not an object",
                 id="path-below-a-value"),
    pytest.param({"parameters": [{"path": "template.image", "categorical": ["a"]}]},
                 "spec.parameters[0].path: spec.template (the pod template) cannot be searched",
                 id="pod-template"),
    pytest.param({"parameters": [{"path": "model.args.depth", "int": {"min": 4, "max": 1}}]},
                 "spec.parameters[0].int: empty range: max 1 is below min 4", id="empty-int-range"),
    pytest.param({"parameters": [{"path": "training.optimizer.lr",
                                  "float": {"min": 0.3, "max": 0.3}}]},
                 "spec.parameters[0].float: empty range: max 0.3 is not above min 0.3",
                 id="empty-float-range"),
    pytest.param({"objective": {"metric": "train_accuracy"}},
                 "spec.objective.metric: Input should be 'validation_accuracy' or "
                 "'validation_loss'", id="objective-the-trainer-never-reports"),
    pytest.param({"parameters": [{"path": "training.epochs", "float": {"min": 1.0, "max": 9.0}}]},
                 "spec.parameters[0].float: training.epochs takes whole numbers; use an int range",
                 id="float-range-on-an-int-field"),
    pytest.param({"algorithm": {"name": "grid"}},
                 "spec.algorithm.name: grid needs a finite set per parameter; "
                 "training.optimizer.lr is a float range", id="grid-over-a-float-range"),
    pytest.param({"parameters": [{"path": "model.args.depth", "int": {"min": 1, "max": 2},
                                  "categorical": [1]}]},
                 "spec.parameters[0]: set exactly one of categorical, int or float (got "
                 "categorical, int)", id="two-kinds"),
    pytest.param({"parameters": [{"path": "model.args.depth", "categorical": [1, 1]}]},
                 "spec.parameters[0].categorical: a value is listed twice", id="value-twice"),
    pytest.param({"parameters": [{"path": "model.args.depth", "categorical": [1]},
                                 {"path": "model.args.depth", "categorical": [2]}]},
                 "spec.parameters[1].path: 'model.args.depth' is set by an earlier parameter",
                 id="path-twice"),
    pytest.param({"parameters": [{"path": "training.batchSize", "categorical": [32, 0]}]},
                 "spec.parameters[0]: training.batchSize=0 makes an invalid trial: "
                 "spec.training.batchSize", id="value-makes-an-invalid-trial"),
    pytest.param({"parameters": [{"path": "model.args.depth", "int": {"min": 0, "max": 4,
                                                                      "log": True}}]},
                 "spec.parameters[0].int.log: a log scale needs min at least 1", id="int-log"),
    pytest.param({"objective": {"goal": "minimize"}},
                 "spec.objective.goal: minimize validation_accuracy makes the search prefer "
                 "worse models; use maximize", id="goal-against-metric"),
    pytest.param({"objective": {"target": 2}},
                 "spec.objective.target: an accuracy is in (0, 1]", id="target"),
    pytest.param({"earlyStopping": {"name": "median", "minEpochs": 4}},
                 "spec.earlyStopping.minEpochs: 4 leaves nothing to stop in a 4-epoch trial",
                 id="min-epochs"),
    pytest.param({"parameters": [{"path": "model.args.depth", "categorical": [2, 2.0]}]},
                 "spec.parameters[0].categorical: a value is listed twice (1 and 1.0 are the "
                 "same number)", id="int-and-float-of-one-number"),
    pytest.param({"parameters": [{"path": "model.args.act", "categorical": ["x" * 257]}]},
                 "spec.parameters[0].categorical: a string value has at most 256 characters",
                 id="long-string-value"),
    pytest.param({"parameters": [{"path": "runPolicy.suspend", "categorical": [True, False]}]},
                 "spec.parameters[0].path: runPolicy.suspend cannot be searched",
                 id="suspend-searched"),
    pytest.param({"template": {"model": {"architecture": "small_cnn", "inputShape": [1, 8, 8]},
                               "runPolicy": {"suspend": True}}},
                 "spec.template.runPolicy.suspend: trials would be created suspended",
                 id="template-suspended"),
    pytest.param({"objective": {"metric": "validation_loss", "target": float("inf")}},
                 "spec.objective.target: must be a finite number (got inf)",
                 id="target-infinite"),
    pytest.param({"maxTrials": 200, "template": {
        "model": {"architecture": "small_cnn", "inputShape": [1, 8, 8]},
        "training": {"epochs": 1000}}},
                 "spec.maxTrials: 200 trials of up to 1000 epochs would record about ",
                 id="history-outgrows-the-status"),
    pytest.param({"maxTrials": 20, "parameters": [
        {"path": "training.epochs", "categorical": [10, 2000]}]},
                 "spec.maxTrials: 20 trials of up to 2000 epochs", id="epochs-searched-too-high"),
    pytest.param({"maxTrial": 3}, "spec.maxTrial: unknown field", id="unknown-field"),
    pytest.param({"template": {"model": {"architecture": "small_cnn", "inputShape": [1, 8, 8]},
                               "training": {"epochs": 0}}},
                 "spec.template.training.epochs", id="template-invalid"),
])
def test_a_bad_sweep_is_refused_naming_the_field(spec: dict[str, Any], expected: str) -> None:
    problems = _problems(_doc(**spec))
    assert any(p.startswith(expected) for p in problems), problems


def test_a_name_leaves_room_for_its_trials_names() -> None:
    doc = _doc()
    doc["metadata"]["name"] = "a" * (sw.SWEEP_NAME_MAX_LENGTH + 1)
    (problem,) = _problems(doc)
    assert problem.startswith(f"metadata.name: at most {sw.SWEEP_NAME_MAX_LENGTH} characters")
    doc["metadata"]["name"] = "a" * sw.SWEEP_NAME_MAX_LENGTH
    assert len(sw.trial_name(sw.parse_sweep(doc).name, sw.MAX_TRIALS - 1)) == api.NAME_MAX_LENGTH


def test_a_huge_int_range_is_counted_not_listed() -> None:
    """A range of 10**30 values parses at once (the checks never list it), and a grid over it
    is refused: the grid sampler lists every combination."""
    huge = [{"path": "dataset.maxSamples", "int": {"min": 20, "max": 20 + 10**30}}]
    sweep = sw.parse_sweep(_doc(parameters=huge))
    assert sw.grid_size(sweep.spec.parameters) == 10**30 + 1
    assert sw.probe_values(sweep.spec.parameters[0]) == [20, 20 + 10**30]
    assert 20 + 10**29 in (sw.finite_values(sweep.spec.parameters[0]) or [])
    problems = _problems(_doc(parameters=huge, algorithm={"name": "grid"}, maxTrials=10))
    assert problems == [(f"spec.parameters: the grid has {10**30 + 1} combinations, above "
                        f"{sw.MAX_GRID_POINTS}; narrow the parameters, or use random or tpe")]


# ---------------------------------------------------------------------------- values and paths


def test_grid_size_points_and_budget() -> None:
    params = [{"path": "model.args.depth", "int": {"min": 1, "max": 5, "step": 2}},
              {"path": "model.args.width", "categorical": [8, 16]}]
    sweep = sw.parse_sweep(_doc(parameters=params, algorithm={"name": "grid"}))
    assert sw.grid_size(sweep.spec.parameters) == 6 and sweep.spec.trial_budget == 6
    assert sw.all_grid_points(sweep.spec.parameters) == [
        {"model.args.depth": d, "model.args.width": w} for d in (1, 3, 5) for w in (8, 16)]
    assert sw.grid_size(sw.parse_sweep(_doc()).spec.parameters) is None  # a float range
    assert sw.probe_values(sweep.spec.parameters[0]) == [1, 5]
    over = [{"path": "training.seed", "int": {"min": 0, "max": sw.MAX_TRIALS}}]
    (problem,) = _problems(_doc(parameters=over, algorithm={"name": "grid"}))
    assert problem.startswith(f"spec.maxTrials: the grid has {sw.MAX_TRIALS + 1} combinations")
    budget = sw.parse_sweep(_doc(parameters=over, algorithm={"name": "grid"}, maxTrials=7))
    assert budget.spec.trial_budget == 7


def test_an_int_ranges_last_probe_is_on_its_step() -> None:
    param = sw.Parameter.model_validate({"path": "training.seed",
                                         "int": {"min": 1, "max": 10, "step": 4}})
    assert sw.probe_values(param) == [1, 9] and list(sw.finite_values(param) or []) == [1, 5, 9]


def test_apply_sets_each_path_in_a_copy_creating_missing_objects() -> None:
    template = {"model": {"args": {"depth": 2}}, "training": {"epochs": 4}}
    before = copy.deepcopy(template)
    spec = sw.apply(template, {"model.args.depth": 3, "training.optimizer.lr": 0.01,
                               "dataset.args.size": 8})
    assert spec == {"model": {"args": {"depth": 3}},
                    "training": {"epochs": 4, "optimizer": {"lr": 0.01}},
                    "dataset": {"args": {"size": 8}}}
    assert template == before
    assert api.parse_job({"apiVersion": api.API_VERSION, "kind": api.KIND,
                          "metadata": {"name": sw.trial_name("s", 0)},
                          "spec": sw.apply(yaml.safe_load(SWEEP)["spec"]["template"],
                                           {"training.optimizer.lr": 0.01})
                          }).spec.training.optimizer.lr == 0.01


@pytest.mark.parametrize("path", ["training.optimizer.lr", "training.epochs", "model.args.depth",
                                  "dataset.args.anything", "warmStart.enabled",
                                  "freezing.enabled"])
def test_paths_into_the_typed_spec_and_the_free_form_maps_are_accepted(path: str) -> None:
    assert sw.path_problem_of(path) is None


def test_the_path_descriptions_example_is_a_real_path() -> None:
    description = sw.Parameter.model_fields["path"].description or ""
    examples = description.split("e.g. ", 1)[1].split(" (", 1)[0].split(", ")
    assert examples and [p for p in examples if sw.path_problem_of(p)] == []


def test_trial_name() -> None:
    assert sw.trial_name("fmnist", 12) == "fmnist-t12"


# ---------------------------------------------------------------------------- job files


def test_load_documents_reads_jobs_and_sweeps_by_kind(tmp_path: Path) -> None:
    path = tmp_path / "mixed.yaml"
    path.write_text(SWEEP + "---\n" + JOB, encoding="utf-8")
    found = jobfile.load_documents(path)
    assert [type(d).__name__ for d in found] == ["TrainingSweep", "TrainingJob"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(JOB + "---\n" + SWEEP.replace("small_cnn", "small_cnn, x: &a 1"),
                   encoding="utf-8")
    with pytest.raises(api.InvalidSpec, match="anchors and aliases are not supported"):
        jobfile.load_documents(bad)  # the same strict loader as job files
    with pytest.raises(api.InvalidSpec) as caught:
        jobfile.load_jobs(path)  # `kiln run` is for jobs: it says where a sweep goes
    assert caught.value.problems == [("kind: TrainingSweep is a search over jobs, not a job; "
                                     "run it with `kiln sweep run`")]
    assert caught.value.source == f"{path}[0]"


# ---------------------------------------------------------------------------- kiln validate


def _write(tmp_path: Path, text: str, name: str = "sweep.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def test_validate_accepts_a_mixed_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                       ) -> None:
    path = _write(tmp_path, SWEEP + "---\n" + JOB)
    assert cli.main(["validate", str(path)]) == cli.EXIT_OK
    out = " ".join(capsys.readouterr().out.split())
    assert ("valid: digits-search (sweep of 16 trials over training.optimizer.lr, "
            "model.args.depth, model.args.width; small_cnn on digits)") in out
    assert "valid: digits-small (small_cnn on digits)" in out


@pytest.mark.parametrize(("edit", "expected"), [
    pytest.param(("training.optimizer.lr", "training.lr"),
                 "spec.parameters[0].path: 'training.lr' is not a TrainingJob field",
                 id="unknown-path"),
    pytest.param(("{min: 1, max: 3}", "{min: 3, max: 1}"),
                 "spec.parameters[1].int: empty range", id="empty-range"),
    pytest.param(("earlyStopping: {name: asha}", "objective: {metric: accuracy}"),
                 "spec.objective.metric:", id="objective-never-reported"),
    pytest.param(("path: model.args.depth\n      int:", "path: training.epochs\n      float:"),
                 "spec.parameters[1].float: training.epochs takes whole numbers",
                 id="float-range-on-an-int-field"),
    pytest.param(("earlyStopping: {name: asha}", "algorithm: {name: grid}"),
                 "spec.algorithm.name: grid needs a finite set", id="grid-over-a-float-range"),
    # The registry's checks of each trial: the builder at each value, naming the parameter.
    pytest.param(("categorical: [8, 16]", "categorical: [8, 0]"),
                 "spec.parameters[2]: model.args.width=0 makes an invalid trial: "
                 "spec.model.args: small_cnn rejects its args", id="value-the-builder-rejects"),
    pytest.param(("model.args.width", "model.args.widht"),
                 "spec.parameters[2]: model.args.widht=8 makes an invalid trial: "
                 "spec.model.args.widht: unknown argument of small_cnn; did you mean 'width'?",
                 id="argument-the-builder-lacks"),
    pytest.param(("architecture: small_cnn", "architecture: small_cnnn"),
                 "spec.template.model.architecture: unknown architecture 'small_cnnn'",
                 id="template-architecture"),
    # Values valid alone, not together: the deepest model at the widest width.
    pytest.param(("{min: 1, max: 3}\n    - path: model.args.width\n      categorical: [8, 16]",
                  "{min: 1, max: 150}\n    - path: model.args.width\n      categorical: [8, 4096]"),
                 "spec.parameters: training.optimizer.lr=0.001, model.args.depth=150, "
                 "model.args.width=4096 together make an invalid trial: spec.model.args: "
                 "small_cnn with these args has", id="values-invalid-together"),
])
def test_validate_refuses_a_bad_sweep_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: tuple[str, str], expected: str
) -> None:
    path = _write(tmp_path, SWEEP.replace(*edit))
    assert SWEEP.replace(*edit) != SWEEP
    assert cli.main(["validate", str(path)]) == cli.EXIT_USAGE
    err = " ".join(capsys.readouterr().err.split())
    assert f"{path}: invalid TrainingSweep:" in err and expected in err, err
    assert "Traceback" not in err


def test_validate_names_a_sweeps_schema_and_trial_problems_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = SWEEP.replace("categorical: [8, 16]", "categorical: [8, 16, 0]").replace(
        "earlyStopping: {name: asha}", "earlyStopping: {name: asha}\n  maxTrials: eight")
    assert cli.main(["validate", str(_write(tmp_path, text))]) == cli.EXIT_USAGE
    err = " ".join(capsys.readouterr().err.split())
    assert "spec.maxTrials: Input should be a valid integer" in err, err
    assert "spec.parameters[2]: model.args.width=0 makes an invalid trial" in err, err


def test_validate_json_gives_each_documents_kind_and_verdict(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = _write(tmp_path, SWEEP + "---\n" + JOB, "good.yaml")
    bad = _write(tmp_path, SWEEP.replace("training.optimizer.lr", "training.lr"), "bad.yaml")
    twice = _write(tmp_path, SWEEP + "---\n" + SWEEP, "twice.yaml")
    assert cli.main(["validate", "-o", "json", str(good), str(bad), str(twice)]) == cli.EXIT_USAGE
    captured = capsys.readouterr()
    rows = json.loads(captured.out)
    assert [(Path(r["source"]).name, r.get("kind"), r["name"], r["valid"]) for r in rows] == [
        ("good.yaml", "TrainingSweep", "digits-search", False),  # its name repeats in twice.yaml
        ("good.yaml", "TrainingJob", "digits-small", True),
        ("bad.yaml", None, "digits-search", False),  # as written: it did not validate
        ("twice.yaml", "TrainingSweep", "digits-search", False),
        ("twice.yaml", "TrainingSweep", "digits-search", False)]
    assert rows[0]["parameters"] == ["training.optimizer.lr", "model.args.depth",
                                     "model.args.width"] and rows[0]["maxTrials"] == 16
    assert rows[0]["problems"] == ["metadata.name: another sweep has this name"]
    assert "each sweep needs its own name; repeated: ['digits-search']" in captured.err


def test_a_job_and_a_sweep_may_share_a_name(tmp_path: Path) -> None:
    path = _write(tmp_path, SWEEP + "---\n" + JOB.replace("digits-small", "digits-search"))
    assert cli.main(["validate", str(path)]) == cli.EXIT_OK


@pytest.mark.process
def test_the_installed_kiln_validate_reads_a_sweep_from_stdin(tmp_path: Path) -> None:
    kiln = str(Path(sys.executable).with_name("kiln"))
    good = subprocess.run([kiln, "validate", "-"], input=SWEEP, capture_output=True, text=True,
                          timeout=300, check=False)
    assert good.returncode == 0 and "valid: digits-search (sweep of 16 trials" in good.stdout
    bad = subprocess.run([kiln, "validate", "-"], input=SWEEP.replace("max: 3", "max: 0"),
                         capture_output=True, text=True, timeout=300, check=False)
    assert bad.returncode == 2
    assert "<stdin>: invalid TrainingSweep:\n  spec.parameters[1].int: empty range" in bad.stderr


def test_a_document_of_another_kind_is_named_as_such_not_as_a_bad_job(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("apiVersion: kiln.dev/v1alpha1\nkind: Sweep\nmetadata: {name: s}\n"
                    "spec: {}\n", encoding="utf-8")
    with pytest.raises(api.InvalidSpec) as raised:
        jobfile.load_documents(path)
    assert str(raised.value) == (
        f"{path}: invalid document:\n  kind: must be TrainingJob or TrainingSweep (or "
        "TrainingRuntime / ClusterTrainingRuntime) (got 'Sweep')")
    path.write_text("# nothing here\n", encoding="utf-8")  # no document: neither kind
    with pytest.raises(api.InvalidSpec) as raised:
        jobfile.load_documents(path)
    assert str(raised.value) == f"{path}: invalid file:\n  the file holds no YAML document"

"""`kiln.api`: bad documents get one message per problem naming the field; the schema part
(`check_schema`) is exactly what the CRD also checks; nulls, whole floats and server metadata are
read the way the API server reads them. Agreement with the CRD itself is in test_crd.py."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from jobcorpus import corpus

from kiln import api
from kiln.api import jobfile

MINIMAL: dict[str, Any] = {
    "apiVersion": "kiln.dev/v1alpha1",
    "kind": "TrainingJob",
    "metadata": {"name": "minimal"},
    "spec": {"model": {"architecture": "small_cnn", "inputShape": [1, 8, 8]}},
}


def with_spec(**spec: Any) -> dict[str, Any]:
    """MINIMAL with spec keys replaced."""
    return {**MINIMAL, "spec": {**MINIMAL["spec"], **spec}}


@pytest.mark.parametrize(("doc", "field", "message"), corpus("invalid"))
def test_schema_problem_message_names_the_field(doc: Any, field: str, message: str) -> None:
    problems = api.check_schema(doc)
    assert any(p.startswith(f"{field}: ") for p in problems), problems
    assert any(message in p for p in problems), (message, problems)


@pytest.mark.parametrize(("doc", "field", "message"), corpus("invalid"))
def test_parse_job_raises_exactly_the_schema_problems(doc: Any, field: str, message: str) -> None:
    with pytest.raises(api.InvalidSpec) as caught:
        api.parse_job(doc, source="job.yaml")
    assert caught.value.problems == api.check_schema(doc)
    assert str(caught.value).startswith("job.yaml: invalid TrainingJob:")


@pytest.mark.parametrize(("doc", "field", "message"), corpus("valid"))
def test_valid_document_parses_and_round_trips_through_the_wire(
    doc: Any, field: str, message: str
) -> None:
    assert api.check_schema(doc) == []
    job = api.parse_job(doc)
    assert api.parse_job(api.to_wire(job)) == job


@pytest.mark.parametrize(("doc", "field", "message"), corpus("crossfield"))
def test_check_schema_leaves_cross_field_rules_to_validate(
    doc: Any, field: str, message: str
) -> None:
    assert api.check_schema(doc) == []
    with pytest.raises(api.InvalidSpec) as caught:
        api.parse_job(doc)
    assert [p.split(": ", 1)[0] for p in caught.value.problems] == [field]


def test_unknown_field_suggests_the_closest_wire_name() -> None:
    doc = with_spec(training={"epoch": 3, "batchsize": 8}, warmStart={"minSimilarty": 0.5})
    assert api.check_schema(doc) == [
        "spec.training.epoch: unknown field; did you mean 'epochs'?",
        "spec.training.batchsize: unknown field; did you mean 'batchSize'?",
        "spec.warmStart.minSimilarty: unknown field; did you mean 'minSimilarity'?",
    ]


def test_unknown_field_far_from_any_name_lists_the_known_ones() -> None:
    (problem,) = api.check_schema(with_spec(zoo={"xyz": 1}))
    assert problem == ("spec.zoo.xyz: unknown field; known: register, "
                       "provisionalEveryEvaluations, share")


def test_every_problem_is_reported_at_once() -> None:
    doc = with_spec(training={"epochs": 0, "batchSize": "big", "optimizer": {"name": "sgdm"}})
    assert [p.split(":")[0] for p in api.check_schema(doc)] == [
        "spec.training.epochs", "spec.training.batchSize", "spec.training.optimizer.name"]


def test_null_for_a_field_with_a_default_means_the_default() -> None:
    job = api.parse_job(with_spec(dataset={"name": None}, training=None, template=None))
    assert job.spec.dataset == api.DatasetSpec()
    assert job.spec.training == api.TrainingSpec()
    assert job.spec.template == {}


def test_null_for_a_required_field_is_an_error() -> None:
    assert api.check_schema(with_spec(model=None)) == ["spec.model: Input should be an object"]


def test_null_for_an_optional_field_means_unset() -> None:
    job = api.parse_job(with_spec(target=None, resources={"gpus": None}))
    assert job.spec.target is None and job.spec.resources.gpus is None


def test_whole_float_is_read_as_the_integer_kubectl_sends() -> None:
    job = api.parse_job(with_spec(training={"epochs": 5.0}))
    assert job.spec.training.epochs == 5 and isinstance(job.spec.training.epochs, int)


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
def test_non_finite_number_is_rejected_naming_the_field(value: float) -> None:
    (problem,) = api.check_schema(with_spec(training={"gradClipNorm": value}))
    assert problem.startswith("spec.training.gradClipNorm: must be a finite number")


def test_quoted_numbers_and_booleans_keep_their_yaml_type() -> None:
    problems = api.check_schema(with_spec(training={"epochs": "5"}, dataset={"download": "yes"}))
    assert problems == [
        "spec.dataset.download: Input should be a valid boolean (got 'yes')",
        "spec.training.epochs: Input should be a valid integer (got '5')",
    ]


def test_an_unquoted_off_read_as_false_gets_a_quoting_hint() -> None:
    (problem,) = api.check_schema(with_spec(freezing={"cache": False}))
    assert problem.startswith("spec.freezing.cache: Input should be 'auto' or 'off' (got False)")
    assert 'quote it, e.g. "off"' in problem


def test_server_set_metadata_is_accepted_and_unknown_metadata_is_not() -> None:
    server_meta = {"name": "a", "uid": "u", "resourceVersion": "7", "generation": 3,
                   "creationTimestamp": "2025-01-01T00:00:00Z", "finalizers": ["kiln.dev/x"]}
    assert api.parse_job({**MINIMAL, "metadata": server_meta}).metadata.generation == 3
    assert api.check_schema({**MINIMAL, "metadata": {"name": "a", "namspace": "x"}}) == [
        "metadata.namspace: unknown field; did you mean 'namespace'?"]


def test_to_wire_leaves_server_metadata_out_when_unset() -> None:
    assert api.to_wire(api.parse_job(MINIMAL))["metadata"] == {
        "name": "minimal", "labels": {}, "annotations": {}}


def test_non_mapping_document_is_one_problem() -> None:
    assert api.check_schema(["a"]) == ["<document>: expected a mapping, got list"]
    assert api.check_schema(None) == ["<document>: expected a mapping, got NoneType"]


def test_load_jobs_names_each_document_of_a_multi_document_file(tmp_path: Path) -> None:
    bad = with_spec(training={"epochs": 0})
    path = tmp_path / "jobs.yaml"
    path.write_text(yaml.safe_dump_all([MINIMAL, bad]), encoding="utf-8")
    with pytest.raises(api.InvalidSpec) as caught:
        jobfile.load_jobs(path)
    assert caught.value.source == f"{path}[1]"
    assert caught.value.problems[0].startswith("spec.training.epochs: ")


def test_load_jobs_reports_yaml_errors_with_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("spec:\n  model: [1, 2\n", encoding="utf-8")
    with pytest.raises(api.InvalidSpec) as caught:
        jobfile.load_jobs(path)
    (problem,) = caught.value.problems
    assert problem.startswith("not valid YAML at line ")


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("a: &a [*a]\n", id="self-referencing-alias"),
        pytest.param("a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
            f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n"
            for p, n in zip("abcdefgh", "bcdefghi", strict=True)), id="billion-laughs"),
        pytest.param(yaml.safe_dump(MINIMAL).replace("spec:", "spec: &s") + "x: *s\n",
                     id="anchor-in-a-job"),
    ],
)
def test_load_jobs_refuses_yaml_anchors_and_aliases(tmp_path: Path, text: str) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(api.InvalidSpec) as caught:
        jobfile.load_jobs(path)
    (problem,) = caught.value.problems
    assert problem.startswith("YAML anchors and aliases are not supported in job files (line ")


def test_load_jobs_refuses_a_repeated_key_naming_it_and_its_line(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(MINIMAL) + "metadata: {name: other}\n", encoding="utf-8")
    with pytest.raises(api.InvalidSpec) as caught:
        jobfile.load_jobs(path)
    (problem,) = caught.value.problems
    assert re.fullmatch(r"duplicate key 'metadata' at line \d+ \(first at line \d+\); .*", problem)


def test_load_jobs_reads_plain_yaml_as_safe_load_does(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump_all([MINIMAL, {**MINIMAL, "metadata": {"name": "b"}}]),
                    encoding="utf-8")
    assert [j.name for j in jobfile.load_jobs(path)] == ["minimal", "b"]


def test_unsupported_torchvision_class_suggests_the_closest_supported_one() -> None:
    doc = with_spec(model={"architecture": "resnet18", "inputShape": [3, 32, 32]},
                    dataset={"name": "torchvision", "path": "/data", "torchvisionClass": "cifar10"})
    (problem,) = api.validate(api.TrainingJob.model_validate(doc))
    assert problem.startswith("spec.dataset.torchvisionClass: 'cifar10' is not a supported ")
    assert "did you mean 'CIFAR10'?" in problem and "MNIST, FashionMNIST" in problem


@pytest.mark.parametrize(("name", "valid"), [
    ("NCCL_DEBUG", True), ("my.setting-2", True), ("_x", True), ("has space", False),
    ("FOO=BAR", False), ("2FAST", False), ("é", False)])
def test_env_names_are_those_kubernetes_accepts(name: str, valid: bool) -> None:
    job = api.TrainingJob.model_validate(with_spec(template={"env": [{"name": name,
                                                                      "value": "1"}]}))
    problems = [p for p in api.validate(job) if p.startswith("spec.template.env[0].name: ")]
    message = (f"spec.template.env[0].name: {name!r} is not a valid variable name; use letters, "
               "digits, '_', '-' and '.', not starting with a digit, e.g. NCCL_DEBUG")
    assert problems == ([] if valid else [message])


@pytest.mark.parametrize("namespace", ["../x", "Team_A", "a" * 64, ""])
def test_a_namespace_must_be_an_rfc_1123_label(namespace: str) -> None:
    doc = {**MINIMAL, "metadata": {"name": "minimal", "namespace": namespace}}
    with pytest.raises(api.InvalidSpec) as caught:
        api.parse_job(doc)
    assert [p.split(":")[0] for p in caught.value.problems] == ["metadata.namespace"]
    assert api.parse_job({**MINIMAL, "metadata": {"name": "m", "namespace": "team-a"}})


def test_cross_field_problems_are_reported_beside_schema_problems() -> None:
    doc = with_spec(training={"epochs": 2, "optimizer": {"lr": -1}},
                    resources={"gpus": 3, "parallelism": "single"})
    with pytest.raises(api.InvalidSpec) as caught:
        api.parse_job(doc)
    fields = [p.split(":")[0] for p in caught.value.problems]
    assert fields == ["spec.training.optimizer.lr", "spec.resources.parallelism",
                      "spec.training.batchSize"]
    assert caught.value.rejected == ("spec.training.optimizer.lr",)
    assert isinstance(caught.value.job, api.TrainingJob)


def test_cross_field_problems_reading_a_rejected_field_are_left_out() -> None:
    doc = with_spec(training={"epochs": "two", "batchSize": 32, "lrSchedule": {"warmupEpochs": 5}},
                    resources={"gpus": 3})
    with pytest.raises(api.InvalidSpec) as caught:
        api.parse_job(doc)
    # warmupEpochs < epochs reads the rejected epochs; the batch split over gpus does not
    assert [p.split(":")[0] for p in caught.value.problems] == ["spec.training.epochs",
                                                                "spec.training.batchSize"]


def test_a_job_file_reads_exponent_floats_as_kubernetes_does(tmp_path: Path) -> None:
    path = tmp_path / "lr.yaml"
    path.write_text("apiVersion: kiln.dev/v1alpha1\nkind: TrainingJob\nmetadata: {name: lr}\n"
                    "spec:\n  model: {architecture: small_cnn, inputShape: [1, 8, 8]}\n"
                    "  training: {optimizer: {name: adam, lr: 1e-5}}\n", encoding="utf-8")
    (job,) = jobfile.load_jobs(path)
    assert job.spec.training.optimizer.lr == 1e-5


def _nested(levels: int) -> dict[str, Any]:
    """A chain of `levels` mappings."""
    chain: dict[str, Any] = {}
    for _ in range(levels - 1):
        chain = {"a": chain}
    return chain


def test_a_job_nested_deeper_than_a_job_needs_is_refused_naming_the_field() -> None:
    limit = api.MAX_DEPTH - 4  # the document, spec, model and args hold the rest
    fits = with_spec(model={"architecture": "small_cnn", "inputShape": [1, 8, 8],
                            "args": {"depth": 2, "x": _nested(limit)}})
    assert api.nesting_depth(fits) == api.MAX_DEPTH
    api.parse_job(fits)  # the args are the registry's to judge, not the parser's
    deep = with_spec(model={"architecture": "small_cnn", "inputShape": [1, 8, 8],
                            "args": {"depth": 2, "x": _nested(3_000)}},
                     template={"affinity": {"nodeAffinity": [_nested(200)]}})
    with pytest.raises(api.InvalidSpec) as caught:
        api.parse_job(deep)
    assert [p.split(":")[0] for p in caught.value.problems] == ["spec.model.args",
                                                                "spec.template"]
    assert caught.value.problems[0].startswith(
        f"spec.model.args: nested more than {api.MAX_DEPTH} levels deep")
    assert "flatten it" in caught.value.problems[0]


def test_a_spec_too_large_for_the_trainer_pod_names_the_field_holding_it() -> None:
    big = with_spec(model={"architecture": "small_cnn", "inputShape": [1, 8, 8],
                           "args": {"vocabulary": ["word"] * (api.MAX_SPEC_BYTES // 6)}})
    with pytest.raises(api.InvalidSpec) as caught:
        api.parse_job(big)
    (problem,) = caught.value.problems
    assert problem.startswith("spec.model.args: the spec is 1")
    assert "above the 100 KiB a trainer pod can carry" in problem


def test_load_jobs_refuses_yaml_nested_deeper_than_a_job_needs_before_composing_it(
        tmp_path: Path) -> None:
    path = tmp_path / "deep.yaml"
    path.write_text("apiVersion: kiln.dev/v1alpha1\nkind: TrainingJob\nmetadata: {name: d}\n"
                    "spec:\n  model:\n    architecture: small_cnn\n    inputShape: [1, 8, 8]\n"
                    "    args:\n      x: " + "[" * 3_000 + "]" * 3_000 + "\n", encoding="utf-8")
    with pytest.raises(api.InvalidSpec) as caught:
        jobfile.load_jobs(path)
    (problem,) = caught.value.problems
    assert problem.startswith(f"spec.model.args (line 9): nested more than {api.MAX_DEPTH} "
                              "levels deep")


def _admitted(**spec: Any) -> dict[str, Any]:
    """MINIMAL with spec keys replaced, as the API returns it once the operator admitted it."""
    doc = with_spec(model={"architecture": "small_cnn", "inputShape": [1, 8, 8],
                           "args": {"depth": 2, "width": 8}},
                    template={"image": "trainer:1", "nodeSelector": {"pool": "a"}})
    body = {**doc, "status": {"admittedSpec": api.admitted_spec(api.parse_job(doc))}}
    return {**body, "spec": {**doc["spec"], **spec}}


def test_an_admitted_job_runs_on_its_admitted_spec_with_only_the_mutable_edits() -> None:
    body = _admitted(model={"architecture": "small_cnn", "inputShape": [1, 8, 8],
                            "args": {"depth": 2, "width": 64}},
                     training={"epochs": 50},
                     runPolicy={"suspend": True, "backoffLimit": 1},
                     template={"image": "trainer:2", "nodeSelector": {"pool": "b"}})
    body["metadata"] = {"name": "minimal", "managedFields": [{"fieldsV1": {"f:spec": {}}}]}
    job = api.parse_running(body)
    assert job.spec.model.args == {"depth": 2, "width": 8}
    assert job.spec.training.epochs == api.TrainingSpec().epochs
    assert job.spec.template == {"image": "trainer:1", "nodeSelector": {"pool": "b"}}
    assert job.spec.run_policy.suspend and job.spec.run_policy.backoff_limit == 1
    assert job.metadata.managed_fields is None
    assert api.ignored_edits(body) == ["spec.model.args.width", "spec.training.epochs",
                                       "spec.template.image"]


def test_unchanged_and_defaulted_fields_are_no_edit() -> None:
    body = _admitted(runPolicy={"suspend": True}, template={"image": "trainer:1",
                                                            "tolerations": []})
    assert "dataset" not in body["spec"]  # the admitted spec has it, with its defaults
    assert api.ignored_edits(body) == []
    assert api.edited_parts(_admitted()["spec"], body["spec"]) == (False, True)
    body["spec"]["training"] = {"epochs": "many"}
    assert api.ignored_edits(body) == ["spec.training"]
    assert api.ignored_edits({**body, "status": {}}) == []  # not admitted yet


def test_an_invalid_edit_of_the_scheduling_directives_leaves_the_admitted_ones() -> None:
    body = _admitted(template={"image": "trainer:1", "nodeSelector": "pool-b"})
    with pytest.raises(api.InvalidSpec):
        api.parse_job(api.running_doc(body))
    assert api.parse_running(body).spec.template["nodeSelector"] == {"pool": "a"}

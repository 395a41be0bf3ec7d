"""`kiln validate` and the operator's admission are one validation: for every job of the corpus,
and for jobs only the model checks reject, both report exactly the same problems."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import decimal
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from jobcorpus import corpus

from kiln import cli
from kiln.controller import admission


def _job(model: dict[str, Any], dataset: dict[str, Any] | None = None) -> Any:
    doc = {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "x"},
           "spec": {"model": model}}
    if dataset is not None:
        doc["spec"]["dataset"] = dataset
    return pytest.param(doc, "", "", id=f"model-{len(str(model))}-{sorted(model)}")


MODEL_ONLY = [
    _job({"architecture": "small_cnnn", "inputShape": [1, 8, 8]}),
    _job({"architecture": "small_cnn", "args": {"widht": 8}, "inputShape": [1, 8, 8]}),
    _job({"architecture": "char_transformer", "inputShape": [1, 8, 8]}),
    _job({"architecture": "small_cnn", "task": "language_model", "inputShape": [1, 8, 8]}),
    _job({"entrypoint": "not_importable_anywhere:build", "task": "language_model",
          "inputShape": [1, 8, 8]}),
    _job({"entrypoint": "not_importable_anywhere:build", "inputShape": [16]},
         {"name": "text", "path": "corpus.txt"}),
    _job({"architecture": "small_cnn", "args": {"depth": 13_000}, "inputShape": [1, 8, 8]}),
]


def _cli_problems(doc: Any, tmp_path: Path) -> list[str]:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    try:
        cli._load_all([path])
    except cli.UsageError as exc:
        return [line.strip() for line in str(exc).splitlines() if line.startswith("  ")]
    return []


def _admission_problems(doc: Any) -> list[str]:
    body = copy.deepcopy(doc) if isinstance(doc, dict) else doc
    if isinstance(body, dict) and isinstance(body.get("metadata"), dict):
        body["metadata"].setdefault("namespace", "team-a")
    _, problems = asyncio.run(admission.validate(body))
    return problems


@pytest.mark.parametrize(("doc", "field", "message"),
                         corpus("valid") + corpus("crossfield") + MODEL_ONLY)
def test_kiln_validate_and_admission_report_the_same_problems(
        doc: Any, field: str, message: str, tmp_path: Path) -> None:
    del field, message
    assert _cli_problems(doc, tmp_path) == _admission_problems(doc)


@pytest.mark.parametrize(("doc", "field", "message"), MODEL_ONLY)
def test_model_problems_reach_both(doc: Any, field: str, message: str, tmp_path: Path) -> None:
    del field, message
    problems = _admission_problems(doc)
    assert problems and all(p.startswith("spec.model") for p in problems), problems


def test_an_overflowing_quantity_is_a_named_problem() -> None:
    doc = {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "x"},
           "spec": {"model": {"architecture": "small_cnn", "inputShape": [1, 8, 8]},
                    "template": {"resources": {"requests": {"cpu": "1e1000000"}}}}}
    problems = _admission_problems(doc)
    assert any(p.startswith("spec.template.resources.requests.cpu: not a Kubernetes quantity")
               for p in problems), problems


def test_a_parser_error_fails_the_job_not_the_handler(monkeypatch: pytest.MonkeyPatch) -> None:
    # No spec reaches such a gap today; the stand-in parser raises what a future one might.
    def broken(body: Any, source: str = "") -> Any:
        raise decimal.Overflow("exponent too large")
    monkeypatch.setattr(admission.lifecycle.api, "parse_running", broken)
    job, problems = asyncio.run(admission.validate({"metadata": {"name": "x", "namespace": "a"}}))
    assert job is None and problems == ["spec: cannot be read (Overflow: exponent too large)"]


def test_a_job_nested_3000_levels_deep_is_refused_by_name_in_both(tmp_path: Path) -> None:
    chain: dict[str, Any] = {}
    for _ in range(3_000):
        chain = {"a": chain}
    doc = {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob",
           "metadata": {"name": "x", "namespace": "team-a"},
           "spec": {"model": {"architecture": "small_cnn", "args": {"nested": chain},
                              "inputShape": [1, 8, 8]}}}
    job, (problem,) = asyncio.run(admission.validate(doc))
    assert job is None
    assert problem.startswith("spec.model.args: nested more than 100 levels deep")
    path = tmp_path / "job.yaml"  # JSON is YAML; PyYAML cannot write this deep
    with _recursion_limit(10_000):
        path.write_text(json.dumps(doc), encoding="utf-8")
    with pytest.raises(cli.UsageError) as caught:
        cli._load_all([path])
    assert "spec.model.args (line 1): nested more than 100 levels deep" in str(caught.value)


@contextlib.contextmanager
def _recursion_limit(limit: int) -> Iterator[None]:
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(limit)
    try:
        yield
    finally:
        sys.setrecursionlimit(before)


def test_admission_refuses_the_accelerators_the_operator_counts_as_gpus_in_the_template(
) -> None:
    doc: dict[str, Any] = {
        "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": "x", "namespace": "team-a"},
        "spec": {"model": {"architecture": "small_cnn", "inputShape": [1, 8, 8]},
                 "template": {"resources": {"limits": {"cpu": "1", "example.com/accel": 1}}}}}
    assert asyncio.run(admission.validate(doc))[1] == []  # unknown to `kiln validate`
    _, problems = asyncio.run(admission.validate(
        doc, gpu_resources=("nvidia.com/gpu", "example.com/accel")))
    assert problems == [(
        "spec.template.resources.limits: example.com/accel is an accelerator, which only Kiln "
        "asks for (as many as the planner gives the job); remove it and set "
        "spec.resources.gpus")]
    doc["spec"]["template"]["resources"]["limits"]["nvidia.com/gpu"] = 1
    _, problems = asyncio.run(admission.validate(doc, gpu_resources=("example.com/accel",)))
    (problem,) = problems
    assert problem.startswith("spec.template.resources.limits: example.com/accel, "
                              "nvidia.com/gpu are accelerators")

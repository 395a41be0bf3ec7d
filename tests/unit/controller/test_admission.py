"""`kiln validate` and the operator's admission are one validation: for every job of the corpus,
and for jobs only the model checks reject, both report exactly the same problems."""

from __future__ import annotations

import asyncio
import copy
import decimal
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
    monkeypatch.setattr(admission.lifecycle.api, "parse_job", broken)
    job, problems = asyncio.run(admission.validate({"metadata": {"name": "x", "namespace": "a"}}))
    assert job is None and problems == ["spec: cannot be read (Overflow: exponent too large)"]

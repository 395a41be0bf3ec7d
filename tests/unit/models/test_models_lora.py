"""LoRA jobs: spec.training.peft's schema and `check_job` rules, each naming the field, and the
adapter helpers of `kiln.models.lora` (its tensors, loading them, merging into the base)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from kiln import api, models
from kiln.models import lora

MODEL: dict[str, Any] = {"architecture": "small_cnn", "args": {"depth": 2, "width": 8}, "inputShape": [1, 8, 8]}


def _doc(peft: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "ft"},
            "spec": {"model": MODEL, "training": {"peft": peft},
                     "warmStart": {"parent": "small_cnn-0a0b0c0d"}, **spec}}


def _problems(peft: dict[str, Any], **spec: Any) -> list[str]:
    try:
        return models.check_job(api.parse_job(_doc(peft, **spec)))
    except api.InvalidSpec as exc:
        return models.check_job(exc)


def test_a_valid_lora_job_has_no_problems() -> None:
    assert _problems({"rank": 4, "targetModules": ["head.2", "blocks.0.0"]}) == []


@pytest.mark.parametrize(("peft", "field"), [
    ({"method": "adalora", "targetModules": ["head.2"]}, "spec.training.peft.method"),
    ({"rank": 0, "targetModules": ["head.2"]}, "spec.training.peft.rank"),
    ({"targetModules": []}, "spec.training.peft.targetModules"),
    ({"dropout": 1.0, "targetModules": ["head.2"]}, "spec.training.peft.dropout"),
    ({"rank": 4}, "spec.training.peft.targetModules"),
])
def test_schema_errors_name_the_field(peft: dict[str, Any], field: str) -> None:
    problems = _problems(peft)
    assert problems and any(p.startswith(field) for p in problems), problems


@pytest.mark.parametrize("targets", [["nope"], ["stem.1"]])  # nothing, and a BatchNorm
def test_target_modules_that_fit_no_module_are_named_with_the_ones_that_do(
        targets: list[str]) -> None:
    problems = _problems({"targetModules": targets})
    assert len(problems) == 1, problems
    assert problems[0].startswith("spec.training.peft.targetModules: ")
    assert str(targets) in problems[0] and "head.2" in problems[0] and "stem.0" in problems[0]


def test_a_lora_job_must_pin_its_base_and_not_shard() -> None:
    doc = _doc({"targetModules": ["head.2"]}, resources={"parallelism": "fsdp"})
    doc["spec"]["warmStart"] = {}
    problems = models.check_job(api.parse_job(doc))
    assert any(p.startswith("spec.training.peft: LoRA trains an adapter on a base model; set "
                            "spec.warmStart.parent") for p in problems), problems
    assert any("set spec.resources.parallelism to ddp or auto" in p for p in problems), problems


def test_a_lora_job_on_pretrained_weights_has_its_base_without_a_pin() -> None:
    doc = _doc({"targetModules": ["head.2"]})
    doc["spec"]["warmStart"] = {}
    doc["spec"]["model"] = {**MODEL, "pretrained": {"uri": "s3://weights/base.safetensors"}}
    assert models.check_job(api.parse_job(doc)) == []


def test_without_peft_installed_validation_says_which_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft raises ImportError
    models.checks._lora_problems.cache_clear()
    try:
        problems = _problems({"targetModules": ["head.2"]})
    finally:
        models.checks._lora_problems.cache_clear()
    assert problems == [("spec.training.peft: LoRA needs the peft library; install it with "
                        "`pip install 'kiln-operator[peft]'`")]


def test_attach_trains_only_the_adapters_and_merging_computes_what_they_compute() -> None:
    spec = api.ModelSpec.model_validate(MODEL)
    peft = api.PeftSpec.model_validate({"rank": 2, "targetModules": ["head.2", "blocks.0.0"]})
    torch.manual_seed(0)
    base = models.build(spec).state_dict()
    model = models.build(spec)
    model.load_state_dict(base)
    inputs = torch.randn(4, 1, 8, 8)
    before = model.eval()(inputs)
    lora.attach(model, peft)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    torch.testing.assert_close(model(inputs), before)  # B = 0: the adapters start as identity
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_()
        model.get_buffer("stem.1.running_mean").add_(0.5)  # training moves these too
    adapter = lora.adapter_state(model)
    assert "stem.1.running_mean" in adapter and not any(".base_layer." in k for k in adapter)
    with torch.no_grad():
        expected = model(inputs)
    merged = lora.merged(models.build(spec), base, adapter, peft)
    assert set(merged) == set(base)
    plain = models.build(spec)
    plain.load_state_dict(merged)
    with torch.no_grad():
        torch.testing.assert_close(plain.eval()(inputs), expected, rtol=1e-4, atol=1e-5)


def test_an_adapter_of_other_settings_does_not_load_saying_what_differs() -> None:
    spec = api.ModelSpec.model_validate(MODEL)
    small = lora.attach(models.build(spec), api.PeftSpec.model_validate(
        {"rank": 2, "targetModules": ["head.2"]}))
    other = lora.attach(models.build(spec), api.PeftSpec.model_validate(
        {"rank": 4, "targetModules": ["head.2"]}))
    with pytest.raises(ValueError, match="other shapes head.2.lora_A.weight"):
        lora.load_adapter(other, lora.adapter_state(small))


@pytest.mark.parametrize(("peft", "message"), [
    pytest.param({"rank": 16, "targetModules": ["head.2"]},
                 "spec.training.peft.rank: 16 is more than head.2 (at most 10) can use", id="rank"),
    pytest.param({"targetModules": ["blocks"]},
                 "spec.training.peft.targetModules: LoRA cannot wrap blocks (Sequential)",
                 id="container"),
])
def test_kiln_validate_refuses_what_lora_cannot_wrap_naming_field_and_module(
        peft: dict[str, Any], message: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    from kiln import cli

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(_doc(peft)), encoding="utf-8")
    assert cli.main(["validate", str(job)]) != cli.EXIT_OK
    err = " ".join(capsys.readouterr().err.split())
    assert message in err and "Traceback" not in err, err

"""check_job: api.validate plus the registry's checks, with api-style messages; build(spec)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kiln import api, models
from kiln.models import checks


def _job(
    architecture: str,
    *,
    args: dict[str, Any] | None = None,
    input_shape: list[int] | None = None,
    dataset: dict[str, Any] | None = None,
    training: dict[str, Any] | None = None,
) -> api.TrainingJob:
    """A job as the API types hold it, without `parse_job`'s validation (check_job's job)."""
    doc = {
        "apiVersion": "kiln.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "check"},
        "spec": {
            "model": {
                "architecture": architecture,
                "args": args or {},
                "inputShape": input_shape or [1, 8, 8],
            },
            "dataset": dataset or {"name": "digits"},
            "training": training or {},
        },
    }
    return api.TrainingJob.model_validate(doc)


def _text(path: str = "corpus.txt") -> dict[str, Any]:
    return {"name": "text", "path": path}


def _default_job(name: str, input_shape: list[int]) -> api.TrainingJob:
    if models.get_info(name).modality == models.Modality.TEXT:
        return _job(name, input_shape=[64], dataset=_text())
    return _job(name, input_shape=input_shape)


@pytest.mark.parametrize("input_shape", [[1, 8, 8], [3, 32, 32]], ids=["1x8x8", "3x32x32"])
@pytest.mark.parametrize("name", models.list_models())
def test_every_registered_model_passes_with_its_defaults(name: str, input_shape: list[int]) -> None:
    assert models.check_job(_default_job(name, input_shape)) == []


def test_unknown_architecture_lists_the_closest_names() -> None:
    expected = (
        "spec.model.architecture: unknown architecture 'resnet19'; closest: resnet18, "
        f"resnet101, resnet50 (list_models() / `kiln models` lists all {len(models.list_models())})"
    )
    assert models.check_job(_job("resnet19")) == [expected]


def test_text_model_on_an_image_dataset_is_a_modality_mismatch() -> None:
    (problem,) = models.check_job(_job("char_transformer", input_shape=[1, 8, 8]))
    assert problem.startswith(
        "spec.model.architecture: char_transformer is a text model but dataset digits gives "
        "image data; use an image model ("
    )
    assert "small_resnet" in problem


def test_image_model_on_a_text_dataset_is_a_modality_mismatch() -> None:
    expected = (
        "spec.model.architecture: resnet18 is an image model but dataset text gives text data; "
        "use a text model (char_transformer)"
    )
    assert models.check_job(_job("resnet18", input_shape=[64], dataset=_text())) == [expected]


def test_unknown_argument_gets_a_did_you_mean() -> None:
    (problem,) = models.check_job(_job("small_cnn", args={"depht": 2}))
    assert problem == (
        "spec.model.args.depht: unknown argument of small_cnn; did you mean 'depth'? "
        "(known: depth, width, num_classes)"
    )


@pytest.mark.parametrize(
    ("architecture", "args", "expected"),
    [
        pytest.param(
            "small_cnn",
            {"depth": 0},
            "spec.model.args: small_cnn rejects its args: depth must be >= 1 (got 0)",
            id="out-of-range",
        ),
        pytest.param(
            "small_resnet",
            {"width": 2.5},
            "spec.model.args: small_resnet rejects its args: width must be an integer (got 2.5)",
            id="wrong-type",
        ),
        pytest.param(
            "vit",
            {"width": 30},
            "spec.model.args: vit rejects its args: width 30 must be divisible by heads 4",
            id="cross-argument",
        ),
    ],
)
def test_builder_rejecting_args_is_reported_on_spec_model_args(
    architecture: str, args: dict[str, Any], expected: str
) -> None:
    assert models.check_job(_job(architecture, args=args)) == [expected]


def test_input_shape_the_model_cannot_take_is_reported_on_input_shape() -> None:
    (problem,) = models.check_job(_job("vit", args={"patch_size": 3}, input_shape=[1, 8, 8]))
    assert problem.startswith("spec.model.inputShape: vit needs H and W divisible by patch_size 3")


def test_too_few_classes_for_digits() -> None:
    assert models.check_job(_job("small_resnet", args={"num_classes": 5})) == [
        "spec.model.args.num_classes: dataset digits has 10 classes (got 5); set num_classes: 10"
    ]


def test_vocabulary_too_small_for_bytes() -> None:
    job = _job("char_transformer", args={"vocab_size": 128}, input_shape=[32], dataset=_text())
    expected = (
        "spec.model.args.vocab_size: text is read as bytes, so it needs 256 tokens (got 128); "
        "set vocab_size: 256"
    )
    assert models.check_job(job) == [expected]


def test_api_problems_come_first_and_registry_problems_follow() -> None:
    job = _job(
        "small_cnn", args={"depht": 2}, training={"epochs": 2, "lrSchedule": {"warmupEpochs": 2}}
    )
    problems = models.check_job(job)
    assert problems[0].startswith("spec.training.lrSchedule.warmupEpochs: must be < epochs 2")
    assert problems[1].startswith("spec.model.args.depht: unknown argument")


def test_bad_input_shape_from_api_validate_is_not_reported_twice() -> None:
    problems = models.check_job(_job("small_cnn", input_shape=[2, 8, 8]))
    assert len(problems) == 1
    assert problems[0].startswith("spec.model.inputShape: dataset digits gives images")


def test_check_job_leaves_the_global_rng_untouched() -> None:
    torch.manual_seed(0)
    state = torch.get_rng_state()
    assert models.check_job(_job("resnet18")) == []
    assert torch.equal(torch.get_rng_state(), state)


def test_build_makes_the_model_the_spec_describes() -> None:
    spec = api.ModelSpec(
        architecture="small_resnet",
        args={"blocks": [2, 1], "num_classes": 3},
        input_shape=[1, 16, 16],
    )
    model = models.build(spec)
    assert model(torch.zeros(2, 1, 16, 16)).shape == (2, 3)
    assert models.natural_blocks(model) == [
        "stem",
        "stages.0.0",
        "stages.0.1",
        "stages.1.0",
        "head",
    ]


def test_a_model_too_large_to_build_even_on_meta_names_spec_model() -> None:
    (problem,) = models.check_job(_job("small_cnn", args={"width": 10**12},
                                       input_shape=[3, 32, 32]))
    assert problem.startswith("spec.model: small_cnn cannot be built with inputShape [3, 32, 32]")
    assert "use smaller sizes" in problem


def test_a_model_with_more_than_two_billion_parameters_is_refused_with_its_count() -> None:
    (problem,) = models.check_job(_job("vit", args={"width": 1_000_000}, input_shape=[3, 32, 32]))
    assert problem.startswith("spec.model.args: vit with these args has ")
    assert "over the 2,000,000,000" in problem and "reduce its width or depth" in problem


def test_a_model_thousands_of_layers_deep_is_refused_before_it_is_built() -> None:
    # Building this on meta alone would take about a minute; the check answers at once.
    (problem,) = models.check_job(_job("small_cnn", args={"depth": 13_000}))
    assert problem == ("spec.model.args.depth: the model would have 13,000 layers; Kiln builds "
                       f"at most {checks.MAX_LAYERS}; use fewer blocks (depth)")


def test_block_lists_count_their_sum_of_layers() -> None:
    (problem,) = models.check_job(_job("small_resnet", args={"blocks": [100, 100, 100]}))
    assert problem.startswith("spec.model.args.blocks: the model would have 300 layers")


def test_a_model_over_the_module_limit_is_refused_naming_its_count(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checks, "MAX_MODULES", 100)
    (problem,) = models.check_job(_job("small_cnn", args={"depth": 40, "width": 4}))
    assert problem == ("spec.model.args: the model has 166 modules; Kiln traces at most 100; "
                       "use fewer blocks (depth)")


def test_a_forward_pass_over_the_flop_limit_is_refused_with_its_cost() -> None:
    (problem,) = models.check_job(_job("small_cnn", args={"width": 512},
                                       input_shape=[3, 16384, 16384]))
    assert problem.startswith("spec.model: one forward pass of small_cnn with inputShape "
                              "[3, 16384, 16384] costs 1.91e+15 FLOPs per sample")
    assert "use a smaller input, width or depth" in problem

"""The registry API: names, metadata, argument checks and registration rules."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from kiln import models
from kiln.models import registry


def test_list_models_is_sorted_and_every_name_has_info() -> None:
    names = models.list_models()
    assert names == sorted(names)
    for name in names:
        info = models.get_info(name)
        assert info.name == name
        assert info.modality in (models.Modality.IMAGE, models.Modality.TEXT)
        assert info.paper and info.summary


def test_info_gives_modality_task_and_builder_defaults() -> None:
    info = models.get_info("char_transformer")
    assert info.modality == models.Modality.TEXT
    assert info.task == models.Task.LANGUAGE_MODELING
    assert info.default_args["vocab_size"] == 256
    assert "input_shape" not in info.default_args
    assert models.get_info("small_resnet").default_args["num_classes"] == 10
    with pytest.raises(TypeError):
        info.default_args["vocab_size"] = 3  # type: ignore[index]


@pytest.mark.parametrize(
    ("name", "closest"),
    [
        pytest.param("resnet19", "resnet18", id="typo"),
        pytest.param("ResNet-18", "resnet18", id="case-and-dash"),
        pytest.param("small_resent", "small_resnet", id="swapped-letters"),
    ],
)
def test_unknown_architecture_names_the_closest_registered_ones(name: str, closest: str) -> None:
    with pytest.raises(models.UnknownArchitecture) as caught:
        models.get_model(name, input_shape=(1, 8, 8))
    assert closest in caught.value.closest
    assert f"unknown architecture {name!r}; closest: " in str(caught.value)
    assert isinstance(caught.value, ValueError)


def test_unknown_architecture_without_close_names_says_so() -> None:
    with pytest.raises(models.UnknownArchitecture, match="no registered name is close"):
        models.get_info("zzzzzzzzzzzz")


def test_unknown_argument_names_the_closest_known_one() -> None:
    with pytest.raises(
        TypeError, match="widht: unknown argument of small_cnn; did you mean 'width'"
    ):
        models.get_model("small_cnn", input_shape=(1, 8, 8), widht=8)


def test_input_shape_passed_as_an_argument_points_to_the_spec_field() -> None:
    assert registry.unknown_args("small_cnn", {"input_shape": [1, 8, 8]}) == [
        ("input_shape", "set it as spec.model.inputShape, not as an argument")
    ]


@pytest.mark.parametrize(
    ("name", "shape", "args", "error", "message"),
    [
        pytest.param(
            "small_cnn",
            (1, 8, 8),
            {"depth": 0},
            ValueError,
            r"depth must be >= 1 \(got 0\)",
            id="depth-zero",
        ),
        pytest.param(
            "small_cnn",
            (1, 8, 8),
            {"width": "wide"},
            TypeError,
            "width must be an integer",
            id="width-string",
        ),
        pytest.param(
            "small_cnn",
            (1, 8, 8),
            {"depth": True},
            TypeError,
            "depth must be an integer",
            id="bool-is-not-int",
        ),
        pytest.param(
            "small_resnet",
            (1, 8, 8),
            {"blocks": []},
            ValueError,
            "at least one stage",
            id="no-stages",
        ),
        pytest.param(
            "small_resnet",
            (1, 8, 8),
            {"blocks": "3"},
            TypeError,
            "blocks must be an integer or a list",
            id="blocks-string",
        ),
        pytest.param(
            "vit",
            (1, 8, 8),
            {"width": 30, "heads": 4},
            ValueError,
            "width 30 must be divisible by heads 4",
            id="heads-split-width",
        ),
        pytest.param(
            "vit",
            (1, 10, 10),
            {"patch_size": 4},
            models.IncompatibleInputShape,
            "divisible by patch_size 4",
            id="patches-tile-image",
        ),
        pytest.param(
            "vit",
            (1, 8, 8),
            {"mlp_ratio": 0},
            ValueError,
            r"mlp_ratio must be > 0.0",
            id="mlp-ratio",
        ),
        pytest.param(
            "resnet18",
            (8, 8),
            {},
            models.IncompatibleInputShape,
            r"\[C, H, W\]",
            id="image-needs-three-sizes",
        ),
        pytest.param(
            "char_transformer",
            (1, 8, 8),
            {},
            models.IncompatibleInputShape,
            r"\[sequenceLength\]",
            id="text-needs-one-size",
        ),
        pytest.param(
            "resnet18",
            (1, 8, 8),
            {"num_classes": 0},
            ValueError,
            r"num_classes must be >= 1",
            id="no-classes",
        ),
    ],
)
def test_builder_rejects_bad_arguments_naming_them(
    name: str, shape: tuple[int, ...], args: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        models.get_model(name, input_shape=shape, **args)


def test_get_model_accepts_a_list_as_input_shape() -> None:
    model = models.get_model("small_cnn", input_shape=[1, 8, 8], depth=2, width=4)
    assert model(torch.zeros(1, 1, 8, 8)).shape == (1, 10)


def test_registering_a_taken_name_fails() -> None:
    with pytest.raises(ValueError, match="already registered"):
        models.register_model(
            "small_cnn",
            family="x",
            modality=models.Modality.IMAGE,
            task=models.Task.CLASSIFICATION,
        )(lambda *, input_shape: nn.Identity())


def test_registering_a_builder_with_positional_parameters_fails() -> None:
    def builder(input_shape: tuple[int, ...]) -> nn.Module:
        return nn.Identity()

    with pytest.raises(TypeError, match="keyword-only"):
        models.register_model(
            "kiln_test_positional",
            family="x",
            modality=models.Modality.IMAGE,
            task=models.Task.CLASSIFICATION,
        )(builder)
    assert "kiln_test_positional" not in models.list_models()


def test_example_input_has_the_dtype_the_modality_needs() -> None:
    image = models.example_input("resnet18", [3, 32, 32], batch_size=4)
    text = models.example_input("char_transformer", [64], device="meta")
    assert (image.shape, image.dtype) == ((4, 3, 32, 32), torch.float32)
    assert (text.shape, text.dtype, text.device.type) == ((1, 64), torch.long, "meta")

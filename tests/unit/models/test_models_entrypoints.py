"""Models from user code: `models.build` imports and calls an entrypoint with errors naming the
field and the user's file and line; the `kiln.models` entry-point group adds registry names;
`models.check_job` checks an entrypoint's format and task without importing it."""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from kiln import api, models
from kiln.models import entrypoints, registry


@pytest.fixture
def user_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        sys.modules.pop(name, None)


def _spec(entrypoint: str, **args: object) -> api.ModelSpec:
    return api.ModelSpec(entrypoint=entrypoint, args=args, input_shape=[1, 8, 8])


def _job(model: dict[str, object], dataset: dict[str, object] | None = None) -> api.TrainingJob:
    return api.parse_job({"apiVersion": api.API_VERSION, "kind": api.KIND,
                          "metadata": {"name": "j"},
                          "spec": {"model": model, "dataset": dataset or {"name": "digits"}}})


def test_an_entrypoint_is_called_with_its_args_and_builds_the_users_module(
        user_dir: Path) -> None:
    (user_dir / "usernet.py").write_text(
        "from torch import nn\n"
        "def build(*, width, num_classes=10):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.Linear(width, num_classes))\n",
        encoding="utf-8")
    model = models.build(_spec("usernet:build", width=12))
    assert isinstance(model, nn.Sequential) and model[1].out_features == 12


@pytest.mark.parametrize(("source", "entrypoint", "expected"), [
    pytest.param(None, "nowhere.models:build", "cannot import 'nowhere.models'", id="missing"),
    pytest.param("import not_installed_dep\n", "userbad:build",
                 "userbad.py, line 1, in <module>: import not_installed_dep", id="import-error"),
    pytest.param("X = 1\n", "userbad:build", "has no attribute 'build'", id="no-attribute"),
    pytest.param("X = 1\n", "userbad:X", "is not callable (got int 1)", id="not-callable"),
    pytest.param("def build():\n    raise ValueError('no')\n", "userbad:build",
                 "raised ValueError: no (at userbad.py, line 2, in build", id="raises"),
    pytest.param("def build():\n    return 3\n", "userbad:build",
                 "returned a builtins.int, not a torch.nn.Module", id="not-a-module"),
])
def test_a_broken_entrypoint_names_the_field_and_the_users_file_and_line(
        user_dir: Path, monkeypatch: pytest.MonkeyPatch, source: str | None, entrypoint: str,
        expected: str) -> None:
    monkeypatch.chdir(user_dir)
    if source is not None:
        (user_dir / "userbad.py").write_text(source, encoding="utf-8")
    with pytest.raises(models.EntrypointError) as caught:
        models.build(_spec(entrypoint))
    assert str(caught.value).startswith("spec.model.entrypoint: ")
    assert expected in str(caught.value)


def test_a_malformed_entrypoint_is_refused_by_the_schema_naming_the_format() -> None:
    with pytest.raises(api.InvalidSpec, match=r"spec.model.entrypoint: must be "
                                              r"package.module:callable"):
        _job({"entrypoint": "mynets.mixer", "inputShape": [1, 8, 8]})
    with pytest.raises(models.EntrypointError, match="not package.module:callable"):
        entrypoints.load("mynets.mixer")


@pytest.mark.parametrize("model", [
    pytest.param({"inputShape": [1, 8, 8]}, id="neither"),
    pytest.param({"architecture": "small_cnn", "entrypoint": "a:b", "inputShape": [1, 8, 8]},
                 id="both"),
])
def test_exactly_one_of_architecture_and_entrypoint(model: dict[str, object]) -> None:
    with pytest.raises(api.InvalidSpec, match="spec.model: set exactly one of architecture"):
        _job(model)


def test_check_job_never_imports_an_entrypoint_but_checks_its_task_against_the_data(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("check_job imported user code")

    monkeypatch.setattr(importlib, "import_module", refuse)
    assert models.check_job(_job({"entrypoint": "not_importable_here:build",
                                  "inputShape": [1, 8, 8]})) == []
    problems = models.check_job(_job({"entrypoint": "x:lm", "task": "language_model",
                                      "inputShape": [1, 8, 8]}))
    assert problems and problems[0].startswith("spec.model.task: dataset digits")


def test_a_registry_models_task_must_be_its_own() -> None:
    problems = models.check_job(_job({"architecture": "small_cnn", "task": "language_model",
                                      "inputShape": [1, 8, 8]}))
    assert problems == [("spec.model.task: small_cnn is a classification model (got "
                         "language_model); remove task or set it to classification")]


def test_task_and_modality_of_an_entrypoint_follow_task_and_input_shape() -> None:
    image = _spec("a:b")
    text = api.ModelSpec(entrypoint="a:b", task=api.ModelTask.LANGUAGE_MODEL, input_shape=[16])
    assert (models.task_of(image), models.modality_of(image)) == (
        models.Task.CLASSIFICATION, models.Modality.IMAGE)
    assert (models.task_of(text), models.modality_of(text)) == (
        models.Task.LANGUAGE_MODELING, models.Modality.TEXT)
    assert models.example_batch(text, batch_size=2).dtype.is_floating_point is False


def test_the_kiln_models_entry_point_group_adds_registry_names(user_dir: Path) -> None:
    (user_dir / "plugin_nets.py").write_text(
        "from torch import nn\n"
        "def tiny(*, input_shape, num_classes=10):\n"
        "    c, h, w = input_shape\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, num_classes))\n"
        "def broken(*, input_shape):\n"
        "    return None\n", encoding="utf-8")
    found = [importlib.metadata.EntryPoint("plugin_tiny", "plugin_nets:tiny", "kiln.models"),
             importlib.metadata.EntryPoint("plugin_gone", "plugin_missing:x", "kiln.models")]
    try:
        assert registry.load_entry_points(found) == ["plugin_tiny"]
        assert "plugin_tiny" in models.list_models()
        assert models.check_job(_job({"architecture": "plugin_tiny",
                                      "inputShape": [1, 8, 8]})) == []
        model = models.build(api.ModelSpec(architecture="plugin_tiny", input_shape=[1, 8, 8]))
        assert isinstance(model, nn.Sequential) and model[1].in_features == 64
        with pytest.raises(models.UnknownArchitecture, match="plugin_gone = plugin_missing:x "
                                                             "failed to load"):
            models.get_info("plugin_gone")
    finally:
        registry._REGISTRY.pop("plugin_tiny", None)
        registry._PLUGIN_ERRORS.pop("plugin_gone", None)


class _Tokens(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(x.shape[0], x.shape[-1], 5)


class _Broken(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")


@pytest.mark.parametrize(("model", "sample", "language_model", "expected"), [
    pytest.param(_Tokens(), torch.zeros(1, 8, 8), False, "a classification model returns "
                 "logits Tensor[B, K] (got shape [1, 8, 5]", id="classifier-gives-3d"),
    pytest.param(nn.Flatten(), torch.zeros(16, dtype=torch.long), True,
                 "a language_model returns next-token logits", id="lm-gives-2d"),
    pytest.param(_Broken(), torch.zeros(1, 8, 8), False,
                 "raised RuntimeError: mat1 and mat2 shapes cannot be multiplied (at "
                 "test_models_entrypoints.py", id="forward-raises"),
])
def test_a_user_models_forward_is_checked_against_its_task(
        model: nn.Module, sample: torch.Tensor, language_model: bool, expected: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(Path(__file__).parent)
    with pytest.raises(models.EntrypointError) as caught:
        entrypoints.check_forward(model, sample, entrypoint="u:m", language_model=language_model)
    assert expected in str(caught.value)
    assert model.training  # left as found

"""The user's dataset entrypoint and separate validation sets (`kiln_trainer.data`): what comes
back is checked before training, and every bad return names spec.dataset.entrypoint and, when
the user's code raised, its file and line. Through the trainer's CLI: tests/integration."""

from __future__ import annotations

import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln import api
from kiln_trainer import data, runtime

SHAPES = Path(__file__).resolve().parents[2] / "data" / "shapes"
CORPUS = Path(__file__).resolve().parents[2] / "data" / "corpus"

USER_MODULE = '''\
import torch
from torch.utils.data import Dataset, TensorDataset


def good(n=24, classes=3, size=8, label_offset=0):
    x = torch.randn(n, 1, size, size, dtype=torch.float64)
    y = torch.arange(n) % classes + label_offset
    return TensorDataset(x[: n - 6], y[: n - 6]), TensorDataset(x[n - 6:], y[n - 6:])


def raises():
    return load_from_disk("/nowhere")  # NameError in the user's code


def one():
    return good()[0]


def not_datasets():
    return good()[0], "validation"


def empty():
    return TensorDataset(torch.zeros(0, 1, 8, 8), torch.zeros(0)), good()[1]


class Pictures(Dataset):
    def __init__(self, kind):
        self.kind = kind

    def __len__(self):
        return 12

    def __getitem__(self, index):
        if self.kind == "string":
            return "a picture", 1
        if self.kind == "triple":
            return torch.zeros(1, 8, 8), 1, "extra"
        if self.kind == "float-label":
            return torch.zeros(1, 8, 8), 0.5
        if self.kind == "negative":
            return torch.zeros(1, 8, 8), -1
        if self.kind == "numpy":
            import numpy as np
            return np.zeros((1, 8, 8)), np.int64(index % 2)
        if self.kind == "late" and index >= 10:
            raise KeyError(f"sample {index} is missing")
        return torch.zeros(1, 8, 8), index % 2


def pictures(kind):
    return Pictures(kind), Pictures(kind)


def tokens(dtype="long"):
    x = torch.randint(0, 50, (20, 17))
    if dtype == "float":
        x = x.float()
    return TensorDataset(x[:16, :-1], x[:16, 1:]), TensorDataset(x[16:, :-1], x[16:, 1:])
'''


def _line(text: str) -> int:
    """The line of USER_MODULE holding `text` (1-based)."""
    return next(i for i, line in enumerate(USER_MODULE.splitlines(), 1) if text in line)


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A user's dataset module, importable under a fresh name."""
    name = f"userdata_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(USER_MODULE, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def _load(entrypoint: str, args: dict[str, Any] | None = None, *, shape: list[int] | None = None,
          model_args: dict[str, Any] | None = None, task: str | None = None) -> data.Splits:
    shape = shape or [1, 8, 8]
    model = api.ModelSpec(architecture="small_cnn", input_shape=shape, args=model_args or {},
                          task=api.ModelTask(task) if task else None)
    spec = api.DatasetSpec(entrypoint=entrypoint, args=args or {})
    return data.load(spec, input_shape=shape, seed=0, model=model)


def _error(entrypoint: str, args: dict[str, Any] | None = None, **kwargs: Any) -> str:
    with pytest.raises(data.DatasetError) as caught:
        splits = _load(entrypoint, args, **kwargs)
        for dataset in (splits.train, splits.validation):
            for i in range(len(dataset)):  # type: ignore[arg-type]
                dataset[i]
    message = str(caught.value)
    assert message.startswith("spec.dataset.entrypoint: "), message
    return message


def test_an_entrypoint_dataset_trains_as_returned(user_module: str) -> None:
    splits = _load(f"{user_module}:good", {"n": 30, "classes": 3})
    assert (len(splits.train), len(splits.validation)) == (24, 6)  # type: ignore[arg-type]
    image, label = splits.train[0]
    assert image.dtype == torch.float32 and image.shape == (1, 8, 8)  # float64 made float32
    assert label == 0 and isinstance(label, int)
    assert splits.max_target == 2 and splits.description == f"entrypoint:{user_module}:good"


def test_numpy_samples_become_tensors(user_module: str) -> None:
    splits = _load(f"{user_module}:pictures", {"kind": "numpy"})
    image, label = splits.train[3]
    assert isinstance(image, torch.Tensor) and image.dtype == torch.float32 and label == 1


def test_language_model_samples_are_token_id_sequences(user_module: str) -> None:
    splits = _load(f"{user_module}:tokens", shape=[16], task="language_model")
    inputs, target = splits.train[0]
    assert inputs.dtype == torch.long and isinstance(target, torch.Tensor)
    assert target.shape == (16,) and splits.modality == "text"
    message = _error(f"{user_module}:tokens", {"dtype": "float"}, shape=[16],
                     task="language_model")
    assert "torch.float32, but a language model takes integer token ids" in message


@pytest.mark.parametrize(("entrypoint", "args", "expected"), [
    pytest.param("nowhere_pkg.data:load", {}, "cannot import 'nowhere_pkg.data'", id="missing"),
    pytest.param("{m}:nothing", {}, "has no attribute 'nothing'", id="no-attribute"),
    pytest.param("{m}:one", {}, "returned a torch.utils.data.dataset.TensorDataset; return "
                 "(train, validation)", id="one-dataset"),
    pytest.param("{m}:not_datasets", {}, "the validation split {m}:not_datasets returned is a "
                 "builtins.str, not a map-style Dataset", id="not-a-dataset"),
    pytest.param("{m}:empty", {}, "the train split of {m}:empty is empty", id="empty"),
    pytest.param("{m}:good", {"size": 6}, "the input has shape [1, 6, 6] but "
                 "spec.model.inputShape is [1, 8, 8]", id="wrong-shape"),
    pytest.param("{m}:pictures", {"kind": "string"}, "the input is a builtins.str, not a tensor",
                 id="not-a-tensor"),
    pytest.param("{m}:pictures", {"kind": "triple"}, "is a tuple of 3, not an (input, target) "
                 "pair", id="not-a-pair"),
    pytest.param("{m}:pictures", {"kind": "float-label"}, "the target is 0.5, not an integer "
                 "class label", id="float-label"),
    pytest.param("{m}:pictures", {"kind": "negative"}, "a target is -1; classes and token ids "
                 "start at 0", id="negative-label"),
])
def test_bad_returns_name_the_entrypoint_and_the_fix(
    user_module: str, entrypoint: str, args: dict[str, Any], expected: str
) -> None:
    message = _error(entrypoint.format(m=user_module), args)
    assert expected.format(m=user_module) in message, message


def test_a_raising_entrypoint_names_the_users_file_and_line(user_module: str) -> None:
    message = _error(f"{user_module}:raises")
    assert "raised NameError: name 'load_from_disk' is not defined" in message
    assert f"{user_module}.py, line {_line('load_from_disk')}, in raises: return " in message


def test_a_sample_raising_later_names_its_index_file_and_line(user_module: str) -> None:
    message = _error(f"{user_module}:pictures", {"kind": "late"})
    assert f"train[10] of {user_module}:pictures raised KeyError" in message
    assert f"{user_module}.py, line {_line('raise KeyError')}, in __getitem__" in message
    assert "data.py" not in message  # the tail is the user's code alone


def test_labels_beyond_num_classes_are_refused_naming_where_the_count_came_from(
    user_module: str,
) -> None:
    message = _error(f"{user_module}:good", {"classes": 5}, model_args={"num_classes": 3})
    assert "a target is 3, out of range for 3 classes (spec.model.args.num_classes)" in message


def test_labels_beyond_the_models_outputs_are_refused_before_training(user_module: str) -> None:
    splits = _load(f"{user_module}:good", {"label_offset": 9})  # classes 9..11
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    with pytest.raises(data.DatasetError, match=r"a target among the first samples is 11, out "
                       r"of range for the model's 10 outputs \(counted from the model's output\)"):
        runtime.check_outputs(model, splits, torch.device("cpu"))


def test_later_labels_are_checked_against_the_models_outputs(user_module: str) -> None:
    splits = _load(f"{user_module}:good", {"n": 58, "classes": 12})  # first samples: 0..9
    data.check_targets(splits, 10)
    with pytest.raises(data.DatasetError, match=r"a target is 10, out of range for 10 classes "
                       r"\(the model's outputs\)"):
        for i in range(len(splits.train)):  # type: ignore[arg-type]
            splits.train[i]


def test_a_separate_image_validation_set_is_used_whole() -> None:
    spec = api.DatasetSpec(name=api.DatasetName.IMAGEFOLDER, path=str(SHAPES / "train"),
                           validation_path=str(SHAPES / "validation"))
    splits = data.load(spec, input_shape=[1, 12, 12], seed=0)
    assert (len(splits.train), len(splits.validation)) == (15, 6)  # type: ignore[arg-type]
    assert splits.num_classes == 3 and splits.validation[0][0].shape == (1, 12, 12)
    capped = spec.model_copy(update={"max_samples": 4})
    splits = data.load(capped, input_shape=[1, 12, 12], seed=0)
    assert (len(splits.train), len(splits.validation)) == (4, 4)  # type: ignore[arg-type]


def test_validation_classes_must_match_the_training_classes(tmp_path: Path) -> None:
    (tmp_path / "circle").symlink_to(SHAPES / "validation" / "circle")
    spec = api.DatasetSpec(name=api.DatasetName.IMAGEFOLDER, path=str(SHAPES / "train"),
                           validation_path=str(tmp_path))
    with pytest.raises(data.DatasetError, match=r"spec.dataset.validationPath: its class folders "
                       r"\(circle\) differ from spec.dataset.path's \(circle, cross, square\)"):
        data.load(spec, input_shape=[1, 12, 12], seed=0)


def test_a_separate_text_validation_set(tmp_path: Path) -> None:
    spec = api.DatasetSpec(name=api.DatasetName.TEXT, path=str(CORPUS / "kilns.txt"),
                           validation_path=str(CORPUS / "firing.txt"))
    splits = data.load(spec, input_shape=[31], seed=0)
    assert (len(splits.train), len(splits.validation)) == (1253 // 32, 852 // 32)  # type: ignore[arg-type]
    short = tmp_path / "short.txt"
    short.write_text(textwrap.dedent("too short"), encoding="utf-8")
    with pytest.raises(data.DatasetError, match="spec.dataset.validationPath: .* too short"):
        data.load(spec.model_copy(update={"validation_path": str(short)}), input_shape=[31],
                  seed=0)

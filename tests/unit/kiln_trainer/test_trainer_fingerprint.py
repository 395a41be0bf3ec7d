"""Dataset fingerprints from what the trainer loaded (`kiln_trainer.fingerprint`, `data.load`):
content, not the spec, so data changed behind one path, or moved to another, is told apart or
recognised; and how the warm-start reason compares the parent's data with the child's."""

from __future__ import annotations

import importlib
import random
import shutil
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from kiln import api
from kiln.zoo import records
from kiln_trainer import data, fingerprint, warm

SHAPES = Path(__file__).resolve().parents[2] / "data" / "shapes"
CORPUS = Path(__file__).resolve().parents[2] / "data" / "corpus"


def _images(path: str, **fields: object) -> api.DatasetSpec:
    return api.DatasetSpec.model_validate({"name": "imagefolder", "path": path, **fields})


def _loaded(spec: api.DatasetSpec, shape: list[int] | None = None) -> str:
    splits = data.load(spec, input_shape=shape or [1, 12, 12], seed=0)
    assert splits.fingerprint is not None
    return splits.fingerprint


def test_one_spec_over_different_folders_gives_different_fingerprints(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The same relative path in two working directories: one spec (and one spec fingerprint,
    # all admission sees), two datasets.
    shutil.copytree(SHAPES / "train", tmp_path / "a" / "data")
    shutil.copytree(SHAPES / "validation", tmp_path / "b" / "data")
    spec = _images("data")
    monkeypatch.chdir(tmp_path / "a")
    first = _loaded(spec)
    monkeypatch.chdir(tmp_path / "b")
    second = _loaded(spec)
    assert first.startswith(fingerprint.CONTENT) and second.startswith(fingerprint.CONTENT)
    assert first != second


def test_the_same_files_under_another_path_give_the_same_fingerprint(tmp_path: Path) -> None:
    moved = shutil.copytree(SHAPES, tmp_path / "elsewhere" / "shapes")
    here = _images(str(SHAPES / "train"), validationPath=str(SHAPES / "validation"))
    there = _images(str(moved / "train"), validationPath=str(moved / "validation"))
    assert _loaded(here) == _loaded(there)
    assert records.dataset_fingerprint(here) != records.dataset_fingerprint(there)
    # ...and the validation folder counts: without it the data is another.
    assert _loaded(_images(str(moved / "train"))) != _loaded(there)


def test_a_file_changed_in_place_changes_the_fingerprint(tmp_path: Path) -> None:
    folder = shutil.copytree(SHAPES / "train", tmp_path / "shapes")
    spec = _images(str(folder))
    before = _loaded(spec)
    circle, cross = (min((folder / name).iterdir()) for name in ("circle", "cross"))
    circle.write_bytes(cross.read_bytes())  # a mislabelled image: same names, same count
    after = _loaded(spec)
    assert after != before
    (folder / ".DS_Store").write_bytes(b"finder junk")  # hidden: not data
    assert _loaded(spec) == after


def test_hidden_images_and_class_folders_are_neither_loaded_nor_fingerprinted(
        tmp_path: Path) -> None:
    folder = shutil.copytree(SHAPES / "train", tmp_path / "shapes")
    spec = _images(str(folder))
    before = data.load(spec, input_shape=[1, 12, 12], seed=0)
    image = min((folder / "circle").iterdir())
    shutil.copy(image, folder / "circle" / ".hidden.png")
    (folder / ".trash").mkdir()
    shutil.copy(image, folder / ".trash" / "old.png")
    after = data.load(spec, input_shape=[1, 12, 12], seed=0)
    assert (after.num_classes, len(after.train) + len(after.validation)) == (  # type: ignore[arg-type]
        before.num_classes, len(before.train) + len(before.validation))  # type: ignore[arg-type]
    assert after.fingerprint == before.fingerprint


def test_a_text_folder_is_fingerprinted_by_its_files_not_its_byte_cache(tmp_path: Path) -> None:
    corpus = shutil.copytree(CORPUS, tmp_path / "corpus")
    spec = api.DatasetSpec(name=api.DatasetName.TEXT, path=str(corpus))
    before = _loaded(spec, [31])
    (corpus / "__pycache__").mkdir()
    (corpus / "__pycache__" / "kilns.cpython-311.pyc").write_bytes(b"\0compiled")
    assert _loaded(spec, [15]) == before  # nor does the model's input length count
    with (corpus / "kilns.txt").open("a", encoding="utf-8") as text:
        text.write("One more line.\n")
    assert _loaded(spec, [31]) != before


def test_digits_fingerprint_the_bundled_arrays_the_same_every_run() -> None:
    first = _loaded(api.DatasetSpec(name=api.DatasetName.DIGITS), [1, 8, 8])
    again = _loaded(api.DatasetSpec(name=api.DatasetName.DIGITS, validationFraction=0.3),
                    [3, 16, 16])
    assert first == again and first.startswith(fingerprint.CONTENT)
    assert len(first) == len(fingerprint.CONTENT) + 64


def test_a_fingerprint_the_job_sets_is_used_as_given() -> None:
    spec = _images(str(SHAPES / "train"), fingerprint="shapes-v2")
    assert _loaded(spec) == "user:shapes-v2"


USER_MODULE = '''\
import random

import numpy as np
import torch
from torch.utils.data import Dataset


class Noisy(Dataset):
    """Samples drawn from every global generator a user's transform might use."""

    def __init__(self, n, shift):
        self.n, self.shift = n, shift

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        image = torch.full((1, 8, 8), float(index + self.shift)) + torch.randn(1, 8, 8)
        image += float(np.random.rand()) + random.random()
        return image, index % 3


def noisy(n=300, shift=0):
    return Noisy(n, shift), Noisy(20, shift)
'''


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"fingerprinted_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(USER_MODULE, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def _entrypoint(module: str, **args: object) -> str:
    spec = api.DatasetSpec.model_validate({"entrypoint": f"{module}:noisy", "args": args})
    return _loaded(spec, [1, 8, 8])


def test_an_entrypoint_dataset_gets_a_sample_fingerprint_that_random_draws_do_not_move(
        user_module: str) -> None:
    torch.manual_seed(1)
    first = _entrypoint(user_module)
    torch.manual_seed(2)  # another run's generator state: the same fingerprint
    random.seed(2)
    np.random.seed(2)
    assert _entrypoint(user_module) == first and first.startswith(fingerprint.SAMPLE)
    assert _entrypoint(user_module, shift=1) != first  # other samples
    assert _entrypoint(user_module, n=301) != first  # same first samples, another length


def test_a_sample_fingerprint_leaves_the_global_generators_as_they_were(
        user_module: str) -> None:
    train, validation = importlib.import_module(user_module).noisy()
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    states = torch.random.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
    fingerprint.of_samples(train, validation)
    assert torch.equal(torch.random.get_rng_state(), states[0])  # the run's streams untouched
    assert random.getstate() == states[1]
    assert np.array_equal(np.random.get_state()[1], states[2])


def test_an_entrypoint_dataset_with_its_own_fingerprint_is_not_read_for_one(
        user_module: str) -> None:
    spec = api.DatasetSpec.model_validate({"entrypoint": f"{user_module}:noisy",
                                           "fingerprint": "noisy-2024-05"})
    assert _loaded(spec, [1, 8, 8]) == "user:noisy-2024-05"


# ----------------------------------------------------------------------------------------------
# the warm-start reason

CONTENT_A = fingerprint.CONTENT + "a" * 64
CONTENT_B = fingerprint.CONTENT + "b" * 64


@pytest.mark.parametrize(("parent", "child", "said"), [
    pytest.param(CONTENT_A, CONTENT_A, "same data as the parent (content:sha256:aaaaaaaaaaaa…)",
                 id="same"),
    pytest.param(CONTENT_A, CONTENT_B, "other data than the parent's (parent "
                 "content:sha256:aaaaaaaaaaaa…, this job content:sha256:bbbbbbbbbbbb…)",
                 id="other"),
    pytest.param("user:v3", "user:v3", "same data as the parent (user:v3)", id="same-user"),
    pytest.param("spec:0123456789abcdef", CONTENT_A, "data not comparable with the parent's "
                 "(parent spec:0123456789abcdef, this job content:sha256:aaaaaaaaaaaa…)",
                 id="old-parent"),
    pytest.param(None, CONTENT_A, "the parent's data is unknown (this job "
                 "content:sha256:aaaaaaaaaaaa…)", id="imported-parent"),
    pytest.param(CONTENT_A, None, "", id="child-unknown"),
])
def test_the_reason_says_whether_the_parent_saw_the_same_data(
        parent: str | None, child: str | None, said: str) -> None:
    assert warm.data_note(parent, child) == said

